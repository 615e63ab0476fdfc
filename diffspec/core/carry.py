"""Carried drafts: the tail of a draft block that the step did not verify, kept for the
next step when the step accepted everything it verified.

A two-pass drafter may draft a block wider than the step verifies (over-drafting: the
adaptive policy verifies ``k`` of ``w`` drafts,
:meth:`~diffspec.core.adaptive.AdaptiveDrafts.draft_widths`).
When all ``k`` drafts pass and the token the verify emits after them (the bonus) is the
block's own draft ``k + 1``, the block's drafts ``k + 2 .. w`` still continue the committed
text exactly as they were drafted, from the same anchor: the next step takes them as its
drafts at prompt lookup's price (a verify, no draft pass). Anything else (a rejection, a
different bonus, a request that moved on in between) drops them. Verification is the
same as for any draft, so the output is unchanged: only how many tokens a step commits.

Engine-free: both engines' workers keep one :class:`CarriedDrafts` each.

Design notes: docs/design/core.md (section ``diffspec/core/carry.py``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["CARRY_SETTINGS", "CarriedDrafts", "carried_tail", "carry_setting"]

CARRY_SETTINGS = ("auto", "always", "off")


def carry_setting(value, method: str, adaptive: bool) -> str:
    """The ``"carry"`` option of a method's settings (``None``/``true``: ``"auto"``, the
    default; ``false``: ``"off"``), checked: a ``ValueError`` whose first words say what to
    do for an unknown value, or a setting other than the default where nothing is
    carried (TiDAR; a fixed draft count, which verifies every draft it drafts)."""
    setting = value
    if value is None or isinstance(value, bool):
        setting = "off" if value is False else "auto"
    if setting not in CARRY_SETTINGS:
        raise ValueError(f"set \"carry\" to \"auto\" (the default: over-draft where the "
                         f"latency profile says it pays), \"always\" or \"off\" (or false), "
                         f"got {value!r}")
    tidar = method.lower() == "tidar"
    if setting != "auto" and (tidar or not adaptive):
        raise ValueError(
            "remove \"carry\": carried drafts are the adaptive two-pass drafter's (orthrus, "
            "linear_self_spec with \"adaptive\": true); " + (
                "tidar pre-drafts every outcome in its own forward" if tidar else
                "\"adaptive\": false drafts the full block every step"))
    return setting


def carried_tail(block: Sequence[int], verified: int, emitted: Sequence[int]) -> list[int]:
    """The drafts of ``block`` (``w`` draft tokens after one anchor) a next step can take,
    given that its first ``verified`` were verified and the step emitted ``emitted`` (the
    accepted drafts, then the verify's own token): ``block[verified + 1:]`` when every
    verified draft was accepted and the verify's token is ``block[verified]``; ``[]``
    otherwise."""
    if (len(emitted) != verified + 1 or len(block) <= verified + 1
            or list(emitted[:verified]) != list(block[:verified])
            or emitted[verified] != block[verified]):
        return []
    return list(block[verified + 1:])


@dataclass(frozen=True)
class _Pending:
    start: int  # the anchor's position the block was drafted from
    verified: int  # drafts the step verifies (-1: settled, ``block`` is the tail)
    block: tuple[int, ...]  # every draft of the block, or once settled its carried tail


class CarriedDrafts:
    """Per request, the block drafted this step (:meth:`keep`) and, once the step's
    outcome is known (:meth:`settle`, or the emitted tokens given to :meth:`take`), the
    drafts the next step may take (:meth:`take`)."""

    def __init__(self) -> None:
        self._pending: dict[str, _Pending] = {}

    def keep(self, req_id: str, start: int, verified: int, block: Sequence[int]) -> None:
        """Request ``req_id``'s step verifies ``verified`` drafts of ``block``, drafted
        from the anchor at position ``start``; a block with nothing past the verified
        drafts and the bonus is not kept."""
        if len(block) > verified + 1:
            self._pending[req_id] = _Pending(start, verified, tuple(int(t) for t in block))
        else:
            self._pending.pop(req_id, None)

    def settle(self, req_id: str, emitted: Sequence[int]) -> None:
        """The step of request ``req_id`` emitted ``emitted``: keep its block's carried
        tail (:func:`carried_tail`) for the step at the next anchor, or nothing."""
        pending = self._pending.pop(req_id, None)
        if pending is not None and pending.verified >= 0:
            tail = carried_tail(pending.block, pending.verified, [int(t) for t in emitted])
            if tail:
                self._pending[req_id] = _Pending(pending.start + len(emitted), -1, tuple(tail))

    def take(self, req_id: str, start: int, limit: int,
             emitted: Sequence[int] | None = None) -> list[int]:
        """The carried drafts of request ``req_id``, whose anchor is now at position
        ``start`` (at most ``limit``; ``[]``: none), its last step's ``emitted`` tokens
        settled first where given. Whatever was kept for it is consumed."""
        if emitted is not None:
            self.settle(req_id, emitted)
        pending = self._pending.pop(req_id, None)
        if pending is None or pending.verified >= 0 or limit <= 0 or start != pending.start:
            return []
        return list(pending.block[:limit])

    def forget(self, live_req_ids: Iterable[str]) -> None:
        """Drop what was kept for requests that left the batch."""
        live = set(live_req_ids)
        for req_id in [r for r in self._pending if r not in live]:
            del self._pending[req_id]
