"""What the benches share: every attempt a bench makes goes through the runtime's holder loop
(``kvwire.holding``), as an engine's would; this adds only the benches' one check, that
every row of the attempt was delivered."""

from __future__ import annotations

from kvwire.contract import Backend, Hint, Outcome, View
from kvwire.holding import AtDeadline, Direction, Wakes, submit, wait

__all__ = ["Mover", "Direction"]


class Mover:
    """Submits one view at a time and waits, woken by the backend, until the attempt concluded
    and quiesced; raises if it did not in ``timeout_s`` or if any row was not delivered."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.wakes = Wakes()  # one condition for every attempt of this mover
        self.timeout_s = timeout_s

    def move(self, backend: Backend, op: Direction, view: View, hint: Hint) -> Outcome:
        sub = submit(backend, op, view, hint, wakes=self.wakes)
        outcome = wait(sub, self.timeout_s, at_deadline=AtDeadline.RETURN).result()
        assert outcome.is_delivered and all(m.all() for m in outcome.masks), outcome
        return outcome
