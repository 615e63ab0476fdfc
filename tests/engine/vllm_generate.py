"""Run greedy/seeded generation in a real vLLM and print the result as JSON.

A script, not a test: vLLM's offline engine starts a spawned engine-core process, so
``vllm.LLM`` must be created under ``if __name__ == "__main__"``. The engine tests run it
in a subprocess:

    python tests/engine/vllm_generate.py MODEL_DIR REQUESTS_JSON

REQUESTS_JSON is a list of {"prompt_token_ids": [...], "max_tokens": N}. Prints one JSON
object after RESULT_PREFIX: {"outputs": [[token ids], ...], "plugin_registered": bool, "vllm_version": str}.
"""

from __future__ import annotations

import json
import os
import sys

RESULT_PREFIX = "DIFFSPEC_RESULT "  # vLLM logs to stdout too; the result line has this prefix


def main() -> None:
    model, requests_path = sys.argv[1], sys.argv[2]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default is too big for CI
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    import diffspec.plugin.vllm as plugin

    requests = json.loads(open(requests_path).read())
    llm = LLM(model=model, dtype="float32", max_model_len=512, seed=0, enforce_eager=True)
    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    params = [SamplingParams(temperature=0.0, max_tokens=r["max_tokens"], ignore_eos=r.get("ignore_eos", False)) for r in requests]
    results = llm.generate(prompts, params, use_tqdm=False)
    print(
        RESULT_PREFIX
        + json.dumps(
            {
                "outputs": [list(r.outputs[0].token_ids) for r in results],
                "finish_reasons": [r.outputs[0].finish_reason for r in results],
                "plugin_registered": plugin._registered,
                "vllm_version": vllm.__version__,
            }
        )
    )


if __name__ == "__main__":
    main()
