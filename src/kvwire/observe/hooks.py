"""The events a worker announces, as pluggy hook specifications (project name ``kvwire``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from kvwire.contract.outcome import Cause, OutcomeStatus
    from kvwire.holding import Direction

hookspec = pluggy.HookspecMarker("kvwire")
hookimpl = pluggy.HookimplMarker("kvwire")

__all__ = ["hookspec", "hookimpl", "ObserverSpec"]


class ObserverSpec:
    """What an observer may implement; each hook is optional and must not block."""

    @hookspec
    def kvwire_transfer(self, worker: str, backend: str, direction: Direction, rows: int, delivered: int,
                        nbytes: int, seconds: float, status: OutcomeStatus, reason: str | None,
                        cause: Cause | None, blocks: int, whole: int) -> None:
        """A fetch or publish attempt concluded and quiesced: ``rows`` submitted, ``delivered`` of
        them arrived (or are held by the store), ``nbytes`` moved; of the ``blocks`` it named,
        ``whole`` arrived (or are held) in every PAGED group; ``status`` and ``cause`` are the
        outcome's (``cause`` is ``None`` when delivered, or from a contract 1.0 backend).
        Branch on ``cause``, never on ``reason``'s text (A10)."""

    @hookspec
    def kvwire_refused(self, worker: str, backend: str, direction: Direction, reason: str) -> None:
        """A submission was refused (``SubmissionRejected`` or ``InvalidSubmission``)."""

    @hookspec
    def kvwire_pull_served(self, worker: str, backend: str, peer: str, requested: int, served: int) -> None:
        """This worker answered a pull: ``served`` of the ``requested`` blocks were held."""

    @hookspec
    def kvwire_pull_declined(self, worker: str, backend: str, peer: str, reason: str) -> None:
        """This worker refused a pull (authentication, allowlist, layout)."""

    @hookspec
    def kvwire_blocks(self, worker: str, stored: int, evicted: int, pinned: int) -> None:
        """The reuse tree changed: blocks newly stored, evicted since the last event, pinned now."""
