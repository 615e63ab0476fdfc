"""The synthetic language, its tokenizer, the training run and the bundled checkpoint."""

from __future__ import annotations

import json
from collections import Counter

import pytest
import torch

from diffspec.assets import SYNTH_QWEN3_DIR
from diffspec.testing import synthetic
from diffspec.testing.synthetic import (
    ENDOFTEXT,
    IM_END,
    SPECIAL_TOKENS,
    build_tokenizer,
    language,
    sample_documents,
    sample_prompts,
    train_synthetic_model,
)


def test_language_is_well_formed():
    lang = language()
    assert len(lang.words) == synthetic.NUM_WORDS == len(set(lang.words))
    assert len(lang.phrases) == synthetic.NUM_PHRASES
    assert len({p[0] for p in lang.phrases}) == synthetic.NUM_PHRASES  # unique first words
    assert all(4 <= len(p) <= 12 for p in lang.phrases)
    assert sorted(lang.successor) == list(range(synthetic.NUM_PHRASES))  # a permutation
    for start in range(synthetic.NUM_PHRASES):  # made of short cycles
        p, length = lang.successor[start], 1
        while p != start:
            p, length = lang.successor[p], length + 1
        assert 3 <= length <= 4


SAMPLING_CASES = {
    "documents_same_seed": (lambda: sample_documents(20, seed=3), True),
    "prompts_same_seed": (lambda: sample_prompts(10, seed=3), True),
}


@pytest.mark.parametrize("name", list(SAMPLING_CASES))
def test_sampling_is_deterministic(name):
    fn, _ = SAMPLING_CASES[name]
    assert fn() == fn()


def test_documents_depend_on_seed_and_end_with_eos():
    docs = sample_documents(200, seed=0)
    assert docs != sample_documents(200, seed=1)
    assert all(d.endswith(ENDOFTEXT) for d in docs)
    chats = [d for d in docs if d.startswith("<|im_start|>")]
    assert 0.1 < len(chats) / len(docs) < 0.3
    assert all(f"{IM_END} {ENDOFTEXT}" in d for d in chats)


def test_tokenizer_round_trip_and_specials():
    tok = build_tokenizer()
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.eos_token == ENDOFTEXT and tok.mask_token == "<|mask|>"
    for doc in sample_documents(30, seed=2) + sample_prompts(5, seed=2):
        ids = tok(doc)["input_ids"]
        assert tok.unk_token_id not in ids
        assert tok.decode(ids) == doc
    chat = tok.apply_chat_template([{"role": "user", "content": sample_prompts(1, 0)[0]}],
                                   tokenize=False, add_generation_prompt=True)
    assert tok.unk_token_id not in tok(chat)["input_ids"]


def test_training_is_deterministic(tmp_path):
    from safetensors.torch import load_file

    small = dict(batch_size=2, seq_len=32, log_every=0)
    records = [train_synthetic_model(tmp_path / name, steps=3, seed=5, **small)
               for name in ("a", "b")]
    a = load_file(str(tmp_path / "a" / "model.safetensors"))
    b = load_file(str(tmp_path / "b" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert records[0]["final_loss"] == records[1]["final_loss"]
    c = train_synthetic_model(tmp_path / "c", steps=3, seed=6, **small)
    assert c["final_loss"] != records[0]["final_loss"]
    for f in ("config.json", "generation_config.json", "tokenizer.json", "TRAINING.md",
              "training.json"):
        assert (tmp_path / "a" / f).is_file()


def test_bundled_checkpoint():
    from transformers import AutoConfig, AutoTokenizer

    path = SYNTH_QWEN3_DIR
    config = AutoConfig.from_pretrained(str(path))
    assert config.architectures == ["Qwen3ForCausalLM"]
    assert config.head_dim >= 32  # vLLM's CPU attention rejects 16
    tok = AutoTokenizer.from_pretrained(str(path))
    assert len(tok) == config.vocab_size
    generation = json.loads((path / "generation_config.json").read_text())
    assert sorted(generation["eos_token_id"]) == sorted(
        tok.convert_tokens_to_ids([ENDOFTEXT, IM_END]))
    record = json.loads((path / "training.json").read_text())
    assert {"command", "seed", "steps", "final_loss", "wall_time_s"} <= record.keys()
    size = sum(f.stat().st_size for f in path.iterdir())
    assert size < 3 * 2**20, size
    assert Counter(f.suffix for f in path.iterdir())[".safetensors"] == 1


def test_trainer_schedules():
    cfg = synthetic.TrainConfig(steps=100, warmup=10, lr=2e-3)
    lr = synthetic.warmup_cosine_lr(cfg)
    assert lr(0) == 2e-3 * 1 / 10 and lr(9) == 2e-3 and lr(10) == 2e-3
    assert lr(100) == pytest.approx(2e-4) and 2e-4 < lr(55) < 2e-3
    to_zero = synthetic.warmup_cosine_to_zero_lr(cfg)
    assert to_zero(0) == 2e-3 * min(1 / 10, 1.0) and to_zero(99) < 1e-6
    assert to_zero(50) == pytest.approx(1e-3)  # the cosine runs over all steps


def test_trainer_cli_records_the_command_it_runs(capsys):
    from diffspec.testing.synthetic_tidar import TiDARTrainConfig

    module = "diffspec.testing.synthetic_tidar"
    parser, _, train = synthetic.trainer_cli(module, "train", TiDARTrainConfig)
    train.add_argument("--block-size", type=int, default=8)
    args = parser.parse_args(["train", "--out", "/tmp/x", "--steps", "3"])
    calls = []

    def fake_train(out, command, **kwargs):
        calls.append((out, command, kwargs))
        return {"command": command, "config": {"hidden": True}}

    assert synthetic.run_train(module, args, fake_train,
                               ("out", "steps", "seed", "block_size")) == 0
    command = f"python -m {module} train --out /tmp/x --steps 3 --seed 0 --block-size 8"
    assert calls == [("/tmp/x", command, {"steps": 3, "seed": 0, "block_size": 8})]
    assert json.loads(capsys.readouterr().out) == {"command": command}
