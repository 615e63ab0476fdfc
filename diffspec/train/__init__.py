"""Training the drafters: Orthrus diffusion heads and the NLD linear self-speculation LoRA.

Design notes: docs/design/training.md (section ``diffspec/train/__init__.py``).
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "FitResult",
    "LRSchedule",
    "LossFn",
    "OnStep",
    "StepFn",
    "TrainConfig",
    "TrainResult",
    "cosine_lr_scale",
    "cpu_bf16_is_fast",
    "fit",
    "log_to_stderr",
    "measure_speculation",
    "rank_arg",
    "torch_threads",
    "warn_slow_autocast",
]


@dataclass
class TrainConfig:
    """Optimization settings shared by both trainers (one place, validated once)."""

    steps: int = 300
    lr: float = 1e-3
    warmup_steps: int = 20
    min_lr_ratio: float = 0.1  # the cosine decays to lr * min_lr_ratio
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    max_grad_norm: float = 1.0  # 0 disables clipping
    batch_size: int = 8
    seq_len: int = 192
    seed: int = 0
    num_threads: int | None = 1  # torch threads (CPU); None leaves torch's default
    log_every: int = 25
    extra: dict[str, Any] = field(default_factory=dict)  # method settings, for the record

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "seq_len", "log_every"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.lr <= 0 or not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"need lr > 0 and 0 <= min_lr_ratio <= 1, got {self.lr}, "
                             f"{self.min_lr_ratio}")
        if self.warmup_steps < 0 or self.max_grad_norm < 0:
            raise ValueError("warmup_steps and max_grad_norm must be >= 0")

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def cosine_lr_scale(step: int, cfg: TrainConfig) -> float:
    """LR multiplier at ``step``: linear warmup to 1, then cosine down to ``min_lr_ratio``."""
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    t = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * min(t, 1.0)))


@dataclass
class FitResult:
    """What :func:`fit` returns: per-step metrics and the (unwrapped) trained module."""

    history: list[dict[str, float]]  # one dict per step: loss terms, lr
    wall_time_s: float
    cpu_time_s: float  # this process's CPU time (on a shared machine, less than wall x threads)
    module: Any  # the module passed in, unwrapped from DDP / FSDP
    accelerator: Any = None  # the accelerate.Accelerator, when one was used
    is_main_process: bool = True
    wrapped: Any = None  # the module as prepared by accelerate (DDP / FSDP wrapper)

    @property
    def distributed(self) -> bool:
        return self.accelerator is not None and self.accelerator.num_processes > 1

    def trained_state(self, keep: Callable[[str], bool]) -> dict[str, Any] | None:
        """Whole tensors of the parameters whose name passes ``keep`` (names relative to the
        module given to :func:`fit`). In a multi-process run every process must call this
        (FSDP gathers the shards); the main process gets the tensors, the others ``None``."""
        if not self.distributed:
            return {n: p.detach() for n, p in self.module.named_parameters() if keep(n)}
        state = self.accelerator.get_state_dict(self.wrapped)
        if not self.is_main_process:
            return None
        return {n: t for n, t in state.items() if keep(n)}


@dataclass
class TrainResult:
    """A finished trainer run: the trained model (in memory), where it was saved, the
    ``training.json`` record and the :class:`FitResult`."""

    model: Any  # OrthrusModel (Orthrus heads) or NLDModel (draft LoRA)
    out_dir: Path | None
    record: dict[str, Any]
    fit: FitResult


LossFn = Callable[[Any, Any], Any]  # (module, batch) -> {"loss": tensor, ...} or a loss tensor
LRSchedule = Callable[[int], float]  # step -> learning rate (absolute, not a multiplier)
# (module, batch, backward) -> the step's metrics as floats ("loss" among them); the step
# calls backward(loss) once per micro-batch (gradients add up), fit clips and steps after it
StepFn = Callable[[Any, Any, Callable[[Any], None]], dict[str, float]]
OnStep = Callable[[int, dict[str, float]], bool]  # (step, record) -> stop now?



def log_to_stderr(msg: str) -> None:
    """The trainers' default ``log``: one line on stderr, flushed."""
    print(msg, file=sys.stderr, flush=True)


@contextlib.contextmanager
def torch_threads(num_threads: int | None) -> Iterator[None]:
    """torch's CPU threads set to ``num_threads`` (None or 0: left as they are) for the
    block, restored after it."""
    import torch

    previous = torch.get_num_threads()
    if num_threads:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)

def fit(
    module,  # torch.nn.Module whose forward(batch [B, L]) returns a dict with "loss"
    batches: Iterable,  # a DataLoader of [B, L] int64 rows (at least cfg.steps batches)
    cfg: TrainConfig,
    *,
    loss_fn: LossFn | None = None,
    step_fn: StepFn | None = None,
    lr_schedule: LRSchedule | None = None,
    use_accelerate: bool | None = None,
    log: Callable[[str], None] | None = None,
    optimizer=None,
    start_step: int = 0,
    reseed: bool = True,
    on_step: OnStep | None = None,
    format_step: Callable[[int, dict[str, float]], str] | None = None,
) -> FitResult:
    """Train the parameters of ``module`` that require grad, steps ``start_step ..
    cfg.steps - 1``.

    AdamW over the trainable parameters only (or ``optimizer``, e.g. one restored from a
    checkpoint), gradient clipping at ``cfg.max_grad_norm``. Each step's loss terms come
    from ``module(batch)``, or from ``loss_fn(module, batch)`` when given (a dict of scalar
    tensors with ``"loss"``, or the loss tensor alone); a trainer that accumulates
    gradients over micro-batches passes ``step_fn`` instead (see :data:`StepFn`). The
    step's learning rate is ``lr_schedule(step)`` when given, else ``cfg.lr *
    cosine_lr_scale(step, cfg)``. After each optimizer step ``on_step(step, record)``
    runs (checkpoints, budgets; ``True`` stops the run after this step), then the log line
    (``format_step``) every ``cfg.log_every`` steps. With ``accelerate`` installed
    (default when it is importable) the module, optimizer and data loader go through
    ``Accelerator.prepare``, so the same call runs as one plain process or under
    ``accelerate launch`` (DDP, FSDP); the seed (``reseed``: set here; a trainer that
    seeded before building its model, or restored the RNG, passes ``False``) makes a
    single-process run deterministic.
    """
    import torch

    log = log or log_to_stderr
    if step_fn is not None and loss_fn is not None:
        raise ValueError("pass loss_fn or step_fn, not both")
    step_fn = step_fn or _loss_step(loss_fn or (lambda m, batch: m(batch)))
    lr_schedule = lr_schedule or (lambda step: cfg.lr * cosine_lr_scale(step, cfg))
    format_step = format_step or _format_step
    with torch_threads(cfg.num_threads):
        if reseed:
            torch.manual_seed(cfg.seed)
        return _fit(module, batches, cfg, _make_accelerator(use_accelerate), log, step_fn,
                    lr_schedule, optimizer, start_step, on_step, format_step)


def _loss_step(loss_fn: LossFn) -> StepFn:
    """The step of a plain loss: one forward, one backward, its terms as floats."""
    def step(module, batch, backward) -> dict[str, float]:
        out = loss_fn(module, batch)
        if not isinstance(out, dict):
            out = {"loss": out}
        backward(out["loss"])
        return {k: float(v.detach()) for k, v in out.items()}
    return step


def _format_step(step: int, record: dict[str, float]) -> str:
    terms = "  ".join(f"{k} {v:.4f}" for k, v in record.items() if k != "lr")
    return f"step {step:5d}  {terms}  lr {record['lr']:.2e}"


def _make_accelerator(use_accelerate: bool | None):
    if use_accelerate is False:
        return None
    try:
        from accelerate import Accelerator
    except ImportError:
        if use_accelerate:
            raise
        return None
    accelerator = Accelerator()
    if accelerator.num_processes > 1:
        # Destroy the process group (accelerate's end_training) at exit, before Python
        # finalizes: left to module teardown, the gloo group is destroyed while the
        # interpreter shuts down, and a gloo thread that needs the GIL then aborts the
        # process (SIGABRT, "terminate called without an active exception").
        import atexit

        atexit.register(accelerator.end_training)
    return accelerator


def _fit(module, batches, cfg: TrainConfig, accelerator, log, step_fn: StepFn,
         lr_schedule: LRSchedule, optimizer, start_step: int, on_step: OnStep | None,
         format_step) -> FitResult:
    import torch

    if optimizer is None:
        params = [p for p in module.parameters() if p.requires_grad]
        if not params:
            raise ValueError("the module has no trainable parameters")
        optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas,
                                      weight_decay=cfg.weight_decay)
    else:
        params = [p for group in optimizer.param_groups for p in group["params"]]
    if accelerator is not None:
        module, optimizer, batches = accelerator.prepare(module, optimizer, batches)
    is_main = accelerator is None or accelerator.is_main_process
    if accelerator is not None and is_main:
        log(f"accelerate: {accelerator.distributed_type.value}, "
            f"{accelerator.num_processes} process(es), device {accelerator.device}")

    def backward(loss) -> None:
        if accelerator is None:
            loss.backward()
        else:
            accelerator.backward(loss)

    module.train()
    history: list[dict[str, float]] = []
    start, start_cpu = time.perf_counter(), time.process_time()
    batch_iter = iter(batches)
    for step in range(start_step, cfg.steps):
        for group in optimizer.param_groups:  # set per step: one step per optimizer step
            group["lr"] = lr_schedule(step)
        batch = next(batch_iter)
        optimizer.zero_grad(set_to_none=True)
        record = dict(step_fn(module, batch, backward))
        if cfg.max_grad_norm:
            if accelerator is None:
                torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm)
            else:
                accelerator.clip_grad_norm_(module.parameters(), cfg.max_grad_norm)
        record["lr"] = optimizer.param_groups[0]["lr"]
        optimizer.step()
        history.append(record)
        stop = bool(on_step(step, record)) if on_step is not None else False
        if is_main and (step % cfg.log_every == 0 or step == cfg.steps - 1 or stop):
            log(format_step(step, record))
        if stop:
            break
    wall, cpu = time.perf_counter() - start, time.process_time() - start_cpu
    unwrapped = accelerator.unwrap_model(module) if accelerator is not None else module
    return FitResult(history, wall, cpu, unwrapped, accelerator, is_main, module)


# --------------------------------------------------------------------------- measurement


def measure_speculation(
    lm,  # the AR model (verifier), e.g. OrthrusModel.lm
    drafter,  # a diffspec.spec_workers.reference.decoder.Drafter, e.g. BlockDrafter(model)
    prompts: list[list[int]],
    num_draft_tokens: int,
    *,
    max_tokens: int = 64,
    stop_token_ids: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Greedy speculative decoding of ``prompts`` with the reference decoder, and the same
    requests with plain AR: TPF (generated tokens / forwards, a draft + verify cycle
    counting two), mean tokens emitted per cycle, mean accepted drafts per cycle, and
    whether every output equals AR token for token."""
    import torch

    from diffspec.spec_workers.reference.decoder import Request, ar_generate, speculative_generate

    if stop_token_ids is None:
        eos = getattr(lm.generation_config, "eos_token_id", None)
        stop_token_ids = tuple(eos if isinstance(eos, (list, tuple)) else [eos] if eos else [])
    requests = [Request(p, max_tokens=max_tokens, stop_token_ids=stop_token_ids)
                for p in prompts]
    with torch.inference_mode():
        spec = speculative_generate(lm, drafter, requests, num_draft_tokens)
        ar = ar_generate(lm, requests)
    tokens = sum(len(o.token_ids) for o in spec)
    forwards = sum(o.num_forwards for o in spec)
    cycles = sum(len(o.accept_lengths) for o in spec)
    return {
        "tpf": round(tokens / max(1, forwards), 3),
        "mean_accept_length": round(tokens / max(1, cycles), 3),
        "mean_accepted_drafts": round(sum(o.num_accepted_tokens for o in spec) / max(1, cycles),
                                      3),
        "tokens": tokens,
        "forwards": forwards,
        "equal_ar": all(a.token_ids == s.token_ids for a, s in zip(ar, spec, strict=True)),
    }


def rank_arg(text: str) -> int | str:
    """``--rank``: a positive integer, or ``full`` (dense deltas)."""
    if text == "full":
        return text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        import argparse

        raise argparse.ArgumentTypeError(f"expected a positive integer or 'full', got {text!r}")
    return value


def cpu_bf16_is_fast() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX512-BF16 or AMX). Only there does CPU
    bf16 autocast pay; elsewhere oneDNN emulates it: measured 2026-11-28 on a 2-core Intel
    Xeon with AVX512 but no AVX512-BF16, an Orthrus row took ~3x the CPU time with
    ``--autocast-bf16`` than in fp32."""
    import torch

    cpu = torch.cpu
    return bool(getattr(cpu, "_is_avx512_bf16_supported", lambda: False)()
                or getattr(cpu, "_is_amx_tile_supported", lambda: False)())


def warn_slow_autocast(autocast_bf16: bool, device: str,
                       log: Callable[[str], None]) -> None:
    """One log line when ``--autocast-bf16`` is asked for on a CPU that emulates bf16."""
    if autocast_bf16 and str(device).startswith("cpu") and not cpu_bf16_is_fast():
        log("warning: --autocast-bf16 on a CPU without AVX512-BF16 or AMX is emulated and "
            "several times slower than fp32 here; drop it (benchmarks/smollm2_drafters.sh "
            "sets it only where the CPU has them)")
