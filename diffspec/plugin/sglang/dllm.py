"""SGLang dLLM mode for diffspec's diffusion checkpoints: ``--dllm-algorithm FastDLLM``.

This module imports neither torch nor SGLang at import time.

Design notes: docs/design/plugins.md (section ``diffspec/plugin/sglang/dllm.py``).
"""

from __future__ import annotations

import logging
from typing import Any

from diffspec.core.checkpoint import CheckpointError, inspect_checkpoint, require_method
from diffspec.methods import FAMILIES, get_method
from diffspec.plugin.sglang.config import yaml_mapping

logger = logging.getLogger("diffspec")

__all__ = ["ALGORITHM", "configure_dllm_server_args", "dllm_architectures", "dllm_backend_error",
           "dllm_backends", "dllm_config", "fast_dllm_options", "register_dllm"]

ALGORITHM = get_method("fast_dllm").sglang.name  # "FastDLLM"
_OPTIONS = ("threshold", "block_size", "sub_block_size", "cache")
SGLANG_CACHES = ("prefix", "dual")  # cache strategies FastDLLM runs in SGLang
DUAL_CACHE_BACKEND = "torch_native"  # the attention backend the dual cache runs on
# Attention backends each dLLM algorithm runs on (checked by its ``configure_server_args``,
# which SGLang's ``handle_dllm_inference`` calls at start, after it picked the backend:
# flashinfer when CUDA graphs are on). FastDLLM's prefix cache runs SGLang's own dLLM
# forward (``DllmAlgorithm.run``: one DLLM_EXTEND over each request's whole block, what
# SGLang's LowConfidence runs on flashinfer, with or without its graphs; triton's kernels ran
# it in Triton's interpreter in the engine tier, tests/engine/test_sglang_triton.py; SGLang
# itself switches to flashinfer while CUDA graphs are on, and to triton on AMD GPUs);
# ReFusion's ragged forwards (their own prefix and query lengths per row, slots in commit
# order, scratch ``req_to_token`` rows) are verified on torch_native and on triton (its
# kernels in Triton's interpreter, same test), which run them without CUDA graphs.
FAST_DLLM_BACKENDS = ("torch_native", "flashinfer", "triton")
REFUSION_BACKENDS = ("torch_native", "triton")


def dllm_backends(algorithm: str) -> tuple[str, ...]:
    """The attention backends ``--dllm-algorithm algorithm`` (FastDLLM, ReFusion) runs on."""
    return REFUSION_BACKENDS if algorithm == "ReFusion" else FAST_DLLM_BACKENDS
_registered = False


def dllm_architectures() -> tuple[str, ...]:
    """Architectures ``--dllm-algorithm FastDLLM`` serves: those of the ``fast_dllm``
    method's families that have an SGLang model class (NLD's, which is also its
    self-speculative model, runs its diffusion mode in dLLM mode:
    :mod:`diffspec.model_executors.sglang.nld`)."""
    method = get_method("fast_dllm")
    return tuple(arch for fam in method.families for arch in FAMILIES[fam].sglang_models)


def register_dllm() -> None:
    """Add ``FastDLLM`` to SGLang's dLLM algorithms and hook ``DllmConfig`` (idempotent)."""
    global _registered
    if _registered:
        return
    from sglang.srt.dllm.algorithm import algo_name_to_cls

    from diffspec.plugin.sglang.hooks import register_around
    from diffspec.plugin.sglang.refusion import ALGORITHM as REFUSION
    from diffspec.spec_workers.sglang.fast_dllm import FastDLLM
    from diffspec.spec_workers.sglang.refusion import ReFusion

    FastDLLM.supported_architectures = dllm_architectures()
    for name, cls in ((ALGORITHM, FastDLLM), (REFUSION, ReFusion)):
        # SGLang's launch-time hook (DllmAlgorithm.configure_server_args, called by
        # handle_dllm_inference): installed here so the workers import nothing of the plugin
        cls.configure_server_args = classmethod(_launch_check(name))
        algo_name_to_cls.setdefault(name, cls)
    register_around("dllm", _from_server_args)
    _registered = True


def _from_server_args(original, server_args):
    """AROUND hook of ``DllmConfig.from_server_args``: diffspec's architectures here,
    every other one in SGLang's own function."""
    from sglang.srt.arg_groups.overrides import resolving_view

    from diffspec.plugin.sglang.refusion import ALGORITHM as REFUSION
    from diffspec.plugin.sglang.refusion import refusion_dllm_config

    cfg = resolving_view(server_args)
    if cfg.dllm_algorithm is None:
        return original(server_args)
    if cfg.dllm_algorithm == REFUSION:  # a stock Qwen3 architecture: ReFusion's own config
        return refusion_dllm_config(cfg)
    try:
        info = inspect_checkpoint(cfg.model_path)
    except CheckpointError:
        if cfg.dllm_algorithm == ALGORITHM:
            raise
        return original(server_args)
    if info.architecture in dllm_architectures():
        return dllm_config(cfg, info)
    if cfg.dllm_algorithm == ALGORITHM:
        raise CheckpointError(
            f"serve a {' / '.join(dllm_architectures())} checkpoint with --dllm-algorithm "
            f"{ALGORITHM}; {cfg.model_path} is {info.architecture!r} (family {info.family!r})")
    return original(server_args)


def dllm_config(cfg: Any, info=None):
    """The ``DllmConfig`` of a FastDLLM launch (``cfg``: server arguments), checked against
    the served checkpoint; :class:`CheckpointError` (first line: what to do) otherwise."""
    from sglang.srt.dllm.config import DllmConfig

    from diffspec.spec_workers.reference.fast_dllm import FastDLLMConfig

    info = info or inspect_checkpoint(cfg.model_path)
    if cfg.dllm_algorithm != ALGORITHM:
        raise CheckpointError(
            f"use --dllm-algorithm {ALGORITHM} for checkpoint {cfg.model_path} "
            f"({info.architecture}); --dllm-algorithm {cfg.dllm_algorithm} does not serve it")
    require_method(info, "fast_dllm")
    if info.architecture not in dllm_architectures():
        raise CheckpointError(
            f"serve checkpoint {cfg.model_path} with the reference decoder: architecture "
            f"{info.architecture!r} has no SGLang model in diffspec yet (FastDLLM in SGLang "
            f"serves {', '.join(dllm_architectures())})")
    options = fast_dllm_options(cfg.dllm_algorithm_config)
    cache = options.get("cache", "prefix")
    if cache not in SGLANG_CACHES:
        raise CheckpointError(
            f"set cache: prefix or dual in {cfg.dllm_algorithm_config} (or leave it out: "
            f"prefix), or run cache {cache!r} on the reference decoder (diffspec generate "
            f"--method fast_dllm --cache {cache}): SGLang's dLLM scheduler keeps the KV of "
            f"a request's earlier blocks, so each step runs at most the current block (the "
            f"prefix cache; cache none would recompute the prompt and every earlier block "
            f"at every step, with the same result on this layout)")
    try:
        config = FastDLLMConfig(cache=cache, threshold=options.get("threshold", FastDLLMConfig.threshold),
                                block_size=options.get("block_size"),
                                sub_block_size=options.get("sub_block_size"),
                                attention="block_causal")
        block, sub = config.sizes(info)
    except ValueError as exc:
        raise CheckpointError(f"fix {cfg.dllm_algorithm_config or 'the dLLM settings'}: "
                              f"{exc}") from None
    backend = getattr(cfg, "attention_backend", None)
    if cache == "dual" and backend != DUAL_CACHE_BACKEND:
        raise CheckpointError(_dual_cache_backend_error(backend, cfg.dllm_algorithm_config))
    if cache == "dual" and sub == block:
        logger.warning(
            "diffspec FastDLLM: cache: dual with sub_block_size == block_size (%d) computes "
            "what cache: prefix does (the window is the whole block); set sub_block_size "
            "below block_size in %s for the dual cache's sub-block window", block,
            cfg.dllm_algorithm_config)
    return DllmConfig(
        algorithm=ALGORITHM,
        algorithm_config={"threshold": config.threshold, "block_size": block,
                          "sub_block_size": sub, "cache": cache,
                          "logits_shift": info.logits_shift,
                          "turn_end_ids": _turn_end_ids(info)},
        block_size=block,
        mask_id=int(info.mask_token_id),
        max_running_requests=cfg.max_running_requests or 1,
        first_done_first_out_mode=cfg.dllm_fdfo,
    )


def _dual_cache_backend_error(backend: str | None, config_path: str | None) -> str:
    return (f"set --attention-backend {DUAL_CACHE_BACKEND} for cache: dual (now: "
            f"{backend or 'SGLang picks one'}), or set cache: prefix in {config_path}: a "
            f"window-only step reorders the request's req_to_token row so that the window is "
            f"the forward's tail, which {DUAL_CACHE_BACKEND} reads token by token; backends "
            f"that read the KV in pages (SGLang's dLLM mode makes a page one block) cannot see "
            f"that order, and the dual cache is not verified on them")


def dllm_backend_error(algorithm: str, backends, graphs_on: bool = False) -> str | None:
    """Why ``--dllm-algorithm algorithm`` cannot run on the resolved attention ``backends``
    (``(prefill, decode)``), first words what to do; ``None`` when it can."""
    allowed = dllm_backends(algorithm)
    wrong = [b for b in dict.fromkeys(backends) if b is not None and b not in allowed]
    if not wrong:
        return None
    if algorithm == "ReFusion":
        why = ("its forwards are ragged causal extends with their own prefix and query "
               "lengths per row, over slots in commit order and borrowed req_to_token rows, "
               "and SGLang's dLLM CUDA graphs replay inputs of bs * block_size tokens, which "
               "they are not; verified on torch_native and triton without CUDA graphs")
        todo = ("use --attention-backend triton with --disable-cuda-graph (torch_native on "
                "CPU)")
    else:
        why = ("FastDLLM runs SGLang's own dLLM block forward, which diffspec has checked on "
               "torch_native (CPU) and triton (its kernels in Triton's interpreter) and "
               "reasoned for flashinfer, the backend SGLang's dLLM mode picks with CUDA graphs")
        todo = "use --attention-backend flashinfer or triton (torch_native on CPU)"
    graphs = (" (SGLang's dLLM mode switches to flashinfer while CUDA graphs are on)"
              if graphs_on else "")
    return (f"{todo} with --dllm-algorithm {algorithm}: attention backend "
            f"{', '.join(wrong)}{graphs} is not one it runs on: {why}")


def _launch_check(algorithm: str):
    """``configure_server_args`` of the dLLM algorithm ``algorithm``."""
    def configure_server_args(cls, server_args) -> None:
        """Refuse an attention backend the algorithm does not run on
        (:func:`dllm_backend_error`)."""
        configure_dllm_server_args(algorithm, server_args)
    return configure_server_args


def configure_dllm_server_args(algorithm: str, server_args) -> None:
    """``DllmAlgorithm.configure_server_args`` of diffspec's dLLM algorithms: refuse an
    attention backend they do not run on (:func:`dllm_backend_error`)."""
    from sglang.srt.arg_groups.model_override_base import attention_backends_of
    from sglang.srt.arg_groups.overrides import resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend

    cfg = resolving_view(server_args)
    backends = attention_backends_of(cfg)
    if algorithm == ALGORITHM:  # the dual cache runs on torch_native only: say so first
        cache = fast_dllm_options(cfg.dllm_algorithm_config).get("cache", "prefix")
        wrong = [b for b in backends if b is not None and b != DUAL_CACHE_BACKEND]
        if cache == "dual" and wrong:
            raise CheckpointError(_dual_cache_backend_error(wrong[0], cfg.dllm_algorithm_config))
    graphs = getattr(cfg, "cuda_graph_config", None)
    graphs_on = graphs is not None and graphs.decode.backend != Backend.DISABLED
    error = dllm_backend_error(algorithm, backends, graphs_on)
    if error:
        raise CheckpointError(error)
    neutral_sampling_defaults(algorithm, server_args)
    from diffspec.plugin.sglang.refusion import ALGORITHM as REFUSION
    from diffspec.plugin.sglang.refusion import skip_warmup_it_refuses

    if algorithm == REFUSION:
        skip_warmup_it_refuses(server_args)


def neutral_sampling_defaults(algorithm: str, server_args) -> None:
    """Let a chat request that sets no sampling field be served: with SGLang's default
    ``--sampling-defaults model`` its OpenAI server fills a request's gaps from
    generation_config.json (Qwen3's temperature 0.6, ...), which the greedy dLLM algorithms
    would refuse; ``openai`` fills them with SGLang's own defaults, which they serve
    greedily (:func:`diffspec.spec_workers.sglang.requests.sampling_asked`). Logged once,
    at launch."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    if resolving_view(server_args).sampling_defaults != "model":
        return
    declare_resolution(server_args, "diffspec", sampling_defaults="openai")
    logger.info("diffspec: --dllm-algorithm %s decodes greedily: a request's missing sampling "
                "fields get SGLang's defaults (--sampling-defaults openai), not the model's "
                "generation_config.json; a request may leave every sampling field out or set "
                "temperature 0, and is refused (HTTP 400) for any other sampling value",
                algorithm)


def _turn_end_ids(info) -> list[int]:
    """The chat template's turn-end token (a stop besides the config's EOS), if any."""
    from transformers import AutoTokenizer

    from diffspec.spec_workers.reference.fast_dllm import turn_end_token_ids

    try:
        tokenizer = AutoTokenizer.from_pretrained(str(info.path), trust_remote_code=False)
    except (OSError, ValueError):
        return []
    return list(turn_end_token_ids(tokenizer))


def fast_dllm_options(path: str | None) -> dict[str, Any]:
    """The FastDLLM settings in the ``--dllm-algorithm-config`` YAML ``path`` (``{}``
    without one; also what the benchmark driver's ``--fast-dllm-config`` gives the
    reference decoder); a :class:`CheckpointError` for an unknown key."""
    options = yaml_mapping(path, _OPTIONS)
    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise CheckpointError(f"remove {', '.join(unknown)} from {path}: FastDLLM takes "
                              f"{', '.join(_OPTIONS)}")
    return options
