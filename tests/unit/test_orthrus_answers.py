"""Orthrus heads on conversation rows (train_orthrus_answers): answer-only anchors, metrics,
resume bit for bit, the CPU budget, snapshots. The bundled synth-qwen3; seconds on CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from diffspec.train import TrainConfig
from diffspec.train.orthrus import (
    answer_anchors,
    answer_metrics,
    answer_positions,
    chain_lengths,
    train_orthrus_answers,
)

BASE = Path(__file__).resolve().parents[2] / "diffspec" / "assets" / "synth-qwen3"


def test_answer_anchors_stay_in_the_answer():
    g = torch.Generator().manual_seed(0)
    a = answer_anchors(length=40, prompt_len=10, block_size=8, num=100, generator=g)
    # the last prompt token (9) anchors the first answer block; every anchor has a target
    assert a.tolist() == list(range(9, 39))
    assert answer_anchors(40, 10, 8, 5, g).unique().numel() == 5
    assert answer_anchors(12, 11, 8, 4, g).tolist() == [10]  # one answer token: one anchor
    assert answer_anchors(11, 11, 8, 4, g).numel() == 0  # no answer: no anchor
    assert answer_anchors(5, 0, 8, 10, g).tolist() == [1, 2, 3]  # position 0 sees nothing


def test_answer_positions_and_chains():
    positions, valid = answer_positions(torch.tensor([3, 10]), block_size=4, length=13)
    assert positions.tolist() == [[3, 4, 5], [10, 11, 12]]
    assert valid.tolist() == [[True, True, True], [True, True, False]]
    agree = torch.tensor([[True, True, False], [True, False, True], [False, True, True]])
    assert chain_lengths(agree).tolist() == [2, 1, 0]
    m = answer_metrics({"kl": 6.0, "count": 3, "right": 2, "anchors": 2, "chain": 3,
                        "accept_0": 2, "accept_1": 1, "accept_2": 0}, block_size=4)
    assert m == {"kl": 2.0, "acc": 2 / 3, "est_al": 2.5, "accept_0": 1.0, "accept_1": 0.5,
                 "accept_2": 0.0}


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> Path:
    from diffspec.testing.synthetic import build_tokenizer, sample_prompts
    from training.eagle3 import greedy_rows

    tok = build_tokenizer()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in sample_prompts(24, 7)]
    path = tmp_path_factory.mktemp("rows") / "rows.jsonl"
    with path.open("w") as f:
        for r in greedy_rows(BASE, prompts, 40):
            f.write(json.dumps(r) + "\n")
    return path


def _cfg(steps: int) -> TrainConfig:
    return TrainConfig(steps=steps, lr=1e-2, warmup_steps=2, batch_size=3, seq_len=96,
                       log_every=100)


def _run(out, rows, steps, rank_override=8, **kw):
    return train_orthrus_answers(BASE, out, _cfg(steps), data=[str(rows)], block_size=8,
                                 num_anchors=12, rank=rank_override, log=lambda m: None, **kw)


def _heads(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(out / "heads.safetensors"))


def test_training_lowers_the_divergence_and_resumes_bit_for_bit(rows, tmp_path):
    full = _run(tmp_path / "full", rows, 30, save_every=10, snapshot_every=15)
    hist = full.record["history"]
    assert len(hist) == 30 and hist[-1]["tokens_seen"] == full.record["tokens_seen"]
    first = sum(h["kl"] for h in hist[:5]) / 5
    last = sum(h["kl"] for h in hist[-5:]) / 5
    assert last < 0.8 * first, (first, last)  # the heads learn the AR view's distributions
    assert all(1.0 <= h["est_al"] <= 8.0 for h in hist)
    assert sorted(p.name for p in (tmp_path / "full" / "snapshots").iterdir()) == [
        "step-00015", "step-00030"]
    record = json.loads((tmp_path / "full" / "training.json").read_text())
    assert record["mode"] == "answers" and record["steps"] == 30

    _run(tmp_path / "split", rows, 30, max_cpu_s=0.0)  # stops after its first step
    first_session = json.loads((tmp_path / "split" / "training.json").read_text())
    assert first_session["steps"] == 1
    assert first_session["sessions"][0]["stopped_by_cpu_budget"]
    resumed = _run(tmp_path / "split", rows, 30, resume=True)
    assert resumed.record["steps"] == 30 and len(resumed.record["sessions"]) == 2
    a, b = _heads(tmp_path / "full"), _heads(tmp_path / "split")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_resume_needs_a_checkpoint(rows, tmp_path):
    with pytest.raises(FileNotFoundError, match="without --resume first"):
        _run(tmp_path / "none", rows, 3, resume=True)


def test_trainers_refuse_held_out_answers(rows, tmp_path):
    folder = tmp_path / "heldout"
    folder.mkdir()
    (folder / "shard-00000.jsonl").write_text(rows.read_text())
    (folder / "manifest.json").write_text(json.dumps({"prompts": {"split": "held-out"}}))
    with pytest.raises(ValueError, match="held-out prompts"):
        train_orthrus_answers(BASE, None, _cfg(2), data=[str(folder)], log=lambda m: None)
    from diffspec.model_executors.reference.orthrus import orthrus_from_base
    from diffspec.train.data import load_rows
    from diffspec.train.orthrus import measure_answer_acceptance  # evaluation reads them

    measured, _ = load_rows(None, 96, files=[folder / "shard-00000.jsonl"])
    m = measure_answer_acceptance(orthrus_from_base(BASE, 8, rank=4), measured[:3])
    assert 1.0 <= m["est_al"] <= 8.0 and m["accept_0"] >= m["accept_1"] >= m["accept_6"]


def test_init_heads_continues_a_heads_folder(rows, tmp_path):
    """--init-heads: a new run starts from a heads folder, not from B = 0: its first step's
    divergence is the folder's (well below untrained heads'), the trained folder differs
    from the start, and settings that contradict the folder are refused."""
    first = _run(tmp_path / "first", rows, 30)
    untrained_kl = first.record["history"][0]["kl"]
    trained_kl = sum(h["kl"] for h in first.record["history"][-5:]) / 5
    cont = _run(tmp_path / "cont", rows, 5, init_heads=tmp_path / "first")
    start_kl = cont.record["history"][0]["kl"]
    assert start_kl < 0.5 * (untrained_kl + trained_kl), (untrained_kl, start_kl)
    assert cont.record["config"]["extra"]["init_heads"] == str(tmp_path / "first")
    a, b = _heads(tmp_path / "first"), _heads(tmp_path / "cont")
    assert a.keys() == b.keys() and any(not torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ValueError, match="pass --rank 8"):
        _run(tmp_path / "bad", rows, 2, init_heads=tmp_path / "first", rank_override=16)


def test_cli_wall_minutes_and_init_heads(rows, tmp_path, capsys):
    """The CLI's --max-wall-minutes stops a session (saved, resumable) and --init-heads
    starts from a heads folder (recorded in training.json)."""
    from diffspec.train.__main__ import main

    common = ["orthrus", "--base", str(BASE), "--data", str(rows), "--answers-only",
              "--rank", "8", "--block-size", "8", "--num-anchors", "4", "--seq-len", "96",
              "--batch-size", "2", "--steps", "20", "--log-every", "100"]
    assert main(common + ["--out", str(tmp_path / "a"), "--max-wall-minutes", "0"]) == 0
    record = json.loads((tmp_path / "a" / "training.json").read_text())
    assert record["steps"] == 1 and record["sessions"][0]["stopped_by_deadline"]
    assert main(common + ["--out", str(tmp_path / "b"), "--steps", "2",
                          "--init-heads", str(tmp_path / "a")]) == 0
    record = json.loads((tmp_path / "b" / "training.json").read_text())
    assert record["config"]["extra"]["init_heads"] == str(tmp_path / "a")
    with pytest.raises(SystemExit, match="--init-heads needs --answers-only"):
        main([a for a in common if a != "--answers-only"] + ["--init-heads", "x"])


def test_acceptance_curve_starts_from_the_init_heads(rows, tmp_path):
    """benchmarks.acceptance_curve on a continued run: its first point is the heads it
    started from (not B = 0), and tokens count that folder's training too."""
    from benchmarks.acceptance_curve import main as curve

    first = _run(tmp_path / "first", rows, 4)
    _run(tmp_path / "cont", rows, 2, init_heads=tmp_path / "first", snapshot_every=1)
    assert curve(["--base", str(BASE), "--run", str(tmp_path / "cont"), "--data", str(rows),
                  "--max-rows", "3", "--max-anchors", "4", "--seq-len", "96",
                  "--out", str(tmp_path / "curve")]) == 0
    points = json.loads((tmp_path / "curve" / "acceptance_curve.json").read_text())["points"]
    assert points[0]["heads"] == f"start: {tmp_path / 'first'}"
    assert points[0]["tokens"] == first.record["tokens_seen"] > 0
    assert [p["step"] for p in points] == [0, 1, 2, 2]  # start, snapshots 1 and 2, final
    assert points[1]["tokens"] > points[0]["tokens"]


def test_a_narrowed_block_is_the_engines_shorter_block():
    """A block of K = 8 narrowed to width 3 (narrow_blocks) gives its first 3 rows the
    logits a block of K = 3 gives (what an engine computes when the adaptive policy drafts
    2): the hidden columns change nothing the rows see, on the real reference model."""
    from diffspec.model_executors.reference.orthrus import orthrus_from_base
    from diffspec.model_executors.reference.views import block_view_logits
    from diffspec.train.data import anchor_blocks, narrow_blocks
    from diffspec.train.orthrus import BlockDistiller

    model = orthrus_from_base(BASE, block_size=8, rank=8, seed=0)
    with torch.no_grad():  # heads away from the AR projections: the views differ
        for name, p in model.lm.named_parameters():
            if "_diff." in name:
                p.add_(0.05 * torch.randn_like(p))
    distiller = BlockDistiller(model.lm, block_size=8, mask_token_id=model.mask_token_id,
                               num_anchors=2, draft_view=model.diffusion_view)
    ids = torch.randint(5, 60, (1, 30), generator=torch.Generator().manual_seed(1))
    anchors = torch.tensor([[6, 17]])
    _, cache = distiller._teacher(ids)
    wide = narrow_blocks(anchor_blocks(ids, anchors, 8, model.mask_token_id),
                         torch.tensor([3, 8]), 30, 8)
    short = anchor_blocks(ids, anchors, 3, model.mask_token_id)
    with torch.no_grad(), model.diffusion_view():
        got = block_view_logits(model.lm, wide.input_ids, wide.position_ids, cache,
                                wide.attention_mask)[0]
        want = block_view_logits(model.lm, short.input_ids, short.position_ids, cache,
                                 short.attention_mask)[0]
        plain = anchor_blocks(ids, anchors, 8, model.mask_token_id)
        full = block_view_logits(model.lm, plain.input_ids, plain.position_ids, cache,
                                 plain.attention_mask)[0]
    torch.testing.assert_close(got[:3], want[:3], rtol=1e-4, atol=1e-4)
    assert not torch.allclose(full[:3], want[:3], atol=1e-3)  # unnarrowed: rows see more
    torch.testing.assert_close(got[8:], full[8:], rtol=1e-4, atol=1e-4)  # width 8: as is


def test_training_on_a_mix_of_block_widths(rows, tmp_path):
    """--block-widths: the run trains (the divergence falls), records its widths, resumes
    with them, and refuses a width past the block size."""
    run = _run(tmp_path / "mix", rows, 20, block_widths=[2, 4, 8])
    hist = run.record["history"]
    assert sum(h["kl"] for h in hist[-5:]) < 0.9 * sum(h["kl"] for h in hist[:5])
    assert run.record["config"]["extra"]["block_widths"] == [2, 4, 8]
    with pytest.raises(ValueError, match=r"^set --block-widths within 2\.\.8"):
        _run(tmp_path / "bad", rows, 2, block_widths=[2, 9])


def test_cross_entropy_on_the_ar_argmax(rows, tmp_path):
    """--loss ce: the heads learn the AR view's greedy tokens (their agreement rises), the
    KL is still reported, and the setting is recorded."""
    run = _run(tmp_path / "ce", rows, 20, loss="ce")
    hist = run.record["history"]
    assert all("kl" in h for h in hist)
    assert sum(h["acc"] for h in hist[-5:]) > sum(h["acc"] for h in hist[:5])
    assert run.record["config"]["extra"]["loss"] == "ce"
