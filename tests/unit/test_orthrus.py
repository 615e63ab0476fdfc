"""The block view (custom masks over the AR cache) and the Orthrus model: loading the
published layout, the diffusion view, building from a base Qwen3, saving, clear errors.

The block view is checked against a hand-written one-layer forward (Qwen3 and Ministral3,
the latter past its llama-4 scaling threshold), against the model's own causal forward, and,
for training, against per-block inference: the Orthrus dual-pass mask over several blocks
in one call gives the same logits as drafting each block on its own cache.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from diffspec.assets import SYNTH_QWEN3_DIR
from diffspec.cli import main
from diffspec.core.checkpoint import CheckpointError, inspect_checkpoint, validate_block_size
from diffspec.core.masks import orthrus_dual_pass_mask
from diffspec.model_executors.reference.orthrus import (
    DIFF_MODULES,
    load_orthrus,
    orthrus_from_base,
    save_orthrus,
)
from diffspec.model_executors.reference.views import block_view_logits
from diffspec.spec_workers.reference.decoder import BlockDrafter, Request, speculative_generate
from diffspec.testing.checkpoints import write_orthrus, write_qwen3
from tests.unit.kv import prefilled_cache


def _tiny(arch: str) -> torch.nn.Module:
    """A one-layer model built in code; Ministral3 uses YaRN + llama-4 query scaling with a
    small original context (8), so the block positions used below (>= 8) are scaled."""
    from transformers import (
        Ministral3Config,
        Ministral3ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    sizes = dict(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 max_position_embeddings=256, tie_word_embeddings=False)
    torch.manual_seed(0)
    if arch == "qwen3":
        return Qwen3ForCausalLM(Qwen3Config(**sizes, initializer_range=0.2)).eval()
    rope = {"rope_type": "yarn", "rope_theta": 1e6, "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
            "original_max_position_embeddings": 8, "llama_4_scaling_beta": 0.1}
    config = Ministral3Config(**sizes, rope_parameters=rope, initializer_range=0.2)
    return Ministral3ForCausalLM(config).eval()


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def _hand_written_logits(model, ids: Tensor, positions: Tensor, cache,
                         mask: Tensor) -> Tensor:  # [n, vocab]
    """One decoder layer by hand: attention of the block's queries over [cache K/V, block
    K/V] under ``mask`` (True = attend), with the model's own weights."""
    inner, layer = model.model, model.model.layers[0]
    attn, cfg = layer.self_attn, model.config
    heads, kv_heads, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    n = ids.shape[0]
    h = inner.embed_tokens(ids)  # [n, hidden]
    x = layer.input_layernorm(h)
    q = attn.q_proj(x).view(n, heads, d)
    k = attn.k_proj(x).view(n, kv_heads, d)
    v = attn.v_proj(x).view(n, kv_heads, d)
    if hasattr(attn, "q_norm"):  # Qwen3
        q, k = attn.q_norm(q), attn.k_norm(k)
    cos, sin = (t[0][:, None, :] for t in inner.rotary_emb(h[None], positions[None]))  # [n,1,d]
    q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
    rope = cfg.rope_parameters
    if "llama_4_scaling_beta" in rope:  # Ministral3's position-dependent query scaling
        scale = 1 + rope["llama_4_scaling_beta"] * torch.log(
            1 + torch.floor(positions / rope["original_max_position_embeddings"]))
        q = q * scale[:, None, None]
    keys = torch.cat([cache.layers[0].keys[0].transpose(0, 1), k])  # [kv_len, kv_heads, d]
    values = torch.cat([cache.layers[0].values[0].transpose(0, 1), v])
    keys = keys.repeat_interleave(heads // kv_heads, dim=1)
    values = values.repeat_interleave(heads // kv_heads, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, keys) * d**-0.5
    weights = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.einsum("hqk,khd->qhd", weights, values).reshape(n, heads * d)
    h = h + attn.o_proj(out)
    h = h + layer.mlp(layer.post_attention_layernorm(h))
    return model.lm_head(inner.norm(h))


# ------------------------------------------------------------------------- block view


@pytest.mark.parametrize("arch", ["qwen3", "ministral3"])
def test_block_view_matches_hand_written_attention(arch):
    model = _tiny(arch)
    prefix = [5, 9, 2, 30, 41, 7, 11, 3, 19]
    cache = prefilled_cache(model, prefix)
    ids = torch.tensor([12, 60, 60, 60, 33])
    positions = torch.tensor([9, 10, 12, 11, 13])  # any order: each token its own position
    generator = torch.Generator().manual_seed(1)
    mask = torch.rand(5, 9 + 5, generator=generator) < 0.5
    mask[:, 9:] |= torch.eye(5, dtype=torch.bool)  # every row sees itself
    with torch.no_grad():
        got = block_view_logits(model, ids, positions, cache, mask)
        want = _hand_written_logits(model, ids, positions, cache, mask)
        full = _hand_written_logits(model, ids, positions, cache, torch.ones_like(mask))
    assert cache.get_seq_length() == len(prefix)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=1e-5)
    assert (want - full).abs().max() > 1e-2  # the mask really changes the result


@pytest.mark.parametrize("arch", ["qwen3", "ministral3"])
def test_causal_mask_equals_the_models_causal_forward(arch):
    model = _tiny(arch)
    prefix, block = [5, 9, 2, 30], [12, 40, 41, 42]
    cache = prefilled_cache(model, prefix)
    mask = torch.cat([torch.ones(4, 4, dtype=torch.bool), torch.ones(4, 4, dtype=torch.bool).tril()], dim=1)
    positions = torch.arange(4, 8)
    with torch.no_grad():
        causal = block_view_logits(model, torch.tensor(block), positions, cache, mask)
        bidirectional = block_view_logits(model, torch.tensor(block), positions, cache)
        reference = model(input_ids=torch.tensor([block]), position_ids=positions[None],
                          past_key_values=cache, use_cache=True).logits[0]
    torch.testing.assert_close(causal, reference, atol=1e-6, rtol=1e-6)
    assert (causal[:-1] - bidirectional[:-1]).abs().max() > 1e-2  # earlier rows see later ones
    torch.testing.assert_close(causal[-1], bidirectional[-1], atol=1e-5, rtol=1e-5)


def test_no_cache_runs_the_block_alone():
    """``cache=None`` (training without a prefix): keys are the block only."""
    model = _tiny("qwen3")
    ids = torch.tensor([5, 9, 2, 30, 41])
    with torch.no_grad():
        got = block_view_logits(model, ids, torch.arange(5), None, torch.ones(5, 5, dtype=torch.bool).tril())
        want = model(input_ids=ids[None]).logits[0]
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("keep_kv", [False, True])
def test_cache_length_moves_back_unless_keep_kv(keep_kv):
    model = _tiny("qwen3")
    cache = prefilled_cache(model, [5, 9, 2])
    prefix_keys = cache.layers[0].keys.clone()
    with torch.no_grad():
        block_view_logits(model, torch.tensor([1, 2]), torch.tensor([3, 4]), cache,
                          keep_kv=keep_kv)
    assert cache.get_seq_length() == (5 if keep_kv else 3)
    assert torch.equal(cache.layers[0].keys[:, :, :3], prefix_keys)


def test_block_view_rejects_a_mask_of_the_wrong_shape():
    model = _tiny("qwen3")
    cache = prefilled_cache(model, [5, 9, 2])
    with pytest.raises(ValueError, match=r"\[n, cache_len \+ n\]"):
        block_view_logits(model, torch.tensor([1, 2]), torch.tensor([3, 4]), cache,
                          torch.ones(2, 2, dtype=torch.bool))


# ------------------------------------------------------------------ Orthrus: loading


@pytest.fixture(scope="module")
def qwen3_path(tmp_path_factory):
    return write_qwen3(tmp_path_factory.mktemp("qwen3") / "base")


LAYOUTS = {  # name: write_orthrus kwargs
    f"{mt}_{arch}_{'list' if as_list else 'int'}": dict(
        model_type=mt, architecture=arch, eos_as_list=as_list)
    for mt in ("qwen3", "orthrus")
    for arch in ("OrthrusLM", "OrthrusForCausalLM")
    for as_list in (False, True)
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_load_published_layouts(layout, qwen3_path, tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_orthrus(tmp_path / layout, diff_noise=0.05, **LAYOUTS[layout])
    model = load_orthrus(path)
    base = AutoModelForCausalLM.from_pretrained(str(qwen3_path), dtype=torch.float32).eval()
    ids = torch.tensor([[10, 11, 12, 13, 14, 15, 16]])
    with torch.no_grad():
        assert torch.equal(model.lm(ids).logits, base(ids).logits)  # AR view bit for bit
    saved = load_file(str(path / "model.safetensors"))
    state = model.lm.state_dict()
    diff = [k for k in saved if "_diff." in k]
    assert len(diff) == 6 * model.config.num_hidden_layers
    assert all(torch.equal(state[k], saved[k]) for k in diff)
    config = json.loads((path / "config.json").read_text())
    eos = config["eos_token_id"]
    assert set(model.eos_token_ids) >= set(eos if isinstance(eos, list) else [eos])
    assert (model.block_size, model.mask_token_id) == (config["block_size"],
                                                       config["mask_token_id"])


def test_diffusion_view_swaps_attention_and_restores(tmp_path):
    model = load_orthrus(write_orthrus(tmp_path / "o", diff_noise=0.05))
    attn = model.lm.model.layers[0].self_attn
    ar_modules = {name: getattr(attn, name) for name in DIFF_MODULES}
    with model.diffusion_view():
        assert all(getattr(attn, n) is getattr(attn, f"{n}_diff") for n in DIFF_MODULES)
        with pytest.raises(RuntimeError, match="does not nest"), model.diffusion_view():
            pass
    assert all(getattr(attn, n) is m for n, m in ar_modules.items())
    with pytest.raises(KeyError), model.diffusion_view():
        raise KeyError("boom")
    assert all(getattr(attn, n) is m for n, m in ar_modules.items())


def test_diffusion_view_uses_the_diff_weights(tmp_path):
    """Same block, same cache, same causal mask: the diffusion view differs from the AR view
    with trained-looking (perturbed) diff weights, and equals it with exact copies."""
    perturbed = load_orthrus(write_orthrus(tmp_path / "o", diff_noise=0.05))
    copies = orthrus_from_base(write_qwen3(tmp_path / "q"), mask_token_id=7)
    block, positions = torch.tensor([12, 40, 41]), torch.arange(3, 6)
    mask = torch.cat([torch.ones(3, 3, dtype=torch.bool), torch.ones(3, 3, dtype=torch.bool).tril()], dim=1)
    for model, same in ((perturbed, False), (copies, True)):
        cache = prefilled_cache(model.lm, [5, 9, 2])
        with torch.no_grad():
            ar = block_view_logits(model.lm, block, positions, cache, mask)
            diffusion = model.diffusion_logits(block, positions, cache, mask)
        assert torch.equal(ar, diffusion) == same


def test_dual_pass_training_mask_equals_per_block_drafting(tmp_path):
    """Training: the clean sequence's AR cache plus several noisy blocks in one call under the
    Orthrus dual-pass mask gives each block's inference draft logits; gradients reach only
    through the diff weights when the AR weights are frozen."""
    model = load_orthrus(write_orthrus(tmp_path / "o", diff_noise=0.05))
    clean = [20 + 3 * i for i in range(12)]
    anchors, k, length = [0, 3, 7], 4, 12
    mask, position_ids = orthrus_dual_pass_mask(length, anchors, k)
    blocks = torch.tensor([t for a in anchors for t in [clean[a]] + [model.mask_token_id] * 3])
    cache = prefilled_cache(model.lm, clean)  # the AR pass over the clean sequence
    for p in model.lm.parameters():
        p.requires_grad_(False)
    for p in model.diffusion_parameters():
        p.requires_grad_(True)
    together = model.diffusion_logits(blocks, position_ids[length:], cache, mask[length:])
    assert cache.get_seq_length() == length
    with torch.no_grad():
        for b, a in enumerate(anchors):
            alone = model.draft_logits(clean[a], prefilled_cache(model.lm, clean[:a]), k - 1)
            torch.testing.assert_close(together[b * k : b * k + k - 1], alone,
                                       atol=2e-5, rtol=1e-5)
    together.logsumexp(-1).sum().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0
               for p in model.diffusion_parameters())


# ---------------------------------------------------------- from base, save, round trip


def test_orthrus_from_base_copies_the_ar_projections():
    model = orthrus_from_base(SYNTH_QWEN3_DIR, block_size=16)
    assert model.mask_token_id == 3 and model.eos_token_ids == (0, 2)
    params = model.diffusion_parameters()
    assert len(params) == 6 * model.config.num_hidden_layers
    attn = model.lm.model.layers[1].self_attn
    for name in DIFF_MODULES:
        ar, diff = getattr(attn, name).weight, getattr(attn, f"{name}_diff").weight
        assert torch.equal(ar, diff) and ar.data_ptr() != diff.data_ptr()


@pytest.mark.parametrize("architecture,model_type", [("OrthrusLM", "qwen3"),
                                                     ("OrthrusForCausalLM", "orthrus")])
def test_save_then_load_round_trip(architecture, model_type, tmp_path):
    model = orthrus_from_base(SYNTH_QWEN3_DIR, block_size=8)
    with torch.no_grad():
        for p in model.diffusion_parameters():
            p.add_(0.01)
    path = save_orthrus(model, tmp_path / "saved", architecture=architecture,
                        model_type=model_type)
    info = inspect_checkpoint(path)
    assert (info.family, info.architecture, info.model_type) == ("orthrus", architecture,
                                                                 model_type)
    assert (info.block_size, info.mask_token_id) == (8, 3)
    assert (path / "tokenizer.json").is_file()
    loaded = load_orthrus(path)
    original = model.lm.state_dict()
    assert all(torch.equal(v, original[k]) for k, v in loaded.lm.state_dict().items())


# ------------------------------------------------------------------------ clear errors


def _drop_one_diff_tensor(path):
    tensors = load_file(str(path / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_norm_diff.weight"]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


ERRORS = {  # name: (make checkpoint, expected message)
    "base_qwen3_as_orthrus": (lambda p: write_qwen3(p), "no diffusion weights"),
    "one_diff_tensor_missing": (lambda p: _drop_one_diff_tensor(write_orthrus(p)),
                                "lacks 1 Orthrus diffusion weights"),
    "no_mask_token_id": (lambda p: write_orthrus(p, mask_token_id=None), "no mask_token_id"),
    "no_block_size": (lambda p: write_orthrus(p, block_size=None), "no block_size"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_load_errors_name_what_is_missing(name, tmp_path):
    make, message = ERRORS[name]
    path = make(tmp_path / name)
    with pytest.raises(CheckpointError, match=message):
        load_orthrus(path)


@pytest.mark.parametrize("name", ["base_qwen3_as_orthrus", "too_many_draft_tokens"])
def test_cli_errors(name, tmp_path, capsys):
    if name == "base_qwen3_as_orthrus":
        path, args, message = write_qwen3(tmp_path / "q"), [], "no diffusion weights"
    else:
        path, message = write_orthrus(tmp_path / "o", block_size=8), "drafts at most 7 tokens"
        args = ["--num-draft-tokens", "8"]
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--model", str(path), "--method", "orthrus", "--prompt", "the a",
              *args])
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_cli_generates_with_orthrus(tmp_path, capsys):
    path = write_orthrus(tmp_path / "o", block_size=8)
    assert main(["generate", "--model", str(path), "--method", "orthrus", "--prompt", "the a",
                 "--max-tokens", "6", "--num-draft-tokens", "7"]) == 0
    err = capsys.readouterr().err
    assert "[orthrus] 6 tokens" in err and "acceptance histogram" in err


def test_too_many_draft_tokens_is_refused(tmp_path):
    model = orthrus_from_base(SYNTH_QWEN3_DIR, block_size=8)
    with pytest.raises(ValueError, match="at most 7 drafts per step"):
        speculative_generate(model.lm, BlockDrafter(model), [Request([5, 6, 7], 4)], 8)
    path = save_orthrus(model, tmp_path / "o")
    with pytest.raises(CheckpointError, match="block_size=8"):
        validate_block_size(inspect_checkpoint(path), 8)
    validate_block_size(inspect_checkpoint(path), 7)
