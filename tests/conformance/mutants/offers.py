"""Mutants that each break one standing-offer clause (O1: the optional offer-pulls protocol). Every
harness below is registered once, in ``tests/conformance/mutant_table.py``, with the clause it
breaks and the ``-k`` selection of the suite's tests that must catch it. A mutant either wraps a
correct backend through :mod:`kit` (the memory backend, or the reference peer for the serving
protocol) and breaks the clause from outside, or subclasses a reference backend
(:mod:`kvwire.testing.reference`) and overrides the one method where the bug lives.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants/offers.py:NAME``."""

from __future__ import annotations

import dataclasses

import numpy as np
from kit import (  # beside this file; on sys.path when loaded as a harness
    MutantHarness,
    PeerMutant,
    PeerMutantHarness,
)

from kvwire.contract import OFFER_PULLS, Capabilities, Cause, InvalidSubmission, OutcomeStatus, View, WakeFn
from kvwire.testing.reference.core import Access, ReferenceAttempt, write_rows
from kvwire.testing.reference.harness import ReferencePeerHarness as LoopbackHarness
from kvwire.testing.reference.offers import OfferedAnswer, OfferIndex, StandingOffer
from kvwire.testing.reference.peer import Fabric, PullMessage, ReferencePeer, Rows


class _OfferPeerHarness(LoopbackHarness):
    """The reference peer's harness, building ``peer`` (a broken subclass) and declaring what it
    declares."""

    def __init__(self, peer: type[ReferencePeer]) -> None:
        self.peer = peer

    def make_peer(self, fabric: Fabric, name: str, *, timeout_s: float, max_in_flight: int) -> ReferencePeer:
        return self.peer(fabric, name, timeout_s=timeout_s, max_in_flight=max_in_flight)

    def capabilities(self) -> Capabilities:
        return getattr(self.peer, "declare", lambda caps: caps)(super().capabilities())


def _mutant(name: str, peer: type[ReferencePeer]) -> MutantHarness:
    return MutantHarness(name.replace("_", "-"), PeerMutant, inner=_OfferPeerHarness(peer))


# -- O1.1 ------------------------------------------------------------------------------------------

class OfferDeclaredWithoutServePulls(ReferencePeer):
    """O1.1: declares ``offer-pulls`` in place of ``serve-pulls`` (the protocols set replaced, not
    added to), though it still serves pulls."""

    @staticmethod
    def declare(caps: Capabilities) -> Capabilities:
        return dataclasses.replace(caps, protocols=frozenset({OFFER_PULLS}))

    def capabilities(self) -> Capabilities:
        return self.declare(super().capabilities())


class OfferDeclaredWithoutCancellation(ReferencePeer):
    """O1.1: declares ``offer-pulls`` but no cancellation (B4.5 allows that for other backends),
    so a holder could never withdraw an offer before its deadline."""

    @staticmethod
    def declare(caps: Capabilities) -> Capabilities:
        return dataclasses.replace(caps, cancellation=False)

    def capabilities(self) -> Capabilities:
        return self.declare(super().capabilities())


# -- O1.2 ------------------------------------------------------------------------------------------

class OfferAcceptsRepeatedNames(ReferencePeer):
    """O1.2: an offer naming one block on two rows of a group is taken ("the index keeps one row
    per name anyway"): the later row answers for that name."""

    def _offer_deadline(self, view: View, timeout_s: object) -> float:
        try:
            return super()._offer_deadline(view, timeout_s)
        except InvalidSubmission as exc:
            if "two rows" not in str(exc):
                raise
            return self._timeout_s


class OfferTimeoutUnchecked(ReferencePeer):
    """O1.2: an offer's ``timeout_s`` is read with ``float()`` and checked only for ``<= 0``, so
    ``True`` stands for one second and NaN for an offer that never ends."""

    def _offer_deadline(self, view: View, timeout_s: object) -> float:
        deadline = super()._offer_deadline(view, None)
        if timeout_s is None:
            return deadline
        try:
            seconds = float(timeout_s)  # type: ignore[arg-type]
        except (TypeError, ValueError):
            raise InvalidSubmission(f"timeout_s must be a number, got {timeout_s!r}") from None
        if seconds <= 0:
            raise InvalidSubmission(f"timeout_s must be positive, got {timeout_s!r}")
        return seconds


# -- O1.3 ------------------------------------------------------------------------------------------

class OfferAdmittedBeyondTheBound(ReferencePeer):
    """O1.3: offers are admitted against a bound one larger than ``max_in_flight`` ("an offer moves
    nothing until pulled, so it may take one slot more")."""

    def offer(self, view: View, wake: WakeFn, timeout_s: float | None = None) -> StandingOffer:
        with self._runner.lock:
            self._runner.max_in_flight += 1
        try:
            return super().offer(view, wake, timeout_s)
        finally:
            with self._runner.lock:
                self._runner.max_in_flight -= 1


# -- O1.4 and O1.11 ----------------------------------------------------------------------------------

class OfferedPullAlsoHandedToHolder(ReferencePeer):
    """O1.4: a pull an offer covers is answered from it, and also handed to the holder through
    ``incoming()`` ("so the holder knows what was pulled")."""

    def _on_request(self, message: PullMessage) -> None:
        with self._runner.lock:
            covered = self._serving_wake is not None and self._offers.cover(
                message.groups, message.slot_bytes, message.names) is not None
        if covered:
            self._to_holder(message)
        super()._on_request(message)


class OfferAnswersRowsByPosition(ReferencePeer):
    """O1.4: an answer sends the offer's first rows, row ``j`` for the pull's block ``j``, not the
    rows of the names the pull asks for (right only when the pull asks for the offer's prefix)."""

    def _claim_locked(self, message: PullMessage) -> OfferedAnswer | None:
        answer = super()._claim_locked(message)
        if answer is not None:
            answer.rows = tuple((gi, np.arange(rows.size)) for gi, rows in answer.rows)
        return answer


class OfferAnswersOnlyAnonymousPulls(ReferencePeer):
    """O1.11: a pull that carries credentials is never answered from an offer ("credentials are
    for the holder to check"): it goes to the holder."""

    def _claim_locked(self, message: PullMessage) -> OfferedAnswer | None:
        return None if message.credentials else super()._claim_locked(message)


# -- O1.5 ------------------------------------------------------------------------------------------

class AnswersPartOfAPull(ReferencePeer):
    """O1.5: a pull no offer covers whole is answered from an offer that covers a prefix of its
    blocks, and the requester gets that prefix (a partial prefix delivers, N2.10)."""

    def _claim_locked(self, message: PullMessage) -> OfferedAnswer | None:
        answer = super()._claim_locked(message)
        for count in range(message.names.shape[0] - 1, 0, -1):
            if answer is not None:
                break
            answer = super()._claim_locked(dataclasses.replace(message, names=message.names[:count]))
        return answer


class _SizeBlindIndex(OfferIndex):
    def cover(self, groups: tuple[int, ...], slot_bytes: tuple[int, ...],
              names: np.ndarray) -> tuple[StandingOffer, tuple[tuple[int, np.ndarray], ...]] | None:
        for offer in self.offers:
            sizes = tuple(offer.groups[g][0] if g in offer.groups else s for g, s in zip(groups, slot_bytes, strict=True))
            found = OfferIndex([offer]).cover(groups, sizes, names)
            if found is not None:
                return found
        return None


class OfferIgnoresSlotSize(ReferencePeer):
    """O1.5: an offer covers a pull by group and name, whatever slot size the pull expects: a pull
    of rows of another size is answered with the offer's rows (and fails at the requester)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        self._offers = _SizeBlindIndex()


# -- O1.6 ------------------------------------------------------------------------------------------

class OfferScrubsRowsAtItsEnd(ReferencePeer):
    """O1.6: when an offer concludes its rows are zeroed ("no served bytes are left behind"): the
    backend writes memory it was only offered."""

    def _offer_ended_locked(self, offer: StandingOffer) -> None:
        super()._offer_ended_locked(offer)
        for group, located in zip(offer.view.groups, offer.located, strict=True):
            if group.rows:
                write_rows(located, group.region.slot_bytes, np.arange(group.rows),
                           np.zeros((group.rows, group.region.slot_bytes), dtype=np.uint8))


# -- O1.7 ------------------------------------------------------------------------------------------

class _ExpiringOffer(StandingOffer):
    expire_locked = ReferenceAttempt.expire_locked  # the generic deadline: FAILED, cause DEADLINE


class OfferExpiresAsFailure(ReferencePeer):
    """O1.7: an offer's deadline fails it like any attempt's (``FAILED``, cause ``DEADLINE``)
    instead of delivering it with every bit true."""

    _offer_type = _ExpiringOffer


class CancelledOfferStillAnswers(ReferencePeer):
    """O1.7: ``cancel()`` concludes an offer but leaves it in the index ("a cancel only stops its
    deadline"): pulls of its blocks are still answered from it, not handed to the holder."""

    def _offer_ended_locked(self, offer: StandingOffer) -> None:
        super()._offer_ended_locked(offer)
        assert offer.outcome is not None
        if offer.outcome.cause is Cause.HOLDER_CANCELLED:
            self._offers.add(offer)

    def _claim_locked(self, message: PullMessage) -> OfferedAnswer | None:
        found = self._offers.cover(message.groups, message.slot_bytes, message.names)
        if found is None or not found[0].concluded:
            return super()._claim_locked(message)
        offer, rows = found  # concluded and quiesced: it is read without a claim
        answer = OfferedAnswer(message.ticket, message.reply_to, offer, rows)
        offer.claims.add(answer)
        return answer

    def _answer_from_offer(self, answer: OfferedAnswer) -> None:
        if not answer.offer.concluded:
            super()._answer_from_offer(answer)
            return
        data = answer.offer.read(answer)
        with self._runner.lock:
            answer.offer.claims.discard(answer)
        self._send(answer.reply_to, Rows(answer.ticket, self.address(), data))


class ShutdownDeliversOffers(ReferencePeer):
    """O1.7: ``shutdown()`` concludes each standing offer as its deadline would, ``DELIVERED``
    with every bit true ("it stood until the end")."""

    def shutdown(self) -> frozenset[ReferenceAttempt]:
        with self._runner.lock:
            for attempt in list(self._runner.live):
                if isinstance(attempt, StandingOffer) and attempt.outcome is None:
                    attempt.expire_locked()
        return super().shutdown()


# -- O1.8 ------------------------------------------------------------------------------------------

class OfferWaitsForItsAnswers(ReferencePeer):
    """O1.8: an offer that concludes lets the answers it gave run to their end, so it quiesces
    only when the last of them has read its rows: an answer held half-way keeps it unquiesced."""

    def _offer_ended_locked(self, offer: StandingOffer) -> None:
        self._offers.remove(offer)


class OfferQuiescesBeforeItsAnswersEnd(ReferencePeer):
    """O1.8: an offer quiesces with its conclusion, forgetting the answers it gave, which run on:
    an answer held half-way reads the offered rows after the offer said it quiesced."""

    def _offer_ended_locked(self, offer: StandingOffer) -> None:
        self._offers.remove(offer)
        offer.claims.clear()
        if offer.access is not Access.ENDED:
            offer.access = Access.ENDED
            self._runner.changed_locked(offer)

    def _answer_from_offer(self, answer: OfferedAnswer) -> None:
        data = answer.offer.read(answer)
        with self._runner.lock:
            answer.offer.release_locked(answer)
        self._send(answer.reply_to, Rows(answer.ticket, self.address(), data))


# -- O1.9 ------------------------------------------------------------------------------------------

class RequesterCancelEndsTheOffer(ReferencePeer):
    """O1.9: a requester's ``Cancel`` of a pull an offer answered ends the offer itself (cancelled
    by the peer, as N2.13 ends an answer), so the next pull of its blocks goes to the holder."""

    def _claim_locked(self, message: PullMessage) -> OfferedAnswer | None:
        answer = super()._claim_locked(message)
        if answer is not None:
            self.__dict__.setdefault("answered_by", {})[message.ticket] = answer.offer
        return answer

    def _on_cancel(self, message: object) -> None:
        super()._on_cancel(message)  # type: ignore[arg-type]
        with self._runner.lock:
            offer = self.__dict__.get("answered_by", {}).pop(message.ticket, None)  # type: ignore[attr-defined]
            if offer is not None:
                offer.conclude_locked(OutcomeStatus.CANCELLED, Cause.PEER_CANCELLED, "the requester cancelled",
                                      by_peer=True)


# -- O1.10 -----------------------------------------------------------------------------------------

class OfferIndexKeyedByName(ReferencePeer):
    """O1.10: the index keeps one offer per (group, name); when an offer ends, its keys leave the
    index, so another standing offer of the same blocks no longer answers them."""

    def _offer_ended_locked(self, offer: StandingOffer) -> None:
        super()._offer_ended_locked(offer)
        keys = {(gid, name) for gid, (_, names) in offer.groups.items() for name in names}
        for other in list(self._offers.offers):
            if any((gid, name) in keys for gid, (_, names) in other.groups.items() for name in names):
                self._offers.remove(other)


class OfferWakesOnEachAnswer(ReferencePeer):
    """O1.10: each answer from an offer calls the offer's wake ("its holder may want to know it
    is in use"), though nothing the holder can poll changed."""

    def _claim_locked(self, message: PullMessage) -> OfferedAnswer | None:
        answer = super()._claim_locked(message)
        if answer is not None:
            self._runner.later_locked(answer.offer.wake)
        return answer


offer_declared_without_serve_pulls = _mutant("offer_declared_without_serve_pulls", OfferDeclaredWithoutServePulls)
offer_declared_without_cancellation = _mutant("offer_declared_without_cancellation", OfferDeclaredWithoutCancellation)
offer_accepts_repeated_names = _mutant("offer_accepts_repeated_names", OfferAcceptsRepeatedNames)
offer_timeout_unchecked = _mutant("offer_timeout_unchecked", OfferTimeoutUnchecked)
offer_admitted_beyond_the_bound = _mutant("offer_admitted_beyond_the_bound", OfferAdmittedBeyondTheBound)
offered_pull_also_handed_to_holder = _mutant("offered_pull_also_handed_to_holder", OfferedPullAlsoHandedToHolder)
offer_answers_rows_by_position = _mutant("offer_answers_rows_by_position", OfferAnswersRowsByPosition)
answers_part_of_a_pull = _mutant("answers_part_of_a_pull", AnswersPartOfAPull)
offer_ignores_slot_size = _mutant("offer_ignores_slot_size", OfferIgnoresSlotSize)
offer_scrubs_rows_at_its_end = _mutant("offer_scrubs_rows_at_its_end", OfferScrubsRowsAtItsEnd)
offer_expires_as_failure = _mutant("offer_expires_as_failure", OfferExpiresAsFailure)
cancelled_offer_still_answers = _mutant("cancelled_offer_still_answers", CancelledOfferStillAnswers)
shutdown_delivers_offers = _mutant("shutdown_delivers_offers", ShutdownDeliversOffers)
offer_waits_for_its_answers = _mutant("offer_waits_for_its_answers", OfferWaitsForItsAnswers)


offer_quiesces_before_its_answers_end = _mutant("offer_quiesces_before_its_answers_end",
                                                OfferQuiescesBeforeItsAnswersEnd)
requester_cancel_ends_the_offer = _mutant("requester_cancel_ends_the_offer", RequesterCancelEndsTheOffer)
offer_index_keyed_by_name = _mutant("offer_index_keyed_by_name", OfferIndexKeyedByName)
offer_wakes_on_each_answer = _mutant("offer_wakes_on_each_answer", OfferWakesOnEachAnswer)
offer_answers_only_anonymous_pulls = _mutant("offer_answers_only_anonymous_pulls", OfferAnswersOnlyAnonymousPulls)


# -- O1.12: a frame bound that cuts an answer from an offer ---------------------------------------

class OfferFrameCutsTheAnswer(ReferencePeer):
    """O1.12: answers from offers carry at most one row per group (a frame bound it keeps): a pull
    of more blocks is answered from the offer with its first block only, never handed to the
    holder whole."""

    def _claim_locked(self, message: PullMessage) -> OfferedAnswer | None:
        answer = super()._claim_locked(message)
        if answer is not None:
            answer.rows = tuple((index, rows[:1]) for index, rows in answer.rows)
        return answer


offer_frame_cuts_the_answer = PeerMutantHarness("offer-frame-cuts-the-answer", OfferFrameCutsTheAnswer)
