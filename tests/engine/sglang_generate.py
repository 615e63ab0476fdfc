"""Run generation in a real SGLang (CPU path) and print the result as JSON.

A script, not a test: it runs under SGLang's own interpreter (see
:mod:`tests.engine.sglang_cpu`), and ``sglang.Engine`` spawns its scheduler and
detokenizer processes, so the engine is created under ``if __name__ == "__main__"``:

    python tests/engine/sglang_generate.py JOB_JSON

JOB_JSON is {"runs": [{"name": str, "model": path, "engine": {Engine kwargs},
"batches": {batch name: [requests]}, "count_forwards": bool, "rewrite_cached_profiles":
{tokens: seconds}}], "config_errors": {name:
{"model": path, "server_args": {...}}}}; a run with "prometheus" also reports diffspec's
Prometheus counters under server_info (prometheus_client's multiprocess mode, as SGLang's
``--enable-metrics`` sets it up). A request is {"input_ids": [...], "max_new_tokens": N} plus
optional sampling fields ("temperature", "top_p", "top_k", "ignore_eos",
"stop_token_ids"); temperature
defaults to 0 (greedy). Each run starts one engine (fp32, CPU kwargs) and generates its
batches one after the other, each batch as one ``generate`` call (continuous batching);
a run with "rewrite_cached_profiles" first replaces the points of every latency profile
in diffspec's cache (``diffspec.profiling.cache_dir()``) with those (a test of where a
server's profile came from); each config_errors entry only builds ``ServerArgs``
(SGLang's argument resolution, which runs the plugin's validation) and records the error
it raises.

Prints one line: RESULT_PREFIX + {"runs": {run: {batch: {"outputs": [[ids]],
"finish_reasons": [...], "meta": [{spec_verify_ct, spec_correct_drafts_histogram,
cached_tokens, ...}]}}}, "server_info": {run: {"avg_spec_accept_length": ...,
"attention_backend": the resolved one}},
"config_errors": {name: message | null}, "sglang_version": str}.

A run with "logits_rows": N sets diffspec's SGLang logits chunk to N rows in the scheduler
and reports, under server_info's "logits_meter", the largest vocabulary-wide tensor its
decode steps allocated and the most tokens a step's forward ran
(:mod:`diffspec.testing.sglang_logits`).

A run with "count_forwards" also reports, per batch, "forwards": the model forwards the
engine ran for it, by forward mode ({"EXTEND": 1, "TARGET_VERIFY": 7}), "tokens": the
tokens those forwards processed (``input_ids``), by forward mode, and under
"EMBED" the passes through the network however they were started (calls of the token
embedding, ``VocabParallelEmbedding.forward``: a worker that runs layers outside
``ModelRunner.forward``, as a separate draft view does, shows up there). They are counted
in SGLang's scheduler process: the run sets ``DIFFSPEC_FORWARD_COUNT_DIR`` before starting
the engine, and the processes it spawns import this script as ``__mp_main__`` (SGLang
starts them with the ``spawn`` method), which wraps both there and writes the counts to a
file of that folder after every call.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path

from diffspec.testing.sglang_forwards import (
    FORWARD_COUNT_ENV,
    forward_counts,
    install_forward_counter,
)
from diffspec.testing.sglang_logits import LOGITS_METER_ENV, install_logits_meter, logits_meter

RESULT_PREFIX = "DIFFSPEC_RESULT "
CPU_ENGINE_KWARGS = {
    "device": "cpu",
    "attention_backend": "torch_native",
    "sampling_backend": "pytorch",
    "disable_cuda_graph": True,
    "mem_fraction_static": 0.3,
    "dtype": "float32",
    "max_total_tokens": 8192,
    "log_level": "warning",
    "random_seed": 0,
}
SAMPLING_KEYS = ("temperature", "top_p", "top_k", "ignore_eos", "stop_token_ids", "stop",
                 "min_p", "repetition_penalty", "frequency_penalty", "presence_penalty",
                 "min_new_tokens", "logit_bias", "regex", "sampling_seed")
META_KEYS = ("spec_verify_ct", "spec_correct_drafts_histogram", "spec_accept_length",
             "spec_num_correct_drafts", "cached_tokens", "completion_tokens")


def _run(run: dict) -> tuple[dict, dict]:
    import sglang

    kwargs = {**CPU_ENGINE_KWARGS, **run.get("engine", {})}
    if run.get("rewrite_cached_profiles") is not None:
        from diffspec.profiling import cache_dir

        for path in (cache_dir() / "latency-profiles").glob("*.json"):
            data = json.loads(path.read_text())
            path.write_text(json.dumps({**data, "points": run["rewrite_cached_profiles"]}))
    folder = tempfile.mkdtemp(prefix="diffspec-forwards-") if run.get("count_forwards") else None
    if folder is not None:
        os.environ[FORWARD_COUNT_ENV] = folder  # inherited by the engine's processes
    metrics = tempfile.mkdtemp(prefix="diffspec-prom-") if run.get("prometheus") else None
    if metrics is not None:  # prometheus_client's multiprocess mode, as --enable-metrics sets
        os.environ["PROMETHEUS_MULTIPROC_DIR"] = metrics
    meter = tempfile.mkdtemp(prefix="diffspec-logits-") if run.get("logits_rows") else None
    if meter is not None:
        os.environ[LOGITS_METER_ENV] = f"{meter}:{run['logits_rows']}"
    try:
        engine = sglang.Engine(model_path=run["model"], **kwargs)
    finally:
        os.environ.pop(FORWARD_COUNT_ENV, None)
        os.environ.pop("PROMETHEUS_MULTIPROC_DIR", None)
        os.environ.pop(LOGITS_METER_ENV, None)
    try:
        outputs = {}
        for name, requests in run.get("batches", {}).items():
            before = forward_counts(folder) if folder is not None else None
            outputs[name] = _generate(engine, requests)
            if folder is not None:
                after = forward_counts(folder)
                delta = {mode: count - before.get(mode, 0) for mode, count in after.items()
                         if count != before.get(mode, 0)}
                outputs[name]["forwards"] = {k: v for k, v in delta.items()
                                             if not k.startswith("tokens:")}
                outputs[name]["tokens"] = {k.partition(":")[2]: v for k, v in delta.items()
                                           if k.startswith("tokens:")}
        info = engine.get_server_info()
        state = (info.get("internal_states") or [{}])[0]
        server = {"avg_spec_accept_length": state.get("avg_spec_accept_length"),
                  "attention_backend": info.get("attention_backend")}  # as resolved
        if metrics is not None:
            server["diffspec_metrics"] = _diffspec_metrics(metrics)
        if meter is not None:
            server["logits_meter"] = logits_meter(meter)
    finally:
        engine.shutdown()
    return outputs, server


def _diffspec_metrics(folder: str) -> dict[str, float]:
    """diffspec's Prometheus samples the engine's processes wrote to ``folder``
    (``name{label="v"}``: value), read as SGLang's ``/metrics`` reads them."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.multiprocess import MultiProcessCollector

    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=folder)
    out = {}
    for family in registry.collect():
        for sample in family.samples:
            if sample.name.startswith("diffspec:"):
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                out[sample.name + (f"{{{labels}}}" if labels else "")] = sample.value
    return out


def _generate(engine, requests: list[dict]) -> dict:
    params = [{"max_new_tokens": r["max_new_tokens"], "temperature": 0.0,
               **{k: r[k] for k in SAMPLING_KEYS if k in r}} for r in requests]
    if any("return_logprob" in r or r.get("may_fail") for r in requests):
        return _generate_each(engine, requests, params)
    results = engine.generate(input_ids=[r["input_ids"] for r in requests],
                              sampling_params=params)
    return {
        "outputs": [list(r["output_ids"]) for r in results],
        "finish_reasons": [r["meta_info"]["finish_reason"]["type"] for r in results],
        "meta": [{k: r["meta_info"].get(k) for k in META_KEYS} for r in results],
    }


def _generate_each(engine, requests: list[dict], params: list[dict]) -> dict:
    """The requests sent together but one ``async_generate`` each, so one that is refused
    (SGLang raises its abort message for it) does not take the others' results with it:
    "errors" holds each request's message or null, its output is then null."""
    import asyncio

    async def one(request: dict, param: dict):
        return await engine.async_generate(
            input_ids=request["input_ids"], sampling_params=param,
            return_logprob=request.get("return_logprob", False))

    async def all_():
        return await asyncio.gather(*(one(r, p) for r, p in zip(requests, params)),
                                    return_exceptions=True)

    results = engine.loop.run_until_complete(all_())
    ok = [None if isinstance(r, BaseException) else r for r in results]
    return {
        "outputs": [None if r is None else list(r["output_ids"]) for r in ok],
        "finish_reasons": [None if r is None else r["meta_info"]["finish_reason"]["type"]
                           for r in ok],
        "meta": [None if r is None else {k: r["meta_info"].get(k) for k in META_KEYS}
                 for r in ok],
        "errors": [f"{type(r).__name__}: {r}" if isinstance(r, BaseException) else None
                   for r in results],
    }


def _config_error(case: dict) -> str | None:
    from sglang.srt.plugins import load_plugins
    from sglang.srt.server_args import ServerArgs

    load_plugins()
    kwargs = {**CPU_ENGINE_KWARGS, **case.get("server_args", {})}
    kwargs.pop("log_level", None)
    try:
        ServerArgs(model_path=case["model"], **kwargs).resolve_once()
    except Exception as exc:  # noqa: BLE001 - the message is the result
        return f"{type(exc).__name__}: {exc}"
    return None


# What SGLang's scheduler and detokenizer processes import: loaded once per job by the
# fork server (see _start_from_a_fork_server), not once per process.
FORK_SERVER_PRELOAD = ["torch", "sglang.srt.managers.scheduler",
                       "sglang.srt.managers.detokenizer_manager",
                       "sglang.srt.models.registry"]


def _start_from_a_fork_server() -> None:
    """Start SGLang's processes with multiprocessing's ``forkserver`` method where SGLang
    asks for ``spawn``: a clean single-threaded server process imports SGLang once per job
    and forks each scheduler / detokenizer from it, instead of every spawned process
    importing SGLang and torch again (about 20 s of CPU each, most of an engine start on a
    2-core machine; a job starts up to 16 engines). Like spawn, the children are fresh
    processes (no thread or lock of this one) that unpickle their arguments and import this
    script as ``__mp_main__``; unlike spawn they would inherit the fork server's
    environment, so each process carries this process's environment at its start and
    applies it first (:func:`_apply_parent_environment`): the per-run probe settings below
    and whatever SGLang sets before it starts them."""
    import multiprocessing
    from multiprocessing import process

    set_start_method = multiprocessing.set_start_method

    def forkserver_for_spawn(method: str, force: bool = False) -> None:
        set_start_method("forkserver" if method == "spawn" else method, force=force)

    multiprocessing.set_start_method = forkserver_for_spawn
    multiprocessing.set_forkserver_preload(FORK_SERVER_PRELOAD)
    start = process.BaseProcess.start

    def start_with_environment(self) -> None:
        self._diffspec_environ = dict(os.environ)
        start(self)

    process.BaseProcess.start = start_with_environment


def _apply_parent_environment() -> None:
    """In a process SGLang started: before it runs, replace the environment with the one its
    parent had when it started it, then install the probes that environment asks for."""
    from multiprocessing import process

    bootstrap = process.BaseProcess._bootstrap

    def bootstrap_in_parent_environment(self, *args, **kwargs):
        environ = getattr(self, "_diffspec_environ", None)
        if environ is not None:
            for name in set(os.environ) - set(environ):
                del os.environ[name]
            os.environ.update(environ)
        if os.environ.get(FORWARD_COUNT_ENV):
            install_forward_counter(os.environ[FORWARD_COUNT_ENV])
        if os.environ.get(LOGITS_METER_ENV):
            install_logits_meter(os.environ[LOGITS_METER_ENV])
        return bootstrap(self, *args, **kwargs)

    process.BaseProcess._bootstrap = bootstrap_in_parent_environment


def main() -> None:
    job = json.loads(Path(sys.argv[1]).read_text())
    if os.environ.get("DIFFSPEC_SGLANG_SPAWN") != "1":  # 1: SGLang's own spawn, to compare
        _start_from_a_fork_server()
    import sglang

    errors = {name: _config_error(case) for name, case in job.get("config_errors", {}).items()}
    runs, server = {}, {}
    for run in job.get("runs", []):
        runs[run["name"]], server[run["name"]] = _run(run)
    print(RESULT_PREFIX + json.dumps({"runs": runs, "server_info": server,
                                      "config_errors": errors,
                                      "sglang_version": sglang.__version__}), flush=True)


if __name__ == "__main__":
    main()
elif __name__ == "__mp_main__":
    _apply_parent_environment()
