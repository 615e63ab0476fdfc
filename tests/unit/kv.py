"""A transformers KV cache holding a prefix: what the unit suites prefill before a draft or
verify step (the reference decoder's own prefill is ``start_request``)."""

import torch


def prefilled_cache(lm, ids: list[int]):
    """A ``DynamicCache`` of ``lm`` (a transformers causal LM) after one forward over ``ids``
    (empty when ``ids`` is)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=lm.config)
    if ids:
        with torch.no_grad():
            lm(input_ids=torch.tensor([ids]), past_key_values=cache, use_cache=True)
    return cache
