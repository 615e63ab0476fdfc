"""The torch-native decode-rows hook (diffspec.plugin.sglang.decode_rows): grouping rows by
request gives each row the attention SGLang's per-row loop gives it (one query over the
row's first seq_len keys of its request's req_to_token row). The loop is written out here
with torch's SDPA, as SGLang's backend runs it; SGLang itself is not imported."""

from __future__ import annotations

import pytest
import torch
from torch.nn.functional import scaled_dot_product_attention

from diffspec.plugin.sglang.decode_rows import _grouped, request_runs


def test_request_runs():
    assert request_runs([]) == []
    assert request_runs([3]) == [(0, 1)]
    assert request_runs([3, 3, 3, 1, 1, 5]) == [(0, 3), (3, 5), (5, 6)]
    assert request_runs([2, 1, 2]) == [(0, 1), (1, 2), (2, 3)]  # not adjacent: not one run


def _per_row(query, k_cache, v_cache, req_to_token, pools, lens, scaling, gqa):
    """SGLang's ``_run_sdpa_forward_decode`` loop: one gather and one SDPA per row."""
    out = torch.empty_like(query)
    q = query.movedim(0, 1)  # [heads, rows, hd]
    for i, (pool, n) in enumerate(zip(pools, lens, strict=True)):
        tokens = req_to_token[pool, :n]
        key, value = k_cache[tokens].movedim(0, 1), v_cache[tokens].movedim(0, 1)
        o = scaled_dot_product_attention(q[:, i:i + 1][None], key[None], value[None],
                                         enable_gqa=gqa, scale=scaling)
        out[i] = o[0].movedim(1, 0)[0]
    return out


@pytest.mark.parametrize("causal_chain", [True, False])
@pytest.mark.parametrize("kv_heads", [3, 1])
def test_grouped_rows_equal_the_per_row_loop(causal_chain, kv_heads):
    g = torch.Generator().manual_seed(0)
    heads, hd, slots = 3, 8, 64
    k_cache = torch.randn(slots, kv_heads, hd, generator=g, dtype=torch.float64)
    v_cache = torch.randn(slots, kv_heads, hd, generator=g, dtype=torch.float64)
    req_to_token = torch.randperm(slots, generator=g).reshape(4, 16)  # [reqs, ctx]
    # two requests, W = 4 rows each (committed 5 and 9), and one plain decode row
    committed, w = {2: 5, 0: 9}, 4
    pools, lens = [], []
    for pool, c in committed.items():
        pools += [pool] * w
        lens += [c + j + 1 for j in range(w)] if causal_chain else [c + w] * w
    pools.append(3)
    lens.append(11)
    query = torch.randn(len(pools), heads, hd, generator=g, dtype=torch.float64)
    got = _grouped(query, torch.empty_like(query), k_cache, v_cache, req_to_token, pools,
                   lens, request_runs(pools), 0.3, kv_heads != heads)
    want = _per_row(query, k_cache, v_cache, req_to_token, pools, lens, 0.3,
                    kv_heads != heads)
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
