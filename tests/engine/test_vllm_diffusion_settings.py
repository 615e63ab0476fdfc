"""Engine tier: what a GPU launch of Fast-dLLM and ReFusion on vLLM's diffusion path runs
under (issue 45, items 1-4), checked on CPU without an engine process (vLLM installed):

* async scheduling: vLLM's own ``EngineArgs(...).create_engine_config()`` with the plugin
  registered, the platform hook made to leave async scheduling as a GPU platform does (the
  CPU one turns it off itself) and the V2 runner taken as available: both methods get
  vLLM's ``DiffusionScheduler`` (async off, one log line), and an explicit
  ``--async-scheduling`` is refused at start, what to do first;
* prefix caching: off for Fast-dLLM (its kept block K/V is non-causal), kept for ReFusion
  (which re-encodes its output causally);
* a request's own canvas width: refused for Fast-dLLM unless it is the served block;
* the model states' per-request counters stay bounded over many finished requests.

The engine runs with prefix caching on and a short canvas are in
``tests/engine/test_vllm_fast_dllm.py`` (``test_fast_dllm_second_turn_and_short_canvas``).
"""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from tests.engine.conftest import require_engine

require_engine("vllm")  # the whole module: skipped, or failed where CI requires vLLM

from diffspec.assets import SYNTH_DLLM_DIR, SYNTH_REFUSION_DIR
from diffspec.plugin.engine_sources import Target, problems
from diffspec.plugin.versions import SUPPORTED_ENGINE_VERSIONS
from diffspec.plugin.vllm.dllm import DiffusionConfigError, fast_dllm_request_error
from diffspec.spec_workers.vllm.diffusion_state import (
    FINISHED_KEPT,
    ForwardCounts,
    ignored_sampling,
)
from diffspec.spec_workers.vllm.fast_dllm import FastDLLMModelState

pytestmark = pytest.mark.engine

MODELS = {"fast_dllm": (SYNTH_DLLM_DIR / "llada", 8), "refusion": (SYNTH_REFUSION_DIR, 64)}


def _gpu_like(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin registered, vLLM's V2 runner taken as available (Triton) and the
    platform hook leaving async scheduling as vLLM resolved it (vLLM's CUDA platform does;
    the CPU one turns it off)."""
    import vllm.config.vllm
    import vllm.triton_utils
    from vllm.platforms import current_platform

    import diffspec.plugin.vllm as plugin

    plugin.register()
    monkeypatch.setattr(vllm.triton_utils, "HAS_TRITON", True)
    monkeypatch.setattr(vllm.config.vllm, "HAS_TRITON", True)
    platform = type(current_platform)
    original = platform.check_and_update_config

    def keep_async(cls, vllm_config) -> None:
        chosen = vllm_config.scheduler_config.async_scheduling
        original(vllm_config)
        vllm_config.scheduler_config.async_scheduling = chosen

    monkeypatch.setattr(platform, "check_and_update_config", classmethod(keep_async))


def _gpu_like_config(monkeypatch: pytest.MonkeyPatch, method: str, **kwargs: object):
    """vLLM's engine config for ``method``'s tiny checkpoint as a GPU launch resolves it
    (:func:`_gpu_like`)."""
    from vllm.engine.arg_utils import EngineArgs

    _gpu_like(monkeypatch)
    path, canvas = MODELS[method]
    return EngineArgs(model=str(path), dtype="float32", max_model_len=256, enforce_eager=True,
                      skip_tokenizer_init=True, diffusion_config={"canvas_length": canvas},
                      max_num_batched_tokens=256, **kwargs).create_engine_config()


def test_the_platform_stand_in_leaves_async_scheduling_on(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    """The control: a plain causal model under the same stand-in gets vLLM's default, async
    scheduling on (so the diffusion cases below see what a GPU launch sees)."""
    from vllm.engine.arg_utils import EngineArgs

    _gpu_like(monkeypatch)
    config = EngineArgs(model=str(SYNTH_REFUSION_DIR), dtype="float32", max_model_len=256,
                        enforce_eager=True, skip_tokenizer_init=True).create_engine_config()
    assert config.scheduler_config.async_scheduling is True


@pytest.mark.parametrize("method", list(MODELS))
def test_async_scheduling_off_with_a_log_line(monkeypatch: pytest.MonkeyPatch,
                                              caplog: pytest.LogCaptureFixture,
                                              method: str) -> None:
    """Left to vLLM, a GPU launch would run the DiffusionAsyncScheduler, whose host-side
    computed-token counts the samplers read a step late: the hook turns it off first."""
    with caplog.at_level(logging.INFO, logger="vllm.diffspec"):
        config = _gpu_like_config(monkeypatch, method)
    assert config.scheduler_config.async_scheduling is False
    assert config.scheduler_config.scheduler_cls == \
        "vllm.v1.core.sched.diffusion_scheduler.DiffusionScheduler"
    assert "on vLLM's diffusion path with async scheduling off" in caplog.text


@pytest.mark.parametrize("method", list(MODELS))
def test_explicit_async_scheduling_is_refused_at_start(monkeypatch: pytest.MonkeyPatch,
                                                       method: str) -> None:
    with pytest.raises(DiffusionConfigError) as err:
        _gpu_like_config(monkeypatch, method, async_scheduling=True)
    assert str(err.value).startswith("remove --async-scheduling (or add "
                                     "--no-async-scheduling) to serve "), str(err.value)


def test_prefix_caching_off_for_fast_dllm_only(monkeypatch: pytest.MonkeyPatch,
                                               caplog: pytest.LogCaptureFixture) -> None:
    """Fast-dLLM keeps non-causal block K/V, which a later prompt must not reuse: prefix
    caching off, with one log line. ReFusion re-encodes its output causally: kept on."""
    with caplog.at_level(logging.WARNING, logger="vllm.diffspec"):
        config = _gpu_like_config(monkeypatch, "fast_dllm", enable_prefix_caching=True)
    assert config.cache_config.enable_prefix_caching is False
    assert "with prefix caching off" in caplog.text
    config = _gpu_like_config(monkeypatch, "refusion", enable_prefix_caching=True)
    assert config.cache_config.enable_prefix_caching is True
    assert config.model_config.hf_config.diffspec_refusion["canvas_length"] == 64


# The order the hooks rely on, in every vLLM release diffspec supports: the model's config
# hook runs before vLLM resolves an unset async_scheduling (so False set there stays), and
# the diffusion scheduler is chosen from the resolved value after the platform hook.
ASYNC_ORDER = Target(
    "vllm.config.vllm", "VllmConfig.try_verify_and_update_config", ("self",),
    relies_on=(("vllm.config.vllm:VllmConfig.__post_init__",
                ("self.try_verify_and_update_config() ... "
                 "elif self.scheduler_config.async_scheduling is None: ... "
                 "current_platform.check_and_update_config(self) ... "
                 '"DiffusionAsyncScheduler" if self.scheduler_config.async_scheduling '
                 'else "DiffusionScheduler"')),))


@pytest.mark.parametrize("release", SUPPORTED_ENGINE_VERSIONS["vllm"])
def test_the_hook_runs_before_vllm_resolves_async_scheduling(release: str) -> None:
    from diffspec.testing.engine_sources import source_root
    from tests.engine.conftest import skip_or_fail

    root = source_root("vllm", release)
    if root is None:
        skip_or_fail("vllm", f"no vllm {release} sources: run python -m "
                             f"diffspec.testing.engine_sources")
    assert problems(root, ASYNC_ORDER) == [], f"vLLM {release} ({root})"


# ------------------------------------------------------------------ a request's own canvas


@pytest.mark.parametrize(("extra", "refused"), [
    (None, False), ({}, False), ({"diffusion_canvas_length": 8}, False),
    ({"diffusion_canvas_length": 4}, True), ({"diffusion_canvas_length": 16}, True),
    ({"fast_dllm_threshold": 0.5}, False)])
def test_a_canvas_of_its_own_is_refused_unless_the_block(extra: dict | None,
                                                        refused: bool) -> None:
    error = fast_dllm_request_error(extra, 8)
    assert (error is not None) is refused
    if refused:
        assert error.startswith("remove diffusion_canvas_length from the request's "
                                "extra_args (vllm_xargs), or set it to 8: ")


def test_the_canvas_width_is_not_reported_as_ignored() -> None:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=4, extra_args={"diffusion_canvas_length": 8,
                                                      "diffusion_max_steps": 3})
    assert ignored_sampling(params) == ["extra_args diffusion_max_steps"]


# ------------------------------------------------------------------------ bounded counters


@pytest.fixture
def bare_model_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """vLLM's DefaultModelState without its buffers (the bookkeeping under test is ours)."""
    from vllm.v1.worker.gpu.model_states.default import DefaultModelState

    def init(self, vllm_config, model, encoder_cache, device) -> None:
        self.model, self.max_num_reqs, self.device = model, 4, device

    monkeypatch.setattr(DefaultModelState, "__init__", init)
    monkeypatch.setattr(DefaultModelState, "add_request", lambda self, i, data: None)
    monkeypatch.setattr(DefaultModelState, "remove_request", lambda self, req_id: None)
    monkeypatch.setattr(DefaultModelState, "prepare_inputs", lambda self, batch, states: {})


def test_forward_counts_keep_live_and_the_last_finished() -> None:
    counts = ForwardCounts(kept=2)
    for rid in ("a", "b", "c"):
        counts.start(rid)
        counts.count(rid)
        counts.count(rid)
    counts.finish("a")
    counts.start("a")  # preempted and re-added: goes on from its count
    counts.count("a")
    assert dict(counts) == {"a": 3, "b": 2, "c": 2}
    for rid in ("a", "b", "c"):
        counts.finish(rid)
    assert dict(counts) == {"b": 2, "c": 2}  # the oldest finished one dropped


def test_fast_dllm_state_does_not_grow_with_finished_requests(bare_model_state: None) -> None:
    settings = {"sub_block_size": 8, "threshold": 0.9, "mask_token_id": 5,
                "logits_shift": False}
    config = SimpleNamespace(diffusion_config=SimpleNamespace(canvas_length=8),
                             additional_config={"diffspec": {"fast_dllm": settings}})
    state = FastDLLMModelState(config, SimpleNamespace(), None, torch.device("cpu"))
    n = FINISHED_KEPT * 4
    for i in range(n):
        rid = f"r{i}"
        state.add_request(i % 4, SimpleNamespace(req_id=rid))
        state.states[i % 4] = object()  # what the sampler's add_request puts there
        for _ in range(3):
            state.prepare_inputs(SimpleNamespace(req_ids=[rid], num_reqs=1), None)
        state.remove_request(rid)
    assert len(state.forwards) == FINISHED_KEPT
    assert state.forwards[f"r{n - 1}"] == 3 and "r0" not in state.forwards
    assert state.states == {} and state.slot_of == {}


def test_refusion_state_does_not_grow_with_finished_requests(bare_model_state: None,
                                                             monkeypatch: pytest.MonkeyPatch
                                                             ) -> None:
    from diffspec.spec_workers.vllm.refusion import ReFusionModelState, ReFusionSampler

    settings = {"slot_size": 8, "num_blocks": 1, "slot_threshold": 0.5,
                "token_threshold": 0.9, "mask_token_id": 5}
    config = SimpleNamespace(diffusion_config=SimpleNamespace(canvas_length=64),
                             additional_config={"diffspec": {"refusion": settings}},
                             cache_config=SimpleNamespace(enable_prefix_caching=True))
    state = ReFusionModelState(config, SimpleNamespace(), None, torch.device("cpu"))
    state.forward = lambda seqs: [None] * len(seqs)
    sampler = object.__new__(ReFusionSampler)
    sampler.state = state

    def rounds(req, first):  # two engine forwards per request
        yield [object()]
        yield [object()]

    monkeypatch.setattr(sampler, "_rounds", rounds)
    n = FINISHED_KEPT * 4
    for i in range(n):
        rid = f"r{i}"
        state.add_request(0, SimpleNamespace(req_id=rid))
        sampler._decode([SimpleNamespace(batch=0)], [None], SimpleNamespace(req_ids=[rid]))
        state.remove_request(rid)
    assert len(state.decode_steps) == FINISHED_KEPT
    assert state.decode_steps[-1] == ([f"r{n - 1}"], 2)
    assert len(state.forwards) == FINISHED_KEPT and state.forwards[f"r{n - 1}"] == 2
