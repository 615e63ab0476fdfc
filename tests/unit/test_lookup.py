"""Prompt lookup (:mod:`diffspec.core.lookup`): the vectorised n-gram matcher against a
brute-force one, named cases (ties, no match, shortest / longest n, a match at the very
end, a batch), the config option, and the hybrid reference drafter."""

from __future__ import annotations

import random

import pytest
import torch

from diffspec.core.lookup import (
    LookupStats,
    PromptLookup,
    lookup_drafts,
    ngram_lookup,
    prompt_lookup_settings,
)


def brute_force(context: list[int], k: int, settings: PromptLookup) -> list[int]:
    """The rule, written plainly: the longest n in max .. min whose suffix occurs earlier
    with a token after it; of its occurrences the most recent with k tokens after it,
    else the earliest."""
    length = len(context)
    if k <= 0:
        return []
    for n in range(settings.max, settings.min - 1, -1):
        if n > length - 1:
            continue
        suffix = context[length - n:]
        starts = [s for s in range(0, length - n) if context[s:s + n] == suffix]
        if not starts:
            continue
        full = [s for s in starts if length - (s + n) >= k]
        s = max(full) if full else min(starts)
        return context[s + n:s + n + k]
    return []


def one(context: list[int], k: int, settings: PromptLookup = PromptLookup()) -> list[int]:
    return lookup_drafts([context], [k], settings)[0]


# ------------------------------------------------------------------ named cases


def test_no_match() -> None:
    assert one([1, 2, 3, 4, 5], 4) == []
    assert one([7], 4) == []  # nothing before the anchor
    assert one([7, 7], 4, PromptLookup(min=2)) == []  # a 1-gram repeat, 2-grams asked


def test_continuation_of_the_match() -> None:
    #           0  1  2  3  4  5  6  7  8
    context = [5, 6, 7, 8, 9, 1, 5, 6, 7]
    assert one(context, 3) == [8, 9, 1]
    assert one(context, 10) == [8, 9, 1, 5, 6, 7]  # up to the context's end
    assert one(context, 0) == []


def test_shortest_n() -> None:
    context = [1, 2, 9, 9, 3, 2]  # only the 1-gram "2" recurs
    assert one(context, 2, PromptLookup(min=1, max=4)) == [9, 9]
    assert one(context, 2, PromptLookup(min=2, max=4)) == []


def test_longest_n_wins_over_recency() -> None:
    #           0  1  2  3  4  5  6  7  8  9
    context = [1, 2, 3, 40, 9, 2, 3, 50, 1, 2, 3]
    # "2 3" last occurred at 5..6 (then 50), but "1 2 3" at 0..2 (then 40) is longer
    assert one(context, 1) == [40]
    assert one(context, 1, PromptLookup(min=2, max=2)) == [50]


def test_ties_take_the_most_recent_full_continuation() -> None:
    context = [1, 2, 10, 11, 1, 2, 20, 21, 1, 2]
    assert one(context, 2) == [20, 21]
    # no occurrence is followed by 8 tokens: the one with the most after it (the earliest)
    assert one(context, 8) == [10, 11, 1, 2, 20, 21, 1, 2]


def test_match_at_the_very_end() -> None:
    # the previous occurrence overlaps the suffix and ends just before the anchor
    assert one([4, 4, 4], 3, PromptLookup(min=1, max=4)) == [4]  # "4 4" at 0..1, then 4
    assert one([8, 3, 3], 2, PromptLookup(min=1, max=1)) == [3]
    # a period-2 loop: "1 2 1 2" has one earlier occurrence, 2 tokens before the end;
    # "1 2" has two, and the earlier one is followed by 4
    assert one([1, 2, 1, 2, 1, 2], 4) == [1, 2]
    assert one([1, 2, 1, 2, 1, 2], 4, PromptLookup(min=2, max=2)) == [1, 2, 1, 2]


def test_batch_of_mixed_lengths_and_counts() -> None:
    contexts = [[1, 2, 3, 1, 2], [9], [5, 6, 5, 6, 5, 6, 7, 5, 6], [3, 3, 3, 3]]
    counts = [4, 3, 2, 0]
    assert lookup_drafts(contexts, counts) == [[3, 1, 2], [], [7, 5], []]
    tokens = torch.full((4, 9), -1)
    for b, c in enumerate(contexts):
        tokens[b, :len(c)] = torch.tensor(c)
    drafts, n = ngram_lookup(tokens, torch.tensor([5, 1, 9, 4]), torch.tensor(counts))
    assert n.tolist() == [3, 0, 2, 0]
    assert drafts.tolist() == [[3, 1, 2, -1], [-1] * 4, [7, 5, -1, -1], [-1] * 4]


def test_padding_never_matches() -> None:
    """Whatever sits past a row's length (an engine's stale buffer) is not context."""
    tokens = torch.tensor([[4, 5, 6, 4, 5, 6, 4, 5]])
    drafts, n = ngram_lookup(tokens, torch.tensor([3]), torch.tensor([4]))
    assert n.tolist() == [0]


@pytest.mark.parametrize("seed", range(6))
def test_matches_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    settings = PromptLookup(min=rng.randint(1, 3), max=rng.randint(3, 5))
    contexts = [[rng.randint(0, 5) for _ in range(rng.randint(1, 60))] for _ in range(40)]
    ks = [rng.randint(0, 9) for _ in contexts]
    got = lookup_drafts(contexts, ks, settings)
    assert got == [brute_force(c, k, settings) for c, k in zip(contexts, ks)]


# ------------------------------------------------------------------ the option


def test_settings() -> None:
    assert prompt_lookup_settings(None, "orthrus") == PromptLookup(2, 4)
    assert prompt_lookup_settings(None, "orthrus", default=False) is None
    assert prompt_lookup_settings(True, "linear_self_spec") == PromptLookup()
    assert prompt_lookup_settings({"min": 1, "max": 3}, "orthrus") == PromptLookup(1, 3)
    assert prompt_lookup_settings({"max": 6}, "orthrus") == PromptLookup(2, 6)
    assert prompt_lookup_settings(False, "orthrus") is None
    assert prompt_lookup_settings(None, "tidar") is None
    assert prompt_lookup_settings(False, "tidar") is None


@pytest.mark.parametrize(("value", "method", "match"), [
    ({"min": 3, "max": 2}, "orthrus", r"^set prompt_lookup min <= max"),
    ({"min": 0}, "orthrus", r"^set prompt_lookup min to an int >= 1"),
    ({"n": 2}, "orthrus", r"^remove 'n' from \"prompt_lookup\""),
    ("yes", "orthrus", r"^set \"prompt_lookup\" to true, false or"),
    (True, "tidar", r"^remove \"prompt_lookup\" .*for method 'tidar'"),
])
def test_settings_errors(value, method: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        prompt_lookup_settings(value, method)


def test_stats() -> None:
    stats = LookupStats()
    assert stats.record([3, 2], 1)  # a log line at drafting steps 1, 2, 4, 8 ...
    assert stats.record([4], 0)
    assert not stats.record([], 0)  # no draft at all: not a drafting step
    assert [stats.record([], 1) for _ in range(6)] == [False, True, False, False, False, True]
    stats = LookupStats()
    stats.record([3, 2], 1)
    stats.record([4], 0)
    assert (stats.lookup_blocks, stats.lookup_tokens, stats.diffusion_blocks, stats.steps,
            stats.forwards_skipped) == (3, 9, 1, 2, 1)
    assert stats.summary() == ("4 draft blocks (1 by the draft pass, 3 by prompt lookup (9 "
                               "tokens)); 1 of 2 drafting steps ran no draft forward")
    off = LookupStats()  # lookup off: the line names only the sources that drafted
    off.record([], 2)
    assert off.summary() == ("2 draft blocks (2 by the draft pass); 0 of 1 drafting steps ran "
                             "no draft forward")


# ------------------------------------------------------------------ with the adaptive policy


def _policy(draft: float, lookup: float, profile=None):
    """An :class:`AdaptiveDrafts` whose estimates say ``draft`` / ``lookup`` for every
    position (well measured: a prior of 1000 pseudo-trials)."""
    from diffspec.core.adaptive import AdaptiveDrafts, LatencyProfile, StepCost

    # 10 ms a forward, 0.1 ms a query token: a draft pass doubles a step's price
    policy = AdaptiveDrafts(8, profile or LatencyProfile({1: 0.010, 1001: 0.110}),
                            StepCost("two_pass"))
    for source, a in (("draft", draft), ("lookup", lookup)):
        estimate = policy.estimates[source]
        estimate.trials = [1000.0] * 8
        estimate.successes = [1000.0 * a] * 8
    return policy


def test_lookup_steps_cost_only_their_verify() -> None:
    from diffspec.core.adaptive import LatencyProfile, StepCost

    profile, cost = LatencyProfile({1: 0.001, 1000: 1.0}), StepCost("two_pass")
    assert cost.latency(profile, [4, 4]) == pytest.approx(0.020)  # draft 10 + verify 10
    assert cost.latency(profile, [4, 4], [True, False]) == pytest.approx(0.015)
    assert cost.latency(profile, [4, 4], [True, True]) == pytest.approx(0.010)
    assert cost.latency(profile, [0, 0], [True, True]) == pytest.approx(0.002)  # plain AR


def test_the_estimates_pick_the_source() -> None:
    """Lookup where its drafts promise more tokens per second (its estimate is high, it
    needs no draft pass) and the request has a match; the drafter elsewhere."""
    policy = _policy(draft=0.3, lookup=0.95)
    counts, lookup = policy.choose_hybrid(["a", "b", "c"], [8, 8, 8], [5, 0, 2])
    assert lookup == [True, False, True]
    assert counts == [5, 0, 2]  # what lookup found; b's poor drafts do not pay
    assert policy.sources == {"a": "lookup", "b": "draft", "c": "lookup"}
    policy = _policy(draft=0.95, lookup=0.2)
    counts, lookup = policy.choose_hybrid(["a", "b"], [8, 8], [5, 0])
    assert lookup == [False, False] and counts[0] > 0


def test_outcomes_update_their_source_estimate() -> None:
    policy = _policy(draft=0.5, lookup=0.5)
    policy.choose_hybrid(["a", "b"], [8, 8], [4, 0])  # a: lookup, b: the drafter (0.5)
    assert policy.sources["a"] == "lookup"
    policy.observe("a", 5)  # 4 lookup drafts accepted + the bonus token
    assert policy.estimates["lookup"].conditional[0] > 0.5
    assert policy.estimates["draft"].conditional[0] == pytest.approx(0.5)  # untouched
    assert "a" not in policy.sources and "a" not in policy.proposed


def test_shared_count_with_lookup() -> None:
    from diffspec.core.adaptive import LatencyProfile

    free = LatencyProfile({1: 0.01, 4096: 0.01})  # extra tokens cost nothing
    policy = _policy(draft=0.9, lookup=0.9, profile=free)
    k, lookup, counts = policy.choose_shared_hybrid(["a", "b"], [8, 8], [3, 0])
    assert lookup == [True, False] and k == 8 and counts == [3, 8]
    assert policy.proposed == {"a": 3, "b": 8}  # a: all it found


def test_sglang_options_are_checked_with_the_server_arguments() -> None:
    """SGLang reads diffspec's options from ``--json-model-override-args``; a prompt
    lookup the worker would refuse is refused with the server arguments."""
    from types import SimpleNamespace

    from diffspec.core.checkpoint import CheckpointError
    from diffspec.plugin.sglang.config import _validate_diffspec_options, diffspec_options

    def args(value):
        return SimpleNamespace(json_model_override_args=value)

    assert diffspec_options(args(None)) == {}
    assert diffspec_options(args('{"diffspec": {"prompt_lookup": false}}')) == {
        "prompt_lookup": False}
    _validate_diffspec_options(args('{"diffspec": {"prompt_lookup": {"max": 3}}}'), "orthrus")
    _validate_diffspec_options(args(None), "tidar")  # off by default there
    with pytest.raises(CheckpointError, match=r"^remove \"prompt_lookup\" .*'tidar'"):
        _validate_diffspec_options(args('{"diffspec": {"prompt_lookup": true}}'), "tidar")
    with pytest.raises(CheckpointError, match=r"^set \"prompt_lookup\" to true, false or"):
        _validate_diffspec_options(args('{"diffspec": {"prompt_lookup": 3}}'), "orthrus")
    with pytest.raises(CheckpointError, match=r"^make \"diffspec\" in "):
        diffspec_options(args('{"diffspec": 1}'))
