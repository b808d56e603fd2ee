"""A ready harness for store plugins built on :class:`kvwire.blob.BlobBackend`.

A store plugin subclasses :class:`StoreHarness`, says how to make a fresh store and a driver
that reaches it, and gets holds and fault injection for free: between each backend and its
driver sits a :class:`ControlledDriver` that can hold every call and fail chosen names, and
beneath it, when a test asks, a :class:`~kvwire.testing.faults.FaultyDriver` with a drawn
schedule."""

from __future__ import annotations

import abc
import itertools
import os
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvwire.blob import BatchResult, BlobBackend, KeyStatus, StoreDriver
from kvwire.blob.driver import overrides_parts
from kvwire.contract import Backend, Hint, SlotRegion
from kvwire.testing.faults import FaultyDriver
from kvwire.testing.gate import Gate
from kvwire.testing.harness import Ends, FaultPlan, Harness, Unavailable, close_spawned, shut_down
from kvwire.testing.processes import StoreProcess
from kvwire.testing.regions import HostMemory

__all__ = ["StoreHarness", "ControlledDriver", "StoreControl", "fill_until_full", "FILL_CHUNK"]

#: The largest object a fill stores (it halves from here down to a row's size).
FILL_CHUNK = 8 << 20
_fills = itertools.count(1)


def fill_until_full(put: Callable[[int], bool], row_bytes: int, limit_bytes: int) -> int:
    """Store objects through ``put(size) -> stored``, :data:`FILL_CHUNK` bytes each and then
    halving at each refusal, until the store takes no object of ``row_bytes`` more; the bytes
    stored. :class:`~kvwire.testing.harness.Unavailable` for a store the suite cannot hold full:

    - one that took ``limit_bytes`` without refusing an object (no bound the suite can reach);
    - one that makes room as it fills (evicts, or its objects expire): after refusing an object of
      a size it took earlier in the fill (so not too big for it), it took more bytes of smaller
      objects than that size. A store that makes no room had less free than the object it
      refused, so it cannot. (A refused size it never took may be over its largest object; the
      fill then just goes on.) Without this, a fill of small rows into a store that evicts as
      it fills would go on for hours."""
    size = max(FILL_CHUNK, row_bytes)
    stored = largest = 0
    refused = 0  # the size refused last, while the bytes taken since are a bound on its room
    after = 0  # the bytes taken since that refusal
    while True:
        if put(size):
            stored += size
            largest = max(largest, size)
            if stored > limit_bytes:
                raise Unavailable(f"the store took {stored >> 20} MiB of objects without refusing one; it has no "
                                  "bound the suite can reach (Ends.fill)")
            if refused:
                after += size
                if after > refused:
                    if refused <= largest:
                        raise Unavailable(
                            f"the store refused an object of {refused} bytes (a size it took before), then took "
                            f"{after} bytes of smaller ones: it makes room as it fills (evicts, or its objects "
                            "expire), so the suite cannot hold it full (Ends.fill)")
                    refused = 0  # too big for it, not a sign of a full store
        elif size == row_bytes:
            return stored  # it takes no object of a row's size more: full
        else:
            refused, after = size, 0
            size = max(size // 2, row_bytes)


class StoreControl(Gate):
    """Shared by the drivers of one pair of ends: a :class:`~kvwire.testing.gate.Gate` (holds
    every call while held, counts the calls waiting and running) that also fails the names of a
    :class:`FaultPlan`."""

    def __init__(self, faults: FaultPlan | None = None) -> None:
        super().__init__()
        plan = faults or FaultPlan()
        self.fail_get = frozenset(n.hex() for n in plan.fetch)
        self.fail_put = frozenset(n.hex() for n in plan.publish)
        self.fail_lookup = frozenset(n.hex() for n in plan.lookup)


class ControlledDriver(StoreDriver):
    """``inner`` under a :class:`StoreControl`: every put and get waits while the control holds,
    and keys whose content name the control's plan lists answer ``FAILED``."""

    def __init__(self, inner: StoreDriver, control: StoreControl) -> None:
        self.inner = inner
        self.control = control
        self.memory_kinds = inner.memory_kinds
        self.max_batch_keys = inner.max_batch_keys
        self.chunks_at_once = inner.chunks_at_once

    def register(self, regions: Sequence[SlotRegion]) -> None:
        self.inner.register(regions)

    def unregister(self, regions: Sequence[SlotRegion]) -> None:
        self.inner.unregister(regions)

    def put(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        return self._call(self.inner.put, self.control.fail_put, keys, addresses, sizes)

    def get_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        return self._call(self.inner.get_into, self.control.fail_get, keys, addresses, sizes)

    def put_parts(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        """The inner driver's own parts call where it has one (held and failed like a put), so
        the suite checks the block path the backend really takes; else the bounce through
        :meth:`put`."""
        if not overrides_parts(self.inner):
            return super().put_parts(keys, addresses, sizes)
        return self._call(self.inner.put_parts, self.control.fail_put, keys, addresses, sizes, parts=True)

    def get_parts_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        """As :meth:`put_parts`, for reads."""
        if not overrides_parts(self.inner):
            return super().get_parts_into(keys, addresses, sizes)
        return self._call(self.inner.get_parts_into, self.control.fail_get, keys, addresses, sizes, parts=True)

    @property
    def offers_parts(self) -> bool:
        return self.inner.offers_parts

    def exists(self, keys: Sequence[str]) -> np.ndarray:
        return self.inner.exists(keys)

    def contains(self, keys: Sequence[str]) -> BatchResult:
        """The inner driver's answer, held like every put and get (lookup, L1); the names the
        plan lists for lookups answer ``FAILED``."""
        return self._call(lambda k, _a, _s: self.inner.contains(k), self.control.fail_lookup, keys,
                          np.zeros(len(keys), dtype=np.uint64), np.zeros(len(keys), dtype=np.uint64))

    @property
    def offers_contains(self) -> bool:
        return self.inner.offers_contains

    def remove(self, keys: Sequence[str]) -> BatchResult:
        return self.inner.remove(keys)

    def close(self) -> None:
        self.inner.close()

    def _call(self, call: Any, failing: frozenset[str], keys: Sequence[str], addresses: np.ndarray,
              sizes: np.ndarray, *, parts: bool = False) -> BatchResult:
        """``call`` once the control lets it pass, on the keys the plan does not fail. For a
        parts call (``parts``) ``sizes`` are the parts' sizes, the same for every key."""
        with self.control.passage():
            if not failing:
                result: BatchResult = call(keys, addresses, sizes)
                return result
            # Keys end in the row's content name as hex (kvwire.blob.keys); fail those listed.
            fail = np.fromiter((k.rsplit("/", 1)[-1] in failing for k in keys), dtype=bool, count=len(keys))
            status = np.full(len(keys), int(KeyStatus.FAILED), dtype=np.uint8)
            reasons = {int(i): "injected fault: the store failed this object" for i in np.flatnonzero(fail)}
            rest = np.flatnonzero(~fail)
            if rest.size:
                inner: BatchResult = call([keys[i] for i in rest.tolist()], np.asarray(addresses)[rest],
                                          np.asarray(sizes) if parts else np.asarray(sizes)[rest])
                status[rest] = inner.status
                for j, text in inner.reasons.items():
                    reasons[int(rest[j])] = text
            return BatchResult(status, reasons)


class StoreHarness(Harness):
    """A harness for a backend built on :class:`~kvwire.blob.BlobBackend`.

    Implement :meth:`new_store` and :meth:`driver`; override :meth:`plugin_end` to have the
    suite also build your backend exactly as your plugin does, for tests that need no control of
    the store; override :meth:`drop_store` to free a store after its test.

    Both ends are configured with the namespace ``"conformance"`` and their hints name it; each
    :class:`~kvwire.testing.harness.Ends` says so in ``extra["namespace"]`` (H1.7)."""

    #: Options passed to :class:`~kvwire.blob.BlobBackend` besides namespace, timeout and queue.
    blob_options: dict[str, Any] = {}

    lookup_faults = True  # the controlled driver fails a lookup's listed names

    #: ``"module:object"`` of this harness, importable in a fresh interpreter, when the stores
    #: :meth:`new_store` makes are shared by processes (a directory: ``new_store()`` returns a
    #: ``str`` the other process can open): the cross-process tests then start a backend on the
    #: same store in another process (:attr:`Ends.other_process`). ``None`` (the default): they skip.
    process_harness: str | None = None

    @abc.abstractmethod
    def new_store(self) -> Any:
        """A fresh, empty store that nothing else uses, that takes 32 MiB without evicting or
        declining anything. Whatever it returns is passed to :meth:`driver`."""

    @abc.abstractmethod
    def driver(self, store: Any) -> StoreDriver:
        """A new driver that reaches ``store`` (one per end)."""

    def drop_store(self, store: Any) -> None:
        """Free ``store`` once both ends are shut down. The default does nothing."""

    def plugin_end(self, store: Any, *, namespace: str, timeout_s: float,
                   max_in_flight: int | None) -> Backend | None:
        """One end built the way the plugin builds it (e.g. ``plugin.build(options)``), reaching
        ``store`` with ``namespace``; ``None`` (the default) to always build on a controlled
        driver."""
        return None

    def open(self, *, timeout_s: float, max_in_flight: int | None = None,
             faults: FaultPlan | None = None, hold: bool = False) -> Ends:
        store = self.new_store()
        namespace = "conformance"
        hint = Hint.of("store", namespace=namespace)
        control: StoreControl | None = None
        plain = not faults and not hold

        def end() -> Backend:
            """One more end on ``store``: as the plugin builds it where the test controls nothing,
            else a blob backend on a controlled driver."""
            if control is None:
                built = self.plugin_end(store, namespace=namespace, timeout_s=timeout_s, max_in_flight=max_in_flight)
                if built is not None:
                    return built
                raise AssertionError("plugin_end() gave no end after it gave one")  # never: it is deterministic
            options = dict(self.blob_options)
            if max_in_flight is not None:
                options["max_in_flight"] = max_in_flight
            driver = self.driver(store)
            if faults is not None and faults.schedule:
                driver = FaultyDriver(driver, faults.schedule, owns_inner=True)
            return BlobBackend(ControlledDriver(driver, control), namespace=namespace, timeout_s=timeout_s,
                               owns_driver=True, **options)

        backends: list[Backend] = []
        try:
            if plain:
                first = self.plugin_end(store, namespace=namespace, timeout_s=timeout_s, max_in_flight=max_in_flight)
                if first is not None:
                    backends.append(first)
            if not backends:
                control = StoreControl(faults)
            while len(backends) < 2:
                backends.append(end())
        except BaseException:
            for backend in backends:
                backend.shutdown()
            self.drop_store(store)
            raise
        source, sink = backends
        return Ends(
            source=source,
            sink=sink,
            publish_hint=hint,
            fetch_hint=hint,
            hold=control.hold if control is not None else None,
            cleanup=lambda: self.drop_store(store),
            extra={"store": store, "control": control, "namespace": namespace},
            fill=lambda row_bytes: self.fill_store(store, row_bytes),
            another_sink=end,
            other_process=(lambda: self.start_process(store, namespace, timeout_s))
            if self.process_harness is not None else None,
        )

    def start_process(self, store: Any, namespace: str, timeout_s: float) -> StoreProcess:
        """:attr:`Ends.other_process`: a child process with a backend on ``store``."""
        assert self.process_harness is not None
        if not isinstance(store, str):
            raise Unavailable(f"the harness's store is a {type(store).__name__}, not a str another process can open")
        return StoreProcess(self.process_harness, store, namespace, timeout_s)

    #: Objects a fill stores at most before it decides the store has no bound.
    fill_limit_bytes: int = 512 << 20

    def fill_store(self, store: Any, row_bytes: int) -> Callable[[], None]:
        """:attr:`Ends.fill` for any driver: put objects of the harness's own (keys under
        ``kvwire-fill/``, never a namespace's) through a fresh driver, 8 MiB each and then halving,
        until the store takes no object of ``row_bytes`` more: a put answers ``DECLINED`` (or
        anything but stored) at that size. Returns the undo, which removes them all. A store that
        took :attr:`fill_limit_bytes` without refusing one has no bound: :class:`Unavailable`."""
        if not isinstance(row_bytes, int) or row_bytes < 1:
            raise ValueError(f"row_bytes must be an int >= 1, got {row_bytes!r}")
        driver = self.driver(store)
        memory = HostMemory(max(FILL_CHUNK, row_bytes), 1)
        region = memory.region
        driver.register([region])
        keys: list[str] = []
        prefix = f"kvwire-fill/{os.getpid()}-{next(_fills)}/"
        base = np.array([region.base], dtype=np.uint64)

        def put(size: int) -> bool:
            key = f"{prefix}{len(keys)}"
            stored = int(driver.put([key], base, np.array([size], dtype=np.uint64)).status[0]) == int(KeyStatus.OK)
            if stored:
                keys.append(key)
            return stored

        def free() -> None:
            try:
                for start in range(0, len(keys), 256):
                    driver.remove(keys[start:start + 256])
            finally:
                keys.clear()
                driver.unregister([memory.region])  # the junk buffer lives until the store let go of it
                driver.close()

        try:
            fill_until_full(put, row_bytes, self.fill_limit_bytes)
        except BaseException:
            free()
            raise
        return free

    def close(self, ends: Ends) -> None:
        control = ends.extra.get("control")
        if isinstance(control, StoreControl):
            control.release()
        try:
            close_spawned(ends, max(10.0, self.quiesce_grace_s))
            for backend in ends.backends:
                shut_down(backend, timeout_s=max(10.0, self.quiesce_grace_s))
            for backend in ends.backends:
                backend.close()
        finally:
            if ends.cleanup is not None:
                ends.cleanup()
