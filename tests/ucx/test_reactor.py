"""The progress thread's reactor orders what it finds by time: a timer that came due before the
thread woke fires before the messages the fds brought. On a busy machine the thread may wake past
a pull's deadline with the serving end's expiry decline in hand; the deadline came first, so the
pull must fail for its deadline (A10.7), not as declined. And a holder's command runs on its own
thread only while the loop sleeps, in order with the commands queued before it."""

from __future__ import annotations

import selectors
import socket
import threading
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


class Sleeper:
    """A driver whose loop sleeps on the fds until told to stop (``cap`` at a time);
    ``iterated`` is set once the loop has gone round (it then goes to sleep)."""

    def __init__(self, cap: float = 0.5) -> None:
        self.cap = cap
        self.stop = False
        self.iterated = threading.Event()

    def progress(self) -> None:
        self.iterated.set()
    def reap(self) -> None: ...
    def spinning(self) -> bool: return False
    def arm(self) -> bool: return True
    def sleep_cap(self) -> float: return self.cap
    def on_ready(self, data: Any, events: int) -> None: ...
    def can_exit(self) -> bool: return self.stop


def running(reactor: Reactor, driver: Sleeper) -> threading.Thread:
    thread = threading.Thread(target=reactor.run, args=(driver, 0), daemon=True)
    thread.start()
    assert driver.iterated.wait(5), "the loop never started"
    return thread


def stopped(reactor: Reactor, driver: Sleeper, thread: threading.Thread) -> None:
    driver.stop = True
    reactor.stopping = True
    reactor.submit(lambda: None)
    thread.join(5)
    assert not thread.is_alive()
    reactor.close()


def test_run_here_runs_on_the_callers_thread_while_the_loop_sleeps_and_keeps_order_otherwise() -> None:
    """The one-sided fetch's Pull goes out inside fetch() when the progress thread sleeps; a
    command queued before it runs first (a fault hold taken before a fetch catches its frames)."""
    reactor, driver = Reactor(), Sleeper()
    thread = running(reactor, driver)
    try:
        ran_on: list[str] = []
        for _ in range(5000):  # once the loop sleeps, the caller runs it (before: the loop does)
            done = threading.Event()
            reactor.run_here(lambda d=done: (ran_on.append("loop" if threading.current_thread() is thread
                                                          else "caller"), d.set()))
            assert done.wait(5), "a command given to run_here never ran"
            if ran_on[-1] == "caller":
                break
        assert ran_on[-1] == "caller", f"run_here never ran on the caller's thread while the loop slept: {ran_on[-5:]}"
        order: list[str] = []
        # A command queued whose ring the sleeping loop has not seen yet (a holder's other
        # thread between its append and its ring): run_here must not overtake it.
        reactor._commands.append((order.append, ("first",)))
        reactor.run_here(order.append, "second")
        done = threading.Event()
        reactor.submit(done.set)  # runs after both
        assert done.wait(5), f"the commands never ran: {order}"
        assert order == ["first", "second"], "run_here ran ahead of a command queued before it"
    finally:
        stopped(reactor, driver, thread)


def test_run_here_wakes_the_sleeping_loop_only_for_something_due_before_it_wakes_on_its_own() -> None:
    """What run_here left (a wake owed, a timer sooner than the sleep, a shorter sleep cap)
    rings the doorbell; a later timer does not (the caller keeps its thread's time)."""
    reactor, driver = Reactor(), Sleeper(cap=5.0)
    reactor._driver = driver
    reactor._sleep_until = time.monotonic() + 5.0
    assert not reactor._wakes_sooner()
    reactor.call_later(60.0, lambda: None)  # a pull's deadline, after the sleep
    assert not reactor._wakes_sooner()
    reactor.call_later(0.0, lambda: None)  # due now
    assert reactor._wakes_sooner()
    reactor._timers.clear()
    reactor.wake_later(lambda: None)
    assert reactor._wakes_sooner()
    reactor._wakes.take()
    driver.cap = 0.001  # a one-sided answer out: NIXL needs progress soon
    assert reactor._wakes_sooner()
    reactor.close()


def test_work_after_the_wakes_runs_after_them_and_what_it_owes_is_woken_in_the_same_pass() -> None:
    """after_wakes: the iteration's wakes first, then the work (a peer's last word), and a wake
    that work owes (a connection it found gone concluded another attempt) before the thread
    could go to sleep; a failing piece of work stops neither the others nor the loop."""
    reactor = Reactor()
    try:
        order: list[str] = []

        def last_word() -> None:
            order.append("last word")
            reactor.wake_later(lambda: order.append("other woken"))

        def broken() -> None:
            raise RuntimeError("socket gone")

        reactor.wake_later(lambda: order.append("holder woken"))
        reactor.after_wakes(broken)
        reactor.after_wakes(last_word)
        reactor._flush_wakes()
        assert order == ["holder woken", "last word", "other woken"]
        assert not reactor._wakes and not reactor._after_wakes  # nothing left for after a sleep
    finally:
        reactor.close()


def test_work_after_the_wakes_runs_at_once_on_a_holders_thread() -> None:
    """Inside run_here the wakes are the progress thread's, later: the work is not held back
    behind them (nor left for a thread that may sleep on)."""
    reactor = Reactor()
    try:
        order: list[str] = []
        reactor.inline = True
        reactor.after_wakes(order.append, "now")
        reactor.inline = False
        assert order == ["now"] and not reactor._after_wakes
    finally:
        reactor.close()
