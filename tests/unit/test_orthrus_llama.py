"""Orthrus on a Llama base (SmolLM2's architecture: no q/k norms, tied embeddings, the mask
an existing token) and low-rank heads (``W + B @ A``, heads folder, materialization).

Everything is fp32 and built offline: a tiny Llama Orthrus in the published layout
(:func:`~diffspec.testing.checkpoints.write_llama_orthrus`) and a tiny base Llama. Lossless
means token for token equal to :func:`~diffspec.spec_workers.reference.decoder.ar_generate`.
"""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffspec.core.checkpoint import CheckpointError, inspect_checkpoint, require_method
from diffspec.model_executors.reference.orthrus import (
    HEADS_CONFIG,
    HEADS_WEIGHTS,
    PROJECTIONS,
    DenseDelta,
    LowRankDelta,
    OrthrusModel,
    base_weights_sha256,
    load_orthrus,
    load_orthrus_heads,
    materialize_orthrus,
    merge_low_rank,
    orthrus_from_base,
    save_orthrus,
    save_orthrus_heads,
)
from diffspec.spec_workers.reference.decoder import (
    BlockDrafter,
    Request,
    ar_generate,
    speculative_generate,
)
from diffspec.testing.checkpoints import (
    LLAMA_ORTHRUS_MASK_TOKEN_ID,
    write_llama,
    write_llama_orthrus,
)
from tests.unit.lossless_cases import GREEDY, SAMPLINGS

MASK = LLAMA_ORTHRUS_MASK_TOKEN_ID


def _prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(10, 200) for _ in range(n)] for n in lengths]


def _assert_lossless(model: OrthrusModel, requests: list[Request], k: int):
    ar = ar_generate(model.lm, requests)
    spec = speculative_generate(model.lm, BlockDrafter(model), requests, k)
    for a, s in zip(ar, spec, strict=True):
        assert s.token_ids == a.token_ids
        assert s.finish_reason == a.finish_reason
        assert sum(s.accept_lengths) == len(s.token_ids)
    return spec


@pytest.fixture(scope="module")
def llama_base(tmp_path_factory):
    return write_llama(tmp_path_factory.mktemp("llama") / "base")


@pytest.fixture(scope="module")
def llama_orthrus(tmp_path_factory) -> OrthrusModel:
    return load_orthrus(write_llama_orthrus(tmp_path_factory.mktemp("lo") / "o",
                                            diff_noise=0.02))


@pytest.fixture(scope="module")
def copies(llama_base) -> OrthrusModel:
    """Diff projections = AR copies: the anchor row mostly drafts what AR emits, so drafts
    get accepted (and EOS can land inside an accepted block)."""
    return orthrus_from_base(llama_base, block_size=8, mask_token_id=MASK)


# ------------------------------------------------------------------------------ loading


def test_llama_orthrus_is_identified_and_loads(llama_orthrus, llama_base):
    from transformers import LlamaForCausalLM

    info = inspect_checkpoint(llama_orthrus.source)
    assert (info.family, info.orthrus_base, info.architecture, info.model_type) == (
        "orthrus", "llama", "OrthrusLlamaForCausalLM", "llama")
    assert (info.mask_token_id, info.eos_token_ids) == (MASK, (2,))
    assert isinstance(llama_orthrus.lm, LlamaForCausalLM)
    attn = llama_orthrus.lm.model.layers[0].self_attn
    assert not hasattr(attn, "q_norm_diff")
    diff = [k for k in llama_orthrus.lm.state_dict() if "_diff." in k]
    assert len(diff) == 4 * llama_orthrus.config.num_hidden_layers
    base = LlamaForCausalLM.from_pretrained(str(llama_base), dtype=torch.float32).eval()
    ids = torch.tensor([[10, 11, 12, 13, 14]])
    with torch.no_grad():
        assert torch.equal(llama_orthrus.lm(ids).logits, base(ids).logits)  # AR view exact
    saved = load_file(str(llama_orthrus.source / "model.safetensors"))
    assert "lm_head.weight" not in saved  # tied embeddings, as SmolLM2
    assert all(torch.equal(llama_orthrus.lm.state_dict()[k], saved[k]) for k in diff)


def test_llama_diffusion_view_uses_the_diff_weights(llama_orthrus, copies):
    from transformers import DynamicCache

    for model, same in ((llama_orthrus, False), (copies, True)):
        cache = DynamicCache(config=model.config)
        with torch.no_grad():
            model.lm(input_ids=torch.tensor([[5, 9, 30]]), past_key_values=cache, use_cache=True)
            block, positions = torch.tensor([12, 40, 41]), torch.arange(3, 6)
            causal = torch.ones(3, 6, dtype=torch.bool).tril(3)
            from diffspec.model_executors.reference.views import block_view_logits

            ar = block_view_logits(model.lm, block, positions, cache, causal)
            diffusion = model.diffusion_logits(block, positions, cache, causal)
        assert torch.equal(ar, diffusion) == same


# ----------------------------------------------------------------------------- lossless


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("which", ["published", "copies"])
def test_llama_orthrus_equals_ar(which, sampling, llama_orthrus, copies):
    model = llama_orthrus if which == "published" else copies
    k = model.block_size - 1
    requests = [Request(p, 14, SAMPLINGS[sampling], model.eos_token_ids)
                for p in _prompts([1, 6, k + 1, 33])]
    spec = _assert_lossless(model, requests, k)
    assert sum(s.num_draft_tokens for s in spec) > 0


def test_copies_get_drafts_accepted(copies):
    requests = [Request(p, 40) for p in _prompts([3, 9, 17])]
    spec = _assert_lossless(copies, requests, 7)
    assert sum(s.num_accepted_tokens for s in spec) >= 3
    assert max(max(s.accept_lengths) for s in spec) >= 2  # a draft, then more of the block


@pytest.mark.parametrize("max_tokens", [1, 2, 5, 9])
def test_llama_max_tokens_ends_mid_block(max_tokens, copies):
    requests = [Request(p, max_tokens) for p in _prompts([2, 7, 20])]
    spec = _assert_lossless(copies, requests, 7)
    assert all(len(s.token_ids) == max_tokens and s.finish_reason == "length" for s in spec)


def test_llama_eos_inside_an_accepted_block(copies):
    """The stop token is a token the model emits as an *accepted draft* with more of its
    step after it: generation must stop there, as AR does."""
    prompts = _prompts([3, 9, 17, 25], seed=1)
    free = speculative_generate(copies.lm, BlockDrafter(copies),
                                [Request(p, 40) for p in prompts], 7)
    for prompt, out in zip(prompts, free):
        start = 0
        for length in out.accept_lengths:
            step = out.token_ids[start:start + length]
            # an accepted draft (not the step's last token) seen nowhere earlier
            candidates = [t for i, t in enumerate(step[:-1]) if t not in out.token_ids[:start + i]]
            if candidates:
                stop = candidates[0]
                break
            start += length
        else:
            continue
        break
    else:
        pytest.fail("no accepted draft to use as a stop token")
    requests = [Request(prompt, 40, GREEDY, (stop,))] + [Request(p, 40, GREEDY, (stop,))
                                                          for p in prompts[:2]]
    spec = _assert_lossless(copies, requests, 7)
    assert spec[0].finish_reason == "stop" and spec[0].token_ids[-1] == stop
    assert len(spec[0].token_ids) < start + len(step)  # cut inside the block


# ------------------------------------------------------------------------- clear errors


def _drop_diff(path, keep_any: bool):
    tensors = load_file(str(path / "model.safetensors"))
    drop = ["model.layers.1.self_attn.v_proj_diff.weight"] if keep_any else [
        k for k in tensors if "_diff." in k]
    for k in drop:
        del tensors[k]
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    return path


ERRORS = {  # name: (make checkpoint, expected message)
    "no_diff_tensors": (lambda p: _drop_diff(write_llama_orthrus(p), keep_any=False),
                        "no diffusion weights.*base Llama"),
    "one_diff_tensor_missing": (lambda p: _drop_diff(write_llama_orthrus(p), keep_any=True),
                                "lacks 1 Orthrus diffusion weights.*v_proj_diff"),
    "base_llama_as_orthrus": (lambda p: write_llama(p, block_size=8, mask_token_id=4),
                              "no diffusion weights.*base Llama"),
    "mask_outside_vocab": (lambda p: write_llama_orthrus(p, mask_token_id=256),
                           r"mask_token_id=256, outside its vocabulary \[0, 256\)"),
    "no_mask_token_id": (lambda p: write_llama_orthrus(p, mask_token_id=None),
                         "no mask_token_id"),
}


@pytest.mark.parametrize("name", list(ERRORS))
def test_llama_errors_name_what_is_wrong(name, tmp_path):
    make, message = ERRORS[name]
    path = make(tmp_path / name)
    with pytest.raises(CheckpointError, match=message):
        require_method(inspect_checkpoint(path), "orthrus")
    with pytest.raises(CheckpointError, match=message):
        load_orthrus(path)


def test_orthrus_from_base_takes_an_existing_token_as_the_mask(llama_base):
    with pytest.raises(ValueError, match="no mask_token; pass mask_token_id"):
        orthrus_from_base(llama_base)
    with pytest.raises(ValueError, match=r"outside the vocabulary \[0, 256\)"):
        orthrus_from_base(llama_base, mask_token_id=256)
    assert orthrus_from_base(llama_base, mask_token_id=255).mask_token_id == 255


def test_save_llama_orthrus_round_trip(copies, tmp_path):
    model = orthrus_from_base(copies.source, block_size=8, mask_token_id=MASK)
    with torch.no_grad():
        for p in model.diffusion_parameters():
            p.add_(0.01)
    path = save_orthrus(model, tmp_path / "saved")
    info = inspect_checkpoint(path)
    assert (info.family, info.architecture, info.model_type) == (
        "orthrus", "OrthrusLlamaForCausalLM", "llama")
    assert (path / "tokenizer.json").is_file()
    loaded = load_orthrus(path)
    original = model.lm.state_dict()
    assert all(torch.equal(v, original[k]) for k, v in loaded.lm.state_dict().items())
    with pytest.raises(ValueError, match="architecture for a llama base"):
        save_orthrus(model, tmp_path / "bad", architecture="OrthrusLM")


# ----------------------------------------------------------------------- low-rank heads


@pytest.fixture(scope="module")
def trained_heads(llama_base, tmp_path_factory):
    """Low-rank heads with non-zero B (as if trained), saved to a heads folder."""
    model = orthrus_from_base(llama_base, block_size=8, mask_token_id=MASK, rank=4, seed=3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, p in model.lm.named_parameters():
            if name.endswith("lora_B"):
                p.copy_(torch.randn(p.shape, generator=generator) * 0.05)
    heads = save_orthrus_heads(model, tmp_path_factory.mktemp("heads") / "h")
    return model, heads


@pytest.mark.parametrize("base", ["llama", "qwen3"])
def test_zero_b_gives_the_ar_projections(base, tmp_path):
    from diffspec.testing.checkpoints import write_qwen3

    path = (write_llama if base == "llama" else write_qwen3)(tmp_path / base)
    model = orthrus_from_base(path, block_size=8, mask_token_id=MASK, rank=4)
    assert model.rank == 4
    names = [n for n, _ in model.lm.named_parameters() if "_diff." in n]
    assert all(n.endswith(("lora_A", "lora_B")) or "norm_diff" in n for n in names)
    for layer in model.lm.model.layers:
        attn = layer.self_attn
        for name in PROJECTIONS:
            delta = getattr(attn, f"{name}_diff")
            assert isinstance(delta, LowRankDelta) and delta.lora_A.abs().sum() > 0
            assert torch.equal(delta.merged_weight(), getattr(attn, name).weight)
    full = orthrus_from_base(path, block_size=8, mask_token_id=MASK)
    block, positions = torch.tensor([12, MASK, MASK]), torch.arange(3)
    with torch.no_grad():
        assert torch.equal(model.diffusion_logits(block, positions),
                           full.diffusion_logits(block, positions))


def test_heads_folder_is_compact_and_described(trained_heads, llama_base):
    model, heads = trained_heads
    record = json.loads((heads / HEADS_CONFIG).read_text())
    assert record["base_model_type"] == "llama" and record["rank"] == 4
    assert (record["block_size"], record["mask_token_id"], record["dtype"]) == (8, MASK,
                                                                                "bfloat16")
    assert record["base_sha256"] == base_weights_sha256(llama_base)
    tensors = load_file(str(heads / HEADS_WEIGHTS))
    layers = model.config.num_hidden_layers
    assert len(tensors) == 2 * 4 * layers and all(v.dtype == torch.bfloat16
                                                  for v in tensors.values())
    assert tensors["model.layers.0.self_attn.k_proj_diff.lora_A"].shape == (4, 64)
    assert tensors["model.layers.0.self_attn.k_proj_diff.lora_B"].shape == (32, 4)


def test_base_hash_is_layout_independent_and_weight_sensitive(llama_base, tmp_path):
    from transformers import LlamaForCausalLM

    lm = LlamaForCausalLM.from_pretrained(str(llama_base), dtype=torch.float32)
    assert base_weights_sha256(lm) == base_weights_sha256(llama_base)
    with torch.no_grad():
        lm.model.norm.weight[0] += 1e-6
    assert base_weights_sha256(lm) != base_weights_sha256(llama_base)


def test_heads_round_trip_is_bit_identical(trained_heads, llama_base, tmp_path):
    """In memory (factors rounded to bf16 on save) == load_orthrus_heads == the
    materialized full checkpoint: the same diff weights bit for bit, the same drafts."""
    model, heads = trained_heads
    full = _assert_heads_round_trip(model, heads, llama_base, tmp_path)
    assert inspect_checkpoint(full.source).architecture == "OrthrusLlamaForCausalLM"
    assert (full.source / "tokenizer.json").is_file()
    assert all(torch.equal(v, model.lm.state_dict()[k])
               for k, v in full.lm.state_dict().items() if "_diff." not in k)


def _assert_heads_round_trip(model: OrthrusModel, heads, llama_base, tmp_path) -> OrthrusModel:
    """``model`` == its heads folder loaded == the materialized checkpoint: the same diff
    weights bit for bit (each unlike the AR one), the same drafts and acceptance, and the
    checkpoint lossless against AR. Returns the materialized model."""
    loaded = load_orthrus_heads(llama_base, heads)
    full = load_orthrus(materialize_orthrus(llama_base, heads, tmp_path / "full"))
    for layers in zip(model.lm.model.layers, loaded.lm.model.layers, full.lm.model.layers):
        for name in PROJECTIONS:
            a, b, c = (getattr(layer.self_attn, f"{name}_diff") for layer in layers)
            assert torch.equal(a.merged_weight(), b.merged_weight())
            assert torch.equal(b.merged_weight(), c.weight)
            assert not torch.equal(c.weight, getattr(layers[2].self_attn, name).weight)
    requests = [Request(p, 12) for p in _prompts([2, 7, 20])]
    outs = [speculative_generate(m.lm, BlockDrafter(m), requests, 7)
            for m in (model, loaded, full)]
    for a, b, c in zip(*outs):
        assert a.token_ids == b.token_ids == c.token_ids
        assert a.accept_lengths == b.accept_lengths == c.accept_lengths
    _assert_lossless(full, requests, 7)
    return full


def test_dense_heads_start_at_ar_and_round_trip_bit_identical(llama_base, tmp_path):
    """``rank="full"`` (every projection weight trains, as in the paper): zero deltas give
    the AR projections; trained deltas stored in bf16 load and materialize to the same
    weights bit for bit and draft the same tokens; the folder says ``"rank": "full"``."""
    model = orthrus_from_base(llama_base, block_size=8, mask_token_id=MASK, rank="full")
    assert model.rank == "full"
    attn = model.lm.model.layers[0].self_attn
    assert isinstance(attn.q_proj_diff, DenseDelta)
    assert torch.equal(attn.q_proj_diff.merged_weight(), attn.q_proj.weight)
    assert sorted(n for n, _ in model.lm.named_parameters() if "layers.0." in n and "_diff." in n
                  ) == [f"model.layers.0.self_attn.{p}_diff.delta" for p in sorted(PROJECTIONS)]
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.diffusion_parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    heads = save_orthrus_heads(model, tmp_path / "heads")
    record = json.loads((heads / HEADS_CONFIG).read_text())
    assert record["rank"] == "full"
    tensors = load_file(str(heads / HEADS_WEIGHTS))
    assert tensors["model.layers.0.self_attn.k_proj_diff.delta"].shape == \
        attn.k_proj.weight.shape
    assert all(v.dtype == torch.bfloat16 for v in tensors.values())
    _assert_heads_round_trip(model, heads, llama_base, tmp_path)
    with pytest.raises(ValueError, match="positive integer or 'full'"):
        orthrus_from_base(llama_base, block_size=8, mask_token_id=MASK, rank="dense")


def test_merge_is_the_same_function_of_the_stored_factors():
    generator = torch.Generator().manual_seed(0)
    w = torch.randn(48, 40, generator=generator)
    a = torch.randn(8, 40, generator=generator).bfloat16()
    b = torch.randn(48, 8, generator=generator).bfloat16()
    want = (w.double() + b.double() @ a.double()).float()
    assert torch.equal(merge_low_rank(w, a, b), want)
    assert torch.equal(merge_low_rank(w, a.float(), b.float()), want)  # storage dtype irrelevant


def test_lora_form_forward_equals_the_merged_weight_forward():
    """A delta runs as ``x W^T + b + (x A^T) B^T`` (no merged weight); that equals the
    merged projection ``x (W + B A)^T + b`` within fp32 rounding, and its gradients reach
    only the factors (the frozen AR weight gets none)."""
    generator = torch.Generator().manual_seed(0)
    ar = torch.nn.Linear(40, 48)
    ar.requires_grad_(False)
    delta = LowRankDelta(ar, 8, generator)
    with torch.no_grad():
        delta.lora_B.copy_(torch.randn(48, 8, generator=generator) * 0.1)
    x = torch.randn(3, 5, 40, generator=generator)
    out = delta(x)
    merged = torch.nn.functional.linear(x, delta.merged_weight(), ar.bias)
    torch.testing.assert_close(out, merged, atol=1e-5, rtol=1e-5)
    assert not torch.equal(out, ar(x))
    out.square().sum().backward()
    assert delta.lora_A.grad is not None and delta.lora_B.grad is not None
    assert ar.weight.grad is None


def test_low_rank_model_equals_its_materialized_checkpoint(trained_heads, llama_base, tmp_path):
    """The in-memory low-rank model (LoRA form) and the exported full checkpoint (merged
    ``*_diff`` weights) give the same diffusion logits within fp32 tolerance."""
    model, heads = trained_heads
    full = load_orthrus(materialize_orthrus(llama_base, heads, tmp_path / "full"))
    block, positions = torch.tensor([12, MASK, MASK, MASK]), torch.arange(4)
    with torch.no_grad():
        lora = model.diffusion_logits(block, positions)
        merged = full.diffusion_logits(block, positions)
        ar = model.lm(input_ids=block[None]).logits[0]
    torch.testing.assert_close(lora, merged, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(lora, ar, atol=1e-3)


def test_wrong_base_is_refused(trained_heads, tmp_path):
    _, heads = trained_heads
    other_weights = write_llama(tmp_path / "seed1", seed=1)
    with pytest.raises(CheckpointError, match="not the base the heads were trained against"):
        load_orthrus_heads(other_weights, heads)
    wider = write_llama(tmp_path / "wide", hidden_size=96)
    with pytest.raises(CheckpointError, match="hidden_size=64.*has hidden_size=96"):
        materialize_orthrus(wider, heads, tmp_path / "out")
    from diffspec.testing.checkpoints import write_qwen3

    with pytest.raises(CheckpointError, match="trained on a llama base"):
        load_orthrus_heads(write_qwen3(tmp_path / "q"), heads)
    assert not (tmp_path / "out").exists()
    with pytest.raises(CheckpointError, match="not an Orthrus heads folder"):
        load_orthrus_heads(other_weights, tmp_path)


def test_save_heads_needs_delta_heads(copies, tmp_path):
    with pytest.raises(ValueError, match="needs delta heads"):
        save_orthrus_heads(copies, tmp_path / "h")


def test_vllm_config_translation_accepts_a_llama_orthrus(llama_orthrus, llama_base):
    """The vLLM plugin's pure config check (no vLLM needed) serves OrthrusLlamaForCausalLM."""
    from diffspec.plugin.vllm.config import proposer_path, translate_speculative_config

    out = translate_speculative_config({"method": "orthrus"}, llama_orthrus.source)
    assert out == {"method": "custom_class", "model": proposer_path("orthrus"),
                   "num_speculative_tokens": 31}
    with pytest.raises(CheckpointError, match="no diffusion weights"):
        translate_speculative_config({"method": "orthrus"}, llama_base)


def test_qwen3_heads_carry_the_diff_norms(tmp_path):
    """On Qwen3 the heads folder also holds the (full, trainable) q/k diff norms, and the
    materialized checkpoint is the published Qwen3 Orthrus layout."""
    from diffspec.testing.checkpoints import write_qwen3

    base = write_qwen3(tmp_path / "qwen3")
    model = orthrus_from_base(base, block_size=8, mask_token_id=7, rank=2)
    with torch.no_grad():
        for name, p in model.lm.named_parameters():
            if name.endswith(("lora_B", "norm_diff.weight")):
                p.add_(0.03)
    heads = save_orthrus_heads(model, tmp_path / "heads")
    names = set(load_file(str(heads / HEADS_WEIGHTS)))
    assert "model.layers.1.self_attn.k_norm_diff.weight" in names
    full = load_orthrus(materialize_orthrus(base, heads, tmp_path / "full"))
    assert inspect_checkpoint(full.source).architecture == "OrthrusLM"
    state = full.lm.state_dict()
    for name, tensor in model.lm.state_dict().items():
        if name.endswith("norm_diff.weight"):
            assert torch.equal(state[name], tensor)
    for layer, ref in zip(full.lm.model.layers, model.lm.model.layers):
        assert torch.equal(layer.self_attn.q_proj_diff.weight,
                           ref.self_attn.q_proj_diff.merged_weight())


def test_cli_generates_with_a_llama_orthrus(tmp_path, capsys):
    from diffspec.cli import main

    path = write_llama_orthrus(tmp_path / "o", block_size=8)
    assert main(["generate", "--model", str(path), "--method", "orthrus", "--prompt", "the a",
                 "--max-tokens", "6", "--num-draft-tokens", "7"]) == 0
    assert "[orthrus] 6 tokens" in capsys.readouterr().err
