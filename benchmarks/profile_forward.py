"""Forward-latency profiler: the time of one forward with Q query tokens (1..64) over a KV
cache of C context tokens (256..8k), for a checkpoint or a model shape with random weights.

Speculative decoding trades forwards for wider forwards; where a wider forward costs no
more than a narrow one (memory-bound decode), drafting more pays. ``recommend_block_size``
combines these latencies with measured acceptance to pick the block size that maximizes
expected tokens per second.

    python benchmarks/profile_forward.py --shape qwen3-8b --layers 2 --out results/
    python benchmarks/profile_forward.py --model PATH --device cuda --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

# name: (layers, hidden, heads, kv heads, head dim, intermediate, vocab), Qwen3 family
SHAPES: dict[str, tuple[int, int, int, int, int, int, int]] = {
    "tiny": (2, 128, 4, 2, 32, 320, 208),
    "qwen3-0.6b": (28, 1024, 16, 8, 128, 3072, 151936),
    "qwen3-1.7b": (28, 2048, 16, 8, 128, 6144, 151936),
    "qwen3-4b": (36, 2560, 32, 8, 128, 9728, 151936),
    "qwen3-8b": (36, 4096, 32, 8, 128, 12288, 151936),
}
DEFAULT_QUERY_LENS = (1, 2, 4, 8, 16, 32, 64)
DEFAULT_CONTEXTS = (256, 1024, 4096, 8192)


def recommend_block_size(acceptance_per_position: list[float],
                         latency_by_query_len: dict[int, float],
                         forwards_per_step: int = 1) -> int:
    """The block size B (query tokens per verify forward: the anchor + B-1 drafts) with the
    highest expected tokens per second, among the measured query lengths.

    ``acceptance_per_position[i]``: probability that draft i (0-based) is accepted, i.e.
    that drafts 0..i all are (vLLM's accepted-per-position counter / verify steps).
    A step with B-1 drafts commits 1 + sum(acceptance[:B-1]) tokens in expectation and
    costs ``forwards_per_step`` forwards of B query tokens (self-speculation: 2, draft +
    verify). B = 1 is plain AR. Query lengths beyond the measured acceptance count the
    missing positions as never accepted.
    """
    if not latency_by_query_len:
        raise ValueError("latency_by_query_len is empty")

    def tokens_per_s(block: int) -> float:
        expected = 1.0 + sum(acceptance_per_position[: block - 1])
        cost = latency_by_query_len[block] * (forwards_per_step if block > 1 else 1)
        return expected / cost

    return max(sorted(latency_by_query_len), key=tokens_per_s)


def build_model(model: str | None, shape: str | None, layers: int | None, vocab: int | None,
                dtype: Any, device: str) -> tuple[Any, dict[str, Any]]:
    """A causal LM from a checkpoint folder, or a random-weight Qwen3 of a built-in shape."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Qwen3Config

    if model is not None:
        config = AutoConfig.from_pretrained(model)
        if layers is not None:
            config.num_hidden_layers = layers
        lm = AutoModelForCausalLM.from_pretrained(model, config=config, dtype=dtype)
        desc = {"model": model}
    else:
        if shape not in SHAPES:
            raise ValueError(f"unknown shape {shape!r} (known: {', '.join(SHAPES)})")
        n_layers, hidden, heads, kv, head_dim, inter, n_vocab = SHAPES[shape]
        config = Qwen3Config(num_hidden_layers=layers or n_layers, hidden_size=hidden,
                             num_attention_heads=heads, num_key_value_heads=kv,
                             head_dim=head_dim, intermediate_size=inter,
                             vocab_size=vocab or n_vocab, max_position_embeddings=40960,
                             tie_word_embeddings=False)
        torch.manual_seed(0)
        lm = AutoModelForCausalLM.from_config(config, dtype=dtype)
        desc = {"shape": shape}
    lm = lm.to(device).eval()
    c = lm.config
    desc.update(layers=c.num_hidden_layers, hidden=c.hidden_size, heads=c.num_attention_heads,
                kv_heads=c.num_key_value_heads, vocab=c.vocab_size)
    return lm, desc


def profile(lm: Any, query_lens: list[int], contexts: list[int], repeats: int,
            device: str) -> dict[int, dict[int, float]]:
    """Median seconds of one forward: {context: {query_len: s}}. The context is prefilled
    once; after each timed forward the cache is cropped back to it."""
    import torch
    from transformers import DynamicCache

    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    vocab = lm.config.vocab_size
    gen = torch.Generator().manual_seed(0)
    table: dict[int, dict[int, float]] = {}
    with torch.inference_mode():
        for ctx in contexts:
            cache = DynamicCache(config=lm.config)
            prompt = torch.randint(0, vocab, (1, ctx), generator=gen).to(device)
            lm(input_ids=prompt, past_key_values=cache, use_cache=True, logits_to_keep=1)
            table[ctx] = {}
            for q in query_lens:
                ids = torch.randint(0, vocab, (1, q), generator=gen).to(device)
                positions = torch.arange(ctx, ctx + q, device=device)[None]
                times = []
                for i in range(repeats + 1):  # the first is a warm-up
                    sync()
                    start = time.perf_counter()
                    lm(input_ids=ids, position_ids=positions, cache_position=positions[0],
                       past_key_values=cache, use_cache=True)
                    sync()
                    if i:
                        times.append(time.perf_counter() - start)
                    cache.crop(-q)  # drop the timed tokens: back to the context
                table[ctx][q] = statistics.median(times)
    return table


def format_table(table: dict[int, dict[int, float]]) -> str:
    """Markdown: one row per context length, one column per query length (ms)."""
    query_lens = sorted({q for row in table.values() for q in row})
    lines = ["| context \\ query tokens | " + " | ".join(str(q) for q in query_lens) + " |",
             "|" + "---|" * (len(query_lens) + 1)]
    for ctx in sorted(table):
        lines.append(f"| {ctx} | " + " | ".join(f"{table[ctx][q] * 1000:.2f}"
                                                for q in query_lens) + " |")
    return "\n".join(lines)


def _cpu_model() -> str:
    """The CPU model from /proc/cpuinfo (Linux), else what ``platform`` knows."""
    import platform

    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        for line in cpuinfo.read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Time one forward with 1..64 query tokens over 256..8k context tokens "
        "(median of --repeats, after a warm-up), print a table (ms) and save JSON.")
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", help="local checkpoint folder")
    src.add_argument("--shape", default="tiny", choices=sorted(SHAPES),
                     help="random-weight Qwen3 of this shape (default: tiny)")
    p.add_argument("--layers", type=int, help="override the number of layers (small CPU runs)")
    p.add_argument("--vocab", type=int, help="override the vocabulary size (--shape only)")
    p.add_argument("--query-lens", type=_ints, default=list(DEFAULT_QUERY_LENS),
                   help="comma-separated (default: 1,2,4,8,16,32,64)")
    p.add_argument("--contexts", type=_ints, default=list(DEFAULT_CONTEXTS),
                   help="comma-separated (default: 256,1024,4096,8192)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default: cpu)")
    p.add_argument("--dtype", default=None,
                   help="float32 / bfloat16 / float16 (default: float32 on CPU, bf16 on CUDA)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, help="torch CPU threads")
    p.add_argument("--out", type=Path, help="folder for forward_latency.json")
    return p


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = build_parser().parse_args(argv)
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    dtype_name = args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32")
    lm, desc = build_model(args.model, None if args.model else args.shape, args.layers,
                           args.vocab, getattr(torch, dtype_name), args.device)
    table = profile(lm, args.query_lens, args.contexts, args.repeats, args.device)
    device_name = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
                   else _cpu_model())
    result = {
        "command": " ".join([Path(sys.argv[0]).name,
                             *(argv if argv is not None else sys.argv[1:])]),
        "model": desc, "device": args.device, "device_name": device_name, "dtype": dtype_name,
        "threads": torch.get_num_threads(), "repeats": args.repeats,
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "latency_s": {str(c): {str(q): t for q, t in row.items()} for c, row in table.items()},
    }
    print(f"forward latency (ms), {desc}, {args.device} {dtype_name}\n{format_table(table)}")
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "forward_latency.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
