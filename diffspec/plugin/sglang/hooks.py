"""diffspec's SGLang hooks, one index (:data:`HOOKS`, like vLLM's ``PATCHES``), registered
one way: AROUND hooks in SGLang's ``HookRegistry`` (applied by its ``load_plugins()``), each
target at most once per process, however often the plugin registers (SGLang loads plugins
once per process it starts), and only on an SGLang release the hook was checked against.

"Checked" is a test (``tests/unit/test_engine_sources.py``): every hook's target
(:data:`TARGETS`) and every SGLang base-class method diffspec's classes override
(:data:`OVERRIDES`: an override of a method SGLang renamed would silently never run) is
found, with its parameters and the lines diffspec relies on, in the source of every
release listed here. Why / how / upstream / removal: ``diffspec/plugin/patches.md``.

This module imports neither torch nor SGLang at import time.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from diffspec.plugin.engine_sources import Target
from diffspec.plugin.versions import ALLOW_ENV, release_matches, unsupported_allowed

__all__ = ["HOOKS", "OVERRIDES", "TARGETS", "register_around"]

logger = logging.getLogger("diffspec")

# hook (module of diffspec.plugin.sglang) -> SGLang releases it was checked against
HOOKS: dict[str, tuple[str, ...]] = {
    "headroom": ("0.5.23",),
    "decode_rows": ("0.5.23",),
    "dllm": ("0.5.23",),
    "default_backend": ("0.5.23",),
}

# hook -> what it hooks AROUND in SGLang (and relies on there)
TARGETS: dict[str, Target] = {
    "headroom": Target(
        "sglang.srt.mem_cache.allocation_sizing", "get_req_to_token_extra_context_len", (),
        relies_on=(("sglang.srt.mem_cache.allocation_sizing:get_alloc_reserve_per_decode",
                    "def get_alloc_reserve_per_decode()"),
                   ("sglang.srt.mem_cache.allocation_sizing:get_alloc_page_size",
                    "def get_alloc_page_size()"))),
    "decode_rows": Target(
        "sglang.srt.layers.attention.torch_native_backend",
        "TorchNativeAttnBackend._run_sdpa_forward_decode",
        ("self", "query", "output", "k_cache", "v_cache", "req_to_token", "req_pool_indices",
         "seq_lens", "encoder_lens", "scaling", "enable_gqa", "causal", "is_cross_attn",
         "sliding_window_size")),
    "dllm": Target(
        "sglang.srt.dllm.config", "DllmConfig.from_server_args", ("server_args",),
        relies_on=(("sglang.srt.arg_groups.dllm_hook:handle_dllm_inference",
                    "get_algorithm_cls(cfg.dllm_algorithm).configure_server_args(server_args)"),)),
    "default_backend": Target(
        "sglang.srt.arg_groups.attention_hook", "handle_attention_backend_compatibility",
        ("server_args",),
        relies_on=(
            # the device is resolved, the CUDA graphs parsed and CPU's backend picked before
            # the hooked step; the page size (1: TIDAR on triton) and the dLLM mode after it
            ("sglang.srt.arg_groups.pipeline:run_resolution_pipeline",
             "run_hook(handle_missing_default_values, server_args) ... "
             "run_hook(handle_cuda_graph_config, server_args) ... "
             "run_hook(handle_cpu_backends, server_args) ... "
             "run_hook(handle_attention_backend_compatibility, server_args) ... "
             "run_post_process_pass(server_args, _page_size_default) ... "
             "run_hook(handle_dllm_inference, server_args)"),
            ("sglang.srt.arg_groups.platform_hook:handle_cpu_backends",
             "if cfg.device == \"cpu\": if cfg.attention_backend is None:"),
            # the hooked step fills SGLang's default only where no backend is declared
            ("sglang.srt.arg_groups.attention_hook:handle_attention_backend_compatibility",
             "cfg = resolving_view(server_args) ... "
             "run_post_process_pass(server_args, _attention_backend_default)"),
            ("sglang.srt.arg_groups.overrides:_attention_backend_default",
             "if view.attention_backend is None: backend = get_default_attn_backend("),
            ("sglang.srt.arg_groups.overrides:_page_size_default",
             "if view.page_size is not None: return {} ... "
             "if not get_platform().is_musa: return {\"page_size\": 1}"),
            # the dLLM mode keeps a declared triton while the decode phase's graphs are off
            ("sglang.srt.arg_groups.overrides:_dllm_attention_backend",
             "elif view.cuda_graph_config.decode.backend != Backend.DISABLED: "
             "if view.attention_backend != \"flashinfer\":"),
        )),
}

# SGLang base-class methods diffspec's classes override (TwoPassAlgo / TiDARAlgo:
# CustomSpecAlgo; FastDLLM / ReFusion: DllmAlgorithm), and what calls them
OVERRIDES: tuple[Target, ...] = (
    Target("sglang.srt.speculative.spec_registry", "CustomSpecAlgo.has_draft_kv", ("self",)),
    Target("sglang.srt.speculative.spec_registry", "CustomSpecAlgo.handle_server_args",
           ("self", "server_args"),
           relies_on=(("sglang.srt.arg_groups.speculative_hook:handle_speculative_decoding",
                       "record_foreign_defaults( server_args, "
                       "\"handle_speculative_decoding.custom_algo\", algo.handle_server_args, )"),
                      # handle_server_args runs after the CUDA-graph config is parsed and
                      # the attention backend is picked
                      ("sglang.srt.arg_groups.pipeline:run_resolution_pipeline",
                       "run_hook(handle_cuda_graph_config, server_args) ... "
                       "run_hook(handle_attention_backend_compatibility, server_args) ... "
                       "run_hook(handle_speculative_decoding, server_args) ... "
                       "run_hook(handle_dllm_inference, server_args)"))),
    Target("sglang.srt.speculative.spec_registry",
           "CustomSpecAlgo.resolve_max_speculative_num_draft_tokens", ("self", "server_args")),
    Target("sglang.srt.speculative.spec_registry", "CustomSpecAlgo.create_worker",
           ("self", "server_args")),
    Target("sglang.srt.dllm.algorithm.base", "DllmAlgorithm.configure_server_args",
           ("cls", "server_args")),
    Target("sglang.srt.dllm.algorithm.base", "DllmAlgorithm.validate_request", ("cls", "req")),
    Target("sglang.srt.dllm.algorithm.base", "DllmAlgorithm.run",
           ("self", "model_runner", "forward_batch", "algo_states")),
    Target("sglang.srt.dllm.algorithm.base", "DllmAlgorithm.prepare_inputs",
           ("self", "model_runner", "forward_batch", "states")),
    Target("sglang.srt.model_executor.cuda_graph_config", "with_phase",
           ("config", "phase", "**changes")),
    # the SGLang workers' StepLogits (diffspec/spec_workers/sglang/target_worker.py): a
    # verify forward's logits processor stands in for LogitsProcessor.forward (keeping the
    # final hidden states), then _get_logits computes the rows asked, a chunk at a time
    Target("sglang.srt.layers.logits_processor", "LogitsProcessor.forward",
           ("self", "input_ids", "hidden_states", "lm_head", "logits_metadata",
            "aux_hidden_states", "hidden_states_before_norm")),
    Target("sglang.srt.layers.logits_processor", "LogitsProcessor._get_logits",
           ("self", "hidden_states", "lm_head", "logits_metadata", "embedding_bias",
            "use_logits_buffer")),
    Target("sglang.srt.layers.logits_processor", "LogitsMetadata.from_forward_batch",
           ("cls", "forward_batch")),
)

_registered: set[str] = set()


def register_around(name: str, hook: Callable) -> bool:
    """Register ``hook`` AROUND hook ``name``'s target (:data:`TARGETS`) when the running
    SGLang is a release :data:`HOOKS` lists for it (else log that it is not applied);
    idempotent per hook. Returns whether the hook is in place."""
    if name in _registered:
        return True
    from importlib.metadata import version

    running = version("sglang")
    if not release_matches(running, HOOKS[name]):
        if not unsupported_allowed():
            logger.warning("diffspec: SGLang hook %s is not checked against SGLang %s "
                           "(checked: %s); not applied, so what it does is missing "
                           "(diffspec/plugin/patches.md)", name, running,
                           ", ".join(HOOKS[name]))
            return False
        logger.warning("diffspec: SGLang hook %s is not checked against SGLang %s (checked: "
                       "%s); applied anyway because %s is set", name, running,
                       ", ".join(HOOKS[name]), ALLOW_ENV)
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(TARGETS[name].path, hook, HookType.AROUND)
    _registered.add(name)
    return True
