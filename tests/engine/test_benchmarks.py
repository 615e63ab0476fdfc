"""Engine tier: the benchmark driver (``benchmarks/driver.py``) end to end.

One short driver run on the tiny trained Orthrus (synth-orthrus), a few prompts of the
tiny SPEED-Bench-schema file, through the reference adapter and the vLLM offline adapter,
with vLLM's EAGLE-3 on an untrained tiny drafter in EAGLE-3's published layout: the
report's structure (keys, per-category rows, exact launch configurations), its lossless
column (greedy method output == the same engine's AR output: 1.0) and its PNG plots, never
speed. Plus the same through SGLang's CPU harness (skipped without an SGLang interpreter,
failed where CI requires SGLang). (The engine-free parts of the benchmark tooling are
tested in tests/unit/test_benchmarks.py.)
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from diffspec.assets import SYNTH_ORTHRUS_DIR
from tests.engine.conftest import require_engine, require_sglang

HERE = Path(__file__).resolve().parent
SPEED_BENCH_TINY = HERE / "data" / "speed_bench_tiny.jsonl"
ENTRY_KEYS = {"engine", "baseline", "launch", "overall", "per_category", "system_tokens_per_s",
              "acceptance_per_position", "forwards_per_step", "notes", "outputs"}
ROW_KEYS = {"num_prompts", "tokens", "acceptance_length", "tpf", "per_user_tokens_per_s",
            "ttft_s", "tpot_s", "drafts", "draft_tokens", "accepted", "lossless"}


# ------------------------------------------------------------------------------ driver


def _assert_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR", path
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert width > 100 and height > 100, (path, width, height)


@pytest.fixture(scope="module")
def report(tmp_path_factory: pytest.TempPathFactory) -> dict:
    require_engine("vllm")
    from benchmarks import driver
    from benchmarks.tiny_drafters import build_eagle3

    out = tmp_path_factory.mktemp("bench")
    drafter = build_eagle3(SYNTH_ORTHRUS_DIR, out / "eagle3-drafter")
    result = driver.main(["--model", str(SYNTH_ORTHRUS_DIR), "--dataset", "speed-bench",
                          "--data-path", str(SPEED_BENCH_TINY), "--num-prompts", "4",
                          "--max-tokens", "24", "--engines", "reference,vllm",
                          "--baselines", "ar,orthrus,eagle3:2", "--eagle3-drafter",
                          str(drafter), "--concurrency", "1,2", "--out", str(out)])
    result["_out"] = out
    return result


@pytest.mark.slow
def test_report_structure(report: dict) -> None:
    assert {"meta", "prompts", "results", "plots"} <= set(report)
    assert {"command", "date", "machine", "model", "dataset", "baselines"} <= set(report["meta"])
    runs = {(e["engine"], e["baseline"]) for e in report["results"]}
    assert runs == {("reference", "ar"), ("reference", "orthrus"), ("vllm", "ar"),
                    ("vllm", "orthrus"), ("vllm", "eagle3:2")}
    for entry in report["results"]:
        assert entry["error"] is None, entry["error"]
        assert set(entry) >= ENTRY_KEYS
        assert set(entry["overall"]) == ROW_KEYS
        assert list(entry["per_category"]) == ["coding", "math", "writing", "roleplay"]
        assert all(set(row) == ROW_KEYS for row in entry["per_category"].values())
        assert entry["overall"]["num_prompts"] == 4
    vllm_orthrus = next(e for e in report["results"] if e["engine"] == "vllm"
                        and e["baseline"] == "orthrus")
    assert vllm_orthrus["launch"]["vllm.LLM"]["speculative_config"] == {
        "method": "orthrus", "num_speculative_tokens": 31, "adaptive": False}
    assert set(vllm_orthrus["system_tokens_per_s"]) == {"1", "2"}
    # from vLLM's own counters: the trained drafter's long accepted runs (about 10 tokens
    # a step at 24 tokens; an untrained drafter, like the EAGLE-3 one below, about 1)
    assert vllm_orthrus["overall"]["acceptance_length"] > 5
    assert vllm_orthrus["forwards_per_step"] == 2
    eagle3 = next(e for e in report["results"] if e["baseline"] == "eagle3:2")
    assert eagle3["launch"]["vllm.LLM"]["speculative_config"]["method"] == "eagle3"
    assert eagle3["launch"]["vllm serve"].startswith("vllm serve ")
    assert eagle3["untrained_drafter"] and eagle3["overall"]["drafts"] > 0  # it drafted
    assert eagle3["overall"]["acceptance_length"] < 2  # untrained: the bound above is real
    md = (report["_out"] / "report.md").read_text()
    assert "| vllm | orthrus |" in md and "lossless" in md
    assert "eagle3:2 (untrained drafter)" in md and "--speculative-config" in md
    assert json.loads((report["_out"] / "report.json").read_text())["meta"] == report["meta"]


@pytest.mark.slow
def test_report_plots_are_pngs(report: dict) -> None:
    assert report["plots"] == ["tokens_per_s.png", "acceptance_by_category.png"]
    for name in report["plots"]:
        _assert_png(report["_out"] / name)


@pytest.mark.slow
def test_lossless_column_is_one_for_greedy(report: dict) -> None:
    for entry in report["results"]:
        assert entry["overall"]["lossless"] == 1.0, (entry["engine"], entry["baseline"])
        assert all(row["lossless"] == 1.0 for row in entry["per_category"].values())
    by = {(e["engine"], e["baseline"]): e["outputs"] for e in report["results"]}
    assert by[("vllm", "ar")] == by[("reference", "ar")]  # one oracle across engines


@pytest.mark.slow
def test_driver_on_sglang_cpu(tmp_path: Path) -> None:
    """AR and Orthrus through SGLang's CPU path (the test harness): structure + lossless."""
    require_sglang()
    from benchmarks import driver

    report = driver.main(["--model", str(SYNTH_ORTHRUS_DIR), "--dataset", "speed-bench",
                          "--data-path", str(SPEED_BENCH_TINY), "--num-prompts", "2",
                          "--max-tokens", "16", "--engines", "sglang", "--sglang-cpu-harness",
                          "--baselines", "ar,orthrus", "--concurrency", "1",
                          "--out", str(tmp_path)])
    by = {e["baseline"]: e for e in report["results"]}
    assert set(by) == {"ar", "orthrus"} and all(e["engine"] == "sglang" for e in by.values())
    assert by["orthrus"]["error"] is None, by["orthrus"]["error"]
    assert by["orthrus"]["launch"]["sglang.Engine"]["speculative_algorithm"] == "ORTHRUS"
    assert by["orthrus"]["overall"]["lossless"] == 1.0
    # from SGLang's own counters: long accepted runs (an untrained drafter: about 1)
    assert by["orthrus"]["overall"]["acceptance_length"] > 3
    assert by["orthrus"]["overall"]["ttft_s"] is not None
    assert (tmp_path / "report.md").is_file() and (tmp_path / "tokens_per_s.png").is_file()


@pytest.mark.slow
def test_driver_fast_dllm_on_sglang_cpu(tmp_path: Path) -> None:
    """Fast-dLLM on the bundled LLaDA, reference decoder (SGLang's block-causal layout) and
    SGLang's dLLM mode: no AR row (LLaDA has no AR view), SGLang's output compared with the
    reference decoder's (the method is not lossless), forwards counted in SGLang."""
    from diffspec.assets import SYNTH_DLLM_DIR
    require_sglang()
    from benchmarks import driver

    report = driver.main(["--model", str(SYNTH_DLLM_DIR / "llada"), "--dataset", "speed-bench",
                          "--data-path", str(SPEED_BENCH_TINY), "--num-prompts", "2",
                          "--max-tokens", "24", "--engines", "reference,sglang",
                          "--sglang-cpu-harness", "--baselines", "fast_dllm",
                          "--fast-dllm-attention", "block_causal", "--concurrency", "1",
                          "--out", str(tmp_path)])
    by = {(e["engine"], e["baseline"]): e for e in report["results"]}
    assert set(by) == {("reference", "fast_dllm"), ("sglang", "fast_dllm")}
    assert "*/ar (family llada has no AR view)" in report["meta"]["not_run"]
    sglang, ref = by[("sglang", "fast_dllm")], by[("reference", "fast_dllm")]
    assert sglang["error"] is None, sglang["error"]
    assert sglang["launch"]["sglang.Engine"]["dllm_algorithm"] == "FastDLLM"
    assert ref["launch"]["attention"] == "block_causal"
    assert sglang["compared_with"] == "reference/fast_dllm"
    assert sglang["overall"]["lossless"] == 1.0 and sglang["outputs"] == ref["outputs"]
    # counted forwards: parallel unmasking (the trained model commits several per forward)
    assert sglang["overall"]["tpf"] > 1.2 and ref["overall"]["tpf"] > 1.2
