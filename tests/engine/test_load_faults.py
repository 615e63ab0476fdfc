"""Engine tier: load and faults against running servers (``benchmarks/load_faults.py``, small).

Per engine, one server pair on loopback (plain AR and Orthrus, K = 31, on the bundled tiny
trained Orthrus, fp32, a KV pool small enough that running requests are preempted /
retracted), shared by the module: 80 greedy streaming requests of mixed lengths at
concurrency 16, the same schedule at both servers, of which 8 streams are closed by the
client mid-way, 4 prompts are over the 512-token context and 4 fit but ask for more tokens
than the context leaves. SGLang also asserts its pool invariant on every busy scheduler
pass (``SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_BUSY=1``). The checks (one test each):

* both servers stay up and serve a request after the load as before it;
* every request completed on both servers has the AR server's token ids and finish reason
  on the Orthrus server; aborted streams agree on the tokens both received (and where the
  Orthrus server finished before the client's cut, its output extends the AR tokens);
* every normal request is served; every over-context prompt gets a 4xx and no tokens on
  both; an edge request gets the same outcome from both (vLLM: generated up to the
  context's end; SGLang: refused);
* once idle, each server's KV pool has as many free slots as at start (vLLM: free blocks
  from /metrics after a probe request, and the development endpoint /reset_prefix_cache
  succeeds, which it does only when every block is free; SGLang: /v1/loads used tokens
  back to 0, and SGLang's own strict idle leak check, which raises in the scheduler, never
  fired), and no leak / engine-death line in either log.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from diffspec.assets import SYNTH_ORTHRUS_DIR
from tests.engine.conftest import require_engine, require_sglang

pytestmark = [pytest.mark.engine, pytest.mark.slow]

SMALL = ["--model", str(SYNTH_ORTHRUS_DIR), "--requests", "80", "--concurrency", "16",
         "--max-tokens", "64", "--abort-fraction", "0.1", "--over-context-fraction", "0.05",
         "--edge-fraction", "0.05", "--prompts", "auto", "--seed", "0",
         "--request-timeout", "120", "--deadline", "300", "--ready-timeout", "300",
         "--idle-timeout", "60"]
# Small KV pools, so the load also preempts (vLLM) / retracts (SGLang) running requests:
# 24 blocks of 32 tokens (one is vLLM's null block), 1024 SGLang token slots.
VLLM_BLOCKS, SGLANG_TOKENS = 24, 1024
CHECKS = ("servers_up", "equal_to_ar", "normal_served", "over_context_rejected",
          "edge_consistent", "kv_restored", "no_leak_log")


def _run(argv: list[str], out: Path) -> dict[str, Any]:
    from benchmarks.load_faults import parser, run_load, table

    report = run_load(parser().parse_args([*argv, "--out", str(out)]))
    print(table(report))
    return report


@pytest.fixture(scope="module", params=["vllm", "sglang"])
def report(request: pytest.FixtureRequest,
           tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    engine = request.param
    out = tmp_path_factory.mktemp(f"load-faults-{engine}")
    if engine == "vllm":
        require_engine("vllm")
        return _run(["--engine", "vllm", *SMALL, "--vllm-arg=--enforce-eager",
                     f"--vllm-arg=--num-gpu-blocks-override={VLLM_BLOCKS}"], out)
    python = require_sglang()
    return _run(["--engine", "sglang", "--sglang-cpu-harness", "--sglang-python", python,
                 "--sglang-max-total-tokens", str(SGLANG_TOKENS), "--sglang-busy-check",
                 *SMALL], out)


def test_schedule(report: dict[str, Any]) -> None:
    """The load is what it says: 80 requests in these kinds, the aborts really closed
    streams mid-way (on both servers alike), the Orthrus server really speculated (and
    accepted drafts), the AR server did not."""
    assert report["kinds"] == {"normal": 64, "abort": 8, "over_context": 4, "edge": 4}
    rows = report["requests_detail"]
    aborts = [r for r in rows if r["kind"] == "abort"]
    # AR streams token by token: only an early EOS ends a request before its cut; the
    # speculative server may send a whole answer in one chunk before the client can cut
    assert sum(r["ar"]["aborted"] for r in aborts) >= 6
    assert sum(r["spec"]["aborted"] for r in aborts) >= 1
    assert (report["compare"]["aborted_on_both"] + report["compare"]["aborted_on_one"]
            == sum(r["ar"]["aborted"] or r["spec"]["aborted"] for r in aborts))
    assert report["compare"]["completed_on_both"] >= 64
    assert report["servers"]["ar"]["acceptance_length"] is None
    assert report["servers"]["spec"]["acceptance_length"] > 1.5
    if report["engine"] == "vllm":  # the small pool made vLLM preempt on both servers
        assert all(s["kv_idle"]["preemptions"] > 0 for s in report["servers"].values())


@pytest.mark.parametrize("check", CHECKS)
def test_check(report: dict[str, Any], check: str) -> None:
    detail = {k: report["compare"][k] for k in ("mismatches", "normal_not_served",
                                                "over_context_not_rejected",
                                                "edge_inconsistent", "rechecks")}
    servers = {n: {k: s[k] for k in ("alive", "post_load_request_equal", "kv_start", "kv_idle",
                                     "leak_log_lines", "log")}
               for n, s in report["servers"].items()}
    assert report["checks"][check], (check, detail, servers)


def test_kv_pool_is_whole_at_start(report: dict[str, Any]) -> None:
    """The start reading is of an idle, whole pool (so equal after the load means no leak,
    not an equal offset)."""
    for server in report["servers"].values():
        start = server["kv_start"]
        if report["engine"] == "vllm":
            assert start["usage"] == 0.0 and start["reset_prefix_cache"] is True, start
            assert start["free_blocks"] == start["usable_blocks"] > 0, start
        else:
            assert start["used_tokens"] == 0 and start["free_tokens"] == start["total_tokens"]
