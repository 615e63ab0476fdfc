"""benchmarks/code_ab.py's pure parts: checkouts, ratios within rounds, the table."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.code_ab import parse_checkouts, render, summarize

pytestmark = pytest.mark.unit
ROOT = Path(__file__).resolve().parents[2]


def test_checkouts_must_be_named_diffspec_trees(tmp_path: Path) -> None:
    assert parse_checkouts([f"a={ROOT}", f"b={ROOT}"]) == {"a": ROOT, "b": ROOT}
    with pytest.raises(SystemExit, match="NAME=PATH"):
        parse_checkouts([str(ROOT), f"b={ROOT}"])
    with pytest.raises(SystemExit, match="not 'ar'"):
        parse_checkouts([f"ar={ROOT}", f"b={ROOT}"])
    with pytest.raises(SystemExit, match="not a diffspec source tree"):
        parse_checkouts([f"a={tmp_path}", f"b={ROOT}"])
    with pytest.raises(SystemExit, match="at least two"):
        parse_checkouts([f"a={ROOT}"])


def _cell(server: str, rnd: int, tok_s: float, same=None) -> dict:
    return {"table": "gsm8k", "concurrency": 4, "server": server, "round": rnd,
            "tok_s": tok_s, "tpot_ms": 1000 / tok_s, "acceptance_length": None if server == "ar"
            else 2.0, "same_as_ar": same}


def test_ratios_are_taken_within_each_round() -> None:
    # round 1 runs on a machine twice as fast: per-round ratios stay 1.2 and 1.5
    cells = [_cell("ar", 0, 10.0), _cell("before", 0, 12.0, [4, 4]), _cell("after", 0, 15.0, [4, 4]),
             _cell("ar", 1, 20.0), _cell("before", 1, 24.0, [4, 4]), _cell("after", 1, 30.0, [3, 4])]
    rows = {r["server"]: r for r in summarize(cells, ["ar", "before", "after"])}
    assert rows["before"]["x_ar"] == pytest.approx([1.2, 1.2])
    assert rows["after"]["x_ar"] == pytest.approx([1.5, 1.5])
    assert rows["after"]["x_first"] == pytest.approx([1.25, 1.25])
    assert rows["before"]["x_first"] == [] and rows["ar"]["x_ar"] == []
    table = render(list(rows.values()), ["ar", "before", "after"])
    assert "| gsm8k | 4 | after | 22.5 (15.0-30.0) |" in table
    assert "| 1.25 (1.25-1.25) |" in table and "| 7/8 |" in table
