"""The ``diffspec`` command line: ``demo`` and ``generate`` on the reference decoder.

Importing this module imports no torch (it is imported inside the commands), so
``diffspec --help`` is fast.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

BUILT_METHODS = {
    "ar": "plain autoregressive decoding, one token per forward",
    "ngram": "speculative decoding with prompt lookup (n-gram) drafts, lossless",
    "orthrus": "Orthrus checkpoint: diffusion-view drafts verified by the AR view, lossless",
    "linear_self_spec": "NLD checkpoint: bidirectional (LoRA) drafts, causal verify, lossless",
    "tidar": "TiDAR / NLD checkpoint: draft + verify in one forward (quadratic), lossless",
    "refusion": "ReFusion checkpoint: slot plan-and-infill (greedy; not lossless)",
    "fast_dllm": "LLaDA / Dream / Fast-dLLM v2 / NLD: block diffusion with KV cache and "
                 "confidence-threshold unmasking (greedy; not lossless)",
}
NOT_BUILT_METHODS: tuple[str, ...] = ()

_METHODS_HELP = "decoding methods:\n" + "".join(
    f"  {name:<17} {text}\n" for name, text in BUILT_METHODS.items()
) + "".join(f"  {name:<17} not built yet\n" for name in NOT_BUILT_METHODS)

_FORWARDS_HELP = (
    "Forwards count every model call after the prompt prefill (the prefill is not counted);\n"
    "an n-gram lookup is not a forward; a draft + verify cycle is two. TPF = generated tokens\n"
    "/ forwards."
)


def bundled_model_path() -> Path:
    """The small bundled checkpoint: a tiny Qwen3 trained on the synthetic language, with
    Orthrus diffusion heads distilled onto it (AR weights identical to synth-qwen3)."""
    from diffspec.assets import SYNTH_ORTHRUS_DIR

    return SYNTH_ORTHRUS_DIR


class _CliError(Exception):
    """A user error: printed as ``diffspec: error: ...`` with exit code 2."""


@dataclass
class _Decoder:
    """A loaded checkpoint ready to decode with one method."""

    method: str
    tokenizer: Any
    decode: Callable[[list[Any]], list[Any]]  # requests -> RequestOutputs
    stop_token_ids: tuple[int, ...]
    max_len: int  # context length (positions)
    vocab_size: int


def _load_decoder(method: str, path: str | Path, num_draft_tokens: int,
                  threshold: float = 0.9, cache: str = "prefix") -> _Decoder:
    """Load ``path`` for ``method``, with clear errors when the checkpoint cannot serve it
    (no diffusion weights, block too large, ...); never touches the network."""
    if method in NOT_BUILT_METHODS:
        raise _CliError(f"method {method!r} is not built yet (built: {', '.join(BUILT_METHODS)})")
    if num_draft_tokens < 1:
        raise _CliError(f"--num-draft-tokens must be >= 1, got {num_draft_tokens}")
    if not (Path(path) / "config.json").is_file():
        raise _CliError(f"model path {str(path)!r} is not a local checkpoint folder "
                        "(no config.json there)")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    from diffspec.core import reference
    from diffspec.core.checkpoint import (
        CheckpointError,
        inspect_checkpoint,
        require_method,
        validate_block_size,
    )

    hf_logging.disable_progress_bar()
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # config-class warnings for model types it does not know
    k = num_draft_tokens
    try:
        info = inspect_checkpoint(path)
        tokenizer = AutoTokenizer.from_pretrained(str(info.path), trust_remote_code=False)
        if method in ("ar", "ngram"):
            model = _load_ar_view(info, torch.float32)
            drafter = reference.NgramDrafter()
            if method == "ar":
                decode = lambda reqs: reference.ar_generate(model, reqs, tokenizer)
            else:
                decode = lambda reqs: reference.speculative_generate(
                    model, drafter, reqs, k, tokenizer=tokenizer)
            eos: tuple[int, ...] = info.eos_token_ids
        elif method in ("orthrus", "linear_self_spec"):
            require_method(info, method)
            validate_block_size(info, k)
            if method == "orthrus":
                from diffspec.model_executors.orthrus import load_orthrus
                from diffspec.spec_workers.orthrus import OrthrusDrafter

                wrapped: Any = load_orthrus(info.path, dtype=torch.float32)
                drafter = OrthrusDrafter(wrapped)
            else:
                from diffspec.model_executors.nld import load_nld
                from diffspec.spec_workers.linear_self_spec import LinearSelfSpecDrafter

                wrapped = load_nld(info.path, dtype=torch.float32)
                drafter = LinearSelfSpecDrafter(wrapped)
            model, eos = wrapped.lm, wrapped.eos_token_ids
            decode = lambda reqs: reference.speculative_generate(
                model, drafter, reqs, k, tokenizer=tokenizer)
        elif method == "tidar":
            from diffspec.spec_workers.tidar import load_quadratic, tidar_generate

            require_method(info, "tidar")
            quadratic = load_quadratic(info.path, dtype=torch.float32)
            if k > quadratic.max_draft_tokens:
                raise CheckpointError(f"checkpoint {info.path} drafts at most "
                                      f"{quadratic.max_draft_tokens} tokens per step "
                                      f"(block_size={quadratic.block_size}); {k} requested")
            model, eos = quadratic.lm, quadratic.eos_token_ids
            decode = lambda reqs: tidar_generate(quadratic, reqs, k, tokenizer=tokenizer)
        elif method == "fast_dllm":
            from diffspec.model_executors.dllm import load_dllm
            from diffspec.spec_workers.fast_dllm import FastDLLMConfig, fast_dllm_generate

            lm = load_dllm(info.path, dtype=torch.float32)
            dllm_config = FastDLLMConfig(cache=cache, threshold=threshold, block_size=k)
            decode = lambda reqs: fast_dllm_generate(lm, reqs, dllm_config)
            stops = tuple(dict.fromkeys([*lm.eos_token_ids, *([tokenizer.eos_token_id]
                                         if tokenizer.eos_token_id is not None else [])]))
            return _Decoder(method, tokenizer, decode, stops, lm.max_positions,
                            int(info.vocab_size or len(tokenizer)))
        else:  # refusion
            from diffspec.spec_workers.refusion import (
                ReFusionConfig,
                load_refusion,
                refusion_generate,
            )

            model, info = load_refusion(info.path, dtype=torch.float32)
            config = ReFusionConfig(slot_size=k, num_blocks=1)
            mask_id = int(info.mask_token_id)
            decode = lambda reqs: refusion_generate(model, reqs, config, mask_id)
            eos = info.eos_token_ids
    except (CheckpointError, ValueError) as e:
        raise _CliError(str(e)) from None
    finally:
        hf_logging.set_verbosity(verbosity)
    stops = tuple(dict.fromkeys([*eos, *_stop_token_ids(model, tokenizer)]))
    return _Decoder(method, tokenizer, decode, stops, model.config.max_position_embeddings,
                    model.config.vocab_size)


def _load_ar_view(info: Any, dtype: Any) -> Any:
    """The plain causal LM of any checkpoint diffspec reads (Orthrus: its AR view)."""
    if info.family == "orthrus":
        from diffspec.model_executors.orthrus import load_orthrus

        return load_orthrus(info.path, dtype=dtype).lm
    if info.family == "nld":
        from diffspec.model_executors.nld import load_nld

        return load_nld(info.path, dtype=dtype, lora=False).lm
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(info.path), dtype=dtype).eval()


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


def _timed(decoder: _Decoder, requests: list[Any]) -> tuple[list[Any], float]:
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
    decoder = _load_decoder(args.method, args.model, args.num_draft_tokens, args.threshold,
                            args.cache)
    tokenizer = decoder.tokenizer

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


DEMO_METHODS = ("ar", "ngram", "orthrus")


def cmd_demo(args: argparse.Namespace) -> int:
    from diffspec.core.reference import Request
    from diffspec.core.sampling import SamplingParams
    from diffspec.testing.synthetic import sample_prompts

    decoders = [_load_decoder(m, args.model, args.num_draft_tokens) for m in DEMO_METHODS]
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
            first_text = (prompts[0], tokenizer.decode(runs["orthrus"][0][0].token_ids))
    print("\n(tok/s is per method over all prompts of a setting, reference decoder on CPU)")
    print(f"\nprompt:     {first_text[0]}\ncompletion: {first_text[1]}")
    if not all_equal:
        print("\nLOSSLESS CHECK FAILED: speculative output differs from AR", file=sys.stderr)
        return 1
    print("\nlossless check: speculative == AR for every prompt and method")
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
        epilog=_METHODS_HELP + "\n" + _FORWARDS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gen.add_argument("--model", default=str(bundled_model_path()), help=model_help)
    gen.add_argument("--prompt", required=True, help="prompt text")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the chat template")
    gen.add_argument("--method", default="ngram", choices=[*BUILT_METHODS, *NOT_BUILT_METHODS],
                     help="decoding method (default: ngram); see the list below")
    gen.add_argument("--num-draft-tokens", type=int, default=8,
                     help="drafts per step (K); refusion: the slot size; fast_dllm: the block")
    gen.add_argument("--threshold", type=float, default=0.9,
                     help="fast_dllm: unmask every position with confidence > this (and at "
                     "least the top-1); 1.0 = one token per step")
    gen.add_argument("--cache", choices=("none", "prefix", "dual"), default="prefix",
                     help="fast_dllm: KV cache mode (default: prefix)")
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
