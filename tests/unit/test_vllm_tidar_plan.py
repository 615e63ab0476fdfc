"""The pure planning rules of the vLLM TiDAR drafter: which requests get branches this
step, how many masks each holds, and how many drafts the accepted branch yields. They must
be the reference decoder's rules (:mod:`diffspec.spec_workers.reference.tidar`), or the
engine drafts other blocks than the reference."""

from __future__ import annotations

from diffspec.spec_workers.vllm.tidar import BranchPlan, next_draft_count, plan_branches


def _plan(**overrides):
    args = {"num_scheduled": [4], "num_spec": [3], "num_computed": [20], "num_tokens": [21],
            "num_left": [None], "num_slots": [64], "max_drafts": 8, "logits_shift": True,
            "max_model_len": 512}
    args.update(overrides)
    return plan_branches(**args)


def test_decode_step_branches_after_the_verify_chain() -> None:
    # 20 tokens cached, the anchor (position 20) + 3 drafts scheduled
    assert _plan() == [BranchPlan(row=0, anchor=20, num_drafts=3, num_masks=8)]
    # unshifted drafts: one more mask, on the bonus token's position
    assert _plan(logits_shift=False) == [BranchPlan(0, 20, 3, 9)]


def test_prefill_gets_branch_zero_only_on_its_last_chunk() -> None:
    # a 100-token prompt: a first chunk of 64 samples nothing, the last chunk does
    assert _plan(num_scheduled=[64], num_spec=[0], num_computed=[0], num_tokens=[100]) == []
    assert _plan(num_scheduled=[36], num_spec=[0], num_computed=[64], num_tokens=[100],
                 num_slots=[128]) == [
        BranchPlan(0, 99, 0, 8)]


def test_unscheduled_and_nearly_finished_requests_get_none() -> None:
    assert _plan(num_scheduled=[0]) == []
    assert _plan(num_left=[2]) == []  # emits >= 1 token now, then has 1 left: no draft
    assert _plan(num_left=[3]) == [BranchPlan(0, 20, 3, 8)]


def test_branches_shrink_at_the_context_end_and_the_slots() -> None:
    # reference: K' = min(K, max_len - 1 - (P + n)) with P + n = 23
    assert _plan(max_model_len=30) == [BranchPlan(0, 20, 3, 6)]
    assert _plan(num_slots=[28]) == [BranchPlan(0, 20, 3, 4)]
    assert _plan(max_model_len=25) == [BranchPlan(0, 20, 3, 1)]
    assert _plan(max_model_len=25, logits_shift=False) == []  # its one mask drafts nothing
    assert _plan(max_model_len=24) == []


def test_next_draft_count() -> None:
    plan = BranchPlan(0, 20, 3, 8)
    assert next_draft_count(plan, 25, None, 64, 8, True, 512) == 8
    assert next_draft_count(plan, 25, None, 64, 8, False, 512) == 7  # first mask: bonus
    assert next_draft_count(plan, 25, 4, 64, 8, True, 512) == 3  # max_tokens - 1
    assert next_draft_count(plan, 25, 1, 64, 8, True, 512) == 0
    assert next_draft_count(plan, 25, None, 30, 8, True, 512) == 5  # slots held
    assert next_draft_count(plan, 25, None, 64, 8, True, 27) == 2  # context
    assert next_draft_count(plan, 25, None, 64, 3, True, 512) == 3  # num_speculative_tokens
