"""Baseline specs: what the driver's ``--baselines`` names, parsed once for every adapter.

A spec is ``METHOD[:K]`` (K drafts per step; default ``--num-draft-tokens``), e.g.
``ar,ngram:4,eagle3:3,dflash:15,orthrus``. The report labels each row with the spec as given.
"""

from __future__ import annotations

from dataclasses import dataclass

from diffspec.methods import METHODS as REGISTRY

# Every baseline is a method of diffspec's registry (diffspec/methods.py): diffspec's own
# and the engines' (ar, ngram, eagle3, dflash).
METHODS = {name: m.summary for name, m in REGISTRY.items()}
# diffspec's methods served through the engines' speculative decoding (the served model
# drafts for itself: Orthrus and NLD linear in two forwards per step, TiDAR in one)
SELF_SPEC = tuple(m.name for m in REGISTRY.values()
                  if m.origin == "diffspec" and (m.vllm is not None or m.sglang is not None))
DRAFTER_METHODS = tuple(m.name for m in REGISTRY.values() if m.needs_drafter)


def engine_methods(engine: str) -> tuple[str, ...]:
    """Baselines an engine runs: AR plus every registry method it serves."""
    if engine == "reference":
        return tuple(m.name for m in REGISTRY.values() if m.reference is not None)
    return ("ar", *(m.name for m in REGISTRY.values() if m.engine(engine) is not None))


@dataclass(frozen=True)
class Baseline:
    label: str  # as written on the command line, e.g. "eagle3:3"
    method: str  # a key of METHODS
    num_draft_tokens: int  # drafts per step (0 for ar)
    drafter: str | None = None  # drafter checkpoint (eagle3 / dflash)
    dllm_config: str | None = None  # fast_dllm: its settings YAML (--dllm-algorithm-config)

    @property
    def forwards_per_step(self) -> int:
        return REGISTRY[self.method].forwards_per_step


def parse(specs: list[str], default_k: int,
          drafters: dict[str, str | None] | None = None) -> list[Baseline]:
    """``["ar", "eagle3:3", ...]`` -> baselines, AR first (added when missing)."""
    drafters = drafters or {}
    out: list[Baseline] = []
    for spec in ["ar", *[s for s in specs if s != "ar"]]:
        method, _, k = spec.partition(":")
        if method not in METHODS:
            raise ValueError(f"unknown baseline {method!r} (known: {', '.join(METHODS)})")
        if method == "ar" and k:
            raise ValueError("ar takes no draft count")
        if method in DRAFTER_METHODS and not drafters.get(method):
            raise ValueError(f"baseline {method} needs --{method}-drafter PATH")
        num = 0 if method == "ar" else int(k) if k else default_k
        out.append(Baseline(spec, method, num, drafters.get(method)))
    if len({b.label for b in out}) != len(out):
        raise ValueError(f"baselines repeat a label: {specs}")
    return out


def add_drafter_args(parser) -> None:
    """``--<method>-drafter PATH`` for every registry method that needs a drafter."""
    for method in REGISTRY.values():
        if method.needs_drafter:
            parser.add_argument(f"--{method.name}-drafter", default=None,
                                help=f"{method.summary}: its drafter checkpoint (adds the "
                                     f"{method.name} baseline when not listed)")


def drafters_from_args(args) -> dict[str, str | None]:
    """The drafter paths given by :func:`add_drafter_args`' options, by method name."""
    return {m.name: getattr(args, f"{m.name}_drafter")
            for m in REGISTRY.values() if m.needs_drafter}
