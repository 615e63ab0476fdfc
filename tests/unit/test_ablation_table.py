"""training.ablation_table on arm folders laid out as the ablation stage writes them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from training.ablation_table import ablation_rows, main


def _arm(runs: Path, arm: str, al: float | None, spec_tps: float, extra: dict) -> None:
    (runs / arm).mkdir(parents=True)
    (runs / arm / "training.json").write_text(json.dumps({
        "config": {"lr": 2e-3, "extra": {"rank": 64, "block_size": 8, **extra}},
        "cpu_time_s": 1800.0, "steps": 120, "tokens_seen": 500_000,
        "estimated_acceptance_length": 2.1}))
    if al is None:
        return
    (runs / f"{arm}-accept").mkdir()
    overall = {"per_user_tokens_per_s": 10.0, "acceptance_length": None, "lossless": 1.0}
    (runs / f"{arm}-accept" / "report.json").write_text(json.dumps({"results": [
        {"engine": "vllm", "baseline": "ar", "overall": overall},
        {"engine": "vllm", "baseline": "orthrus:7",
         "overall": {**overall, "per_user_tokens_per_s": spec_tps, "acceptance_length": al}},
    ]}))


def test_the_table_ranks_the_measured_arms(tmp_path: Path, capsys) -> None:
    _arm(tmp_path, "base", 2.4, 13.0, {})
    _arm(tmp_path, "ce", 2.6, 14.0, {"loss": "ce"})
    _arm(tmp_path, "widths", None, 0.0, {"block_widths": [2, 4, 8]})  # not measured yet
    rows = ablation_rows(tmp_path)
    assert [r["arm"] for r in rows] == ["base", "ce"]
    assert rows[1]["vs_ar"] == pytest.approx(1.4) and rows[1]["cpu_minutes"] == 30.0
    assert main(["--runs", str(tmp_path), "--out", str(tmp_path / "out")]) == 0
    table = capsys.readouterr().out.splitlines()
    assert table[2].startswith("| ce |") and "| 2.60 | 1.40x | 100% |" in table[2]
    assert json.loads((tmp_path / "out" / "ablation.json").read_text())[0]["arm"] == "base"


def test_nothing_measured_says_what_to_run(tmp_path: Path) -> None:
    with pytest.raises(SystemExit):
        main(["--runs", str(tmp_path)])
