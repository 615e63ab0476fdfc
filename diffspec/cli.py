"""The ``diffspec`` command line: ``demo`` and ``generate`` on the reference decoder.

Importing this module imports no torch (it is imported inside the commands), so
``diffspec --help`` is fast.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

BUILT_METHODS = {
    "ar": "plain autoregressive decoding, one token per forward",
    "ngram": "speculative decoding with prompt lookup (n-gram) drafts, lossless",
    "orthrus": "Orthrus checkpoint: diffusion-view drafts verified by the AR view, lossless",
    "linear_self_spec": "NLD checkpoint: bidirectional (LoRA) drafts, causal verify, lossless",
}
SELF_SPEC_METHODS = ("orthrus", "linear_self_spec")  # need a checkpoint with diffusion weights
NOT_BUILT_METHODS = ("tidar", "fast_dllm", "refusion")

_METHODS_HELP = "decoding methods:\n" + "".join(
    f"  {name:<17} {text}\n" for name, text in BUILT_METHODS.items()
) + "".join(f"  {name:<17} not built yet\n" for name in NOT_BUILT_METHODS)

_FORWARDS_HELP = (
    "Forwards count every model call after the prompt prefill (the prefill is not counted);\n"
    "an n-gram lookup is not a forward. TPF = generated tokens / forwards."
)


def bundled_model_path() -> Path:
    """The small bundled checkpoint (a tiny Qwen3 trained on the synthetic language)."""
    from diffspec.assets import SYNTH_QWEN3_DIR

    return SYNTH_QWEN3_DIR


class _CliError(Exception):
    """A user error: printed as ``diffspec: error: ...`` with exit code 2."""


def _load(path: str | Path) -> tuple[Any, Any]:
    """Load a local HF checkpoint (fp32, eval mode) and its tokenizer; never the network."""
    path = Path(path)
    if not (path / "config.json").is_file():
        raise _CliError(f"model path {str(path)!r} is not a local checkpoint folder "
                        "(no config.json there)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, tokenizer


def _load_self_spec(method: str, path: str | Path,
                    num_draft_tokens: int) -> tuple[Any, Any, Any, tuple[int, ...]]:
    """Load an Orthrus / NLD checkpoint for ``method``: (AR-view model, tokenizer, drafter,
    EOS ids). Raises a clear error when the checkpoint cannot serve the method or was
    trained for fewer than ``num_draft_tokens`` drafts per step."""
    if not (Path(path) / "config.json").is_file():
        raise _CliError(f"model path {str(path)!r} is not a local checkpoint folder "
                        "(no config.json there)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from diffspec.core.checkpoint import (
        CheckpointError,
        inspect_checkpoint,
        require_method,
        validate_block_size,
    )

    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # config-class warnings for model types it does not know
    try:
        info = inspect_checkpoint(path)
        require_method(info, method)
        validate_block_size(info, num_draft_tokens)
        if method == "orthrus":
            from diffspec.model_executors.orthrus import load_orthrus
            from diffspec.spec_workers.orthrus import OrthrusDrafter

            model = load_orthrus(info.path, dtype=torch.float32)
            drafter: Any = OrthrusDrafter(model)
        else:
            from diffspec.model_executors.nld import load_nld
            from diffspec.spec_workers.linear_self_spec import LinearSelfSpecDrafter

            model = load_nld(info.path, dtype=torch.float32)
            drafter = LinearSelfSpecDrafter(model)
        tokenizer = AutoTokenizer.from_pretrained(str(info.path), trust_remote_code=False)
    except CheckpointError as e:
        raise _CliError(str(e)) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    return model.lm, tokenizer, drafter, model.eos_token_ids


def _stop_token_ids(model: Any, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from the generation config (a list or an int) and the tokenizer."""
    eos = getattr(model.generation_config, "eos_token_id", None)
    ids = list(eos) if isinstance(eos, (list, tuple)) else ([] if eos is None else [eos])
    if tokenizer.eos_token_id is not None:
        ids.append(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(int(i) for i in ids))


def _sampling(args: argparse.Namespace) -> Any:
    from diffspec.core.sampling import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed)
    except ValueError as e:
        raise _CliError(str(e)) from None


def _run(method: str, model: Any, requests: list[Any], num_draft_tokens: int,
         tokenizer: Any, drafter: Any = None) -> tuple[list[Any], float]:
    """Decode ``requests`` with ``method`` (``drafter`` defaults to n-gram lookup); return
    the outputs and the wall time (s)."""
    from diffspec.core.reference import NgramDrafter, ar_generate, speculative_generate

    start = time.perf_counter()
    if method == "ar":
        outputs = ar_generate(model, requests, tokenizer=tokenizer)
    else:
        outputs = speculative_generate(model, drafter or NgramDrafter(), requests,
                                       num_draft_tokens, tokenizer=tokenizer)
    return outputs, time.perf_counter() - start


# ----------------------------------------------------------------------------- commands


def cmd_generate(args: argparse.Namespace) -> int:
    if args.method in NOT_BUILT_METHODS:
        raise _CliError(f"method {args.method!r} is not built yet "
                        f"(built: {', '.join(BUILT_METHODS)})")
    if args.max_tokens < 1:
        raise _CliError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    if args.num_draft_tokens < 1:
        raise _CliError(f"--num-draft-tokens must be >= 1, got {args.num_draft_tokens}")
    sampling = _sampling(args)
    drafter, extra_stops = None, ()
    if args.method in SELF_SPEC_METHODS:
        model, tokenizer, drafter, extra_stops = _load_self_spec(args.method, args.model,
                                                                 args.num_draft_tokens)
    else:
        model, tokenizer = _load(args.model)

    from diffspec.core.reference import Request

    text = args.prompt
    if args.chat:
        if tokenizer.chat_template is None:
            raise _CliError(f"--chat: the tokenizer of {args.model!r} has no chat template")
        messages = [{"role": "user", "content": args.prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    try:
        request = Request(prompt_ids, max_tokens=args.max_tokens, sampling=sampling,
                          stop_token_ids=tuple(dict.fromkeys(
                              _stop_token_ids(model, tokenizer) + tuple(extra_stops))),
                          stop_strings=tuple(args.stop))
        request.check_fits(model.config.max_position_embeddings, model.config.vocab_size)
    except ValueError as e:
        raise _CliError(str(e)) from None

    [out], seconds = _run(args.method, model, [request], args.num_draft_tokens, tokenizer,
                          drafter)
    print(tokenizer.decode(out.token_ids, skip_special_tokens=False))
    print(f"[{args.method}] {len(out.token_ids)} tokens, {out.num_forwards} forwards, "
          f"TPF {out.tpf:.2f}, mean acceptance length {out.mean_accept_length:.2f}, "
          f"finish_reason={out.finish_reason}, {len(out.token_ids) / seconds:.1f} tokens/s, "
          f"acceptance histogram (steps emitting k tokens, k=0..) {out.acceptance_histogram}",
          file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from diffspec.core.reference import Request
    from diffspec.core.sampling import SamplingParams
    from diffspec.testing.synthetic import sample_prompts

    model, tokenizer = _load(args.model)
    stops = _stop_token_ids(model, tokenizer)
    prompts = sample_prompts(args.num_prompts, args.seed)
    settings = [
        ("greedy", SamplingParams()),
        (f"T=1 seed={args.seed}", SamplingParams(temperature=1.0, seed=args.seed)),
    ]

    header = (f"{'sampling':<12} {'prompt':<26} {'method':<6} {'tokens':>6} {'fwd':>4} "
              f"{'TPF':>5} {'acc.len':>7} {'tok/s':>7}  == AR")
    print(f"model: {args.model}\nspeculative: ngram drafter, {args.num_draft_tokens} draft tokens"
          f" per step\n{_FORWARDS_HELP}\n\n{header}\n{'-' * len(header)}")
    all_equal, first_text = True, None
    for name, sampling in settings:
        requests = [Request(tokenizer(p)["input_ids"], max_tokens=args.max_tokens,
                            sampling=sampling, stop_token_ids=stops) for p in prompts]
        ar, ar_s = _run("ar", model, requests, args.num_draft_tokens, tokenizer)
        spec, spec_s = _run("ngram", model, requests, args.num_draft_tokens, tokenizer)
        for prompt, a, s in zip(prompts, ar, spec):
            equal = a.token_ids == s.token_ids
            all_equal &= equal
            short = prompt if len(prompt) <= 24 else prompt[:21] + "..."
            for method, out, secs in (("ar", a, ar_s), ("ngram", s, spec_s)):
                tps = sum(len(o.token_ids) for o in (ar if method == "ar" else spec)) / secs
                print(f"{name:<12} {short:<26} {method:<6} {len(out.token_ids):>6} "
                      f"{out.num_forwards:>4} {out.tpf:>5.2f} {out.mean_accept_length:>7.2f} "
                      f"{tps:>7.0f}  {'yes' if equal else 'NO'}")
        if first_text is None:
            first_text = (prompts[0], tokenizer.decode(spec[0].token_ids))
    print("\n(tok/s is per method over all prompts of a setting)")
    print(f"\nprompt:     {first_text[0]}\ncompletion: {first_text[1]}")
    if not all_equal:
        print("\nLOSSLESS CHECK FAILED: speculative output differs from AR", file=sys.stderr)
        return 1
    print("\nlossless check: speculative == AR for every prompt")
    return 0


# ------------------------------------------------------------------------------- parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="diffspec",
        description="Diffusion-drafted speculative decoding: reference decoder demo and "
        "generation (engine-free, CPU).",
        epilog=_METHODS_HELP + "\n" + _FORWARDS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from diffspec import __version__

    parser.add_argument("--version", action="version", version=f"diffspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,generate}")

    demo = sub.add_parser(
        "demo",
        help="AR vs speculative decoding on the bundled model (default command)",
        description="Decode a few prompts of the synthetic language with plain AR and with "
        "n-gram speculative decoding (greedy, then seeded sampling), print a table and check "
        "that speculative output equals AR token for token (exit code 1 if not).",
        epilog=_FORWARDS_HELP,
    )
    model_help = "local checkpoint folder (default: the bundled synth-qwen3)"
    demo.add_argument("--model", default=str(bundled_model_path()), help=model_help)
    demo.add_argument("--num-prompts", type=int, default=4)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--num-draft-tokens", type=int, default=8)
    demo.add_argument("--seed", type=int, default=0, help="prompt and sampling seed")
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser(
        "generate",
        help="generate from a prompt with one method",
        description="Generate a completion with the reference decoder.",
        epilog=_METHODS_HELP + "\n" + _FORWARDS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("--model", default=str(bundled_model_path()), help=model_help)
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--method", default="ngram", choices=[*BUILT_METHODS, *NOT_BUILT_METHODS],
                     help="decoding method (default: ngram); see the list below")
    gen.add_argument("--num-draft-tokens", type=int, default=8, help="drafts per step (K)")
    gen.add_argument("--max-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    gen.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    gen.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    gen.add_argument(
        "--seed", type=int, default=None,
        help="sampling seed (coupled sampling: ar and ngram give the same tokens)",
    )
    gen.add_argument("--stop", action="append", default=[], metavar="STR",
                     help="stop string (repeatable)")
    gen.set_defaults(func=cmd_generate)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # `diffspec` alone runs the demo
        args = parser.parse_args(["demo", *(argv if argv is not None else sys.argv[1:])])
    try:
        return args.func(args)
    except _CliError as e:
        parser.exit(2, f"diffspec: error: {e}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
