"""The boundary itself: :class:`Backend`, its :class:`Attempt`, and :data:`WakeFn`."""

from __future__ import annotations

import abc
from collections.abc import Callable, Sequence

from kvwire.contract.capabilities import Capabilities
from kvwire.contract.hint import Hint
from kvwire.contract.memory import SlotRegion
from kvwire.contract.outcome import Outcome
from kvwire.contract.view import View

__all__ = ["Attempt", "Backend", "Registration", "WakeFn"]

#: Called by a backend, from any thread, after a change it reports is visible (W1). Cheap and
#: non-blocking; the holder never calls into the backend from inside it.
WakeFn = Callable[[], None]


class Attempt(abc.ABC):
    """One submission in flight. Its methods never block, and its conclusion and quiescence do
    not depend on them being called (A3)."""

    @abc.abstractmethod
    def poll(self) -> Outcome | None:
        """``None`` until the attempt concludes, then the same outcome on every call (A1)."""

    @abc.abstractmethod
    def quiesced(self) -> bool:
        """True, and true from then on, once the backend will never touch the view's memory
        again (A2)."""

    @abc.abstractmethod
    def cancel(self) -> None:
        """Ask the attempt to stop. Idempotent; yields a cancelled outcome unless the attempt had
        already concluded; a cancelled attempt still quiesces (A4)."""


class Registration(abc.ABC):
    """What :meth:`Backend.register_regions` returns: the regions registered in one batch."""

    @property
    @abc.abstractmethod
    def regions(self) -> tuple[SlotRegion, ...]:
        """The regions this registration covers."""

    @abc.abstractmethod
    def close(self) -> None:
        """Unregister. Idempotent; never revokes a later registration of the same span (M3)."""

    def __enter__(self) -> Registration:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Backend(abc.ABC):
    """Moves the bytes of lent rows to or from the other end: a peer or a store.

    It runs its own progress on its own threads and never calls the lender or a lease. One
    instance serves one lender's domain (B1); its methods and its attempts' methods are called
    from one call sequence, never concurrently (B2)."""

    @abc.abstractmethod
    def capabilities(self) -> Capabilities:
        """Frozen data: what this backend does (B4)."""

    @abc.abstractmethod
    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        """Register a batch of regions (M3). A region whose memory kind the capabilities do not
        list, or that overlaps a registered region or another in the batch, refuses the whole
        batch with ``InvalidSubmission`` and leaves nothing registered."""

    @abc.abstractmethod
    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        """Fill the view's rows from the other end (S1). Until the attempt quiesces, the holder
        keeps that memory allocated and untouched by anyone else (S2)."""

    @abc.abstractmethod
    def publish(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        """Offer the view's rows to the other end (S1). Until the attempt quiesces, the holder
        keeps that memory allocated and unwritten by anyone else (S2)."""

    @abc.abstractmethod
    def shutdown(self) -> frozenset[Attempt]:
        """Stop taking submissions, end or cancel work in flight, and return the attempts whose
        memory access is not yet proven ended (B3). Idempotent; call until it returns empty."""

    def close(self) -> None:
        """Release what the backend holds (connections, threads, an owned store client) once
        ``shutdown()`` has returned an empty set and the holder closed its registrations. The
        default does nothing; idempotent."""
