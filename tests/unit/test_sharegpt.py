"""The ShareGPT distillation data generator, without vLLM and without the 125 MB file:
truncated-JSON recovery, prompt selection, the held-out split, row format, shard
planning and resume (with a fake engine), and the trainer's loader reading the rows."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from training import sharegpt
from training.sharegpt import (
    MANIFEST,
    ManifestMismatch,
    build_row,
    pending_shards,
    plan_shards,
    recover_json_array,
    split,
    user_prompts,
)


def _conv(cid: str, *turns: tuple[str, str]) -> dict:
    return {"id": cid, "conversations": [{"from": r, "value": v} for r, v in turns]}


CONVERSATIONS = [
    _conv("a_0", ("human", "  What is a monad?  "), ("gpt", "A monoid in ...")),
    _conv("a_1", ("gpt", "...continued"), ("human", "continue")),  # a later part
    _conv("b_0", ("system", "be brief"), ("human", "Write a haiku"), ("gpt", "...")),
    _conv("c_0", ("human", "What is a monad?"), ("gpt", "again")),  # duplicate once stripped
    _conv("d_0", ("human", "   "), ("gpt", "?")),  # empty
    _conv("e_0", ("user", "Sort a list in Python"), ("gpt", "sorted(x)")),
    _conv("f_0"),  # no turns
    _conv("g_0", ("human", 'A "quoted" {brace} [bracket] \\ prompt'), ("gpt", "ok")),
]


# ------------------------------------------------------------------------ JSON recovery


def test_recovers_complete_objects_of_a_cut_array():
    text = json.dumps(CONVERSATIONS, indent=2)
    cut_at = text.index("Sort a list")  # mid-string, inside the 6th object
    items, complete = recover_json_array(text[:cut_at])
    assert not complete
    assert items == CONVERSATIONS[:5]
    # cut right after the comma, in the whitespace, right after the opening brace
    start = text.rindex("{", 0, text.index('"e_0"'))
    comma = text.rindex(",", 0, start)
    for end in (comma + 1, start - 1, start, start + 1):
        assert recover_json_array(text[:end])[0] == CONVERSATIONS[:5]


def test_reads_a_complete_array_and_rejects_non_arrays():
    text = json.dumps(CONVERSATIONS)
    assert recover_json_array(text) == (CONVERSATIONS, True)
    assert recover_json_array("[]") == ([], True)
    assert recover_json_array("[") == ([], False)
    with pytest.raises(ValueError):
        recover_json_array('{"a": 1}')


def test_load_conversations_from_a_truncated_file(tmp_path):
    path = tmp_path / "sharegpt.json"
    text = json.dumps(CONVERSATIONS, indent=2)
    path.write_text(text[: text.index("haiku")], encoding="utf-8")
    messages = []
    assert sharegpt.load_conversations(path, log=messages.append) == CONVERSATIONS[:2]
    assert "2 conversations recovered" in messages[0] and "truncated" in messages[0]


# ----------------------------------------------------------------------------- prompts


def test_user_prompts_are_opening_turns_stripped_and_deduplicated():
    assert user_prompts(CONVERSATIONS) == [
        "What is a monad?", "Write a haiku", "Sort a list in Python",
        'A "quoted" {brace} [bracket] \\ prompt']
    assert "continue" in user_prompts(CONVERSATIONS, opening_only=False)
    assert user_prompts(CONVERSATIONS) == user_prompts(list(CONVERSATIONS))  # deterministic


class _CharTokenizer:
    """One token per character."""

    def __call__(self, texts, add_special_tokens=False):
        return {"input_ids": [list(range(len(t))) for t in texts]}


def test_user_prompts_token_limit():
    # 16, 13, 21 and 38 characters
    assert user_prompts(CONVERSATIONS, _CharTokenizer(), max_prompt_tokens=16) == [
        "What is a monad?", "Write a haiku"]
    assert user_prompts(CONVERSATIONS, _CharTokenizer(), max_prompt_tokens=0) == \
        user_prompts(CONVERSATIONS)


# ------------------------------------------------------------------------------- split


def test_split_is_deterministic_disjoint_and_order_independent():
    prompts = [f"prompt number {i}" for i in range(2000)]
    train, held = split(prompts, held_out=0.05, seed=0)
    assert set(train).isdisjoint(held) and len(train) + len(held) == len(prompts)
    assert 50 < len(held) < 150  # ~5%
    assert train == [p for p in prompts if p in set(train)]  # input order kept
    shuffled = prompts[:]
    random.Random(1).shuffle(shuffled)
    train2, held2 = split(shuffled, held_out=0.05, seed=0)
    assert set(held2) == set(held) and set(train2) == set(train)
    # a prompt's side does not depend on which other prompts are in the list
    assert split(prompts[:100], 0.05, 0)[1] == [p for p in held if p in set(prompts[:100])]
    assert set(split(prompts, 0.05, seed=1)[1]) != set(held)
    assert split(prompts, 0.0)[1] == []
    assert all(sharegpt.is_held_out(p, 0.05, 0) for p in held)


def test_split_hash_is_pinned():
    # changing the hash would move prompts between train and held-out: keep it fixed
    assert sharegpt._unit_hash("hi", 0) == pytest.approx(0.5232009454261246, abs=1e-15)
    assert sharegpt._unit_hash("Write a haiku", 0) == pytest.approx(0.26958515127679394,
                                                                     abs=1e-15)
    held = split([f"prompt number {i}" for i in range(200)], 0.05, 0)[1]
    assert held == [f"prompt number {i}" for i in (16, 54, 75, 78, 82, 124, 178)]


# -------------------------------------------------------------------------------- rows


def test_build_row_marks_eos_and_cut_answers():
    eos = 2
    row = build_row([1, 5, 6], [7, 8, eos], eos, finish_reason="stop", index=3)
    assert row == {"source": "sharegpt", "token_ids": [1, 5, 6, 7, 8, eos], "prompt_len": 3,
                   "finish": "stop", "index": 3}
    cut = build_row([1, 5], [7, 8, 9], eos, finish_reason="length")
    assert cut["finish"] == "length" and cut["token_ids"] == [1, 5, 7, 8, 9]
    # anything after the first EOS is dropped; without a reason the EOS decides
    assert build_row([1], [7, eos, 9], eos)["token_ids"] == [1, 7, eos]
    assert build_row([1], [7, 9], eos)["finish"] == "length"
    assert build_row([1], [7, 9], eos, finish_reason="stop")["finish"] == "stop"


# ------------------------------------------------------------------------------ shards


def test_plan_shards_prefix_stable():
    prompts = [f"p{i}" for i in range(10)]
    shards = plan_shards(prompts, 4)
    assert [(s.name, s.start, s.stop) for s in shards] == [
        ("shard-00000.jsonl", 0, 4), ("shard-00001.jsonl", 4, 8), ("shard-00002.jsonl", 8, 10)]
    longer = plan_shards(prompts + ["p10", "p11", "p12"], 4)
    assert longer[:2] == shards[:2] and longer[2] != shards[2]  # the short shard changes
    with pytest.raises(ValueError):
        plan_shards(prompts, 0)


def test_pending_shards():
    shards = plan_shards([f"p{i}" for i in range(10)], 4)
    assert pending_shards(shards, {}, []) == shards
    manifest = {"shards": {s.name: {"prompt_sha256": s.prompt_sha256} for s in shards[:2]}}
    # done = recorded with the same prompts AND the file is there
    assert pending_shards(shards, manifest, [s.name for s in shards[:2]]) == shards[2:]
    assert pending_shards(shards, manifest, [shards[0].name]) == shards[1:]
    manifest["shards"][shards[0].name]["prompt_sha256"] = "other prompts"
    assert pending_shards(shards, manifest, [s.name for s in shards]) == [shards[0], shards[2]]


# ------------------------------------------------------------------ generate (fake engine)


class _Tokenizer:
    """A stand-in chat tokenizer: one id per character, a fixed template."""

    eos_token_id = 2

    def apply_chat_template(self, messages, tokenize, add_generation_prompt, return_dict):
        assert tokenize and add_generation_prompt and return_dict
        return {"input_ids": [1] + [10 + ord(c) % 50 for c in messages[0]["content"]] + [3]}


class _Engine:
    name = "fake"

    def __init__(self):
        self.calls = []

    def __call__(self, prompt_ids, max_new_tokens):
        self.calls.append(len(prompt_ids))
        out = []
        for ids in prompt_ids:
            if len(ids) % 2:  # odd: stops with EOS; even: runs to the cap
                out.append(([70 + len(ids) % 7, 71, _Tokenizer.eos_token_id], "stop"))
            else:
                out.append(([80] * max_new_tokens, "length"))
        return out


@pytest.fixture
def model_dir(tmp_path) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    (model / "model.safetensors").write_bytes(b"weights")
    return model


def _generate(model, prompts, out, engine, **kw):
    kw = {"max_new_tokens": 5, "shard_size": 3, **kw}
    return sharegpt.generate(model, prompts, out, engine=engine, tokenizer=_Tokenizer(),
                             log=lambda msg: None, **kw)


def test_generate_writes_shards_and_resumes(model_dir, tmp_path):
    prompts = [f"prompt {'x' * i}" for i in range(8)]
    out = tmp_path / "out"
    engine = _Engine()
    manifest = _generate(model_dir, prompts, out, engine, provenance={"split_seed": 0})
    assert engine.calls == [3, 3, 2]
    assert sorted(p.name for p in out.iterdir()) == [
        MANIFEST, "shard-00000.jsonl", "shard-00001.jsonl", "shard-00002.jsonl"]
    rows = [json.loads(line) for f in sorted(out.glob("shard-*.jsonl"))
            for line in f.read_text().splitlines()]
    assert [r["index"] for r in rows] == list(range(8))
    for r, p in zip(rows, prompts):
        assert r["token_ids"][:r["prompt_len"]] == _Tokenizer().apply_chat_template(
            [{"role": "user", "content": p}], True, True, True)["input_ids"]
        answer = r["token_ids"][r["prompt_len"]:]
        assert (r["finish"] == "stop") == (answer[-1] == 2)
        assert r["finish"] == "stop" or len(answer) == 5
    on_disk = json.loads((out / MANIFEST).read_text())
    assert on_disk == manifest
    assert manifest["model"]["config_sha256"] and manifest["settings"]["max_new_tokens"] == 5
    assert manifest["prompts"]["count"] == 8 and manifest["prompts"]["split_seed"] == 0
    assert manifest["totals"]["prompts"] == 8
    assert manifest["totals"]["answer_tokens"] == sum(
        len(r["token_ids"]) - r["prompt_len"] for r in rows)
    assert manifest["totals"]["stop"] == sum(r["finish"] == "stop" for r in rows)
    assert not list(out.glob(".*"))  # no temp file left

    # resume: nothing to do, the engine is not even needed
    shard_bytes = {p.name: p.read_bytes() for p in out.glob("shard-*.jsonl")}
    _generate(model_dir, prompts, out, engine=_Failing())
    assert {p.name: p.read_bytes() for p in out.glob("shard-*.jsonl")} == shard_bytes

    # a lost shard is generated again, the others are kept
    (out / "shard-00001.jsonl").unlink()
    engine = _Engine()
    _generate(model_dir, prompts, out, engine)
    assert engine.calls == [3]
    assert (out / "shard-00001.jsonl").read_bytes() == shard_bytes["shard-00001.jsonl"]

    # more prompts: the short last shard is redone, then the new ones
    engine = _Engine()
    manifest = _generate(model_dir, prompts + ["one more", "two more"], out, engine)
    assert engine.calls == [3, 1]
    assert manifest["totals"]["prompts"] == 10


class _Failing:
    name = "fake"

    def __call__(self, prompt_ids, max_new_tokens):
        raise AssertionError("nothing should be generated")


def test_generate_refuses_other_settings_or_model(model_dir, tmp_path):
    out = tmp_path / "out"
    _generate(model_dir, ["a", "b"], out, _Engine())
    with pytest.raises(ManifestMismatch, match="max_new_tokens"):
        _generate(model_dir, ["a", "b"], out, _Engine(), max_new_tokens=6)
    (model_dir / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(ManifestMismatch, match="model.safetensors"):
        _generate(model_dir, ["a", "b"], out, _Engine())


def test_rows_round_trip_through_the_trainer_loader(model_dir, tmp_path):
    from diffspec.train.data import pack_rows, read_documents, tokenize_documents

    prompts = ["hello there", "what is 2+2", "tell me a joke"]
    out = tmp_path / "out"
    _generate(model_dir, prompts, out, _Engine())
    rows = [json.loads(line) for f in sorted(out.glob("shard-*.jsonl"))
            for line in f.read_text().splitlines()]
    # the folder itself is a --data source: the manifest is not read as data
    docs = list(read_documents([out]))
    assert docs == [r["token_ids"] for r in rows]
    ids = list(tokenize_documents(docs, tokenizer=None, eos_token_id=2))
    assert ids[0] == rows[0]["token_ids"] + ([] if rows[0]["finish"] == "stop" else [2])
    assert list(pack_rows(ids, 8))
    # export: one JSONL with the same rows; cut answers can be left out
    summary = sharegpt.export(out, tmp_path / "all.jsonl")
    assert summary == {"rows": 3, "dropped": 0}
    assert list(read_documents([tmp_path / "all.jsonl"])) == docs
    summary = sharegpt.export(out, tmp_path / "eos.jsonl", drop_cut=True)
    assert summary["rows"] == sum(r["finish"] == "stop" for r in rows)


def test_write_held_out(tmp_path):
    from benchmarks.datasets import load_prompts

    path = sharegpt.write_held_out(tmp_path / "held.jsonl", ["q one", 'q "two"'])
    prompts = load_prompts("jsonl", path)
    assert [p.text for p in prompts] == ["q one", 'q "two"']
    assert {p.category for p in prompts} == {"sharegpt"}
    (tmp_path / "gen").mkdir()
    (tmp_path / "gen" / MANIFEST).write_text("{}")
    with pytest.raises(ValueError):
        sharegpt.write_held_out(tmp_path / "gen" / "held.jsonl", ["q"])


def test_cli_help_explains_each_command(capsys):
    for cmd in ([], ["generate"], ["held-out"], ["export"]):
        with pytest.raises(SystemExit):
            sharegpt.main([*cmd, "--help"])
    text = capsys.readouterr().out
    assert "resum" in text and "--max-new-tokens" in text and "--dataset jsonl" in text


def test_packed_answers_rebuild_the_same_shards_without_an_engine(model_dir, tmp_path):
    prompts = [f"prompt {'y' * i}" for i in range(7)]
    out = tmp_path / "out"
    _generate(model_dir, prompts, out, _Engine())
    packed = tmp_path / "answers.jsonl.gz"
    summary = sharegpt.pack_answers(out, packed)
    assert summary["rows"] == 7 and summary["bytes"] == packed.stat().st_size
    assert b"yyy" not in __import__("gzip").decompress(packed.read_bytes())  # no prompt text
    # replayed (engine=None: vLLM would start only for a prompt the file lacks)
    again = tmp_path / "again"
    manifest = sharegpt.generate(model_dir, prompts, again, max_new_tokens=5, shard_size=3,
                                 tokenizer=_Tokenizer(), replay=packed, log=lambda m: None)
    assert manifest["settings"]["engine"] == "vllm, replayed from answers.jsonl.gz"
    for shard in sorted(out.glob("shard-*.jsonl")):
        assert (again / shard.name).read_bytes() == shard.read_bytes()
    # a prompt the file lacks goes to the fallback engine, the others are replayed
    model = sharegpt.model_fingerprint(model_dir)
    settings = json.loads((out / MANIFEST).read_text())["settings"]
    fallback = _Engine()
    replay = sharegpt.ReplayEngine(packed, model, settings, lambda: fallback, log=lambda m: None)
    ids = [_Tokenizer().apply_chat_template([{"role": "user", "content": p}], True, True,
                                            True)["input_ids"] for p in (prompts[0], "new one")]
    answers = replay(ids, 5)
    assert fallback.calls == [1] and answers[1] == _Engine()([ids[1]], 5)[0]
    assert (replay.replayed, replay.generated) == (1, 1)
    # answers of other settings or weights are refused
    with pytest.raises(ValueError, match="leave out --replay-answers.*max_new_tokens"):
        sharegpt.ReplayEngine(packed, model, {**settings, "max_new_tokens": 6})
    (model_dir / "model.safetensors").write_bytes(b"other weights")
    with pytest.raises(ValueError, match="model files differ"):
        sharegpt.ReplayEngine(packed, sharegpt.model_fingerprint(model_dir), settings)
