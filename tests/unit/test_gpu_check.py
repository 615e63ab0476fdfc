"""The GPU check command (scripts/gpu_check.sh, scripts/gpu_check.py) on CPU: ``--device
cpu --quick`` runs the checks, each asserting what it checks, writes the figures the
results page shows, and exits non-zero when a check fails."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "scripts/gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_checks_pass_on_cpu_and_write_figures(gpu_check, tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    names = ["core_rules", "tidar_split_attention", "draft_logits_memory", "masked_attention",
             "draft_pass"]
    code = gpu_check.main(["--device", "cpu", "--quick", "--out", str(out), "--only", *names])
    report = json.loads(out.read_text())
    assert code == 0 and report["ok"], report
    assert report["device"] == "cpu" and report["quick"]
    checks = report["checks"]
    assert set(checks) == set(names)
    split = checks["tidar_split_attention"]["figures"]
    assert split["fp32"]["max_abs_error"] <= split["fp32"]["tolerance"]
    memory = checks["draft_logits_memory"]["figures"]
    assert memory["logits_bytes_chunk"] < memory["logits_bytes_whole"]
    masked = checks["masked_attention"]["figures"]
    for dtype in ("fp32", "bf16"):
        rows = masked[dtype]["contexts"]
        assert [r["context"] for r in rows] == [256, 512]
        assert all(r["max_abs_error"] <= masked[dtype]["tolerance"] and r["ms"] > 0
                   for r in rows)
    draft = checks["draft_pass"]["figures"]
    assert draft["graph"] == "skipped: CUDA graphs need a CUDA device"  # recorded, not failed
    assert draft["rows"] > draft["chunk_rows"] and draft["eager_ms"] > 0
    assert draft["logits"]["memory"].startswith("not measured")


def test_masked_attention_check_catches_a_lost_mask(gpu_check,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """MaskedAttention attending without its masks (every token seeing every step token)
    fails the check: it compares with the masked dense attention."""
    from diffspec.model_executors.sglang import quadratic

    forward = quadratic.MaskedAttention.forward

    def unmasked(self, *args, **kwargs):
        self.layout.masks = [torch.ones_like(m) for m in self.layout.masks]
        return forward(self, *args, **kwargs)

    import torch

    monkeypatch.setattr(quadratic.MaskedAttention, "forward", unmasked)
    with pytest.raises(AssertionError, match="max error"):
        gpu_check.check_masked_attention(torch.device("cpu"), True)


def test_a_failing_check_fails_the_command(gpu_check, tmp_path: Path,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    def broken(device, quick):
        raise AssertionError("split vs dense max error 0.4")

    monkeypatch.setitem(gpu_check.CHECKS, "tidar_split_attention", broken)
    out = tmp_path / "gpu-check.json"
    code = gpu_check.main(["--device", "cpu", "--quick", "--out", str(out), "--only",
                           "core_rules", "tidar_split_attention"])
    report = json.loads(out.read_text())
    assert code == 1 and not report["ok"]
    assert report["checks"]["core_rules"]["ok"]
    assert "split vs dense max error 0.4" in report["checks"]["tidar_split_attention"]["error"]


@pytest.mark.parametrize(("mutation", "caught"), [
    # the branches run first to last, so a branch reads K/V a later branch wrote
    ("branches_first_to_last", "split vs dense max error"),
    # the verify K/V of d_1 .. d_n, overwritten by the branches, are not written back
    ("no_write_back", "the verify K/V are not in their slots after the step"),
])
def test_split_attention_check_runs_diffspecs_schedule(gpu_check, monkeypatch,
                                                       mutation: str, caught: str) -> None:
    """The check runs diffspec's own TiDAR code (issue 45, item 9): a wrong schedule in
    ``diffspec/spec_workers/vllm/tidar.py`` fails it."""
    import dataclasses

    import torch

    from diffspec.spec_workers.vllm import tidar

    build = tidar.build_branches

    def wrong(*args, **kwargs):
        branches = build(*args, **kwargs)
        if mutation == "branches_first_to_last":
            return dataclasses.replace(branches, steps=branches.steps[::-1])
        return dataclasses.replace(branches, restore_index=None)

    gpu_check.check_tidar_split_attention(torch.device("cpu"), True)  # the real code passes
    monkeypatch.setattr(tidar, "build_branches", wrong)
    with pytest.raises(AssertionError, match=caught):
        gpu_check.check_tidar_split_attention(torch.device("cpu"), True)


def test_shell_command_on_cpu(tmp_path: Path) -> None:
    """The one command: the gpu tier (skipped without CUDA) and the checks' figures."""
    env = {**os.environ, "PYTHON": sys.executable,
           "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run(["bash", str(ROOT / "scripts/gpu_check.sh"), "--device", "cpu",
                           "--quick", "--out", str(tmp_path), "--only", "core_rules"],
                          capture_output=True, text=True, timeout=600, env=env, check=False)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert (tmp_path / "gpu-tier.xml").is_file()
    assert json.loads((tmp_path / "gpu-check.json").read_text())["checks"]["core_rules"]["ok"]
