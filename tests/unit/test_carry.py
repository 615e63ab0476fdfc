"""Carried drafts (issue 47 item 4): the tail of an over-drafted block after a fully
accepted step, the policy's choice to over-draft, and its pricing."""

from __future__ import annotations

import pytest

from diffspec.core.adaptive import AdaptiveDrafts, LatencyProfile, StepCost
from diffspec.core.carry import CarriedDrafts, carried_tail

pytestmark = pytest.mark.unit


def test_the_tail_after_a_fully_accepted_step_whose_bonus_is_the_blocks_draft() -> None:
    block = [11, 12, 13, 14, 15, 16, 17]
    assert carried_tail(block, 3, [11, 12, 13, 14]) == [15, 16, 17]
    assert carried_tail(block, 3, [11, 12, 13, 99]) == []  # the bonus is not draft 4
    assert carried_tail(block, 3, [11, 12, 40]) == []  # draft 3 rejected
    assert carried_tail(block, 5, [11, 12, 13, 14, 15, 16]) == [17]
    assert carried_tail(block, 6, [11, 12, 13, 14, 15, 16, 17]) == []  # nothing past it
    assert carried_tail(block, 0, [11]) == [12, 13, 14, 15, 16, 17]


def test_carried_drafts_are_taken_once_at_the_right_position_within_the_limit() -> None:
    carried = CarriedDrafts()
    carried.keep("a", start=20, verified=2, block=[1, 2, 3, 4, 5, 6])
    carried.keep("b", start=30, verified=2, block=[1, 2, 3, 4, 5, 6])
    carried.keep("c", start=40, verified=5, block=[1, 2, 3, 4, 5, 6])  # nothing to carry
    assert carried.take("a", 23, 2, emitted=[1, 2, 3]) == [4, 5]
    assert carried.take("a", 23, 2, emitted=[1, 2, 3]) == []  # consumed
    assert carried.take("b", 34, 7, emitted=[1, 2, 3]) == []  # the request moved on
    assert carried.take("c", 46, 7, emitted=[1, 2, 3, 4, 5, 6]) == []
    carried.keep("d", start=0, verified=1, block=[7, 8, 9])
    carried.forget(["a"])
    assert carried.take("d", 2, 3, emitted=[7, 8]) == []
    # settled when the step's outcome is known (SGLang), taken at the next step
    carried.keep("e", start=10, verified=1, block=[7, 8, 9, 10])
    carried.settle("e", [7, 8])
    assert carried.take("e", 11, 5) == []  # not where the request's anchor is
    carried.keep("e", start=10, verified=1, block=[7, 8, 9, 10])
    carried.settle("e", [7, 8])
    assert carried.take("e", 12, 5) == [9, 10]
    carried.keep("f", start=10, verified=1, block=[7, 8, 9, 10])
    carried.settle("f", [7, 5])  # a different bonus
    assert carried.take("f", 12, 5) == []


def test_a_wider_draft_block_is_priced_as_one() -> None:
    profile = LatencyProfile({1: 1.0, 100: 100.0}, draft_points={1: 1.0, 100: 100.0})
    two_pass = StepCost("two_pass")
    # drafts 2 + 3 verified (7 tokens); the first block drafts 6 (7 + 4 drafted tokens)
    assert two_pass.latency(profile, [2, 3], None, [6, 3]) == pytest.approx(7 + 11)
    assert two_pass.latency(profile, [2, 3], [False, True], [6, 3]) == pytest.approx(7 + 7)
    padded = StepCost("two_pass", padded=True)
    assert padded.latency(profile, [2, 3], None, [6, 3]) == pytest.approx(8 + 14)
    assert two_pass.latency(profile, [2, 3]) == two_pass.latency(profile, [2, 3], None, [2, 3])


def _policy(carry: str, draft_points: dict[int, float], prior: float = 0.9) -> AdaptiveDrafts:
    profile = LatencyProfile({1: 0.050, 8: 0.060, 16: 0.085, 32: 0.145},
                             draft_points=draft_points)
    return AdaptiveDrafts(7, profile, StepCost("two_pass"), draft_prior=[prior] * 7,
                          carry=carry)


def test_over_drafting_where_the_draft_pass_is_flat_and_not_where_each_token_costs() -> None:
    flat = _policy("auto", {1: 0.030, 64: 0.031})
    assert flat.draft_widths(["a"], [3], [False], [7]) == [7]
    steep = _policy("auto", {1: 0.001, 8: 0.400}, prior=0.3)
    assert steep.draft_widths(["a"], [3], [False], [7]) == [3]
    # never for lookup drafts, seeded requests, blocks with nothing past the bonus, or off
    assert flat.draft_widths(["a", "b", "c", "d"], [3, 3, 6, 0], [True, False, False, False],
                             [7, 7, 7, 7], seeded=[False, True, False, False]) == [3, 3, 6, 0]
    assert _policy("off", {1: 0.030, 64: 0.031}).draft_widths(["a"], [3], [False], [7]) == [3]
    assert steep.carry == "auto"
    always = _policy("always", {1: 0.001, 8: 0.400}, prior=0.3)
    assert always.draft_widths(["a", "b"], [3, 2], [False, False], [7, 5]) == [7, 5]
    with pytest.raises(ValueError, match="carry is"):
        _policy("sometimes", {1: 0.030})


def test_carried_drafts_are_estimated_apart_and_cost_no_draft_pass() -> None:
    policy = _policy("auto", {1: 0.030, 64: 0.031})
    counts, free = policy.choose_hybrid(["a"], [7], [4], [0], free_source=["carry"])
    assert free == [True] and counts[0] > 0  # 4 free drafts beat 7 with a draft pass
    assert policy.sources == {"a": "carry"} and policy.ngrams == {"a": 0}
    lookup_before = list(policy.estimates["lookup"].trials)
    carry_before = policy.estimates["carry"].trials[0]
    policy.observe("a", 1)  # the first carried draft rejected
    assert policy.estimates["lookup"].trials == lookup_before
    assert policy.estimates["carry"].trials[0] > carry_before
    assert policy.estimates["carry"].conditional[0] < policy.estimates["lookup"].conditional[0]
    # with a draft pass paid for another request, the drafter's 7 beat 4 carried drafts
    counts, free = policy.choose_hybrid(["a", "b"], [7, 7], [4, 0], [0, 0],
                                        free_source=["carry", "lookup"])
    assert free == [False, False] and policy.sources == {"a": "draft", "b": "draft"}


def test_the_carry_setting_is_checked_with_what_to_do() -> None:
    from diffspec.core.carry import carry_setting

    assert carry_setting(None, "orthrus", True) == "auto"
    assert carry_setting(True, "orthrus", True) == "auto"
    assert carry_setting(False, "linear_self_spec", True) == "off"
    assert carry_setting("always", "orthrus", True) == "always"
    assert carry_setting(None, "TIDAR", True) == "auto"  # the default is fine anywhere
    with pytest.raises(ValueError, match=r'^set "carry" to "auto"'):
        carry_setting(1, "orthrus", True)
    with pytest.raises(ValueError, match=r'^remove "carry": .*tidar pre-drafts'):
        carry_setting("always", "TIDAR", True)
    with pytest.raises(ValueError, match=r'^remove "carry": .*"adaptive": false'):
        carry_setting(False, "orthrus", False)
