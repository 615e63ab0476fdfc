"""Engine registration: one small, idempotent, lazy ``register()`` per engine.

* vLLM calls ``diffspec.plugin.vllm:register`` (entry-point group ``vllm.general_plugins``)
  in every process it starts.
* SGLang calls ``diffspec.plugin.sglang:register`` (entry-point group ``sglang.srt.plugins``)
  in each of its processes.

Both first check that the running engine is a version diffspec is tested against
(:mod:`diffspec.plugin.versions`) and fail with a clear message otherwise. Model classes
and methods are registered as ``"pkg.mod:Class"`` strings, so nothing heavy is imported
until the engine needs it. Every monkeypatch an engine needs (where it offers no hook)
is listed in ``diffspec/plugin/patches.md`` with why / how / upstream / removal plan,
and applied only from ``register()``.
"""
