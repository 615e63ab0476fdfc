"""Baseline specs: what the driver's ``--baselines`` names, parsed once for every adapter.

A spec is ``METHOD[:K]`` (K drafts per step; default ``--num-draft-tokens``), e.g.
``ar,ngram:4,eagle3:3,dflash:15,orthrus``. The report labels each row with the spec as given.
"""

from __future__ import annotations

from dataclasses import dataclass

# method -> what it is (the CLI's epilog and the docs list these)
METHODS = {
    "ar": "plain autoregressive decoding (the lossless oracle; always run first)",
    "ngram": "prompt lookup (vLLM's ngram proposer; the reference decoder's n-gram drafter)",
    "eagle3": "the engine's EAGLE-3 with a drafter checkpoint (--eagle3-drafter)",
    "dflash": "the engine's DFlash with a drafter checkpoint (--dflash-drafter)",
    "orthrus": "diffspec Orthrus self-speculation (draft + verify forwards per step)",
    "linear_self_spec": "diffspec NLD linear self-speculation (draft + verify forwards per step)",
    "tidar": "diffspec TiDAR (reference decoder only)",
}
SELF_SPEC = ("orthrus", "linear_self_spec")  # two forwards per step: draft + verify
DRAFTER_METHODS = ("eagle3", "dflash")  # a separate drafter checkpoint


@dataclass(frozen=True)
class Baseline:
    label: str  # as written on the command line, e.g. "eagle3:3"
    method: str  # a key of METHODS
    num_draft_tokens: int  # drafts per step (0 for ar)
    drafter: str | None = None  # drafter checkpoint (eagle3 / dflash)

    @property
    def forwards_per_step(self) -> int:
        return 2 if self.method in SELF_SPEC else 1


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
