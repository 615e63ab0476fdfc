"""The drafter trainers: pure losses, data layout, Orthrus head distillation, the NLD draft
LoRA, determinism, and the shipped synth-orthrus checkpoint."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from diffspec.assets import (
    SYNTH_ORTHRUS_DIR,
    SYNTH_QWEN3_DIR,
)
from diffspec.core.masks import orthrus_dual_pass_mask
from diffspec.train import TrainConfig, cosine_lr_scale
from diffspec.train.data import (
    anchor_blocks,
    pack_rows,
    read_documents,
    sample_anchors,
    tokenize_documents,
)
from diffspec.train.losses import (
    accepted_prefix_weights,
    draft_loss,
    forward_kl,
    lk_loss,
    token_cross_entropy,
)

# --------------------------------------------------------------------------------- losses


def test_forward_kl_is_zero_when_equal_and_matches_the_formula():
    teacher = torch.randn(5, 11)
    assert forward_kl(teacher.clone(), teacher).abs() < 1e-6
    student = torch.randn(5, 11)
    p, q = teacher.softmax(-1), student.softmax(-1)
    expected = (p * (p.log() - q.log())).sum(-1).mean()
    assert torch.allclose(forward_kl(student, teacher), expected, atol=1e-6)
    assert forward_kl(student, teacher) > 0


def test_lk_loss_is_minus_log_overlap():
    teacher, student = torch.randn(4, 7), torch.randn(4, 7)
    assert lk_loss(teacher.clone(), teacher).abs() < 1e-6
    overlap = torch.minimum(teacher.softmax(-1), student.softmax(-1)).sum(-1)
    assert torch.allclose(lk_loss(student, teacher), -overlap.log().mean(), atol=1e-6)


def test_weights_select_positions():
    student, teacher = torch.randn(4, 9), torch.randn(4, 9)
    targets = torch.tensor([1, 2, 3, 4])
    w = torch.tensor([1.0, 0.0, 1.0, 0.0])
    keep = torch.tensor([0, 2])
    assert torch.allclose(forward_kl(student, teacher, w), forward_kl(student[keep], teacher[keep]))
    assert torch.allclose(token_cross_entropy(student, targets, w),
                          F.cross_entropy(student[keep], targets[keep]))


def test_draft_loss_gradient_reaches_the_student_only():
    student = torch.randn(6, 10, requires_grad=True)
    teacher = torch.randn(6, 10, requires_grad=True)
    for divergence in ("kl", "lk"):
        loss = draft_loss(student, teacher, divergence=divergence, ce_weight=0.5)
        loss.total.backward()
    assert student.grad is not None and student.grad.abs().sum() > 0
    assert teacher.grad is None


ACCEPTED_PREFIX_CASES = {
    # name: (draft, target, weights): accepted prefix + the first rejected position
    "perfect_match": ([5, 6, 7, 8], [5, 6, 7, 8], [1, 1, 1, 1]),
    "first_mismatch": ([9, 6, 7, 8], [5, 6, 7, 8], [1, 0, 0, 0]),
    "early_mismatch": ([5, 6, 0, 8], [5, 6, 7, 8], [1, 1, 1, 0]),
    "last_mismatch": ([5, 6, 7, 0], [5, 6, 7, 8], [1, 1, 1, 1]),
    "match_after_mismatch_ignored": ([5, 0, 7, 8], [5, 6, 7, 8], [1, 1, 0, 0]),
}


@pytest.mark.parametrize("name", list(ACCEPTED_PREFIX_CASES))
def test_accepted_prefix_weights(name):
    draft, target, expected = ACCEPTED_PREFIX_CASES[name]
    got = accepted_prefix_weights(torch.tensor(draft), torch.tensor(target))
    assert got.tolist() == expected


def test_accepted_prefix_weights_per_block():
    draft = torch.tensor([[[1, 2, 3], [1, 9, 3]], [[0, 2, 3], [1, 2, 3]]])  # [B=2, n=2, K-1=3]
    target = torch.tensor([[[1, 2, 3], [1, 2, 3]], [[1, 2, 3], [1, 2, 3]]])
    got = accepted_prefix_weights(draft, target)
    assert got.tolist() == [[[1, 1, 1], [1, 1, 0]], [[1, 0, 0], [1, 1, 1]]]


def test_cosine_schedule():
    cfg = TrainConfig(steps=100, warmup_steps=10, min_lr_ratio=0.1)
    assert cosine_lr_scale(0, cfg) == pytest.approx(0.1)
    assert cosine_lr_scale(9, cfg) == pytest.approx(1.0)
    assert cosine_lr_scale(10, cfg) == pytest.approx(1.0)
    assert cosine_lr_scale(100, cfg) == pytest.approx(0.1)
    assert 0.1 < cosine_lr_scale(55, cfg) < 1.0


def _linear() -> torch.nn.Linear:
    torch.manual_seed(0)
    return torch.nn.Linear(6, 3)


def test_fit_with_a_loss_callable_and_an_lr_schedule_is_the_plain_adamw_loop():
    """``fit(loss_fn=..., lr_schedule=...)`` (what the synthetic trainers use) is, bit for
    bit, the hand-written loop: AdamW, the step's LR set before it, clipping; the history
    holds every term and the LR. A bare loss tensor works, and without a schedule the LR
    is ``cfg.lr * cosine_lr_scale``."""
    from diffspec.train import fit

    data = torch.randn(5, 4, 6, generator=torch.Generator().manual_seed(1))  # 5 batches
    cfg = TrainConfig(steps=5, lr=0.1, warmup_steps=2, weight_decay=0.01, max_grad_norm=0.5,
                      log_every=100)

    def schedule(step: int) -> float:
        return 0.1 * 3 / (step + 3)

    def loss_fn(module, x):
        y = module(x)
        return {"loss": y.square().mean(), "mean": y.mean()}

    model = _linear()
    result = fit(model, iter(data), cfg, loss_fn=loss_fn, lr_schedule=schedule,
                 use_accelerate=False, log=lambda msg: None)
    assert [h["lr"] for h in result.history] == [schedule(s) for s in range(5)]
    assert set(result.history[0]) == {"loss", "mean", "lr"}

    ref = _linear()
    opt = torch.optim.AdamW(ref.parameters(), lr=cfg.lr, betas=cfg.betas,
                            weight_decay=cfg.weight_decay)
    for step, x in enumerate(data):
        for group in opt.param_groups:
            group["lr"] = schedule(step)
        loss = ref(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(list(ref.parameters()), cfg.max_grad_norm)
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), ref.parameters()))

    result = fit(_linear(), iter(data), cfg, loss_fn=lambda m, x: m(x).square().mean(),
                 use_accelerate=False, log=lambda msg: None)
    assert [h["lr"] for h in result.history] == [cfg.lr * cosine_lr_scale(s, cfg)
                                                 for s in range(5)]


def test_fit_step_fn_accumulates_resumes_and_stops():
    """``step_fn`` (the answer-row trainers): two micro-batches' backward calls add up to
    the whole batch's gradient, so the run equals the plain loss on whole batches; a
    run stopped by ``on_step`` and continued from ``start_step`` with the same optimizer
    ends where one uninterrupted run does; the log line comes from ``format_step``."""
    from diffspec.train import fit

    data = torch.randn(6, 4, 6, generator=torch.Generator().manual_seed(2))
    cfg = TrainConfig(steps=6, lr=0.05, warmup_steps=1, max_grad_norm=0.3, log_every=100)

    def step_fn(module, x, backward):
        total = 0.0
        for half in (x[:2], x[2:]):  # each half's share of the batch mean
            loss = module(half).square().sum() / x.numel() * 2
            backward(loss)
            total += float(loss.detach())
        return {"loss": total}

    whole = fit(_linear(), iter(data), cfg, loss_fn=lambda m, x: m(x).square().mean(),
                use_accelerate=False, log=lambda msg: None)
    split = fit(_linear(), iter(data), cfg, step_fn=step_fn, use_accelerate=False,
                log=lambda msg: None)
    for a, b in zip(whole.module.parameters(), split.module.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    assert [round(h["loss"], 5) for h in whole.history] == \
        [round(h["loss"], 5) for h in split.history]

    model = _linear()
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas,
                                  weight_decay=cfg.weight_decay)
    lines: list[str] = []
    first = fit(model, iter(data), cfg, step_fn=step_fn, optimizer=optimizer,
                use_accelerate=False, on_step=lambda step, rec: step == 2, log=lines.append,
                format_step=lambda step, rec: f"at {step}")
    assert len(first.history) == 3 and lines == ["at 0", "at 2"]  # step 2 stopped: logged
    rest = fit(model, iter(data[3:]), cfg, step_fn=step_fn, optimizer=optimizer,
               start_step=3, reseed=False, use_accelerate=False, log=lambda msg: None)
    assert [h["lr"] for h in rest.history] == [cfg.lr * cosine_lr_scale(s, cfg)
                                               for s in range(3, 6)]
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(),
                                                 split.module.parameters(), strict=True))
    with pytest.raises(ValueError, match="not both"):
        fit(_linear(), iter(data), cfg, step_fn=step_fn, loss_fn=lambda m, x: m(x).sum())


# ----------------------------------------------------------------------------------- data


def test_pack_rows_concatenates_and_cuts():
    rows = list(pack_rows([[1, 2, 3], [4, 5], [6, 7, 8, 9]], seq_len=4))
    assert rows == [[1, 2, 3, 4], [5, 6, 7, 8]]


def test_sample_anchors_are_distinct_sorted_and_in_range():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        a = sample_anchors(40, 8, 10, gen)
        assert a.tolist() == sorted(set(a.tolist()))
        assert int(a.min()) >= 1 and int(a.max()) <= 40 - 8
    assert len(sample_anchors(12, 8, 10, gen)) == 4  # only 1..4 fit


def test_read_documents_text_and_jsonl(tmp_path):
    (tmp_path / "a.txt").write_text("hello world")
    (tmp_path / "b.jsonl").write_text('{"text": "x y"}\n\n{"token_ids": [3, 4]}\n')
    docs = list(read_documents([tmp_path]))
    assert docs == ["hello world", "x y", [3, 4]]

    class Tok:
        def __call__(self, text, add_special_tokens=False):
            return {"input_ids": [len(w) for w in text.split()]}

    got = list(tokenize_documents(docs, Tok(), eos_token_id=0))
    assert got == [[5, 5, 0], [1, 1, 0], [3, 4, 0]]


def test_anchor_blocks_layout_matches_the_dual_pass_mask():
    x = torch.arange(100, 120)[None].repeat(2, 1)  # [B=2, L=20]
    anchors = torch.tensor([[1, 9], [4, 12]])
    blocks = anchor_blocks(x, anchors, block_size=4, mask_token_id=7)
    assert blocks.input_ids[0].tolist() == [101, 7, 7, 7, 109, 7, 7, 7]
    assert blocks.position_ids[1].tolist() == [4, 5, 6, 7, 12, 13, 14, 15]
    full, _ = orthrus_dual_pass_mask(20, anchors[1], 4)
    assert torch.equal(blocks.attention_mask[1], full[20:])
    row = blocks.attention_mask[0, 5]  # a mask of the block at anchor 9
    assert row[:9].all() and not row[9:20].any() and row[24:28].all() and not row[20:24].any()


# ------------------------------------------------------------------------------- Orthrus


@pytest.fixture(scope="module")
def tiny_qwen3(tmp_path_factory) -> Path:
    from diffspec.testing.checkpoints import write_qwen3

    return write_qwen3(tmp_path_factory.mktemp("qwen3") / "base")


@pytest.fixture(scope="module")
def token_data(tmp_path_factory) -> str:
    """Pre-tokenized JSONL: repeating patterns, so a drafter has something to learn."""
    gen = torch.Generator().manual_seed(0)
    path = tmp_path_factory.mktemp("data") / "rows.jsonl"
    rows = []
    for _ in range(64):
        pattern = (torch.randint(20, 200, (6,), generator=gen)).tolist()
        rows.append(json.dumps({"token_ids": pattern * 8}))
    path.write_text("\n".join(rows) + "\n")
    return str(path)


def _tiny_cfg(steps: int = 8, seed: int = 0) -> TrainConfig:
    return TrainConfig(steps=steps, lr=5e-3, warmup_steps=2, batch_size=2, seq_len=40,
                       seed=seed, log_every=100)


def _orthrus_distiller(model, seed=0):
    from diffspec.train.orthrus import BlockDistiller

    return BlockDistiller(model.lm, block_size=model.block_size,
                          mask_token_id=model.mask_token_id, num_anchors=3,
                          draft_view=model.diffusion_view, seed=seed)


def test_orthrus_gradient_reaches_only_diff_params(tiny_qwen3):
    from diffspec.model_executors.reference.orthrus import orthrus_from_base
    from diffspec.train.orthrus import freeze_all_but

    model = orthrus_from_base(tiny_qwen3, block_size=8, mask_token_id=7)
    freeze_all_but(model.lm, model.diffusion_parameters())
    out = _orthrus_distiller(model)(torch.randint(10, 200, (2, 40)))
    out["loss"].backward()
    for name, p in model.lm.named_parameters():
        if "_diff." in name:
            assert p.grad is not None and p.grad.abs().sum() > 0, name
        else:
            assert p.grad is None, name


@pytest.fixture(scope="module")
def trained_orthrus(tiny_qwen3, token_data, tmp_path_factory):
    from diffspec.model_executors.reference.orthrus import orthrus_from_base
    from diffspec.train.orthrus import train_orthrus

    out = tmp_path_factory.mktemp("orthrus") / "trained"
    before = orthrus_from_base(tiny_qwen3, block_size=8, mask_token_id=7)
    result = train_orthrus(tiny_qwen3, out, _tiny_cfg(steps=12), data=[token_data],
                           block_size=8, mask_token_id=7, num_anchors=3)
    return before, result


def test_orthrus_training_reduces_the_loss_and_changes_only_diff_weights(
    trained_orthrus, token_data
):
    before, result = trained_orthrus
    lines = Path(token_data).read_text().splitlines()[:4]
    batch = torch.tensor([json.loads(line)["token_ids"][:40] for line in lines])  # [4, 40]
    with torch.no_grad():
        loss_before = _orthrus_distiller(before, seed=5)(batch)["loss"]
        loss_after = _orthrus_distiller(result.model, seed=5)(batch)["loss"]
    assert loss_after < loss_before
    old, new = before.lm.state_dict(), result.model.lm.state_dict()
    for name in old:
        if "_diff." in name:
            continue
        assert torch.equal(old[name], new[name]), f"AR weight {name} changed"
    assert any(not torch.equal(old[n], new[n]) for n in old if "_diff." in n)


def test_orthrus_save_load_round_trip(trained_orthrus, tiny_qwen3):
    from safetensors.torch import load_file

    from diffspec.model_executors.reference.orthrus import load_orthrus

    _, result = trained_orthrus
    loaded = load_orthrus(result.out_dir)
    assert loaded.block_size == 8 and loaded.mask_token_id == 7
    trained = result.model.lm.state_dict()
    for name, tensor in loaded.lm.state_dict().items():
        assert torch.equal(tensor, trained[name]), name
    base = load_file(str(tiny_qwen3 / "model.safetensors"))
    saved = load_file(str(result.out_dir / "model.safetensors"))
    assert all(torch.equal(saved[k], v) for k, v in base.items())  # AR bit-identical
    assert (result.out_dir / "training.json").is_file()


def test_orthrus_training_is_deterministic(tiny_qwen3, token_data):
    from diffspec.train.orthrus import train_orthrus

    runs = [train_orthrus(tiny_qwen3, None, _tiny_cfg(steps=3, seed=s), data=[token_data],
                          block_size=8, mask_token_id=7, num_anchors=3)
            for s in (1, 1, 2)]
    weights = [r.model.diffusion_parameters() for r in runs]
    assert all(torch.equal(a, b) for a, b in zip(weights[0], weights[1], strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(weights[0], weights[2], strict=True))


def test_orthrus_low_rank_heads_on_llama_train_only_the_factors(token_data, tmp_path):
    """``--rank``: a Llama base, only lora_A / lora_B train, the AR weights stay bit for bit,
    the run writes a heads folder, and materializing it gives the trained model's drafts."""
    from safetensors.torch import load_file

    from diffspec.model_executors.reference.orthrus import (
        load_orthrus,
        materialize_orthrus,
        orthrus_from_base,
    )
    from diffspec.spec_workers.reference.decoder import BlockDrafter, Request, speculative_generate
    from diffspec.testing.checkpoints import write_llama
    from diffspec.train.__main__ import main

    base = write_llama(tmp_path / "base")
    out = tmp_path / "heads"
    assert main(["orthrus", "--base", str(base), "--out", str(out), "--data", token_data,
                 "--rank", "4", "--mask-token-id", "4", "--block-size", "8", "--steps", "6",
                 "--batch-size", "2", "--seq-len", "40", "--num-anchors", "3",
                 "--lr", "5e-3", "--warmup-steps", "2"]) == 0
    assert {p.name for p in out.iterdir()} == {"heads.json", "heads.safetensors",
                                               "training.json", "TRAINING.md"}
    record = json.loads((out / "training.json").read_text())
    assert record["config"]["extra"]["rank"] == 4
    # 2 layers x (q, o: A [4, 64] + B [64, 4]; k, v: A [4, 64] + B [32, 4])
    assert record["trainable_parameters"] == 2 * (2 * 4 * (64 + 64) + 2 * 4 * (64 + 32))
    heads = load_file(str(out / "heads.safetensors"))
    assert any(k.endswith("lora_B") and v.abs().sum() > 0 for k, v in heads.items())

    full = load_orthrus(materialize_orthrus(base, out, tmp_path / "full"))
    start = orthrus_from_base(base, block_size=8, mask_token_id=4)
    trained_ar = {k: v for k, v in full.lm.state_dict().items() if "_diff." not in k}
    assert all(torch.equal(v, start.lm.state_dict()[k]) for k, v in trained_ar.items())
    changed = [k for k, v in full.lm.state_dict().items()
               if "_diff." in k and not torch.equal(v, start.lm.state_dict()[k])]
    assert len(changed) == 4 * 2  # every projection of both layers moved

    requests = [Request(list(range(20, 20 + n)), 10) for n in (3, 11)]
    from diffspec.model_executors.reference.orthrus import load_orthrus_heads

    heads_model = load_orthrus_heads(base, out)
    a, b = (speculative_generate(m.lm, BlockDrafter(m), requests, 7)
            for m in (heads_model, full))
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    assert [o.accept_lengths for o in a] == [o.accept_lengths for o in b]


def test_rank_refuses_an_orthrus_start(tmp_path, token_data):
    from diffspec.testing.checkpoints import write_orthrus
    from diffspec.train.orthrus import train_orthrus

    with pytest.raises(ValueError, match="already an Orthrus checkpoint"):
        train_orthrus(write_orthrus(tmp_path / "o"), None, _tiny_cfg(steps=1),
                      data=[token_data], rank=4)


# ---------------------------------------------------------------------------- NLD LoRA


def test_nld_lora_trainer_writes_a_peft_folder_that_load_nld_reads(tmp_path, token_data):
    from safetensors.torch import load_file

    from diffspec.model_executors.reference.nld import load_nld
    from diffspec.testing.checkpoints import write_nld
    from diffspec.train.nld_lora import lora_parameters, train_nld_lora

    base = write_nld(tmp_path / "nld", block_size=8, with_lora=False)
    before = load_nld(base, lora=False).lm.state_dict()
    result = train_nld_lora(base, tmp_path / "out", _tiny_cfg(steps=6), data=[token_data],
                            rank=4, alpha=16, num_anchors=3)
    lora = tmp_path / "out" / "linear_spec_lora"
    config = json.loads((lora / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["target_modules"] == ["o_proj"]
    assert config["r"] == 4 and config["lora_alpha"] == 16
    names = load_file(str(lora / "adapter_model.safetensors"))
    assert names and all(k.startswith("base_model.model.encoder.layers.") for k in names)

    loaded = load_nld(tmp_path / "out")
    assert loaded.has_lora
    trained = dict(zip([n for n, _ in result.model.lm.named_parameters() if ".lora_" in n],
                       lora_parameters(result.model), strict=True))
    for name, p in loaded.lm.named_parameters():
        if ".lora_" in name:
            assert torch.equal(p, trained[name]), name
    assert any(p.abs().sum() > 0 for n, p in trained.items() if "lora_B" in n)  # it trained
    after = result.model.lm.state_dict()
    for name, tensor in before.items():  # the backbone did not change
        assert torch.equal(after[name.replace("self_attn.o_proj.", "self_attn.o_proj.base_layer.")
                                 if name not in after else name], tensor), name
    assert load_file(str(base / "model.safetensors")).keys() == load_file(
        str(tmp_path / "out" / "model.safetensors")).keys()


def test_nld_lora_drafts_change_only_inside_the_draft_view(tmp_path, token_data):
    from diffspec.model_executors.reference.nld import load_nld
    from diffspec.testing.checkpoints import write_nld
    from diffspec.train.nld_lora import train_nld_lora

    base = write_nld(tmp_path / "nld", block_size=8, with_lora=False)
    plain = load_nld(base, lora=False)
    result = train_nld_lora(base, None, _tiny_cfg(steps=4), data=[token_data], rank=4,
                            alpha=16, num_anchors=3)
    ids = torch.randint(20, 200, (1, 12))
    with torch.no_grad():
        assert torch.equal(result.model.lm(input_ids=ids).logits, plain.lm(input_ids=ids).logits)


# Runs the trainer's CLI in each worker; an exit handler registered before anything else
# (so it runs after every other one) reports the gloo threads still alive at that point.
_DDP_WORKER = """
import atexit, os, sys
from pathlib import Path

def _report_gloo_threads():
    names = []
    for t in Path("/proc/self/task").iterdir():
        try:
            names.append(Path(t, "comm").read_text().strip())
        except FileNotFoundError:  # the thread ended after the listing: not alive at exit
            pass
    print(f"rank {os.environ['RANK']} gloo threads at exit: "
          f"{sorted(n for n in names if 'gloo' in n)}", flush=True)

if Path("/proc/self/task").is_dir():
    atexit.register(_report_gloo_threads)
from diffspec.train.__main__ import main
sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.slow
def test_orthrus_trains_under_two_processes(tiny_qwen3, token_data, tmp_path):
    """DDP on CPU (gloo), through accelerate: both processes train, the main one gathers
    the trained tensors and writes a checkpoint that loads; and each process has destroyed
    its process group before the interpreter shuts down. (Left to module teardown, the
    group was destroyed while Python finalized, with its threads running: now and then a
    gloo thread needing the GIL aborted its process, SIGABRT, "terminate called without an
    active exception". ``fit`` now leaves it at exit.)"""
    import os
    import subprocess
    import sys

    from diffspec.model_executors.reference.orthrus import load_orthrus

    out = tmp_path / "ddp"
    worker = tmp_path / "train_worker.py"
    worker.write_text(_DDP_WORKER)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
           str(worker), "orthrus", "--base", str(tiny_qwen3), "--out", str(out),
           "--data", token_data, "--block-size", "8", "--mask-token-id", "7",
           "--num-anchors", "3", "--batch-size", "2", "--seq-len", "40", "--steps", "3"]
    env = {**os.environ, "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=170,
                         check=False)
    assert run.returncode == 0, run.stderr[-6000:]
    if Path("/proc/self/task").is_dir():
        for rank in (0, 1):
            assert f"rank {rank} gloo threads at exit: []" in run.stdout, run.stdout[-3000:]
    assert "MULTI_CPU, 2 process(es)" in run.stderr
    model = load_orthrus(out)
    attn = model.lm.model.layers[0].self_attn
    assert not torch.equal(attn.q_proj.weight, attn.q_proj_diff.weight)  # it trained


# --------------------------------------------------------------------- shipped checkpoint


def test_shipped_synth_orthrus_drafts_are_accepted_and_lossless():
    from safetensors.torch import load_file

    from diffspec.model_executors.reference.orthrus import load_orthrus
    from diffspec.spec_workers.reference.decoder import BlockDrafter
    from diffspec.testing.synthetic import build_tokenizer, sample_prompts
    from diffspec.train import measure_speculation

    model = load_orthrus(SYNTH_ORTHRUS_DIR)
    base = load_file(str(SYNTH_QWEN3_DIR / "model.safetensors"))
    shipped = load_file(str(SYNTH_ORTHRUS_DIR / "model.safetensors"))
    assert all(torch.equal(shipped[k], v) for k, v in base.items())  # AR weights bit-identical
    tok = build_tokenizer()
    prompts = [tok(p, add_special_tokens=False)["input_ids"] for p in sample_prompts(6, 99)]
    report = measure_speculation(model.lm, BlockDrafter(model), prompts,
                                 model.block_size - 1, max_tokens=40)
    assert report["equal_ar"]
    assert report["mean_accept_length"] > 1.5, report
    assert math.isfinite(report["tpf"])


def test_slow_bf16_autocast_is_named_once_and_only_where_emulated(monkeypatch) -> None:
    """``--autocast-bf16`` on a CPU without native bf16 gets one warning line that says what
    to do; on a CPU with it, or on a GPU, nothing."""
    import diffspec.train as train

    lines: list[str] = []
    monkeypatch.setattr(train, "cpu_bf16_is_fast", lambda: False)
    train.warn_slow_autocast(True, "cpu", lines.append)
    train.warn_slow_autocast(False, "cpu", lines.append)
    train.warn_slow_autocast(True, "cuda", lines.append)
    assert len(lines) == 1 and "drop it" in lines[0]
    monkeypatch.setattr(train, "cpu_bf16_is_fast", lambda: True)
    train.warn_slow_autocast(True, "cpu", lines.append)
    assert len(lines) == 1


def test_rank_arg_takes_a_positive_integer_or_full() -> None:
    import argparse

    from diffspec.train import rank_arg

    assert rank_arg("64") == 64 and rank_arg("full") == "full"
    for bad in ("0", "-3", "dense", ""):
        with pytest.raises(argparse.ArgumentTypeError, match="positive integer or 'full'"):
            rank_arg(bad)


def test_torch_threads_sets_and_restores(monkeypatch) -> None:
    """The trainers' thread count: set for the block, the caller's back after it (also when
    the block raises); None or 0 leave torch's as it is."""
    from diffspec.train import torch_threads

    current = {"n": 4}
    monkeypatch.setattr(torch, "get_num_threads", lambda: current["n"])
    monkeypatch.setattr(torch, "set_num_threads", lambda n: current.update(n=n))
    with torch_threads(1):
        assert current["n"] == 1
    assert current["n"] == 4
    with pytest.raises(RuntimeError), torch_threads(2):
        assert current["n"] == 2
        raise RuntimeError("a failing step")
    assert current["n"] == 4
    for keep in (None, 0):
        with torch_threads(keep):
            assert current["n"] == 4


def test_resumed_run_keeps_its_saved_settings(tmp_path) -> None:
    """ResumableRun on resume: the first session's settings win over the caller's, its data
    files are read again, changed rows are refused, and the budget stop is logged."""
    from diffspec.train.runs import ResumableRun

    fresh = ResumableRun.open(tmp_path, resume=False)
    assert fresh.resumed(rank=64, block_size=8) == (64, 8)
    assert fresh.files(lambda: [Path("new.jsonl")]) == [Path("new.jsonl")]
    fresh.check_rows("anything")  # nothing to compare with
    fresh.state = {"settings": {"rank": 16, "block_size": 32},
                   "data": {"files": ["first.jsonl"], "rows_sha256": "abc"}}
    assert fresh.resumed(rank=64, block_size=8) == (16, 32)
    assert fresh.files(lambda: [Path("new.jsonl")]) == [Path("first.jsonl")]
    fresh.check_rows("abc")
    with pytest.raises(ValueError, match="--resume: the data rows differ"):
        fresh.check_rows("changed")
    logged: list[str] = []
    budget = ResumableRun.open(tmp_path / "b", resume=False, max_cpu_s=0.0)
    assert budget.stops_after(0, 5, logged.append) and "stopping after step 0" in logged[0]
    assert not budget.stops_after(4, 5, logged.append)  # the last step: nothing to stop
