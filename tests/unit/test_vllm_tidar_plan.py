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


# ------------------------------------------------------------------ the rows a step forwards


def test_branch_rows_per_request_never_exceed_the_reserved_rows() -> None:
    """vLLM's scheduler reserves ``tidar_branch_rows(K, shift)`` rows per scheduled request
    besides its scheduled tokens (patch ``drafting_rows``): every request's planned
    branches fit in them, whatever its state, and a full decode step fills them; so a
    step's scheduled tokens plus branch rows stay within ``max_num_batched_tokens``, the
    rows vLLM's memory profile forwarded."""
    import itertools

    from diffspec.plugin.vllm.config import tidar_branch_rows

    for k, shift in itertools.product((1, 3, 7, 8), (True, False)):
        reserved, widest = tidar_branch_rows(k, shift), 0
        for n, computed, left, slots, max_len in itertools.product(
                range(k + 1), (0, 20, 500), (None, 2, 3, 9), (32, 64, 1024), (30, 512, 4096)):
            for q in {n + 1, n + 40}:  # a decode step; a prefill's last chunk
                plans = plan_branches([q], [n], [computed], [computed + q - n], [left], [slots],
                                      k, shift, max_len)
                rows = sum((p.num_drafts + 1) * p.num_masks for p in plans)
                assert rows <= reserved, (k, shift, n, computed, left, slots, max_len, q)
                widest = max(widest, rows)
        assert widest == reserved  # the reservation is the bound, not more
    assert tidar_branch_rows(8, True) == 72  # synth-tidar: 9 branches of 8 masks
    assert tidar_branch_rows(7, False) == 64  # NLD block 8: 8 branches of 8 masks


def test_batch_within_the_scheduler_budget_forwards_within_it() -> None:
    """vLLM's rule (``Scheduler.schedule``: each scheduled request takes its tokens plus the
    reserved rows from ``max_num_batched_tokens``) applied to a long batch of decodes and a
    prefill chunk: the forward (scheduled tokens + every branch) is within the budget,
    while the same requests without the reservation would forward more."""
    from diffspec.plugin.vllm.config import tidar_branch_rows

    k, shift, budget = 8, True, 256
    reserved = tidar_branch_rows(k, shift)

    def schedule(draft_slots: int) -> list[int]:
        left, out = budget, []
        for want in [k + 1] * 12 + [300]:  # 12 decodes verifying k drafts, one long prompt
            if left <= draft_slots:
                break
            q = min(want, left - draft_slots)
            out.append(q)
            left -= q + draft_slots
        return out

    def rows_forwarded(scheduled: list[int]) -> int:
        n = len(scheduled)
        spec = [min(q - 1, k) if i < 12 else 0 for i, q in enumerate(scheduled)]
        computed = [100] * n
        tokens = [c + q - s if i < 12 else 1000 for i, (c, q, s)
                  in enumerate(zip(computed, scheduled, spec))]
        plans = plan_branches(scheduled, spec, computed, tokens, [None] * n, [4096] * n, k,
                              shift, 4096)
        return sum(scheduled) + sum((p.num_drafts + 1) * p.num_masks for p in plans)

    assert rows_forwarded(schedule(reserved)) <= budget
    assert rows_forwarded(schedule(0)) > 2 * budget  # what an unreserved step forwards


def test_budget_error_and_drafting_rows() -> None:
    from types import SimpleNamespace

    from diffspec.plugin.vllm.config import budget_error, drafting_rows, proposer_path

    assert budget_error(None, 8, True) is None  # vLLM's default budget: checked at start
    assert budget_error(81, 8, True) is None  # one request's full step: 9 + 72
    message = budget_error(80, 8, True)
    assert message.startswith("raise max_num_batched_tokens (--max-num-batched-tokens) to "
                              "at least 81 (got 80)")
    assert "72 branch rows per request" in message
    assert budget_error(71, 7, False).startswith(
        "raise max_num_batched_tokens (--max-num-batched-tokens) to at least 72")

    def spec(model: str, dlm_type=None) -> SimpleNamespace:
        return SimpleNamespace(method="custom_class", model=model, num_speculative_tokens=7,
                               target_model_config=SimpleNamespace(
                                   hf_config=SimpleNamespace(dlm_type=dlm_type)))

    assert drafting_rows(spec(proposer_path("tidar"))) == 64
    assert drafting_rows(spec(proposer_path("tidar"), "dream")) == 56
    assert drafting_rows(spec(proposer_path("orthrus"))) is None  # vLLM's own answer
    assert drafting_rows(None) is None
