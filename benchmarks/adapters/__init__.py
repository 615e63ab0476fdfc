"""One adapter per engine; each turns (baseline, prompts) into a :class:`RunResult`.

``reference``: diffspec's reference decoder, in-process. ``vllm_offline``: ``vllm.LLM`` in
a subprocess (``vllm_worker.py``). ``openai_server``: an already running OpenAI-compatible
server on loopback (vLLM ``serve``; SGLang once its plugin lands), streaming.
"""
