"""EAGLE-3 drafter trainer (training.eagle3): layout, loss, resume, answer masking.

Tiny targets built in code (random weights); seconds on CPU.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from diffspec.train import TrainConfig
from training.eagle3 import (
    DrafterSpec,
    Eagle3Drafter,
    TargetFeatures,
    _ttt_attention,
    collate,
    default_aux_layer_ids,
    eagle3_loss,
    load_rows,
    loss_counts,
    train_eagle3,
    write_bf16_copy,
)

VOCAB = 64


def _tiny_target(path: Path, model_type: str = "qwen3", layers: int = 2) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    kwargs = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": layers, "num_attention_heads": 2, "num_key_value_heads": 1,
              "head_dim": 16, "max_position_embeddings": 128, "eos_token_id": 0,
              "pad_token_id": 0, "tie_word_embeddings": True}
    if model_type == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**kwargs))
    else:
        model = LlamaForCausalLM(LlamaConfig(**kwargs))
    model.save_pretrained(path)
    return path


def _rows(path: Path, n: int = 16, seed: int = 0, prompt_len: int = 6) -> Path:
    """JSONL rows: a random prompt, then a repetitive 'answer' (learnable)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for _ in range(n):
            prompt = [rng.randrange(1, VOCAB) for _ in range(prompt_len)]
            start = rng.randrange(1, VOCAB)
            answer = [(start + 3 * i) % (VOCAB - 1) + 1 for i in range(rng.randint(14, 24))]
            f.write(json.dumps({"token_ids": prompt + answer, "prompt_len": prompt_len}) + "\n")
    return path


def _cfg(steps: int, **kw) -> TrainConfig:
    base = {"steps": steps, "lr": 3e-3, "warmup_steps": 0, "batch_size": 4, "seq_len": 32,
            "seed": 0, "log_every": 1000}
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> Path:
    return _tiny_target(tmp_path_factory.mktemp("target") / "qwen3")


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> Path:
    return _rows(tmp_path_factory.mktemp("data") / "rows.jsonl")


def _tensors(folder: Path) -> dict[str, tuple[int, ...]]:
    from safetensors import safe_open

    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}  # noqa: SIM118


def test_default_aux_layers_follow_vllm():
    assert default_aux_layer_ids(30) == [2, 15, 27]  # SmolLM2-135M: vLLM's (2, L//2, L-3)
    assert default_aux_layer_ids(36) == [2, 18, 33]
    assert default_aux_layer_ids(2) == [0, 1, 2]  # too shallow: tiny_drafters' ids
    for layers in range(1, 40):
        ids = default_aux_layer_ids(layers)
        assert len(ids) == 3 and all(0 <= i <= layers for i in ids)


def test_checkpoint_layout_matches_vllm_eagle3(target, data, tmp_path):
    """Same tensor names and shapes as the published layout tiny_drafters writes (what
    vLLM's LlamaForCausalLMEagle3 loads), config with every key it writes."""
    from benchmarks.tiny_drafters import UNTRAINED, build_eagle3

    out = tmp_path / "drafter"
    train_eagle3(target, out, _cfg(2), data=[str(data)], save_every=0, log=lambda m: None)
    reference = build_eagle3(target, tmp_path / "reference")
    assert _tensors(out) == _tensors(reference)
    assert "embed_tokens.weight" not in _tensors(out)  # shared with the target
    config = json.loads((out / "config.json").read_text())
    ref_config = json.loads((reference / "config.json").read_text())
    assert set(ref_config) - {UNTRAINED} <= set(config)
    assert UNTRAINED not in config
    for key in ("architectures", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "head_dim", "num_hidden_layers", "vocab_size", "draft_vocab_size",
                "target_hidden_size", "eagle_config"):
        assert config[key] == ref_config[key], key
    record = json.loads((out / "training.json").read_text())
    assert record["steps"] == 2 and record["tokens_seen"] > 0 and record["cpu_time_s"] >= 0
    assert len(record["data"]["rows_sha256"]) == 64


def test_bf16_copy_halves_the_floats_and_keeps_the_index_maps(target, data, tmp_path):
    from safetensors.torch import load_file

    out = tmp_path / "drafter"
    train_eagle3(target, out, _cfg(1), data=[str(data)], draft_vocab_size=16, save_every=0,
                 log=lambda m: None)
    copy = write_bf16_copy(out, tmp_path / "shipped")
    full, half = load_file(str(out / "model.safetensors")), load_file(str(copy / "model.safetensors"))
    assert set(full) == set(half)
    for k, v in full.items():
        if v.is_floating_point():
            assert half[k].dtype == torch.bfloat16 and torch.equal(half[k], v.to(torch.bfloat16))
        else:
            assert half[k].dtype == v.dtype and torch.equal(half[k], v)  # d2t / t2d
    config = json.loads((copy / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    assert config["draft_vocab_size"] == json.loads((out / "config.json").read_text())[
        "draft_vocab_size"]
    assert (copy / "training.json").read_bytes() == (out / "training.json").read_bytes()
    assert not (copy / "checkpoint").exists()
    with pytest.raises(ValueError, match="write the copy to a folder other than the run"):
        write_bf16_copy(out, out)


def test_reduced_draft_vocab_writes_d2t(target, data, tmp_path):
    out = tmp_path / "drafter"
    result = train_eagle3(target, out, _cfg(1), data=[str(data)], draft_vocab_size=16,
                          save_every=0, log=lambda m: None)
    shapes = _tensors(out)
    assert shapes["lm_head.weight"] == (16, 32)
    assert shapes["d2t"] == (16,) and shapes["t2d"] == (VOCAB,)
    from safetensors.torch import load_file

    state = load_file(str(out / "model.safetensors"))
    target_ids = torch.arange(16) + state["d2t"]  # vLLM: target id = draft id + d2t
    assert torch.equal(target_ids, result.drafter.draft_ids)
    assert int(state["t2d"].sum()) == 16 and bool(state["t2d"][target_ids].all())
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 16


def test_fc_norm_variant_layout(target, data, tmp_path):
    """--fc-norm: vLLM's `fc_norm` (an RMSNorm per aux layer), weights fc_norm.{i}.weight."""
    out = tmp_path / "drafter"
    train_eagle3(target, out, _cfg(1), data=[str(data)], fc_norm=True, save_every=0,
                 log=lambda m: None)
    shapes = _tensors(out)
    assert {shapes[f"fc_norm.{i}.weight"] for i in range(3)} == {(32,)}
    assert json.loads((out / "config.json").read_text())["fc_norm"] is True


def test_loss_decreases(target, data):
    result = train_eagle3(target, None, _cfg(40), data=[str(data)], save_every=0,
                          log=lambda m: None)
    losses = [h["loss"] for h in result.history]
    assert sum(losses[-5:]) / 5 < 0.7 * losses[0]
    assert result.history[-1]["acc_0"] > result.history[0]["acc_0"]
    assert {"kl_0", "acc_0", "chain_0", "kl_2", "acc_2", "chain_2"} <= set(result.history[-1])


def test_resume_continues_the_same_run(target, data, tmp_path):
    """3 steps + resume to 6 == 6 steps straight (constant LR: the schedule does not
    depend on --steps), weights, optimizer and data order included."""
    cfg = {"min_lr_ratio": 1.0}
    straight = train_eagle3(target, tmp_path / "a", _cfg(6, **cfg), data=[str(data)],
                            save_every=0, log=lambda m: None)
    train_eagle3(target, tmp_path / "b", _cfg(3, **cfg), data=[str(data)], save_every=0,
                 log=lambda m: None)
    assert (tmp_path / "b" / "checkpoint" / "state.pt").is_file()
    resumed = train_eagle3(target, tmp_path / "b", _cfg(6, **cfg), data=[str(data)],
                           resume=True, log=lambda m: None)
    assert len(resumed.history) == 6
    assert [h["loss"] for h in resumed.history] == pytest.approx(
        [h["loss"] for h in straight.history], rel=1e-5)
    for (name, a), b in zip(straight.drafter.state_dict().items(),
                            resumed.drafter.state_dict().values(), strict=True):
        torch.testing.assert_close(a, b, msg=name)
    record = json.loads((tmp_path / "b" / "training.json").read_text())
    assert record["steps"] == 6 and len(record["sessions"]) == 2
    assert record["tokens_seen"] == json.loads(
        (tmp_path / "a" / "training.json").read_text())["tokens_seen"]


def test_cpu_budget_stops_and_resume_finishes(target, data, tmp_path):
    first = train_eagle3(target, tmp_path / "c", _cfg(5), data=[str(data)], max_cpu_s=0.0,
                         log=lambda m: None)
    assert len(first.history) == 1 and first.record["sessions"][0]["stopped_by_cpu_budget"]
    resumed = train_eagle3(target, tmp_path / "c", _cfg(5), data=[str(data)], resume=True,
                           log=lambda m: None)
    assert len(resumed.history) == 5


def test_resume_refuses_changed_data(target, data, tmp_path):
    train_eagle3(target, tmp_path / "d", _cfg(1), data=[str(data)], save_every=0,
                 log=lambda m: None)
    other = _rows(tmp_path / "rows.jsonl", seed=1)
    state = torch.load(tmp_path / "d" / "checkpoint" / "state.pt", weights_only=False)
    state["data"]["files"] = [str(other)]
    torch.save(state, tmp_path / "d" / "checkpoint" / "state.pt")
    with pytest.raises(ValueError, match="data rows differ"):
        train_eagle3(target, tmp_path / "d", _cfg(2), data=[str(data)], resume=True,
                     log=lambda m: None)


def test_answer_only_loss_positions():
    """Slot t at step k predicts token t+k+2: a loss only when that token is an answer
    token (index >= prompt_len) inside the row."""
    lengths, prompt_lens = torch.tensor([20, 12]), torch.tensor([8, 0])

    def expected(length: int, prompt: int, k: int) -> int:
        return sum(1 for t in range(length - 1) if max(prompt, 0) <= t + k + 2 < length)

    counts = loss_counts(lengths, prompt_lens, 3)
    assert counts == [expected(20, 8, k) + expected(12, 0, k) for k in range(3)]
    assert counts == [12 + 10, 12 + 9, 12 + 8]


def test_prompt_tokens_get_no_loss(target):
    """With prompt_len the loss covers the answer positions only, at every draft step; a
    row whose answer is empty has no loss at all."""
    feats = TargetFeatures.load(target, [0, 1, 2])
    spec = DrafterSpec.from_target(json.loads((target / "config.json").read_text()))
    torch.manual_seed(0)
    drafter = Eagle3Drafter(spec)
    ids = torch.randint(1, VOCAB, (1, 16))
    full = eagle3_loss(drafter, feats, ids, torch.tensor([16]), torch.tensor([0]), 3)
    answer = eagle3_loss(drafter, feats, ids, torch.tensor([16]), torch.tensor([10]), 3)
    assert [answer.sums[f"count_{k}"] for k in range(3)] == [6, 6, 6]
    assert [full.sums[f"count_{k}"] for k in range(3)] == [14, 13, 12]
    none = eagle3_loss(drafter, feats, ids, torch.tensor([16]), torch.tensor([16]), 3)
    assert none.loss_tokens == 0 and float(none.loss) == 0.0


def test_load_rows_cuts_and_drops(tmp_path):
    path = tmp_path / "rows.jsonl"
    rows = [{"token_ids": list(range(1, 41)), "prompt_len": 10},  # cut to 32, kept
            {"token_ids": list(range(1, 41)), "prompt_len": 35},  # answer beyond 32: dropped
            {"token_ids": list(range(1, 11))}]  # no prompt_len: all tokens trainable
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    kept, stats = load_rows([str(path)], 32)
    assert [len(r.token_ids) for r in kept] == [32, 10]
    assert [r.prompt_len for r in kept] == [10, 0]
    assert stats["rows_cut"] == 2 and stats["rows_dropped"] == 1 and stats["rows"] == 2


def test_ttt_attention_matches_dense_mask():
    """Step k, slot t sees step-0 keys of slots <= t and its own keys of steps 1..k (the
    draft KV cache at inference), checked against a dense masked softmax."""
    torch.manual_seed(0)
    b, nh, nkv, s, d, steps = 2, 4, 2, 7, 8, 3
    cache = [(torch.randn(b, nkv, s, d), torch.randn(b, nkv, s, d)) for _ in range(steps)]
    for k in range(steps):
        q = torch.randn(b, nh, s, d)
        got = _ttt_attention(q, cache[:k + 1], nh // nkv)
        keys = torch.cat([c[0] for c in cache[:k + 1]], dim=2).repeat_interleave(2, dim=1)
        values = torch.cat([c[1] for c in cache[:k + 1]], dim=2).repeat_interleave(2, dim=1)
        mask = torch.zeros(s, (k + 1) * s, dtype=torch.bool)
        for t in range(s):
            mask[t, :t + 1] = True
            for j in range(1, k + 1):
                mask[t, j * s + t] = True
        want = torch.nn.functional.scaled_dot_product_attention(q, keys, values,
                                                                attn_mask=mask)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_features_are_vllm_aux_hidden_states(tmp_path):
    """Aux id i = the residual stream entering decoder layer i (0: embeddings; L: the
    last layer's output before the final norm), as vLLM's EagleModelMixin collects them."""
    target = _tiny_target(tmp_path / "llama", "llama", layers=3)
    feats = TargetFeatures.load(target, [0, 2, 3])
    ids = torch.randint(1, VOCAB, (1, 9))
    aux, last = feats(ids)
    out = feats.model(input_ids=ids, output_hidden_states=True)
    hs = out.hidden_states  # transformers: embeddings, then each layer's output
    torch.testing.assert_close(aux[..., :32], hs[0])
    torch.testing.assert_close(aux[..., 32:64], hs[2])
    torch.testing.assert_close(aux[..., 64:], last)
    # the last layer's output, normed and read out, gives the model's logits
    torch.testing.assert_close(feats.teacher_logits(last[0]), out.logits[0], atol=1e-4,
                               rtol=1e-4)


def test_collate_pads_right():
    from training.eagle3 import Row

    ids, lengths, prompt_lens = collate([Row([5, 6, 7], 1), Row([8, 9], 0)])
    assert ids.tolist() == [[5, 6, 7], [8, 9, 0]]
    assert lengths.tolist() == [3, 2] and prompt_lens.tolist() == [1, 0]


def test_cli_runs_from_the_repository(target, data, tmp_path, capsys):
    """``python -m training.eagle3`` (the trainer lives outside the installed package):
    the options reach the trainer and the summary is printed; ``diffspec.train`` no longer
    has the subcommand."""
    from diffspec.train.__main__ import build_parser as package_parser
    from training.eagle3 import main

    out = tmp_path / "cli"
    assert main(["--base", str(target), "--data", str(data), "--out", str(out), "--steps",
                 "2", "--seq-len", "32", "--batch-size", "2", "--micro-batch", "2",
                 "--ttt-steps", "2", "--save-every", "0"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["steps"] == 2
    record = json.loads((out / "training.json").read_text())
    assert record["command"].startswith("python -m training.eagle3 --base")
    assert record["config"]["extra"]["ttt_steps"] == 2
    with pytest.raises(SystemExit):
        package_parser().parse_args(["eagle3", "--base", str(target)])
