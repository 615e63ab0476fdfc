"""Patch: the property ``vllm.config.vllm.VllmConfig.num_lookahead_tokens``.

Why: the diffusion view drafts the block ``[anchor, <mask> x n]`` in the very KV slots the
next verify pass will write (positions ``p .. p + n``, ``p`` = the anchor), attending
non-causally over the AR cache of the prefix and the block. After a verify step that
accepted every draft, that block ends ``n + 1`` positions past the tokens the step was
scheduled for, so those slots must be allocated one step early. vLLM sizes that margin in
this one property ("consumers must read this property"), which knows its built-in
drafters only (DFlash asks for the same ``n + 1``); the custom_class hook gets 0.

How: wrap the property's getter: ``num_speculative_tokens + 1`` for a diffspec
self-speculative config, vLLM's own answer otherwise. The scheduler passes it to
``KVCacheManager.allocate_slots(num_lookahead_tokens=...)``, which never hashes (prefix
caches) a block past the committed tokens, so no shared or cached block ever holds
draft K/V.
"""

from __future__ import annotations

from diffspec.plugin.engine_sources import Target
from diffspec.plugin.vllm.patches import is_applied, mark

__all__ = ["TARGETS", "apply"]

TARGETS = (
    Target("vllm.config.vllm", "VllmConfig.num_lookahead_tokens", ("self",), is_property=True,
           relies_on=(("vllm.v1.core.sched.scheduler:Scheduler.__init__",
                       "self.num_lookahead_tokens = vllm_config.num_lookahead_tokens"),)),
)


def apply() -> None:
    from vllm.config.vllm import VllmConfig

    from diffspec.plugin.vllm.config import is_self_spec_proposer

    original = VllmConfig.num_lookahead_tokens
    if is_applied(original.fget):
        return

    def num_lookahead_tokens(self) -> int:
        spec = self.speculative_config
        if is_self_spec_proposer(spec):
            return spec.num_speculative_tokens + 1
        return original.fget(self)

    num_lookahead_tokens.__doc__ = original.__doc__
    VllmConfig.num_lookahead_tokens = property(mark(num_lookahead_tokens, __name__))
