"""Engine tier: vLLM's diffusion path (the V2 model runner) with ``--attention-backend
TRITON_ATTN``, the backend the plugin names on a GPU for Fast-dLLM and ReFusion: its own
Triton kernels (``triton_unified_attention``, which reads Fast-dLLM's per-request causal
flags, ``use_per_seq_causal``; ``triton_reshape_and_cache_flash``) and metadata builder run
by Triton's interpreter on CPU through the test-only harness :mod:`tests.engine.vllm_v2_cpu`.

* Fast-dLLM, the batch of ``tests/engine/test_vllm_fast_dllm.py`` (mixed prompt lengths,
  so causal prefills and non-causal blocks share forwards; ``max_tokens`` ending inside a
  block; per-request thresholds; a request's own stop token) on Fast-dLLM v2 (shifted,
  sub-blocks of 8 in blocks of 16; LLaDA passed too, left out for CI's time): tokens and
  forwards equal the reference decoder's with the same layout;
* ReFusion, the mixed-length batch of ``tests/engine/test_vllm_refusion.py``: tokens,
  finish reasons and forwards equal the reference decoder's;
* TRITON_ATTN's kernels ran (launches counted in the worker).

One engine per test; the interpreter is slow, so the batches are those files' small ones.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.engine.test_vllm_fast_dllm import check_batch_matches_reference

TRITON_ATTN_KERNELS = ("vllm.v1.attention.ops.triton_unified_attention.kernel_unified_attention",
                       "vllm.v1.attention.ops.triton_reshape_and_cache_flash."
                       "reshape_and_cache_kernel_flash")


@pytest.mark.engine
@pytest.mark.slow
def test_fast_dllm_on_triton_attn_matches_reference(tmp_path: Path) -> None:
    """Fast-dLLM v2 (shifted, sub-blocks): LLaDA's run took as long (about 4 minutes on the
    loaded 2-core box) and adds no attention layout, so CI runs this one."""
    got = check_batch_matches_reference(tmp_path, "fast_dllm_v2",
                                        attention_backend="TRITON_ATTN")
    assert all(got["kernels"].get(k) for k in TRITON_ATTN_KERNELS), sorted(got["kernels"])


@pytest.mark.engine
@pytest.mark.slow
def test_refusion_on_triton_attn_matches_reference(tmp_path: Path) -> None:
    """ReFusion's mixed-length batch of ``tests/engine/test_vllm_refusion.py`` (causal
    prefills, its planning and parallel-completion forwards, the causal verify) on
    TRITON_ATTN: tokens, finish reasons and forwards are the reference decoder's."""
    from tests.engine.test_vllm_refusion import _batch, assert_batch_equals_reference, run_engine

    got = run_engine({"batch": list(_batch()), "prefix": [], "refused": {},
                      "attention_backend": "TRITON_ATTN"}, tmp_path)
    assert_batch_equals_reference(got)
    assert all(got["kernels"].get(k) for k in TRITON_ATTN_KERNELS), sorted(got["kernels"])
