"""diffspec benchmarks: one driver (``driver.py``), one adapter per engine (``adapters/``),
shared metrics (``metrics.py``), a forward-latency profiler (``profile_forward.py``)."""
