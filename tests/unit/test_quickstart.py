"""The pure parts of ``diffspec quickstart``: the Orthrus server's speculative config
(diffspec's default, adaptive, or a fixed K by hand), the two servers taking turns, the
answer check, the tokens/s lines with their ratio, what the server chose from its counters,
and the command's arguments; its flow with stand-in servers (SIGTERM, "serving"). (The
quickstart end to end starts vLLM servers: tests/engine/test_quickstart_serve.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from diffspec.quickstart import (
    DEFAULT_ANSWER,
    DEFAULT_PROMPT,
    ChatResult,
    Reply,
    _expected,
    answer_found,
    choice_lines,
    default_speculative_config,
    measure,
    profile_line,
    speed_lines,
)
from diffspec.serving import SpecDecodeCounters

BLOCK = 8  # the shipped heads' block: at most 7 drafts per step
ADAPTIVE = {"method": "orthrus", "num_speculative_tokens": 7}


def _heads(tmp_path: Path, **extra: object) -> Path:
    (tmp_path / "heads.json").write_text(json.dumps({"block_size": BLOCK, **extra}))
    return tmp_path


# ------------------------------------------------------------------ speculative config


def test_the_default_is_diffspecs_default_config_with_the_full_block_as_the_bound() -> None:
    """No "adaptive" key: the plugin's default (adaptive drafting, its own start-up
    profile) applies, as for any user's --speculative-config."""
    assert default_speculative_config(BLOCK, None) == ADAPTIVE


def test_k_by_hand_is_a_fixed_k() -> None:
    assert default_speculative_config(BLOCK, 3) == {
        "method": "orthrus", "num_speculative_tokens": 3, "adaptive": False}
    assert default_speculative_config(BLOCK, 7)["num_speculative_tokens"] == 7
    for bad in (0, BLOCK):  # what to do first
        with pytest.raises(ValueError, match=r"^use --num-draft-tokens 1\.\.7, or leave it "
                                             r"out for adaptive drafting"):
            default_speculative_config(BLOCK, bad)


def test_the_vllm_plugin_reads_the_default_as_adaptive_and_k_by_hand_as_fixed() -> None:
    from diffspec.plugin.vllm.config import diffspec_options

    assert diffspec_options(default_speculative_config(BLOCK, None))["adaptive"] is True
    assert diffspec_options(default_speculative_config(BLOCK, 3))["adaptive"] is False


def test_profile_line_finds_the_engines_start_up_line() -> None:
    log = ("INFO 11-27 [core.py:1] init engine\n"
           "(EngineCore pid=7) INFO 11-27 18:00:01 [proposer.py:217] diffspec: measured a "
           "latency profile in 3.2 s (16 points, 1..256 tokens), cached at /c/x.json\n"
           "INFO 11-27 [api_server.py:1] Starting vLLM API server\n")
    assert profile_line(log) == ("diffspec: measured a latency profile in 3.2 s (16 points, "
                                 "1..256 tokens), cached at /c/x.json")
    reused = "x diffspec: reused the latency profile /c/x.json (16 points, 1..256 tokens; ..."
    assert profile_line(reused).startswith("diffspec: reused the latency profile /c/x.json")
    assert profile_line("INFO nothing about it\n") is None


# --------------------------------------------------------------------- the comparison


class _Stub:
    """A server: ``ask`` logs the call and answers ``tokens`` tokens in ``seconds``;
    ``counters`` grow by ``per_request`` at each request."""

    def __init__(self, name: str, calls: list, tokens: int, seconds: float,
                 per_request: SpecDecodeCounters = SpecDecodeCounters()) -> None:
        self.name, self.calls, self.tokens, self.seconds = name, calls, tokens, seconds
        self.per_request, self.total = per_request, SpecDecodeCounters()

    def ask(self, prompt: str, max_tokens: int) -> Reply:
        self.calls.append((self.name, max_tokens))
        p, t = self.per_request, self.total
        self.total = SpecDecodeCounters(t.drafts + p.drafts, t.draft_tokens + p.draft_tokens,
                                        t.accepted + p.accepted)
        return Reply(f"answer of {self.name}", min(self.tokens, max_tokens), self.seconds)

    def counters(self) -> SpecDecodeCounters:
        return self.total


def test_measure_warms_up_then_alternates_and_counts_only_the_timed_requests() -> None:
    calls: list = []
    orthrus = _Stub("orthrus", calls, 32, 0.5, SpecDecodeCounters(10, 40, 15))
    ar = _Stub("ar", calls, 32, 1.0)
    o, a = measure([orthrus, ar], "q", 32, requests=3)
    assert calls == [("orthrus", 4), ("ar", 4),  # the untimed warm-ups
                     ("orthrus", 32), ("ar", 32), ("ar", 32), ("orthrus", 32),
                     ("orthrus", 32), ("ar", 32)]
    assert o.requests == a.requests == 3 and o.completion_tokens == 96
    assert o.tokens_per_s == pytest.approx(64.0) and a.tokens_per_s == pytest.approx(32.0)
    assert o.counters == SpecDecodeCounters(30, 120, 45)  # three timed requests, no warm-up
    assert a.counters == SpecDecodeCounters()
    assert speed_lines(o, a, ADAPTIVE)[2].startswith("Orthrus / AR: 2.00x")


# --------------------------------------------------------------------------- output


def test_answer_found_ignores_case() -> None:
    assert answer_found("... known as rayleigh Scattering.", DEFAULT_ANSWER)
    assert not answer_found("Because of the ocean.", DEFAULT_ANSWER)


def _run(tokens: int, seconds: float, requests: int = 1,
         counters: SpecDecodeCounters = SpecDecodeCounters()) -> ChatResult:
    return ChatResult([Reply("a", tokens // requests, seconds / requests)] * requests, counters)


def test_speed_lines_give_both_rates_and_their_ratio() -> None:
    lines = speed_lines(_run(300, 10.0, 3), _run(300, 8.0, 3), ADAPTIVE)
    assert lines[0] == ("Orthrus (vLLM, adaptive, at most 7 drafts per step): 300 tokens in "
                        "10.00 s = 30.0 tokens/s (3 requests)")
    assert lines[1] == ("plain AR (vLLM, no speculation): 300 tokens in 8.00 s = 37.5 "
                        "tokens/s (3 requests)")
    assert lines[2].startswith("Orthrus / AR: 0.80x")


def test_speed_lines_without_ar_give_no_ratio() -> None:
    fixed = default_speculative_config(BLOCK, 3)
    lines = speed_lines(_run(64, 2.0), None, fixed, ar_note="skipped (--no-ar-check)")
    assert lines == ["Orthrus (vLLM, K = 3 drafts every step): 64 tokens in 2.00 s = 32.0 "
                     "tokens/s (1 request)", "plain AR: skipped (--no-ar-check)"]


def test_choice_lines_say_what_the_server_chose_from_its_counters() -> None:
    # 2 requests of 50 tokens: 2 from the prefills, 98 from decode steps; 38 drafts
    # accepted, so 60 decode steps, 20 of which drafted 90 tokens in all
    r = _run(100, 4.0, 2, SpecDecodeCounters(20, 90, 38, (18.0, 12.0, 8.0)))
    assert r.decode_steps == 60
    drafts, accepted = choice_lines(r, ADAPTIVE)
    assert drafts == ("drafts per step (adaptive, at most 7 drafts per step): 1.50 on average "
                      "over ~60 decode steps; drafted at 20 of them (4.50 each)")
    assert accepted == ("acceptance length: 2.90 tokens per drafting step (38 of 90 drafts "
                        "accepted; drafts 1.. accepted in 0.90, 0.60, 0.40 of those steps)")


def test_choice_lines_when_the_server_never_drafted() -> None:
    assert choice_lines(_run(40, 1.0, 2), ADAPTIVE) == [
        "drafts per step (adaptive, at most 7 drafts per step): 0.00 on average over ~38 "
        "decode steps; drafted at 0 of them"]


# ------------------------------------------------------------------------ arguments


def _args(*argv: str):
    from diffspec.cli import build_parser

    return build_parser().parse_args(["quickstart", *argv])


def test_arguments_default_to_adaptive_drafting_and_the_default_question() -> None:
    args = _args()
    assert args.num_draft_tokens is None and not hasattr(args, "latency_profile")
    assert args.json is None and not args.no_ar_check
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


def _fake_quickstart(tmp_path: Path, monkeypatch, ready_after: float, *argv: str,
                     on_chat=lambda: None):
    """``diffspec quickstart --serve`` (and ``argv``) on stand-in servers: (args, pid
    files of each server's child, chat calls as (served name, max tokens)); ``on_chat()``
    runs at each chat request. The Orthrus stand-in drafts 2, accepts 1 per request."""
    from diffspec import default_model, quickstart
    from diffspec.serving import ServerProcess, free_port
    from tests.unit.test_serving import _FAKE_SERVER

    orthrus = tmp_path / "orthrus"
    orthrus.mkdir()
    (orthrus / "config.json").write_text(json.dumps({"block_size": BLOCK}))
    heads = _heads(tmp_path)
    monkeypatch.setattr(default_model, "prepare_default", lambda *a, **k: orthrus)
    monkeypatch.setattr(default_model, "base_checkpoint", lambda *a, **k: tmp_path / "base")
    pid_files, chats = [], []

    class FakeServer(quickstart.Server):
        def __init__(self, python, model, port, *, served_name, **_):
            pid_files.append(tmp_path / f"child-{len(pid_files)}.pid")
            cmd = [sys.executable, "-c", _FAKE_SERVER, str(port), str(ready_after),
                   str(pid_files[-1])]
            self.served_name, self.calls = served_name, 0
            self.process = ServerProcess(cmd, port, log_path=tmp_path / f"{served_name}.log")
            self.cmd, self.url, self.proc = cmd, self.process.url, self.process.proc
            self.log_path = self.process.log_path

        def wait_ready(self, timeout_s):
            self.process.wait_ready(timeout_s, poll_s=0.1)

        def ask(self, prompt, max_tokens):
            chats.append((self.served_name, max_tokens))
            self.calls += 1
            on_chat()
            fast = self.served_name == quickstart.SERVED_NAME
            return Reply("Rayleigh scattering.", 4, 0.1 if fast else 0.3)

        def counters(self):
            if self.served_name != quickstart.SERVED_NAME:
                return SpecDecodeCounters()
            return SpecDecodeCounters(self.calls, 2 * self.calls, self.calls)

    monkeypatch.setattr(quickstart, "Server", FakeServer)
    args = _args("--serve", "--port", str(free_port()), "--requests", "1", "--heads",
                 str(heads), "--python", sys.executable, *argv)
    return args, pid_files, chats


def _sigterm_in(seconds: float) -> threading.Timer:
    import os
    import signal

    timer = threading.Timer(seconds, os.kill, (os.getpid(), signal.SIGTERM))
    timer.start()
    return timer


def _sigterm_once(ready: Callable[[], bool], timeout_s: float = 60.0) -> threading.Event:
    """SIGTERM this process as soon as ``ready()`` holds (polled), not after a fixed delay
    that a loaded machine can outrun; set the returned event to cancel."""
    import os
    import signal

    cancel = threading.Event()

    def watch() -> None:
        deadline = time.monotonic() + timeout_s
        while not cancel.is_set() and time.monotonic() < deadline:
            if ready():
                os.kill(os.getpid(), signal.SIGTERM)
                return
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    return cancel


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
    args, pid_files, chats = _fake_quickstart(
        tmp_path, monkeypatch, 0.3, "--num-draft-tokens", "3", "--no-ar-check",
        on_chat=lambda: before_chat.append(capsys.readouterr().out))
    timer = _sigterm_in(3.0)  # by then it waits on the server
    try:
        code = run_quickstart(args)
    finally:
        timer.cancel()
    out = capsys.readouterr().out
    assert code == 0 and chats == [("smollm2-orthrus", 4), ("smollm2-orthrus", 128)]
    assert f"serving smollm2-orthrus at http://127.0.0.1:{args.port}/v1" in before_chat[0]
    assert "Ctrl-C or SIGTERM stops it" in before_chat[0]
    assert "still serving" in out and "stopped the server" in out
    assert _gone(int(pid_files[0].read_text())), "the server's child outlived SIGTERM"
    assert port_is_free(args.port)


def test_sigterm_before_the_server_answers_stops_it_too(tmp_path: Path, monkeypatch,
                                                       capsys) -> None:
    from diffspec.quickstart import run_quickstart
    from diffspec.serving import port_is_free

    args, pid_files, chats = _fake_quickstart(tmp_path, monkeypatch, 1e9, "--no-ar-check")
    # once the stand-in server's child is up (its pid written); it never answers
    cancel = _sigterm_once(lambda: bool(pid_files) and pid_files[0].exists()
                           and pid_files[0].read_text().strip() != "")
    try:
        code = run_quickstart(args)
    finally:
        cancel.set()
    out = capsys.readouterr().out
    assert code == 143 and chats == [] and "serving smollm2" not in out
    assert _gone(int(pid_files[0].read_text()))
    assert port_is_free(args.port)


def test_the_printed_ratio_is_that_of_the_two_servers_it_started(tmp_path: Path, monkeypatch,
                                                                 capsys) -> None:
    """The default flow (adaptive, with the AR server) on stand-ins: both servers started,
    the Orthrus one first, asked in turn, the AR one stopped once measured; the printed
    rates, ratio and drafts are those of the --json record. SIGTERM once it keeps serving."""
    from diffspec.quickstart import run_quickstart

    out_json = tmp_path / "quickstart.json"
    args, pid_files, chats = _fake_quickstart(tmp_path, monkeypatch, 0.3, "--requests", "2",
                                              "--json", str(out_json))
    timer = _sigterm_in(4.0)
    try:
        code = run_quickstart(args)
    finally:
        timer.cancel()
    out = capsys.readouterr().out
    assert code == 0, out
    assert chats == [("smollm2-orthrus", 4), ("smollm2", 4), ("smollm2-orthrus", 128),
                     ("smollm2", 128), ("smollm2", 128), ("smollm2-orthrus", 128)]
    assert all(_gone(int(f.read_text())) for f in pid_files) and len(pid_files) == 2
    record = json.loads(out_json.read_text())
    assert record["speculative_config"] == ADAPTIVE
    assert [r["seconds"] for r in record["orthrus"]["requests"]] == [0.1, 0.1]
    assert record["ar"]["tokens_per_s"] == pytest.approx(8 / 0.6)
    assert record["ratio"] == pytest.approx(3.0)
    assert record["orthrus"]["counters"] == {"drafts": 2, "draft_tokens": 4, "accepted": 2,
                                             "accepted_per_pos": []}
    assert record["orthrus"]["server"]["url"] == f"http://127.0.0.1:{args.port}"
    assert record["ar"]["server"]["url"] != record["orthrus"]["server"]["url"]
    assert ("Orthrus (vLLM, adaptive, at most 7 drafts per step): 8 tokens in 0.20 s = 40.0 "
            "tokens/s (2 requests)") in out
    assert "plain AR (vLLM, no speculation): 8 tokens in 0.60 s = 13.3 tokens/s" in out
    assert "Orthrus / AR: 3.00x" in out and "output == plain AR decoding" in out
    # 8 tokens, 2 from the prefills, 2 accepted: 4 decode steps, 2 drafting 2 each
    assert ("drafts per step (adaptive, at most 7 drafts per step): 1.00 on average over ~4 "
            "decode steps; drafted at 2 of them (2.00 each)") in out
    assert out.index("Orthrus / AR") < out.index("still serving")


def test_wrong_heads_folder_says_what_to_do_before_any_download(tmp_path: Path) -> None:
    from diffspec.default_model import DefaultModelError, prepare_default

    (tmp_path / "heads.json").write_text("{}")  # no heads.safetensors
    with pytest.raises(DefaultModelError, match=r"^give a heads folder with heads.safetensors "
                       r"and heads.json \(quickstart: --heads DIR.*missing heads.safetensors"):
        prepare_default(tmp_path / "cache", heads_dir=tmp_path, log=print)
    assert not (tmp_path / "cache").exists()
