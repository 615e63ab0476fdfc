"""Hook: on a CUDA device, a launch of one of diffspec's SGLang algorithms that names no
attention backend gets ``triton``, the GPU backend diffspec has run them on (SGLang's own
kernels in Triton's interpreter, ``tests/engine/test_sglang_triton.py``), instead of
SGLang's automatic choice.

SGLang picks the backend in ``handle_attention_backend_compatibility``
(``_attention_backend_default``), before any of diffspec's launch hooks run: fa3 on Hopper
(refused for the speculative algorithms, docs/gpu-support.md S6), flashinfer elsewhere
(reasoned only, S4); SGLang's dLLM mode then switches to flashinfer while CUDA graphs are
on (refused for ReFusion, S9; reasoned for FastDLLM, S7). This AROUND hook declares
``attention_backend=triton`` before SGLang's function runs, when the launch uses
``--speculative-algorithm`` ORTHRUS / LINEAR_SELF_SPEC / TIDAR or ``--dllm-algorithm``
FastDLLM / ReFusion, its device is ``cuda`` and no attention backend is set
(``--attention-backend``, ``--prefill-attention-backend``, ``--decode-attention-backend``,
nor an earlier SGLang step); for the dLLM algorithms it also turns CUDA graphs off, which
SGLang's dLLM mode needs to keep triton (the speculative algorithms turn them off
themselves, S2). One log line says so and how to pick another backend. A launch that names
a backend, runs on another device (CPU: SGLang's ``handle_cpu_backends`` picks
torch_native or intel_amx first) or uses another algorithm is unchanged
(:func:`gpu_default_backend`).

This module imports neither torch nor SGLang at import time.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from diffspec.plugin.sglang.config import graphs_disabled, self_spec_algorithms
from diffspec.plugin.sglang.dllm import ALGORITHM as FAST_DLLM
from diffspec.plugin.sglang.hooks import register_around
from diffspec.plugin.sglang.refusion import ALGORITHM as REFUSION

logger = logging.getLogger("diffspec")

__all__ = ["GPU_DEFAULT_BACKEND", "DefaultBackend", "gpu_default_backend",
           "register_default_backend"]

GPU_DEFAULT_BACKEND = "triton"
# per algorithm: SGLang's automatic choice, and what a user names to get another backend
_SPECULATIVE = ("fa3 on Hopper, which diffspec refuses for it; flashinfer elsewhere",
                "name --attention-backend flashinfer to run FlashInfer instead (reasoned, not "
                "run here)")
_DLLM = {
    FAST_DLLM: ("flashinfer with CUDA graphs", "name --attention-backend flashinfer to run "
                "SGLang's dLLM default with its CUDA graphs back on (reasoned, not run here)"),
    REFUSION: ("flashinfer with CUDA graphs, which diffspec refuses for it", "name "
               "--attention-backend torch_native for the only other backend ReFusion runs on"),
}


@dataclass(frozen=True)
class DefaultBackend:
    """What diffspec sets for a launch that named no attention backend on a CUDA device."""

    flag: str  # "--speculative-algorithm" or "--dllm-algorithm"
    algorithm: str
    graphs_off: bool  # turn CUDA graphs off too (they are on, and this is a dLLM algorithm)

    def message(self) -> str:
        """The one log line saying what is set and how to pick another backend."""
        automatic, other = _DLLM.get(self.algorithm, _SPECULATIVE)
        graphs = ("; CUDA graphs off, as --disable-cuda-graph does (SGLang's dLLM mode keeps "
                  "triton only without them)" if self.graphs_off else "")
        return (f"diffspec: {self.flag} {self.algorithm} on a CUDA device with no attention "
                f"backend named: using --attention-backend {GPU_DEFAULT_BACKEND}, the GPU "
                f"backend diffspec has run it on (SGLang's kernels in Triton's interpreter), "
                f"not SGLang's automatic choice ({automatic}; docs/gpu-support.md){graphs}; "
                f"{other}")


def gpu_default_backend(speculative_algorithm, dllm_algorithm, device, backends,
                        graphs_on: bool) -> DefaultBackend | None:
    """What to set for a launch (``backends``: the attention, prefill and decode attention
    backends set so far; ``graphs_on``: whether CUDA graphs are on for the decode phase):
    ``None`` unless the device is ``cuda``, no backend is set and the algorithm is one of
    diffspec's."""
    if str(device).split(":")[0] != "cuda" or any(b is not None for b in backends):
        return None
    if speculative_algorithm is not None:
        name = str(speculative_algorithm).upper()
        if name in self_spec_algorithms():
            return DefaultBackend("--speculative-algorithm", name, graphs_off=False)
        return None
    if dllm_algorithm in (FAST_DLLM, REFUSION):
        return DefaultBackend("--dllm-algorithm", dllm_algorithm, graphs_off=graphs_on)
    return None


def register_default_backend() -> None:
    """Register the AROUND hook (idempotent); SGLang's ``load_plugins()`` applies it."""
    register_around("default_backend", _name_triton)


def _name_triton(original, server_args):
    """AROUND hook of ``handle_attention_backend_compatibility``: declare triton (and, for
    the dLLM algorithms, CUDA graphs off) where :func:`gpu_default_backend` says so, then
    run SGLang's function, which keeps a named backend."""
    from sglang.srt.arg_groups.overrides import declare_resolution, resolving_view
    from sglang.srt.model_executor.cuda_graph_config import Backend

    cfg = resolving_view(server_args)
    graphs = cfg.cuda_graph_config
    choice = gpu_default_backend(
        cfg.speculative_algorithm, cfg.dllm_algorithm, cfg.device,
        (cfg.attention_backend, cfg.prefill_attention_backend, cfg.decode_attention_backend),
        graphs.decode.backend != Backend.DISABLED)
    if choice is not None:
        logger.warning(choice.message())
        declare_resolution(server_args, "diffspec", attention_backend=GPU_DEFAULT_BACKEND)
        if choice.graphs_off:
            declare_resolution(server_args, "diffspec", disable_cuda_graph=True,
                               cuda_graph_config=graphs_disabled(graphs)[0])
    return original(server_args)
