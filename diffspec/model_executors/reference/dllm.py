"""Reference executors for the diffusion LMs Fast-dLLM decodes: LLaDA, Dream, Fast-dLLM v2.

Design notes: docs/design/reference.md (section ``diffspec/model_executors/reference/dllm.py``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from diffspec.core.checkpoint import (
    CheckpointError,
    CheckpointInfo,
    inspect_checkpoint,
    require_method,
)
from diffspec.model_executors.reference.views import block_view_logits

__all__ = ["DiffusionLM", "LLaDAModelLM", "llada_dims", "load_dllm"]

Attention = Literal["bidirectional", "block_causal"]
_NLD_PREFIXES = {"model": "encoder.", "lm_head": "diffusion_head."}  # transformers -> NLD names
_ATTENTION: dict[str, Attention] = {
    "llada": "bidirectional",
    "dream": "bidirectional",
    "fast_dllm_v2": "block_causal",
}


@dataclass
class DiffusionLM:
    """A loaded diffusion LM and what a decoder needs to know about it."""

    model: nn.Module  # in eval mode; called through views.block_view_logits
    family: str  # "llada" | "dream" | "fast_dllm_v2" | "nld"
    mask_token_id: int
    eos_token_ids: tuple[int, ...]  # config.json then generation_config.json
    logits_shift: bool  # True: position j's logits predict token j+1
    attention: Attention  # the attention the model was trained with
    block_size: int | None  # trained block (Fast-dLLM v2 bd_size); None: any block
    max_positions: int  # largest position id + 1 the model supports
    info: CheckpointInfo
    causal_prefix: bool = False  # block-causal: True = causal prompt, blocks after it (NLD)

    def forward(
        self,
        input_ids: Tensor,  # [batch, n]
        position_ids: Tensor,  # [batch, n]
        attention_mask: Tensor,  # [batch, n, cache_len + n] bool, keys = [cache, new tokens]
        cache=None,  # DynamicCache or None
        keep_kv: bool = False,
    ) -> Tensor:  # [batch, n, vocab] float32, unshifted (as the head computes them)
        """One forward (no gradients); the new tokens' K/V stay in ``cache`` only if ``keep_kv``."""
        with torch.no_grad():
            logits = block_view_logits(self.model, input_ids, position_ids, cache,
                                       attention_mask, keep_kv=keep_kv)
        return logits.float()

    @staticmethod
    def new_cache():
        """An empty KV cache for :meth:`forward`."""
        from transformers import DynamicCache

        return DynamicCache()


# ---------------------------------------------------------------------------- loading


def load_dllm(path: str | Path, *, dtype: torch.dtype = torch.float32) -> DiffusionLM:
    """Load a LLaDA, Dream, Fast-dLLM v2 or NLD (diffusion mode) checkpoint folder (or a
    cached hub id).

    Raises :class:`CheckpointError` for any other checkpoint (naming its family), for a
    missing / unexpected / mis-shaped tensor (naming it), and for an LLaDA config this
    module does not implement. Weights are loaded strictly, in ``dtype`` (fp32 default:
    the reference decoders are compared token for token in fp32).
    """
    info = inspect_checkpoint(path)
    if info.family == "nld":
        return _load_nld_diffusion(info, dtype)
    require_method(info, "fast_dllm")  # family llada / dream / fast_dllm_v2, mask token present
    model = _build_llada(info) if info.family == "llada" else _build_qwen2(info)
    _load_weights(model, info)
    model.to(dtype).eval()
    cfg = info.config
    max_positions = int(cfg.get("max_sequence_length") or cfg.get("max_position_embeddings"))
    return DiffusionLM(
        model=model,
        family=str(info.family),
        mask_token_id=int(info.mask_token_id),  # type: ignore[arg-type]  # require_method
        eos_token_ids=info.eos_token_ids,
        logits_shift=info.logits_shift,
        attention=_ATTENTION[str(info.family)],
        block_size=info.block_size if info.family == "fast_dllm_v2" else None,
        max_positions=max_positions,
        info=info,
    )


def _load_nld_diffusion(info: CheckpointInfo, dtype: torch.dtype) -> DiffusionLM:
    """NLD's diffusion mode: the backbone without the draft LoRA."""
    from diffspec.model_executors.reference.nld import load_nld

    nld = load_nld(info.path, dtype=dtype, lora=False)
    published = {_NLD_PREFIXES[k.split(".", 1)[0]] + k.split(".", 1)[1]
                 for k in nld.lm.state_dict()}
    _require_names(info, published, info.weight_names)  # from_pretrained would init the missing
    return DiffusionLM(
        model=nld.lm, family="nld", mask_token_id=nld.mask_token_id,
        eos_token_ids=nld.eos_token_ids, logits_shift=nld.logits_shift,
        attention="block_causal", block_size=nld.block_size,
        max_positions=int(nld.config.max_position_embeddings), info=info, causal_prefix=True,
    )


def _checkpoint_tensors(info: CheckpointInfo) -> dict[str, Tensor]:
    """Every tensor of the checkpoint (sharded or not), by name."""
    from safetensors.torch import load_file

    index = info.path / "model.safetensors.index.json"
    if index.is_file():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in info.path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"checkpoint {info.path} has no *.safetensors weights")
    tensors: dict[str, Tensor] = {}
    for name in files:
        tensors.update(load_file(str(info.path / name)))
    return tensors


def _require_names(info: CheckpointInfo, expected: Iterable[str], present: Iterable[str]) -> None:
    """Raise CheckpointError naming the first missing, then the first unexpected tensor."""
    expected, present = sorted(set(expected)), set(present)
    missing = [n for n in expected if n not in present]
    unexpected = sorted(present.difference(expected))
    layout = f"{info.family} layout ({info.architecture})"
    if missing:
        raise CheckpointError(f"checkpoint {info.path} lacks {len(missing)} tensor(s) of the "
                              f"{layout}, first {missing[0]!r}")
    if unexpected:
        raise CheckpointError(f"checkpoint {info.path} holds {len(unexpected)} tensor(s) the "
                              f"{layout} does not have, first {unexpected[0]!r}")


def _load_weights(model: nn.Module, info: CheckpointInfo) -> None:
    """Strict load: every parameter of the layout must be there with its shape, nothing else."""
    tensors = _checkpoint_tensors(info)
    expected = model.state_dict()
    if getattr(getattr(model, "config", None), "tie_word_embeddings", False):
        expected.pop("lm_head.weight", None)  # tied to the embedding, absent from the file
    _require_names(info, expected, tensors)
    for name, value in expected.items():
        if tuple(tensors[name].shape) != tuple(value.shape):
            raise CheckpointError(f"checkpoint {info.path}: tensor {name!r} has shape "
                                  f"{tuple(tensors[name].shape)}, the config implies "
                                  f"{tuple(value.shape)}")
    model.load_state_dict(tensors, strict=False)  # strictness checked above (tied head)
    if hasattr(model, "tie_weights"):
        model.tie_weights()


def _build_qwen2(info: CheckpointInfo) -> nn.Module:
    """Dream and Fast-dLLM v2 are Qwen2.5 tensors: transformers' Qwen2ForCausalLM (SDPA)."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    c = info.config
    keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
            "rms_norm_eps", "rope_theta", "hidden_act", "tie_word_embeddings")
    absent = [k for k in keys[:6] if k not in c]
    if absent:
        raise CheckpointError(f"checkpoint {info.path} config.json lacks {', '.join(absent)}")
    config = Qwen2Config(**{k: c[k] for k in keys if k in c}, use_sliding_window=False,
                         sliding_window=None, attention_dropout=0.0)
    if c.get("rope_scaling"):
        raise CheckpointError(f"checkpoint {info.path}: rope_scaling {c['rope_scaling']!r} "
                              f"is not supported by the reference executor")
    config._attn_implementation = "sdpa"
    return Qwen2ForCausalLM(config)


# ---------------------------------------------------------------------------- LLaDA


@dataclass(frozen=True)
class LLaDADims:
    """The LLaDA config fields the module uses (OLMo names in config.json)."""

    d_model: int
    n_heads: int
    n_kv_heads: int
    n_layers: int
    mlp_hidden_size: int
    vocab_size: int  # rows of wte / ff_out (config ``embedding_size`` when set)
    rope_theta: float
    rms_norm_eps: float
    qkv_bias: bool
    weight_tying: bool
    max_sequence_length: int

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


# config key -> the only value this module implements (what LLaDA-8B ships)
_LLADA_FIXED = {"block_type": "llama", "layer_norm_type": "rms", "activation_type": "silu",
                "rope": True, "alibi": False, "attention_layer_norm": False,
                "include_bias": False, "input_emb_norm": False, "scale_logits": False,
                "block_group_size": 1}


def llada_dims(config: dict[str, Any], where: str | Path = "config") -> LLaDADims:
    """Read (and check) an LLaDA ``config.json``; raise CheckpointError on what is unsupported."""
    for key, value in _LLADA_FIXED.items():
        if key in config and config[key] != value:
            raise CheckpointError(f"{where}: LLaDA config {key}={config[key]!r} is not "
                                  f"supported (only {value!r}, as in LLaDA-8B)")
    try:
        d, heads = int(config["d_model"]), int(config["n_heads"])
        mlp = config.get("mlp_hidden_size") or config["mlp_ratio"] * d
        dims = LLaDADims(
            d_model=d, n_heads=heads, n_kv_heads=int(config.get("n_kv_heads") or heads),
            n_layers=int(config["n_layers"]), mlp_hidden_size=int(mlp),
            vocab_size=int(config.get("embedding_size") or config["vocab_size"]),
            rope_theta=float(config.get("rope_theta", 10000.0)),
            rms_norm_eps=float(config.get("rms_norm_eps", 1e-5)),
            qkv_bias=bool(config.get("include_qkv_bias", False)),
            weight_tying=bool(config.get("weight_tying", False)),
            max_sequence_length=int(config.get("max_sequence_length", 4096)),
        )
    except KeyError as exc:
        raise CheckpointError(f"{where}: LLaDA config.json lacks {exc.args[0]!r}") from exc
    if d % heads or heads % dims.n_kv_heads:
        raise CheckpointError(f"{where}: d_model={d}, n_heads={heads}, "
                              f"n_kv_heads={dims.n_kv_heads} do not divide")
    return dims


def _build_llada(info: CheckpointInfo) -> nn.Module:
    return LLaDAModelLM(llada_dims(info.config, info.path))


class _RMSNorm(nn.Module):
    """LLaDA's RMSLayerNorm: normalise in fp32, cast back, then scale."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:  # [..., size]
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def _rope(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos, sin ``[batch, 1, n, head_dim]`` in fp32 for ``positions [batch, n]``."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim)
    angles = positions.float()[..., None] * inv_freq.to(positions.device)  # [batch, n, hd/2]
    emb = torch.cat([angles, angles], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # x: [batch, heads, n, head_dim]
    x1, x2 = x.float().chunk(2, dim=-1)
    return (x.float() * cos + torch.cat([-x2, x1], dim=-1) * sin).to(x.dtype)


class _LLaDABlock(nn.Module):
    """One ``block_type: llama`` layer, with LLaDA's parameter names."""

    def __init__(self, dims: LLaDADims, layer_idx: int) -> None:
        super().__init__()
        d, hd = dims.d_model, dims.head_dim
        self.dims, self.layer_idx = dims, layer_idx
        self.attn_norm = _RMSNorm(d, dims.rms_norm_eps)
        self.q_proj = nn.Linear(d, dims.n_heads * hd, bias=dims.qkv_bias)
        self.k_proj = nn.Linear(d, dims.n_kv_heads * hd, bias=dims.qkv_bias)
        self.v_proj = nn.Linear(d, dims.n_kv_heads * hd, bias=dims.qkv_bias)
        self.attn_out = nn.Linear(dims.n_heads * hd, d, bias=False)
        self.ff_norm = _RMSNorm(d, dims.rms_norm_eps)
        self.ff_proj = nn.Linear(d, dims.mlp_hidden_size, bias=False)  # the SwiGLU gate
        self.up_proj = nn.Linear(d, dims.mlp_hidden_size, bias=False)
        self.ff_out = nn.Linear(dims.mlp_hidden_size, d, bias=False)

    def forward(
        self,
        x: Tensor,  # [batch, n, d_model]
        cos: Tensor,  # [batch, 1, n, head_dim]
        sin: Tensor,  # [batch, 1, n, head_dim]
        bias: Tensor | None,  # [batch, 1, n, cache_len + n] additive
        cache,  # DynamicCache or None
    ) -> Tensor:  # [batch, n, d_model]
        b, n, _ = x.shape
        hd = self.dims.head_dim
        h = self.attn_norm(x)
        q = self.q_proj(h).view(b, n, -1, hd).transpose(1, 2)
        k = self.k_proj(h).view(b, n, -1, hd).transpose(1, 2)
        v = self.v_proj(h).view(b, n, -1, hd).transpose(1, 2)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        if cache is not None:
            k, v = cache.update(k, v, self.layer_idx)  # [batch, kv_heads, cache_len + n, hd]
        att = F.scaled_dot_product_attention(q, k, v, attn_mask=bias,
                                             enable_gqa=q.shape[1] != k.shape[1])
        x = x + self.attn_out(att.transpose(1, 2).reshape(b, n, -1))
        h = self.ff_norm(x)
        return x + self.ff_out(F.silu(self.ff_proj(h)) * self.up_proj(h))


class LLaDAModelLM(nn.Module):
    """LLaDA (``LLaDAModelLM``): state-dict names ``model.transformer.{wte, blocks.N.*, ln_f,
    ff_out}`` as in ``GSAI-ML/LLaDA-8B-*``. Called like a transformers causal LM by
    :func:`~diffspec.model_executors.reference.views.block_view_logits` (``input_ids``,
    ``position_ids``, additive 4-D ``attention_mask``, ``past_key_values``)."""

    def __init__(self, dims: LLaDADims) -> None:
        super().__init__()
        self.dims = dims
        # what block_view_logits and the decoders read off a model's config
        self.config = SimpleNamespace(_attn_implementation="sdpa", vocab_size=dims.vocab_size,
                                      max_position_embeddings=dims.max_sequence_length)
        transformer = nn.ModuleDict({
            "wte": nn.Embedding(dims.vocab_size, dims.d_model),
            "blocks": nn.ModuleList(_LLaDABlock(dims, i) for i in range(dims.n_layers)),
            "ln_f": _RMSNorm(dims.d_model, dims.rms_norm_eps),
        })
        if not dims.weight_tying:
            transformer["ff_out"] = nn.Linear(dims.d_model, dims.vocab_size, bias=False)
        self.model = nn.Module()
        self.model.transformer = transformer

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.transformer["wte"]

    def forward(
        self,
        input_ids: Tensor,  # [batch, n]
        position_ids: Tensor,  # [batch, n]
        attention_mask: Tensor | None = None,  # [batch, 1, n, cache_len + n] additive; None: all
        past_key_values=None,  # DynamicCache or None
        use_cache: bool = False,
    ) -> SimpleNamespace:  # .logits [batch, n, vocab]
        t = self.model.transformer
        x = t["wte"](input_ids)
        cos, sin = _rope(position_ids, self.dims.head_dim, self.dims.rope_theta)
        cache = past_key_values if use_cache else None
        for block in t["blocks"]:
            x = block(x, cos, sin, attention_mask, cache)
        x = t["ln_f"](x)
        head = t["wte"].weight if self.dims.weight_tying else t["ff_out"].weight
        return SimpleNamespace(logits=F.linear(x, head))
