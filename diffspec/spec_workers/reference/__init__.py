"""The reference decoder: every method's decoding loop on transformers models, engine-free.

It is the oracle every engine path is checked against. :func:`load_decoder` builds a
:class:`Decoder` for any method of the registry (:data:`diffspec.methods.METHODS`) from a
local checkpoint: it checks the checkpoint can serve the method, merges the method's
defaults with the caller's options and calls the method's factory (``decoder(info,
options)`` in ``spec_workers/reference/<method>.py``; ``ar`` / ``ngram`` in
:mod:`.decoder`). The CLI and the benchmarks use it; importing this package imports no
torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["Decoder", "load_decoder"]


@dataclass
class Decoder:
    """A loaded checkpoint ready to decode with one method."""

    method: str
    tokenizer: Any
    decode: Callable[[list[Any]], list[Any]]  # [Request] -> [RequestOutput]
    stop_token_ids: tuple[int, ...]
    max_len: int  # context length (positions)
    vocab_size: int
    options: Mapping[str, Any]  # the settings it decodes with (defaults resolved)


def load_decoder(method: str, path: str | Path, **options: Any) -> Decoder:
    """Load ``path`` for ``method`` with the registry's defaults overridden by ``options``
    (``num_draft_tokens``, ``threshold``, ``cache``, ``slot_size`` ...; ``None`` keeps the
    default; ``dtype``, a torch dtype, applies to every method: float32 by default). Raises ``ValueError`` (:class:`~diffspec.core.checkpoint.CheckpointError`
    for the checkpoint) naming the problem; never touches the network."""
    from diffspec.core.checkpoint import CheckpointError, inspect_checkpoint
    from diffspec.methods import get_method, load_object

    spec = get_method(method)
    if spec.reference is None:
        raise ValueError(f"method {method!r} is the engines' own ({spec.summary}); the "
                         f"reference decoder does not run it")
    unknown = sorted(k for k, v in options.items()
                     if v is not None and k not in spec.defaults and k != "dtype")
    if unknown:
        raise ValueError(f"method {method!r} takes no option {', '.join(unknown)} "
                         f"(its options: {', '.join(spec.defaults) or 'none'})")
    merged = {**spec.defaults, **{k: v for k, v in options.items() if v is not None}}
    if not (Path(path) / "config.json").is_file():
        raise CheckpointError(f"model path {str(path)!r} is not a local checkpoint folder "
                              f"(no config.json there)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # config-class warnings for model types it does not know
    try:
        info = inspect_checkpoint(path)
        return load_object(spec.reference)(info, merged)
    finally:
        hf_logging.set_verbosity(verbosity)
