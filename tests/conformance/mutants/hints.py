"""Mutants that each break one hint clause (H1: hints, namespaces, peer addresses and tickets). Every
harness below is registered once, in ``tests/conformance/mutant_table.py``, with the clause it
breaks and the ``-k`` selection of the suite's tests that must catch it. A mutant either wraps a
correct backend through :mod:`kit` (the memory backend, or the reference peer for the serving
protocol) and breaks the clause from outside, or subclasses a reference backend
(:mod:`kvwire.testing.reference`) and overrides the one method where the bug lives.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants/hints.py:NAME``."""

from __future__ import annotations

import re
from typing import Any

import numpy as np
from kit import (  # beside this file; on sys.path when loaded as a harness
    HoleHarness,
    Mutant,
    MutantHarness,
    PeerMutant,
    PeerMutantHarness,
    StoreMutantHarness,
    Wrapped,
    _Done,
    _PeerTracking,
)

from kvwire.contract import Attempt, Hint, InvalidSubmission, SubmissionRejected, View, WakeFn
from kvwire.contract.serving import PullRequest
from kvwire.testing.reference.harness import ReferencePeerHarness as LoopbackHarness
from kvwire.testing.reference.peer import PullMessage, ReferencePeer
from kvwire.testing.reference.store import ReferenceStoreBackend, RowStatus, StoreReply


class AcceptsAnyHint(Mutant):
    """H1: takes a hint of any kind as if it were its own."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if hint.kind != "store":
            hint = Hint.of("store", namespace="conformance")
        return super().make(op, view, hint, wake)


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


class CoercesStrAddress(PeerMutant):
    """H1.11 / H1.5: a peer hint whose address is a str (not bytes) is encoded and used."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if op == "fetch" and isinstance(hint, Hint) and isinstance(hint.get("address"), str):
            fields = dict(hint.fields)
            fields["address"] = fields["address"].encode()
            hint = Hint.of(hint.kind, timeout_s=hint.timeout_s, **fields)
        return super().make(op, view, hint, wake)


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


# -- H1.3 / H1.13: a ticket decoded from bytes is unknown ---------------------------------------

class TicketKnownByIdentity(_PeerTracking):
    """H1.3 / H1.13: the serving end knows a ticket only as the very object it handed out; an
    equal ticket decoded from its bytes is refused as unknown (``InvalidSubmission``)."""

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        request = self.request_of(hint) if op == "publish" else None
        if request is not None and request.ticket is not hint:
            raise InvalidSubmission(f"unknown ticket {hint!r}: this peer handed out no such ticket")
        return super().make(op, view, hint, wake)


# -- H1.5 / H1.11: a peer hint without an address goes to the last peer -----------------------------

class MissingAddressMeansLastPeer(PeerMutant):
    """H1.5 / H1.11: a peer hint without an ``address`` pulls from the peer this instance pulled
    from last (a cached connection), instead of being refused."""

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if isinstance(hint, Hint) and hint.kind == "peer":
            fields = dict(hint.fields)
            last = self.__dict__.get("last_address")
            if "address" not in fields and last is not None:
                fields["address"] = last
                hint = Hint.of("peer", timeout_s=hint.timeout_s, **fields)  # type: ignore[arg-type]
            attempt = super().fetch(view, hint, wake)
            self.__dict__["last_address"] = hint.get("address")
            return attempt
        return super().fetch(view, hint, wake)


# -- H1.5 / H1.12: credentials that are no bytes are encoded ------------------------------------------

class StrCredentialsEncoded(PeerMutant):
    """H1.5 / H1.12: a peer hint whose ``credentials`` are a ``str`` (or an int) is taken, the
    value sent as its UTF-8 (or decimal) bytes, instead of being refused."""

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if isinstance(hint, Hint) and hint.kind == "peer":
            credentials = hint.get("credentials")
            if credentials is not None and not isinstance(credentials, bytes):
                fields = dict(hint.fields)
                fields["credentials"] = str(credentials).encode()
                hint = Hint.of("peer", timeout_s=hint.timeout_s, **fields)  # type: ignore[arg-type]
        return super().fetch(view, hint, wake)


# -- H1.6: a hint's deadline kept only when the hint has fields ---------------------------------------------

class DeadlineNeedsOtherFields(Mutant):
    """H1.6: a hint's ``timeout_s`` is read only along with its fields ("an empty hint is no
    hint"): a store hint of only a deadline gets the options' deadline."""

    def submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if isinstance(hint, Hint) and not hint.fields and hint.timeout_s is not None:
            hint = Hint(hint.kind, (), None)
        return super().submit(op, view, hint, wake)


def _with_namespace(hint: Hint, namespace: object) -> Hint:
    fields = {**dict(hint.fields), "namespace": namespace}
    return Hint(hint.kind, tuple(sorted(fields.items())), hint.timeout_s)  # type: ignore[arg-type]


class _HintMutant(Mutant):
    """Changes each store hint (of a submission and of a lookup) with :meth:`rewrite`."""

    def rewrite(self, hint: Hint) -> Hint:
        return hint

    def make(self, op: str, view: View, hint: Hint, wake: WakeFn) -> Wrapped:
        if isinstance(hint, Hint) and hint.kind == "store":
            hint = self.rewrite(hint)
        return super().make(op, view, hint, wake)

    def lookup(self, groups, names, hint, timeout_s=None):  # type: ignore[no-untyped-def]
        if isinstance(hint, Hint) and hint.kind == "store":
            hint = self.rewrite(hint)
        return super().lookup(groups, names, hint, timeout_s)


class MissingNamespaceToDefault(_HintMutant):
    """H1.7: a store hint without a namespace goes to "default", not to the namespace the
    backend was configured with."""

    def rewrite(self, hint: Hint) -> Hint:
        return _with_namespace(hint, "default") if hint.get("namespace") is None else hint


_NOT_ALLOWED = re.compile(r"[^A-Za-z0-9._:@+=\-/]")


class AcceptsBadNamespace(_HintMutant):
    """H1.8: a namespace outside the allowed form (a leading '/', a space, non-ASCII, too long,
    empty) is sanitized and used instead of refused."""

    def rewrite(self, hint: Hint) -> Hint:
        namespace = hint.get("namespace")
        if isinstance(namespace, str):
            fixed = _NOT_ALLOWED.sub("_", namespace).lstrip("/")[:128] or "default"
            if fixed != namespace:
                return _with_namespace(hint, fixed)
        return hint


class CoercesNamespaceType(_HintMutant):
    """H1.5: a namespace that is no str (an int, bytes, a float) is converted with str() or
    decode() instead of refused as an ill-typed field."""

    def rewrite(self, hint: Hint) -> Hint:
        namespace = hint.get("namespace")
        if namespace is not None and not isinstance(namespace, str):
            text = namespace.decode("ascii", "replace") if isinstance(namespace, bytes) else str(namespace)
            return _with_namespace(hint, text)
        return hint


class _FallbackStore:
    def __init__(self, end: Any, own: str) -> None:
        self.end = end
        self.own = own

    def put(self, namespace: str, group_id: int, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        return self.end.put(namespace, group_id, names, rows)

    def get(self, namespace: str, group_id: int, names: np.ndarray, slot_bytes: int) -> StoreReply:
        reply = self.end.get(namespace, group_id, names, slot_bytes)
        missed = np.flatnonzero(reply.status == RowStatus.MISSING)
        if namespace == self.own or not missed.size:
            return reply
        again = self.end.get(self.own, group_id, names[missed], slot_bytes)
        status, data = reply.status.copy(), reply.data.copy() if reply.data is not None else None
        status[missed] = again.status
        assert data is not None and again.data is not None
        data[missed] = again.data
        return StoreReply(status, data, reply.reason or again.reason)


class FetchFallsBackToOwnNamespace(ReferenceStoreBackend):
    """H1/A7: a fetch that misses in the hint's namespace tries the backend's own default
    namespace too, and marks what it finds there."""

    def __init__(self, store: Any, **options: Any) -> None:
        super().__init__(store, **options)
        self._store = _FallbackStore(store, self._namespace)


class IgnoresHintNamespace(ReferenceStoreBackend):
    """H1: the hint's namespace is ignored; every row goes to the backend's own namespace."""

    def _namespace_of(self, hint: Hint) -> str:
        super()._namespace_of(hint)
        return self._namespace


class AcceptsUnknownHintFields(ReferenceStoreBackend):
    """H1: a store hint's fields other than ``namespace`` are silently ignored."""

    def _namespace_of(self, hint: Hint) -> str:
        if not isinstance(hint, Hint) or hint.kind != "store":
            raise InvalidSubmission(f"this store takes a hint of kind 'store', got {hint!r}")
        namespace = hint.get("namespace")
        return namespace if isinstance(namespace, str) else self._namespace


class DropsCredentials(ReferencePeer):
    """H1: a peer hint's ``credentials`` are checked but not passed on: the serving end's
    PullRequest carries none (H1.12)."""

    def _send(self, to: bytes, message: Any) -> bool:
        if isinstance(message, PullMessage) and message.credentials:
            message = PullMessage(message.ticket, message.reply_to, message.groups, message.slot_bytes, message.names)
        return super()._send(to, message)


faithful = MutantHarness("hints-faithful", Mutant)
accepts_any_hint = MutantHarness("accepts-any-hint", AcceptsAnyHint)
missing_namespace_to_default = MutantHarness("missing-namespace-to-default", MissingNamespaceToDefault)
accepts_bad_namespace = MutantHarness("accepts-bad-namespace", AcceptsBadNamespace)
coerces_namespace_type = MutantHarness("coerces-namespace-type", CoercesNamespaceType)
deadline_needs_other_fields = HoleHarness("deadline-needs-other-fields", DeadlineNeedsOtherFields)
foreign_ticket_invalid = MutantHarness("foreign-ticket-invalid", ForeignTicketInvalid, inner=LoopbackHarness())
answers_a_ticket_twice = MutantHarness("answers-a-ticket-twice", AnswersATicketTwice, inner=LoopbackHarness())
coerces_str_address = MutantHarness("coerces-str-address", CoercesStrAddress, inner=LoopbackHarness())


declined_ticket_still_answerable = MutantHarness("declined-ticket-still-answerable", DeclinedTicketStillAnswerable,
                                                 inner=LoopbackHarness())


credentials_of_first_pull = MutantHarness("credentials-of-first-pull", CredentialsOfFirstPull,
                                          inner=LoopbackHarness())
ticket_known_by_identity = MutantHarness("ticket-known-by-identity", TicketKnownByIdentity, inner=LoopbackHarness())


missing_address_means_last_peer = MutantHarness("missing-address-means-last-peer", MissingAddressMeansLastPeer,
                                                inner=LoopbackHarness())
str_credentials_encoded = MutantHarness("str-credentials-encoded", StrCredentialsEncoded, inner=LoopbackHarness())
fetch_falls_back_to_own_namespace = StoreMutantHarness("fetch-falls-back", FetchFallsBackToOwnNamespace)
ignores_hint_namespace = StoreMutantHarness("ignores-hint-namespace", IgnoresHintNamespace)
accepts_unknown_hint_fields = StoreMutantHarness("accepts-unknown-hint-fields", AcceptsUnknownHintFields)
drops_credentials = PeerMutantHarness("drops-credentials", DropsCredentials)


# -- H1.14 / H1.15 / H1.16 ----------------------------------------------------------------------------

class EmptyAddressFailsLater(ReferencePeer):
    """H1.14: a peer hint whose address is empty bytes is taken; the pull then finds no peer there
    and fails (``PEER_GONE``), where the contract refuses it when submitted."""

    def _peer_of(self, hint: Hint) -> tuple[bytes, bytes]:
        if isinstance(hint, Hint) and hint.kind == "peer" and hint.get("address") == b"":
            return b"", hint.get("credentials", b"")
        return super()._peer_of(hint)


class IntCredentialsAsDecimal(ReferencePeer):
    """H1.15: credentials given as an int are taken, sent as their decimal digits (a str is still
    refused)."""

    def _peer_of(self, hint: Hint) -> tuple[bytes, bytes]:
        credentials = hint.get("credentials") if isinstance(hint, Hint) else None
        if isinstance(credentials, int) and not isinstance(credentials, bool):
            fields = {k: v for k, v in hint.fields if k != "credentials"}
            address, _ = super()._peer_of(Hint.of("peer", timeout_s=hint.timeout_s, **fields))
            return address, str(credentials).encode()
        return super()._peer_of(hint)


class DeclinedTicketPublishedQuietly(PeerMutant):
    """H1.16: a publish with the ticket of a request the holder declined is not refused: it returns
    an attempt that concludes at once, moving nothing (the decline already answered the pull)."""

    def decline(self, request: PullRequest, reason: str) -> None:
        self.__dict__.setdefault("declined", set()).add(request.ticket.to_bytes())
        super().decline(request, reason)

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        if isinstance(hint, Hint) and hint.kind == "ticket" and hint.to_bytes() in self.__dict__.get("declined", ()):
            return _Done(view, wake, held=False)
        return super().publish(view, hint, wake)


empty_address_fails_later = PeerMutantHarness("empty-address-fails-later", EmptyAddressFailsLater)
int_credentials_as_decimal = PeerMutantHarness("int-credentials-as-decimal", IntCredentialsAsDecimal)
declined_ticket_published_quietly = MutantHarness("declined-ticket-published-quietly", DeclinedTicketPublishedQuietly,
                                                  inner=LoopbackHarness())
