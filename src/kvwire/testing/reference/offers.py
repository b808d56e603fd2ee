"""Standing offers (``offer-pulls``, O1) of the reference peer: the offer as an attempt
(:class:`StandingOffer`), the check of an offer's view and timeout (:func:`check_offer`), and the
index that finds the one standing offer covering a pull whole (:class:`OfferIndex`).

An offer is an attempt like a publish: it takes a queue slot, concludes once (``DELIVERED`` with
every bit true at its deadline, ``CANCELLED`` on ``cancel()`` or ``shutdown()``) and quiesces once
no answer reads its rows. Each answer *claims* the offer while it may still read its rows; the
offer's access is ``TOUCHING`` while any claim is held, so it quiesces only when the last claim
goes (O1.8). The peer that made it ends the claims not yet reading when the offer concludes
(:meth:`StandingOffer.conclude_locked` calls back into it)."""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from kvwire.contract import Cause, InvalidSubmission, OutcomeStatus, View, WakeFn
from kvwire.contract.regions import Located
from kvwire.testing.reference.core import Access, ReferenceAttempt, Runner, read_rows

__all__ = ["StandingOffer", "OfferedAnswer", "OfferIndex", "check_offer"]


def check_offer(view: View, timeout_s: object, default_s: float) -> float:
    """O1.2 beyond what locating the view checked (M1, M4, V1): every group names every row, no
    name twice in a group, and a timeout that is a finite number > 0 (not a bool), as a hint's.
    Returns the offer's deadline in seconds from now (``default_s`` without a timeout)."""
    for group in view.groups:
        if not group.rows:
            continue
        if group.names is None:
            raise InvalidSubmission(f"group {group.group_id} of an offer carries no names; an offer names every "
                                    "row it offers (N1.5)")
        if len(np.unique(group.names, axis=0)) != group.rows:
            raise InvalidSubmission(f"group {group.group_id} of an offer names one block on two rows; an offer "
                                    "names each block at most once per group (O1.2)")
    if timeout_s is None:
        return default_s
    problem = (f"an offer's timeout_s is a finite real number of seconds > 0, not a bool (or None for the "
               f"backend's deadline), got {timeout_s!r} (O1.2)")
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, numbers.Real):
        raise InvalidSubmission(problem)
    try:
        seconds = float(timeout_s)
    except (OverflowError, ValueError):  # an int beyond any float
        raise InvalidSubmission(problem) from None
    if not math.isfinite(seconds) or seconds <= 0:
        raise InvalidSubmission(problem)
    return seconds


@dataclass(eq=False)
class OfferedAnswer:
    """A pull answered from an offer: per requested group, the offer's group (its index in the
    offer's view) and the rows of it the pull names, in the pull's order."""

    ticket: int
    reply_to: bytes
    offer: StandingOffer
    rows: tuple[tuple[int, np.ndarray], ...]
    reading: bool = False
    ended: bool = False


class StandingOffer(ReferenceAttempt):
    """An offer (O1): the attempt, where its rows lie, and the answers that hold a claim on it."""

    def __init__(self, runner: Runner, view: View, wake: WakeFn, timeout_s: float, located: tuple[Located, ...],
                 on_end: Callable[[StandingOffer], None]) -> None:
        super().__init__(runner, "offer", view, wake, timeout_s)
        self.located = located
        self.on_end = on_end
        #: Answers that may still read its rows (O1.8): claimed, and not yet done reading.
        self.claims: set[OfferedAnswer] = set()
        #: Per group id: the slot size of its rows, and each name's row in the group.
        self.groups: dict[int, tuple[int, dict[bytes, int]]] = {
            g.group_id: (g.region.slot_bytes, {g.name(row): row for row in range(g.rows)}) for g in view.groups}
        self.index_of = {g.group_id: i for i, g in enumerate(view.groups)}

    def read(self, answer: OfferedAnswer) -> tuple[np.ndarray, ...]:
        """The rows ``answer`` sends, copied out of the holder's memory (while its claim holds
        the offer unquiesced; without the lock)."""
        return tuple(read_rows(self.located[gi], self.view.groups[gi].region.slot_bytes, rows)
                     for gi, rows in answer.rows)

    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        concluded = super().conclude_locked(status, cause, reason, by_peer=by_peer)
        if concluded:
            self.on_end(self)  # O1.7/O1.8: it answers nothing more; the answers not reading end
        return concluded

    def expire_locked(self) -> None:
        """O1.7: the deadline is how an offer ends well: every row stood offered all its life."""
        for mask in self.moved:
            mask[:] = True
        self.conclude_locked(OutcomeStatus.DELIVERED)

    def claim_locked(self, answer: OfferedAnswer) -> None:
        if not self.claims:
            self.access = Access.TOUCHING
        self.claims.add(answer)

    def release_locked(self, answer: OfferedAnswer) -> None:
        """``answer`` will never read the rows again; the last claim to go lets the offer quiesce."""
        self.claims.discard(answer)
        if not self.claims:
            self.untouch_locked()


@dataclass
class OfferIndex:
    """The standing offers of one peer, in the order they were made (O1.10: any that covers a
    pull may answer it; the oldest does)."""

    offers: list[StandingOffer] = field(default_factory=list)

    def add(self, offer: StandingOffer) -> None:
        self.offers.append(offer)

    def remove(self, offer: StandingOffer) -> None:
        if offer in self.offers:
            self.offers.remove(offer)

    def cover(self, groups: tuple[int, ...], slot_bytes: tuple[int, ...],
              names: np.ndarray) -> tuple[StandingOffer, tuple[tuple[int, np.ndarray], ...]] | None:
        """The first standing offer that covers the pull whole (O1.4), and for each requested group
        the offer's row of each requested name; ``None`` when no one offer does (O1.5)."""
        wanted = [n.tobytes() for n in np.asarray(names, dtype=np.uint8)]
        for offer in self.offers:
            rows = []
            for gid, size in zip(groups, slot_bytes, strict=True):
                entry = offer.groups.get(gid)
                if entry is None or entry[0] != size or any(n not in entry[1] for n in wanted):
                    break
                rows.append((offer.index_of[gid],
                             np.fromiter((entry[1][n] for n in wanted), dtype=np.int64, count=len(wanted))))
            else:
                return offer, tuple(rows)
        return None
