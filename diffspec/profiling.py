"""Forward latency of a causal LM: the time of one forward with Q query tokens over a KV
cache of C context tokens, as the draft-count policy (:mod:`diffspec.core.adaptive`) needs
it. ``benchmarks/profile_forward.py`` builds its tables with :func:`forward_latency`
(transformers). :class:`DraftTimings` times the engines' draft passes when
``$DIFFSPEC_DRAFT_TIMINGS`` names a file (``benchmarks/adaptive_sweep.py`` sets it), which
:func:`read_draft_timings` turns into a profile's ``draft_points`` / ``verify_points`` and
:func:`read_step_grid` into its ``step_grid`` (TiDAR's whole steps by requests and drafts).


The engines measure their own profile at start-up (:func:`time_forwards` over the widths of
:func:`profile_grid`, within a time budget) and keep it in a cache
(:func:`cached_latency_profile`: ``$DIFFSPEC_CACHE_DIR``, else
``$XDG_CACHE_HOME/diffspec``, else ``~/.cache/diffspec``; one JSON file per key of
checkpoint identity, engine and version, dtype, device, threads, drafts and grid).
torch and transformers are imported inside the functions.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from diffspec.core.adaptive import LatencyProfile

__all__ = ["CACHE_ENV", "DRAFT_TIMINGS_ENV", "PREFILL_CHUNK", "PROFILE_BUDGET_S", "DraftTimings",
           "engine_profile",
           "cache_dir", "cached_latency_profile", "checkpoint_identity", "device_name",
           "device_timer",
           "forward_latency",
           "profile_grid", "read_cached_profile",
           "read_draft_timings", "read_step_grid", "reused_profile_message", "time_forwards",
           "write_cached_profile"]

DRAFT_TIMINGS_ENV = "DIFFSPEC_DRAFT_TIMINGS"
CACHE_ENV = "DIFFSPEC_CACHE_DIR"
PROFILE_FORMAT = 1  # bump when what a cached profile means changes: older files are remeasured

PREFILL_CHUNK = 1024  # context prefilled in chunks: bounded activation memory at 8k


def device_name(device: Any) -> str:
    """What a cached profile's key says of the device (a ``torch.device``): a GPU's model;
    a CPU's model name and core count."""
    import platform

    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name")), name)
    except OSError:
        pass
    return f"{device.type}: {name} x{os.cpu_count()}"


def device_timer(device: str) -> Any:
    """``timed(fn) -> seconds``: CUDA events on a GPU (the kernels' time, synchronized),
    the wall clock on CPU."""
    import torch

    if not device.startswith("cuda"):
        def timed(fn: Any) -> float:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        return timed

    def timed_cuda(fn: Any) -> float:
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        begin.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        return begin.elapsed_time(end) / 1000.0
    return timed_cuda


def forward_latency(lm: Any, query_lens: list[int], contexts: list[int], repeats: int,
                    device: str, layer_counts: list[int] | None = None, stat: str = "median",
                    ) -> dict[int, dict[int, dict[int, float]]]:
    """Seconds of one forward (``stat``: median or min of ``repeats``): {layers: {context:
    {query_len: s}}}, with the first ``layers`` decoder layers of ``lm`` (default: all of
    them). The context is prefilled once (in chunks) through every layer; after each timed
    forward the cache is cropped back. The repeats are rounds over every query length, so a
    burst of other work on the machine falls on all of them alike. ``min`` suits a machine
    shared with other work (the least-disturbed run); ``median`` a dedicated one."""
    reduce = {"median": statistics.median, "min": min}[stat]
    import torch
    from transformers import DynamicCache

    layers = lm.model.layers
    layer_counts = layer_counts or [len(layers)]
    timed = device_timer(device)
    vocab = lm.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    tables: dict[int, dict[int, dict[int, float]]] = {n: {} for n in layer_counts}
    with torch.inference_mode():
        for ctx in contexts:
            cache = DynamicCache(config=lm.config)
            prompt = torch.randint(0, vocab, (1, ctx), generator=gen).to(device)
            for start in range(0, ctx, PREFILL_CHUNK):
                chunk = prompt[:, start:start + PREFILL_CHUNK]
                pos = torch.arange(start, start + chunk.shape[1], device=device)
                lm(input_ids=chunk, position_ids=pos[None], cache_position=pos,
                   past_key_values=cache, use_cache=True, logits_to_keep=1)
            for n in layer_counts:
                lm.model.layers = layers[:n]  # the first n layers; their cache is the same
                times: dict[int, list[float]] = {q: [] for q in query_lens}
                for i in range(repeats + 1):  # rounds over every width; the first warms up
                    for q in query_lens:
                        ids = torch.randint(0, vocab, (1, q), generator=gen).to(device)
                        positions = torch.arange(ctx, ctx + q, device=device)[None]
                        t = timed(functools.partial(lm, input_ids=ids, position_ids=positions,
                                                    cache_position=positions[0],
                                                    past_key_values=cache, use_cache=True))
                        if i:
                            times[q].append(t)
                        for layer_cache in cache.layers[:n]:  # drop the timed tokens from
                            layer_cache.crop(-q)  # the n layers that ran: back to the context
                tables[n][ctx] = {q: reduce(ts) for q, ts in times.items()}
            lm.model.layers = layers
    return tables


class DraftTimings:
    """Wall time of an engine drafter's passes, one line ``KIND TOKENS SECONDS`` appended
    per pass (``draft``; ``verify`` where the drafter runs the verify forward itself) to the
    file ``$DIFFSPEC_DRAFT_TIMINGS`` names (read when the drafter starts), and of whole
    quadratic steps, ``step REQUESTS DRAFTS SECONDS`` (:meth:`step`). Unset (the default):
    :meth:`time` just calls the pass, with no synchronization. Set, a CUDA device is
    synchronized around the pass, so leave it unset when serving."""

    def __init__(self, device: Any = None) -> None:
        path = os.environ.get(DRAFT_TIMINGS_ENV)
        self.path = Path(path) if path else None
        self.cuda = getattr(device, "type", str(device or "")).startswith("cuda")
        # the last step, when steady: (its start, its requests, its drafts)
        self._steady: tuple[float, frozenset[str], int] | None = None

    def time(self, tokens: int, fn: Any, kind: str = "draft") -> Any:
        """``fn()``, timed as a ``kind`` pass over ``tokens`` query tokens when enabled."""
        if self.path is None:
            return fn()
        import torch

        if self.cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        if self.cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        with self.path.open("a") as f:
            f.write(f"{kind} {int(tokens)} {seconds:.6f}\n")
        return out

    def start(self) -> float | None:
        """The start of a pass that spans several calls (:meth:`stop` ends it); ``None``
        when disabled."""
        if self.path is None:
            return None
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        return time.perf_counter()

    def stop(self, start: float | None, tokens: int, kind: str = "draft") -> None:
        """Record the pass :meth:`start` began (nothing when disabled)."""
        if self.path is None or start is None:
            return
        if self.cuda:
            import torch

            torch.cuda.synchronize()
        with self.path.open("a") as f:
            f.write(f"{kind} {int(tokens)} {time.perf_counter() - start:.6f}\n")

    def step(self, req_ids: Sequence[str], verified: Sequence[int],
             drafted: Sequence[int]) -> None:
        """Mark the start of an engine step of the requests ``req_ids`` (at the same point
        of every step, whatever it runs), of which those with branches verify
        ``verified`` drafts and pre-draft ``drafted`` each (``[]``: none has branches).
        The step before ran from its own mark to this one, a whole engine step (scheduler
        to scheduler, as the AR profile's ``points`` time it); it is written as ``step
        REQUESTS DRAFTS SECONDS`` when it was **steady** (every one of its requests
        verified and pre-drafted the same ``k >= 1``: TiDAR's steady state) and this step
        runs some of its requests and no other (so nothing else ran in between: no new
        request's prefill, no pause between two ``generate`` calls)."""
        if self.path is None:
            return
        now = self.start()
        if self._steady is not None:
            start, requests, k = self._steady
            if req_ids and requests.issuperset(req_ids):
                with self.path.open("a") as f:
                    f.write(f"step {len(requests)} {k} {now - start:.6f}\n")
        counts = {*verified, *drafted}
        steady = (len(counts) == 1 and min(counts) >= 1
                  and len(verified) == len(drafted) == len(req_ids))
        self._steady = (now, frozenset(req_ids), min(counts)) if steady else None


def _samples(path: str | Path, kind: str) -> dict[tuple[int, ...], list[float]]:
    """Seconds by key of the ``kind`` lines (``KIND KEY.. SECONDS``) of a timings file."""
    samples: dict[tuple[int, ...], list[float]] = {}
    for line in Path(path).read_text().splitlines():
        what, *key, seconds = line.split()
        if what == kind:
            samples.setdefault(tuple(int(x) for x in key), []).append(float(seconds))
    return samples


def read_draft_timings(path: str | Path, kind: str = "draft",
                       min_count: int = 3) -> dict[int, float]:
    """``{tokens: median seconds}`` of the ``kind`` passes a :class:`DraftTimings` file
    holds, for token counts seen at least ``min_count`` times (fewer: too few to trust)."""
    return {tokens: statistics.median(s) for (tokens,), s in sorted(_samples(path, kind).items())
            if len(s) >= min_count}


def read_step_grid(path: str | Path, min_count: int = 3) -> dict[int, dict[int, float]]:
    """``{requests: {drafts: median seconds}}`` of the steady quadratic steps a
    :class:`DraftTimings` file holds (:meth:`DraftTimings.step`; a profile's
    ``step_grid``), for cells seen at least ``min_count`` times."""
    grid: dict[int, dict[int, float]] = {}
    for (requests, drafts), s in sorted(_samples(path, "step").items()):
        if len(s) >= min_count:
            grid.setdefault(requests, {})[drafts] = statistics.median(s)
    return grid


# ------------------------------------------------------------------ start-up profiles


def cache_dir() -> Path:
    """Where diffspec caches what it measures: ``$DIFFSPEC_CACHE_DIR``, else
    ``$XDG_CACHE_HOME/diffspec``, else ``~/.cache/diffspec``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base).expanduser() / "diffspec"


def profile_grid(max_tokens: int) -> list[int]:
    """Query-token counts a start-up profile times: 1, 2, 3, 4, 6, 8, 12, 16, 24 .. (each
    power of two and the midpoint after it) up to ``max_tokens``, which is always in."""
    if max_tokens < 1:
        raise ValueError(f"a profile grid needs max_tokens >= 1, got {max_tokens}")
    grid, power = [1, 2], 2
    while grid[-1] < max_tokens:
        grid += [power + power // 2, power * 2]
        power *= 2
    grid = sorted({t for t in grid if t < max_tokens} | {max_tokens})
    return grid


def checkpoint_identity(checkpoint: str | Path, config: Mapping | None = None) -> dict:
    """What identifies a checkpoint's weights for a cache key: for a folder, its resolved
    path, the sha256 of its config.json and the size and mtime of each weight file; for
    a hub id, the id and the sha256 of ``config`` (its config as the engine read it)."""
    path = Path(checkpoint).expanduser()
    if path.is_dir():
        config_file = path / "config.json"
        weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt"))
        return {"path": str(path.resolve()),
                "config_sha256": (hashlib.sha256(config_file.read_bytes()).hexdigest()
                                  if config_file.is_file() else None),
                "weights": [[p.name, p.stat().st_size, p.stat().st_mtime_ns] for p in weights]}
    text = json.dumps(config or {}, sort_keys=True, default=str)
    return {"name": str(checkpoint), "config_sha256": hashlib.sha256(text.encode()).hexdigest()}


def time_forwards(run: Callable[[int], Any], grid: Sequence[int], repeats: int = 3,
                  budget_s: float = 20.0, timer: Callable[[Callable[[], Any]], float] | None = None,
                  agree: Callable[[bool], bool] | None = None) -> dict[int, float]:
    """``{tokens: median seconds}`` of ``run(tokens)`` over ``grid`` (increasing): one
    warm-up pass over the widths, widest last, that stops adding widths before the next
    one (guessed from the last, in proportion to the tokens) would overspend its share of
    ``budget_s`` (``budget_s / (repeats + 1)``; at least the first two widths
    are kept, so the profile can extrapolate past the last: linearly, as a compute-bound
    forward grows), then ``repeats`` rounds over the kept widths (interleaved: a burst of
    other work falls on all widths alike), the median of each. ``timer(fn) -> seconds``
    (default: the wall clock). ``agree(stop) -> stop``: where several processes time
    forwards together (tensor-parallel ranks), one decision for all of them whether the
    warm-up pass stops here (default: this process's own)."""
    if repeats < 1 or not grid:
        raise ValueError(f"need repeats >= 1 and a grid, got {repeats}, {list(grid)}")
    timer = timer or device_timer("cpu")
    share, spent, kept, last = budget_s / (repeats + 1), 0.0, [], 0.0
    for tokens in grid:
        # the next width's time, guessed as proportional to its tokens (a compute-bound
        # forward; less where extra tokens are nearly free): stop before it overspends
        guess = last * tokens / kept[-1] if kept else 0.0
        stop = len(kept) >= 2 and spent + guess > share
        if agree is not None:
            stop = agree(stop)
        if stop:
            break
        last = timer(functools.partial(run, tokens))
        spent += last
        kept.append(tokens)
    times: dict[int, list[float]] = {t: [] for t in kept}
    for _ in range(repeats):
        for tokens in kept:
            times[tokens].append(timer(functools.partial(run, tokens)))
    return {t: statistics.median(ts) for t, ts in times.items()}


def read_cached_profile(key: Mapping[str, Any]) -> tuple[LatencyProfile | None, Path]:
    """(the profile cached under ``key``, or None when there is none or it cannot be read;
    the cache file that holds or would hold it). ``key``: any JSON-able description of
    what the timings depend on."""
    key = {"format": PROFILE_FORMAT, **key}
    text = json.dumps(key, sort_keys=True, default=str)
    digest = hashlib.sha256(text.encode()).hexdigest()[:20]
    path = cache_dir() / "latency-profiles" / f"{digest}.json"
    try:
        data = json.loads(path.read_text())
        if json.dumps(data.get("key"), sort_keys=True, default=str) == text:
            return LatencyProfile({int(t): float(s) for t, s in data["points"].items()}), path
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        pass  # absent or unreadable: measure
    return None, path


def write_cached_profile(key: Mapping[str, Any], points: Mapping[int, float],
                         seconds: float) -> str:
    """Cache ``points`` (measured in ``seconds``) under ``key`` (atomically); the log line
    that says so, or why it could not be cached (the profile is used all the same)."""
    _, path = read_cached_profile(key)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({
            "key": {"format": PROFILE_FORMAT, **key},
            "points": {str(t): s for t, s in sorted(points.items())},
            "measured_s": round(seconds, 3),
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())},
            indent=1, default=str))
        tmp.replace(path)
        where = f"cached at {path}"
    except OSError as exc:
        where = f"not cached ({exc})"
    return (f"diffspec: measured a latency profile in {seconds:.1f} s ({len(points)} points, "
            f"{min(points)}..{max(points)} tokens), {where}")


def reused_profile_message(profile: LatencyProfile, path: Path) -> str:
    """The log line of a profile taken from the cache."""
    return (f"diffspec: reused the latency profile {path} ({len(profile.points)} points, "
            f"{min(profile.points)}..{max(profile.points)} tokens; delete it to measure again)")


def cached_latency_profile(key: Mapping[str, Any], measure: Callable[[], Mapping[int, float]],
                           log: Callable[[str], None],
                           broadcast: Callable[[Any], Any] | None = None,
                           rank0: bool = True) -> LatencyProfile:
    """The profile cached under ``key`` (:func:`read_cached_profile`), else ``measure()``'s
    points, cached (:func:`write_cached_profile`); one line to ``log`` either way (what it
    cost, where it is). Under tensor parallelism (``broadcast``: the group's broadcast of
    rank 0's object; ``rank0``: whether this is rank 0) rank 0 alone reads and writes the
    cache and logs, every rank measures together (the forwards' collectives) and every rank
    takes rank 0's points."""
    share = broadcast or (lambda obj: obj)
    cached, path = read_cached_profile(key) if rank0 else (None, None)
    points = share(None if cached is None else dict(cached.points))
    if points is not None:
        if rank0:
            log(reused_profile_message(cached, path))
        return LatencyProfile(points)
    start = time.perf_counter()
    measured = dict(measure())
    LatencyProfile(measured)  # refuses an empty or non-positive measurement
    if rank0:
        log(write_cached_profile(key, measured, time.perf_counter() - start))
    return LatencyProfile(share(measured if rank0 else None))


PROFILE_BUDGET_S = 20.0  # most seconds an engine's start-up profile spends timing forwards


def engine_profile(key: Mapping[str, Any], forward: Callable[[int], Any], grid: Sequence[int],
                   device: Any, tp: Any, log: Callable[[str], None]) -> LatencyProfile:
    """An engine worker's start-up latency profile: ``forward(T)`` timed over ``grid``
    (:func:`time_forwards`, within about :data:`PROFILE_BUDGET_S` seconds, on ``device``'s
    timer), cached under ``key`` (:func:`cached_latency_profile`). ``tp``: the engine's
    tensor-parallel group (``world_size``, ``rank_in_group``, ``broadcast_object``): the ranks
    run the forwards together and take rank 0's profile and cache decision."""
    broadcast = None if tp.world_size == 1 else tp.broadcast_object

    def measure() -> dict[int, float]:
        return time_forwards(forward, grid, budget_s=PROFILE_BUDGET_S,
                             timer=device_timer(str(device)), agree=broadcast)

    return cached_latency_profile(key, measure, log, broadcast=broadcast,
                                  rank0=tp.rank_in_group == 0)
