"""Deliberately broken backends of the fourth probing round: each wraps the memory backend, or
for the serving protocol the reference peer (``loopback_peer.py``), as ``mutants.py`` does, and
breaks one clause the earlier rounds covered least: views that later work rewrites (V2.2), a
refusal that touched memory or woke later (S3.5, S3.7), the masks of a failed outcome (A6.5),
fetches of the same rows in flight together (A9.5), and the serving protocol's tickets, addresses
and answers (H1.11, H1.13, N2.3, N2.12). ``test_mutants.py`` reads its entries in ``mutant_table.py`` and checks that
the suite fails each one on a test named after the rule it breaks.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants_round4.py:NAME``."""

from __future__ import annotations

import ctypes
import threading

import numpy as np
from loopback_peer import LoopbackHarness  # beside this file; on sys.path when loaded as a harness
from mutants import HandsOverViews, Mutant, MutantHarness, PeerMutant, Wrapped, _outcome_like

from kvwire.contract import (
    Attempt,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    Outcome,
    PullRequest,
    SubmissionRejected,
    View,
    WakeFn,
)

# -- V2.2: a later submission rewrites an earlier view in place -------------------------------

class MutatesAnEarlierView(Mutant):
    """V2.2: on each submission the backend reverses, in place, the slots and names of the view
    it was given before (a staging index array reused for the next submission)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        attempt = super().make(op, view, hint, wake)
        previous = self.__dict__.get("previous")
        if previous is not None and previous is not view:
            for g in previous.groups:
                if g.rows > 1:
                    g.slots.setflags(write=True)
                    g.slots[:] = g.slots[::-1].copy()
                    g.slots.setflags(write=False)
                    if g.names is not None:
                        g.names.setflags(write=True)
                        g.names[:] = g.names[::-1].copy()
                        g.names.setflags(write=False)
        self.__dict__["previous"] = view
        return attempt


# -- S3.5: a fetch rejected for a full queue clears its rows first ----------------------------

class RejectedFetchClearsRows(Mutant):
    """S3.5: a fetch rejected for a full queue has already zeroed its rows (destination prepared
    before the queue slot was asked for)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        try:
            return super().make(op, view, hint, wake)
        except SubmissionRejected:
            if op == "fetch" and not self.__dict__.get("down"):
                for g in view.groups:
                    for address in g.addresses().tolist():
                        ctypes.memset(int(address), 0, g.region.slot_bytes)
            raise

    def shutdown(self) -> frozenset[Attempt]:
        self.__dict__["down"] = True
        return super().shutdown()


# -- A9.5: a fetch of names another fetch in flight is fetching passes them as misses ---------

class _Dedup(Wrapped):
    keys: list[tuple[int, bytes]]
    keep: list[list[int]] | None = None
    seen = False

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            return None
        if not self.seen:
            self.seen = True
            inflight = self.backend.__dict__.setdefault("inflight", set())
            for k in self.keys:
                inflight.discard(k)
        if self.keep is None:
            return out
        masks = list(self.view.row_masks())
        for gi, rows in enumerate(self.keep):
            if rows:
                masks[gi][rows] = out.masks[gi]
        return _outcome_like(out, masks)


class DedupesNamesInFlight(Mutant):
    """A9.5: a fetch naming (group, name) rows that another fetch of this instance is still
    fetching (not yet concluded for the holder) leaves them out and passes them for misses."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op != "fetch" or any(g.names is None for g in view.groups):
            return super().make(op, view, hint, wake)
        inflight = self.__dict__.setdefault("inflight", set())
        keep: list[list[int]] = []
        keys: list[tuple[int, bytes]] = []
        groups = []
        for g in view.groups:
            rows = [r for r in range(g.rows) if (g.group_id, g.name(r)) not in inflight]
            keep.append(rows)
            keys += [(g.group_id, g.name(r)) for r in rows]
            groups.append(LayerGroupRows(g.group_id, g.kind, g.region, g.slots[rows], g.tokens, g.names[rows]))
        dup = any(len(k) != g.rows for k, g in zip(keep, view.groups, strict=True))
        inner = self.inner.fetch(View(tuple(groups)) if dup else view, hint, wake)
        inflight.update(keys)
        attempt = _Dedup(inner, view, op, self)
        attempt.keys = keys
        if dup:
            attempt.keep = keep
        return attempt


# -- A6.5: the masks of a failed fetch are cleared after hand-over ----------------------------

class _RollsBack(HandsOverViews):
    def handed_over(self, out: Outcome, buffers: list[np.ndarray]) -> None:
        if not out.is_delivered:
            self.backend.__dict__.setdefault("rollback", []).extend(buffers)


class FailedMasksClearedLater(Mutant):
    """A6.5: the masks of a failed or cancelled outcome are views of buffers the backend keeps;
    when the next submission comes in, a rollback pass over the attempts that did not deliver
    clears them."""

    attempt_type = _RollsBack

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        for b in self.__dict__.pop("rollback", []):
            b[:] = False
        return super().submit(op, view, hint, wake)


# -- S3.7: the wake of a fetch refused for overlapping rows is called later -----------------------

class OverlapRefusalWakesLater(Mutant):
    """S3.7: a fetch refused for overlapping rows (V4) had its wake put in the instance's wake list
    before the check: it is called along with the wake of the next attempt that concludes."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        try:
            stray = self.__dict__.setdefault("stray", [])

            def both() -> None:
                for stray_wake in list(stray):
                    stray_wake()
                wake()

            return super().make(op, view, hint, both)
        except InvalidSubmission:
            if op == "fetch" and view.overlapping_rows() is not None:
                self.__dict__["stray"].append(wake)
            raise


# -- peer mutants (reference peer) -------------------------------------------------------------

class _PeerTracking(PeerMutant):
    def incoming(self) -> tuple[PullRequest, ...]:
        got = self.serving.incoming()
        reqs = self.__dict__.setdefault("requests", {})
        for request in got:
            reqs[request.ticket.to_bytes()] = request
        return got

    def request_of(self, hint: Hint) -> PullRequest | None:
        requests: dict[bytes, PullRequest] = self.__dict__.get("requests", {})
        return requests.get(hint.to_bytes()) if isinstance(hint, Hint) else None


class ForeignTicketInvalid(_PeerTracking):
    """H1.13: a ticket of another instance is refused with InvalidSubmission (as if unknown),
    not SubmissionRejected."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        try:
            return super().make(op, view, hint, wake)
        except SubmissionRejected as exc:
            if op == "publish" and "another peer" in str(exc):
                raise InvalidSubmission(f"unknown ticket {hint!r}") from None
            raise


class _Done(Attempt):
    """Concluded delivered at once: every row held (``held``), or none; woken from a timer thread."""

    def __init__(self, view: View, wake: WakeFn, held: bool = True) -> None:
        self.outcome = Outcome.delivered([np.full(g.rows, held, dtype=bool) for g in view.groups])
        threading.Timer(0.01, wake).start()

    def poll(self) -> Outcome | None:
        return self.outcome

    def quiesced(self) -> bool:
        return True

    def cancel(self) -> None:
        pass


class AnswersATicketTwice(_PeerTracking):
    """H1.13: a publish with a ticket that was already answered is taken again (idempotent
    answers): it concludes delivered at once, touching nothing."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        answered = self.__dict__.setdefault("answered", set())
        key = hint.to_bytes() if isinstance(hint, Hint) else b""
        if op == "publish" and key in answered:
            return _Done(view, wake)
        attempt = super().submit(op, view, hint, wake)
        if op == "publish":
            answered.add(key)
        return attempt


class TrimsOversizedAnswer(_PeerTracking):
    """N2.12: an answer with more rows than its pull asked for is cut to the pull's blocks and
    sent, instead of failing."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        request = self.request_of(hint) if op == "publish" else None
        if request is not None and any(g.rows > request.blocks for g in view.groups):
            n = request.blocks
            view = View(tuple(LayerGroupRows(g.group_id, g.kind, g.region, g.slots[:n], g.tokens,
                                             None if g.names is None else g.names[:n]) for g in view.groups))
        return super().make(op, view, hint, wake)


class AnswerNamesUnchecked(_PeerTracking):
    """N2.12: an answer whose rows are named other than the pull's prefix is sent as the prefix
    (the names of the answer are never compared with the request's)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        request = self.request_of(hint) if op == "publish" else None
        if request is not None and all(g.rows <= request.blocks for g in view.groups):
            view = View(tuple(LayerGroupRows(g.group_id, g.kind, g.region, g.slots, g.tokens,
                                             request.names[: g.rows] if g.rows else g.names) for g in view.groups))
        return super().make(op, view, hint, wake)


class PullNamesFromFirstGroup(PeerMutant):
    """N2.3: a pull whose groups name different blocks is taken, every group named as the first
    one is (the other groups' names are never compared)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op == "fetch" and view.groups and all(g.names is not None for g in view.groups):
            first = view.groups[0]
            if all(g.rows == first.rows for g in view.groups):
                view = View(tuple(LayerGroupRows(g.group_id, g.kind, g.region, g.slots, g.tokens, first.names)
                                  for g in view.groups))
        return super().make(op, view, hint, wake)


class CoercesStrAddress(PeerMutant):
    """H1.11 / H1.5: a peer hint whose address is a str (not bytes) is encoded and used."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op == "fetch" and isinstance(hint, Hint) and isinstance(hint.get("address"), str):
            fields = dict(hint.fields)
            fields["address"] = fields["address"].encode()
            hint = Hint.of(hint.kind, timeout_s=hint.timeout_s, **fields)
        return super().make(op, view, hint, wake)


# -- the harnesses the suite is pointed at --------------------------------------------------------

mutates_an_earlier_view = MutantHarness("mutates-an-earlier-view", MutatesAnEarlierView)
rejected_fetch_clears_rows = MutantHarness("rejected-fetch-clears-rows", RejectedFetchClearsRows)
overlap_refusal_wakes_later = MutantHarness("overlap-refusal-wakes-later", OverlapRefusalWakesLater)
failed_masks_cleared_later = MutantHarness("failed-masks-cleared-later", FailedMasksClearedLater)
dedupes_names_in_flight = MutantHarness("dedupes-names-in-flight", DedupesNamesInFlight)
foreign_ticket_invalid = MutantHarness("foreign-ticket-invalid", ForeignTicketInvalid, inner=LoopbackHarness())
answers_a_ticket_twice = MutantHarness("answers-a-ticket-twice", AnswersATicketTwice, inner=LoopbackHarness())
coerces_str_address = MutantHarness("coerces-str-address", CoercesStrAddress, inner=LoopbackHarness())
pull_names_from_first_group = MutantHarness("pull-names-from-first-group", PullNamesFromFirstGroup,
                                            inner=LoopbackHarness())
trims_oversized_answer = MutantHarness("trims-oversized-answer", TrimsOversizedAnswer, inner=LoopbackHarness())
answer_names_unchecked = MutantHarness("answer-names-unchecked", AnswerNamesUnchecked, inner=LoopbackHarness())
