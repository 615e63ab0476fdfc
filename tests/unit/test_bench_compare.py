"""benchmarks.compare: rows and ratios from driver reports, training curves (pure)."""

from __future__ import annotations

import json

import pytest

from benchmarks.compare import compare, curve_points, rows_of


def _result(baseline, tps, al=None, lossless=1.0, error=None):
    return {"engine": "vllm", "baseline": baseline, "error": error,
            "overall": {"acceptance_length": al, "tpf": None, "lossless": lossless,
                        "tokens": 100},
            "system_tokens_per_s": {str(c): v for c, v in tps.items()}}


def _report(dataset="gsm8k", data_path=None):
    return {"meta": {"dataset": dataset, "data_path": data_path, "command": "cmd",
                     "date": "2026-11-24", "machine": {"nproc": 2, "cpu": "x"}},
            "results": [_result("ar", {1: 30.0, 4: 60.0}),
                        _result("orthrus:4", {1: 45.0, 4: 54.0}, al=3.1),
                        _result("eagle3:3", {}, error="boom\nmore")]}


def test_rows_divide_by_the_same_runs_ar():
    rows = rows_of(_report())
    orthrus = next(r for r in rows if r["baseline"] == "orthrus:4")
    assert orthrus["ratio_to_ar"] == {1: pytest.approx(1.5), 4: pytest.approx(0.9)}
    assert orthrus["acceptance_length"] == 3.1
    assert next(r for r in rows if r["baseline"] == "eagle3:3")["error"] == "boom"
    assert rows_of(_report("jsonl", "/x/sharegpt-heldout.jsonl"))[0]["dataset"] == \
        "sharegpt-heldout"


def test_curve_points_from_both_trainers():
    orthrus = {"history": [{"est_al": 2.0, "tokens_seen": 10}, {"est_al": 2.5,
                                                                 "tokens_seen": 20}]}
    assert curve_points(orthrus) == [(10, 2.0), (20, 2.5)]
    eagle = {"history": [{"chain_0": 0.5, "chain_1": 0.25}, {"chain_0": 0.6, "chain_1": 0.3},
                         {"chain_0": 0.7, "chain_1": 0.4}],
             "history_every": 5, "steps": 11, "tokens_seen": 1100}
    points = curve_points(eagle)
    assert [p[1] for p in points] == pytest.approx([1.75, 1.9, 2.1])
    assert [p[0] for p in points] == [100, 600, 1100]  # steps 0, 5 and the last (10)


def test_compare_writes_the_table(tmp_path):
    path = tmp_path / "report.json"
    path.write_text(json.dumps(_report()))
    result = compare([path], tmp_path / "out")
    text = (tmp_path / "out" / "comparison.md").read_text()
    assert "| gsm8k | vllm | orthrus:4 | 3.10 | n/a | 45.0 | 1.50 | 54.0 | 0.90 | 1.00 |" in text
    assert len(result["rows"]) == 3
