"""Files shipped inside the package (no torch import here).

``synth-qwen3/``: the small bundled model the demo runs: a 2-layer Qwen3 trained on the
synthetic language of :mod:`diffspec.testing.synthetic` (see its ``TRAINING.md``).
``synth-orthrus/``: synth-qwen3 plus Orthrus diffusion heads distilled by ``diffspec.train``.
``synth-refusion/``: synth-qwen3 fine-tuned with the ReFusion objective.
``synth-tidar/``: synth-qwen3 trained with the TiDAR recipe (causal + fully-masked copy).
``synth-dllm/``: a tiny LLaDA-layout and a tiny Fast-dLLM-v2-layout diffusion LM.
``synth-nld/``: a tiny Nemotron-Labs-Diffusion (Ministral3) trained on the synthetic language
(AR + block diffusion) with a trained linear self-speculation draft LoRA.
Each folder's ``TRAINING.md`` gives the exact command that reproduces it.
"""

from __future__ import annotations

from pathlib import Path

ASSETS_DIR = Path(__file__).resolve().parent
SYNTH_QWEN3_DIR = ASSETS_DIR / "synth-qwen3"
SYNTH_REFUSION_DIR = ASSETS_DIR / "synth-refusion"
SYNTH_ORTHRUS_DIR = ASSETS_DIR / "synth-orthrus"
SYNTH_TIDAR_DIR = ASSETS_DIR / "synth-tidar"
SYNTH_DLLM_DIR = ASSETS_DIR / "synth-dllm"  # llada/ and fast_dllm_v2/
SYNTH_NLD_DIR = ASSETS_DIR / "synth-nld"  # NLD layout + linear_spec_lora/
