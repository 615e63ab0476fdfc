"""The diffusion view shared by diffspec's vLLM model classes (Orthrus, NLD).

A self-speculative model in vLLM *is* the engine's own causal model (the AR view); its
diffusion view runs the same embeddings, layer norms, MLPs and final norm, and swaps only
the attention of every layer for the method's draft attention (Orthrus: the ``*_diff``
projections; NLD: the same projections plus the draft LoRA). The attention goes through
the layer's own paged ``Attention``, so under the non-causal metadata the drafter builds,
a block reads the AR K/V of its prefix from the engine's KV cache.
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import islice

import torch
from torch import nn


class DiffusionViewMixin:
    """Adds :meth:`diffusion_hidden_states` to a vLLM ``*ForCausalLM`` whose subclass
    implements :meth:`_draft_attention`. Runs eagerly (it bypasses the compiled
    ``model.forward``), so the AR graph is never traced with it."""

    model: nn.Module

    def _layers(self) -> Iterable[nn.Module]:
        return islice(self.model.layers, self.model.start_layer, self.model.end_layer)

    def _draft_attention(
        self,
        attn: nn.Module,
        positions: torch.Tensor,  # [num_tokens]
        hidden: torch.Tensor,  # [num_tokens, hidden]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        raise NotImplementedError

    def diffusion_hidden_states(
        self,
        input_ids: torch.Tensor,  # [num_tokens] blocks [anchor, <mask> x n], concatenated
        positions: torch.Tensor,  # [num_tokens]
    ) -> torch.Tensor:  # [num_tokens, hidden]
        """The diffusion view over the current forward context's (non-causal) metadata."""
        hidden = self.model.embed_input_ids(input_ids)
        residual = None
        for layer in self._layers():
            if residual is None:
                residual, hidden = hidden, layer.input_layernorm(hidden)
            else:
                hidden, residual = layer.input_layernorm(hidden, residual)
            hidden = self._draft_attention(layer.self_attn, positions, hidden)
            hidden, residual = layer.post_attention_layernorm(hidden, residual)
            hidden = layer.mlp(hidden)
        hidden, _ = self.model.norm(hidden, residual)
        return hidden
