"""The GPU command (training/gpu_run.py) on CPU: the carried GGUF parts reassemble (and
refuse to when one is missing or damaged), and ``run --device cpu`` on a few rows of the
bundled synth-qwen3 generates the data, trains both drafters, measures both curves on
held-out answers, bundles what comes back, stops generating when its time is up, and
resumes; ``unpack`` rebuilds the folders."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from training import gpu_run

BASE = Path(__file__).resolve().parents[2] / "diffspec" / "assets" / "synth-qwen3"


def test_parts_split_and_reassemble(tmp_path):
    src = tmp_path / "model.gguf"
    data = bytes(range(256)) * 41  # 10,496 bytes
    src.write_bytes(data)
    parts = gpu_run.split_file(src, [tmp_path / "stage-1", tmp_path / "stage-2",
                                     tmp_path / "run"], 4096)
    assert [p["bytes"] for p in parts] == [4096, 4096, 2304]
    index = {"name": src.name, "sha256": hashlib.sha256(data).hexdigest(), "parts": parts}
    stage = tmp_path / "stage"  # what the staging calls copy the first parts into
    stage.mkdir()
    for folder in ("stage-1", "stage-2"):
        for f in (tmp_path / folder).iterdir():
            (stage / f.name).write_bytes(f.read_bytes())
    out = gpu_run.assemble(index, [stage, tmp_path / "run"], tmp_path / "work" / src.name)
    assert out.read_bytes() == data

    (stage / parts[1]["name"]).unlink()  # the machine went cold between calls
    with pytest.raises(FileNotFoundError, match="^stage the GGUF parts first"):
        gpu_run.assemble(index, [stage, tmp_path / "run"], tmp_path / "again" / src.name)
    (stage / parts[1]["name"]).write_bytes(b"x" * 4096)  # a part of another pack
    with pytest.raises(FileNotFoundError, match=parts[1]["name"]):
        gpu_run.assemble(index, [stage, tmp_path / "run"], tmp_path / "again" / src.name)
    rest = gpu_run.split_file(src, [tmp_path / "a", tmp_path / "b"], 1024)
    assert [p["bytes"] for p in rest] == [1024, len(data) - 1024]  # the last takes the rest


def test_generation_batches_bound_rows_and_padded_tokens():
    engine = gpu_run.HFEngine(None, batch_size=3, eos_token_id=0, pad_token_id=0,
                              max_batch_tokens=40)
    lengths = [12, 3, 5, 30, 4, 6, 9]
    batches = engine.batches(lengths)
    assert sorted(i for b in batches for i in b) == list(range(len(lengths)))
    assert all(len(b) <= 3 and len(b) * max(lengths[i] for i in b) <= 40 or len(b) == 1
               for b in batches)
    assert batches[0] == [1, 4, 2]  # shortest first: 3, 4, 5 tokens


def test_run_on_cpu_trains_both_drafters_and_resumes(tmp_path):
    from diffspec.model_executors.reference.orthrus import load_orthrus_heads
    from diffspec.testing.synthetic import sample_prompts

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps({"train": sample_prompts(12, 7),
                                   "held_out": sample_prompts(4, 99)}))
    args = ["run", "--device", "cpu", "--base", str(BASE), "--prompts", str(prompts),
            "--rows", "8", "--steps", "2", "--rank", "8", "--heldout-prompts", "4",
            "--gen-batch", "4", "--max-new-tokens", "24", "--batch-size", "4",
            "--micro-batch", "2", "--seq-len", "96", "--work", str(tmp_path / "work"),
            "--out", str(tmp_path / "out")]
    assert gpu_run.main(args + ["--gen-seconds", "0"]) == 0

    curve = json.loads((tmp_path / "out" / "curve.json").read_text())
    assert curve["generation"]["prompts"] == 4  # no time: the first shard of 4 only
    assert curve["heldout_generation"]["prompts"] == 4
    for name, positions in (("orthrus", "accept_6"), ("eagle3", "accept_2")):
        points = curve["training"][name]["heldout_curve"]
        assert [p["step"] for p in points] == [0, 1, 2]  # untrained, every step, the end
        assert all(1.0 <= p["est_al"] and positions in p for p in points)
        assert curve["training"][name]["steps"] == 2
    manifest = json.loads((tmp_path / "work" / "heldout" / "manifest.json").read_text())
    assert manifest["prompts"]["split"] == "held-out"  # the trainers refuse this folder

    back = gpu_run.unpack(tmp_path / "out", tmp_path / "back")
    heads = json.loads((back / "orthrus" / "heads.json").read_text())
    assert (heads["rank"], heads["block_size"]) == (8, 8)
    model = load_orthrus_heads(BASE, back / "orthrus")
    assert model.rank == 8
    drafter = json.loads((back / "eagle3" / "config.json").read_text())
    assert drafter["architectures"] == ["LlamaForCausalLMEagle3"]
    assert (back / "eagle3" / "model.safetensors").is_file()
    assert len(list((back / "rows" / "data").glob("shard-*.jsonl"))) == 1
    assert all(p.stat().st_size < 16 * 2**20 for p in (tmp_path / "out").iterdir())

    assert gpu_run.main(args + ["--resume", "--out", str(tmp_path / "out2")]) == 0
    curve = json.loads((tmp_path / "out2" / "curve.json").read_text())
    assert curve["generation"]["prompts"] == 8  # the second shard now; the first kept
    for name in ("orthrus", "eagle3"):  # resumed on the first session's rows
        assert curve["training"][name]["steps"] == 4  # two more after the saved two
        assert [p["step"] for p in curve["training"][name]["heldout_curve"]][-1] == 4
