"""The benchmark tooling without an engine: prompt datasets, baseline specs, the tiny
drafters' checkpoint layouts, the server adapter against a stand-in streaming server on
loopback (vLLM's /v1/completions + /metrics, SGLang's /generate + /server_info), the
forward-latency profiler on the tiny shape, its extrapolation from fewer layers, and
``recommend_block_size`` on inputs whose answer is known. (The driver end to end through
real engines is in tests/engine/test_benchmarks.py.)"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from diffspec.assets import SYNTH_ORTHRUS_DIR

SPEED_BENCH_TINY = (Path(__file__).resolve().parents[1] / "engine" / "data"
                    / "speed_bench_tiny.jsonl")  # shared with the engine-tier driver run
PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


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


def test_speed_bench_prepared_folder(tmp_path: Path) -> None:
    """The copy NeMo-Skills' prepare script writes: {subset}.jsonl with ``messages`` rows."""
    from benchmarks.datasets import load_prompts

    rows = [{"question_id": i, "category": c, "messages": [{"role": "user", "content": t}]}
            for i, (c, t) in enumerate([("qa", "q0"), ("rag", "r1"), ("qa", "q2")])]
    (tmp_path / "qualitative.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "throughput_1k.jsonl").write_text(json.dumps(
        {"question_id": 7, "messages": [{"role": "user", "content": "long"}]}) + "\n")
    assert [(p.text, p.category) for p in load_prompts("speed-bench", tmp_path, 2)] == [
        ("q0", "qa"), ("r1", "rag")]
    [row] = load_prompts("speed-bench", tmp_path, None, subset="throughput_1k")
    assert (row.text, row.category, row.id) == ("long", "throughput_1k", "7")
    with pytest.raises(ValueError, match="unknown SPEED-Bench subset"):
        load_prompts("speed-bench", tmp_path, None, subset="throughput_3k")


@pytest.mark.parametrize("dataset", ["gsm8k", "humaneval"])
def test_shared_data_default_paths(dataset: str) -> None:
    from benchmarks.datasets import DEFAULT_PATHS, load_prompts

    if not DEFAULT_PATHS[dataset].is_file():
        pytest.skip(f"{DEFAULT_PATHS[dataset]} is not there")
    prompts = load_prompts(dataset, None, 3)
    assert len(prompts) == 3 and all(p.text and p.category == dataset for p in prompts)


# ------------------------------------------------------------------------------ baselines


def test_baseline_specs() -> None:
    from benchmarks.baselines import parse

    specs = parse(["ngram:4", "eagle3:3", "orthrus"], 31, {"eagle3": "/d"})
    assert [(b.label, b.method, b.num_draft_tokens, b.drafter) for b in specs] == [
        ("ar", "ar", 0, None), ("ngram:4", "ngram", 4, None), ("eagle3:3", "eagle3", 3, "/d"),
        ("orthrus", "orthrus", 31, None)]
    assert [b.forwards_per_step for b in specs] == [1, 1, 1, 2]
    with pytest.raises(ValueError, match="needs --dflash-drafter"):
        parse(["dflash"], 15)
    with pytest.raises(ValueError, match="unknown baseline"):
        parse(["medusa"], 3)


def test_self_speculative_baselines_draft_a_fixed_k_in_both_engines() -> None:
    """A baseline named ``orthrus:3`` drafts 3 every step: the engines' default (adaptive
    drafting) is switched off explicitly; AR and EAGLE-3 get no diffspec options."""
    from benchmarks.adapters import sglang_offline, vllm_offline
    from benchmarks.baselines import parse

    ar, eagle3, orthrus, tidar = parse(["eagle3:3", "orthrus:3", "tidar:8"], 31, {"eagle3": "/d"})
    for b in (orthrus, tidar):
        sglang = sglang_offline.engine_kwargs(b, 512)
        assert json.loads(sglang["json_model_override_args"]) == {"diffspec": {"adaptive": False}}
        assert vllm_offline.llm_kwargs(b, 512)["speculative_config"]["adaptive"] is False
    assert sglang_offline.engine_kwargs(orthrus, 512)["speculative_num_draft_tokens"] == 4
    for b in (ar, eagle3):
        assert "json_model_override_args" not in sglang_offline.engine_kwargs(b, 512)


def test_tiny_drafters_have_the_published_layouts(tmp_path: Path) -> None:
    from safetensors import safe_open

    from benchmarks.tiny_drafters import build_dflash, build_eagle3, is_untrained

    eagle3 = build_eagle3(SYNTH_ORTHRUS_DIR, tmp_path / "eagle3")
    config = json.loads((eagle3 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["num_hidden_layers"] == 1 and is_untrained(eagle3)
    with safe_open(str(eagle3 / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        assert f.get_slice("fc.weight").get_shape() == [128, 3 * 128]
        assert f.get_slice("midlayer.self_attn.q_proj.weight").get_shape() == [128, 2 * 128]
    assert {"midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight"} <= names
    dflash = build_dflash(SYNTH_ORTHRUS_DIR, tmp_path / "dflash")
    config = json.loads((dflash / "config.json").read_text())
    assert config["architectures"] == ["DFlashDraftModel"]
    assert config["dflash_config"]["mask_token_id"] == 3  # synth-orthrus's mask token
    assert not is_untrained(SYNTH_ORTHRUS_DIR)


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 100 and height > 100, (path, width, height)


# ------------------------------------------------------------------------------ server adapter


class _FakeServer(BaseHTTPRequestHandler):
    """Streams token ids 10, 11, ... of the requested length and serves spec counters that
    grow by one verify step with 2 accepted drafts per completion."""

    requests_served = 0

    def log_message(self, *args) -> None:  # quiet
        pass

    def do_GET(self) -> None:
        n = type(self).requests_served
        if self.path == "/server_info":
            self.send_response(200)
            self.end_headers()
            self.wfile.write(json.dumps(
                {"internal_states": [{"avg_spec_accept_length": 3.0}]}).encode())
            return
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
        if self.path == "/generate":  # SGLang's native API: cumulative ids, meta_info
            n = req["sampling_params"]["max_new_tokens"]
            for i in range(1, n + 1):
                meta = {"completion_tokens": i, "spec_verify_ct": 1,
                        "spec_num_correct_drafts": 2}
                chunk = {"output_ids": list(range(10, 10 + i)), "meta_info": meta}
                self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
            self.wfile.write(b"data: [DONE]\n\n")
            return
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


def test_server_adapter_sglang_api_against_a_fake_server() -> None:
    from benchmarks.adapters import openai_server
    from benchmarks.metrics import summarize

    server = ThreadingHTTPServer(("127.0.0.1", 0), _FakeServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        result = openai_server.run("orthrus", url, "m", [[1, 2], [3]], 4, [1, 2],
                                   server="sglang")
    finally:
        server.shutdown()
        server.server_close()
    assert [c.token_ids for c in result.completions] == [[10, 11, 12, 13]] * 2
    entry = summarize(result, ["a", "b"], result)
    assert entry["overall"]["acceptance_length"] == 3.0  # 1 + 2 correct drafts / 1 step
    assert set(entry["system_tokens_per_s"]) == {"1", "2"}
    assert any("avg_spec_accept_length" in n and "3.0" in n for n in entry["notes"])


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


def test_profiler_layers_and_extrapolation(tmp_path: Path) -> None:
    from benchmarks import profile_forward

    result = profile_forward.main(["--shape", "tiny", "--layers", "1,2", "--query-lens", "1,2",
                                   "--contexts", "32", "--repeats", "1", "--out", str(tmp_path)])
    assert set(result["measured_s"]) == {"1", "2"} and result["full_layers"] == 2
    assert result["extrapolated"] and set(result["free_query_len"]) == {"32"}
    _assert_png(tmp_path / "forward_latency.png")
    # fixed 1.0 + 0.5 per layer, measured at 1 and 2 layers -> 36 layers: 19.0
    tables = {n: {256: {1: 1.0 + 0.5 * n, 4: 2.0 + 0.5 * n}} for n in (1, 2)}
    assert profile_forward.extrapolate(tables, 36) == {256: {1: 19.0, 4: 20.0}}
    assert profile_forward.free_query_len({1: 1.0, 4: 1.05, 16: 1.5}) == 4
    noisy = {1: {256: {1: 2.0, 4: 2.0}}, 2: {256: {1: 1.5, 4: 2.5}}}
    assert profile_forward.inconsistent_cells(noisy) == ["256/1"]
    assert profile_forward.inconsistent_cells(tables) == []


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
