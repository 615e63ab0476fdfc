"""The GPU settings each engine path runs under, without an engine: which attention
backends and CUDA-graph modes are accepted, set, or refused at start, and that every
refusal's first words say what to do (issue 29; the matrix is docs/gpu-support.md). The
same rules run through the engines' own argument objects in
tests/engine/test_gpu_settings.py."""

from __future__ import annotations

import pytest
import torch

from diffspec.core.checkpoint import CheckpointError
from diffspec.plugin.sglang.config import (
    VERIFY_BACKENDS,
    attention_backend_error,
    graphs_off_message,
)
from diffspec.plugin.sglang.default_backend import GPU_DEFAULT_BACKEND, DefaultBackend
# renamed: vLLM's rule of the same name is imported below
from diffspec.plugin.sglang.default_backend import gpu_default_backend as sglang_default
from diffspec.plugin.sglang.dllm import dllm_backend_error, dllm_backends
from diffspec.plugin.vllm.config import attention_backend_error as vllm_backend_error
from diffspec.plugin.vllm.config import cudagraph_plan, gpu_default_backend, named_backends
from diffspec.plugin.vllm.dllm import diffusion_backend_error

pytestmark = pytest.mark.unit

SGLANG_ALGORITHMS = ("ORTHRUS", "LINEAR_SELF_SPEC", "TIDAR")


# ------------------------------------------------------------------ SGLang self-spec


@pytest.mark.parametrize("algorithm", SGLANG_ALGORITHMS)
@pytest.mark.parametrize("backend", VERIFY_BACKENDS)
def test_sglang_verify_backends_run(algorithm: str, backend: str) -> None:
    assert attention_backend_error(algorithm, (backend, backend), page_size=1) is None


@pytest.mark.parametrize("algorithm", SGLANG_ALGORITHMS)
@pytest.mark.parametrize(("backends", "why"), [
    (("fa3", "fa3"), "fa3 plans every TARGET_VERIFY batch at the server's"),
    (("trtllm_mha", "trtllm_mha"), "attention backend trtllm_mha is not one"),
    (("triton", "fa3"), "fa3 plans"),  # a split backend: both halves must be checked ones
    (("fa4", "flashinfer"), "attention backend fa4 is not one"),
])
def test_sglang_other_backends_are_refused(algorithm: str, backends, why: str) -> None:
    error = attention_backend_error(algorithm, backends)
    assert error.startswith("use --attention-backend triton or flashinfer (torch_native on "
                            f"CPU) with --speculative-algorithm {algorithm}: ")
    assert why in error


def test_sglang_tidar_needs_one_token_pages_on_gpu_backends() -> None:
    error = attention_backend_error("TIDAR", ("triton", "triton"), page_size=16)
    assert error.startswith("set --page-size 1 with --speculative-algorithm TIDAR")
    assert attention_backend_error("TIDAR", ("torch_native", "torch_native"), 16) is None
    assert attention_backend_error("ORTHRUS", ("triton", "triton"), 16) is None


def test_sglang_graphs_off_line_says_why_and_cost() -> None:
    line = graphs_off_message("ORTHRUS", ["decode", "prefill"])
    assert "runs without CUDA graphs; turning them off (decode and prefill phase)" in line
    assert "as --disable-cuda-graph does" in line and "Cost:" in line


# ------------------------------------------------------------------ SGLang dLLM

REFUSION_TODO = "use --attention-backend triton with --disable-cuda-graph (torch_native on CPU)"
FAST_DLLM_TODO = "use --attention-backend flashinfer or triton (torch_native on CPU)"



@pytest.mark.parametrize(("algorithm", "backends", "first"), [
    ("ReFusion", ("flashinfer", "flashinfer"), REFUSION_TODO),
    ("ReFusion", ("fa3", "fa3"), REFUSION_TODO),
    ("FastDLLM", ("fa3", "fa3"), FAST_DLLM_TODO),
    ("FastDLLM", ("trtllm_mha", "trtllm_mha"), FAST_DLLM_TODO),
])
def test_sglang_dllm_backends_refused(algorithm: str, backends, first: str) -> None:
    error = dllm_backend_error(algorithm, backends, graphs_on=True)
    assert error.startswith(f"{first} with --dllm-algorithm {algorithm}: "), error
    assert "switches to flashinfer while CUDA graphs are on" in error


@pytest.mark.parametrize("algorithm", ["FastDLLM", "ReFusion"])
def test_sglang_dllm_backends_accepted(algorithm: str) -> None:
    assert "torch_native" in dllm_backends(algorithm)
    assert "triton" in dllm_backends(algorithm)
    for backend in dllm_backends(algorithm):
        assert dllm_backend_error(algorithm, (backend, backend)) is None


# ------------------------------------------------------------ SGLang: a GPU launch naming none

NONE_NAMED = (None, None, None)  # --attention-backend, --prefill-..., --decode-attention-backend


@pytest.mark.parametrize("algorithm", [*SGLANG_ALGORITHMS, "orthrus"])
@pytest.mark.parametrize("graphs_on", [True, False])
def test_sglang_gpu_default_is_triton_for_speculative(algorithm: str, graphs_on: bool) -> None:
    """Issue 46, item 3: not SGLang's fa3 (Hopper: refused) or flashinfer (reasoned only);
    CUDA graphs are left to ``handle_server_args``, which turns them off for these (S2)."""
    name = algorithm.upper()
    choice = sglang_default(algorithm, None, "cuda", NONE_NAMED, graphs_on)
    assert choice == DefaultBackend("--speculative-algorithm", name, graphs_off=False)
    assert GPU_DEFAULT_BACKEND == "triton"
    line = choice.message()
    assert line.startswith(f"diffspec: --speculative-algorithm {name} on a CUDA device with no "
                           f"attention backend named: using --attention-backend triton, ")
    assert "name --attention-backend flashinfer" in line and "CUDA graphs off" not in line
    # what is set runs: triton with one token per page, SGLang's default page size
    assert attention_backend_error(name, (GPU_DEFAULT_BACKEND,) * 2, page_size=1) is None


@pytest.mark.parametrize(("algorithm", "other"), [("FastDLLM", "flashinfer"),
                                                  ("ReFusion", "torch_native")])
def test_sglang_gpu_default_is_triton_without_graphs_for_dllm(algorithm: str, other: str) -> None:
    """SGLang's dLLM mode keeps triton only without CUDA graphs (S11): they go off too."""
    choice = sglang_default(None, algorithm, "cuda", NONE_NAMED, graphs_on=True)
    assert choice == DefaultBackend("--dllm-algorithm", algorithm, graphs_off=True)
    line = choice.message()
    assert "; CUDA graphs off, as --disable-cuda-graph does" in line
    assert f"name --attention-backend {other}" in line
    assert dllm_backend_error(algorithm, (GPU_DEFAULT_BACKEND,) * 2) is None
    # graphs already off (--disable-cuda-graph): triton, nothing more to turn off
    quiet = sglang_default(None, algorithm, "cuda:0", NONE_NAMED, graphs_on=False)
    assert quiet == DefaultBackend("--dllm-algorithm", algorithm, graphs_off=False)
    assert "CUDA graphs off" not in quiet.message()


@pytest.mark.parametrize(("speculative", "dllm", "device", "backends"), [
    ("ORTHRUS", None, "cuda", ("fa3", None, None)),  # a named backend is the user's
    ("TIDAR", None, "cuda", ("flashinfer", None, None)),
    ("LINEAR_SELF_SPEC", None, "cuda", (None, "flashinfer", None)),  # a named half, too
    (None, "ReFusion", "cuda", (None, None, "triton")),
    (None, "FastDLLM", "cuda", ("flashinfer", None, None)),
    ("ORTHRUS", None, "cpu", NONE_NAMED),  # CPU: SGLang's choice (torch_native here)
    (None, "FastDLLM", "cpu", NONE_NAMED),
    ("EAGLE", None, "cuda", NONE_NAMED),  # not diffspec's algorithms
    (None, "LowConfidence", "cuda", NONE_NAMED),
    (None, None, "cuda", NONE_NAMED),
])
def test_sglang_gpu_default_leaves_other_launches(speculative, dllm, device, backends) -> None:
    assert sglang_default(speculative, dllm, device, backends, graphs_on=True) is None


# ------------------------------------------------------------------ vLLM self-spec


@pytest.mark.parametrize("method", ["orthrus", "linear_self_spec", "tidar"])
@pytest.mark.parametrize("named", [None, "auto", "FLASH_ATTN", "CPU_ATTN", "flash_attn",
                                   "TRITON_ATTN", "triton_attn"])
def test_vllm_checked_backends_run(method: str, named) -> None:
    assert vllm_backend_error(method, named) is None


@pytest.mark.parametrize(("config", "on_gpu", "want"), [
    ({}, True, "TRITON_ATTN"),  # none named on a GPU: the backend whose kernels ran here
    ({"backend": "auto"}, True, "TRITON_ATTN"),
    ({}, False, None),  # CPU: vLLM's CPU_ATTN, run here
    ({"backend": "FLASH_ATTN"}, True, None),  # the user's choice stands
    ({"backend": "CPU_ATTN"}, False, None),
    # a per-kind entry overrides the global backend for its layers only: the others still
    # get TRITON_ATTN (and the per-kind one was checked by attention_backend_error)
    ({"backend_per_kind": {"full_attention": "FLASH_ATTN"}}, True, "TRITON_ATTN"),
])
def test_vllm_names_triton_attn_on_a_gpu_when_none_is_named(config, on_gpu, want) -> None:
    assert gpu_default_backend(named_backends(config), on_gpu) == want


@pytest.mark.parametrize(("method", "named", "why"), [
    ("tidar", "FLASHINFER", "share one re-planned wrapper"),
    ("orthrus", "FLASHINFER", "non-causal path out of its default order"),
    ("linear_self_spec", "TRITON_MLA", "not on TRITON_MLA"),
    ("tidar", "FLEX_ATTENTION", "not on FLEX_ATTENTION"),
])
def test_vllm_other_backends_refused(method: str, named: str, why: str) -> None:
    error = vllm_backend_error(method, named)
    assert error.startswith(f"use --attention-backend TRITON_ATTN or FLASH_ATTN (GPU) or "
                            f"CPU_ATTN (CPU) with method {method!r}: "), error
    assert why in error


@pytest.mark.parametrize(("method", "adaptive", "mode", "eager", "gpu", "want"), [
    ("tidar", False, None, False, True, "PIECEWISE"),  # set, with a log line
    ("tidar", False, None, False, False, None),  # CPU: no CUDA graphs to change
    ("tidar", False, "PIECEWISE", False, True, None),
    ("tidar", False, "NONE", False, True, None),
    ("tidar", False, "FULL", True, True, None),  # --enforce-eager: no graphs at all
    ("orthrus", False, None, False, True, None),  # fixed width: vLLM's graphs as they are
    ("orthrus", False, "FULL_AND_PIECEWISE", False, True, None),
    ("orthrus", True, None, False, True, "PIECEWISE"),  # adaptive: the width varies
    ("linear_self_spec", True, "PIECEWISE", False, True, None),
])
def test_vllm_cudagraph_plan(method, adaptive, mode, eager, gpu, want) -> None:
    assert cudagraph_plan(method, adaptive, mode, eager, gpu) == want


@pytest.mark.parametrize(("mode", "eager", "gpu", "want"), [
    (None, False, True, "PIECEWISE"), (None, False, False, None), ("PIECEWISE", False, True, None),
    ("NONE", False, True, None), ("FULL", True, True, None),
])
def test_vllm_v2_runner_cudagraph_plan(mode, eager, gpu, want) -> None:
    """On vLLM's V2 model runner the two-pass methods run PIECEWISE graphs at most (V11)."""
    assert cudagraph_plan("orthrus", False, mode, eager, gpu, v2_runner=True) == want
    if mode is None and gpu:
        assert cudagraph_plan("orthrus", False, mode, eager, gpu) is None  # V1: vLLM's own


@pytest.mark.parametrize(("method", "adaptive", "mode"), [
    ("tidar", False, "FULL"), ("tidar", False, "FULL_AND_PIECEWISE"),
    ("tidar", False, "FULL_DECODE_ONLY"), ("orthrus", True, "FULL_AND_PIECEWISE"),
])
def test_vllm_full_graphs_refused(method: str, adaptive: bool, mode: str) -> None:
    with pytest.raises(CheckpointError) as info:
        cudagraph_plan(method, adaptive, mode, False, True)
    assert str(info.value).startswith("set compilation_config's cudagraph_mode to PIECEWISE "
                                      f"or NONE (or add --enforce-eager, or leave "
                                      f"cudagraph_mode out) for method {method!r}: ")


@pytest.mark.parametrize(("mode", "eager", "gpu", "want"), [
    (None, False, True, "NONE"), (None, False, False, None), ("NONE", False, True, None),
    ("FULL", True, True, None),
])
def test_vllm_v2_runner_tidar_runs_eager(mode, eager, gpu, want) -> None:
    """TiDAR's branches join the target forward in the model's Python forward on the V2
    runner, which a graph replay skips: no CUDA graphs there (V1: PIECEWISE)."""
    assert cudagraph_plan("tidar", False, mode, eager, gpu, v2_runner=True) == want


@pytest.mark.parametrize("mode", ["PIECEWISE", "FULL", "FULL_AND_PIECEWISE"])
def test_vllm_v2_runner_tidar_graphs_refused(mode: str) -> None:
    with pytest.raises(CheckpointError) as info:
        cudagraph_plan("tidar", False, mode, False, True, v2_runner=True)
    assert str(info.value).startswith(
        "set compilation_config's cudagraph_mode to NONE (or add --enforce-eager, or leave "
        "cudagraph_mode out) for method 'tidar' on vLLM's V2 model runner, or unset "
        "VLLM_USE_V2_MODEL_RUNNER"), info.value


@pytest.mark.parametrize("mode", ["FULL", "FULL_AND_PIECEWISE", "FULL_DECODE_ONLY"])
def test_vllm_v2_runner_full_graphs_refused(mode: str) -> None:
    with pytest.raises(CheckpointError) as info:
        cudagraph_plan("linear_self_spec", False, mode, False, True, v2_runner=True)
    assert str(info.value).startswith("set compilation_config's cudagraph_mode to PIECEWISE ")
    assert "V2 model runner" in str(info.value)


# ------------------------------------------------------------------ vLLM diffusion path


@pytest.mark.parametrize(("named", "fa"), [(None, None), ("auto", None), ("TRITON_ATTN", None),
                                           ("CPU_ATTN", None), ("FLASH_ATTN", 4)])
def test_vllm_diffusion_backends_run(named, fa) -> None:
    assert diffusion_backend_error("LLaDAModelLM", named, fa) is None


@pytest.mark.parametrize(("named", "fa"), [("FLASHINFER", None), ("FLASH_ATTN", None),
                                           ("FLASH_ATTN", 3), ("FLEX_ATTENTION", None)])
def test_vllm_diffusion_backends_refused(named: str, fa) -> None:
    error = diffusion_backend_error("LLaDAModelLM", named, fa)
    assert error.startswith("use --attention-backend TRITON_ATTN (GPU; or FLASH_ATTN with "), error
    assert "one causal flag per request" in error and named in error


# ------------------------------------------------------------------ draft logits memory


class _Head:
    """A stand-in for a vLLM model's ``compute_logits`` that records its batch sizes."""

    def __init__(self, vocab: int, hidden: int, none: bool = False) -> None:
        self.weight = torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(0))
        self.rows: list[int] = []
        self.none = none

    def compute_logits(self, states: torch.Tensor) -> torch.Tensor | None:
        self.rows.append(states.shape[0])
        return None if self.none else states @ self.weight.T


def test_draft_logits_are_computed_in_bounded_chunks() -> None:
    """A long batch (3000 draft rows, more than DRAFT_LOGITS_ROWS) never materialises more
    than DRAFT_LOGITS_ROWS rows of logits at once, and drafts the same tokens as one
    whole-batch computation (issue 29 row 8: vLLM's two-pass and TiDAR proposers)."""
    from diffspec.spec_workers.vllm.proposer import DRAFT_LOGITS_ROWS, draft_argmax

    head = _Head(vocab=97, hidden=16)
    hidden = torch.randn(3500, 16, generator=torch.Generator().manual_seed(1))
    rows = torch.randperm(3500, generator=torch.Generator().manual_seed(2))[:3000]
    tokens = draft_argmax(head, hidden, rows)
    assert tokens == (hidden[rows] @ head.weight.T).argmax(-1).tolist()
    assert max(head.rows) == DRAFT_LOGITS_ROWS and sum(head.rows) == 3000
    assert len(head.rows) == -(-3000 // DRAFT_LOGITS_ROWS)
    assert draft_argmax(head, hidden, rows[:0]) == []
    assert draft_argmax(_Head(97, 16, none=True), hidden, rows) is None  # a TP rank w/o logits


def test_vllm_named_backends_read_backend_per_kind() -> None:
    """Issue 45, item 5: vLLM's selector gives a layer of a kind listed in
    ``backend_per_kind`` that backend instead of the global one, so the backends a launch
    names are the global one and every per-kind entry ("auto" and unset left out)."""
    from types import SimpleNamespace

    from diffspec.plugin.vllm.config import named_backends, per_kind_note

    enum = SimpleNamespace(name="FLASHINFER")  # vLLM's parsed AttentionBackendEnum member
    config = SimpleNamespace(backend=None, backend_per_kind={"full_attention": enum,
                                                             "sliding_window": "auto"})
    assert named_backends(config) == [
        ("backend_per_kind['full_attention'] of --attention-config", "FLASHINFER")]
    assert named_backends(config, "cpu_attn")[0] == ("--attention-backend", "CPU_ATTN")
    assert named_backends({"backend": "AUTO"}) == []
    assert named_backends(None) == []
    assert per_kind_note("--attention-backend") == ""
    assert per_kind_note(named_backends(config)[0][0]).startswith(" (named in backend_per_kind")
