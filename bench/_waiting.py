"""What the benches share: a wake function to block on until an attempt has settled."""

from __future__ import annotations

import threading

from kvwire.contract import Attempt


class Waiter:
    """A wake function the bench can block on; ``settle`` waits until the attempt concluded and
    quiesced and checks every row was delivered."""

    def __init__(self, timeout_s: float = 60.0) -> None:
        self.event = threading.Event()
        self.timeout_s = timeout_s

    def __call__(self) -> None:
        self.event.set()

    def settle(self, attempt: Attempt) -> None:
        while not (attempt.poll() is not None and attempt.quiesced()):
            if not self.event.wait(self.timeout_s):
                raise TimeoutError(f"{attempt!r} did not settle in {self.timeout_s:g} s")
            self.event.clear()
        outcome = attempt.poll()
        assert outcome is not None and outcome.is_delivered and all(m.all() for m in outcome.masks), outcome
