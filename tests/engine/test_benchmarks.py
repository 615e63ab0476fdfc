"""Engine tier: the benchmark driver (``benchmarks/driver.py``) end to end.

One short driver run on the tiny trained Orthrus (synth-orthrus), a few prompts of the
tiny SPEED-Bench-schema file, through the reference adapter and the vLLM offline adapter:
the report's structure (keys, per-category rows) and its lossless column (greedy method
output == the same engine's AR output: 1.0), never speed. Plus the OpenAI-server adapter
against a fake streaming server on loopback, a profiler smoke run, and
``recommend_block_size`` on inputs whose answer is known.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from diffspec.assets import SYNTH_ORTHRUS_DIR
from tests.engine.conftest import require_engine

HERE = Path(__file__).resolve().parent
SPEED_BENCH_TINY = HERE / "data" / "speed_bench_tiny.jsonl"
ENTRY_KEYS = {"engine", "baseline", "launch", "overall", "per_category", "system_tokens_per_s",
              "acceptance_per_position", "forwards_per_step", "notes", "outputs"}
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
ROW_KEYS = {"num_prompts", "tokens", "acceptance_length", "tpf", "per_user_tokens_per_s",
            "ttft_s", "tpot_s", "drafts", "draft_tokens", "accepted", "lossless"}


# ------------------------------------------------------------------------------ datasets


def test_speed_bench_prompts_spread_over_categories() -> None:
    from benchmarks.datasets import SPEED_BENCH_FIELDS, load_prompts

    rows = [json.loads(line) for line in SPEED_BENCH_TINY.read_text().splitlines()]
    assert all(set(r) == set(SPEED_BENCH_FIELDS) for r in rows)
    prompts = load_prompts("speed-bench", SPEED_BENCH_TINY, 4)
    assert [p.category for p in prompts] == ["coding", "math", "writing", "roleplay"]
    assert prompts[0].text == rows[0]["turns"][0]
    assert [p.category for p in load_prompts("speed-bench", SPEED_BENCH_TINY, None, ["math"])] \
        == ["math", "math"]


def test_jsonl_prompts_and_errors(tmp_path: Path) -> None:
    from benchmarks.datasets import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a b"}\n{"prompt": "c", "category": "x"}\n')
    assert [(p.text, p.category) for p in load_prompts("jsonl", path)] == [("a b", "prompts"),
                                                                         ("c", "x")]
    with pytest.raises(ValueError, match="required"):
        load_prompts("jsonl", None)
    with pytest.raises(ValueError, match="not SPEED-Bench rows"):
        load_prompts("speed-bench", path)


@pytest.mark.parametrize("dataset", ["gsm8k", "humaneval"])
def test_shared_data_default_paths(dataset: str) -> None:
    from benchmarks.datasets import DEFAULT_PATHS, load_prompts

    if not DEFAULT_PATHS[dataset].is_file():
        pytest.skip(f"{DEFAULT_PATHS[dataset]} is not there")
    prompts = load_prompts(dataset, None, 3)
    assert len(prompts) == 3 and all(p.text and p.category == dataset for p in prompts)


# ------------------------------------------------------------------------------ driver


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_engine("vllm")
    from benchmarks import driver

    out = tmp_path_factory.mktemp("bench")
    result = driver.main(["--model", str(SYNTH_ORTHRUS_DIR), "--dataset", "speed-bench",
                          "--data-path", str(SPEED_BENCH_TINY), "--num-prompts", "4",
                          "--max-tokens", "24", "--engines", "reference,vllm",
                          "--baselines", "ar,orthrus", "--concurrency", "1,2",
                          "--out", str(out)])
    result["_out"] = out
    return result


@pytest.mark.slow
def test_report_structure(report: dict) -> None:
    assert {"meta", "prompts", "results"} <= set(report)
    assert {"command", "date", "machine", "model", "dataset"} <= set(report["meta"])
    runs = {(e["engine"], e["baseline"]) for e in report["results"]}
    assert runs == {("reference", "ar"), ("reference", "orthrus"), ("vllm", "ar"),
                    ("vllm", "orthrus")}
    for entry in report["results"]:
        assert set(entry) >= ENTRY_KEYS
        assert set(entry["overall"]) == ROW_KEYS
        assert list(entry["per_category"]) == ["coding", "math", "writing", "roleplay"]
        assert all(set(row) == ROW_KEYS for row in entry["per_category"].values())
        assert entry["overall"]["num_prompts"] == 4
    vllm_orthrus = next(e for e in report["results"] if e["engine"] == "vllm"
                        and e["baseline"] == "orthrus")
    assert vllm_orthrus["launch"]["vllm.LLM"]["speculative_config"] == {
        "method": "orthrus", "num_speculative_tokens": 31}
    assert set(vllm_orthrus["system_tokens_per_s"]) == {"1", "2"}
    assert vllm_orthrus["overall"]["acceptance_length"] > 1  # from vLLM's own counters
    assert vllm_orthrus["forwards_per_step"] == 2
    md = (report["_out"] / "report.md").read_text()
    assert "| vllm | orthrus |" in md and "lossless" in md
    assert json.loads((report["_out"] / "report.json").read_text())["meta"] == report["meta"]


@pytest.mark.slow
def test_lossless_column_is_one_for_greedy(report: dict) -> None:
    for entry in report["results"]:
        assert entry["overall"]["lossless"] == 1.0, (entry["engine"], entry["baseline"])
        assert all(row["lossless"] == 1.0 for row in entry["per_category"].values())
    by = {(e["engine"], e["baseline"]): e["outputs"] for e in report["results"]}
    assert by[("vllm", "ar")] == by[("reference", "ar")]  # one oracle across engines


# ------------------------------------------------------------------------------ openai adapter


class _FakeServer(BaseHTTPRequestHandler):
    """Streams token ids 10, 11, ... of the requested length and serves spec counters that
    grow by one verify step with 2 accepted drafts per completion."""

    requests_served = 0

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        n = type(self).requests_served
        body = (f"# HELP x\nvllm:spec_decode_num_drafts_total{{engine=\"0\"}} {n}\n"
                f"vllm:spec_decode_num_draft_tokens_total{{engine=\"0\"}} {3 * n}\n"
                f"vllm:spec_decode_num_accepted_tokens_total{{engine=\"0\"}} {2 * n}\n"
                + "".join(f"{PER_POS}{{engine=\"0\",position=\"{p}\"}} {n}\n" for p in (0, 1)))
        self.send_response(200)
        self.end_headers()
        self.wfile.write(body.encode())

    def do_POST(self) -> None:
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for i in range(req["max_tokens"]):
            chunk = {"choices": [{"text": "x", "token_ids": [10 + i]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        usage = {"choices": [], "usage": {"completion_tokens": req["max_tokens"]}}
        self.wfile.write(f"data: {json.dumps(usage)}\n\ndata: [DONE]\n\n".encode())
        type(self).requests_served += 1


def test_openai_adapter_against_a_fake_server() -> None:
    from benchmarks.adapters import openai_server
    from benchmarks.metrics import summarize

    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = openai_server.run("orthrus", url, "m", [[1, 2], [3]], 5, [1, 2])
    finally:
        server.shutdown()
        server.server_close()
    assert [c.token_ids for c in result.completions] == [[10, 11, 12, 13, 14]] * 2
    assert all(c.ttft_s is not None and c.ttft_s <= c.latency_s for c in result.completions)
    assert set(result.system_tokens_per_s) == {1, 2}
    entry = summarize(result, ["a", "b"], result)
    assert entry["overall"]["acceptance_length"] == 3.0  # 1 + 2 accepted per verify step
    assert entry["acceptance_per_position"] == [1.0, 1.0]
    assert entry["overall"]["lossless"] == 1.0 and entry["overall"]["tpot_s"] is not None
    with pytest.raises(ValueError, match="loopback"):
        openai_server.check_loopback("http://10.0.0.1:8000")


# ------------------------------------------------------------------------------ profiler


def test_profiler_smoke(tmp_path: Path) -> None:
    from benchmarks import profile_forward

    result = profile_forward.main(["--shape", "tiny", "--query-lens", "1,4",
                                   "--contexts", "32,64", "--repeats", "1",
                                   "--out", str(tmp_path)])
    assert set(result["latency_s"]) == {"32", "64"}
    assert all(set(row) == {"1", "4"} and all(t > 0 for t in row.values())
               for row in result["latency_s"].values())
    saved = json.loads((tmp_path / "forward_latency.json").read_text())
    assert saved["latency_s"] == result["latency_s"] and saved["model"]["layers"] == 2
    table = profile_forward.format_table({32: {1: 0.001, 4: 0.002}})
    assert table.splitlines()[0].endswith("| 1 | 4 |") and "| 32 | 1.00 | 2.00 |" in table


@pytest.mark.parametrize(
    ("acceptance", "latency", "forwards", "expected"),
    [
        # flat latency (memory bound): the widest block wins when drafts keep being accepted
        ([1.0] * 63, {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}, 1, 8),
        # no draft is ever accepted: plain AR (block 1)
        ([0.0] * 63, {1: 1.0, 2: 1.0, 4: 1.0, 8: 1.0}, 1, 1),
        # latency doubles with every doubling (compute bound): 4 -> 1+1+1+1=4 tokens / 2.0
        # beats 8 -> 4.5 tokens / 4.0 and 2 -> 2 tokens / 1.2
        ([1.0, 1.0, 1.0, 0.5, 0, 0, 0], {1: 1.0, 2: 1.2, 4: 2.0, 8: 4.0}, 1, 4),
        # two forwards per step (self-spec): 2 tokens / (2 x 1.0) = 1 = AR; block 4 gives
        # 1 + 0.9 + 0.8 + 0.7 = 3.4 tokens / (2 x 1.1) = 1.55
        ([0.9, 0.8, 0.7], {1: 1.0, 4: 1.1}, 2, 4),
        ([0.2, 0.0, 0.0], {1: 1.0, 4: 1.1}, 2, 1),
    ],
    ids=["flat_latency", "nothing_accepted", "compute_bound", "self_spec", "self_spec_poor"],
)
def test_recommend_block_size(acceptance, latency, forwards, expected) -> None:
    from benchmarks.profile_forward import recommend_block_size

    assert recommend_block_size(acceptance, latency, forwards) == expected
