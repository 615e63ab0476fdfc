"""Count the model forwards an SGLang engine runs, in its scheduler process (measurement
instrumentation for the engine tier and the benchmark worker; never installed by the plugin).

SGLang starts its scheduler with the ``spawn`` method, so a script that wants the counts sets
:data:`FORWARD_COUNT_ENV` to a folder before it creates ``sglang.Engine`` and calls
:func:`install_forward_counter` when it is imported as ``__mp_main__`` (what a spawned child
does with its parent's main script). Each process then rewrites ``<folder>/<pid>.json``
after every forward, before the forward's results are used, and :func:`forward_counts`
sums them: ``{"DLLM_EXTEND": 12, "EMBED": 12, "tokens:DLLM_EXTEND": 410}``
(``ModelRunner.forward`` by forward mode; ``EMBED``: every pass through the token embedding,
however it was started; ``tokens:MODE``: the ``input_ids`` those forwards processed).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

__all__ = ["FORWARD_COUNT_ENV", "forward_counts", "install_forward_counter"]

FORWARD_COUNT_ENV = "DIFFSPEC_FORWARD_COUNT_DIR"


def install_forward_counter(folder: str) -> None:
    """Count this process's ``ModelRunner.forward`` calls by forward mode (and the tokens
    they processed, as ``tokens:MODE``), and its token embedding calls as ``EMBED``, into
    ``folder/<pid>.json``."""
    from sglang.srt.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from sglang.srt.model_executor.model_runner import ModelRunner

    counts: dict[str, int] = {}
    target = Path(folder) / f"{os.getpid()}.json"

    def record(key: str) -> None:
        counts[key] = counts.get(key, 0) + 1
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(counts))
        tmp.replace(target)

    forward, embed = ModelRunner.forward, VocabParallelEmbedding.forward

    def counted_forward(self, forward_batch, *args, **kwargs):
        mode = forward_batch.forward_mode.name
        tokens = forward_batch.input_ids.numel()
        out = forward(self, forward_batch, *args, **kwargs)
        counts[f"tokens:{mode}"] = counts.get(f"tokens:{mode}", 0) + tokens
        record(mode)
        return out

    def counted_embed(self, input_):
        record("EMBED")
        return embed(self, input_)

    ModelRunner.forward = counted_forward
    VocabParallelEmbedding.forward = counted_embed


def forward_counts(folder: str) -> dict[str, int]:
    """The counts of every process that wrote into ``folder``, summed."""
    total: dict[str, int] = {}
    for path in Path(folder).glob("*.json"):
        for mode, count in json.loads(path.read_text()).items():
            total[mode] = total.get(mode, 0) + count
    return total
