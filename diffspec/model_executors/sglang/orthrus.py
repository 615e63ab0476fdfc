"""Orthrus in SGLang: SGLang's own Qwen3 or Llama (the AR view) plus per-layer diffusion
attention.

Design notes: docs/design/sglang.md (section ``diffspec/model_executors/sglang/orthrus.py``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import QKVParallelLinear, RowParallelLinear
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.llama import LlamaForCausalLM
from sglang.srt.models.qwen3 import Qwen3ForCausalLM
from sglang.srt.models.utils import apply_qk_norm
from sglang.srt.utils import add_prefix
from torch import nn

from diffspec.core.checkpoint import orthrus_weights_missing
from diffspec.model_executors.sglang.views import DiffusionViewMixin, full_output

__all__ = ["OrthrusForCausalLM", "OrthrusLlamaForCausalLM"]

_DIFF_SHARDS = (("q_proj_diff", "q"), ("k_proj_diff", "k"), ("v_proj_diff", "v"))


class _OrthrusMixin(DiffusionViewMixin):
    """The Orthrus part shared by both bases: build the ``*_diff`` twins of every layer's
    attention, draft through them, and refuse a checkpoint without them."""

    draft_logits_shift = True  # block position j predicts token j + 1
    config: object

    def _add_diffusion_modules(self, quant_config, prefix: str) -> None:
        for i in range(self.model.start_layer, self.model.end_layer):
            _add_diffusion_projections(
                self.model.layers[i].self_attn, self.config, quant_config,
                add_prefix(f"layers.{i}.self_attn", add_prefix("model", prefix)))

    def _draft_qkv(
        self,
        attn: nn.Module,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv, _ = attn.qkv_proj_diff(hidden)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        if hasattr(attn, "q_norm_diff"):  # Qwen3; Llama has no q/k norms
            q, k = apply_qk_norm(q=q, k=k, q_norm=attn.q_norm_diff, k_norm=attn.k_norm_diff,
                                 head_dim=attn.head_dim, allow_inplace=False)
        q, k = attn.rotary_emb(positions, q, k)
        return q, k, v

    def _draft_out(self, attn: nn.Module, heads: torch.Tensor) -> torch.Tensor:
        out, _ = attn.o_proj_diff(heads)  # this rank's share
        return full_output(attn.o_proj_diff, out)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The base's loader for the AR weights; the ``*_diff`` tensors go to the diffusion
        modules (``q/k/v_proj_diff`` as shards of ``qkv_proj_diff``). Raises if any
        diffusion parameter is left without a checkpoint tensor."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()

        def ar_weights():
            for name, tensor in weights:
                if "_diff." not in name:
                    yield name, tensor
                    continue
                target, shard = name, None
                for source, shard_id in _DIFF_SHARDS:
                    if f".{source}." in name:
                        target, shard = name.replace(source, "qkv_proj_diff"), shard_id
                if target not in params:
                    continue  # a layer of another pipeline stage
                param = params[target]
                loader = getattr(param, "weight_loader", default_weight_loader)
                loader(param, tensor, shard) if shard is not None else loader(param, tensor)
                loaded.add(target if shard is None else f"{target}:{shard}")

        super().load_weights(ar_weights())
        expected = {f"{n}:{s}" for n in params if ".qkv_proj_diff." in n for s in "qkv"}
        expected |= {n for n in params if "_diff." in n and ".qkv_proj_diff." not in n}
        missing = sorted(expected - loaded)
        if missing:
            raise orthrus_weights_missing(
                missing, "tensors", norms=any("_norm_diff." in n for n in expected))


class OrthrusForCausalLM(_OrthrusMixin, Qwen3ForCausalLM):
    """SGLang's Qwen3 with Orthrus's diffusion attention projections and q/k norms in every
    layer (``OrthrusLM`` / ``OrthrusForCausalLM``)."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        self._add_diffusion_modules(quant_config, prefix)


class OrthrusLlamaForCausalLM(_OrthrusMixin, LlamaForCausalLM):
    """SGLang's Llama with Orthrus's diffusion attention projections in every layer
    (``OrthrusLlamaForCausalLM``, ``model_type: "llama"``; e.g. on SmolLM2)."""

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        self._add_diffusion_modules(quant_config, prefix)


def _add_diffusion_projections(attn: nn.Module, config, quant_config, prefix: str) -> None:
    """Give ``attn`` the ``*_diff`` twins of its projections (biases and tensor-parallel
    groups as the AR ones have them) and, when it has q/k norms (Qwen3), of those."""
    attn.qkv_proj_diff = QKVParallelLinear(
        attn.hidden_size, attn.head_dim, attn.total_num_heads, attn.total_num_kv_heads,
        bias=attn.qkv_proj.bias is not None, quant_config=quant_config,
        parallel_group=attn.qkv_proj.parallel_group, prefix=add_prefix("qkv_proj_diff", prefix))
    attn.o_proj_diff = RowParallelLinear(
        attn.total_num_heads * attn.head_dim, attn.hidden_size,
        bias=attn.o_proj.bias is not None, quant_config=quant_config,
        parallel_group=attn.o_proj.parallel_group, reduce_results=False,
        prefix=add_prefix("o_proj_diff", prefix))
    if hasattr(attn, "q_norm"):
        attn.q_norm_diff = RMSNorm(attn.head_dim, eps=config.rms_norm_eps)
        attn.k_norm_diff = RMSNorm(attn.head_dim, eps=config.rms_norm_eps)
