"""benchmarks.drafter_curves: chained runs on one CPU-minute axis, engine-measured points."""

from __future__ import annotations

import json

import pytest

from benchmarks.drafter_curves import chained_curve, main, measured_point


def _orthrus(cpu_s, tokens, estimates):
    step_tokens = tokens // len(estimates)
    return {"steps": len(estimates), "cpu_time_s": cpu_s, "tokens_seen": tokens,
            "history": [{"est_al": e, "tokens_seen": step_tokens * (i + 1)}
                        for i, e in enumerate(estimates)]}


def test_a_continued_run_starts_where_the_first_ended():
    first = _orthrus(600, 100, [2.0, 2.2])          # 10 CPU-min, 2 steps
    second = _orthrus(1200, 300, [2.3, 2.4, 2.5])   # 20 CPU-min, 3 steps
    pts = chained_curve([first, second])
    assert [p["cpu_min"] for p in pts] == pytest.approx([5, 10, 10 + 20 / 3, 10 + 40 / 3, 30])
    assert [p["tokens"] for p in pts] == [50, 100, 200, 300, 400]
    assert [p["estimate"] for p in pts] == [2.0, 2.2, 2.3, 2.4, 2.5]


def test_logged_every_n_steps_spreads_cpu_by_step():
    eagle = {"history": [{"chain_0": 0.5}, {"chain_0": 0.6}, {"chain_0": 0.7}],
             "history_every": 5, "steps": 11, "tokens_seen": 1100, "cpu_time_s": 660}
    pts = chained_curve([eagle])
    assert [p["cpu_min"] for p in pts] == pytest.approx([1, 6, 11])  # steps 0, 5, 10
    assert [p["estimate"] for p in pts] == pytest.approx([1.5, 1.6, 1.7])


def _report():
    ok = {"baseline": "orthrus:7", "error": None, "acceptance_per_position": [0.9, 0.4],
          "overall": {"acceptance_length": 2.3}}
    bad = {"baseline": "eagle3:3", "error": "boom\nmore", "overall": {}}
    return {"meta": {"date": "2026-12-02"}, "results": [ok, bad]}


def test_measured_point_reads_the_engine_counters_and_refuses_what_is_not_there():
    assert measured_point(_report(), "orthrus:7") == {
        "acceptance_length": 2.3, "acceptance_per_position": [0.9, 0.4], "date": "2026-12-02"}
    with pytest.raises(ValueError, match="failed in that report: boom"):
        measured_point(_report(), "eagle3:3")
    with pytest.raises(ValueError, match="name a baseline the report has"):
        measured_point(_report(), "orthrus:3")


def test_main_writes_json_and_plot(tmp_path, capsys):
    rec = tmp_path / "training.json"
    rec.write_text(json.dumps(_orthrus(600, 100, [2.0, 2.2])))
    report = tmp_path / "report.json"
    report.write_text(json.dumps(_report()))
    assert main(["--run", f"orthrus={rec}", "--measured", f"orthrus@10={report}#orthrus:7",
                 "--out", str(tmp_path / "out")]) == 0
    out = json.loads((tmp_path / "out" / "drafter_curves.json").read_text())
    assert out["measured"][0]["acceptance_length"] == 2.3
    assert (tmp_path / "out" / "drafter_curves.png").stat().st_size > 0
    assert "| orthrus | 10 | 100 | 2.10 |" in capsys.readouterr().out
