"""Strict checkpoint loading for the reference executors.

transformers' ``from_pretrained`` fills tensors a checkpoint lacks with random values and
only logs it; an oracle must not decode with half-random weights, so every reference
loader goes through :func:`from_pretrained_strict`, which raises a
:class:`~diffspec.core.checkpoint.CheckpointError` naming what is missing or mis-shaped.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from diffspec.core.checkpoint import CheckpointError


def from_pretrained_strict(model_cls: Any, path: str | Path, **kwargs: Any) -> Any:
    """``model_cls.from_pretrained(path, **kwargs)``, refusing missing or mis-shaped tensors
    (an LM head tied to the embeddings is not missing). Errors name tensors as the checkpoint
    does: a ``key_mapping`` (published -> transformers name) is undone. Returns the model in
    eval mode."""
    model, loading = model_cls.from_pretrained(str(path), output_loading_info=True, **kwargs)
    tied = {"lm_head.weight"} if getattr(model.config, "tie_word_embeddings", False) else set()
    missing = sorted(set(loading.get("missing_keys", ())) - tied)
    for published, internal in (kwargs.get("key_mapping") or {}).items():
        # a prefix mapping such as r"^encoder\." -> "model.": map "model.x" back to "encoder.x"
        prefix = published.lstrip("^").replace("\\", "")
        missing = [re.sub("^" + re.escape(internal), prefix, name) for name in missing]
    mismatched = list(loading.get("mismatched_keys", ()))
    if missing:
        raise CheckpointError(
            f"checkpoint {path} lacks {len(missing)} tensor(s) the "
            f"{type(model).__name__} needs, e.g. {missing[0]!r}; it is incomplete or "
            f"not this architecture"
        )
    if mismatched:
        raise CheckpointError(f"checkpoint {path} has tensors of the wrong shape: "
                              f"{mismatched[0]}")
    return model.eval()
