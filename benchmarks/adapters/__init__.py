"""One adapter per engine; each turns (baselines, prompts) into :class:`RunResult` rows.

``reference``: diffspec's reference decoder, in-process. ``vllm_offline``: ``vllm.LLM`` in
a subprocess (``vllm_worker.py``). ``sglang_offline``: ``sglang.Engine`` in a subprocess of
SGLang's own interpreter (``sglang_worker.py``). ``openai_server``: an already running vLLM
or SGLang server on loopback, streaming.
"""
