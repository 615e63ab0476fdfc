"""benchmarks/server_vs_offline.py: the pure parts (vLLM's iteration log, the step split, the
baselines, the table's per-round ratio)."""

from benchmarks.server_vs_offline import (
    cpu_by_role,
    iterations,
    parse_baseline,
    step_summary,
    table,
)

LOG = """(APIServer pid=1) INFO [loggers.py:199] Engine 000: Iteration(0): 1 context requests, 96 context tokens, 0 generation requests, 0 generation tokens, iteration elapsed time: 420.10 ms, CPU KV cache usage: 0.1%
(APIServer pid=1) INFO [loggers.py:199] Engine 000: Iteration(1): 0 context requests, 0 context tokens, 1 generation requests, 4 generation tokens, iteration elapsed time: 200.00 ms, CPU KV cache usage: 0.1%
(APIServer pid=1) INFO [loggers.py:335] Engine 000: Avg prompt throughput: 14.0 tokens/s
(APIServer pid=1) INFO [loggers.py:199] Engine 000: Iteration(2): 0 context requests, 0 context tokens, 1 generation requests, 2 generation tokens, iteration elapsed time: 100.00 ms, CPU KV cache usage: 0.1%
"""


def test_iteration_log_splits_the_wall_time() -> None:
    its = iterations(LOG)
    assert its == [(96, 0, 420.1), (0, 4, 200.0), (0, 2, 100.0)]
    s = step_summary(its, wall_s=1.0, tokens=5)
    assert s["decode_steps"] == 2 and s["decode_step_ms"] == 150.0
    assert s["scheduled_per_step"] == 3 and s["tokens_per_step"] == 2.5
    assert abs(s["inside_steps_s"] - 0.7201) < 1e-9 and abs(s["outside_steps_s"] - 0.2799) < 1e-9
    assert s["tok_per_s"] == 5.0 and s["ms_per_token"] == 200.0


def test_baselines_and_cpu_roles() -> None:
    assert parse_baseline("ar") == ("ar", None)
    assert parse_baseline("orthrus") == ("orthrus", {"method": "orthrus"})
    assert parse_baseline("orthrus:3") == ("orthrus:3", {"method": "orthrus", "num_speculative_tokens": 3,
                                                         "adaptive": False})
    before = {1: ("python", 1.0), 2: ("VLLM::EngineCor", 5.0)}
    after = {1: ("python", 1.5), 2: ("VLLM::EngineCor", 7.0), 3: ("VLLM::Worker", 4.0)}
    assert cpu_by_role(before, after, "API server", tokens=100) == {
        "API server": 5.0, "engine core": 20.0, "worker": 40.0}


def test_ratio_is_taken_within_each_round() -> None:
    def row(rnd, baseline, tps):
        return {"round": rnd, "layout": "default", "baseline": baseline, "path": "server", "tok_per_s": tps,
                "ms_per_token": 1000 / tps, "decode_step_ms": 100.0, "tokens_per_step": 1.0,
                "inside_steps_s": 9.0, "wall_s": 10.0, "cpu_ms_per_token": {"worker": 1.0}}
    # round 0 is slow for everyone, round 1 fast: the ratio is 1.5 in both
    lines = table([row(0, "ar", 10), row(0, "orthrus:3", 15), row(1, "ar", 20), row(1, "orthrus:3", 30)])
    line = next(x for x in lines if "| orthrus:3 |" in x)
    assert "| 1.50 |" in line and "22.50 (15.00, 30.00)" in line
