"""The progress thread's reactor orders what it finds by time: a timer that came due before the
thread woke fires before the messages the fds brought. On a busy machine the thread may wake past
a pull's deadline with the serving end's expiry decline in hand; the deadline came first, so the
pull must fail for its deadline (A10.7), not as declined."""

from __future__ import annotations

import selectors
import socket
import time
from typing import Any

from kvwire_ucx.reactor import Reactor


class Recorder:
    """A driver that only records which fd became readable."""

    def __init__(self, seen: list[str]) -> None:
        self.seen = seen

    def progress(self) -> None: ...
    def reap(self) -> None: ...
    def spinning(self) -> bool: return False
    def arm(self) -> bool: return True
    def sleep_cap(self) -> float: return 0.0
    def can_exit(self) -> bool: return True

    def on_ready(self, data: Any, events: int) -> None:
        data.recv(16)
        self.seen.append("message")


def test_a_timer_due_before_the_wake_fires_before_the_message_it_woke_with() -> None:
    reactor = Reactor()
    ours, theirs = socket.socketpair()
    try:
        seen: list[str] = []
        ours.setblocking(False)
        reactor.register(ours, selectors.EVENT_READ, ours)
        reactor.call_later(0.0, lambda: seen.append("deadline"))
        time.sleep(0.01)  # the scenario: the thread wakes late, past the timer
        theirs.send(b"decline")
        reactor._wait(Recorder(seen), 1.0)
        assert seen == ["deadline", "message"]
    finally:
        reactor.close()
        ours.close()
        theirs.close()
