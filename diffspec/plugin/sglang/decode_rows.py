"""Hook: SGLang's torch-native decode kernel reads a request's K/V once for all of its rows.

Design notes: docs/design/plugins.md (section ``diffspec/plugin/sglang/decode_rows.py``).
"""

from __future__ import annotations

from diffspec.plugin.sglang.hooks import register_around

__all__ = ["register_decode_rows"]


def register_decode_rows() -> None:
    """Register the AROUND hook (idempotent); SGLang's ``load_plugins()`` applies it."""
    register_around("decode_rows", _forward_decode)


def request_runs(req_pool_indices: list[int]) -> list[tuple[int, int]]:
    """``[(start, end)]``: the runs of consecutive equal entries (one run per request in a
    decode-rows batch; every run has length 1 in a plain decode batch)."""
    runs, start = [], 0
    for i in range(1, len(req_pool_indices) + 1):
        if i == len(req_pool_indices) or req_pool_indices[i] != req_pool_indices[start]:
            runs.append((start, i))
            start = i
    return runs


def _forward_decode(original, backend, query, output, k_cache, v_cache, req_to_token,
                    req_pool_indices, seq_lens, encoder_lens=None, scaling=None,
                    enable_gqa=False, causal=False, is_cross_attn=False,
                    sliding_window_size=None):
    pools = req_pool_indices.tolist()
    runs = request_runs(pools)
    if (len(runs) == len(pools) or encoder_lens is not None or is_cross_attn
            or (sliding_window_size is not None and sliding_window_size > -1)):
        return original(backend, query, output, k_cache, v_cache, req_to_token,
                        req_pool_indices, seq_lens, encoder_lens=encoder_lens,
                        scaling=scaling, enable_gqa=enable_gqa, causal=causal,
                        is_cross_attn=is_cross_attn, sliding_window_size=sliding_window_size)
    return _grouped(query, output, k_cache, v_cache, req_to_token, pools, seq_lens.tolist(),
                    runs, scaling, enable_gqa)


def _grouped(query, output, k_cache, v_cache, req_to_token, pools: list[int],
             lens: list[int], runs: list[tuple[int, int]], scaling, enable_gqa):
    """SGLang's decode attention (one query per row over the row's first ``seq_len`` keys
    of its request's ``req_to_token`` row), one gather and one SDPA call per run."""
    import torch
    from torch.nn.functional import scaled_dot_product_attention

    heads_first = query.movedim(0, query.dim() - 2)  # [heads, rows, head_size]
    for start, end in runs:
        run_lens = lens[start:end]
        longest = max(run_lens)
        tokens = req_to_token[pools[start], :longest]  # [L] pool slots of the request
        key = k_cache[tokens].movedim(0, query.dim() - 2)  # [kv_heads, L, head_size]
        value = v_cache[tokens].movedim(0, query.dim() - 2)
        q = heads_first[:, start:end, :]  # [heads, R, head_size]
        if not (q.dtype == key.dtype == value.dtype):  # as SGLang's loop
            key, value = key.to(q.dtype), value.to(q.dtype)
        mask = None
        if min(run_lens) != longest:  # row r sees keys [0, lens[r])
            seen = torch.tensor(run_lens, device=q.device)
            mask = torch.arange(longest, device=q.device)[None, :] < seen[:, None]  # [R, L]
        out = scaled_dot_product_attention(
            q.unsqueeze(0), key.unsqueeze(0), value.unsqueeze(0), attn_mask=mask,
            enable_gqa=enable_gqa, scale=scaling, is_causal=False)  # [1, heads, R, hd]
        output[start:end, :, :] = out.squeeze(0).movedim(query.dim() - 2, 0)
    return output
