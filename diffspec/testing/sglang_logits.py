"""Measure the vocabulary-wide tensors diffspec's SGLang workers allocate per decode step, in
the scheduler process (measurement instrumentation for the engine tier; never installed by
the plugin): issue 29, row 8, "a long batch on CPU shows it".

As :mod:`diffspec.testing.sglang_forwards`: a script sets :data:`LOGITS_METER_ENV` to
``FOLDER:ROWS`` before it creates ``sglang.Engine`` and calls :func:`install_logits_meter`
when it is imported as ``__mp_main__`` (SGLang's spawned scheduler). The meter sets
:data:`diffspec.model_executors.sglang.views.LOGITS_ROWS` to ``ROWS`` (the chunk, small, so
that a test batch spans many chunks) and runs every decode step of a diffspec worker
(``TargetModelSpecWorker.forward_batch_generation`` on a decode batch) under a
``TorchDispatchMode`` that sees every tensor an operator returns. It records, over the steps,
the largest storage (bytes) of a tensor whose last dimension is the config's vocabulary
(a slice of the LM head's padded output counts whole: its storage; a width equal to the
padded vocabulary alone is not counted, another layer may have it) and the most tokens one
forward of a step embedded
(``aten.embedding``: the step's rows) and the most requests one step held, into
``FOLDER/<pid>.json``; :func:`logits_meter`
reads them. Whole logits of a step would be ``rows x vocab x 4`` bytes; chunked, at most
``max(ROWS, one request's verify rows) x vocab x 4``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["LOGITS_METER_ENV", "install_logits_meter", "logits_meter"]

LOGITS_METER_ENV = "DIFFSPEC_LOGITS_METER"


def install_logits_meter(spec: str) -> None:
    """``spec``: ``FOLDER:ROWS`` (see the module docstring)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    from diffspec.model_executors.sglang import views
    from diffspec.spec_workers.sglang.target_worker import TargetModelSpecWorker

    folder, rows = spec.rsplit(":", 1)
    views.LOGITS_ROWS = int(rows)
    target = Path(folder) / f"{os.getpid()}.json"
    record = {"logits_rows": int(rows), "steps": 0, "largest_vocab_bytes": 0,
              "most_step_tokens": 0, "most_step_requests": 0, "vocab": None, "padded_vocab": None,
              "largest_op": None}

    class Meter(TorchDispatchMode):
        def __init__(self, widths: set[int]) -> None:
            super().__init__()
            self.widths = widths

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func is torch.ops.aten.embedding.default:
                record["most_step_tokens"] = max(record["most_step_tokens"], args[1].numel())
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor) and t.ndim and t.shape[-1] in self.widths:
                    size = t.untyped_storage().nbytes()
                    if size > record["largest_vocab_bytes"]:
                        record["largest_vocab_bytes"] = size
                        record["largest_op"] = f"{func} -> {tuple(t.shape)} {t.dtype}"
            return out

    original = TargetModelSpecWorker.forward_batch_generation

    def metered(self, batch, on_publish=None, **kwargs):
        if not batch.forward_mode.is_decode():
            return original(self, batch, on_publish, **kwargs)
        model = self.model_runner.model
        record["vocab"] = int(model.config.vocab_size)
        record["padded_vocab"] = int(model.lm_head.weight.shape[0])
        with Meter({record["vocab"]}):
            out = original(self, batch, on_publish, **kwargs)
        record["steps"] += 1
        record["most_step_requests"] = max(record["most_step_requests"], len(batch.reqs))
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(record))
        tmp.replace(target)
        return out

    TargetModelSpecWorker.forward_batch_generation = metered


def logits_meter(folder: str) -> dict:
    """The records of the processes that wrote into ``folder``, merged (maxima; steps
    summed); ``{}`` when none did."""
    merged: dict = {}
    for path in Path(folder).glob("*.json"):
        rec = json.loads(path.read_text())
        if not merged:
            merged = rec
            continue
        merged["steps"] += rec["steps"]
        if rec["largest_vocab_bytes"] > merged["largest_vocab_bytes"]:
            merged["largest_vocab_bytes"], merged["largest_op"] = (
                rec["largest_vocab_bytes"], rec["largest_op"])
        for key in ("most_step_tokens", "most_step_requests"):
            merged[key] = max(merged[key], rec[key])
    return merged
