"""The ``diffspec`` command line: ``demo`` and ``generate`` on the reference decoder.

Importing this module imports no torch (it is imported inside the commands), so
``diffspec --help`` is fast.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any


def _methods_help() -> str:
    """The epilog's method list, from the registry (with each method's bundled model)."""
    from diffspec.methods import METHODS

    lines = ["decoding methods (the bundled model is used when --model is not given; bundled "
             "models are tiny\nand speak diffspec's synthetic language: `diffspec demo` shows "
             "prompts they understand):"]
    for m in METHODS.values():
        if m.reference is None:
            continue
        lines.append(f"  {m.name:<17} {m.summary}{'' if m.lossless else ' (not lossless)'}")
        lines.append(f"  {'':<17} bundled: {m.bundled}; options: "
                     f"{', '.join('--' + k.replace('_', '-') for k in m.defaults) or 'none'}")
    return "\n".join(lines) + "\n"


_FORWARDS_HELP = (
    "Forwards count every model call after the prompt prefill (the prefill is not counted);\n"
    "an n-gram lookup is not a forward; a draft + verify cycle is two. TPF = generated tokens\n"
    "/ forwards."
)


def bundled_model_path(method: str = "orthrus") -> Path:
    """The small trained checkpoint bundled for ``method`` (registry ``Method.bundled``)."""
    from diffspec.assets import ASSETS_DIR
    from diffspec.methods import get_method

    bundled = get_method(method).bundled
    if bundled is None:
        raise _CliError(f"method {method!r} has no bundled model; pass --model")
    return ASSETS_DIR / bundled


class _CliError(Exception):
    """A user error: printed as ``diffspec: error: ...`` with exit code 2."""


def _decode_options() -> set[str]:
    """Every decoding option of the registry's methods (each is a ``generate`` flag)."""
    from diffspec.methods import METHODS

    return {k for m in METHODS.values() for k in m.defaults}


def _load_decoder(method: str, path: str | Path, **options: Any):
    """:func:`diffspec.spec_workers.reference.load_decoder` with user errors as _CliError."""
    from diffspec.spec_workers.reference import load_decoder

    try:
        return load_decoder(method, path, **options)
    except ValueError as e:  # CheckpointError included
        raise _CliError(str(e)) from None


def _sampling(args: argparse.Namespace) -> Any:
    from diffspec.core.sampling import SamplingParams

    try:
        return SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed)
    except ValueError as e:
        raise _CliError(str(e)) from None


def _timed(decoder: Any, requests: list[Any]) -> tuple[list[Any], float]:
    """Decode ``requests``; return the outputs and the wall time (s)."""
    start = time.perf_counter()
    try:
        outputs = decoder.decode(requests)
    except ValueError as e:  # e.g. sampling or stop strings a method cannot honour
        raise _CliError(f"{decoder.method}: {e}") from None
    return outputs, time.perf_counter() - start


# ----------------------------------------------------------------------------- commands


def cmd_generate(args: argparse.Namespace) -> int:
    if args.max_tokens < 1:
        raise _CliError(f"--max-tokens must be >= 1, got {args.max_tokens}")
    sampling = _sampling(args)
    model = args.model or bundled_model_path(args.method)
    decoder = _load_decoder(args.method, model,
                            **{k: getattr(args, k) for k in _decode_options()})
    tokenizer = decoder.tokenizer

    from diffspec.spec_workers.reference.decoder import Request

    text = args.prompt
    if args.chat:
        if tokenizer.chat_template is None:
            raise _CliError(f"--chat: the tokenizer of {args.model!r} has no chat template")
        messages = [{"role": "user", "content": args.prompt}]
        text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    try:
        request = Request(prompt_ids, max_tokens=args.max_tokens, sampling=sampling,
                          stop_token_ids=decoder.stop_token_ids, stop_strings=tuple(args.stop))
        request.check_fits(decoder.max_len, decoder.vocab_size)
    except ValueError as e:
        raise _CliError(str(e)) from None

    [out], seconds = _timed(decoder, [request])
    print(tokenizer.decode(out.token_ids, skip_special_tokens=False))
    print(f"[{args.method}] {len(out.token_ids)} tokens, {out.num_forwards} forwards, "
          f"TPF {out.tpf:.2f}, mean acceptance length {out.mean_accept_length:.2f}, "
          f"finish_reason={out.finish_reason}, {len(out.token_ids) / seconds:.1f} tokens/s, "
          f"acceptance histogram (steps emitting k tokens, k=0..) {out.acceptance_histogram}",
          file=sys.stderr)
    return 0


def _lossless_methods(model: str | Path) -> list[str]:
    """The lossless methods whose reference decoder serves ``model``'s family, AR first."""
    from diffspec.core.checkpoint import CheckpointError, inspect_checkpoint
    from diffspec.methods import reference_methods_for

    try:
        family = inspect_checkpoint(model).family
    except CheckpointError as e:
        raise _CliError(str(e)) from None
    return [m.name for m in reference_methods_for(family) if m.lossless]


def cmd_demo(args: argparse.Namespace) -> int:
    from diffspec.core.sampling import SamplingParams
    from diffspec.spec_workers.reference.decoder import Request
    from diffspec.testing.synthetic import sample_prompts

    methods = _lossless_methods(args.model)
    decoders = [_load_decoder(m, args.model, **({} if m == "ar" else
                                                 {"num_draft_tokens": args.num_draft_tokens}))
                for m in methods]
    tokenizer, stops = decoders[0].tokenizer, decoders[0].stop_token_ids
    prompts = sample_prompts(args.num_prompts, args.seed)
    settings = [
        ("greedy", SamplingParams()),
        (f"T=1 seed={args.seed}", SamplingParams(temperature=1.0, seed=args.seed)),
    ]

    header = (f"{'sampling':<12} {'prompt':<26} {'method':<8} {'tokens':>6} {'fwd':>4} "
              f"{'TPF':>5} {'acc.len':>7} {'tok/s':>7}  == AR")
    print(f"model: {args.model}\nspeculative: {args.num_draft_tokens} draft tokens per step "
          f"(orthrus: one diffusion-view pass drafts them; ngram: prompt lookup)\n"
          f"{_FORWARDS_HELP}\n\n{header}\n{'-' * len(header)}")
    all_equal, first_text = True, None
    for name, sampling in settings:
        requests = [Request(tokenizer(p)["input_ids"], max_tokens=args.max_tokens,
                            sampling=sampling, stop_token_ids=stops) for p in prompts]
        runs = {d.method: _timed(d, requests) for d in decoders}
        ar = runs["ar"][0]
        for i, prompt in enumerate(prompts):
            short = prompt if len(prompt) <= 24 else prompt[:21] + "..."
            for method, (outs, secs) in runs.items():
                out, equal = outs[i], outs[i].token_ids == ar[i].token_ids
                all_equal &= equal
                tps = sum(len(o.token_ids) for o in outs) / secs
                print(f"{name:<12} {short:<26} {method:<8} {len(out.token_ids):>6} "
                      f"{out.num_forwards:>4} {out.tpf:>5.2f} {out.mean_accept_length:>7.2f} "
                      f"{tps:>7.0f}  {'yes' if equal else 'NO'}")
        if first_text is None:
            first_text = (prompts[0], tokenizer.decode(runs[methods[-1]][0][0].token_ids))
    print("\n(tok/s is per method over all prompts of a setting, reference decoder on CPU)")
    print(f"\nprompt:     {first_text[0]}\ncompletion: {first_text[1]}")
    if not all_equal:
        print("\nLOSSLESS CHECK FAILED: speculative output differs from AR", file=sys.stderr)
        return 1
    print("\nlossless check: speculative == AR for every prompt and method")
    return 0


# ------------------------------------------------------------------------------- parser


# generate's decoding options: flag, type (or choices), the method it applies to, what it does;
# the registry's default for the method (``Method.defaults``) closes the help where it has one
_DECODING_OPTIONS: tuple[tuple[str, Any, str, str], ...] = (
    ("--block-size", int, "fast_dllm", "tokens per block (default: the checkpoint's, else 32)"),
    ("--threshold", float, "fast_dllm", "unmask every position with confidence > this (and at "
     "least the top-1); 1.0 = one token per step"),
    ("--sub-block-size", int, "fast_dllm", "a block is decoded in sub-blocks of this many slots, "
     "in order (default: 8 for Fast-dLLM v2, else the block); under --cache dual on a "
     "block-causal layout each step runs only the sub-block"),
    ("--cache", ("none", "prefix", "dual"), "fast_dllm", "KV cache mode; "
     "diffspec/spec_workers/reference/fast_dllm.py says what each recomputes"),
    ("--attention", ("trained", "block_causal"), "fast_dllm", "the layout: the family's trained "
     "one, or block_causal, blocks from position 0 with the prompt in them (SGLang's dLLM "
     "layout: its FastDLLM output equals this one's)"),
    ("--slot-size", int, "refusion", "tokens per slot, the unit a plan picks and infills; "
     "max_tokens is rounded up to whole slots; ReFusion checkpoints are trained on 4 / 8 / 16 "
     "/ 32, and the refusion defaults are GSAI-ML/ReFusion's GSM8K settings in one serial "
     "block"),
    ("--num-blocks", int, "refusion", "serial blocks: the response is cut into this many equal "
     "blocks of whole slots, each planned and infilled before the next starts"),
    ("--slot-threshold", float, "refusion", "each plan picks every masked slot of the block "
     "whose first-token probability is > this, else the most likely one"),
    ("--token-threshold", float, "refusion", "verify keeps a picked slot's first token and its "
     "drafts up to the first whose causal probability is not > this; the rest are drafted "
     "again"),
)


def build_parser() -> argparse.ArgumentParser:
    from diffspec.methods import METHODS

    parser = argparse.ArgumentParser(
        prog="diffspec",
        description="Diffusion-drafted speculative decoding: reference decoder demo and "
        "generation (engine-free, CPU).",
        epilog=_methods_help() + "\n" + _FORWARDS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    from diffspec import __version__

    parser.add_argument("--version", action="version", version=f"diffspec {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="{demo,generate,quickstart}")

    demo = sub.add_parser(
        "demo",
        help="AR vs speculative decoding on the bundled model (default command)",
        description="Decode a few prompts of the synthetic language with plain AR, n-gram "
        "speculation and Orthrus (diffusion-view drafts, AR-view verify) on the bundled "
        "model (greedy, then seeded sampling), print a table and check that speculative "
        "output equals AR token for token (exit code 1 if not).",
        epilog=_FORWARDS_HELP,
    )
    model_help = "local checkpoint folder (default: the bundled synth-orthrus)"
    demo.add_argument("--model", default=str(bundled_model_path()), help=model_help)
    demo.add_argument("--num-prompts", type=int, default=4)
    demo.add_argument("--max-tokens", type=int, default=64)
    demo.add_argument("--num-draft-tokens", type=int, default=31,
                      help="drafts per step (default 31: the Orthrus block of 32)")
    demo.add_argument("--seed", type=int, default=0, help="prompt and sampling seed")
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser(
        "generate",
        help="generate from a prompt with one method",
        description="Generate a completion with the reference decoder.",
        epilog=_methods_help() + "\n" + _FORWARDS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("--model", default=None,
                     help="local checkpoint folder (default: the method's bundled model, "
                     "listed below)")
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--method", default="ngram", choices=[m.name for m in METHODS.values() if m.reference],
                     help="decoding method (default: ngram); see the list below")
    opts = gen.add_argument_group(
        "decoding options (each applies to the methods listed below; default: the method's "
        "own, from what the checkpoint was trained for)")
    opts.add_argument("--num-draft-tokens", type=int, default=None,
                      help="drafts per step (ngram: 8; orthrus / linear_self_spec: block_size"
                      " - 1; tidar: one trained branch)")
    for flag, kind, method, text in _DECODING_OPTIONS:
        default = METHODS[method].defaults.get(flag[2:].replace("-", "_"))
        opts.add_argument(flag, default=None,
                          **({"choices": kind} if isinstance(kind, tuple) else {"type": kind}),
                          help=f"{method}: {text}" + ("" if default is None
                                                      else f" (default {default})"))
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

    from diffspec.quickstart import add_parser as add_quickstart  # no torch import

    add_quickstart(sub)
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
