"""SGLang registration (entry point ``sglang.srt.plugins: diffspec``).

SGLang loads plugins once per process (server, scheduler, detokenizer, data-parallel
workers), so :func:`register` is idempotent. It refuses unsupported SGLang versions, then

* registers the checkpoints' ``model_type`` names with transformers' ``AutoConfig`` (so
  ``"orthrus"`` / ``"nemotron_labs_diffusion"`` load without remote code) and diffspec's
  model classes in SGLang's ``ModelRegistry`` (:data:`MODEL_ARCHITECTURES`);
* registers the two self-speculative algorithms (:data:`SELF_SPEC_ALGORITHMS`) through
  SGLang's own plugin API, ``SpeculativeAlgorithm.register``, with a ``CustomSpecAlgo``
  subclass (:class:`SelfSpecAlgo`) that answers what the scheduler asks of an algorithm,
  fixes the server arguments they need and validates the rest against the checkpoint
  (:func:`validate_server_args`: one place, clear errors).

No hook (``HookRegistry``) and no patch is needed: see ``diffspec/plugin/patches.md``.
This module imports neither torch nor SGLang at import time.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass

from diffspec.core.checkpoint import (
    CheckpointError,
    inspect_checkpoint,
    require_method,
    validate_block_size,
)
from diffspec.plugin.versions import check_engine_version

logger = logging.getLogger("diffspec")

__all__ = ["MODEL_ARCHITECTURES", "SELF_SPEC_ALGORITHMS", "SelfSpecAlgorithm", "register",
           "validate_server_args"]

# Architecture name (config.json "architectures") -> "module:Class".
MODEL_ARCHITECTURES: dict[str, str] = {
    "OrthrusLM": "diffspec.model_executors.sglang_orthrus:OrthrusForCausalLM",
    "OrthrusForCausalLM": "diffspec.model_executors.sglang_orthrus:OrthrusForCausalLM",
    "OrthrusLlamaForCausalLM":
        "diffspec.model_executors.sglang_orthrus:OrthrusLlamaForCausalLM",
    "NemotronLabsDiffusionModel":
        "diffspec.model_executors.sglang_nld:NemotronLabsDiffusionForCausalLM",
}

MODEL_TYPES: dict[str, str] = {
    "orthrus": "diffspec.plugin.hf_configs:OrthrusConfig",
    "nemotron_labs_diffusion": "diffspec.plugin.hf_configs:NemotronLabsDiffusionConfig",
}


@dataclass(frozen=True)
class SelfSpecAlgorithm:
    """A self-speculative algorithm as SGLang sees it: its ``--speculative-algorithm``
    name, diffspec's method name, the architectures that serve it and its worker."""

    name: str
    method: str
    architectures: tuple[str, ...]
    worker: str  # "module:Class"


SELF_SPEC_ALGORITHMS: dict[str, SelfSpecAlgorithm] = {
    "ORTHRUS": SelfSpecAlgorithm(
        "ORTHRUS", "orthrus", ("OrthrusLM", "OrthrusForCausalLM", "OrthrusLlamaForCausalLM"),
        "diffspec.spec_workers.sglang_self_spec:OrthrusWorker"),
    "LINEAR_SELF_SPEC": SelfSpecAlgorithm(
        "LINEAR_SELF_SPEC", "linear_self_spec", ("NemotronLabsDiffusionModel",),
        "diffspec.spec_workers.sglang_self_spec:LinearSelfSpecWorker"),
}

_registered = False


def _load(target: str):
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


def validate_server_args(server_args) -> None:
    """Check a self-speculative launch against the served checkpoint; raise
    :class:`~diffspec.core.checkpoint.CheckpointError` (a ``ValueError``) naming the
    problem: a checkpoint of another family or without diffusion weights, more draft
    tokens than its block holds, a separate draft model, or a parallel layout the worker
    does not support."""
    name = str(server_args.speculative_algorithm).upper()
    algo = SELF_SPEC_ALGORITHMS[name]
    model = server_args.model_path
    info = inspect_checkpoint(model)
    require_method(info, algo.method)
    if info.architecture not in algo.architectures:
        raise CheckpointError(
            f"checkpoint {model} has architecture {info.architecture!r}; "
            f"--speculative-algorithm {name} is served by {', '.join(algo.architectures)}")
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


def _spec_class():
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


def register() -> None:
    """Register diffspec with the running SGLang. Safe to call any number of times."""
    global _registered
    if _registered:
        return
    from importlib.metadata import version

    check_engine_version("sglang", version("sglang"))
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from diffspec.plugin.hf_configs import register_model_types

    register_model_types(MODEL_TYPES)
    for arch, target in MODEL_ARCHITECTURES.items():
        ModelRegistry.models.setdefault(arch, _load(target))
    spec_class = _spec_class()
    for name, algo in SELF_SPEC_ALGORITHMS.items():
        if get_spec(name) is None:
            worker = algo.worker
            SpeculativeAlgorithm.register(
                name, supports_overlap=False, validate_server_args=validate_server_args,
                spec_class=spec_class)(lambda server_args, worker=worker: _load(worker))
    _registered = True
    logger.info("diffspec plugin loaded into SGLang %s (architectures: %s; speculative "
                "algorithms: %s)", version("sglang"), ", ".join(MODEL_ARCHITECTURES),
                ", ".join(SELF_SPEC_ALGORITHMS))
