"""SGLang's drafting policy from the model config's ``diffspec`` options: the adaptive
draft-count policy and prompt lookup (engine-free: no SGLang import, so the unit tier
checks it; the workers in :mod:`~diffspec.spec_workers.sglang.target_worker` use it)."""

from __future__ import annotations

import logging

__all__ = ["adaptive_policy", "prompt_lookup"]

logger = logging.getLogger("diffspec")


def adaptive_policy(hf_config, max_drafts: int, cost: str, method: str = "orthrus",
                    track_step_times: bool = False, deterministic: bool = False):
    """The adaptive draft-count policy, on by default: ``None`` (``max_drafts`` every step)
    only when the model config carries ``diffspec: {"adaptive": false}`` (SGLang's
    ``--json-model-override-args``; SGLang has no flag of ours). With ``"latency_profile":
    PATH`` the policy prices steps from that profile; otherwise it has none yet, and the
    worker measures one at start-up (:meth:`TargetModelSpecWorker.init_cuda_graphs`), and
    with ``track_step_times`` (one tensor-parallel rank: wall times differ between ranks,
    which must choose alike) prices steps through the online fit of measured step times
    and checks them with the rate guard, as vLLM's drafters do. Its acceptance estimate
    starts from the checkpoint's measured acceptance where config.json has one
    (:func:`~diffspec.core.adaptive.checkpoint_prior`). Under SGLang's
    ``--enable-deterministic-inference`` (``deterministic``: the one mode in which SGLang
    honours a request's seed) it is off, with a log line: one draft count per step for
    the whole batch cannot follow a seeded request's own history, and a count that moved
    with the clock or the other requests would change its samples.
    SGLang's verify has one width per step, so steps are priced padded
    (:attr:`~diffspec.core.adaptive.StepCost.padded`). ``"carry"``: over-drafting for
    carried drafts (:func:`~diffspec.core.carry.carry_setting`)."""
    import json
    from pathlib import Path

    from diffspec.core.adaptive import (
        AdaptiveDrafts,
        StepCost,
        checkpoint_prior,
        load_latency_profile,
    )

    options = getattr(hf_config, "diffspec", None) or {}
    if not isinstance(options, dict):
        options = {}
    adaptive = options.get("adaptive", True)
    path = options.get("latency_profile")
    if adaptive is False and path:
        raise ValueError("remove \"latency_profile\" or the \"adaptive\": false from "
                         "--json-model-override-args '{\"diffspec\": {...}}': a latency "
                         "profile prices the adaptive policy's steps, and \"adaptive\": false "
                         "drafts --speculative-num-draft-tokens - 1 every step")
    if adaptive is False:
        return None
    if deterministic:
        logger.info("diffspec: --enable-deterministic-inference: adaptive drafts off, %d "
                    "drafts every step, so that a seeded request's samples do not depend on "
                    "timing or on the other requests", max_drafts)
        return None
    from diffspec.core.carry import carry_setting

    carry = carry_setting(options.get("carry"), method, True)
    prior = checkpoint_prior(hf_config)
    cost = StepCost(cost, padded=cost == "two_pass")
    if prior:
        logger.info("diffspec: adaptive drafts start from the checkpoint's measured acceptance "
                    "(drafts 1-4: %s)", ", ".join(f"{a:.2f}" for a in prior[:4]))
    if not path:  # measured by the worker once SGLang has built its pools and backends
        return AdaptiveDrafts(max_drafts, None, cost, draft_prior=prior,
                              track_step_times=track_step_times, carry=carry)
    try:
        profile = load_latency_profile(json.loads(Path(path).expanduser().read_text()))
    except (OSError, ValueError) as exc:
        raise ValueError(f"point latency_profile at a forward-latency profile (python -m "
                         f"benchmarks sweep --profile-only --engines sglang --model "
                         f"CKPT --method {method} --out DIR writes one), or leave it out: the "
                         f"worker measures one at start-up; {path!r} cannot be read as "
                         f"one: {exc}") from exc
    logger.info("diffspec: adaptive draft counts (at most %d per step) from the latency "
                "profile %s", max_drafts, path)
    return AdaptiveDrafts(max_drafts, profile, cost, draft_prior=prior, carry=carry)


def prompt_lookup(hf_config, method: str):
    """The prompt-lookup settings (:class:`~diffspec.core.lookup.PromptLookup`) of the
    model config's ``diffspec`` options (``--json-model-override-args '{"diffspec":
    {"prompt_lookup": {"min": 2, "max": 4}}}'``, or ``false``), or ``None``: off. On by
    default, unless the options say ``"adaptive": false`` (the drafter alone at a fixed
    width); never for TIDAR (checked with the server arguments:
    :func:`~diffspec.plugin.sglang.config.validate_server_args`)."""
    from diffspec.core.lookup import prompt_lookup_settings

    options = getattr(hf_config, "diffspec", None) or {}
    if not isinstance(options, dict):
        options = {}
    settings = prompt_lookup_settings(options.get("prompt_lookup"), method,
                                      default=options.get("adaptive") is not False)
    if settings is not None:
        logger.info("diffspec: %s drafts by prompt lookup (n-grams of %d..%d tokens) where "
                    "the context holds a match, by its diffusion view elsewhere",
                    method.upper(), settings.min, settings.max)
    return settings
