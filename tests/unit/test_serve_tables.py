"""``benchmarks/serve_tables.py`` without an engine: the run order (repeats interleaved),
resume skipping, the estimate, the aggregation (ratio to AR within each round, spread,
acceptance length, drafts per output token), the lossless comparison, the state file's
settings check, the ``default`` baseline's launch configuration, and ``--dry-run``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks import serve_tables as st
from benchmarks.serve_tables import Cell
from diffspec.assets import SYNTH_ORTHRUS_DIR


def test_plan_interleaves_rounds_and_runs_ar_first() -> None:
    groups = st.plan(["gsm8k", "humaneval"], ["server", "offline"], ["ar", "ngram:4"], 2, [1, 4])
    assert [(g.round, g.baseline, g.path) for g in groups] == [
        (0, "ar", "server"), (0, "ar", "offline"), (0, "ngram:4", "server"),
        (0, "ngram:4", "offline"), (1, "ar", "server"), (1, "ar", "offline"),
        (1, "ngram:4", "server"), (1, "ngram:4", "offline")]
    # one engine start serves every table and concurrency
    assert [(c.table, c.concurrency) for c in groups[0].cells] == [
        ("gsm8k", 1), ("gsm8k", 4), ("humaneval", 1), ("humaneval", 4)]
    assert groups[3].cells[1].key == "gsm8k/offline/ngram:4/r0/c4"
    assert [st.prompts_for(c, 8, 2) for c in (1, 2, 4, 8, 32)] == [8, 8, 8, 16, 64]


def test_pending_skips_finished_cells_and_engines() -> None:
    groups = st.plan(["gsm8k"], ["server"], ["ar", "orthrus:3"], 1, [1, 2])
    done = {"gsm8k/server/ar/r0/c1", "gsm8k/server/ar/r0/c2", "gsm8k/server/orthrus:3/r0/c1"}
    todo = st.pending(groups, done)
    assert len(todo) == 1  # AR's engine is not started again
    assert todo[0].baseline == "orthrus:3"
    assert [c.key for c in todo[0].cells] == ["gsm8k/server/orthrus:3/r0/c2"]
    assert st.pending(groups, done | {todo[0].cells[0].key}) == []


def _rec(cell: Cell, tok_s: float, **extra) -> dict:
    return {**cell.__dict__, "num_prompts": 8, "output_tokens": 1000,
            "seconds": 1000 / tok_s, **extra}


def test_aggregate_ratio_within_each_round() -> None:
    """The ratio to AR is the median of the per-round ratios, not a ratio of medians: a
    round where the machine was slower for both baselines leaves the ratio as it is."""
    cells = {}
    for r, (ar, k) in enumerate([(10.0, 15.0), (5.0, 8.0), (20.0, 28.0)]):
        a = Cell("gsm8k", "server", "ar", r, 1)
        b = a.with_(baseline="orthrus:3")
        cells[a.key] = _rec(a, ar, drafts=0, draft_tokens=0, accepted=0,
                            **({"matches": 8, "compared": 8} if r else {}))
        cells[b.key] = _rec(b, k, drafts=400, draft_tokens=1200, accepted=500,
                            matches=8 if r != 1 else 7, compared=8)
    rows = st.aggregate(cells, ["gsm8k"], ["server"], ["ar", "orthrus:3"], 3, [1])["gsm8k"]
    ar, k = rows
    assert ar["x_ar"] == 1.0 and ar["lossless"] == 1.0 and ar["lossless_requests"] == [16, 16]
    assert ar["acceptance_length"] is None and ar["draft_tokens_per_token"] == 0
    assert k["repeats"] == 3
    assert k["tokens_per_s"] == pytest.approx(15.0)
    assert (k["tokens_per_s_min"], k["tokens_per_s_max"]) == (pytest.approx(8), pytest.approx(28))
    assert k["x_ar"] == pytest.approx(1.5)  # ratios 1.5, 1.6, 1.4; medians' ratio = 1.5 too
    assert (k["x_ar_min"], k["x_ar_max"]) == (pytest.approx(1.4), pytest.approx(1.6))
    assert k["acceptance_length"] == pytest.approx(1 + 1500 / 1200)
    assert k["draft_tokens_per_token"] == pytest.approx(3600 / 3000)
    assert k["lossless"] == pytest.approx(23 / 24) and k["lossless_requests"] == [23, 24]
    # median of ratios differs from the ratio of medians when rounds drift
    cells[Cell("gsm8k", "server", "orthrus:3", 2, 1).key]["seconds"] = 1000 / 40.0
    k = st.aggregate(cells, ["gsm8k"], ["server"], ["ar", "orthrus:3"], 3, [1])["gsm8k"][1]
    assert k["x_ar"] == pytest.approx(1.6)  # ratios 1.5, 1.6, 2.0 (medians: 15 / 10 = 1.5)
    # SGLang's server counts no drafts: n/a, not 0.00 (its acceptance comes from /server_info)
    for r in range(3):
        cells[Cell("gsm8k", "server", "orthrus:3", r, 1).key].update(
            drafts=None, draft_tokens=None, accepted=None, server_acceptance_length=2.5)
    k = st.aggregate(cells, ["gsm8k"], ["server"], ["ar", "orthrus:3"], 3, [1])["gsm8k"][1]
    assert k["draft_tokens_per_token"] is None and k["acceptance_length"] == 2.5


def test_aggregate_missing_cells_and_render() -> None:
    a = Cell("humaneval", "offline", "ar", 0, 2)
    cells = {a.key: _rec(a, 50.0)}
    rows = st.aggregate(cells, ["humaneval"], ["offline"], ["ar", "ngram:4"], 2, [2])
    ar, ng = rows["humaneval"]
    assert ar["repeats"] == 1 and ar["lossless"] is None and ng["repeats"] == 0
    assert ng["x_ar"] is None and ng["tokens_per_s"] is None
    meta = {"command": "python -m benchmarks.serve_tables --out X", "started": "s",
            "machine": {"cpu": "cpu", "nproc": 2}, "prompt_sets": {},
            "settings": {"dtype": "float32", "output_len": 128, "min_prompts": 8, "waves": 2,
                         "repeats": 2}}
    text = st.render_table("humaneval", rows["humaneval"], meta,
                           {"offline/ngram:4/r0": "RuntimeError: boom\ntrace"})
    assert "| offline | ar | 1.00 |" in text  # one round: no spread shown
    assert "| offline | ngram:4 | n/a |" in text
    assert "no cell: RuntimeError: boom |" in text and "trace" not in text
    assert "| offline | ar | 2 | 8 | 1 | 50.0 | 50.0-50.0 | 1.00 |" in text
    assert "| ref |" in text  # AR's lossless with one round: nothing to compare


def test_lossless_comparison() -> None:
    assert st.same_outputs([[1, 2], [3]], [[1, 2], [3]]) == (2, 2)
    assert st.same_outputs([[1, 2], [3, 4]], [[1, 2], [3]]) == (1, 2)
    assert st.same_outputs(["a"], ["a", "b"]) == (1, 2)  # a missing output counts as different
    c = Cell("sharegpt", "server", "default", 2, 8)
    assert st.reference_cell(c) == c.with_(baseline="ar")
    assert st.reference_cell(c.with_(baseline="ar")) == c.with_(baseline="ar", round=0)
    assert st.reference_cell(c.with_(baseline="ar", round=0)) is None


def test_estimate_uses_measured_rates_then_the_prior() -> None:
    groups = st.plan(["gsm8k"], ["server"], ["ar"], 1, [1, 32])
    tokens = {1: 1000, 32: 8000}
    prior = {1: 10.0, 16: 100.0}
    assert st.estimate_seconds(groups, {}, tokens, start_s=50.0, prior_tok_s=prior) == \
        pytest.approx(50 + 100 + 80)  # c=32: the nearest prior (16)
    done = {"x": {"path": "server", "concurrency": 1, "output_tokens": 500, "seconds": 10.0,
                  "start_s": 30.0}}
    assert st.estimate_seconds(groups, done, tokens, prior_tok_s=prior) == \
        pytest.approx(30 + 20 + 80)  # measured c=1 rate (50 tok/s) and start (30 s)
    assert st.duration(59 * 60) == "59 min" and st.duration(125 * 60) == "2 h 05 min"


def test_state_file_resumes_only_with_the_same_settings(tmp_path: Path) -> None:
    meta = {"settings": {"model": "m", "output_len": 128, "min_prompts": 8, "waves": 2,
                         "max_model_len": 2048, "dtype": "float32", "repeats": 3},
            "started": "t0"}
    path = tmp_path / "tables.json"
    state = st.load_state(path, meta)
    state["cells"]["k"] = {"seconds": 1.0}
    st.save_state(path, state)
    again = st.load_state(path, {**meta, "started": "t1",
                                 "settings": {**meta["settings"], "repeats": 5}})
    assert again["cells"] == {"k": {"seconds": 1.0}} and again["meta"]["started"] == "t0"
    with pytest.raises(SystemExit, match="output_len=128"):
        st.load_state(path, {**meta, "settings": {**meta["settings"], "output_len": 64}})


def test_default_baseline_is_the_plugins_default() -> None:
    bs = st.parse_baselines(["ngram:4", "default", "orthrus:3"], 8, {})
    assert list(bs) == ["ar", "ngram:4", "default", "orthrus:3"]
    assert (bs["default"].method, bs["default"].num_draft_tokens) == ("orthrus", 7)
    # no "adaptive" key: the plugin's default (adaptive, prompt lookup) applies
    assert st.vllm_speculative_config(bs["default"]) == {"method": "orthrus",
                                                          "num_speculative_tokens": 7}
    assert st.vllm_speculative_config(bs["orthrus:3"])["adaptive"] is False
    assert st.vllm_speculative_config(bs["ar"]) is None
    with pytest.raises(ValueError, match="block_size"):
        st.parse_baselines(["default"], None, {})
    with pytest.raises(ValueError, match="eagle3-drafter"):
        st.parse_baselines(["eagle3:3"], 8, {})


def test_dry_run_prints_the_plan_and_estimate(tmp_path: Path, capsys) -> None:
    out = tmp_path / "out"
    argv = ["--model", str(SYNTH_ORTHRUS_DIR), "--baselines", "ar,orthrus:2,ngram",
            "--concurrency", "1,2", "--repeats", "1", "--out", str(out), "--dry-run"]
    assert st.main(argv) == 0
    err = capsys.readouterr().err
    assert "36 cells (3 tables x 2 paths x 3 baselines x 2 concurrencies x 1 rounds)" in err
    assert "0 done, 36 to run in 6 engine starts" in err and "estimated time" in err
    assert (out / "work" / ".gitignore").read_text() == "*\n"
    assert not (out / "tables.json").exists()  # a dry run writes no state
    # a restart skips the cells the state file holds, and the engines they leave nothing to
    settings = {"model": str(SYNTH_ORTHRUS_DIR), "output_len": 64, "min_prompts": 4,
                "waves": 1, "max_model_len": 2048, "dtype": "float32"}
    done = [c for g in st.plan(list(st.TABLES), ["server"], ["ar"], 1, [1, 2]) for c in g.cells]
    st.save_state(out / "tables.json", {"meta": {"settings": settings, "started": "t"},
                                        "cells": {c.key: {} for c in done}})
    assert st.main(argv) == 0
    assert "6 done, 30 to run in 5 engine starts" in capsys.readouterr().err


def test_server_commands_of_both_engines() -> None:
    """vLLM's server with ``vllm_bench_serve``'s settings and the baseline's config; SGLang's
    with the offline engine's arguments as flags (the default: no fixed-K override)."""
    from types import SimpleNamespace

    args = st.build_parser().parse_args(["--out", "x"])
    bs = st.parse_baselines(["default", "orthrus:3"], 8, {})
    run = SimpleNamespace(baselines=bs, args=args, model="/m")
    cmd, env, engine = st.server_command(run, st.Group(0, "default", "server", ()), 8000)
    assert engine == "vllm" and env["VLLM_CPU_KVCACHE_SPACE"]
    assert cmd[cmd.index("--port") + 1] == "8000" and "--enforce-eager" in cmd
    assert json.loads(cmd[cmd.index("--speculative-config") + 1]) == {
        "method": "orthrus", "num_speculative_tokens": 7}
    cmd, _, engine = st.server_command(run, st.Group(0, "ar", "server", ()), 8000)
    assert "--speculative-config" not in cmd
    cmd, _, engine = st.server_command(run, st.Group(0, "default", "sglang-server", ()), 8001)
    assert engine == "sglang" and cmd[1:3] == ["-m", "sglang.launch_server"]
    assert cmd[cmd.index("--speculative-num-draft-tokens") + 1] == "8"
    assert "--json-model-override-args" not in cmd  # adaptive: the plugin's default
    assert cmd[cmd.index("--max-total-tokens") + 1] == "32768"
    assert cmd[cmd.index("--log-level") + 1] == "info"  # diffspec's own lines in the log
    cmd, _, _ = st.server_command(run, st.Group(0, "orthrus:3", "sglang-server", ()), 8001)
    assert json.loads(cmd[cmd.index("--json-model-override-args") + 1]) == {
        "diffspec": {"adaptive": False}}


def test_ar_without_the_overlap_scheduler_is_sglangs_only(tmp_path: Path) -> None:
    """``ar-no-overlap``: SGLang's AR under the scheduling its speculative path runs with
    (``--disable-overlap-schedule``); vLLM has no such switch, so it is refused there."""
    from types import SimpleNamespace

    args = st.build_parser().parse_args(["--out", "x"])
    bs = st.parse_baselines(["ar-no-overlap", "default"], 8, {})
    assert list(bs) == ["ar", "ar-no-overlap", "default"]
    assert (bs["ar-no-overlap"].method, bs["ar-no-overlap"].num_draft_tokens) == ("ar", 0)
    run = SimpleNamespace(baselines=bs, args=args, model="/m")
    cmd, _, _ = st.server_command(run, st.Group(0, "ar-no-overlap", "sglang-server", ()), 1)
    assert "--disable-overlap-schedule" in cmd and "--speculative-algorithm" not in cmd
    cmd, _, _ = st.server_command(run, st.Group(0, "ar", "sglang-server", ()), 1)
    assert "--disable-overlap-schedule" not in cmd  # SGLang's own default for AR
    assert st.offline_launch("sglang-offline", bs["ar-no-overlap"], args, {})[
        "disable_overlap_schedule"] is True
    with pytest.raises(ValueError, match="sglang-server"):
        st.server_command(run, st.Group(0, "ar-no-overlap", "server", ()), 1)
    with pytest.raises(ValueError, match="sglang-server"):
        st.offline_launch("offline", bs["ar-no-overlap"], args, {})
    with pytest.raises(SystemExit, match="SGLang's"):
        st.main(["--model", str(SYNTH_ORTHRUS_DIR), "--baselines", "ar,ar-no-overlap",
                 "--out", str(tmp_path / "out"), "--dry-run"])


def test_the_client_needs_pandas_and_says_so(monkeypatch, tmp_path: Path) -> None:
    """vLLM's client reads the prompt files with pandas, which vllm-cpu does not install:
    the benchmark stops before starting a server, saying what to install (it used to start
    every engine and fail each cell inside the client)."""
    import importlib.util

    from benchmarks.serve_tables import main
    from benchmarks.vllm_bench_serve import require_client

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "pandas" else real(name, *a))
    with pytest.raises(SystemExit, match=r"^install pandas \(pip install -e '\.\[bench\]'\)"):
        require_client()
    with pytest.raises(SystemExit, match="^install pandas"):
        main(["--tables", "gsm8k", "--baselines", "ar", "--paths", "server",
              "--model", "/nonexistent", "--out", str(tmp_path)])
    assert not list(tmp_path.iterdir())  # stopped before it wrote or started anything
