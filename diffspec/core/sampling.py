"""Sampling rules: sampling parameters, logits processing, and (coupled) sampling.

Design notes: docs/design/core.md (section ``diffspec/core/sampling.py``).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = [
    "SamplingParams",
    "coupled_sample",
    "position_gumbel_noise",
    "probs_from_logits",
    "process_logits",
    "sample_from_probs",
]

Scalar = float | int
RowParam = Scalar | Tensor


# --------------------------------------------------------------------------- parameters


def _check_temperature(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"temperature must be a finite number >= 0, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {value!r}")


def _check_top_k(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < -1:
        raise ValueError(f"top_k must be an int >= -1 (-1 or 0 = off), got {value!r}")


def _check_top_p(value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"top_p must be a number in (0, 1], got {value!r}")
    if not 0.0 < value <= 1.0:  # also rejects NaN
        raise ValueError(f"top_p must be in (0, 1] (1 = off), got {value!r}")


def _check_seed(value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
        raise ValueError(f"seed must be None or an int in [0, 2**64), got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling parameters, validated once on construction."""

    temperature: float = 0.0  # 0 => greedy
    top_k: int = -1  # -1 (or 0) => off
    top_p: float = 1.0  # 1.0 => off
    seed: int | None = None  # None => unseeded

    def __post_init__(self) -> None:
        _check_temperature(self.temperature)
        _check_top_k(self.top_k)
        _check_top_p(self.top_p)
        _check_seed(self.seed)

    @property
    def is_greedy(self) -> bool:
        """True when temperature is 0 (argmax decoding; top-k / top-p are then moot)."""
        return self.temperature == 0


# ----------------------------------------------------------------------- logits processing


def _per_row(value: RowParam, lead: torch.Size, dtype: torch.dtype, device: torch.device,
             name: str) -> Tensor:
    """Broadcast a scalar or a leading-prefix-shaped tensor to the rows ``lead``."""
    t = torch.as_tensor(value, dtype=dtype, device=device)
    if t.ndim > len(lead) or tuple(t.shape) != tuple(lead[: t.ndim]):
        raise ValueError(
            f"{name} must be a scalar or a tensor whose shape is a prefix of the logits' "
            f"leading shape {tuple(lead)}, got shape {tuple(t.shape)}"
        )
    return t.reshape(tuple(t.shape) + (1,) * (len(lead) - t.ndim)).expand(lead)


def process_logits(
    logits: Tensor,  # [..., vocab]
    temperature: RowParam,  # scalar or [...] (or a prefix of it, e.g. [batch])
    top_k: RowParam,  # scalar or [...]
    top_p: RowParam,  # scalar or [...]
    min_p: RowParam | None = None,  # scalar or [...]; None or 0: off
) -> Tensor:  # [..., vocab] float32
    """Return float32 ``logits / temperature`` with ``-inf`` outside the top-k / top-p
    (/ min-p) support.

    Order: temperature, then top-k, then top-p (see the module docstring). Greedy rows
    (temperature 0) keep only the argmax, so softmax gives a one-hot. Python scalars are
    validated; tensor parameters are assumed valid (build them from :class:`SamplingParams`).
    A tensor parameter may have the full leading shape or a prefix of it (``[batch]`` for
    logits ``[batch, num_positions, vocab]``).
    """
    if logits.ndim < 1 or logits.shape[-1] == 0:
        raise ValueError(
            f"logits must have shape [..., vocab] with vocab > 0, got {tuple(logits.shape)}"
        )
    if not isinstance(temperature, Tensor):
        _check_temperature(temperature)
    if not isinstance(top_k, Tensor):
        _check_top_k(top_k)
    if not isinstance(top_p, Tensor):
        _check_top_p(top_p)
    logits = logits.float()
    lead, vocab, device = logits.shape[:-1], logits.shape[-1], logits.device
    neg_inf = torch.tensor(float("-inf"), device=device)

    temp = _per_row(temperature, lead, torch.float32, device, "temperature")
    greedy = (temp == 0).unsqueeze(-1)  # [..., 1]
    scaled = logits / torch.where(greedy, torch.ones_like(temp).unsqueeze(-1), temp.unsqueeze(-1))

    k_off = not isinstance(top_k, Tensor) and not 0 < top_k < vocab
    p_off = not isinstance(top_p, Tensor) and top_p >= 1.0
    if not (k_off and p_off):
        # One stable descending sort serves both filters; ties keep the lower index first.
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
        rank = torch.arange(vocab, device=device)  # [vocab]
        k = _per_row(top_k, lead, torch.int64, device, "top_k")
        k = torch.where((k <= 0) | (k > vocab), torch.full_like(k, vocab), k)
        keep_sorted = rank < k.unsqueeze(-1)  # [..., vocab]
        sorted_logits = torch.where(keep_sorted, sorted_logits, neg_inf)
        p = _per_row(top_p, lead, torch.float32, device, "top_p").unsqueeze(-1)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs  # exclusive cumsum
        keep_sorted &= (mass_before < p) | (p >= 1.0)
        keep = torch.zeros_like(keep_sorted).scatter(-1, order, keep_sorted)
        scaled = torch.where(keep, scaled, neg_inf)
    if min_p is not None and (isinstance(min_p, Tensor) or min_p > 0):
        m = _per_row(min_p, lead, torch.float32, device, "min_p").unsqueeze(-1)
        # p_i < m * p_max  <=>  scaled_i < scaled_max + log(m) (the top token is never dropped)
        top = scaled.max(dim=-1, keepdim=True).values
        probs = torch.softmax(scaled, dim=-1)
        drop = probs < probs.max(dim=-1, keepdim=True).values * m
        scaled = torch.where(drop & (scaled < top) & (m > 0), neg_inf, scaled)

    argmax = logits.argmax(dim=-1, keepdim=True)  # [..., 1]
    one_hot = torch.full_like(logits, float("-inf")).scatter(-1, argmax, logits.gather(-1, argmax))
    return torch.where(greedy, one_hot, scaled)


def probs_from_logits(
    logits: Tensor,  # [..., vocab]
    params: SamplingParams,
) -> Tensor:  # [..., vocab] float32
    """Softmax of :func:`process_logits` under ``params``."""
    return torch.softmax(process_logits(logits, params.temperature, params.top_k, params.top_p), -1)


# ------------------------------------------------------------------------------- sampling


def sample_from_probs(
    probs: Tensor,  # [num_rows, vocab], rows need not be normalized
    generator: torch.Generator | None = None,
) -> Tensor:  # [num_rows] int64
    """Draw one token per row: ``argmax(probs / E)`` with ``E ~ Exp(1)`` i.i.d.

    This exponential race samples token ``i`` with probability ``probs[i] / sum(probs)``
    and never picks a zero-probability token (unless the whole row is zero). It consumes
    exactly ``num_rows * vocab`` exponentials from ``generator`` (which must live on
    ``probs.device``), so the result is deterministic for a given generator state.
    """
    if probs.ndim != 2:
        raise ValueError(f"probs must have shape [num_rows, vocab], got {tuple(probs.shape)}")
    probs = probs.float()
    race = torch.empty_like(probs).exponential_(1.0, generator=generator)
    return (probs / race.clamp_min(torch.finfo(torch.float32).tiny)).argmax(dim=-1)


_MASK32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """``(x * c) mod 2**32`` for int64 ``x`` in ``[0, 2**32)`` without int64 overflow."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _MASK32


def _fmix32(x: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finalizer: a bijection on ``[0, 2**32)`` with full avalanche."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def position_gumbel_noise(
    seed: int,
    positions: Tensor | Sequence[int],  # [n] absolute token positions, >= 0
    vocab_size: int,
) -> Tensor:  # [n, vocab_size] float32
    """Gumbel(0, 1) noise that is a pure function of ``(seed, absolute position, token)``.

    It is independent of batch composition and of how positions are grouped into forward
    passes, and of the device (integer hashing, no generator state). Used for coupled
    sampling: ``sample = argmax(log_softmax(processed_logits) + noise)``. Uniforms have 24
    bits, so the noise lies in about ``[-2.8, 17.3]``; the truncated tail has mass ~3e-8.
    """
    _check_seed(seed)
    if seed is None:
        raise ValueError("seed must be an int in [0, 2**64), got None")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size <= 0:
        raise ValueError(f"vocab_size must be a positive int, got {vocab_size!r}")
    pos = torch.as_tensor(positions, dtype=torch.int64)
    if pos.ndim != 1:
        raise ValueError(f"positions must have shape [n], got {tuple(pos.shape)}")
    if pos.numel() and bool((pos < 0).any()):
        raise ValueError("positions must be >= 0")
    device = pos.device
    s = torch.tensor([seed & _MASK32, seed >> 32], dtype=torch.int64, device=device)
    key = _fmix32(_fmix32(s[0] ^ 0x9E3779B9) ^ s[1])  # []
    h1 = _fmix32(_fmix32(key ^ (pos & _MASK32)) ^ (pos >> 32))  # [n]
    h2 = _fmix32(h1 ^ 0x7F4A7C15)  # [n]
    tok = torch.arange(vocab_size, dtype=torch.int64, device=device)  # [vocab]
    bits = _fmix32(_fmix32(h1.unsqueeze(1) ^ tok) ^ h2.unsqueeze(1))  # [n, vocab]
    u = ((bits >> 8).float() + 0.5) * 2.0**-24  # (0, 1), exact in float32
    return -torch.log(-torch.log(u))


def coupled_sample(
    logits: Tensor,  # [n, vocab] processed logits (temperature / top-k / top-p applied)
    noise: Tensor,  # [n, vocab] from position_gumbel_noise
) -> Tensor:  # [n] int64
    """Gumbel-max sample: ``argmax(log_softmax(logits) + noise)``, distributed as softmax.

    ``log_softmax`` only shifts each row by a constant, so the argmax of ``logits + noise``
    is taken instead: elementwise, hence bit-identical however rows are batched.
    """
    if logits.ndim != 2 or logits.shape != noise.shape:
        raise ValueError(
            f"logits and noise must both have shape [n, vocab], got {tuple(logits.shape)} "
            f"and {tuple(noise.shape)}"
        )
    return (logits.float() + noise.to(device=logits.device, dtype=torch.float32)).argmax(dim=-1)
