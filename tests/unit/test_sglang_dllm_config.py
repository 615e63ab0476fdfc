"""The SGLang dLLM plugin's engine-free parts (:mod:`diffspec.plugin.sglang.dllm`): which
architectures ``--dllm-algorithm FastDLLM`` serves and how its YAML is checked. The
``DllmConfig`` it builds is checked in a real SGLang (tests/engine/test_sglang_fast_dllm.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from diffspec.core.checkpoint import CheckpointError
from diffspec.methods import FAMILIES, get_method
from diffspec.plugin.sglang.dllm import dllm_architectures, fast_dllm_options
from diffspec.spec_workers.sglang.requests import fast_dllm_request_error


def test_served_architectures_are_the_fast_dllm_families_with_an_sglang_model() -> None:
    archs = dllm_architectures()
    assert archs == ("LLaDAModelLM", "DreamModel", "Fast_dLLM_QwenForCausalLM",
                     "NemotronLabsDiffusionModel")
    for arch in archs:
        family = next(f for f in FAMILIES.values() if arch in f.architectures)
        assert family.name in get_method("fast_dllm").families
    # NLD (diffusion mode) is the one with an AR view: its class serves both modes
    assert [a for a in archs if FAMILIES["nld"].sglang_models.get(a)] == [
        "NemotronLabsDiffusionModel"]


YAML_CASES = {
    "empty": ("", {}),
    "settings": ("threshold: 0.8\nblock_size: 16\nsub_block_size: 4\ncache: prefix\n",
                 {"threshold": 0.8, "block_size": 16, "sub_block_size": 4, "cache": "prefix"}),
}


@pytest.mark.parametrize("case", list(YAML_CASES))
def test_yaml_options_are_read(tmp_path: Path, case: str) -> None:
    text, want = YAML_CASES[case]
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    assert fast_dllm_options(str(path)) == want
    assert fast_dllm_options(None) == {}


@pytest.mark.parametrize(("text", "first_words"), [
    ("steps: 4\n", "remove steps from"),
    ("- threshold\n", "make "),
])
def test_bad_yaml_says_what_to_do(tmp_path: Path, text: str, first_words: str) -> None:
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    with pytest.raises(CheckpointError) as info:
        fast_dllm_options(str(path))
    assert str(info.value).startswith(first_words)


def test_diffusion_configs_load_without_remote_code(tmp_path: Path) -> None:
    """``llada`` / ``Dream`` / ``Fast_dLLM_Qwen`` configs load through transformers'
    AutoConfig once registered (as SGLang's model config loads them), LLaDA's OLMo names
    read as the Llama ones."""
    from transformers import AutoConfig

    from diffspec.assets import SYNTH_DLLM_DIR
    from diffspec.plugin.hf_configs import register_model_types
    from diffspec.testing.checkpoints import write_dream

    for name in ("llada", "dream", "fast_dllm_v2"):
        register_model_types(FAMILIES[name].hf_configs)
    llada = AutoConfig.from_pretrained(SYNTH_DLLM_DIR / "llada")
    assert (llada.hidden_size, llada.num_attention_heads, llada.num_key_value_heads,
            llada.num_hidden_layers, llada.intermediate_size, llada.head_dim,
            llada.max_position_embeddings, llada.vocab_size, llada.tie_word_embeddings,
            llada.rope_theta) == (96, 3, 1, 2, 256, 32, 1024, 224, False, 500000.0)
    v2 = AutoConfig.from_pretrained(SYNTH_DLLM_DIR / "fast_dllm_v2")
    assert (v2.model_type, v2.bd_size, v2.mask_token_id) == ("Fast_dLLM_Qwen", 32, 5)
    dream = AutoConfig.from_pretrained(write_dream(tmp_path / "dream"))
    assert dream.model_type == "Dream" and dream.mask_token_id is not None


def _params(**fields):
    """SGLang's SamplingParams fields as normalized (temperature 0 -> top_k 1)."""
    from types import SimpleNamespace

    base = {"temperature": 1.0, "top_k": 1, "frequency_penalty": 0.0, "presence_penalty": 0.0,
            "repetition_penalty": 1.0, "min_new_tokens": 0, "logit_bias": None,
            "json_schema": None, "regex": None, "ebnf": None, "structural_tag": None}
    return SimpleNamespace(**{**base, **fields})


SAMPLING_CASES = {
    "greedy": (_params(), None),
    "greedy_top_k_1": (_params(temperature=0.7), None),
    "temperature": (_params(temperature=0.7, top_k=1 << 30),
                    "set temperature 0 (or top_k 1) for --dllm-algorithm FastDLLM"),
    # no sampling field set: SGLang's defaults (temperature 1, whole vocabulary), served
    "no_sampling_fields": (_params(top_k=1 << 30, top_p=1.0, min_p=0.0), None),
    "explicit_top_p": (_params(top_k=1 << 30, top_p=0.9),
                       "set temperature 0 (or top_k 1) for --dllm-algorithm FastDLLM"),
    "penalty": (_params(repetition_penalty=1.2), "remove repetition_penalty for"),
    "both": (_params(temperature=0.5, top_k=1 << 30, regex="a+", logit_bias={"3": 1.0}),
             "set temperature 0 (or top_k 1) and remove logit_bias, regex for"),
}


@pytest.mark.parametrize("case", list(SAMPLING_CASES))
def test_sampling_fastdllm_would_ignore_is_refused(case: str) -> None:
    """FastDLLM decodes greedily: a request asking for more is refused, what to do first."""
    params, first_words = SAMPLING_CASES[case]
    message = fast_dllm_request_error(params)
    if first_words is None:
        assert message is None
    else:
        assert message is not None and message.startswith(first_words), message
        if "temperature" in first_words and params.temperature != 1.0:
            assert f"would ignore temperature {params.temperature:g}" in message


def test_logprobs_are_refused_by_the_dllms() -> None:
    """SGLang's dLLM path answers a logprobs request with an empty list: refused instead,
    what to do first; a request without them passes."""
    from types import SimpleNamespace

    from diffspec.spec_workers.sglang.requests import logprobs_error

    how = "--dllm-algorithm FastDLLM unmasks several tokens a step by confidence"
    message = logprobs_error(SimpleNamespace(return_logprob=True), how)
    assert message is not None and message.startswith("leave logprobs out of the request: "
                                                      + how), message
    assert logprobs_error(SimpleNamespace(return_logprob=False), how) is None
