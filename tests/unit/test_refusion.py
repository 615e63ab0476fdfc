"""ReFusion slot decoding against brute force, on tiny random checkpoints (fp32).

The oracle (:func:`oracle_generate`) re-derives every step from scratch: no KV cache, one
full forward per plan and per infilled token over the prompt and all committed slots laid
out in original order, with true position ids and an explicit visibility mask that says
what each token's KV saw when the decoder wrote it. At the two token thresholds whose
outcome is known (0: every draft passes, so the plan's drafts are committed as they are;
1: no draft passes, so every slot is infilled purely autoregressively) the decoder, which
reuses KV over reordered non-contiguous positions, must agree token for token.
"""

from __future__ import annotations

import math

import pytest
import torch

from diffspec.core import refusion as refusion_rounds
from diffspec.core.checkpoint import CheckpointError
from diffspec.core.sampling import SamplingParams
from diffspec.core.slots import reorder_for_kv_reuse, score_slots
from diffspec.model_executors.reference.refusion import load_refusion
from diffspec.spec_workers.reference.decoder import Request
from diffspec.spec_workers.reference.refusion import ReFusionConfig, refusion_generate
from diffspec.testing.checkpoints import tiny_checkpoint, write_orthrus, write_qwen3, write_refusion

PROMPT = [10, 11, 12, 13, 14]
SHARPEN = 20.0
MID = 0.3  # a slot threshold between the sharpened model's plan scores


@pytest.fixture(scope="module")
def refusion(tmp_path_factory):
    """The tiny random ReFusion checkpoint, LM head scaled x20: its plan scores then spread
    over ~0.15-0.5 instead of sitting near 1/vocab, so a threshold falls between scores
    rather than on near-ties."""
    model, info = load_refusion(tiny_checkpoint("refusion", tmp_path_factory.mktemp("ckpt")))
    with torch.no_grad():
        model.lm_head.weight.mul_(SHARPEN)
    return model, info.mask_token_id


def generate(refusion, cfg: ReFusionConfig, prompt=PROMPT, max_tokens=32, stops=()):
    model, mask_id = refusion
    request = Request(prompt, max_tokens=max_tokens, stop_token_ids=stops)
    return refusion_generate(model, [request], cfg, mask_id)[0]


# ---------------------------------------------------------------------------- the oracle


def visible_forward(model, prompt, slots, sees, slot_size):  # -> {slot: [len, vocab]}
    """One forward, no cache: the prompt, then ``slots`` (slot -> tokens) in slot order at
    their true positions. A slot token sees the prompt, its own slot up to itself, and every
    token of the slots in ``sees[slot]``; the prompt is causal."""
    ids, pos, owner = list(prompt), list(range(len(prompt))), [-1] * len(prompt)
    offset = list(range(len(prompt)))
    for s in sorted(slots):
        ids += slots[s]
        pos += [len(prompt) + s * slot_size + j for j in range(len(slots[s]))]
        owner += [s] * len(slots[s])
        offset += range(len(slots[s]))
    n, num = len(ids), max(slots) + 1
    sees_slot = torch.zeros(num + 1, num + 1, dtype=torch.bool)  # row/col `num`: the prompt
    for s in slots:
        sees_slot[s, sorted(sees[s])] = True
    own, off = torch.tensor(owner), torch.tensor(offset)
    own = torch.where(own < 0, num, own)
    q, k = own[:, None], own[None, :]  # [n, 1], [1, n]
    allow = torch.where(
        k == num,  # a prompt key: every slot token sees it, the prompt is causal
        (q != num) | (off[None, :] <= off[:, None]),
        torch.where(q == k, off[None, :] <= off[:, None], sees_slot[q, k] & (q != num)),
    )
    bias = torch.zeros(n, n).masked_fill(~allow, torch.finfo(torch.float32).min)
    with torch.inference_mode():
        logits = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]),
                       attention_mask=bias[None, None], use_cache=False).logits[0].float()
    out, start = {}, len(prompt)
    for s in sorted(slots):
        out[s] = logits[start : start + len(slots[s])]
        start += len(slots[s])
    return out


def oracle_generate(model, mask_id, cfg, prompt=PROMPT, max_tokens=32, stops=()):
    """Brute-force ReFusion for token_threshold 0 or 1. Returns (tokens, slot_rounds,
    plan scores of every round)."""
    assert cfg.token_threshold in (0.0, 1.0) and cfg.slot_size >= 2
    S = cfg.slot_size
    gen_len, block_len = cfg.layout(max_tokens)
    done: dict[int, list[int]] = {}  # committed slot -> tokens
    ctx: dict[int, set[int]] = {}  # committed slot -> the slots its KV saw
    rounds = [-1] * (gen_len // S)
    stopped, r, all_scores = False, 0, []
    for b in range(cfg.num_blocks):
        masked = list(range(b * block_len // S, (b + 1) * block_len // S))
        while masked:
            before = set(done)
            # plan: masked slots see every committed slot and the masked slots before them
            sees = {**ctx, **{q: before | {m for m in masked if m < q} for q in masked}}
            logits = visible_forward(model, prompt, {**done, **{q: [mask_id] * S for q in masked}},
                                     sees, S)
            scores = [float(torch.softmax(logits[q][0], -1).max()) for q in masked]
            all_scores.append(scores)
            chosen = [q for q, sc in zip(masked, scores) if sc > cfg.slot_threshold]
            chosen = chosen or [masked[max(range(len(masked)), key=lambda i: (scores[i], -i))]]
            rows = {q: logits[q].argmax(-1).tolist() for q in chosen}
            if cfg.token_threshold == 0.0:  # all drafts pass: the global verify pass's KV
                row_ctx = {q: before | {c for c in chosen if c < q} for q in chosen}
            else:  # no draft passes: each slot infilled alone, one token per draft pass
                row_ctx = {q: before for q in chosen}
                for q in chosen:
                    for j in range(1, S):
                        partial = {**done, q: rows[q][:j] + [mask_id]}
                        nxt = visible_forward(model, prompt, partial, {**ctx, q: before}, S)
                        rows[q][j] = int(nxt[q][j].argmax())
            for q in chosen:  # commit in order, up to the first slot with a stop token
                cut = next((j for j, t in enumerate(rows[q]) if t in stops), None)
                done[q], ctx[q], rounds[q] = rows[q][: S if cut is None else cut + 1], row_ctx[q], r
                masked.remove(q)
                if cut is not None:
                    stopped = True
                    masked = [m for m in masked if m < q]
                    break
            r += 1
        if stopped:
            break
    tokens = []
    for s in range(gen_len // S):
        if s not in done:
            break
        tokens += done[s]
    cut = next((i for i, t in enumerate(tokens) if t in stops), None)
    return tokens[: max_tokens if cut is None else min(cut + 1, max_tokens)], rounds, all_scores


@pytest.fixture
def plan_scores(monkeypatch):
    """The decoder's plan scores, round by round (a spy on ``score_slots``)."""
    seen: list[list[float]] = []

    def spy(first_logits, *args):
        scores, tokens = score_slots(first_logits, *args)
        seen.append(scores.tolist())
        return scores, tokens

    monkeypatch.setattr(refusion_rounds, "score_slots", spy)
    return seen


def assert_scores_close(got: list[list[float]], want: list[list[float]]) -> None:
    assert len(got) == len(want)
    for r, (g, w) in enumerate(zip(got, want)):
        torch.testing.assert_close(torch.tensor(g), torch.tensor(w), rtol=1e-5, atol=1e-6,
                                   msg=f"plan scores of round {r}")


def test_oracle_mask_is_the_stock_causal_mask_when_every_slot_sees_the_earlier_ones(refusion):
    model, _ = refusion
    slots = {0: [20, 21, 22, 23], 1: [30, 31, 32, 33], 2: [40, 41, 42, 43]}
    sees = {0: set(), 1: {0}, 2: {0, 1}}
    got = visible_forward(model, PROMPT, slots, sees, 4)
    ids = PROMPT + slots[0] + slots[1] + slots[2]
    with torch.inference_mode():
        ref = model(input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids)),
                    use_cache=False).logits[0].float()
    torch.testing.assert_close(torch.cat([got[0], got[1], got[2]]), ref[len(PROMPT):],
                               rtol=1e-4, atol=1e-4)


# ------------------------------------------------------------------- exact against brute force

ORACLE_CASES = {
    # name: (slot_size, num_blocks, slot_threshold, token_threshold, max_tokens)
    "one_slot_per_round_ar_infill": (4, 2, 1.0, 1.0, 32),
    "all_slots_per_round_parallel_ar_infill": (4, 2, 0.0, 1.0, 32),
    "some_slots_per_round_parallel_ar_infill": (4, 1, MID, 1.0, 32),
    "one_slot_per_round_all_drafts_accepted": (4, 2, 1.0, 0.0, 32),
    "all_slots_per_round_all_drafts_accepted": (8, 2, 0.0, 0.0, 32),
    "some_slots_per_round_all_drafts_accepted": (4, 1, MID, 0.0, 32),
    "single_block_slot_8": (8, 1, 1.0, 1.0, 24),
}


@pytest.mark.parametrize("case", ORACLE_CASES)
def test_matches_brute_force_without_kv_reuse(refusion, plan_scores, case: str) -> None:
    S, blocks, slot_th, token_th, max_tokens = ORACLE_CASES[case]
    cfg = ReFusionConfig(S, blocks, slot_th, token_th)
    out = generate(refusion, cfg, max_tokens=max_tokens)
    tokens, rounds, scores = oracle_generate(*refusion, cfg, max_tokens=max_tokens)
    assert out.token_ids == tokens
    assert out.slot_rounds == rounds  # same slots planned in the same rounds
    assert_scores_close(plan_scores, scores)  # the reused KV gives the same plan logits
    slots_per_block = max_tokens // S // blocks
    if slot_th == 1.0:
        assert set(out.slots_per_plan) == {1}
    elif slot_th == 0.0:
        assert set(out.slots_per_plan) == {slots_per_block}
    else:  # the in-between threshold really picks several but not all slots somewhere
        assert any(1 < k < slots_per_block for k in out.slots_per_plan), out.slots_per_plan


def test_slot_threshold_never_passing_plans_the_brute_force_top1(refusion) -> None:
    """Slot threshold 1 (nothing is > 1): one slot per round, the argmax of first-token
    probabilities recomputed by a plain causal forward over [prompt, committed slots in
    commit order, masked slots of the block] (default token threshold)."""
    model, mask_id = refusion
    S = 4
    cfg = ReFusionConfig(slot_size=S, num_blocks=2, slot_threshold=1.0, token_threshold=0.4)
    out = generate(refusion, cfg)
    assert out.slots_per_plan == [1] * 8
    gen = out.token_ids
    by_round = sorted(range(8), key=lambda s: out.slot_rounds[s])
    for r, slot in enumerate(by_round):
        block = slot // 4
        committed = by_round[:r]
        masked = [s for s in range(block * 4, block * 4 + 4) if s not in committed]
        ids = PROMPT + [t for s in committed for t in gen[s * S : s * S + S]]
        ids += [mask_id] * S * len(masked)
        pos = list(range(len(PROMPT))) + [len(PROMPT) + s * S + j for s in committed + masked
                                          for j in range(S)]
        with torch.inference_mode():
            logits = model(input_ids=torch.tensor([ids]), position_ids=torch.tensor([pos]),
                           attention_mask=torch.ones(1, len(ids)), use_cache=False).logits[0]
        first = len(PROMPT) + S * len(committed) + S * torch.arange(len(masked))
        scores, tokens = torch.softmax(logits[first].float(), -1).max(-1)
        best = int(scores.argmax())
        assert masked[best] == slot, f"round {r}"
        assert gen[slot * S] == int(tokens[best])  # the slot's first token is the plan's


# ---------------------------------------------------------------------- thresholds, counts


def test_token_threshold_zero_accepts_every_draft(refusion) -> None:
    cfg = ReFusionConfig(slot_size=4, num_blocks=2, slot_threshold=1.0, token_threshold=0.0)
    out = generate(refusion, cfg)
    rounds = len(out.slots_per_plan)
    assert out.num_draft_tokens == out.num_accepted_tokens == rounds * 3
    assert out.num_forwards == 2 * rounds  # plan + global verify, nothing to complete
    assert out.accept_lengths == [4] * rounds
    assert out.tpf == pytest.approx(32 / (2 * rounds))


def test_token_threshold_one_accepts_no_draft_and_completes_one_token_per_pass(refusion) -> None:
    cfg = ReFusionConfig(slot_size=4, num_blocks=2, slot_threshold=0.0, token_threshold=1.0)
    out = generate(refusion, cfg)
    assert out.num_accepted_tokens == 0 and out.num_draft_tokens > 0
    assert out.slots_per_plan == [4, 4]
    # per round: plan + global verify + (S - 1) x (draft + verify)
    assert out.num_forwards == 2 * (2 + 2 * 3)
    assert out.tpf == pytest.approx(32 / 16)


def test_position_ids_preserved_after_reordering(refusion) -> None:
    S = 4
    cfg = ReFusionConfig(slot_size=S, num_blocks=2, slot_threshold=MID, token_threshold=0.0)
    out = generate(refusion, cfg)
    P = len(PROMPT)
    order = reorder_for_kv_reuse(out.slot_rounds, S, start_position=P)
    assert out.cache_position_ids == list(range(P)) + order.position_ids.tolist()
    assert sorted(out.cache_position_ids) == list(range(P + 32))
    assert order.perm.tolist() != list(range(32))  # slots really were reordered


# ---------------------------------------------------------------------------- stop tokens


STOP_CASES = {
    # name: (num_blocks, slot_threshold, token_threshold, stop = the free run's token at index)
    "first_token_via_global_verify": (2, MID, 0.0, 0),
    "mid_slot_via_global_verify": (2, MID, 0.0, 9),
    "later_slot_via_global_verify": (2, MID, 0.0, 21),
    "first_token_via_completion": (2, MID, 1.0, 0),
    "mid_slot_via_completion": (2, MID, 1.0, 9),
    "later_slot_via_completion": (2, MID, 1.0, 21),
    # 7 parallel rows; the 3rd is cut at its stop, rows after it dropped, and the next round
    # plans on the merged KV (4 + 4 + 3 entries): a wrong keep per row would show there
    "cut_row_in_parallel_round_then_more_rounds": (1, 0.25, 1.0, 14),
}


@pytest.mark.parametrize("case", STOP_CASES)
def test_stop_token_truncation_matches_brute_force(refusion, plan_scores, case: str) -> None:
    """A token of the free run made a stop: slots with a stop are cut after it, masked slots
    after it are dropped, rows after it in a parallel round are dropped, and the output is
    cut after the first stop in original order (even when a later slot was decoded first)."""
    blocks, slot_th, token_th, which = STOP_CASES[case]
    cfg = ReFusionConfig(slot_size=4, num_blocks=blocks, slot_threshold=slot_th,
                         token_threshold=token_th)
    free = generate(refusion, cfg)
    stop = free.token_ids[which]
    plan_scores.clear()
    out = generate(refusion, cfg, stops=(stop,))
    tokens, rounds, scores = oracle_generate(*refusion, cfg, stops=(stop,))
    assert out.token_ids == tokens and out.slot_rounds == rounds
    assert_scores_close(plan_scores, scores)
    assert out.finish_reason == "stop" and len(out.token_ids) < 32
    assert out.token_ids[-1] == stop and out.token_ids.count(stop) == 1
    if blocks == 2:
        assert out.slot_rounds[4:] == [-1] * 4  # the stop came in block 1: block 2 never starts
    if case == "cut_row_in_parallel_round_then_more_rounds":
        assert out.slots_per_plan[0] > 3 and out.accept_lengths[0] == 11
        assert len(out.slots_per_plan) > 1


def test_stop_as_a_planned_first_token_commits_it_alone(refusion) -> None:
    cfg = ReFusionConfig(slot_size=4, num_blocks=2, slot_threshold=1.0, token_threshold=1.0)
    free = generate(refusion, cfg)
    first_slot = free.slot_rounds.index(0)  # the slot planned first
    assert first_slot > 0
    stop = free.token_ids[first_slot * 4]  # ... and its first token, the plan's choice
    out = generate(refusion, cfg, stops=(stop,))
    assert out.slot_rounds[first_slot] == 0 and out.accept_lengths[0] == 1
    # a lone stop is committed by the global verify (2 forwards); a full slot needs the
    # completion loop too: 2 + 3 x (draft + verify)
    assert out.num_forwards == sum(2 if n == 1 else 8 for n in out.accept_lengths)
    assert all(r == -1 for r in out.slot_rounds[first_slot + 1 :])  # later slots: never
    assert all(out.slot_rounds[s] > 0 for s in range(first_slot))  # earlier ones: still decoded
    assert out.finish_reason == "stop" and out.token_ids[-1] == stop


def test_no_stop_gives_length(refusion) -> None:
    out = generate(refusion, ReFusionConfig(4, 2, 0.9, 0.4), max_tokens=30)
    assert out.finish_reason == "length" and len(out.token_ids) == 30  # 32 decoded, cut


# ------------------------------------------------------------------------------- batching


def test_batch_of_prompts_with_different_lengths(refusion) -> None:
    model, mask_id = refusion
    cfg = ReFusionConfig(slot_size=4, num_blocks=2, slot_threshold=MID, token_threshold=1.0)
    prompts = [[3], [10, 11, 12, 13, 14, 15, 16], [40 + i for i in range(13)]]
    requests = [Request(p, max_tokens=m) for p, m in zip(prompts, (16, 32, 24))]
    outs = refusion_generate(model, requests, cfg, mask_id)
    for p, m, out in zip(prompts, (16, 32, 24), outs):
        assert len(out.token_ids) == m
        assert out.token_ids == oracle_generate(model, mask_id, cfg, prompt=p, max_tokens=m)[0]
        assert out.token_ids == refusion_generate(model, [Request(p, max_tokens=m)], cfg,
                                                  mask_id)[0].token_ids
    other = generate(refusion, cfg, prompt=[10, 11, 12], max_tokens=32)
    assert outs[1].token_ids != other.token_ids  # the prompt matters


# ----------------------------------------------------------------------------- bad inputs

BAD_CONFIGS = {
    "slot_size_zero": {"slot_size": 0},
    "slot_size_float": {"slot_size": 4.0},
    "slot_size_bool": {"slot_size": True},
    "num_blocks_zero": {"num_blocks": 0},
    "slot_threshold_negative": {"slot_threshold": -0.1},
    "slot_threshold_over_one": {"slot_threshold": 1.5},
    "token_threshold_nan": {"token_threshold": math.nan},
    "token_threshold_over_one": {"token_threshold": 1.01},
    "token_threshold_string": {"token_threshold": "0.4"},
}


@pytest.mark.parametrize("case", BAD_CONFIGS)
def test_bad_config_is_a_clear_error(case: str) -> None:
    name = next(iter(BAD_CONFIGS[case]))
    with pytest.raises(ValueError, match=name):
        ReFusionConfig(**BAD_CONFIGS[case])


@pytest.mark.parametrize(
    "slot_size,num_blocks,max_tokens",
    [(8, 3, 64), (32, 4, 64), (4, 3, 30)],
    ids=["slots_not_divisible_by_blocks", "block_shorter_than_slot", "rounded_up_still_odd"],
)
def test_slot_size_not_dividing_the_block_is_a_clear_error(refusion, slot_size, num_blocks,
                                                            max_tokens) -> None:
    cfg = ReFusionConfig(slot_size=slot_size, num_blocks=num_blocks)
    with pytest.raises(ValueError, match="slot_size must divide the block length"):
        generate(refusion, cfg, max_tokens=max_tokens)


def test_layout_rounds_up_to_whole_slots() -> None:
    assert ReFusionConfig(slot_size=8, num_blocks=2).layout(30) == (32, 16)
    assert ReFusionConfig(slot_size=32, num_blocks=4).layout(512) == (512, 128)


def test_unsupported_requests_are_clear_errors(refusion) -> None:
    model, mask_id = refusion
    cfg = ReFusionConfig(4, 2)
    sampled = Request(PROMPT, max_tokens=8, sampling=SamplingParams(temperature=0.7))
    with pytest.raises(ValueError, match="greedy"):
        refusion_generate(model, [sampled], cfg, mask_id)
    with pytest.raises(ValueError, match="stop_strings"):
        refusion_generate(model, [Request(PROMPT, max_tokens=8, stop_strings=("x",))], cfg, mask_id)
    with pytest.raises(ValueError, match="mask_token_id"):
        refusion_generate(model, [Request(PROMPT, max_tokens=8)], cfg, 10_000)
    with pytest.raises(ValueError, match="max_position_embeddings"):
        refusion_generate(model, [Request(PROMPT, max_tokens=4090)], ReFusionConfig(32, 1), mask_id)


LOAD_ERRORS = {
    "plain_qwen3_without_mask_token": (write_qwen3, {}, "mask_token_id"),
    "refusion_with_mask_token_removed": (write_refusion, {"mask_token_id": None}, "mask_token_id"),
    "orthrus_checkpoint": (write_orthrus, {}, "refusion"),
    "mask_token_outside_vocab": (write_refusion, {"mask_token_id": 999}, "outside its vocabulary"),
}


@pytest.mark.parametrize("case", LOAD_ERRORS)
def test_load_refuses_non_refusion_checkpoints(tmp_path, case: str) -> None:
    writer, overrides, message = LOAD_ERRORS[case]
    path = writer(tmp_path / case, **overrides)
    with pytest.raises(CheckpointError, match=message):
        load_refusion(path)


# --------------------------------------------------------------- the training objective


@pytest.mark.parametrize("size", [4, 8, 16, 32])
@pytest.mark.parametrize("seed", range(3))
def test_training_example_follows_forward_process(seed: int, size: int) -> None:
    """ReFusion's forward_process: [query, clean slots shuffled, masked slots in order],
    true positions, clean tokens predict the next token of their slot, masks their own."""
    import random

    from diffspec.testing.synthetic_refusion import IGNORE, refusion_example

    n, q, mask_id = 50, 7, 3
    tokens = list(range(100, 100 + n))
    ids, pos, labels, masked, p_mask = refusion_example(tokens, q, size, mask_id,
                                                        random.Random(seed), eps=1e-3)
    assert 1e-3 <= p_mask <= 1
    assert ids[:q] == tokens[:q] and pos[:q] == list(range(q)) and labels[:q] == [IGNORE] * q
    assert sorted(pos) == list(range(n))
    assert masked == sorted(masked)  # every clean slot before every masked one
    where = {p: i for i, p in enumerate(pos)}  # position -> index in the sequence
    slot_order = []
    for start in range(q, n, size):
        slot = list(range(start, min(start + size, n)))  # this slot's true positions
        idx = [where[p] for p in slot]
        assert idx == list(range(idx[0], idx[0] + len(slot)))  # contiguous, in order
        assert len({masked[i] for i in idx}) == 1
        slot_order.append((idx[0], masked[idx[0]]))
        for j, i in enumerate(idx):
            if masked[i]:
                assert ids[i] == mask_id and labels[i] == tokens[slot[j]]
            else:
                assert ids[i] == tokens[slot[j]]
                assert labels[i] == (tokens[slot[j + 1]] if j + 1 < len(slot) else IGNORE)
    masked_starts = [i for i, m in slot_order if m]
    assert masked_starts == sorted(masked_starts)  # masked slots keep their original order


def test_training_loss_trains_both_views(refusion) -> None:
    """One step of ReFusion's loss on the tiny model: finite, both terms present, and a
    gradient step lowers it on the same batch."""
    import random

    from diffspec.testing.synthetic import vocabulary
    from diffspec.testing.synthetic_refusion import ReFusionTrainConfig, _batch, refusion_loss

    model, mask_id = refusion
    cfg = ReFusionTrainConfig(batch_size=4, seq_len=40, query_len=(8, 16))
    words = {w: 20 + i for i, w in enumerate(vocabulary())}  # clear of the tiny mask id
    batch = _batch(random.Random(0), words, cfg, mask_id)
    assert batch["is_masked"].any() and (~batch["is_masked"]).any()
    trained = type(model)(model.config)
    trained.load_state_dict(model.state_dict())
    loss, ar, mdm = refusion_loss(trained, batch)
    assert torch.isfinite(loss) and ar > 0 and mdm > 0
    loss.backward()
    with torch.no_grad():
        for p in trained.parameters():
            p -= 0.05 * p.grad
    assert refusion_loss(trained, batch)[0] < loss


# ------------------------------------------------------------------ the trained tiny model


def test_trained_synthetic_refusion_decodes_fast_and_well() -> None:
    """The bundled ReFusion-style model (diffspec/assets/synth-refusion, see TRAINING.md) at
    the published default thresholds: measured TPF 3.06, 1.15 slots per plan, valid-bigram
    rate 0.97 on these 10 prompts; the bounds leave a margin, a broken decoder falls far
    below them (random words give ~0.08 valid bigrams)."""
    from diffspec.assets import ASSETS_DIR
    from diffspec.testing.synthetic_refusion import evaluate

    threads = torch.get_num_threads()
    try:
        r = evaluate(ASSETS_DIR / "synth-refusion", slot_size=8, num_blocks=2, slot_threshold=0.9,
                     token_threshold=0.4, max_tokens=64, num_prompts=10, seed=1)
    finally:
        torch.set_num_threads(threads)
    assert r["tpf"] > 2.5 and r["ar_tpf"] == 1.0
    assert r["mean_slots_per_plan"] > 1.05  # the plan does pick several slots at times
    assert r["valid_bigram_rate"] > 0.93 and r["draft_acceptance"] > 0.6
