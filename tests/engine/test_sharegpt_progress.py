"""Data generation with the real vLLM offline engine shows its progress: the CLI
(``python -m training.sharegpt generate``) on the embedded default's base checkpoint,
a handful of prompts, stderr not a terminal (as in CI): progress lines with prompts done,
a rate, vLLM's token rates and an ETA come while requests finish, not only per shard."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from tests.engine.common import default_model

PROMPTS = ["What is the capital of France?", "Name three primary colors.",
           "Write a haiku about the sea.", "What is 2 + 2?"]


def test_generate_prints_progress_lines(tmp_path: Path) -> None:
    base = default_model(base_only=True)
    sharegpt = tmp_path / "sharegpt.json"
    sharegpt.write_text(json.dumps([
        {"id": str(i), "conversations": [{"from": "human", "value": p},
                                         {"from": "gpt", "value": "..."}]}
        for i, p in enumerate(PROMPTS)]))
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", DIFFSPEC_PROGRESS_S="0")
    proc = subprocess.run(
        [sys.executable, "-m", "training.sharegpt", "generate", "--out",
         str(tmp_path / "out"), "--sharegpt", str(sharegpt), "--model", str(base),
         "--held-out", "0", "--max-new-tokens", "8", "--shard-size", "2", "--batch-size", "2"],
        capture_output=True, text=True, timeout=900, env=env, check=False,
        cwd=Path(__file__).resolve().parents[2])  # training/ is a folder of the checkout
    assert proc.returncode == 0, proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines()
             if line.startswith("[sharegpt] generate: prompt ")]
    # one per finished request (interval 0), then the shard's exact count
    assert len(lines) >= 3, proc.stderr[-4000:]
    assert re.search(r"prompt \d/4 \(\d+\.\d%\) \| [\d.]+ prompt/s, this shard input: "
                     r"[\d.]+ tok/s, output: [\d.]+ tok/s \| \S+ elapsed \| ETA \S+", lines[0]), \
        lines
    assert lines[-1].startswith("[sharegpt] generate: prompt 4/4 (100.0%)"), lines
    assert "[sharegpt] generate: done, prompt 4 in" in proc.stderr
    totals = [line for line in proc.stdout.splitlines() if line.startswith('{"prompts"')]
    assert totals and json.loads(totals[-1])["prompts"] == 4, proc.stdout[-2000:]
