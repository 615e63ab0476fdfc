"""EAGLE-3 drafter training: a real EAGLE-3 baseline for a served target.

Design notes: docs/design/training.md (section ``training/eagle3.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diffspec.train import TrainConfig, fit, log_to_stderr, torch_threads, warn_slow_autocast
from diffspec.train.data import (
    Row,
    StepBatches,
    collate,
    data_files,
    files_sha256,
    load_rows,
)
from diffspec.train.runs import ResumableRun, write_json

__all__ = [
    "DrafterSpec",
    "Eagle3Drafter",
    "Eagle3Result",
    "Row",
    "TargetFeatures",
    "default_aux_layer_ids",
    "eagle3_loss",
    "greedy_rows",
    "heldout_acceptance",
    "load_rows",
    "save_drafter",
    "train_eagle3",
    "write_bf16_copy",
]


# ------------------------------------------------------------------------------- config


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """vLLM's default EAGLE-3 aux layers ``(2, L // 2, L - 3)`` when distinct and in
    ``0 .. L``; else (shallow targets) ``tiny_drafters``' choice."""
    ids = [2, num_layers // 2, num_layers - 3]
    if all(0 <= i <= num_layers for i in ids) and ids[0] < ids[1] < ids[2]:
        return ids
    if num_layers >= 3:
        return [1, num_layers // 2 + 1, num_layers]
    return [0, 1, num_layers]


@dataclass
class DrafterSpec:
    """Sizes of the drafter (the target's, one layer) and what vLLM reads from config."""

    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int  # the target's
    draft_vocab_size: int
    aux_layer_ids: list[int]
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 2048
    eos_token_id: int = 0
    fc_norm: bool = False  # vLLM's `fc_norm`: an RMSNorm per aux layer before `fc`

    @classmethod
    def from_target(cls, target_config: dict[str, Any], *, aux_layer_ids: Sequence[int] | None
                    = None, draft_vocab_size: int | None = None, fc_norm: bool = False
                    ) -> DrafterSpec:
        t = target_config
        heads = t["num_attention_heads"]
        rope = t.get("rope_parameters") or {}
        eos = t.get("eos_token_id", 0)
        return cls(
            hidden_size=t["hidden_size"], intermediate_size=t["intermediate_size"],
            num_attention_heads=heads, num_key_value_heads=t.get("num_key_value_heads", heads),
            head_dim=t.get("head_dim") or t["hidden_size"] // heads,
            vocab_size=t["vocab_size"],
            draft_vocab_size=draft_vocab_size or t["vocab_size"],
            aux_layer_ids=list(aux_layer_ids if aux_layer_ids is not None
                               else default_aux_layer_ids(t["num_hidden_layers"])),
            rms_norm_eps=t.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope.get("rope_theta", t.get("rope_theta", 10000.0))),
            max_position_embeddings=t.get("max_position_embeddings", 2048),
            eos_token_id=eos[0] if isinstance(eos, list) else (eos or 0), fc_norm=fc_norm,
        )

    def vllm_config(self) -> dict[str, Any]:
        """``config.json`` of the drafter (the keys ``tiny_drafters.build_eagle3`` writes,
        plus ``rope_parameters`` and ``draft_vocab_size`` as trained)."""
        extra = {"fc_norm": True} if self.fc_norm else {}
        return extra | {
            "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
            "hidden_size": self.hidden_size, "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads, "head_dim": self.head_dim,
            "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": self.rms_norm_eps,
            "max_position_embeddings": self.max_position_embeddings,
            "rope_theta": self.rope_theta,
            "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
            "vocab_size": self.vocab_size, "draft_vocab_size": self.draft_vocab_size,
            "tie_word_embeddings": False, "target_hidden_size": self.hidden_size,
            "eos_token_id": self.eos_token_id, "torch_dtype": "float32",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids),
                             "use_aux_hidden_state": True},
        }


# ------------------------------------------------------------------------------ drafter


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


class _Attention(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        self.q_proj = nn.Linear(2 * h, spec.num_attention_heads * d, bias=False)
        self.k_proj = nn.Linear(2 * h, spec.num_key_value_heads * d, bias=False)
        self.v_proj = nn.Linear(2 * h, spec.num_key_value_heads * d, bias=False)
        self.o_proj = nn.Linear(spec.num_attention_heads * d, h, bias=False)


class _MLP(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.up_proj = nn.Linear(spec.hidden_size, spec.intermediate_size, bias=False)
        self.down_proj = nn.Linear(spec.intermediate_size, spec.hidden_size, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class _MidLayer(nn.Module):
    def __init__(self, spec: DrafterSpec) -> None:
        super().__init__()
        self.self_attn = _Attention(spec)
        self.mlp = _MLP(spec)
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)
        self.hidden_norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps)


def _rotate_half(x: Tensor) -> Tensor:
    a, b = x.chunk(2, dim=-1)
    return torch.cat((-b, a), dim=-1)


class Eagle3Drafter(nn.Module):
    """The EAGLE-3 draft model with parameter names as published (``state_dict()`` is the
    ``model.safetensors`` content, plus ``d2t`` / ``t2d`` with a reduced vocabulary)."""

    def __init__(self, spec: DrafterSpec, draft_ids: Tensor | None = None) -> None:
        super().__init__()
        self.spec = spec
        h = spec.hidden_size
        self.fc = nn.Linear(len(spec.aux_layer_ids) * h, h, bias=False)
        if spec.fc_norm:
            self.fc_norm = nn.ModuleList(RMSNorm(h, spec.rms_norm_eps)
                                         for _ in spec.aux_layer_ids)
        else:
            self.fc_norm = None
        self.midlayer = _MidLayer(spec)
        self.norm = RMSNorm(h, spec.rms_norm_eps)
        self.lm_head = nn.Linear(h, spec.draft_vocab_size, bias=False)
        inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, spec.head_dim, 2,
                                                           dtype=torch.float64) / spec.head_dim))
        self.register_buffer("inv_freq", inv_freq.float(), persistent=False)
        if draft_ids is not None:  # reduced vocabulary: draft id i is target id draft_ids[i]
            if len(draft_ids) != spec.draft_vocab_size:
                raise ValueError("draft_ids must have draft_vocab_size entries")
            self.register_buffer("draft_ids", draft_ids.long(), persistent=False)
        else:
            self.draft_ids = None
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, std=0.02)

    # -- inference-equivalent pieces

    def combine(self, aux: Tensor) -> Tensor:  # [.., n_aux * H] -> [.., H]
        if self.fc_norm is not None:
            chunks = aux.chunk(len(self.fc_norm), dim=-1)
            aux = torch.cat([norm(c) for norm, c in zip(self.fc_norm, chunks, strict=True)],
                            dim=-1)
        return self.fc(aux)

    def rope(self, positions: Tensor) -> tuple[Tensor, Tensor]:  # [S] -> cos, sin [S, d]
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def step(self, embeds: Tensor, hidden: Tensor, position_offset: int,
             cache: list[tuple[Tensor, Tensor]]) -> Tensor:
        """One draft step over all slots: ``embeds``/``hidden`` [B, S, H], slot ``t`` at
        rotary position ``t + position_offset``. ``cache`` holds the (k, v) of the
        previous steps (step 0 first) and gets this step's appended. Returns ``out``
        [B, S, H], the pre-norm hidden state (logits: :meth:`logits`)."""
        layer, attn = self.midlayer, self.midlayer.self_attn
        b, s, _ = embeds.shape
        nh, nkv, d = (self.spec.num_attention_heads, self.spec.num_key_value_heads,
                      self.spec.head_dim)
        residual = hidden
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        q = attn.q_proj(x).view(b, s, nh, d).transpose(1, 2)
        k = attn.k_proj(x).view(b, s, nkv, d).transpose(1, 2)
        v = attn.v_proj(x).view(b, s, nkv, d).transpose(1, 2)
        cos, sin = self.rope(torch.arange(s, device=embeds.device) + position_offset)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        cache.append((k, v))
        o = _ttt_attention(q, cache, nh // nkv)  # [B, nh, S, d]
        residual = residual + attn.o_proj(o.transpose(1, 2).reshape(b, s, nh * d))
        return residual + layer.mlp(layer.post_attention_layernorm(residual))

    def logits(self, out: Tensor) -> Tensor:
        return self.lm_head(self.norm(out))

    def to_target_ids(self, draft_token_ids: Tensor) -> Tensor:
        return draft_token_ids if self.draft_ids is None else self.draft_ids[draft_token_ids]

    def export_state(self) -> dict[str, Tensor]:
        """The tensors of ``model.safetensors`` (names as vLLM loads them)."""
        state = {k: v.detach().to("cpu", torch.float32).contiguous()
                 for k, v in self.state_dict().items()}
        if self.draft_ids is not None:
            ids = self.draft_ids.cpu()
            state["d2t"] = (ids - torch.arange(len(ids))).long()
            t2d = torch.zeros(self.spec.vocab_size, dtype=torch.bool)
            t2d[ids] = True
            state["t2d"] = t2d
        return state


def _ttt_attention(q: Tensor, cache: list[tuple[Tensor, Tensor]], groups: int) -> Tensor:
    """Attention of step ``len(cache) - 1``: query slot t sees step-0 keys of slots <= t and
    its own keys of steps 1 .. k. q [B, nh, S, d]; cache entries [B, nkv, S, d]."""
    scale = q.shape[-1] ** -0.5
    k0, v0 = (t.repeat_interleave(groups, dim=1) for t in cache[0])
    s = q.shape[2]
    scores = torch.matmul(q, k0.transpose(-1, -2)) * scale  # [B, nh, S, S]
    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    extra_v = []
    parts = [scores]
    for kj, vj in cache[1:]:
        kj, vj = kj.repeat_interleave(groups, dim=1), vj.repeat_interleave(groups, dim=1)
        parts.append((q * kj).sum(-1, keepdim=True) * scale)  # [B, nh, S, 1]
        extra_v.append(vj)
    probs = torch.softmax(torch.cat(parts, dim=-1).float(), dim=-1).to(q.dtype)
    out = torch.matmul(probs[..., :s], v0)
    for j, vj in enumerate(extra_v):
        out = out + probs[..., s + j: s + j + 1] * vj
    return out


# ------------------------------------------------------------------------------- target


class TargetFeatures:
    """The frozen target (transformers, fp32, eval): per batch the aux layers' hidden
    states, its final hidden states (for the teacher logits) and its token embedding."""

    def __init__(self, model: nn.Module, aux_layer_ids: Sequence[int]) -> None:
        self.model = model.eval()
        for p in self.model.parameters():
            p.requires_grad_(False)
        inner = model.model
        self.layers = inner.layers
        self.num_layers = len(self.layers)
        self.aux_layer_ids = list(aux_layer_ids)
        bad = [i for i in self.aux_layer_ids if not 0 <= i <= self.num_layers]
        if bad:
            raise ValueError(f"aux layer ids {bad} out of 0..{self.num_layers}")
        self.embed = model.get_input_embeddings()
        self.final_norm = inner.norm
        self.lm_head = model.get_output_embeddings()

    @classmethod
    def load(cls, base: str | Path, aux_layer_ids: Sequence[int],
             device: str | torch.device = "cpu") -> TargetFeatures:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
        return cls(model.to(device), aux_layer_ids)

    @torch.no_grad()
    def __call__(self, input_ids: Tensor) -> tuple[Tensor, Tensor]:
        """(aux [B, T, n_aux * H] in ``aux_layer_ids`` order, final pre-norm hidden [B, T, H])."""
        captured: dict[int, Tensor] = {}
        handles = []

        def pre_hook(i: int) -> Callable:
            def hook(module, args, kwargs):
                captured[i] = args[0] if args else kwargs["hidden_states"]
            return hook

        def post_hook(module, args, output):
            captured[self.num_layers] = output[0] if isinstance(output, tuple) else output

        for i in set(self.aux_layer_ids) | {self.num_layers}:
            if i < self.num_layers:
                handles.append(self.layers[i].register_forward_pre_hook(pre_hook(i),
                                                                         with_kwargs=True))
            else:
                handles.append(self.layers[-1].register_forward_hook(post_hook))
        try:
            self.model.model(input_ids=input_ids, use_cache=False)
        finally:
            for h in handles:
                h.remove()
        aux = torch.cat([captured[i].float() for i in self.aux_layer_ids], dim=-1)
        return aux, captured[self.num_layers].float()

    @torch.no_grad()
    def teacher_logits(self, last_hidden: Tensor) -> Tensor:  # [N, H] pre-norm -> [N, V]
        return self.lm_head(self.final_norm(last_hidden)).float()


# --------------------------------------------------------------------------------- data


def greedy_rows(base: str | Path, prompts: Sequence[Sequence[int]], max_new_tokens: int,
                stop_token_ids: Sequence[int] = ()) -> list[dict[str, Any]]:
    """The target's own greedy answers to ``prompts`` as training rows
    (``{"token_ids": prompt + answer, "prompt_len": len(prompt)}``), with the reference
    decoder (tiny models; real ones: :mod:`training.sharegpt`)."""
    from transformers import AutoModelForCausalLM

    from diffspec.spec_workers.reference.decoder import Request, ar_generate

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
    requests = [Request(list(p), max_tokens=max_new_tokens, stop_token_ids=tuple(stop_token_ids))
                for p in prompts]
    with torch.inference_mode():
        outs = ar_generate(model, requests)
    return [{"token_ids": list(p) + list(o.token_ids), "prompt_len": len(p)}
            for p, o in zip(prompts, outs, strict=True)]


# --------------------------------------------------------------------------------- loss


def valid_slots(lengths: Tensor, prompt_lens: Tensor, num_slots: int, k: int) -> Tensor:
    """[B, S] bool: draft slot ``t`` at step ``k`` has a loss (the token it predicts,
    index ``t + k + 2``, is inside the row and at or after ``prompt_len``)."""
    predicted = torch.arange(num_slots, device=lengths.device)[None, :] + k + 2
    return (predicted < lengths[:, None]) & (predicted >= prompt_lens[:, None])


def loss_counts(lengths: Tensor, prompt_lens: Tensor, ttt_steps: int) -> list[int]:
    """Positions with a loss at each draft step, over rows of these lengths."""
    s = int(lengths.max()) - 1
    return [int(valid_slots(lengths, prompt_lens, s, k).sum()) for k in range(ttt_steps)]


@dataclass
class StepLoss:
    """One (micro-)batch: ``loss`` to back-propagate and, per draft step ``k``, the sums
    behind the metrics (``kl_k``, ``right_k``: top-1 agreements, ``chain_k``: slots whose
    steps 0..k all agree) and ``count_k`` (positions with a loss)."""

    loss: Tensor
    sums: dict[str, float] = field(default_factory=dict)
    loss_tokens: int = 0

    def metrics(self, ttt_steps: int) -> dict[str, float]:
        return step_metrics(self.sums, ttt_steps)


def step_metrics(sums: dict[str, float], ttt_steps: int) -> dict[str, float]:
    """``kl_k`` (mean KL), ``acc_k`` (top-1 agreement), ``chain_k`` (steps 0..k all agree)."""
    out = {}
    for k in range(ttt_steps):
        n = sums.get(f"count_{k}", 0)
        if n:
            out[f"kl_{k}"] = sums[f"kl_{k}"] / n
            out[f"acc_{k}"] = sums[f"right_{k}"] / n
            out[f"chain_{k}"] = sums[f"chain_{k}"] / n
    return out


@torch.no_grad()
def heldout_acceptance(drafter: Eagle3Drafter, target: TargetFeatures, rows: Sequence[Row],
                       ttt_steps: int = 3, micro_batch: int = 8) -> dict[str, float]:
    """Teacher-forced greedy acceptance of ``drafter`` on conversation rows (e.g. the
    target's answers to held-out prompts): ``accept_k`` = share of answer positions whose
    drafts 0..k all equal the target's argmax (:func:`step_metrics`' ``chain_k``),
    ``est_al`` = 1 + their sum (the acceptance length of a ``ttt_steps`` chain), and the
    mean KL per step."""
    was_training = drafter.training
    drafter.eval()
    device = next(drafter.parameters()).device
    sums: dict[str, float] = {}
    for i in range(0, len(rows), micro_batch):
        ids, lengths, prompt_lens = collate(list(rows[i:i + micro_batch]))
        part = eagle3_loss(drafter, target, ids.to(device), lengths, prompt_lens, ttt_steps)
        for key, value in part.sums.items():
            sums[key] = sums.get(key, 0) + value
    drafter.train(was_training)
    m = step_metrics(sums, ttt_steps)
    out = {f"accept_{k}": m[f"chain_{k}"] for k in range(ttt_steps) if f"chain_{k}" in m}
    out["est_al"] = 1 + sum(out.values())
    out.update({f"kl_{k}": m[f"kl_{k}"] for k in range(ttt_steps) if f"kl_{k}" in m})
    return out


def eagle3_loss(
    drafter: Eagle3Drafter,
    target: TargetFeatures,
    input_ids: Tensor,  # [B, T]
    lengths: Tensor,  # [B]
    prompt_lens: Tensor,  # [B]
    ttt_steps: int,
    ttt_decay: float = 1.0,
    counts: Sequence[int] | None = None,
) -> StepLoss:
    """Target features, ``ttt_steps`` unrolled draft steps, ``sum_k ttt_decay^k x KL_k``
    with ``KL_k`` the mean over the positions with a loss at step ``k``. ``counts``: the
    number of such positions in the whole batch when this is one micro-batch of it (the
    micro-batches' losses then add up to the batch's)."""
    b, t = input_ids.shape
    s = t - 1  # draft slots 0 .. T-2
    if counts is None:
        counts = loss_counts(lengths, prompt_lens, ttt_steps)
    device = input_ids.device
    lengths, prompt_lens = lengths.to(device), prompt_lens.to(device)
    aux, last_hidden = target(input_ids)
    embed = target.embed
    ids_ext = torch.cat([input_ids, input_ids.new_zeros(b, ttt_steps)], dim=1)
    # teacher: log-probs at every position q some step needs (q + 1 an answer token)
    pos = torch.arange(t, device=device)
    need = (pos[None, :] + 1 < lengths[:, None]) & (pos[None, :] + 1 >= prompt_lens[:, None])
    row_of = torch.full((b, t + ttt_steps), -1, dtype=torch.long, device=device)
    row_of[:, :t][need] = torch.arange(int(need.sum()), device=device)  # (b, q) -> teacher row
    with torch.no_grad():
        teacher = target.teacher_logits(last_hidden[need])  # [M, V]
        teacher_argmax = teacher.argmax(-1)
        if drafter.draft_ids is not None:
            teacher = teacher[:, drafter.draft_ids]
        teacher_logp = torch.log_softmax(teacher, dim=-1)
        del teacher
    hidden = drafter.combine(aux[:, :-1])  # [B, S, H]
    cache: list[tuple[Tensor, Tensor]] = []
    total = hidden.new_zeros(())
    sums: dict[str, float] = {}
    chain = torch.ones(b, s, dtype=torch.bool, device=device)
    loss_tokens = 0
    for k in range(ttt_steps):
        with torch.no_grad():
            embeds = embed(ids_ext[:, 1 + k: 1 + k + s])
        out = drafter.step(embeds, hidden, k, cache)
        valid = valid_slots(lengths, prompt_lens, s, k)
        n = int(valid.sum())
        sums[f"count_{k}"] = n
        if n:
            rows_idx = row_of[:, k + 1: k + 1 + s][valid]  # teacher rows at q = t + k + 1
            logq = torch.log_softmax(drafter.logits(out[valid]).float(), dim=-1)
            logp = teacher_logp[rows_idx]
            kl_sum = (logp.exp() * (logp - logq)).sum()
            total = total + (ttt_decay ** k) * kl_sum / counts[k]
            with torch.no_grad():
                right = drafter.to_target_ids(logq.argmax(-1)) == teacher_argmax[rows_idx]
                correct = torch.ones(b, s, dtype=torch.bool, device=device)
                correct[valid] = right
                chain &= correct
                sums[f"kl_{k}"] = float(kl_sum.detach())
                sums[f"right_{k}"] = int(right.sum())
                sums[f"chain_{k}"] = int(chain[valid].sum())
            loss_tokens += n
        hidden = out
    return StepLoss(total, sums, loss_tokens)


# ------------------------------------------------------------------------------ trainer


@dataclass
class Eagle3Result:
    drafter: Eagle3Drafter
    out_dir: Path | None
    record: dict[str, Any]
    history: list[dict[str, float]]


def _select_draft_vocab(rows: Sequence[Row], vocab: int, size: int) -> Tensor:
    """The ``size`` target ids most frequent among the rows' answer tokens (ties: lower id
    first), sorted; ids never seen fill the rest in id order."""
    counts = torch.zeros(vocab, dtype=torch.long)
    for r in rows:
        ids = torch.tensor(r.token_ids[r.prompt_len:], dtype=torch.long)
        counts += torch.bincount(ids, minlength=vocab)[:vocab]
    order = sorted(range(vocab), key=lambda i: (-int(counts[i]), i))
    return torch.tensor(sorted(order[:size]), dtype=torch.long)


def _init_from_target(drafter: Eagle3Drafter, target: TargetFeatures,
                      fc_init: str = "random") -> None:
    """``lm_head`` from the target's LM head (its draft-vocabulary rows) and ``norm`` from
    the target's final norm: step 0 starts from the target's own read-out. ``fc_init``:
    ``"random"`` (normal, std 0.02) or ``"last"``: ``fc`` passes the last aux layer's
    hidden state through unchanged (the other blocks zero), so the first draft starts as
    the target's read-out of its own deep features ("logit lens")."""
    with torch.no_grad():
        w = target.lm_head.weight.float()
        if drafter.draft_ids is not None:
            w = w[drafter.draft_ids]
        drafter.lm_head.weight.copy_(w)
        drafter.norm.weight.copy_(target.final_norm.weight.float())
        if fc_init == "last":
            h = drafter.spec.hidden_size
            drafter.fc.weight.zero_()
            drafter.fc.weight[:, -h:] = torch.eye(h)
        elif fc_init != "random":
            raise ValueError(f"fc_init must be 'random' or 'last', got {fc_init!r}")


def save_drafter(out_dir: str | Path, drafter: Eagle3Drafter,
                 extra_config: dict[str, Any] | None = None) -> Path:
    """Write ``config.json`` + ``model.safetensors`` (vLLM's eagle3 layout) to ``out_dir``."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    config = drafter.spec.vllm_config() | (extra_config or {})
    tmp = out / ".model.safetensors.tmp"
    save_file(drafter.export_state(), str(tmp))
    os.replace(tmp, out / "model.safetensors")
    write_json(out / "config.json", config)
    return out


def write_bf16_copy(run_dir: str | Path, out_dir: str | Path) -> Path:
    """The drafter of ``run_dir`` (config.json, model.safetensors, training.json) with its
    floating-point weights in bf16 (half the size: what is shipped; the engine casts them
    to the target's dtype as it loads), in ``out_dir``; the resumable state stays behind."""
    import shutil

    import torch
    from safetensors.torch import load_file, save_file

    src, out = Path(run_dir), Path(out_dir)
    if src.resolve() == out.resolve():
        raise ValueError("write the copy to a folder other than the run's: it would replace "
                         "the run's weights")
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v
             for k, v in load_file(str(src / "model.safetensors")).items()}
    out.mkdir(parents=True, exist_ok=True)
    save_file(state, str(out / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    write_json(out / "config.json", config | {"torch_dtype": "bfloat16"})
    shutil.copyfile(src / "training.json", out / "training.json")
    return out


def train_eagle3(
    base: str | Path,
    out_dir: str | Path | None,
    cfg: TrainConfig,
    *,
    data: Sequence[str] = ("synthetic",),
    ttt_steps: int = 3,
    ttt_decay: float = 1.0,
    aux_layer_ids: Sequence[int] | None = None,
    draft_vocab_size: int | None = None,
    freeze_lm_head: bool = False,
    save_every: int = 100,
    micro_batch: int = 1,
    fc_init: str = "random",
    fc_norm: bool = False,
    autocast_bf16: bool = False,
    max_cpu_s: float | None = None,
    resume: bool = False,
    max_rows: int | None = None,
    device: str = "cpu",
    deadline: float | None = None,
    evaluate: Callable[[Eagle3Drafter, TargetFeatures], dict[str, float]] | None = None,
    evaluate_every: int = 0,
    command: str | None = None,
    log: Callable[[str], None] | None = None,
) -> Eagle3Result:
    """Train an EAGLE-3 drafter for ``base`` for ``cfg.steps`` optimizer steps in all
    (``resume``: continue ``out_dir/checkpoint`` up to ``cfg.steps``). ``max_cpu_s``: stop
    early (saving) once the run's CPU time, all sessions together, reaches it;
    ``deadline`` (a ``time.monotonic()`` instant): stop this session there. ``device``:
    where the target and the drafter run. ``evaluate(drafter, target) -> metrics`` (e.g.
    :func:`heldout_acceptance`) runs before the first step, every ``evaluate_every`` steps
    and at the end (the record's ``heldout_curve``). The steps run on
    :func:`diffspec.train.fit`."""
    from diffspec.core.checkpoint import resolve_checkpoint

    log = log or log_to_stderr
    if ttt_steps < 1:
        raise ValueError("ttt_steps must be >= 1")
    given, base = str(base), resolve_checkpoint(base)
    out = Path(out_dir) if out_dir is not None else None
    run = ResumableRun.open(out, resume=resume, max_cpu_s=max_cpu_s, command=command,
                            total_steps=cfg.steps, deadline=deadline)
    state = run.state
    aux_layer_ids, draft_vocab_size, ttt_steps, ttt_decay, freeze_lm_head, fc_init, fc_norm = \
        run.resumed(aux_layer_ids=aux_layer_ids, draft_vocab_size=draft_vocab_size,
                    ttt_steps=ttt_steps, ttt_decay=ttt_decay, freeze_lm_head=freeze_lm_head,
                    fc_init=fc_init, fc_norm=fc_norm)
    if state is not None:  # a run saved before autocast was a setting ran without it
        autocast_bf16 = state["settings"].get("autocast_bf16", False)
    warn_slow_autocast(autocast_bf16, str(device), log)
    with torch_threads(cfg.num_threads):
        torch.manual_seed(cfg.seed)
        target_config = json.loads((base / "config.json").read_text())
        spec = DrafterSpec.from_target(target_config, aux_layer_ids=aux_layer_ids,
                                       fc_norm=fc_norm)
        device = torch.device(device)
        target = TargetFeatures.load(base, spec.aux_layer_ids, device)

        # data: on resume, exactly the files (and rows) of the first session
        files = run.files(lambda: data_files(data))
        synthetic = (state["data"]["synthetic"] if state is not None
                     else list(data) == ["synthetic"])
        rows, data_stats = load_rows(
            ["synthetic"] if synthetic else None, cfg.seq_len, files=None if synthetic
            else files, tokenizer_from=base, synthetic_rows=max_rows or cfg.steps
            * cfg.batch_size, seed=cfg.seed)
        if max_rows is not None and not synthetic:
            rows = rows[:max_rows]
        if not rows:
            raise ValueError(f"no training rows in {list(data)}")
        data_info = {"sources": [str(d) for d in data], "synthetic": synthetic,
                     "files": [str(f) for f in files],
                     "files_sha256": files_sha256(files) if files else None,
                     **data_stats}
        run.check_rows(data_info["rows_sha256"])
        if state is not None and not synthetic and data_files(data) != files:
            log(f"resume: reading the first session's {len(files)} files only "
                f"({len(data_files(data)) - len(files)} newer files ignored)")

        draft_ids = None
        if draft_vocab_size and draft_vocab_size < spec.vocab_size:
            draft_ids = (state["draft_ids"] if state is not None
                         else _select_draft_vocab(rows, spec.vocab_size, draft_vocab_size))
            spec.draft_vocab_size = draft_vocab_size
        drafter = Eagle3Drafter(spec, draft_ids)
        _init_from_target(drafter, target, fc_init)
        drafter.to(device)
        if freeze_lm_head:
            drafter.lm_head.weight.requires_grad_(False)
        params = [p for p in drafter.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas,
                                      weight_decay=cfg.weight_decay)
        loss_tokens_seen = 0
        if state is not None:
            drafter.load_state_dict(state["drafter"])
            optimizer.load_state_dict(state["optimizer"])
            loss_tokens_seen = state["loss_tokens_seen"]
            torch.set_rng_state(state["torch_rng"])
            log(f"resume: step {run.step} of {cfg.steps} from {run.state_path}")

        settings = {"aux_layer_ids": spec.aux_layer_ids, "draft_vocab_size": draft_vocab_size,
                    "ttt_steps": ttt_steps, "ttt_decay": ttt_decay,
                    "freeze_lm_head": freeze_lm_head, "fc_init": fc_init, "fc_norm": fc_norm,
                    "autocast_bf16": autocast_bf16}
        cfg.extra.update(method="eagle3", base=given, base_name=base.name, **settings)
        trainable = sum(p.numel() for p in params)
        log(f"eagle3: target {base.name} ({target.num_layers} layers), aux layers "
            f"{spec.aux_layer_ids}, draft vocab {spec.draft_vocab_size}, {trainable:,} "
            f"trainable parameters; {data_stats['rows']} rows, {data_stats['tokens']:,} tokens")

        curve: list[dict[str, Any]] = list(state.get("heldout_curve", [])) if state else []

        def measure() -> None:
            if evaluate is None or (curve and curve[-1]["step"] == run.step):
                return
            start = time.perf_counter()
            metrics = evaluate(drafter, target)
            drafter.train()
            curve.append({"step": run.step, "tokens_seen": run.tokens_seen, **metrics,
                          "seconds": round(time.perf_counter() - start, 2)})
            log(f"held-out at step {run.step}: " + "  ".join(
                f"{k} {v:.3f}" for k, v in metrics.items() if isinstance(v, float)))

        def record() -> dict[str, Any]:
            history = run.history
            tail = history[-20:]
            last = {k: round(sum(h[k] for h in tail if k in h)
                             / max(1, sum(k in h for h in tail)), 4)
                    for k in (tail[-1] if tail else {}) if k not in ("lr", "tokens_seen")}
            chain = [last.get(f"chain_{k}", 0.0) for k in range(ttt_steps)]
            return {
                "method": "eagle3", "base": given, "base_path": str(base),
                "command": command, "config": cfg.as_dict(), "data": data_info,
                **run.counters(), "loss_tokens_seen": loss_tokens_seen,
                "trainable_parameters": trainable,
                "first_loss": history[0]["loss"] if history else None,
                "final_metrics_mean_last_20": last,
                "estimated_acceptance_length": round(1 + sum(chain), 3),
                "history_every": cfg.log_every,
                "history": history[::cfg.log_every] + history[-1:],
                "heldout_curve": curve,
            }

        def save() -> None:
            if out is None:
                return
            rec = record()
            save_drafter(out, drafter, {"diffspec_training": {
                "steps": rec["steps"], "data_sha256": data_info["rows_sha256"]}})
            write_json(out / "training.json", rec)
            run.save_state({
                "drafter": {k: v.to("cpu", copy=True) for k, v in drafter.state_dict().items()},
                "optimizer": optimizer.state_dict(),
                "loss_tokens_seen": loss_tokens_seen, "settings": settings,
                "draft_ids": draft_ids,
                "data": {k: data_info[k] for k in ("files", "synthetic", "rows_sha256")},
                "heldout_curve": curve, "config": cfg.as_dict()})

        tokens = {"batch": 0, "loss": 0}  # the last step's row tokens / loss positions

        def step_fn(module, batch: list[Row], backward) -> dict[str, float]:
            """Micro-batches of ``micro_batch`` rows (1: no padding at all); the gradients
            add up to the batch's (each micro-batch's loss is normalized by the batch's
            positions)."""
            _, lengths, prompt_lens = collate(batch)
            counts = loss_counts(lengths, prompt_lens, ttt_steps)
            loss, sums, n_loss = 0.0, {}, 0
            for i in range(0, len(batch), micro_batch):
                ids, mb_lengths, mb_prompt_lens = collate(batch[i:i + micro_batch])
                with torch.autocast(device.type, dtype=torch.bfloat16, enabled=autocast_bf16):
                    part = eagle3_loss(drafter, target, ids.to(device), mb_lengths,
                                       mb_prompt_lens, ttt_steps, ttt_decay, counts)
                if part.loss.requires_grad:  # a micro-batch may have no loss position
                    backward(part.loss)
                loss += float(part.loss.detach())
                n_loss += part.loss_tokens
                for key, value in part.sums.items():
                    sums[key] = sums.get(key, 0) + value
            tokens.update(batch=int(lengths.sum()), loss=n_loss)
            return {"loss": loss, **step_metrics(sums, ttt_steps)}

        def on_step(step: int, entry: dict[str, float]) -> bool:
            nonlocal loss_tokens_seen
            loss_tokens_seen += tokens["loss"]
            run.record_step(entry, tokens["batch"])
            done = step + 1
            if evaluate_every and done % evaluate_every == 0:
                measure()
            if save_every and done % save_every == 0 and done < cfg.steps:
                save()
            return run.stops_after(step, cfg.steps, log)

        def format_step(step: int, entry: dict[str, float]) -> str:
            accs = " ".join(f"{entry.get(f'acc_{k}', float('nan')):.3f}"
                            for k in range(ttt_steps))
            chains = " ".join(f"{entry.get(f'chain_{k}', float('nan')):.3f}"
                              for k in range(ttt_steps))
            return (f"step {step:5d}/{cfg.steps}  loss {entry['loss']:.4f}  acc {accs}  chain "
                    f"{chains}  lr {entry['lr']:.2e}  {run.pace_note(cfg.steps)}")

        if run.step == 0:
            measure()  # the untrained drafter: the curve's first point
        run.start()
        fit(drafter, StepBatches(rows, run.step, cfg.batch_size, cfg.seed), cfg,
            step_fn=step_fn, optimizer=optimizer, start_step=run.step, reseed=False,
            use_accelerate=False, on_step=on_step, format_step=format_step, log=log)
        measure()
        save()
        drafter.eval()
        return Eagle3Result(drafter, out, record(), run.history)


# ---------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    from diffspec.train.__main__ import _add_data_arg, _add_run_args, _add_train_args

    e = argparse.ArgumentParser(
        prog="python -m training.eagle3",
        description="Train a one-layer EAGLE-3 drafter (vLLM's eagle3 layout) for a Qwen3 / "
                    "Llama target on the frozen target's features (three layers' hidden "
                    "states), forward KL to the target's distributions, with the "
                    "training-time test (unrolled draft steps fed the drafter's own hidden "
                    "states); loss on answer tokens (JSONL 'prompt_len'). --out receives the "
                    "vLLM-loadable drafter (config.json, model.safetensors, training.json), "
                    "rewritten every --save-every steps with the resumable state in "
                    "OUT/checkpoint/.",
        epilog="example (tiny, CPU):\n  python -m training.eagle3 --base "
               "diffspec/assets/synth-qwen3 --data rows.jsonl --out /tmp/synth-eagle3 \\\n"
               "      --steps 300 --seq-len 128 --batch-size 8 --micro-batch 8 --lr 3e-3",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    e.add_argument("--base", required=True, help="the target checkpoint folder (frozen)")
    e.add_argument("--out", required=True, help="output drafter folder")
    _add_data_arg(e)
    e.add_argument("--ttt-steps", type=int, default=3,
                   help="draft steps unrolled per position (training-time test)")
    e.add_argument("--ttt-decay", type=float, default=1.0,
                   help="loss weight of draft step k is this ** k")
    e.add_argument("--aux-layers", type=lambda s: [int(x) for x in s.split(",")],
                   help="target layer ids (vLLM's: 0 = embeddings, L = last layer), comma "
                        "separated; default vLLM's (2, L//2, L-3)")
    e.add_argument("--draft-vocab", type=int, default=0,
                   help="reduce the draft vocabulary to the N most frequent answer tokens "
                        "(writes d2t/t2d); 0 = the target's vocabulary (default)")
    e.add_argument("--freeze-lm-head", action="store_true",
                   help="keep lm_head at the target's LM head (cheaper steps)")
    e.add_argument("--fc-init", choices=("random", "last"), default="random",
                   help="fc start: random, or identity on the last aux layer (the target's "
                        "deep features read out by its own head)")
    e.add_argument("--fc-norm", action="store_true",
                   help="an RMSNorm per aux layer before fc (vLLM's eagle3 `fc_norm`; tames "
                        "targets with massive activations; not in the original EAGLE-3)")
    e.add_argument("--micro-batch", type=int, default=1,
                   help="rows per forward (gradients accumulate over --batch-size rows); 1 "
                        "pads nothing (best for real models on CPU), more is faster for "
                        "tiny models")
    _add_run_args(e, "the drafter", save_every=100)
    _add_train_args(e, TrainConfig(steps=1000, lr=1e-3, warmup_steps=20, batch_size=4,
                                   seq_len=512, log_every=10))
    e.add_argument("--device", default="cpu", help="cpu, cuda, cuda:N")
    return e


def main(argv: list[str] | None = None) -> int:
    from diffspec.train.__main__ import _config, wall_deadline

    argv = sys.argv[1:] if argv is None else argv
    args = build_parser().parse_args(argv)
    result = train_eagle3(
        args.base, args.out, _config(args), data=args.data, ttt_steps=args.ttt_steps,
        ttt_decay=args.ttt_decay, aux_layer_ids=args.aux_layers,
        draft_vocab_size=args.draft_vocab or None, freeze_lm_head=args.freeze_lm_head,
        save_every=args.save_every, micro_batch=args.micro_batch, fc_init=args.fc_init,
        fc_norm=args.fc_norm, autocast_bf16=args.autocast_bf16, resume=args.resume,
        max_rows=args.max_rows,
        max_cpu_s=None if args.max_cpu_minutes is None else 60 * args.max_cpu_minutes,
        deadline=wall_deadline(args.max_wall_minutes),
        device=args.device, command="python -m training.eagle3 " + shlex.join(argv),
    )
    keys = ("steps", "tokens_seen", "cpu_time_s", "wall_time_s", "first_loss",
            "final_metrics_mean_last_20", "estimated_acceptance_length")
    print(json.dumps({k: result.record[k] for k in keys}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
