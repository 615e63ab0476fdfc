"""Resumable training runs under a CPU budget (a run may span several sessions).

:class:`ResumableRun` keeps what a trainer needs to stop and continue bit for bit: the
per-step history, tokens seen, CPU and wall time of all sessions together, and one
``state.pt`` written atomically (``checkpoint/state.pt`` under the output folder). The
trainer owns the model and optimizer state; the run adds its own counters and checks the
CPU budget after each step.

Used by :func:`diffspec.train.orthrus.train_orthrus_answers` and the EAGLE-3 baseline
(``training.eagle3``): the same file layout and fields (``checkpoint/state.pt``; ``step``,
``history``, ``tokens_seen``, ``cpu_time_s``, ``wall_time_s``, ``sessions``).

Given ``total_steps``, :meth:`ResumableRun.record_step` also prints a progress line on
stderr (:class:`diffspec.progress.Progress`: at the first step, then every 10 s on a
terminal / 30 s in a log, and at the last step): steps done, steps/s, tokens/s and the ETA
of :meth:`ResumableRun.eta_s` (which also watches the CPU budget)::

    [train] progress: step 120/2000 (6.0%) | 0.85 step/s, 1234 tok/s | 2m21s elapsed | ETA 36m52s
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CHECKPOINT_DIR = "checkpoint"
STATE_FILE = "state.pt"

__all__ = ["CHECKPOINT_DIR", "STATE_FILE", "ResumableRun", "write_json"]


def write_json(path: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON, atomically (a temp file, then a rename)."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


@dataclass
class ResumableRun:
    """Counters of one run across sessions; ``state`` is what the last session saved
    (``None`` for a fresh run)."""

    out: Path | None
    max_cpu_s: float | None = None
    command: str | None = None
    history: list[dict[str, float]] = field(default_factory=list)
    tokens_seen: int = 0
    cpu_before: float = 0.0
    wall_before: float = 0.0
    sessions: list[dict[str, Any]] = field(default_factory=list)
    state: dict[str, Any] | None = None
    stopped_by_budget: bool = False
    total_steps: int | None = None  # progress lines on stderr when set
    deadline: float | None = None  # a time.monotonic() instant: this session stops there

    def __post_init__(self) -> None:
        self._cpu0, self._wall0 = time.process_time(), time.perf_counter()
        self._session_tokens0 = 0
        self._progress = None

    @property
    def state_path(self) -> Path | None:
        return None if self.out is None else self.out / CHECKPOINT_DIR / STATE_FILE

    @classmethod
    def open(cls, out: str | Path | None, *, resume: bool, max_cpu_s: float | None = None,
             command: str | None = None, total_steps: int | None = None,
             deadline: float | None = None) -> ResumableRun:
        """A fresh run, or (``resume``) the one saved under ``out``; with ``total_steps``,
        progress lines on stderr; ``deadline`` (a ``time.monotonic()`` instant) ends this
        session like the CPU budget does (a GPU job's wall-clock limit)."""
        import torch

        run = cls(Path(out) if out is not None else None, max_cpu_s, command,
                  total_steps=total_steps, deadline=deadline)
        if resume:
            path = run.state_path
            if path is None or not path.is_file():
                raise FileNotFoundError(f"--resume: no checkpoint at {path} (start the run "
                                        f"without --resume first)")
            state = torch.load(path, map_location="cpu", weights_only=False)
            run.state = state
            run.history = list(state["history"])
            run.tokens_seen = int(state["tokens_seen"])
            run.cpu_before, run.wall_before = state["cpu_time_s"], state["wall_time_s"]
            run.sessions = list(state.get("sessions", []))
        run.start()
        return run

    def start(self) -> None:
        """Start this session's clocks (call right before the first step)."""
        self._cpu0, self._wall0 = time.process_time(), time.perf_counter()
        self._session_tokens0 = self.tokens_seen
        self._session = {"start_step": self.step, "command": self.command}
        if self.total_steps is not None:
            from diffspec.progress import Progress

            self._progress = Progress("[train] progress", self.total_steps, "step",
                                      done=self.step)

    @property
    def step(self) -> int:
        """Steps done, all sessions together (the next step's index)."""
        return len(self.history)

    @property
    def cpu_time_s(self) -> float:
        return self.cpu_before + time.process_time() - self._cpu0

    @property
    def wall_time_s(self) -> float:
        return self.wall_before + time.perf_counter() - self._wall0

    def session_rate(self) -> float:
        """Tokens per wall second in this session."""
        return (self.tokens_seen - self._session_tokens0) / max(
            time.perf_counter() - self._wall0, 1e-9)

    def record_step(self, entry: dict[str, float], tokens: int) -> None:
        self.tokens_seen += tokens
        self.history.append(dict(entry, tokens_seen=self.tokens_seen))
        if self._progress is not None:
            last = self.step >= self.total_steps
            self._progress.update(1, extra=f"{self.session_rate():.0f} tok/s",
                                  eta_s=self.eta_s(self.total_steps), force=last)

    def over_budget(self) -> bool:
        """True (and noted in the session record) once the CPU budget is spent or the
        session's deadline has passed."""
        if self.max_cpu_s is not None and self.cpu_time_s >= self.max_cpu_s:
            self.stopped_by_budget = True
            self._session["stopped_by_cpu_budget"] = True
            return True
        if self.deadline is not None and time.monotonic() >= self.deadline:
            self.stopped_by_budget = True
            self._session["stopped_by_deadline"] = True
            return True
        return False

    def resumed(self, **current: Any) -> tuple[Any, ...]:
        """The values of ``current``'s settings, in their order: on resume the ones the
        first session saved (a resumed run keeps its settings), else ``current``'s."""
        if self.state is None:
            return tuple(current.values())
        return tuple(self.state["settings"][name] for name in current)

    def files(self, fresh: Callable[[], list[Path]]) -> list[Path]:
        """The data files: on resume exactly the first session's, else ``fresh()``."""
        if self.state is None:
            return fresh()
        return [Path(f) for f in self.state["data"]["files"]]

    def check_rows(self, rows_sha256: str) -> None:
        """Refuse a resumed run whose data rows differ from the first session's."""
        if self.state is not None and self.state["data"]["rows_sha256"] != rows_sha256:
            raise ValueError("--resume: the data rows differ from the first session's "
                             "(a data file changed)")

    def stops_after(self, step: int, total_steps: int, log: Callable[[str], None]) -> bool:
        """After step ``step`` (0-based): True, logged, when the CPU budget or the deadline
        ends this session before ``total_steps`` (a trainer's ``on_step`` returns it)."""
        if step + 1 < total_steps and self.over_budget():
            log(f"stopping after step {step}: {self.budget_note()} (continue with "
                f"--resume and a larger budget)")
            return True
        return False

    def budget_note(self) -> str:
        """Why :meth:`over_budget` stopped the session, for the log."""
        if self._session.get("stopped_by_deadline"):
            return "the session's deadline passed"
        return f"{self.cpu_time_s:.0f} s CPU >= the budget {self.max_cpu_s:.0f} s"

    def eta_s(self, total_steps: int) -> float:
        """Wall seconds left at this session's pace (to ``total_steps`` or the CPU budget,
        whichever comes first)."""
        done = self.step - self._session["start_step"]
        per_step_wall = (time.perf_counter() - self._wall0) / max(done, 1)
        left = (total_steps - self.step) * per_step_wall
        if self.max_cpu_s is not None and done:
            per_step_cpu = (time.process_time() - self._cpu0) / done
            cpu_left_steps = max(0.0, self.max_cpu_s - self.cpu_time_s) / max(per_step_cpu,
                                                                               1e-9)
            left = min(left, cpu_left_steps * per_step_wall)
        return left

    def pace_note(self, total_steps: int) -> str:
        """The end of a trainer's step line: this session's tokens/s, the CPU-minutes of all
        sessions, the ETA of :meth:`eta_s`."""
        return (f"{self.session_rate():.0f} tok/s  {self.cpu_time_s / 60:.1f} CPU-min  "
                f"ETA {self.eta_s(total_steps) / 60:.0f} min")

    def counters(self) -> dict[str, Any]:
        """The run's counters for ``training.json`` and ``state.pt``."""
        return {
            "steps": self.step, "tokens_seen": self.tokens_seen,
            "cpu_time_s": round(self.cpu_time_s, 1), "wall_time_s": round(self.wall_time_s, 1),
            "sessions": self.sessions + [dict(self._session, end_step=self.step)],
        }

    def save_state(self, payload: dict[str, Any]) -> None:
        """``payload`` (the trainer's model / optimizer / settings) plus the counters and
        torch's RNG state, written atomically to ``checkpoint/state.pt``."""
        import torch

        if self.out is None:
            return
        path = self.state_path
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        counters = self.counters()
        torch.save({**payload, **counters, "history": self.history,
                    "step": self.step, "torch_rng": torch.get_rng_state()}, tmp)
        os.replace(tmp, path)
