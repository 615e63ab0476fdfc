"""SGLang config: the ``CustomSpecAlgo`` subclass (:func:`spec_class`) that answers what
SGLang's scheduler asks of diffspec's speculative algorithms and fixes the server
arguments they need, and :func:`validate_server_args`, which checks a launch against the
served checkpoint (one place, clear errors). The algorithms themselves (names, methods,
architectures, workers) come from the registry (:mod:`diffspec.methods`).

This module imports neither torch nor SGLang at import time.
"""

from __future__ import annotations

import logging

from diffspec.core.checkpoint import (
    CheckpointError,
    inspect_checkpoint,
    require_method,
    validate_block_size,
)
from diffspec.methods import Method, methods_for_engine

logger = logging.getLogger("diffspec")

__all__ = ["self_spec_algorithms", "spec_class", "validate_server_args"]


def self_spec_algorithms() -> dict[str, Method]:
    """diffspec's methods served through ``--speculative-algorithm``, by algorithm name."""
    return methods_for_engine("sglang")


def validate_server_args(server_args) -> None:
    """Check a self-speculative launch against the served checkpoint; raise
    :class:`~diffspec.core.checkpoint.CheckpointError` (a ``ValueError``) naming the
    problem: a checkpoint of another family or without diffusion weights, more draft
    tokens than its block holds, a separate draft model, or a parallel layout the worker
    does not support."""
    name = str(server_args.speculative_algorithm).upper()
    method = self_spec_algorithms()[name]
    model = server_args.model_path
    info = inspect_checkpoint(model)
    require_method(info, method.name)
    if info.architecture not in method.architectures:
        raise CheckpointError(
            f"checkpoint {model} has architecture {info.architecture!r}; "
            f"--speculative-algorithm {name} is served by {', '.join(method.architectures)}")
    draft = server_args.speculative_draft_model_path
    if draft is not None and str(draft) != str(model):
        raise CheckpointError(
            f"--speculative-algorithm {name} drafts with the served model itself; it takes no "
            f"--speculative-draft-model-path (got {draft!r})")
    width = server_args.speculative_num_draft_tokens
    if width is not None:
        if isinstance(width, bool) or not isinstance(width, int) or width < 2:
            raise CheckpointError(f"--speculative-num-draft-tokens must be an int >= 2 (the "
                                  f"anchor + at least one draft), got {width!r}")
        try:
            validate_block_size(info, width - 1)
        except CheckpointError as exc:
            raise CheckpointError(f"--speculative-num-draft-tokens {width} is the anchor plus "
                                  f"{width - 1} drafts: {exc}") from None
    for flag, value in (("--tp-size", server_args.tp_size), ("--pp-size", server_args.pp_size),
                        ("--dp-size", server_args.dp_size)):
        if value not in (None, 1):
            raise CheckpointError(f"--speculative-algorithm {name} supports {flag} 1 only "
                                  f"(got {value})")
    if getattr(server_args, "speculative_eagle_topk", None) not in (None, 1):
        raise CheckpointError(f"--speculative-algorithm {name} drafts one linear block; "
                              f"--speculative-eagle-topk must be 1")


def spec_class():
    """The ``CustomSpecAlgo`` subclass (built lazily: SGLang is imported only here)."""
    from sglang.srt.speculative.spec_registry import CustomSpecAlgo

    class SelfSpecAlgo(CustomSpecAlgo):
        """What SGLang's scheduler asks of a self-speculative algorithm."""

        def has_draft_kv(self) -> bool:
            return False  # the diffusion view writes no K/V; verify writes W slots

        def carries_draft_hidden_states(self) -> bool:
            return False

        def need_topk(self) -> bool:
            return False

        def create_future_map(self, device, req_to_token_pool, needs_cpu_seq_lens=True,
                              needs_confidence_relay=False):
            from sglang.srt.managers.overlap_utils import FutureMap

            return FutureMap(device, self, req_to_token_pool, needs_cpu_seq_lens,
                             needs_confidence_relay)

        def handle_server_args(self, server_args) -> None:
            """One linear block per step; synchronous scheduling; no mixed chunks."""
            info = inspect_checkpoint(server_args.model_path)
            if server_args.speculative_num_draft_tokens is None:
                server_args.speculative_num_draft_tokens = int(info.block_size)
            server_args.speculative_num_steps = 1
            server_args.speculative_eagle_topk = 1
            if not server_args.disable_overlap_schedule:
                logger.warning(
                    "diffspec: --speculative-algorithm %s runs without overlap scheduling "
                    "(each step drafts from the tokens the previous step accepted); "
                    "turning it off, as --disable-overlap-schedule does", self.name)
                server_args.disable_overlap_schedule = True
            server_args.enable_mixed_chunk = False
            if server_args.max_running_requests is None:
                server_args.max_running_requests = 48

        def create_worker(self, server_args):
            from sglang.srt.arg_groups.overrides import resolving_view

            if not resolving_view(server_args).disable_overlap_schedule:
                raise ValueError(f"--speculative-algorithm {self.name} does not support "
                                 f"overlap scheduling: pass --disable-overlap-schedule")
            return self.factory(server_args)

    return SelfSpecAlgo
