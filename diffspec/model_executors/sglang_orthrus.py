"""Orthrus in SGLang: SGLang's own Qwen3 (the AR view) plus per-layer diffusion attention.

:class:`OrthrusForCausalLM` *is* SGLang's ``Qwen3ForCausalLM`` (same layers, same radix
attention, same token-to-KV pool): it serves plain requests and every verify pass. Each
decoder layer's ``self_attn`` additionally holds the diffusion projections, built from
SGLang's tensor-parallel layers like the AR ones:

* ``qkv_proj_diff`` (``QKVParallelLinear``; the checkpoint's ``q/k/v_proj_diff`` load into
  it as the ``q`` / ``k`` / ``v`` shards),
* ``o_proj_diff`` (``RowParallelLinear``), ``q_norm_diff`` / ``k_norm_diff`` (``RMSNorm``).

The diffusion view (:class:`~diffspec.model_executors.sglang_views.DiffusionViewMixin`)
runs a block ``[anchor, <mask> x n]`` through the same embeddings, norms, MLPs, rotary and
LM head with every attention computed by the ``*_diff`` modules, non-causally over the AR
K/V of the committed prefix (read from the pool) and the block's own diffusion K/V, which
is the reference's attention (:mod:`diffspec.model_executors.orthrus`). Drafts are read
from shifted logits: block position ``j`` predicts token ``j + 1``.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import QKVParallelLinear, RowParallelLinear
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.models.qwen3 import Qwen3Attention, Qwen3ForCausalLM
from sglang.srt.models.utils import apply_qk_norm
from sglang.srt.utils import add_prefix

from diffspec.model_executors.sglang_views import DiffusionViewMixin

__all__ = ["OrthrusForCausalLM"]

_DIFF_SHARDS = (("q_proj_diff", "q"), ("k_proj_diff", "k"), ("v_proj_diff", "v"))


class OrthrusForCausalLM(DiffusionViewMixin, Qwen3ForCausalLM):
    """SGLang's Qwen3 with Orthrus's diffusion attention projections in every layer."""

    draft_logits_shift = True  # block position j predicts token j + 1

    def __init__(self, config, quant_config=None, prefix: str = "") -> None:
        super().__init__(config, quant_config=quant_config, prefix=prefix)
        for i in range(self.model.start_layer, self.model.end_layer):
            _add_diffusion_projections(
                self.model.layers[i].self_attn, config, quant_config,
                add_prefix(f"layers.{i}.self_attn", add_prefix("model", prefix)))

    def _draft_qkv(
        self,
        attn: Qwen3Attention,
        positions: torch.Tensor,  # [T]
        hidden: torch.Tensor,  # [T, hidden]
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        qkv, _ = attn.qkv_proj_diff(hidden)
        q, k, v = qkv.split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q, k = apply_qk_norm(q=q, k=k, q_norm=attn.q_norm_diff, k_norm=attn.k_norm_diff,
                             head_dim=attn.head_dim, allow_inplace=False)
        q, k = attn.rotary_emb(positions, q, k)
        return q, k, v

    def _draft_out(self, attn: Qwen3Attention, heads: torch.Tensor) -> torch.Tensor:
        out, _ = attn.o_proj_diff(heads)
        return out

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Qwen3's loader for the AR weights; the ``*_diff`` tensors go to the diffusion
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
            raise ValueError(
                f"the checkpoint has no Orthrus diffusion weights for {missing[0]} "
                f"({len(missing)} tensors missing); expected model.layers.N.self_attn."
                f"{{q,k,v,o}}_proj_diff and {{q,k}}_norm_diff for every layer")


def _add_diffusion_projections(attn: Qwen3Attention, config, quant_config, prefix: str) -> None:
    """Give ``attn`` the ``*_diff`` twins of its projections and q/k norms."""
    bias = getattr(config, "attention_bias", False)
    attn.qkv_proj_diff = QKVParallelLinear(
        attn.hidden_size, attn.head_dim, attn.total_num_heads, attn.total_num_kv_heads,
        bias=bias, quant_config=quant_config, parallel_group="attn_tp",
        prefix=add_prefix("qkv_proj_diff", prefix))
    attn.o_proj_diff = RowParallelLinear(
        attn.total_num_heads * attn.head_dim, attn.hidden_size, bias=bias,
        quant_config=quant_config, parallel_group="attn_tp", reduce_results=False,
        prefix=add_prefix("o_proj_diff", prefix))
    attn.q_norm_diff = RMSNorm(attn.head_dim, eps=config.rms_norm_eps)
    attn.k_norm_diff = RMSNorm(attn.head_dim, eps=config.rms_norm_eps)
