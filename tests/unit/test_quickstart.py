"""The pure parts of ``diffspec quickstart``: K from a hand-built latency profile and the
heads' acceptance per position, reading that list (and its absence) from heads.json, the
answer check, the tokens/s lines with their ratio, and the command's arguments. (The
quickstart end to end starts vLLM servers: not a unit test.)"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from itertools import pairwise
from pathlib import Path

import pytest

from diffspec.core.adaptive import LatencyProfile
from diffspec.quickstart import (
    DEFAULT_ANSWER,
    DEFAULT_PROMPT,
    ChatResult,
    _expected,
    answer_found,
    choose_draft_count,
    read_acceptance,
    speed_lines,
)

BLOCK = 8  # the shipped heads' block: at most 7 drafts per step


def _never() -> LatencyProfile:
    raise AssertionError("the latency profile was measured though K needed none")


def _heads(tmp_path: Path, **extra: object) -> Path:
    (tmp_path / "heads.json").write_text(json.dumps({"block_size": BLOCK, **extra}))
    return tmp_path


# ---------------------------------------------------------------------- heads.json


def test_read_acceptance_reads_the_list(tmp_path: Path) -> None:
    heads = _heads(tmp_path, acceptance_per_position=[0.92, 0.3, 0, 1])
    assert read_acceptance(heads) == [0.92, 0.3, 0.0, 1.0]


def test_read_acceptance_without_the_key_is_none(tmp_path: Path) -> None:
    assert read_acceptance(_heads(tmp_path)) is None


@pytest.mark.parametrize("value", [0.9, [], [0.5, 1.5], [0.5, -0.1], ["0.5"], [True]],
                         ids=["not_a_list", "empty", "above_1", "negative", "string", "bool"])
def test_read_acceptance_refuses_malformed_lists(tmp_path: Path, value: object) -> None:
    with pytest.raises(ValueError, match="acceptance_per_position"):
        read_acceptance(_heads(tmp_path, acceptance_per_position=value))


def test_the_shipped_heads_give_the_quickstart_its_k() -> None:
    """The shipped heads carry their measured acceptance, one entry per draft of the block,
    each the share of steps that accepted every draft up to it (so never rising): the
    quickstart recommends K from it (on a profile where the best K is inside the block),
    not the full-block fallback."""
    from diffspec.default_model import DEFAULT_HEADS_DIR

    acceptance = read_acceptance(DEFAULT_HEADS_DIR)  # raises if malformed
    block = json.loads((DEFAULT_HEADS_DIR / "heads.json").read_text())["block_size"]
    assert acceptance is not None, "the shipped heads.json has no acceptance_per_position"
    assert len(acceptance) == block - 1, acceptance
    assert acceptance[0] > 0.5 and all(a >= b for a, b in pairwise(acceptance))
    knee = LatencyProfile({1: 0.010, 3: 0.010, 4: 0.020, 8: 0.060})
    k, why = choose_draft_count(block, acceptance, None, lambda: knee)
    assert 1 <= k < block - 1 and "(recommended)" in why, why


# -------------------------------------------------------------------------------- K


def test_k_by_hand_needs_no_profile() -> None:
    k, why = choose_draft_count(BLOCK, [0.9] * 7, 3, _never)
    assert k == 3 and "--num-draft-tokens" in why
    for bad in (0, BLOCK):  # what to do first
        with pytest.raises(ValueError, match=r"^use --num-draft-tokens 1\.\.7, or leave it out"):
            choose_draft_count(BLOCK, [0.9] * 7, bad, _never)


def test_k_without_acceptance_is_the_full_block_and_says_so() -> None:
    k, why = choose_draft_count(BLOCK, None, None, _never)
    assert k == BLOCK - 1
    assert 'no "acceptance_per_position"' in why and "full block of 8" in why


def test_k_is_the_full_block_where_wider_forwards_are_free() -> None:
    flat = LatencyProfile({1: 0.010, 8: 0.010})
    k, why = choose_draft_count(BLOCK, [0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3], None,
                                lambda: flat)
    # 1 + 4.2 tokens per step of two 10 ms forwards, against one token per 10 ms
    assert k == 7
    assert "expected tokens per step: 5.20" in why and "estimated speed: 2.60x AR" in why
    assert "8 tokens = 20.0 ms; plain AR: 10.0 ms per token" in why


def test_k_stops_where_forwards_stop_being_free() -> None:
    knee = LatencyProfile({1: 0.010, 3: 0.010, 4: 0.020, 8: 0.060})
    k, why = choose_draft_count(BLOCK, [0.96, 0.9, 0.85, 0.1, 0.05, 0.0, 0.0], None,
                                lambda: knee)
    # K = 2: 2.86 tokens / 20 ms; K = 3: 3.71 / 40 ms; K = 1: 1.96 / 20 ms; AR: 1 / 10 ms
    assert k == 2 and "estimated speed: 1.43x AR" in why


def test_k_where_ar_wins_is_the_best_speculative_one_and_says_so() -> None:
    weak = LatencyProfile({1: 0.010, 8: 0.012})
    k, why = choose_draft_count(BLOCK, [0.3, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0], None,
                                lambda: weak)
    assert k == 1 and "plain AR is estimated faster" in why


def test_acceptance_past_the_block_is_ignored() -> None:
    flat = LatencyProfile({1: 0.010, 8: 0.010})
    k, _ = choose_draft_count(4, [1.0] * 10, None, lambda: flat)
    assert k == 3


# --------------------------------------------------------------------------- output


def test_answer_found_ignores_case() -> None:
    assert answer_found("... known as rayleigh Scattering.", DEFAULT_ANSWER)
    assert not answer_found("Because of the ocean.", DEFAULT_ANSWER)


def test_speed_lines_give_both_rates_and_their_ratio() -> None:
    orthrus = ChatResult(text="a", completion_tokens=300, seconds=10.0, requests=3)
    ar = ChatResult(text="a", completion_tokens=300, seconds=8.0, requests=3)
    lines = speed_lines(orthrus, ar, k=2)
    assert lines[0] == ("Orthrus (vLLM, K = 2): 300 tokens in 10.00 s = 30.0 tokens/s "
                        "(3 requests)")
    assert lines[1] == ("plain AR (vLLM, no speculation): 300 tokens in 8.00 s = 37.5 "
                        "tokens/s (3 requests)")
    assert lines[2].startswith("Orthrus / AR: 0.80x")


def test_speed_lines_without_ar_give_no_ratio() -> None:
    orthrus = ChatResult(text="a", completion_tokens=64, seconds=2.0)
    lines = speed_lines(orthrus, None, k=7, ar_note="not measured (--serve)")
    assert lines == ["Orthrus (vLLM, K = 7): 64 tokens in 2.00 s = 32.0 tokens/s (1 request)",
                     "plain AR: not measured (--serve)"]


def test_acceptance_per_position_of_a_run() -> None:
    r = ChatResult(text="a", completion_tokens=20, seconds=1.0, drafts=10, accepted=12,
                   accepted_per_pos=(9.0, 3.0, 0.0))
    assert r.acceptance_per_position == pytest.approx([0.9, 0.3, 0.0])
    assert ChatResult(text="a", completion_tokens=1, seconds=1.0).acceptance_per_position == []


# ------------------------------------------------------------------------ arguments


def _args(*argv: str):
    from diffspec.cli import build_parser

    return build_parser().parse_args(["quickstart", *argv])


def test_arguments_default_to_the_recommended_k_and_the_default_question() -> None:
    args = _args()
    assert args.num_draft_tokens is None and args.latency_profile is None
    assert args.requests == 3 and args.prompt is None
    assert _expected(args) == DEFAULT_ANSWER


@pytest.mark.parametrize(
    ("argv", "k", "expected"),
    [
        (["--num-draft-tokens", "3"], 3, DEFAULT_ANSWER),
        (["--num-speculative-tokens", "5"], 5, DEFAULT_ANSWER),  # the former name
        (["--prompt", "Hi!"], None, None),  # another question: nothing to check
        (["--prompt", "Hi!", "--expect", "hello"], None, "hello"),
        (["--prompt", DEFAULT_PROMPT], None, DEFAULT_ANSWER),
    ],
    ids=["k_by_hand", "k_former_flag", "own_prompt", "own_prompt_expect", "default_prompt"],
)
def test_arguments(argv: list[str], k: int | None, expected: str | None) -> None:
    args = _args(*argv)
    assert args.num_draft_tokens == k and _expected(args) == expected


@pytest.mark.parametrize("argv", [["--requests", "0"], ["--num-draft-tokens", "0"],
                                  ["--max-tokens", "-1"]],
                         ids=["no_requests", "no_drafts", "negative_max_tokens"])
def test_arguments_refuse_non_positive_counts(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        _args(*argv)


def test_importing_the_quickstart_imports_no_torch() -> None:
    code = "import sys, diffspec.quickstart; assert 'torch' not in sys.modules"
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            check=False)
    assert result.returncode == 0, result.stderr


def test_start_up_profile_on_a_tiny_checkpoint() -> None:
    from diffspec.assets import SYNTH_QWEN3_DIR
    from diffspec.profiling import measure_latency_profile

    profile = measure_latency_profile(SYNTH_QWEN3_DIR, context=16, query_lens=[1, 2, 3],
                                      repeats=1)
    assert sorted(profile.points) == [1, 2, 3]
    assert all(s > 0 for s in profile.points.values())


# ------------------------------------------------------------------ SIGTERM, "serving"
# The command's flow with a stand-in server (tests/unit/test_serving.py's: ready after a
# delay, a child process in its group as vLLM's engine core is); the real one, on vLLM:
# tests/engine/test_quickstart_serve.py.


def test_sigterm_raises_stopped_inside_and_is_restored_after() -> None:
    import os
    import signal

    from diffspec.quickstart import Stopped, stop_on_sigterm

    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(Stopped), stop_on_sigterm():
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5)  # interrupted at once
    assert signal.getsignal(signal.SIGTERM) == before
    assert issubclass(Stopped, KeyboardInterrupt)  # handled wherever Ctrl-C is


def _fake_quickstart(tmp_path: Path, monkeypatch, ready_after: float,
                     on_chat=lambda: None):
    """``diffspec quickstart --serve`` on the stand-in server: (args, pid file of the
    server's child, chat calls); ``on_chat()`` runs at each chat request."""
    from diffspec import default_model, quickstart
    from diffspec.serving import ServerProcess, free_port
    from tests.unit.test_serving import _FAKE_SERVER

    orthrus = tmp_path / "orthrus"
    orthrus.mkdir()
    (orthrus / "config.json").write_text(json.dumps({"block_size": BLOCK}))
    heads = _heads(tmp_path)
    monkeypatch.setattr(default_model, "prepare_default", lambda *a, **k: orthrus)
    monkeypatch.setattr(default_model, "base_checkpoint", lambda *a, **k: tmp_path / "base")
    pid_file, chats = tmp_path / "child.pid", []

    class FakeServer(quickstart.Server):
        def __init__(self, python, model, port, **_):
            cmd = [sys.executable, "-c", _FAKE_SERVER, str(port), str(ready_after),
                   str(pid_file)]
            self.process = ServerProcess(cmd, port, log_path=tmp_path / "server.log")
            self.cmd, self.url, self.proc = cmd, self.process.url, self.process.proc
            self.log_path = self.process.log_path

        def wait_ready(self, timeout_s):
            self.process.wait_ready(timeout_s, poll_s=0.1)

        def chat(self, *a, **k):
            chats.append(a)
            on_chat()
            return ChatResult(text="Rayleigh scattering.", completion_tokens=4, seconds=0.1)

    monkeypatch.setattr(quickstart, "Server", FakeServer)
    args = _args("--serve", "--port", str(free_port()), "--num-draft-tokens", "3",
                 "--no-ar-check", "--requests", "1", "--heads", str(heads),
                 "--python", sys.executable)
    return args, pid_file, chats


def _sigterm_in(seconds: float) -> threading.Timer:
    import os
    import signal

    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    return timer


def _gone(pid: int) -> bool:
    from tests.unit.test_serving import _alive

    deadline = time.monotonic() + 10
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not _alive(pid)


def test_serve_says_serving_once_it_answers_and_stops_on_sigterm(tmp_path: Path, monkeypatch,
                                                                capsys) -> None:
    from diffspec.quickstart import run_quickstart
    from diffspec.serving import port_is_free

    before_chat: list[str] = []  # what was printed when the first request went out
    args, pid_file, chats = _fake_quickstart(
        tmp_path, monkeypatch, ready_after=0.3,
        on_chat=lambda: before_chat.append(capsys.readouterr().out))
    timer = _sigterm_in(3.0)  # by then it waits on the server
    try:
        code = run_quickstart(args)
    finally:
        timer.cancel()
    out = capsys.readouterr().out
    assert code == 0 and len(chats) == 1
    assert f"serving smollm2-orthrus at http://127.0.0.1:{args.port}/v1" in before_chat[0]
    assert "Ctrl-C or SIGTERM stops it" in before_chat[0]
    assert "still serving" in out and "stopped the server" in out
    assert _gone(int(pid_file.read_text())), "the server's child outlived SIGTERM"
    assert port_is_free(args.port)


def test_sigterm_before_the_server_answers_stops_it_too(tmp_path: Path, monkeypatch,
                                                       capsys) -> None:
    from diffspec.quickstart import run_quickstart
    from diffspec.serving import port_is_free

    args, pid_file, chats = _fake_quickstart(tmp_path, monkeypatch, ready_after=1e9)
    timer = _sigterm_in(1.5)
    try:
        code = run_quickstart(args)
    finally:
        timer.cancel()
    out = capsys.readouterr().out
    assert code == 143 and chats == [] and "serving smollm2" not in out
    assert _gone(int(pid_file.read_text()))
    assert port_is_free(args.port)


def test_wrong_heads_folder_says_what_to_do_before_any_download(tmp_path: Path) -> None:
    from diffspec.default_model import DefaultModelError, prepare_default

    (tmp_path / "heads.json").write_text("{}")  # no heads.safetensors
    with pytest.raises(DefaultModelError, match=r"^give a heads folder with heads.safetensors "
                       r"and heads.json \(quickstart: --heads DIR.*missing heads.safetensors"):
        prepare_default(tmp_path / "cache", heads_dir=tmp_path, log=print)
    assert not (tmp_path / "cache").exists()
