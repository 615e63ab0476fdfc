"""``--dllm-algorithm ReFusion``: the ``DllmConfig`` of a ReFusion launch (SGLang).

A ReFusion checkpoint is a stock ``Qwen3ForCausalLM``, an architecture SGLang's dLLM
table does not know; the ``DllmConfig.from_server_args`` hook of
:mod:`diffspec.plugin.sglang.dllm` sends ``--dllm-algorithm ReFusion`` here.

YAML keys (``--dllm-algorithm-config``), defaults from the registry's ``refusion`` method
(``GSAI-ML/ReFusion``'s published slot size and thresholds): ``slot_size`` (32),
``slot_threshold`` (0.9), ``token_threshold`` (0.4), ``num_blocks`` (serial blocks per
request, 1; the model card's GSM8K setting is 4), ``block_size`` (the KV block a request
gets, i.e. the most tokens it may generate: 256; a multiple of ``slot_size``).

This module imports neither torch nor SGLang at import time.
"""

from __future__ import annotations

import logging
from typing import Any

from diffspec.core.checkpoint import CheckpointError, inspect_checkpoint, require_method
from diffspec.methods import get_method
from diffspec.plugin.sglang.config import yaml_mapping

logger = logging.getLogger("diffspec")

__all__ = ["ALGORITHM", "DEFAULT_BLOCK_SIZE", "WARMUP_TOKENS", "refusion_dllm_config",
           "refusion_options", "skip_warmup_it_refuses", "warmup_refusal"]

ALGORITHM = get_method("refusion").sglang.name  # "ReFusion"
DEFAULT_BLOCK_SIZE = 256
# SGLang's start-up warm-up: one /generate of max_new_tokens 8, greedy (launch_server's
# _execute_server_warmup); a refused warm-up stops the server
WARMUP_TOKENS = 8
_OPTIONS = ("slot_size", "slot_threshold", "token_threshold", "num_blocks", "block_size")


def refusion_options(options: dict[str, Any], source: str = "the dLLM settings"
                     ) -> dict[str, Any]:
    """Resolved and checked ReFusion settings (registry defaults filled in);
    :class:`CheckpointError` whose first words say what to fix."""
    from diffspec.core.slots import width_error
    from diffspec.spec_workers.reference.refusion import ReFusionConfig

    unknown = sorted(set(options) - set(_OPTIONS))
    if unknown:
        raise CheckpointError(f"remove {', '.join(unknown)} from {source}: ReFusion takes "
                              f"{', '.join(_OPTIONS)}")
    defaults = dict(get_method("refusion").defaults)
    settings = {k: options.get(k, defaults[k]) for k in defaults}
    try:
        config = ReFusionConfig(**settings)
    except ValueError as exc:
        raise CheckpointError(f"fix {source}: {exc}") from None
    block = options.get("block_size", DEFAULT_BLOCK_SIZE)
    why = width_error(block, config.slot_size, config.num_blocks, f"block_size in {source}")
    if why:
        raise CheckpointError(why)
    return {"slot_size": config.slot_size, "slot_threshold": float(config.slot_threshold),
            "token_threshold": float(config.token_threshold), "num_blocks": config.num_blocks,
            "block_size": block}


def refusion_dllm_config(cfg: Any, info=None):
    """The ``DllmConfig`` of ``--dllm-algorithm ReFusion`` (``cfg``: server arguments)."""
    from sglang.srt.dllm.config import DllmConfig

    info = info or inspect_checkpoint(cfg.model_path)
    try:
        require_method(info, "refusion")
    except CheckpointError as exc:
        raise CheckpointError(
            f"serve a ReFusion checkpoint (Qwen3ForCausalLM with mask_token_id in config.json) "
            f"with --dllm-algorithm {ALGORITHM}; {exc}") from None
    source = cfg.dllm_algorithm_config or "the dLLM settings"
    options = refusion_options(yaml_mapping(cfg.dllm_algorithm_config, _OPTIONS), source)
    # Parallel completion borrows one req_to_token row per extra chosen slot, from the
    # pool SGLang sizes by --max-running-requests (large when it is not set)
    borrowed = options["block_size"] // options["slot_size"] - 1
    running = 1
    if cfg.max_running_requests is not None:
        running = cfg.max_running_requests - borrowed
        if running < 1:
            raise CheckpointError(
                f"raise --max-running-requests to at least {borrowed + 1} (got "
                f"{cfg.max_running_requests}): ReFusion's parallel completion borrows up to "
                f"block_size / slot_size - 1 = {borrowed} rows of SGLang's request pool, "
                f"which holds --max-running-requests rows; requests decoding at once: "
                f"--max-running-requests - {borrowed}")
    # first-done-first-out has nothing to do: a request's block is decoded in one step
    if getattr(cfg, "dllm_fdfo", False):
        logger.info("diffspec: --dllm-fdfo has no effect with --dllm-algorithm %s: each "
                    "request's generation is decoded within one scheduler step and "
                    "returned when that step ends", ALGORITHM)
    return DllmConfig(
        algorithm=ALGORITHM,
        algorithm_config={**options, "vocab_size": int(info.config["vocab_size"])},
        block_size=options["block_size"],
        mask_id=int(info.mask_token_id),
        max_running_requests=running,
        first_done_first_out_mode=False,
        requires_separate_context_encoding=True,
    )


def warmup_refusal(options: dict[str, Any]) -> str | None:
    """Why ReFusion with the resolved ``options`` would refuse SGLang's start-up warm-up
    request (:data:`WARMUP_TOKENS` greedy tokens), or ``None``: with ``num_blocks`` > 1 the
    8 tokens, rounded up to whole slots, may not split into the serial blocks (the model
    card's setting, slots of 32 in 4 blocks, does not)."""
    from types import SimpleNamespace

    from diffspec.spec_workers.sglang.requests import refusion_request_error

    warmup = SimpleNamespace(sampling_params=SimpleNamespace(
        max_new_tokens=WARMUP_TOKENS, temperature=1.0, top_k=1))  # greedy, as SGLang stores it
    return refusion_request_error(warmup, options["block_size"], options["slot_size"],
                                  options["num_blocks"])


def skip_warmup_it_refuses(server_args: Any) -> None:
    """Launch check of ``--dllm-algorithm ReFusion``: skip SGLang's start-up warm-up
    request when these settings would refuse it (:func:`warmup_refusal`), which would stop
    the server before it serves anything; logged. A request like it from a client gets the
    400 with what to do."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view

    cfg = resolving_view(server_args)
    if cfg.skip_server_warmup:
        return
    source = cfg.dllm_algorithm_config or "the dLLM settings"
    why = warmup_refusal(refusion_options(yaml_mapping(cfg.dllm_algorithm_config, _OPTIONS),
                                          source))
    if why is None:
        return
    declare_resolution(server_args, "diffspec", skip_server_warmup=True)
    logger.info("diffspec: skipping SGLang's start-up warm-up request (%d tokens): "
                "--dllm-algorithm %s with these settings refuses it (%s), which would stop "
                "the server", WARMUP_TOKENS, ALGORITHM, why)
