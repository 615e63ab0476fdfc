"""The quadratic (TiDAR / NLD) view in SGLang: one forward whose tokens attend under a
structured mask, over SGLang's own layers and KV pool.

Design notes: docs/design/sglang.md (section ``diffspec/model_executors/sglang/quadratic.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from diffspec.core.masks import quadratic_branch_indices, quadratic_mask

__all__ = [
    "MaskedAttention",
    "MaskedLayout",
    "branch_size",
    "decode_step_rows",
    "draft_rows",
    "fit_drafts",
    "prefill_branch_layout",
    "prefill_rows",
    "tokens_per_step",
    "verify_step_layout",
]


def branch_size(num_drafts: int, logits_shift: bool) -> int:
    """``K'``: mask tokens per branch for ``num_drafts`` drafts per step. Shifted logits (a
    mask at ``p`` predicts ``p + 1``) draft from every mask; unshifted ones leave the
    branch's first mask (the bonus token's position) unused, as the reference does."""
    if num_drafts < 1:
        raise ValueError(f"num_drafts must be >= 1, got {num_drafts}")
    return num_drafts + (0 if logits_shift else 1)


def tokens_per_step(num_drafts: int, logits_shift: bool) -> int:
    """Tokens one request puts in a decode step: ``(n + 1) * (1 + K')``."""
    return (num_drafts + 1) * (1 + branch_size(num_drafts, logits_shift))


def fit_drafts(num_drafts: int, budget: int, rows) -> int:
    """The most drafts ``<= num_drafts`` whose step ``rows(k)`` (tokens one forward runs
    when it pre-drafts ``k``) is within ``budget``; 0 when none is (no branches)."""
    for k in range(num_drafts, 0, -1):
        if rows(k) <= budget:
            return k
    return 0


def decode_step_rows(batch_size: int, num_verify: int, num_drafts: int,
                     logits_shift: bool) -> int:
    """Tokens of a TIDAR decode step: ``bs`` requests verifying ``num_verify`` drafts and
    pre-drafting ``num_drafts`` (``(n + 1)(1 + K')`` each; ``n + 1`` without branches)."""
    masks = branch_size(num_drafts, logits_shift) if num_drafts else 0
    return batch_size * (num_verify + 1) * (1 + masks)


def prefill_rows(num_prompt: int, batch_size: int, num_drafts: int, logits_shift: bool) -> int:
    """Tokens of the fused prefill: the batch's prompt tokens plus branch 0 per request."""
    return num_prompt + (batch_size * branch_size(num_drafts, logits_shift) if num_drafts
                         else 0)


def verify_step_layout(
    num_drafts: int, num_masks: int, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """One request's decode step after a committed prefix of any length ``C``.

    Returns ``(new_mask [T, T] bool, offsets [T])``, ``T = (n + 1)(1 + K')``: the mask
    among the step's own tokens (every token also sees the whole prefix) and each token's
    position minus ``C``. Tokens: ``t_0 = anchor, d_1 .. d_n`` (causal, offsets
    ``0 .. n``), then branch ``a = 0 .. n`` (offsets ``a + 1 .. a + K'``, sees ``t_0 ..
    t_a`` and itself). ``K' = 0``: no branch, the causal verify chain alone (a step that
    pre-drafts nothing)."""
    if num_masks == 0:
        chain = torch.ones(num_drafts + 1, num_drafts + 1, dtype=torch.bool, device=device)
        return chain.tril(), torch.arange(num_drafts + 1, device=device)
    mask, offsets = quadratic_mask(0, num_drafts, num_masks, device=device)
    return mask, offsets


def prefill_branch_layout(
    prefix_len: int, extend_len: int, num_masks: int, device: torch.device | str | None = None
) -> tuple[Tensor, Tensor]:
    """One request's fused bootstrap prefill: ``extend_len`` prompt tokens after
    ``prefix_len`` cached ones, then branch 0: ``K'`` masks at the positions right after
    the prompt.

    Returns ``(mask [E + K', prefix_len + E + K'] bool, positions [E + K'])``. Prompt
    token ``i`` sees the prefix and prompt tokens ``<= i`` (plain causal prefill, never a
    mask); a mask sees the whole prompt and every mask (bidirectional). With ``P = prefix
    + E - 1`` (the last prompt token, the reference's first anchor), the masks' rows and
    positions are exactly branch 0 of :func:`~diffspec.core.masks.quadratic_mask` ``(P,
    0, K')``: the reference's bootstrap step, whose verify row is the prompt's last row."""
    if extend_len < 1:
        raise ValueError(f"extend_len must be >= 1 (the prompt's last token), got {extend_len}")
    if prefix_len < 0 or num_masks < 1:
        raise ValueError(f"prefix_len >= 0 and num_masks >= 1 needed, got {prefix_len}, "
                         f"{num_masks}")
    prompt_len = prefix_len + extend_len
    total = extend_len + num_masks
    rows = torch.arange(total, device=device)  # [E + K']
    keys = torch.arange(prompt_len + num_masks, device=device)  # [L + K']
    positions = prefix_len + rows  # prompt positions, then L .. L + K' - 1
    is_mask = rows >= extend_len
    key_is_mask = keys >= prompt_len
    causal = (keys[None, :] <= positions[:, None]) & ~key_is_mask[None, :]
    mask = torch.where(is_mask[:, None], torch.ones_like(causal), causal)
    return mask, positions


def draft_rows(num_drafts: int, num_masks: int, logits_shift: bool,
               num_next: int | None = None) -> Tensor:
    """``[n + 1, m]``: for each outcome ``a`` (accepted drafts of the ``n`` verified), the
    step rows whose logits' argmax are the next step's ``m`` drafts (default ``m = n``):
    branch ``a``'s masks, all of them when shifted, all but the first (the bonus token's
    position) when not."""
    skip = 0 if logits_shift else 1
    num_next = num_drafts if num_next is None else num_next
    if num_masks - skip < num_next:
        raise ValueError(f"a branch of {num_masks} masks drafts {num_masks - skip} tokens "
                         f"(logits_shift={logits_shift}); {num_next} requested")
    rows = quadratic_branch_indices(torch.arange(num_drafts + 1), num_drafts, num_masks)
    return rows[:, skip: skip + num_next]


@dataclass
class MaskedLayout:
    """Who attends to what in one forward, per request ``b``."""

    query_rows: list[Tensor]  # B x [T_b] rows of the forward's tokens that are request b's
    prefix_slots: list[Tensor]  # B x [S_b] KV-pool slots of its K/V before this forward
    masks: list[Tensor]  # B x [T_b, S_b + T_b] bool; keys = [prefix slots, query rows]

    def __post_init__(self) -> None:
        for rows, slots, mask in zip(self.query_rows, self.prefix_slots, self.masks):
            if tuple(mask.shape) != (rows.numel(), slots.numel() + rows.numel()):
                raise ValueError(f"mask {tuple(mask.shape)} does not fit {rows.numel()} "
                                 f"queries over {slots.numel()} + {rows.numel()} keys")


class MaskedAttention:
    """SGLang attention backend for a quadratic forward on the CPU path: wraps the model
    runner's ``TorchNativeAttnBackend`` and replaces its attention by the masked one of
    ``layout`` (see the module docstring). Everything else is delegated."""

    def __init__(self, backend, layout: MaskedLayout) -> None:
        self._backend = backend
        self.layout = layout

    def __getattr__(self, name: str):
        if name == "_backend":
            raise AttributeError(name)
        return getattr(self._backend, name)

    def forward(self, q: Tensor, k: Tensor, v: Tensor, layer, forward_batch,
                save_kv_cache: bool = True, **kwargs) -> Tensor:  # [tokens, Hq * Dv]
        hq, hkv = layer.tp_q_head_num, layer.tp_k_head_num
        if getattr(layer, "sliding_window_size", None) not in (None, -1) or (
                getattr(layer, "logit_cap", 0) or 0) > 0:
            raise NotImplementedError("quadratic attention: sliding windows and logit caps "
                                      "are not supported")
        q = q.reshape(-1, hq, layer.qk_head_dim)  # [N, Hq, D]
        k = k.reshape(-1, hkv, layer.qk_head_dim)  # [N, Hkv, D]
        v = v.reshape(-1, layer.tp_v_head_num, layer.v_head_dim)  # [N, Hkv, Dv]
        pool = self._backend.token_to_kv_pool
        if save_kv_cache:  # as the torch-native backend: every token's K/V to its slot
            from sglang.srt.mem_cache.memory_pool import KVWriteLoc

            swa_loc = getattr(self._backend, "swa_out_cache_loc", None)
            pool.set_kv_buffer(layer, KVWriteLoc(forward_batch.out_cache_loc, swa_loc), k, v)
        k_pool = pool.get_key_buffer(layer.layer_id)  # [slots, Hkv, D]
        v_pool = pool.get_value_buffer(layer.layer_id)
        out = q.new_empty(q.shape[0], hq, layer.v_head_dim)  # [N, Hq, Dv]
        for rows, slots, mask in zip(self.layout.query_rows, self.layout.prefix_slots,
                                     self.layout.masks):
            keys = torch.cat([k_pool[slots].to(q.dtype), k[rows]]).transpose(0, 1)  # [Hkv, S, D]
            values = torch.cat([v_pool[slots].to(q.dtype), v[rows]]).transpose(0, 1)
            out[rows] = nn.functional.scaled_dot_product_attention(
                q[rows].transpose(0, 1)[None], keys[None], values[None], attn_mask=mask,
                scale=layer.scaling, enable_gqa=hq != hkv)[0].transpose(0, 1)
        return out.reshape(-1, hq * layer.v_head_dim)
