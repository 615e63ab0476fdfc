"""The ``diffspec`` command line."""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from diffspec.assets import SYNTH_DLLM_DIR, SYNTH_QWEN3_DIR, SYNTH_REFUSION_DIR, SYNTH_TIDAR_DIR
from diffspec.cli import _decode_options, build_parser, main
from diffspec.methods import METHODS

METHODS_DOC = Path(__file__).resolve().parents[2] / "docs" / "methods.md"


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


# ------------------------------------------------------- refusion defaults, docs/methods.md

REFUSION_OPTIONS = ("slot_size", "num_blocks", "slot_threshold", "token_threshold")


def _doc_commands(prefix: str) -> list[list[str]]:
    """docs/methods.md's command lines starting with ``prefix``, split as a shell does."""
    lines = [line.strip() for line in METHODS_DOC.read_text().splitlines()]
    return [shlex.split(line) for line in lines if line.startswith(prefix)]


def test_refusion_defaults_are_the_published_settings_in_one_block():
    """GSAI-ML/ReFusion's GSM8K slot size and thresholds (:class:`ReFusionConfig`'s defaults)
    in one serial block, so any --max-tokens splits into whole slots."""
    from diffspec.spec_workers.reference.refusion import ReFusionConfig

    published = ReFusionConfig()
    assert (published.slot_size, published.num_blocks) == (32, 1)
    assert (published.slot_threshold, published.token_threshold) == (0.9, 0.4)
    assert dict(METHODS["refusion"].defaults) == {
        "slot_size": published.slot_size, "num_blocks": published.num_blocks,
        "slot_threshold": published.slot_threshold,
        "token_threshold": published.token_threshold}
    for max_tokens in (1, 31, 64, 100):
        ReFusionConfig(**METHODS["refusion"].defaults).layout(max_tokens)  # no ValueError


def test_generate_decodes_refusion_with_the_registry_defaults(capsys):
    """No option given: the parsed options are None and the decoder resolves them to the
    registry's defaults; ``generate --help`` names each of them."""
    from diffspec.spec_workers.reference import load_decoder

    args = build_parser().parse_args(["generate", "--method", "refusion", "--prompt", "x"])
    assert all(getattr(args, k) is None for k in REFUSION_OPTIONS)
    decoder = load_decoder("refusion", SYNTH_REFUSION_DIR,
                           **{k: getattr(args, k) for k in _decode_options()})
    assert {k: decoder.options[k] for k in REFUSION_OPTIONS} == dict(
        METHODS["refusion"].defaults)
    with pytest.raises(SystemExit):
        main(["generate", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    for key, value in METHODS["refusion"].defaults.items():
        flag = f"--{key.replace('_', '-')}"
        entry = help_text[help_text.index(f"{flag} {key.upper()} refusion: "):]
        assert f"(default {value}" in entry[:entry.index(")") + 1]


def _generate_stats(argv: list[str], capsys) -> tuple[int, int]:
    """``(tokens, forwards)`` from the summary line ``diffspec generate`` prints."""
    assert main(argv) == 0
    summary = capsys.readouterr().err
    head = summary[summary.index("] ") + 2:].split(", ")
    return int(head[0].split()[0]), int(head[1].split()[0])


def test_refusion_defaults_are_fast_on_a_prompt_that_small_slots_stall(capsys):
    """sample_prompts(16, 1)[6]: with slot 8 the plan commits later slots first and decodes
    about one token per forward (measured 64 tokens in 66 forwards); the defaults, 64 in 12."""
    from diffspec.testing.synthetic import sample_prompts

    argv = ["generate", "--method", "refusion", "--prompt", sample_prompts(16, seed=1)[6]]
    tokens, forwards = _generate_stats(argv, capsys)
    slot8_tokens, slot8_forwards = _generate_stats([*argv, "--slot-size", "8"], capsys)
    assert tokens == slot8_tokens == 64
    assert tokens / forwards > 4 and slot8_tokens / slot8_forwards < 2


def test_documented_refusion_commands_parse_and_use_the_generate_defaults(capsys):
    """docs/methods.md's ReFusion figures come from commands a user can run as written: the
    ``eval`` lines decode with ``generate``'s defaults (bar the option they name), and the
    ``diffspec generate`` line prints the summary the page quotes."""
    from diffspec.testing.synthetic_refusion import build_parser as eval_parser

    page = " ".join(METHODS_DOC.read_text().split())
    evals = _doc_commands("python -m diffspec.testing.synthetic_refusion eval")
    assert len(evals) == 2
    for command in evals:
        args = eval_parser().parse_args(command[3:])
        given = {a.lstrip("-").replace("-", "_") for a in command[3:] if a.startswith("--")}
        for key, value in METHODS["refusion"].defaults.items():
            if key not in given:
                assert getattr(args, key) == value, (command, key)
        assert args.model == str(SYNTH_REFUSION_DIR) and args.max_tokens == 64

    [generate] = _doc_commands("diffspec generate --method refusion")
    args = build_parser().parse_args(generate[1:])
    assert args.method == "refusion" and args.model is None
    assert all(getattr(args, k) is None for k in REFUSION_OPTIONS)
    tokens, forwards = _generate_stats(generate[1:], capsys)
    assert f"prints `[refusion] {tokens} tokens, {forwards} forwards, TPF " \
           f"{tokens / forwards:.2f}, ...`" in page
