"""The ``diffspec`` command line."""

from __future__ import annotations

import subprocess
import sys

import pytest

from diffspec.assets import SYNTH_DLLM_DIR, SYNTH_QWEN3_DIR, SYNTH_REFUSION_DIR, SYNTH_TIDAR_DIR
from diffspec.cli import main
from diffspec.methods import METHODS


def test_help_lists_methods_with_their_bundled_model_and_imports_no_torch():
    code = ("import sys, diffspec.cli; assert 'torch' not in sys.modules; "
            "diffspec.cli.main(['generate', '--help'])")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    for method in METHODS.values():
        if method.reference is not None:
            assert f"  {method.name} " in result.stdout
            assert f"bundled: {method.bundled};" in result.stdout


def test_demo_runs_and_is_lossless(capsys):
    assert main(["demo", "--num-prompts", "2", "--max-tokens", "24"]) == 0
    out = capsys.readouterr().out
    assert "== AR" in out and " NO" not in out
    assert "lossless check: speculative == AR" in out


def test_generate_runs(capsys):
    assert main(["generate", "--prompt", "hello world", "--chat", "--max-tokens", "8",
                 "--temperature", "0.8", "--seed", "1"]) == 0
    assert "TPF" in capsys.readouterr().err


BAD_GENERATE = {
    # name: (extra args, message on stderr)
    "negative_temperature": (["--temperature", "-1"], "temperature must be"),
    "bad_top_p": (["--top-p", "0"], "top_p must be"),
    "orthrus_on_a_base_model": (["--method", "orthrus", "--model", str(SYNTH_QWEN3_DIR)],
                                "no diffusion weights"),
    "orthrus_block_too_large": (["--method", "orthrus", "--num-draft-tokens", "32"],
                                "block_size=32"),
    "tidar_block_too_large": (["--method", "tidar", "--model", str(SYNTH_TIDAR_DIR),
                               "--num-draft-tokens", "9"], "drafts at most 8"),
    "fast_dllm_on_an_ar_model": (["--method", "fast_dllm", "--model", str(SYNTH_QWEN3_DIR)],
                                 "family"),
    "refusion_is_greedy_only": (["--method", "refusion", "--model", str(SYNTH_REFUSION_DIR),
                                 "--temperature", "0.7"], "refusion"),
    "unknown_model_path": (["--model", "/nonexistent/model"], "not a local checkpoint"),
    "prompt_too_long": (["--max-tokens", "100000"], "exceeds the model's context length"),
    "zero_max_tokens": (["--max-tokens", "0"], "--max-tokens must be >= 1"),
}
BAD_GENERATE["option_of_another_method"] = (["--method", "orthrus", "--slot-size", "4"],
                                           "takes no option slot_size")


@pytest.mark.parametrize("name", list(BAD_GENERATE))
def test_generate_bad_params_exit_2(name, capsys):
    extra, message = BAD_GENERATE[name]
    with pytest.raises(SystemExit) as exc:
        main(["generate", "--prompt", "hello", *extra])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("method", [m for m, spec in METHODS.items() if spec.reference])
def test_generate_runs_every_method_on_its_bundled_model(method, capsys):
    """No --model: each method picks its bundled checkpoint from the registry (they all
    speak the synthetic language, so the prompt is one of its sentences)."""
    from diffspec.testing.synthetic import sample_prompts

    prompt = sample_prompts(1, seed=3)[0]
    assert main(["generate", "--prompt", prompt, "--method", method, "--max-tokens", "16"]) == 0
    err = capsys.readouterr().err
    assert f"[{method}] 16 tokens" in err and "TPF" in err


@pytest.mark.parametrize(
    ("method", "model", "options"),
    [
        ("orthrus", None, ["--num-draft-tokens", "7"]),
        ("tidar", SYNTH_TIDAR_DIR, ["--num-draft-tokens", "4"]),
        ("refusion", SYNTH_REFUSION_DIR, ["--slot-size", "4", "--num-blocks", "2"]),
        ("fast_dllm", SYNTH_DLLM_DIR / "llada", ["--block-size", "16", "--cache", "dual"]),
        ("fast_dllm", SYNTH_DLLM_DIR / "fast_dllm_v2", ["--block-size", "32"]),
    ],
)
def test_generate_with_method_options(method, model, options, capsys):
    args = ["generate", "--prompt", "hello world", "--method", method, "--max-tokens", "16",
            *options]
    assert main(args + (["--model", str(model)] if model else [])) == 0
    err = capsys.readouterr().err
    assert f"[{method}]" in err and "TPF" in err
