"""SGLang registration (entry point ``sglang.srt.plugins: diffspec``).

* registers the checkpoints' ``model_type`` names with transformers' ``AutoConfig`` (so
  ``"orthrus"`` / ``"nemotron_labs_diffusion"`` load without remote code) and every
  registry family's SGLang model class in SGLang's ``ModelRegistry``
  (:data:`diffspec.methods.FAMILIES`);
* registers diffspec's speculative algorithms (registry methods with an SGLang entry)
  through SGLang's own plugin API, ``SpeculativeAlgorithm.register``, with the
  ``CustomSpecAlgo`` subclass of the method (``TwoPassAlgo``; ``TiDARAlgo`` for
  ``TIDAR``) and validation of :mod:`diffspec.plugin.sglang.config`;
* adds the ``FastDLLM`` and ``ReFusion`` dLLM algorithms and hooks
  ``DllmConfig.from_server_args`` for their checkpoints (:mod:`diffspec.plugin.sglang.dllm`),
  listed in ``diffspec/plugin/patches.md``;
* hooks ``get_req_to_token_extra_context_len`` so a request's ``req_to_token`` row holds
  the KV window SGLang reserves for a speculative step up to the context end
  (:mod:`diffspec.plugin.sglang.headroom`, also in ``patches.md``);
* hooks the torch-native backend's decode kernel so the rows of one request (the
  self-speculative passes on SGLang's CPU path) read its K/V once, not once per row
  (:mod:`diffspec.plugin.sglang.decode_rows`, also in ``patches.md``);
* hooks ``handle_attention_backend_compatibility`` so a CUDA launch of diffspec's
  algorithms that names no attention backend gets ``triton`` (the GPU backend they have
  run on) instead of SGLang's automatic choice
  (:mod:`diffspec.plugin.sglang.default_backend`, also in ``patches.md``).
This module imports neither torch nor SGLang at import time.

Design notes: docs/design/plugins.md (section ``diffspec/plugin/sglang/__init__.py``).
"""

from __future__ import annotations

import logging

from diffspec.methods import FAMILIES, load_object
from diffspec.plugin.sglang.config import self_spec_algorithms, validate_server_args
from diffspec.plugin.sglang.decode_rows import register_decode_rows
from diffspec.plugin.sglang.default_backend import register_default_backend
from diffspec.plugin.sglang.dllm import register_dllm
from diffspec.plugin.sglang.headroom import register_headroom
from diffspec.plugin.versions import UnsupportedEngineVersion, check_engine_version

logger = logging.getLogger("diffspec")

__all__ = ["register", "validate_server_args"]

_registered = False


def register() -> None:
    """Register diffspec with the running SGLang. Safe to call any number of times."""
    global _registered
    if _registered:
        return
    from importlib.metadata import version

    try:
        check_engine_version("sglang", version("sglang"))
    except UnsupportedEngineVersion as exc:
        # SGLang's loader catches and logs a plugin's exception, so a launch would only
        # say "unknown speculative algorithm": name diffspec's algorithms anyway, each
        # refusing at launch with this message
        _register_refusals(str(exc))
        raise
    from sglang.srt.models.registry import ModelRegistry
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
    from sglang.srt.speculative.spec_registry import get_spec

    from diffspec.plugin.hf_configs import register_model_types
    from diffspec.plugin.sglang.config import spec_class

    architectures = {}
    for family in FAMILIES.values():
        register_model_types(family.hf_configs)
        architectures.update(family.sglang_models)
    for arch, target in architectures.items():
        ModelRegistry.models.setdefault(arch, load_object(target))
    register_dllm()  # --dllm-algorithm FastDLLM / ReFusion
    register_headroom()  # req_to_token rows hold the KV window the scheduler reserves
    register_decode_rows()  # torch-native decode: one K/V read per request, not per row
    register_default_backend()  # a GPU launch naming no attention backend: triton
    algorithms = self_spec_algorithms()
    for name, method in algorithms.items():
        if get_spec(name) is None:
            worker = method.sglang.worker
            SpeculativeAlgorithm.register(
                name, supports_overlap=False, validate_server_args=validate_server_args,
                spec_class=spec_class(method.name),
            )(lambda server_args, worker=worker: load_object(worker))
    _registered = True
    logger.info("diffspec plugin loaded into SGLang %s (architectures: %s; speculative "
                "algorithms: %s)", version("sglang"), ", ".join(architectures),
                ", ".join(algorithms))


def _register_refusals(message: str) -> None:
    """On an SGLang diffspec does not support: register diffspec's speculative and dLLM
    algorithm names with launch validation that raises ``message`` (the version refusal:
    what to install), so a launch that names one says why it cannot run. Best effort: an
    SGLang without these registration points gets the message in its plugin log only."""
    from diffspec.methods import get_method
    from diffspec.plugin.hf_configs import register_model_types
    from diffspec.plugin.sglang.refusion import ALGORITHM as REFUSION

    def refuse(*_args, **_kwargs):
        raise UnsupportedEngineVersion(message)

    class _Refusing(type):  # whatever SGLang reads of the dLLM algorithm first raises
        def __getattr__(cls, name):
            raise UnsupportedEngineVersion(message)

    for family in FAMILIES.values():  # transformers only: the launch reads the config first
        register_model_types(family.hf_configs)

    try:
        from sglang.srt.speculative.spec_info import SpeculativeAlgorithm
        from sglang.srt.speculative.spec_registry import get_spec

        for name in self_spec_algorithms():
            if get_spec(name) is None:
                SpeculativeAlgorithm.register(name, supports_overlap=False,
                                              validate_server_args=refuse)(refuse)
    except Exception:  # noqa: BLE001 - another SGLang: its own registration may differ
        logger.exception("diffspec: could not register its speculative algorithms' refusal")
    try:
        from sglang.srt.dllm.algorithm import algo_name_to_cls

        refusing = _Refusing("UnsupportedSGLang", (), {})
        for name in (get_method("fast_dllm").sglang.name, REFUSION):
            algo_name_to_cls.setdefault(name, refusing)
    except Exception:  # noqa: BLE001
        logger.exception("diffspec: could not register its dLLM algorithms' refusal")
