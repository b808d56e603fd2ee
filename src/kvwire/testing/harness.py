"""The harness API: what a backend plugin supplies so the conformance suite can test it.

A plugin registers one :class:`Harness` in the entry-point group ``kvwire.harnesses`` under the
same name as its backend in ``kvwire.backends``::

    [project.entry-points."kvwire.harnesses"]
    example = "kvwire_example.harness:harness"

The harness says how to build the backend for a test and nothing else; the suite decides what to
submit from the capabilities the backend declares, and checks every byte through memory it reads
and writes itself (:mod:`kvwire.testing.regions`), never through the backend under test.

What a harness does:

- :meth:`Harness.open` builds a fresh pair of :class:`Ends` that reach one another: for a store
  backend two backends sharing one store that nothing else uses (publish on ``source``, fetch on
  ``sink``); for a peer backend a connected pair. It also gives the hint each direction needs.
- :meth:`Harness.allocate` gives memory of each kind the backend claims (the default gives HOST
  memory as numpy arrays and DEVICE memory as torch CUDA tensors, when a GPU exists).
- Optionally, :attr:`Ends.hold` makes the other end stop answering until released, and
  :meth:`Harness.open` honours a :class:`FaultPlan`. Tests that need either skip when the harness
  cannot provide it (they say so), so a first harness can leave both out. So are the other
  optional hooks of :class:`Ends`: :attr:`Ends.fill` (make a store really full),
  :attr:`Ends.another_sink` (one more backend reaching the same other end) and
  :attr:`Ends.other_process` (a backend in another process on the same store).
- :meth:`Harness.close` tears the ends down (the default shuts both backends down until nothing
  is in flight and then runs :attr:`Ends.cleanup`).

For backends built on :class:`kvwire.blob.BlobBackend`, :class:`kvwire.testing.stores.StoreHarness`
does all of this given a way to make a driver; see ``examples/third_party_plugin``."""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from importlib import metadata
from typing import Any

from kvwire.contract import Backend, Capabilities, Hint, MemoryKind
from kvwire.holding import drain
from kvwire.testing.regions import DeviceMemory, HostMemory, RegionMemory, cuda_devices

__all__ = ["Harness", "Ends", "Hold", "FaultPlan", "Unavailable", "shut_down", "close_spawned"]


class Unavailable(Exception):
    """The harness cannot provide what a test asked for here (no GPU, no fault injection). The
    suite turns it into a skip whose reason is this exception's message."""


class Hold(abc.ABC):
    """While a hold is in place the other end answers nothing: every call a backend makes to it
    waits (a store holds each request; a peer leaves each message unanswered) until
    :meth:`release`. The suite uses it to keep attempts in flight for as long as it likes."""

    @abc.abstractmethod
    def release(self) -> None:
        """Let every held call, and every later one, proceed. Idempotent."""

    @abc.abstractmethod
    def waiting(self) -> int:
        """How many calls the other end is holding now."""

    @abc.abstractmethod
    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no call to the other end is held or running, so the other end touches no
        memory on a backend's behalf; whether that happened within ``timeout_s``."""

    def __enter__(self) -> Hold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


@dataclass(frozen=True)
class FaultPlan:
    """Faults the other end injects, by content name (the row names the suite puts in views):
    a fetch of a name in ``fetch`` or a publish of a name in ``publish`` meets a fault at the
    other end (a store answers ``FAILED`` for that object; a peer reports an error). Names not
    listed behave normally. An empty plan injects nothing."""

    fetch: frozenset[bytes] = frozenset()
    publish: frozenset[bytes] = frozenset()
    #: A lookup (L1) that asks about a name listed here meets a fault at the other end for that
    #: name (a store fails it). Only a harness whose :attr:`Harness.lookup_faults` is true
    #: applies it; the suite asks for it nowhere else.
    lookup: frozenset[bytes] = frozenset()
    #: For a store backend: :mod:`kvwire.testing.faults` records that a
    #: :class:`~kvwire.testing.faults.FaultyDriver` applies to each end's driver.
    schedule: tuple[Any, ...] = ()

    def __bool__(self) -> bool:
        return bool(self.fetch or self.publish or self.lookup or self.schedule)


@dataclass
class Ends:
    """Two ends that reach one another, built by :meth:`Harness.open` for one test.

    ``source`` publishes with ``publish_hint`` and ``sink`` fetches with ``fetch_hint``: for a
    store, what ``source`` published under a name ``sink`` can fetch under that name; for a peer
    backend that serves pulls, ``source`` is the serving end and ``fetch_hint`` names it. For a
    peer backend without that protocol, a publish on ``source`` and a fetch on ``sink`` whose
    views hold the same names in the same groups meet one another.

    ``hold``, when given, starts holding the other end and returns the :class:`Hold`.
    ``cleanup`` runs after both backends shut down (drop the store, stop a server).

    For a store, ``hold`` holds every call the backends make to the store. For a peer that serves
    pulls, the suite holds a pull itself by not answering it; ``hold``, when given, holds what the
    serving end sends towards a requester (an answer's rows, or its offer of them: the answer is
    then on the wire, published and not yet received), so tests can cross a requester's cancel, or
    the end of a standing offer, with an answer in flight. Tests that need it skip without it.

    ``extra`` is the harness's own, with keys the suite reads when present:

    - ``extra["namespace"]``, for a store backend, the namespace (a ``str``) both backends were
      configured with, which a store hint without a ``namespace`` field uses (H1.7). The test of
      H1.7 needs it and skips, naming the key, when a harness leaves it out (or ``extra`` holds no
      ``str`` there). :class:`kvwire.testing.stores.StoreHarness` sets it.
    - ``extra["pending_pulls"]``, for a peer that serves pulls and declines pulls as busy once this
      many wait for its holder (an ``int``): the bound the serving end was built with. Below it no
      pull may be declined for being busy (N2.4); beyond it each one is declined (cause
      ``DECLINED``). Without the key the suite expects no busy decline at all.

    The optional hooks below are what some tests need beyond a hold and faults; each such test
    skips, naming the hook, when a harness leaves it ``None``."""

    source: Backend
    sink: Backend
    publish_hint: Hint
    fetch_hint: Hint
    hold: Callable[[], Hold] | None = None
    cleanup: Callable[[], None] | None = None
    #: Anything else the harness wants to keep with these ends; the suite reads only the keys
    #: ``"namespace"`` and ``"pending_pulls"`` (see above), and only when they are there.
    extra: dict[str, object] = field(default_factory=dict)
    #: For a store: make the store itself really full, the way its own limits make it (not
    #: through these ends): store objects of the harness's own until the store takes no object of
    #: ``row_bytes`` bytes more. Returns a callable that removes what it stored. A store that
    #: cannot be filled (it has no bound) raises :class:`Unavailable`. The test of a full store
    #: (A5.11) needs it: a publish to a full store delivers, its rows false bits, never a failure.
    fill: Callable[[int], Callable[[], None]] | None = None
    #: One more backend built like ``sink``, reaching the same other end with ``fetch_hint`` (for
    #: a serving peer another requester of ``source``; for a store another end on the same
    #: store). Call it through :meth:`make_another_sink`, which the harness's :meth:`Harness.close`
    #: shuts down and closes with the ends.
    another_sink: Callable[[], Backend] | None = None
    #: For a store that several processes share (a directory): start a backend on the same store
    #: in another process (:class:`kvwire.testing.processes.StoreProcess`), configured with the
    #: same namespace. Call it through :meth:`make_other_process`; the harness stops what it
    #: started with the ends.
    other_process: Callable[[], Any] | None = None
    #: What :meth:`make_another_sink` and :meth:`make_other_process` started, stopped by
    #: :func:`close_spawned` (the default :meth:`Harness.close` calls it).
    spawned: list[Any] = field(default_factory=list)

    @property
    def backends(self) -> tuple[Backend, ...]:
        """Each distinct backend of the pair, once."""
        return (self.source,) if self.sink is self.source else (self.source, self.sink)

    def make_another_sink(self) -> Backend:
        """:attr:`another_sink`, kept to be shut down with the ends; :class:`Unavailable`
        without it."""
        if self.another_sink is None:
            raise Unavailable("the harness builds no further backend reaching the same other end (Ends.another_sink)")
        backend = self.another_sink()
        self.spawned.append(backend)
        return backend

    def make_other_process(self) -> Any:
        """:attr:`other_process`, kept to be stopped with the ends; :class:`Unavailable`
        without it."""
        if self.other_process is None:
            raise Unavailable("the harness runs no backend of another process on the same store (Ends.other_process)")
        process = self.other_process()
        self.spawned.append(process)
        return process


def close_spawned(ends: Ends, timeout_s: float) -> None:
    """Stop what :meth:`Ends.make_another_sink` and :meth:`Ends.make_other_process` started:
    each backend shut down until nothing is in flight and closed, each process stopped."""
    spawned, ends.spawned = list(ends.spawned), []
    for thing in spawned:
        if isinstance(thing, Backend):
            shut_down(thing, timeout_s=timeout_s)
            thing.close()
        else:
            thing.stop()


class Harness(abc.ABC):
    """How to build one backend for the conformance suite. Subclass it, set :attr:`name`, and
    implement :meth:`open`; override the rest only when the defaults do not fit.

    A harness is used from one thread at a time and must not keep state between :meth:`open`
    calls that one test could see from another: every :meth:`open` gives a fresh other end."""

    #: The backend's name: its entry-point name in ``kvwire.backends`` and ``kvwire.harnesses``.
    name: str = ""

    #: How long after its deadline (A8) an attempt may take to quiesce: the grace the backend
    #: documents. The suite fails an attempt that takes longer.
    quiesce_grace_s: float = 5.0

    #: Whether :meth:`open` applies :attr:`FaultPlan.lookup` (fails a lookup's listed names at
    #: the other end). The L1.8 test skips unless it does; a harness written before the field
    #: existed ignores it, so it is off by default.
    lookup_faults: bool = False

    @abc.abstractmethod
    def open(self, *, timeout_s: float, max_in_flight: int | None = None,
             faults: FaultPlan | None = None, hold: bool = False) -> Ends:
        """Build a fresh pair of ends.

        ``timeout_s``: each submission's deadline, set through the backend's options (A8).
        ``max_in_flight``: a small queue bound the suite would like, when the backend's options
        allow one (the suite reads the bound from ``capabilities()``, so ignoring it is fine).
        ``faults``: inject these at the other end, or raise :class:`Unavailable` if it cannot.
        ``hold``: the test will hold the other end; set :attr:`Ends.hold` if you can. A store
        backend's harness must (or raise :class:`Unavailable`); for a peer that serves pulls the
        suite holds a pull itself by not answering it.

        The other end keeps everything the suite stores in it for the life of the ends, without
        evicting or declining any of it (one pair of ends receives at most 32 MiB; the largest
        exchanges store about 12 MiB), so a miss is always the suite's doing."""

    def close(self, ends: Ends) -> None:
        """Tear the ends down. The default shuts each backend down until nothing is in flight
        (B3), closes it (``Backend.close()``), then runs ``ends.cleanup``. The suite closes its
        registrations itself, before this."""
        try:
            close_spawned(ends, max(10.0, self.quiesce_grace_s))
            for backend in ends.backends:
                shut_down(backend, timeout_s=max(10.0, self.quiesce_grace_s))
            for backend in ends.backends:
                backend.close()
        finally:
            if ends.cleanup is not None:
                ends.cleanup()

    @contextlib.contextmanager
    def ends(self, *, timeout_s: float, max_in_flight: int | None = None,
             faults: FaultPlan | None = None, hold: bool = False) -> Iterator[Ends]:
        """:meth:`open`, then :meth:`close` however the block ends."""
        ends = self.open(timeout_s=timeout_s, max_in_flight=max_in_flight, faults=faults, hold=hold)
        try:
            yield ends
        finally:
            self.close(ends)

    def finish(self) -> None:
        """End what the harness keeps for the whole session (a server it started, pooled
        clients). The suite calls it once, after the last test. The default does nothing."""

    def capabilities(self) -> Capabilities:
        """What the backend declares. The default asks the plugin registered under :attr:`name`
        (without building a backend); for a harness whose backend is not an installed plugin
        (``--kvwire-harness`` under a new name) it builds one pair of ends once and asks the
        source backend. Override it to declare without building."""
        from kvwire.registry import ConfigError, load

        try:
            return load(self.name).capabilities
        except ConfigError:
            pass  # not an installed plugin: ask a built backend
        cached = getattr(self, "_built_capabilities", None)
        if cached is None:
            ends = self.open(timeout_s=60.0)
            try:
                cached = ends.source.capabilities()
            finally:
                self.close(ends)
            self._built_capabilities = cached
        return cached

    def distribution(self) -> str:
        """``"name version"`` of the distribution that provides the backend, for the report."""
        for entry in metadata.entry_points(group="kvwire.backends"):
            if entry.name == self.name and entry.dist is not None:
                return f"{entry.dist.metadata['Name']} {entry.dist.version}"
        module = type(self).__module__.split(".")[0]
        return f"{module} (not an installed distribution)"

    def allocate(self, kind: MemoryKind, slot_bytes: int, slot_count: int) -> RegionMemory:
        """Memory for one region of ``kind``: HOST as a numpy array, DEVICE as a CUDA tensor on
        the first GPU. Raises :class:`Unavailable` when there is no GPU for DEVICE memory.
        Override to allocate memory your backend needs in a special way (pinned, registered)."""
        if kind is MemoryKind.HOST:
            return HostMemory(slot_bytes, slot_count)
        devices = cuda_devices()
        if not devices:
            raise Unavailable("no CUDA device is present for DEVICE memory")
        return DeviceMemory(slot_bytes, slot_count, device=devices[0])

    def __repr__(self) -> str:
        return f"<{type(self).__name__} for backend {self.name!r}>"


def shut_down(backend: Backend, timeout_s: float) -> None:
    """Call ``shutdown()`` until it returns an empty set, as a holder does (B3). Raises
    ``AssertionError`` naming the attempts still in flight after ``timeout_s``."""
    # The attempts' wakes belong to the tests: the drain re-asks on a short, growing interval.
    pending = drain(backend, timeout_s, close=False)
    if pending:
        raise AssertionError(
            f"B3: shutdown() still returns {len(pending)} attempt(s) whose memory access has not "
            f"ended, {timeout_s:g} s after the first call")
