"""Fast-dLLM: the diffusion-LM executors (LLaDA, Dream, Fast-dLLM v2, NLD diffusion mode)
and the block-wise decoder, on tiny checkpoints in the published layouts (fp32), and on the
bundled trained models (diffspec/assets/synth-dllm)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from diffspec.assets import SYNTH_DLLM_DIR
from diffspec.core.checkpoint import CheckpointError
from diffspec.core.masks import block_causal_mask, block_diffusion_mask
from diffspec.core.sampling import SamplingParams
from diffspec.model_executors.reference.dllm import DiffusionLM, load_dllm
from diffspec.model_executors.reference.views import block_view_logits
from diffspec.spec_workers.reference.decoder import Request
from diffspec.spec_workers.reference.fast_dllm import (
    FastDLLMConfig,
    FastDLLMOutput,
    fast_dllm_generate,
)
from diffspec.testing.checkpoints import tiny_checkpoint, write_fast_dllm_v2, write_llada

FAMILIES = ("llada", "dream", "fast_dllm_v2", "nld")
SYNTH_DIR = SYNTH_DLLM_DIR


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("dllm")


@pytest.fixture(scope="module")
def lms(root: Path) -> dict[str, DiffusionLM]:
    return {family: load_dllm(tiny_checkpoint(family, root)) for family in FAMILIES}


def prompts(*lengths: int, first: int = 20) -> list[list[int]]:
    """Prompts of word ids (no special tokens), one per length, all different."""
    return [[first + 7 * i + j for j in range(n)] for i, n in enumerate(lengths)]


def run(lm: DiffusionLM, token_lists: list[list[int]], max_tokens: int | list[int] = 12,
        stop: tuple[int, ...] = (), **config) -> list[FastDLLMOutput]:
    sizes = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(token_lists)
    requests = [Request(p, max_tokens=m, stop_token_ids=stop) for p, m in zip(token_lists, sizes)]
    return fast_dllm_generate(lm, requests, FastDLLMConfig(**config))


# ---------------------------------------------------------------------------- loaders

LAYOUT_CASES = {
    # family: (a tensor name of the published layout, logits shifted, trained attention)
    "llada": ("model.transformer.blocks.1.ff_proj.weight", False, "bidirectional"),
    "dream": ("model.layers.1.self_attn.q_proj.bias", True, "bidirectional"),
    "fast_dllm_v2": ("model.layers.1.self_attn.k_proj.bias", True, "block_causal"),
    "nld": ("encoder.layers.1.mlp.up_proj.weight", False, "block_causal"),
}


def _published(family: str, name: str) -> str:
    """The checkpoint name of a loaded parameter (NLD loads into a stock Ministral3)."""
    if family == "nld":
        head, rest = name.split(".", 1)
        return {"model": "encoder.", "lm_head": "diffusion_head."}[head] + rest
    return name


@pytest.mark.parametrize("family", FAMILIES)
def test_loader_reads_published_names(lms: dict[str, DiffusionLM], family: str) -> None:
    lm = lms[family]
    name, shifted, attention = LAYOUT_CASES[family]
    on_disk = set(load_file(str(lm.info.path / "model.safetensors")))
    assert name in on_disk
    loaded = {_published(family, n) for n in lm.model.state_dict()}
    assert loaded == on_disk  # every tensor read, nothing invented
    assert (lm.logits_shift, lm.attention) == (shifted, attention)
    assert lm.mask_token_id == lm.info.mask_token_id
    assert lm.eos_token_ids == lm.info.eos_token_ids and lm.eos_token_ids


@pytest.mark.parametrize("family", FAMILIES)
def test_missing_tensor_is_named(root: Path, tmp_path: Path, family: str) -> None:
    folder = tmp_path / family
    shutil.copytree(tiny_checkpoint(family, root), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    name = LAYOUT_CASES[family][0]
    del tensors[name]
    save_file(tensors, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"lacks 1 tensor.*{name}"):
        load_dllm(folder)


def test_unexpected_and_misshaped_tensors_are_named(root: Path, tmp_path: Path) -> None:
    folder = tmp_path / "llada"
    shutil.copytree(tiny_checkpoint("llada", root), folder)
    tensors = load_file(str(folder / "model.safetensors"))
    save_file({**tensors, "model.transformer.extra.weight": torch.ones(2)},
              str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match="does not have, first 'model.transformer.extra"):
        load_dllm(folder)
    name = "model.transformer.blocks.0.up_proj.weight"
    save_file({**tensors, name: torch.ones(3, 3)}, str(folder / "model.safetensors"))
    with pytest.raises(CheckpointError, match=rf"{name}' has shape \(3, 3\)"):
        load_dllm(folder)


WRONG_CHECKPOINTS = {
    "qwen3": "needs a checkpoint of family llada or dream or fast_dllm_v2",
    "orthrus": "family 'orthrus'",
    "refusion": "family 'refusion'",
}


@pytest.mark.parametrize("layout", WRONG_CHECKPOINTS)
def test_wrong_checkpoint_rejected(root: Path, layout: str) -> None:
    with pytest.raises(CheckpointError, match=WRONG_CHECKPOINTS[layout]):
        load_dllm(tiny_checkpoint(layout, root))


def test_unsupported_llada_config_rejected(tmp_path: Path) -> None:
    write_llada(tmp_path / "seq", block_type="sequential")
    with pytest.raises(CheckpointError, match="block_type='sequential' is not supported"):
        load_dllm(tmp_path / "seq")


def test_nld_diffusion_mode_is_the_backbone_without_lora(lms: dict[str, DiffusionLM]) -> None:
    """NLD's diffusion mode runs the plain backbone: same logits as load_nld(lora=False),
    different from the LoRA draft view; blocks come after a causal prompt."""
    from diffspec.model_executors.reference.nld import load_nld

    lm = lms["nld"]
    assert lm.causal_prefix and lm.block_size == 32 and not lm.logits_shift
    with_lora = load_nld(lm.info.path)
    ids, pos = torch.tensor(prompts(9)), torch.arange(9)[None]
    mask = torch.ones(1, 9, 9, dtype=torch.bool)
    plain = lm.forward(ids, pos, mask)
    torch.testing.assert_close(block_view_logits(with_lora.lm, ids, pos, None, mask), plain)
    with torch.no_grad(), with_lora.draft_view():
        drafted = block_view_logits(with_lora.lm, ids, pos, None, mask)
    assert not torch.allclose(drafted, plain)


def test_llada_module_matches_llama(lms: dict[str, DiffusionLM]) -> None:
    """LLaDA's block is Llama's: map the tensors onto transformers' LlamaForCausalLM (an
    independent implementation of RMSNorm / RoPE / SwiGLU) and compare logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    lm = lms["llada"]
    c = lm.info.config
    config = LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["d_model"],
                         intermediate_size=c["mlp_hidden_size"], num_hidden_layers=c["n_layers"],
                         num_attention_heads=c["n_heads"], num_key_value_heads=c["n_kv_heads"],
                         rms_norm_eps=c["rms_norm_eps"], rope_theta=c["rope_theta"],
                         tie_word_embeddings=False)
    config._attn_implementation = "sdpa"
    names = {"attn_norm": "input_layernorm", "ff_norm": "post_attention_layernorm",
             "q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj",
             "v_proj": "self_attn.v_proj", "attn_out": "self_attn.o_proj",
             "ff_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj", "ff_out": "mlp.down_proj"}
    fixed = {"model.transformer.wte.weight": "model.embed_tokens.weight",
             "model.transformer.ln_f.weight": "model.norm.weight",
             "model.transformer.ff_out.weight": "lm_head.weight"}
    state = {}
    for name, value in lm.model.state_dict().items():
        if name in fixed:
            state[fixed[name]] = value
        else:
            _, _, _, layer, part, _ = name.split(".")
            state[f"model.layers.{layer}.{names[part]}.weight"] = value
    llama = LlamaForCausalLM(config).eval()
    llama.load_state_dict(state, strict=True)

    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 200, (2, 9), generator=gen)
    pos = torch.arange(5, 14).expand(2, 9)
    mask = (torch.rand(2, 9, 9, generator=gen) < 0.6) | torch.eye(9, dtype=torch.bool)
    with torch.no_grad():
        expected = block_view_logits(llama, ids, pos, None, mask)
    torch.testing.assert_close(lm.forward(ids, pos, mask), expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_block_over_cache_equals_full_forward(lms: dict[str, DiffusionLM], family: str) -> None:
    """Prefix KV in the cache + a block on top == one forward where the prefix does not see
    the block; the cache is rolled back afterwards (keep_kv=False)."""
    lm = lms[family]
    ids = torch.tensor([prompts(13)[0]])
    pos = torch.arange(13)[None]
    full = block_causal_mask(13, 5, prefix_len=3)  # causal 3, then blocks [3,8) [8,13)
    one_pass = lm.forward(ids, pos, full[None])
    cache = lm.new_cache()
    lm.forward(ids[:, :8], pos[:, :8], full[None, :8, :8], cache, keep_kv=True)
    block = lm.forward(ids[:, 8:], pos[:, 8:], block_diffusion_mask(8, 5)[None], cache)
    assert cache.get_seq_length() == 8
    torch.testing.assert_close(block, one_pass[:, 8:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", FAMILIES)
def test_key_order_does_not_matter(lms: dict[str, DiffusionLM], family: str) -> None:
    """What the dual cache relies on: positions travel with the tokens, so a permuted layout
    gives the same logits (up to rounding)."""
    lm = lms[family]
    ids, pos = torch.tensor(prompts(11)), torch.arange(11)[None]
    perm = torch.randperm(11, generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, 11, 11, dtype=torch.bool)
    straight = lm.forward(ids, pos, mask)
    permuted = lm.forward(ids[:, perm], pos[:, perm], mask)
    torch.testing.assert_close(permuted, straight[:, perm], rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------- logits shift


class _PositionModel(torch.nn.Module):
    """Logits that depend only on the position id: token ``10 + (7 * p) % 50``, confident."""

    def __init__(self) -> None:
        super().__init__()
        self.config = type("C", (), {"_attn_implementation": "sdpa"})()
        self.embed = torch.nn.Embedding(64, 4)

    def get_input_embeddings(self) -> torch.nn.Embedding:
        return self.embed

    def forward(self, input_ids, position_ids, attention_mask=None, past_key_values=None,
                use_cache=False):
        if use_cache:  # keep the cache length consistent with the tokens run
            k = torch.zeros(input_ids.shape[0], 1, input_ids.shape[1], 2)
            past_key_values.update(k, k, 0)
        token = 10 + (7 * position_ids) % 50
        logits = torch.nn.functional.one_hot(token, 64).float() * 20
        return type("O", (), {"logits": logits.expand(input_ids.shape[0], -1, -1)})()


def _position_lm(lm: DiffusionLM, shift: bool) -> DiffusionLM:
    return DiffusionLM(_PositionModel(), lm.family, 63, (), shift, lm.attention, lm.block_size,
                       4096, lm.info, lm.causal_prefix)


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("family", FAMILIES)
def test_shifted_logits_are_read_one_slot_back(lms: dict[str, DiffusionLM], family: str,
                                               cache: str) -> None:
    """Slot p decodes the logits of position p (unshifted) or of p - 1 (shifted)."""
    for shift in (False, True):
        lm = _position_lm(lms[family], shift)
        out = run(lm, prompts(6), max_tokens=11, cache=cache, threshold=0.5, block_size=8,
                  sub_block_size=4)[0]
        first = 6 - int(shift)
        assert out.token_ids == [10 + (7 * p) % 50 for p in range(first, first + 11)]


# ---------------------------------------------------------------------------- exactness

EXACT_CASES = {
    # name: (family, config, prompt lengths, max_tokens)
    "v2_prefix_one_token_per_step": ("fast_dllm_v2", {"cache": "prefix", "threshold": 1.0,
                                     "block_size": 8, "sub_block_size": 4}, (5,), 21),
    "v2_prefix_prompt_on_block_boundary": ("fast_dllm_v2", {"cache": "prefix", "threshold": 1.0,
                                           "block_size": 8}, (16,), 12),
    "v2_prefix_batch": ("fast_dllm_v2", {"cache": "prefix", "threshold": 1.0, "block_size": 8,
                        "sub_block_size": 2}, (3, 17, 9), 14),
    "v2_prefix_block_32_sub_8": ("fast_dllm_v2", {"cache": "prefix", "threshold": 1.0}, (6,), 40),
    "v2_dual_without_sub_blocks": ("fast_dllm_v2", {"cache": "dual", "threshold": 1.0,
                                   "block_size": 8, "sub_block_size": 8}, (5, 12), 17),
    "nld_prefix_one_token_per_step": ("nld", {"cache": "prefix", "threshold": 1.0,
                                      "block_size": 8}, (5, 11), 19),
    "nld_prefix_threshold_0.9_block_32": ("nld", {"cache": "prefix", "threshold": 0.9}, (6,), 40),
    "llada_prefix_one_step_per_block": ("llada", {"cache": "prefix", "threshold": 0.0,
                                        "block_size": 8}, (4, 9), 20),
    # the dual cache is exact on the step that refreshes it (the first of a block, or of a
    # v2 sub-block), up to the rounding of its permuted key order
    "llada_dual_one_step_per_block": ("llada", {"cache": "dual", "threshold": 0.0,
                                      "block_size": 8}, (4, 9), 20),
    "v2_dual_one_step_per_sub_block": ("fast_dllm_v2", {"cache": "dual", "threshold": 0.0,
                                       "block_size": 8, "sub_block_size": 4}, (5, 10), 20),
}


@pytest.mark.parametrize("case", EXACT_CASES)
def test_cached_equals_uncached_where_the_math_is_identical(lms: dict[str, DiffusionLM],
                                                            case: str) -> None:
    """Fast-dLLM v2's prefix cache holds exactly what a full block-causal forward computes;
    LLaDA's prefix cache is only used after a block's first step (so not at all when each
    block takes one step). Same tokens and same forward count as cache="none"."""
    family, config, lengths, max_tokens = EXACT_CASES[case]
    lm = lms[family]
    cached = run(lm, prompts(*lengths), max_tokens, **config)
    uncached = run(lm, prompts(*lengths), max_tokens, **{**config, "cache": "none"})
    assert [o.token_ids for o in cached] == [o.token_ids for o in uncached]
    assert all(len(o.token_ids) == max_tokens for o in cached)
    if family != "nld":  # NLD's cache costs a prompt prefill and a KV write per block
        assert [o.num_forwards for o in cached] == [o.num_forwards for o in uncached]


def test_reference_is_no_cache_one_token_per_step(lms: dict[str, DiffusionLM]) -> None:
    ref = FastDLLMConfig.reference(block_size=8)
    assert (ref.cache, ref.threshold) == ("none", 1.0)
    for lm in lms.values():
        out = fast_dllm_generate(lm, [Request(prompts(7)[0], max_tokens=10)], ref)[0]
        assert out.accept_lengths == [1] * len(out.accept_lengths)
        assert len(out.token_ids) == 10


# ---------------------------------------------------------------------------- steps, stop

STEP_CASES = {
    # name: (family, config, max_tokens, steps per block)
    "llada_one_token_per_step": ("llada", {"threshold": 1.0, "block_size": 8}, 13, [8, 5]),
    "llada_all_at_once": ("llada", {"threshold": 0.0, "block_size": 8}, 13, [1, 1]),
    "llada_sub_blocks": ("llada", {"threshold": 0.0, "block_size": 8, "sub_block_size": 4}, 13,
                         [2, 2]),
    "dream_seed_step_first": ("dream", {"threshold": 0.0, "block_size": 8}, 13, [2, 2]),
    # v2, prompt of 7 in blocks of 8: slot 7, then [8, 16) seeded, then [16, 20) seeded;
    # each block but the last ends with the completing forward
    "v2_one_token_per_step": ("fast_dllm_v2", {"threshold": 1.0, "block_size": 8}, 13,
                              [2, 8, 3]),
    "v2_all_at_once": ("fast_dllm_v2", {"threshold": 0.0, "block_size": 8, "sub_block_size": 4}, 13,
                       [2, 3, 1]),
}


@pytest.mark.parametrize("cache", ["none", "prefix", "dual"])
@pytest.mark.parametrize("case", STEP_CASES)
def test_steps_per_block_and_max_tokens_mid_block(lms: dict[str, DiffusionLM], case: str,
                                                  cache: str) -> None:
    family, config, max_tokens, steps = STEP_CASES[case]
    out = run(lms[family], prompts(7), max_tokens, cache=cache, **config)[0]
    assert len(out.token_ids) == max_tokens and out.finish_reason == "length"
    assert out.steps_per_block == steps
    assert out.num_forwards == sum(steps)  # no prefill: the prompt has no full block
    assert sum(out.accept_lengths) == max_tokens


NLD_COUNTS = {
    # cache: (steps per block, forwards, forwards that commit nothing); prompt 7, blocks of
    # 8, 13 tokens, one per step. Cached: the causal prompt prefill, and a forward writing
    # each completed block's KV (NLD is unshifted: that forward seeds nothing).
    "none": ([8, 5], 13, 0),
    "prefix": ([9, 5], 15, 1),
    "dual": ([9, 5], 15, 1),
}


@pytest.mark.parametrize("cache", NLD_COUNTS)
def test_nld_counts_prefill_and_kv_writes(lms: dict[str, DiffusionLM], cache: str) -> None:
    out = run(lms["nld"], prompts(7), 13, cache=cache, threshold=1.0, block_size=8)[0]
    steps, forwards, kv_writes = NLD_COUNTS[cache]
    assert (out.steps_per_block, out.num_forwards) == (steps, forwards)
    assert len(out.token_ids) == 13 and out.accept_lengths.count(0) == kv_writes


STOP_CASES = {
    # name: (family, cache, index of the stop token in the unstopped output)
    "llada_first_block": ("llada", "prefix", 3),
    "llada_second_block_first_slot": ("llada", "dual", 8),
    "dream_mid_block": ("dream", "none", 10),
    "dream_seed_is_stop": ("dream", "prefix", 8),
    "v2_mid_block": ("fast_dllm_v2", "prefix", 5),
    "v2_seed_is_stop": ("fast_dllm_v2", "dual", 9),
    "nld_mid_block": ("nld", "prefix", 5),
    "nld_second_block": ("nld", "none", 11),
}


@pytest.mark.parametrize("case", STOP_CASES)
def test_stop_token_ends_the_request(lms: dict[str, DiffusionLM], case: str) -> None:
    """Output = the unstopped output up to its first stop token; the request does not
    decode the rest of that block nor any later block."""
    family, cache, index = STOP_CASES[case]
    lm = lms[family]
    config = {"cache": cache, "threshold": 1.0, "block_size": 8}
    free = run(lm, prompts(7), 24, **config)[0]
    stop = free.token_ids[index]
    first = free.token_ids.index(stop)  # the stop token may occur earlier
    stopped = run(lm, prompts(7), 24, stop=(stop,), **config)[0]
    assert stopped.token_ids == free.token_ids[: first + 1]
    assert stopped.finish_reason == "stop"
    assert stopped.num_forwards < free.num_forwards
    assert len(stopped.steps_per_block) == _blocks_until(lm, first)


def _blocks_until(lm: DiffusionLM, index: int) -> int:
    """Blocks a 7-token prompt decodes (block 8) until generated token ``index`` is known."""
    if lm.attention == "bidirectional" or lm.causal_prefix:  # blocks start at the prompt end
        return index // 8 + 1
    slot = 7 + index  # v2: blocks aligned at 0; a block-first slot is seeded by the block before
    return slot // 8 + (0 if slot % 8 == 0 else 1)


def test_batch_with_stop_and_different_lengths(lms: dict[str, DiffusionLM]) -> None:
    """Requests in one batch finish independently: one stops, the others run to their own
    max_tokens."""
    lm = lms["llada"]
    config = {"cache": "prefix", "threshold": 1.0, "block_size": 8}
    free = run(lm, prompts(5, 9, 3), [20, 11, 17], **config)
    stop = free[0].token_ids[4]
    both = run(lm, prompts(5, 9, 3), [20, 11, 17], stop=(stop,), **config)
    first = free[0].token_ids.index(stop)
    assert both[0].token_ids == free[0].token_ids[: first + 1]
    for i in (1, 2):
        if stop in free[i].token_ids:
            cut = free[i].token_ids.index(stop) + 1
            assert both[i].token_ids == free[i].token_ids[:cut]
        else:
            assert both[i].token_ids == free[i].token_ids
            assert both[i].finish_reason == "length"


BATCH_CASES = [(family, cache) for family in FAMILIES for cache in ("none", "prefix", "dual")]


@pytest.mark.parametrize(("family", "cache"), BATCH_CASES)
def test_batch_of_different_lengths_equals_one_by_one(lms: dict[str, DiffusionLM], family: str,
                                                      cache: str) -> None:
    """Left padding never leaks into a request, and no request's decoding depends on its
    neighbours (Fast-dLLM v2's dual cache included: its sub-block refresh is decided per
    request, not for the whole batch as v2's batch_sample does)."""
    lm = lms[family]
    config = {"cache": cache, "threshold": 0.9, "block_size": 8, "sub_block_size": 4}
    lengths, max_tokens = (3, 17, 8), [13, 9, 21]
    batch = run(lm, prompts(*lengths), max_tokens, **config)
    for i, n in enumerate(lengths):
        alone = run(lm, [prompts(*lengths)[i]], max_tokens[i], **config)[0]
        assert batch[i].token_ids == alone.token_ids
        assert batch[i].num_forwards == alone.num_forwards
        assert batch[i].steps_per_block == alone.steps_per_block
        assert batch[i].window_forwards == alone.window_forwards


# ---------------------------------------------------------------------------- masks


def _record_masks(lm: DiffusionLM, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    calls: list[tuple] = []
    forward = lm.forward

    def spy(input_ids, position_ids, attention_mask, cache=None, keep_kv=False):
        cache_len = cache.get_seq_length() if cache is not None else 0
        calls.append((attention_mask.clone(), cache_len, position_ids.clone(), keep_kv))
        return forward(input_ids, position_ids, attention_mask, cache, keep_kv)

    monkeypatch.setattr(lm, "forward", spy)
    return calls


MASK_CASES = {
    # name: (family, cache, expected structural mask of call i: (n, cache_len) -> mask)
    "v2_none_is_block_causal": ("fast_dllm_v2", "none",
                                lambda n, c: block_causal_mask(n, 8)),
    "v2_prefix_block_over_cache": ("fast_dllm_v2", "prefix",
                                   lambda n, c: block_causal_mask(n, 8) if c == 0
                                   else block_diffusion_mask(c, n)),
    "v2_dual_sub_block_over_cache": ("fast_dllm_v2", "dual",
                                     lambda n, c: block_causal_mask(n, 8) if c == 0
                                     else block_diffusion_mask(c, n)),
    "llada_none_bidirectional": ("llada", "none", lambda n, c: block_diffusion_mask(0, n)),
    "dream_dual_block_over_cache": ("dream", "dual", lambda n, c: block_diffusion_mask(c, n)),
    "nld_none_causal_prompt_then_blocks": ("nld", "none",
                                           lambda n, c: block_causal_mask(n, 8, prefix_len=19)),
    "nld_prefix_causal_prefill_then_blocks": ("nld", "prefix",
                                              lambda n, c: block_causal_mask(n, 8, prefix_len=19)
                                              if c == 0 else block_diffusion_mask(c, n)),
}


@pytest.mark.parametrize("case", MASK_CASES)
def test_masks_are_core_masks(lms: dict[str, DiffusionLM], monkeypatch: pytest.MonkeyPatch,
                              case: str) -> None:
    """Every forward's mask is the diffspec.core.masks rule for its layout (one unpadded
    request), and v2's prefill covers the prompt's full blocks with the block-causal rule."""
    family, cache, expected = MASK_CASES[case]
    lm = lms[family]
    calls = _record_masks(lm, monkeypatch)
    run(lm, prompts(19), 14, cache=cache, threshold=0.9, block_size=8, sub_block_size=4)
    assert len(calls) > 3
    for mask, cache_len, _, _ in calls:
        n = mask.shape[1]
        assert torch.equal(mask[0], expected(n, cache_len))
    if family == "fast_dllm_v2":
        assert calls[0][0].shape[1] == 16  # prefill: the two full blocks of the prompt
    if (family, cache) == ("nld", "prefix"):
        assert torch.equal(calls[0][0][0], torch.ones(19, 19, dtype=torch.bool).tril())  # prefill: the causal prompt


def test_padding_is_masked(lms: dict[str, DiffusionLM], monkeypatch: pytest.MonkeyPatch) -> None:
    """A short prompt's left padding is never a key of a real token, its position ids start
    at 0, and a padding slot sees itself (no empty softmax row) but no other padding."""
    lm = lms["dream"]
    calls = _record_masks(lm, monkeypatch)
    run(lm, prompts(9, 4), 6, cache="none", threshold=1.0, block_size=8)
    mask, _, positions, _ = calls[0]
    pad = 5
    assert positions[1, pad:pad + 4].tolist() == [0, 1, 2, 3]
    assert not mask[1, pad:, :pad].any()  # real rows never see padding
    assert torch.equal(mask[1, :pad, :pad], torch.eye(pad, dtype=torch.bool))
    assert mask[0].all()


# ---------------------------------------------------------------------------- config

CONFIG_ERRORS = {
    "unknown_cache": ({"cache": "paged"}, ValueError, "cache must be one of"),
    "threshold_above_one": ({"threshold": 1.5}, ValueError, "threshold must lie in"),
    "sub_block_not_dividing": ({"block_size": 8, "sub_block_size": 3}, ValueError, "must divide"),
    "zero_block": ({"block_size": 0}, ValueError, "block_size must be an int >= 1"),
}


@pytest.mark.parametrize("case", CONFIG_ERRORS)
def test_config_validation(case: str) -> None:
    kwargs, error, message = CONFIG_ERRORS[case]
    with pytest.raises(error, match=message):
        FastDLLMConfig(**kwargs)


REQUEST_ERRORS = {
    "block_larger_than_bd_size": ("fast_dllm_v2", {"block_size": 64}, {}, CheckpointError,
                                  "trained with block size 32"),
    "nld_block_larger_than_block_size": ("nld", {"block_size": 64}, {}, CheckpointError,
                                         "trained with block size 32"),
    "gen_length_below_max_tokens": ("llada", {"gen_length": 8}, {}, ValueError,
                                    "smaller than a request's max_tokens"),
    "sampled_request": ("dream", {}, {"sampling": SamplingParams(temperature=0.7)}, ValueError,
                        "greedy"),
    "stop_strings": ("llada", {}, {"stop_strings": ("x",)}, ValueError, "stop_token_ids"),
    "token_outside_vocab": ("llada", {}, {"prompt_token_ids": [3, 999]}, ValueError,
                            "vocab_size"),
}


@pytest.mark.parametrize("case", REQUEST_ERRORS)
def test_request_validation(lms: dict[str, DiffusionLM], case: str) -> None:
    family, config, request, error, message = REQUEST_ERRORS[case]
    fields = {"prompt_token_ids": [3, 4, 5], "max_tokens": 12, **request}
    with pytest.raises(error, match=message):
        fast_dllm_generate(lms[family], [Request(**fields)], FastDLLMConfig(**config))


def test_gen_length_is_a_longer_masked_canvas(lms: dict[str, DiffusionLM]) -> None:
    """LLaDA / Dream see the whole masked canvas: a longer gen_length changes the logits
    (so it is a real knob), while max_tokens still bounds the output."""
    lm = lms["llada"]
    short = run(lm, prompts(6), 12, cache="none", threshold=1.0, block_size=8)[0]
    longer = run(lm, prompts(6), 12, cache="none", threshold=1.0, block_size=8,
                 gen_length=40)[0]
    assert len(longer.token_ids) == 12 and longer.num_forwards == 12
    assert longer.token_ids != short.token_ids


# ---------------------------------------------------------------------------- trained model


@pytest.mark.parametrize("name", ["llada", "fast_dllm_v2"])
def test_trained_model(name: str) -> None:
    """On the bundled trained model: the reference decodes the language (legal adjacent
    pairs), parallel decoding takes fewer forwards than tokens, and for Fast-dLLM v2 the
    prefix cache stays exact at threshold 0.9 too. Agreement figures are reported, not
    asserted (see diffspec/assets/synth-dllm/TRAINING.md)."""
    from diffspec.testing.synthetic_dllm import evaluate_fast_dllm

    path = SYNTH_DIR / name
    rows = {(r["cache"], r["threshold"]): r
            for r in evaluate_fast_dllm(path, num_prompts=4, max_tokens=48)}
    reference = rows[("none", 1.0)]
    assert reference["legal_pairs"] > 0.9
    assert rows[("prefix", 0.9)]["tpf"] > 1.2
    if json.loads((path / "config.json").read_text())["architectures"] == [
            "Fast_dLLM_QwenForCausalLM"]:
        assert rows[("prefix", 1.0)]["equal_outputs"] == reference["requests"]
        assert rows[("prefix", 0.9)]["agreement"] == rows[("none", 0.9)]["agreement"]


def test_v2_writer_block_size_is_honoured(tmp_path: Path) -> None:
    """A checkpoint trained with bd_size 8 refuses a 16-slot block."""
    lm = load_dllm(write_fast_dllm_v2(tmp_path / "v2", bd_size=8))
    with pytest.raises(CheckpointError, match="block size 8"):
        run(lm, prompts(5), 8, block_size=16)
    assert run(lm, prompts(5), 8)[0].steps_per_block  # default block = bd_size
