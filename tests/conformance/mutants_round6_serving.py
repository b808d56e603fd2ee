"""Deliberately broken backends of the sixth probing round, on the serving and naming clauses:
each wraps the reference peer (``loopback_peer.py``) for the serving protocol, or the memory
backend for ``lookup``, as ``mutants.py`` does, and breaks one clause the earlier rounds touched
least: pulls before ``serve()`` (N2.7), tickets that were declined, used up by a misfit answer or
decoded from bytes (H1.13, N2.12, H1.3), answers with the pull's groups missing or reordered
(N2.12), serve wakes from inside the holder's calls (W1.6), credentials (H1.12), names at the
widths the contract allows (N1.3), the cause of a pull from a peer that is gone (A10.11), and
lookups over several groups, with two deadlines, of names that are not contiguous or repeat
(L1.3, L1.7). ``test_mutants.py`` reads its entries in ``mutant_table.py`` and checks that the suite fails each one on a
test named after the rule it breaks.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants_round6_serving.py:NAME``."""

from __future__ import annotations

import logging

import numpy as np
from lookup_mutants import LookupMutant
from loopback_peer import LoopbackHarness  # beside this file; on sys.path when loaded as a harness
from mutants import MutantHarness, PeerMutant, Wrapped, _outcome_like
from mutants_round4 import _Done, _PeerTracking

from kvwire.contract import (
    Attempt,
    Cause,
    Hint,
    InvalidSubmission,
    LayerGroupRows,
    Outcome,
    SlotRegion,
    View,
    WakeFn,
)
from kvwire.contract.serving import PullRequest

log = logging.getLogger(__name__)


# -- N2.7 / A10.10: a pull before serve() fails, but not as declined ----------------------------

class _Recaused(Wrapped):
    """A failed fetch whose cause was ``old`` is handed over with cause ``new`` (the same
    outcome on every poll)."""

    old: Cause = Cause.DECLINED
    new: Cause = Cause.PEER_GONE

    def poll(self) -> Outcome | None:
        kept = self.__dict__.get("kept")
        if kept is not None:
            return kept
        out = self.inner.poll()
        if out is not None and out.is_failed and out.cause is self.old and self.matches(out):
            out = Outcome(out.status, out.masks, out.reason, out.by_peer, self.new)
        if out is not None:
            self.__dict__["kept"] = out
        return out

    def matches(self, out: Outcome) -> bool:
        return True


class _UnservedAsGone(_Recaused):
    def matches(self, out: Outcome) -> bool:
        return "not serving" in (out.reason or "")


class UnservedPullFailsAsGone(PeerMutant):
    """N2.7 / A10.10: a pull made before the serving end called ``serve()`` fails at once, but
    with cause ``PEER_GONE`` instead of ``DECLINED``."""

    attempt_type = _UnservedAsGone


# -- H1.13 / N2.11: a declined ticket can still be answered -------------------------------------

class DeclinedTicketStillAnswerable(_PeerTracking):
    """H1.13: a publish with the ticket of a request the holder declined is taken, and concludes
    delivered at once (touching nothing), instead of raising ``InvalidSubmission``."""

    def decline(self, request: PullRequest, reason: str) -> None:
        self.__dict__.setdefault("declined", set()).add(request.ticket.to_bytes())
        super().decline(request, reason)

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if op == "publish" and isinstance(hint, Hint) and hint.to_bytes() in self.__dict__.get("declined", set()):
            return _Done(view, wake)
        return super().submit(op, view, hint, wake)


# -- N2.12: answers with the pull's groups missing or in another order --------------------------

class _NothingSent(Wrapped):
    """The outcome of the answer actually sent, with one all-false mask per group of the view
    the holder gave (nothing of it was sent)."""

    def poll(self) -> Outcome | None:
        out = self.inner.poll()
        if out is None:
            return None
        return _outcome_like(out, [np.zeros(g.rows, dtype=bool) for g in self.view.groups])


class AnswerMissingGroupsAsEmpty(_PeerTracking):
    """N2.12: an answer naming only some of the pull's groups (in order) is sent as an empty
    answer of all of them (the missing groups hold nothing, so the prefix is empty), and
    delivers nothing, instead of failing."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        request = self.request_of(hint) if op == "publish" else None
        given = tuple(g.group_id for g in view.groups)
        if request is not None and view.groups and len(given) < len(request.groups) \
                and request.groups[: len(given)] == given:
            g0, r = view.groups[0], view.groups[0].region
            span = r.slot_bytes * r.slot_count
            empty = View(tuple(LayerGroupRows(gid, g0.kind, SlotRegion(r.region_id + 70_000 + i, r.base, size,
                                                                      span // size, r.memory_kind, r.device),
                                             np.zeros(0, np.int64), g0.tokens,
                                             np.zeros((0, request.names.shape[1]), np.uint8))
                              for i, (gid, size) in enumerate(zip(request.groups, request.slot_bytes, strict=True))))
            return _NothingSent(self.inner.publish(empty, hint, wake), view, op, self)
        return super().make(op, view, hint, wake)


class AnswerGroupsInAnyOrder(_PeerTracking):
    """N2.12: an answer holding the pull's groups in another order is put back in the pull's
    order and delivers, instead of failing."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        request = self.request_of(hint) if op == "publish" else None
        given = [g.group_id for g in view.groups]
        if request is not None and sorted(given) == sorted(request.groups) and tuple(given) != request.groups:
            by_id = {g.group_id: g for g in view.groups}
            view = View(tuple(by_id[gid] for gid in request.groups))
        return super().make(op, view, hint, wake)


class MisfitKeepsTheTicket(_PeerTracking):
    """N2.12: after an answer that did not fit its pull failed, the ticket is still taken: a
    second answer with it concludes delivered at once (touching nothing), instead of raising
    ``InvalidSubmission`` (the request is used up)."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        key = hint.to_bytes() if isinstance(hint, Hint) else b""
        if op == "publish" and key in self.__dict__.get("misfits", set()):
            return _Done(view, wake)
        attempt = super().submit(op, view, hint, wake)
        # The reference peer fails a misfit answer inside publish(): concluded before it returns.
        concluded = attempt.inner.poll() if op == "publish" and isinstance(attempt, Wrapped) else None
        if concluded is not None and concluded.is_failed:
            self.__dict__.setdefault("misfits", set()).add(key)
        return attempt


# -- W1.6: the serve wake from inside the holder's calls ---------------------------------------

def _guarded(wake: WakeFn) -> None:
    """Call ``wake`` as a backend keeping W1.7 does: an exception is logged and dropped."""
    try:
        wake()
    except Exception:
        log.debug("the serve wake raised", exc_info=True)


class ServeWakeInsideServe(PeerMutant):
    """W1.6: ``serve(wake)`` calls ``wake`` once from inside the call ("look now, in case")."""

    def serve(self, wake: WakeFn) -> None:
        self.serving.serve(wake)
        _guarded(wake)


class ServeWakeInsideIncoming(PeerMutant):
    """W1.6: ``incoming()`` calls the serve wake from inside the call whenever it hands a
    request over ("more may be waiting")."""

    def serve(self, wake: WakeFn) -> None:
        self.__dict__["wake"] = wake
        self.serving.serve(wake)

    def incoming(self) -> tuple[PullRequest, ...]:
        got = self.serving.incoming()
        if got:
            _guarded(self.__dict__["wake"])
        return got


# -- H1.12: credentials of a requester's first pull ---------------------------------------------

class CredentialsOfFirstPull(PeerMutant):
    """H1.12: the serving end remembers the credentials of each requester's first pull and
    reports them for every later pull of that requester (credentials checked once per
    connection), instead of each pull's own."""

    def incoming(self) -> tuple[PullRequest, ...]:
        first: dict[str, bytes] = self.__dict__.setdefault("first", {})
        out = []
        for r in self.serving.incoming():
            creds = first.setdefault(r.peer, r.credentials)
            out.append(PullRequest(r.ticket, r.groups, r.slot_bytes, r.names, r.peer, creds))
        return tuple(out)


# -- N1.3: pull names cut to 32 bytes ----------------------------------------------------------

class PullNamesCutTo32Bytes(PeerMutant):
    """N1.3 / N2.6: a pull request carries only the first 32 bytes of names wider than that (a
    wire format sized for the common widths), so blocks named by 64 bytes are never found."""

    def incoming(self) -> tuple[PullRequest, ...]:
        return tuple(PullRequest(r.ticket, r.groups, r.slot_bytes, r.names[:, :32], r.peer, r.credentials)
                     for r in self.serving.incoming())


# -- H1.3 / H1.13: a ticket decoded from bytes is unknown ---------------------------------------

class TicketKnownByIdentity(_PeerTracking):
    """H1.3 / H1.13: the serving end knows a ticket only as the very object it handed out; an
    equal ticket decoded from its bytes is refused as unknown (``InvalidSubmission``)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        request = self.request_of(hint) if op == "publish" else None
        if request is not None and request.ticket is not hint:
            raise InvalidSubmission(f"unknown ticket {hint!r}: this peer handed out no such ticket")
        return super().make(op, view, hint, wake)


# -- A10.11: a pull from a peer that is gone fails as a fault -----------------------------------

class _GoneAsFault(_Recaused):
    old = Cause.PEER_GONE
    new = Cause.FAULT


class GonePeerAsFault(PeerMutant):
    """A10.11: a pull from a serving end that is gone (nobody answers at its address) fails at
    once with cause ``FAULT`` instead of ``PEER_GONE``."""

    attempt_type = _GoneAsFault


# -- L1.3 / L1.7: lookups ------------------------------------------------------------------------

class LookupFirstAndLastGroup(LookupMutant):
    """L1.3: a lookup over three or more groups asks only about the first and the last listed
    group (a shortcut for layer groups that are stored together)."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        listed = list(groups) if isinstance(groups, (list, tuple)) else groups
        if isinstance(listed, list) and len(listed) > 2 and all(isinstance(g, int) for g in listed):
            listed = [listed[0], listed[-1]]
        return super().lookup(listed, names, hint, timeout_s)


class LookupHintDeadlineFirst(LookupMutant):
    """L1.7: a lookup's deadline is the hint's ``timeout_s`` when it has one, even when the call
    gives its own ``timeout_s``."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        if isinstance(hint, Hint) and hint.timeout_s is not None:
            timeout_s = hint.timeout_s
        return super().lookup(groups, names, hint, timeout_s)


class LookupReadsNamesContiguously(LookupMutant):
    """L1.3: names that are not one C-contiguous block (a slice of every other row, a column
    slice) are read from their first byte as if they were, so the wrong names are asked about."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        if isinstance(names, np.ndarray) and names.ndim == 2 and names.dtype == np.uint8 \
                and not names.flags.c_contiguous and names.size and min(names.strides) > 0:
            names = np.lib.stride_tricks.as_strided(names, strides=(names.shape[1], 1)).copy()
        return super().lookup(groups, names, hint, timeout_s)


class LookupRepeatedNameOnce(LookupMutant):
    """L1.3: a name asked several times in one lookup answers only at its first place; its
    repeats answer false (the keys asked are deduplicated, and the answer spread back wrongly)."""

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        answer = super().lookup(groups, names, hint, timeout_s)
        seen: set[bytes] = set()
        out = np.array(answer, dtype=bool)
        for i, row in enumerate(np.asarray(names)):
            key = row.tobytes()
            out[i] &= key not in seen
            seen.add(key)
        out.setflags(write=False)
        return out


# -- the harnesses the suite is pointed at --------------------------------------------------------

unserved_pull_fails_as_gone = MutantHarness("unserved-pull-fails-as-gone", UnservedPullFailsAsGone,
                                            inner=LoopbackHarness())
declined_ticket_still_answerable = MutantHarness("declined-ticket-still-answerable", DeclinedTicketStillAnswerable,
                                                 inner=LoopbackHarness())
answer_missing_groups_as_empty = MutantHarness("answer-missing-groups-as-empty", AnswerMissingGroupsAsEmpty,
                                               inner=LoopbackHarness())
answer_groups_in_any_order = MutantHarness("answer-groups-in-any-order", AnswerGroupsInAnyOrder,
                                           inner=LoopbackHarness())
misfit_keeps_the_ticket = MutantHarness("misfit-keeps-the-ticket", MisfitKeepsTheTicket, inner=LoopbackHarness())
serve_wake_inside_serve = MutantHarness("serve-wake-inside-serve", ServeWakeInsideServe, inner=LoopbackHarness())
serve_wake_inside_incoming = MutantHarness("serve-wake-inside-incoming", ServeWakeInsideIncoming,
                                           inner=LoopbackHarness())
credentials_of_first_pull = MutantHarness("credentials-of-first-pull", CredentialsOfFirstPull,
                                          inner=LoopbackHarness())
pull_names_cut_to_32_bytes = MutantHarness("pull-names-cut-to-32-bytes", PullNamesCutTo32Bytes,
                                           inner=LoopbackHarness())
ticket_known_by_identity = MutantHarness("ticket-known-by-identity", TicketKnownByIdentity, inner=LoopbackHarness())
gone_peer_as_fault = MutantHarness("gone-peer-as-fault", GonePeerAsFault, inner=LoopbackHarness())
lookup_first_and_last_group = MutantHarness("lookup-first-and-last-group", LookupFirstAndLastGroup)
lookup_hint_deadline_first = MutantHarness("lookup-hint-deadline-first", LookupHintDeadlineFirst)
lookup_reads_names_contiguously = MutantHarness("lookup-reads-names-contiguously", LookupReadsNamesContiguously)
lookup_repeated_name_once = MutantHarness("lookup-repeated-name-once", LookupRepeatedNameOnce)
