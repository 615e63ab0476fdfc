"""Progress of long steps as plain lines on stderr: done / total, rate, elapsed, ETA.

Plain lines rather than a redrawn bar: they read the same in a terminal and in a CI log
(a file, where a redrawn bar is either silent or one endless line), and they do not fight
with the lines the step prints itself. :class:`Progress` prints one line at the first
update, then at most one every ``interval_s`` (10 s on a terminal, 30 s otherwise;
``$DIFFSPEC_PROGRESS_S`` overrides both), and one when it closes::

    [train] step 120/2000 (6.0%) | 0.85 step/s, 1234 tok/s | 2m21s elapsed | ETA 36m52s

:meth:`Progress.ticker` prints the same line from a background thread for steps that do
not report their own progress (a subprocess, a library call): with ``probe`` (units done
so far, e.g. bytes written) it has a rate and an ETA, without it the elapsed time only.

Importing this module imports nothing heavy.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import IO

__all__ = ["Progress", "format_duration", "interval_s"]

ENV = "DIFFSPEC_PROGRESS_S"


def format_duration(seconds: float) -> str:
    """``45s``, ``2m05s``, ``1h02m03s``."""
    s = max(0, round(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    if h:
        return f"{h}h{m:02d}m{s:02d}s"
    return f"{m}m{s:02d}s" if m else f"{s}s"


def interval_s(file: IO[str] | None = None) -> float:
    """Seconds between progress lines: ``$DIFFSPEC_PROGRESS_S``, else 10 on a terminal and
    30 otherwise (CI logs)."""
    env = os.environ.get(ENV)
    if env:
        return float(env)
    file = file if file is not None else sys.stderr
    try:
        tty = file.isatty()
    except (AttributeError, ValueError):
        tty = False
    return 10.0 if tty else 30.0


def _amount(n: float, unit: str) -> str:
    if unit == "B":
        return f"{n / 1e6:.1f} MB"
    return f"{n:g}" if isinstance(n, float) and not n.is_integer() else f"{int(n)}"


class Progress:
    """Progress of one step towards ``total`` units (``None``: unknown), as lines on
    ``file`` (stderr). ``done`` units may be done already (a resumed run): the rate and the
    ETA count only what this process does. ``unit=""`` counts nothing: the line says what
    runs and for how long (with :meth:`ticker`)."""

    def __init__(self, desc: str, total: float | None = None, unit: str = "it", *,
                 done: float = 0, interval: float | None = None,
                 file: IO[str] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.file = file
        self.interval = interval if interval is not None else interval_s(file)
        self.clock = clock
        self.done = self.start_done = done
        self.start = clock()
        self._last: float | None = None
        self._lock = threading.Lock()
        self.closed = False

    # ------------------------------------------------------------------------ numbers

    @property
    def elapsed(self) -> float:
        return self.clock() - self.start

    def rate(self) -> float | None:
        """Units per second in this process (``None`` before any)."""
        elapsed, done = self.elapsed, self.done - self.start_done
        return done / elapsed if done > 0 and elapsed > 0 else None

    def eta(self) -> float | None:
        """Seconds left at this process's rate (``None`` without a total or a rate)."""
        rate = self.rate()
        if self.total is None or rate is None:
            return None
        return max(0.0, self.total - self.done) / rate

    def line(self, extra: str | None = None, eta_s: float | None = None) -> str:
        """The progress line now; ``extra`` (e.g. ``"1234 tok/s"``) follows the rate,
        ``eta_s`` replaces the computed ETA (a trainer that also watches a CPU budget)."""
        unit = "" if self.unit == "B" else f" {self.unit}"
        if not self.unit:  # nothing counted: what runs and for how long
            head = self.desc
        elif self.total:
            pct = 100.0 * self.done / self.total
            head = (f"{self.desc}:{unit} {_amount(self.done, self.unit)}/"
                    f"{_amount(self.total, self.unit)} ({pct:.1f}%)")
        else:
            head = f"{self.desc}:{unit} {_amount(self.done, self.unit)}"
        rate = self.rate() if self.unit else None
        rates = []
        if rate is not None:
            rates.append(f"{rate / 1e6:.1f} MB/s" if self.unit == "B"
                         else f"{rate:.3g} {self.unit}/s")
        if extra:
            rates.append(extra)
        parts = [head]
        if rates:
            parts.append(", ".join(rates))
        parts.append(f"{format_duration(self.elapsed)} elapsed")
        eta = eta_s if eta_s is not None else self.eta()
        if eta is not None:
            parts.append(f"ETA {format_duration(eta)}")
        return " | ".join(parts)

    # ------------------------------------------------------------------------- output

    def _print(self, text: str) -> None:
        print(text, file=self.file if self.file is not None else sys.stderr, flush=True)

    def update(self, n: float = 1, *, extra: str | None = None, eta_s: float | None = None,
               force: bool = False) -> str | None:
        """Add ``n`` units; print (and return) the line when the first update, ``force``
        or ``interval`` seconds since the last line say so."""
        with self._lock:
            self.done += n
            now = self.clock()
            if not force and self._last is not None and now - self._last < self.interval:
                return None
            self._last = now
            text = self.line(extra, eta_s)
        self._print(text)
        return text

    def close(self, extra: str | None = None) -> str:
        """Print the final line (``done in ...``); idempotent."""
        with self._lock:
            if self.closed:
                return ""
            self.closed = True
            unit = "" if self.unit == "B" else f" {self.unit}"
            rate = self.rate() if self.unit else None
            text = (f"{self.desc}: done,{unit} {_amount(self.done, self.unit)} in "
                    f"{format_duration(self.elapsed)}" if self.unit else
                    f"{self.desc}: done in {format_duration(self.elapsed)}")
            if rate is not None:
                text += (f" ({rate / 1e6:.1f} MB/s)" if self.unit == "B"
                         else f" ({rate:.3g} {self.unit}/s)")
            if extra:
                text += f", {extra}"
        self._print(text)
        return text

    @contextlib.contextmanager
    def ticker(self, probe: Callable[[], float] | None = None) -> Iterator[Progress]:
        """Within the block, a background thread prints the line every ``interval``
        seconds (``probe()``, if given, sets ``done``: bytes written so far, ...); the
        final line is printed on a normal exit."""
        stop = threading.Event()

        def tick() -> None:
            while not stop.wait(self.interval):
                if probe is not None:
                    with contextlib.suppress(OSError):
                        value = probe()
                        with self._lock:
                            self.done = value
                with self._lock:
                    self._last = self.clock()
                    text = self.line()
                self._print(text)

        thread = threading.Thread(target=tick, name=f"progress {self.desc}", daemon=True)
        thread.start()
        try:
            yield self
        finally:
            stop.set()
            thread.join()
        self.close()
