"""Run generation in a real vLLM and print the result as JSON.

A script, not a test: vLLM's offline engine starts a spawned engine-core process, so
``vllm.LLM`` must be created under ``if __name__ == "__main__"``. The engine tests run it
in a subprocess:

    python tests/engine/vllm_generate.py MODEL_DIR REQUESTS_JSON [JOB_JSON]

REQUESTS_JSON is a list of requests: {"prompt_token_ids": [...], "max_tokens": N} plus
optional SamplingParams fields ("temperature", "seed", "top_k", "top_p", "ignore_eos",
"stop_token_ids"); temperature defaults to 0 (greedy).

JOB_JSON (optional) is {"runs": [{"name": str, "model": path, "llm": {LLM kwargs},
"batches": {batch name: [requests]}}], "config_errors": {name: {"model": path,
"speculative_config": {...}}}, "multiprocessing": bool}. Without "multiprocessing": true
the engine core and worker run in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, unless
the environment sets it). Each run starts one engine (one after the other, in this
process) on its model (default MODEL_DIR) with the default kwargs below updated by "llm"
(e.g. "speculative_config", "block_size"; "count_forwards": true counts the model's forwards
per batch, through ``collective_rpc``, which needs VLLM_ALLOW_INSECURE_SERIALIZATION=1;
"probe_runner": true records, the same way, the worker's model runner class and the Triton
kernels Triton's interpreter launched per batch, see tests/engine/vllm_v2_cpu.py;
"lookup_stats": true records, the same way, the diffspec drafter's prompt-lookup counters
per batch, ``LookupStats``), then
generates its batches one after the other (default: one batch "default" of REQUESTS_JSON). Each config_errors entry only builds the
engine config and records the error it raises. Without JOB_JSON there is one plain run.

Prints one JSON object after RESULT_PREFIX: {"runs": {run: {batch: {"outputs": [[token
ids]], "finish_reasons": [...], "spec_steps": [[accepted drafts per verify step] | null],
"forwards": {"model": n, "drafter": n, "max_rows": the most rows one forward of the
model ran during the batch} (with count_forwards), "lookup": {counter: n} (with
lookup_stats), "runner": {"classes": [model runner class and its bases, "module.Name"],
"kernels": {kernel: launches}, "speculator": the V2 runner's speculator class or null,
"draft_forwards": its forwards so far (diffspec's)} (with probe_runner)}},
"metrics": {run: {batch: {counter: value after the batch}}}, "config_errors": {name:
message | null}, "plugin_registered": bool, "vllm_version": str}; the top level also
repeats "outputs" and "finish_reasons" of the first batch of the first run.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

RESULT_PREFIX = "DIFFSPEC_RESULT "  # vLLM logs to stdout too; the result line has this prefix

DEFAULT_LLM_KWARGS = {"dtype": "float32", "max_model_len": 512, "seed": 0, "enforce_eager": True}
SAMPLING_KEYS = ("temperature", "seed", "top_k", "top_p", "ignore_eos", "stop_token_ids", "stop",
                 "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
                 "min_tokens", "logit_bias", "logprobs")


def _run(model: str, llm_kwargs: dict, batches: dict[str, list[dict]]) -> tuple[dict, dict]:
    """Start one engine, generate each batch in turn; (outputs per batch, counters after
    each batch: spec decode and prefix cache)."""
    from vllm import LLM

    llm_kwargs = dict(llm_kwargs)
    count = llm_kwargs.pop("count_forwards", False)
    probe = llm_kwargs.pop("probe_runner", False)
    lookup = llm_kwargs.pop("lookup_stats", False)
    llm = LLM(model=model, **{**DEFAULT_LLM_KWARGS, **llm_kwargs})
    if count:
        llm.collective_rpc(_install_forward_counter)
    outputs, metrics = {}, {}
    for name, requests in batches.items():
        before = llm.collective_rpc(_read_forward_counter)[0] if count else None
        launched = llm.collective_rpc(_probe_runner)[0]["kernels"] if probe else None
        looked_up = llm.collective_rpc(_read_lookup_stats)[0] if lookup else None
        outputs[name] = _generate(llm, requests)
        if lookup:
            after = llm.collective_rpc(_read_lookup_stats)[0]
            outputs[name]["lookup"] = {k: after[k] - looked_up[k] for k in after}
        if count:
            after = llm.collective_rpc(_read_forward_counter)[0]
            outputs[name]["forwards"] = {k: after[k] - before[k] if k != "max_rows"
                                         else after[k] for k in after}
        if probe:
            runner = llm.collective_rpc(_probe_runner)[0]
            runner["kernels"] = {k: n - launched.get(k, 0) for k, n in runner["kernels"].items()
                                 if n > launched.get(k, 0)}
            outputs[name]["runner"] = runner
        if not llm_kwargs.get("disable_log_stats", True):
            metrics[name] = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")
                             and m.name.startswith(("vllm:spec_decode", "vllm:prefix_cache"))}
    del llm
    gc.collect()
    return outputs, metrics


def _install_forward_counter(worker) -> None:
    """Count the model's forwards (calls of its first decoder layer) in the worker."""
    model = worker.model_runner.get_model()
    layer = model.model.layers[model.model.start_layer]
    layer._diffspec_forwards = 0
    layer._diffspec_max_rows = 0  # since the last read

    def hook(module, args, output):
        module._diffspec_forwards += 1
        # a decoder layer's first argument: the forward's positions, one per row
        module._diffspec_max_rows = max(module._diffspec_max_rows, int(args[0].shape[-1]))

    layer.register_forward_hook(hook)


def _read_forward_counter(worker) -> dict:
    """{"model": forwards of the model, "drafter": forwards the drafter ran itself,
    "max_rows": the most rows one forward of the model ran since the last read}."""
    model = worker.model_runner.get_model()
    drafter = getattr(worker.model_runner, "drafter", None)
    layer = model.model.layers[model.model.start_layer]
    max_rows, layer._diffspec_max_rows = layer._diffspec_max_rows, 0
    return {"model": layer._diffspec_forwards, "max_rows": max_rows,
            "drafter": getattr(drafter, "num_forwards", 0)}


def _read_lookup_stats(worker) -> dict:
    """The diffspec drafter's prompt-lookup counters (``LookupStats`` as a dict)."""
    import dataclasses

    return dataclasses.asdict(worker.model_runner.drafter.lookup_stats)


def _probe_runner(worker) -> dict:
    """The worker's model runner class with its bases ("module.Name") and the Triton kernels
    launched so far in the worker by Triton's interpreter ({} when it is not on)."""
    try:
        from triton.runtime.interpreter import InterpretedFunction
        kernels = dict(getattr(InterpretedFunction, "diffspec_launches", {}))
    except ImportError:
        kernels = {}
    classes = [f"{c.__module__}.{c.__qualname__}" for c in type(worker.model_runner).__mro__]
    speculator = getattr(worker.model_runner, "speculator", None)
    return {"classes": classes, "kernels": kernels,
            "speculator": None if speculator is None else
            f"{type(speculator).__module__}.{type(speculator).__qualname__}",
            "draft_forwards": getattr(speculator, "num_forwards", None)}


def _generate(llm, requests: list[dict]) -> dict:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in requests]
    def fields(r: dict) -> dict:
        out = {k: r[k] for k in SAMPLING_KEYS if k in r}
        if "logit_bias" in out:  # JSON keys are strings; SamplingParams wants token ids
            out["logit_bias"] = {int(t): v for t, v in out["logit_bias"].items()}
        return out

    params = [SamplingParams(max_tokens=r["max_tokens"], **{"temperature": 0.0, **fields(r)})
              for r in requests]
    errors: list[str | None] = [None] * len(requests)
    if any(r.get("may_fail") for r in requests):
        results = _generate_each(llm, prompts, params, errors)
    else:
        results = llm.generate(prompts, params, use_tqdm=False)
    completions = [None if r is None else r.outputs[0] for r in results]
    spec = [getattr(c, "spec_decode_metrics", None) for c in completions]
    out = {
        "outputs": [None if c is None else list(c.token_ids) for c in completions],
        "finish_reasons": [None if c is None else c.finish_reason for c in completions],
        "spec_steps": [None if s is None else list(s.per_step_accepted) for s in spec],
        # per generated token: the sampled token's logprob (requests with "logprobs")
        "logprobs": [None if c is None or c.logprobs is None else
                     [lp[t].logprob for lp, t in zip(c.logprobs, c.token_ids)]
                     for c in completions],
    }
    if any(r.get("may_fail") for r in requests):
        out["errors"] = errors
    return out


def _generate_each(llm, prompts: list, params: list, errors: list) -> list:
    """Add the requests to the engine one by one (a refused one records its error in
    ``errors`` and is left out), then step the engine until all added ones finish: the
    others still run as one batch."""
    engine = llm.llm_engine
    done: dict[str, object] = {}
    for i, (prompt, param) in enumerate(zip(prompts, params)):
        try:
            engine.add_request(f"each-{i}", prompt, param)
        except Exception as exc:  # noqa: BLE001 - the message is the result
            errors[i] = f"{type(exc).__name__}: {exc}"
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                done[output.request_id] = output
    return [done.get(f"each-{i}") for i in range(len(prompts))]


def _config_error(model: str, speculative_config: dict, engine_args: dict) -> str | None:
    """The error building the engine config raises (``None`` if it builds)."""
    from vllm.engine.arg_utils import EngineArgs

    args = {**{k: v for k, v in DEFAULT_LLM_KWARGS.items() if k != "seed"}, **engine_args}
    try:
        engine_args = EngineArgs(model=model, speculative_config=speculative_config, **args)
        engine_args.create_engine_config()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return None


def main() -> None:
    model, requests_path = sys.argv[1], sys.argv[2]
    job = json.loads(Path(sys.argv[3]).read_text()) if len(sys.argv) > 3 else {}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default is too big for CI
    if not job.get("multiprocessing", False):
        # vLLM's engine core and worker in this process (vLLM's own switch, which its tests
        # use) rather than two spawned processes that each import vLLM and torch again:
        # that import is most of an engine start on a 2-core machine. A job with
        # "multiprocessing": true runs vLLM's default layout, as `vllm serve` does.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import vllm

    import diffspec.plugin.vllm as plugin

    requests = json.loads(Path(requests_path).read_text())
    errors = {name: _config_error(case.get("model", model), case["speculative_config"],
                                  case.get("engine_args", {}))
              for name, case in job.get("config_errors", {}).items()}
    runs, metrics = {}, {}
    default_runs = [] if "config_errors" in job else [{"name": "default"}]
    for run in job.get("runs", default_runs):
        runs[run["name"]], metrics[run["name"]] = _run(
            run.get("model", model), run.get("llm", {}), run.get("batches", {"default": requests}))
    first = next(iter(next(iter(runs.values()), {}).values()), {})
    print(
        RESULT_PREFIX
        + json.dumps(
            {
                "outputs": first.get("outputs"),
                "finish_reasons": first.get("finish_reasons"),
                "runs": runs,
                "metrics": metrics,
                "config_errors": errors,
                "plugin_registered": plugin._registered,
                "vllm_version": vllm.__version__,
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    main()
