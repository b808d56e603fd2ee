"""The one place a backend's concurrency lives: its progress thread's reactor.

Holder threads only :meth:`Reactor.submit` commands (and ring the doorbell); everything else runs
on the progress thread: the commands, timers, the wakes owed to holders, and the sleep in
``select`` on the registered fds (the UCX worker's epoll fd, the control sockets, the doorbell).
One exception saves a thread hop: :meth:`Reactor.run_here` runs a command on the holder's thread
when the progress thread sleeps with nothing queued. The progress thread holds the loop lock
except while it sleeps, so such a command runs as if it were the loop's next one.
What one loop iteration does besides is the :class:`Driver`'s: progress UCX, reap finished work,
say how long it may sleep. The protocol code and the holder never take a lock of this module."""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import selectors
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol

from kvwire.attempts import OwedWakes, call_wakes
from kvwire.contract.backend import WakeFn

__all__ = ["Reactor", "Driver"]

log = logging.getLogger(__name__)

#: Upper bound on one sleep, so a lost wake-up of the worker fd costs at most this much.
MAX_SLEEP_S = 0.5
#: While work is pending without an fd to wait on, the fds are looked at no more often than this.
SOCKET_POLL_S = 0.0002
_DOORBELL = object()


class Driver(Protocol):
    """What the reactor's loop asks of its owner each iteration."""

    def progress(self) -> None: ...
    def reap(self) -> None: ...
    def spinning(self) -> bool: ...          # work without an fd is in progress (keep going)
    def arm(self) -> bool: ...               # may the loop sleep on the fds now?
    def sleep_cap(self) -> float: ...
    def on_ready(self, data: Any, events: int) -> None: ...
    def can_exit(self) -> bool: ...


class Reactor:
    """Commands, timers, pending wakes and the fds of one progress thread."""

    def __init__(self, spin_s: float = 0.0) -> None:
        #: After a command or an fd event, how long the loop keeps looking (without sleeping)
        #: for the next: an answer that comes within it is taken up without a wake-up.
        self.spin_s = spin_s
        self._commands: collections.deque[tuple[Callable[..., None], tuple[Any, ...]]] = collections.deque()
        self._timers: list[tuple[float, int, Callable[[], None]]] = []
        self._timer_seq = itertools.count()
        self._wakes = OwedWakes()
        self._after_wakes: list[tuple[Callable[..., None], tuple[Any, ...]]] = []
        self._doorbell_r, self._doorbell_w = os.pipe()
        os.set_blocking(self._doorbell_r, False)
        os.set_blocking(self._doorbell_w, False)
        self._selector = selectors.DefaultSelector()
        self._selector.register(self._doorbell_r, selectors.EVENT_READ, _DOORBELL)
        self.stopping = False
        #: Held by the progress thread from its start to its end, except while it sleeps on the
        #: fds: whoever holds it may touch what the loop owns (see :meth:`run_here`).
        self._loop = threading.Lock()
        self._looping = False  # guarded by _loop
        self._driver: Driver | None = None
        self._asleep = False  # the progress thread is inside its blocking select (set under _loop)
        self._sleep_until = 0.0  # while it sleeps: when it wakes on its own
        #: A command runs on a holder's thread (run_here): what would call UCX is deferred to
        #: the progress thread (read under _loop).
        self.inline = False

    # ------------------------------------------------------------ any thread

    def submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on the progress thread soon."""
        self._commands.append((fn, args))
        self._ring()

    def run_here(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` now, on the calling thread, if the progress thread sleeps on the fds
        with no command queued before it (so the order of commands is kept); else
        :meth:`submit` it. A command run here that left the sleeping thread something to do
        sooner than it wakes on its own (a wake owed, an earlier timer, a shorter sleep cap)
        rings the doorbell; one that did not lets it sleep on, so the holder's thread keeps the
        GIL instead of handing it to a progress thread woken for nothing (a ring cost the
        caller 0.1-0.6 ms). ``fn`` must not call into UCX (the worker is the progress thread's):
        sockets, timers, wakes and NIXL (serialized by its own lock) are fine. An exception of
        ``fn`` is logged, as on the progress thread."""
        if self._loop.acquire(blocking=False):
            ring = False
            try:
                # Asleep, not merely without the lock: a thread that woke and waits for the lock
                # has fds and due timers to see first.
                ran = self._looping and self._asleep and not self.stopping and not self._commands
                if ran:
                    self.inline = True
                    try:
                        fn(*args)
                    except Exception:
                        log.exception("kvwire-ucx: a command run on the holder's thread failed")
                    finally:
                        self.inline = False
                    ring = self._wakes_sooner()
            finally:
                self._loop.release()
            if ran:
                if ring:
                    self._ring()
                return
        self.submit(fn, *args)

    def _wakes_sooner(self) -> bool:
        """Whether the sleeping progress thread has something to do before it wakes on its own
        (the loop lock held)."""
        if self._wakes or self._commands:
            return True
        if self._timers and self._timers[0][0] < self._sleep_until:
            return True
        driver = self._driver
        return driver is not None and time.monotonic() + driver.sleep_cap() < self._sleep_until

    def _ring(self) -> None:
        try:
            os.write(self._doorbell_w, b"!")
        except BlockingIOError:
            pass  # the pipe is full of unread rings: the thread is awake anyway
        except OSError:
            pass  # closed at exit

    # ------------------------------------------------------------ the progress thread

    def call_later(self, delay: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._timers, (time.monotonic() + max(0.0, delay), next(self._timer_seq), fn))

    def wake_later(self, wake: WakeFn) -> None:
        """Call ``wake`` once this iteration's changes are visible (W1): one call per distinct
        wake callable for all the changes of the iteration (kvwire's W1.8 policy,
        :class:`kvwire.attempts.OwedWakes`)."""
        self._wakes.add(wake)

    def after_wakes(self, fn: Callable[..., None], *args: Any) -> None:
        """Run ``fn(*args)`` on this thread right after this iteration's wakes (on a holder's
        thread, in :meth:`run_here`: now). For work no holder waits for, such as a last word
        to a peer: a holder woken first need not wait for a socket write, which on a busy host
        can take a whole time slice of the process it wakes."""
        if self.inline:
            fn(*args)
        else:
            self._after_wakes.append((fn, args))

    def register(self, fileobj: Any, events: int, data: Any) -> None:
        self._selector.register(fileobj, events, data)

    def modify(self, fileobj: Any, events: int, data: Any) -> None:
        self._selector.modify(fileobj, events, data)

    def unregister(self, fileobj: Any) -> None:
        try:
            self._selector.unregister(fileobj)
        except (KeyError, ValueError):
            pass

    def run(self, driver: Driver, port: int) -> None:
        """The loop: commands, progress, reaping, timers, wakes, then a sleep on the fds."""
        with self._loop:
            self._looping = True
            self._driver = driver
            try:
                self._run(driver, port)
            finally:
                self._looping = False

    def _run(self, driver: Driver, port: int) -> None:
        polled = 0.0
        spin_until = 0.0
        while True:
            try:
                if self._run_commands() and self.spin_s:
                    spin_until = time.monotonic() + self.spin_s
                driver.progress()
                driver.reap()
                self._fire_timers()
                self._flush_wakes()
                if self.stopping and driver.can_exit():
                    return
                if self._commands:
                    continue
                if self.spin_s and time.monotonic() < spin_until:
                    # spinning after activity: the fds every iteration, no sleep
                    if self._wait(driver, 0.0):
                        spin_until = time.monotonic() + self.spin_s
                    polled = time.monotonic()
                    continue
                if driver.spinning():
                    if time.monotonic() - polled >= SOCKET_POLL_S:
                        self._wait(driver, 0.0)
                        polled = time.monotonic()
                    continue
                if driver.arm():
                    if self._wait(driver, self._sleep_timeout(driver.sleep_cap())) and self.spin_s:
                        spin_until = time.monotonic() + self.spin_s
                    polled = time.monotonic()
                elif time.monotonic() - polled >= SOCKET_POLL_S:
                    # UCX has events pending: progress on, but look at the fds now and then
                    self._wait(driver, 0.0)
                    polled = time.monotonic()
            except Exception:
                log.exception("kvwire-ucx engine on port %d hit an unexpected error; continuing", port)
                time.sleep(0.01)  # no tight loop on a persistent fault

    def _run_commands(self) -> bool:
        """Run the commands submitted so far; whether there were any."""
        ran = False
        while self._commands:
            fn, args = self._commands.popleft()
            fn(*args)
            ran = True
        return ran

    def _fire_timers(self) -> None:
        now = time.monotonic()
        while self._timers and self._timers[0][0] <= now:
            _, _, fn = heapq.heappop(self._timers)
            fn()

    def _flush_wakes(self) -> None:
        while True:
            if self._wakes:
                call_wakes(self._wakes.take())  # each logged if it raises: a wake never stops the engine
            if not self._after_wakes:
                return
            later, self._after_wakes = self._after_wakes, []
            for fn, args in later:
                try:
                    fn(*args)
                except Exception:
                    log.exception("kvwire-ucx: work after the wakes failed")
            if not self._wakes:  # what that work concluded (a connection it found gone) wakes now too
                return

    def _sleep_timeout(self, cap: float) -> float:
        cap = min(cap, MAX_SLEEP_S)
        if not self._timers:
            return cap
        return min(cap, max(0.0, self._timers[0][0] - time.monotonic()))

    def _wait(self, driver: Driver, timeout: float) -> bool:
        """Wait up to ``timeout`` for the fds, then handle what they brought; whether any was
        ready."""
        if timeout > 0 and self._looping:
            self._sleep_until = time.monotonic() + timeout
            self._asleep = True
            self._loop.release()  # asleep: a holder's thread may run a command meanwhile (run_here)
            try:
                ready = self._selector.select(timeout)
            finally:
                self._asleep = False  # awake: no command runs elsewhere once the lock is free again
                self._loop.acquire()
        else:
            ready = self._selector.select(0)
        # Timers that came due by now fire before what the fds brought: on a busy machine this
        # thread may wake past a deadline with a message in hand, and the deadline came first
        # (a serving end's own expiry decline must not pass for a decline, A10.7).
        self._fire_timers()
        for key, events in ready:
            if key.data is _DOORBELL:
                try:
                    while os.read(self._doorbell_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            else:
                driver.on_ready(key.data, events)
        return bool(ready)

    def close(self) -> None:
        try:
            self._selector.close()
        except Exception:
            pass
        for fd in (self._doorbell_r, self._doorbell_w):
            try:
                os.close(fd)
            except OSError:
                pass
