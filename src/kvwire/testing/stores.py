"""A ready harness for store plugins built on :class:`kvwire.blob.BlobBackend`.

A store plugin subclasses :class:`StoreHarness`, says how to make a fresh store and a driver
that reaches it, and gets holds and fault injection for free: between each backend and its
driver sits a :class:`ControlledDriver` that can hold every call and fail chosen names, and
beneath it, when a test asks, a :class:`~kvwire.testing.faults.FaultyDriver` with a drawn
schedule."""

from __future__ import annotations

import abc
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvwire.blob import BatchResult, BlobBackend, KeyStatus, StoreDriver
from kvwire.contract import Backend, Hint, SlotRegion
from kvwire.testing.faults import FaultyDriver
from kvwire.testing.harness import Ends, FaultPlan, Harness, Hold, shut_down

__all__ = ["StoreHarness", "ControlledDriver", "StoreControl"]


class StoreControl(Hold):
    """Shared by the drivers of one pair of ends: holds every call while held, fails the names of
    a :class:`FaultPlan`, and counts the calls in progress."""

    def __init__(self, faults: FaultPlan | None = None) -> None:
        self._cond = threading.Condition()
        self._held = False
        self._waiting = 0
        self._running = 0
        plan = faults or FaultPlan()
        self.fail_get = frozenset(n.hex() for n in plan.fetch)
        self.fail_put = frozenset(n.hex() for n in plan.publish)

    def hold(self) -> StoreControl:
        with self._cond:
            self._held = True
        return self

    def release(self) -> None:
        with self._cond:
            self._held = False
            self._cond.notify_all()

    def waiting(self) -> int:
        with self._cond:
            return self._waiting

    def wait_idle(self, timeout_s: float) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._waiting == 0 and self._running == 0, timeout=timeout_s)

    def enter(self) -> None:
        with self._cond:
            if self._held:
                self._waiting += 1
                self._cond.notify_all()
                self._cond.wait_for(lambda: not self._held)
                self._waiting -= 1
            self._running += 1

    def leave(self) -> None:
        with self._cond:
            self._running -= 1
            self._cond.notify_all()


class ControlledDriver(StoreDriver):
    """``inner`` under a :class:`StoreControl`: every put and get waits while the control holds,
    and keys whose content name the control's plan lists answer ``FAILED``."""

    def __init__(self, inner: StoreDriver, control: StoreControl) -> None:
        self.inner = inner
        self.control = control
        self.memory_kinds = inner.memory_kinds

    def register(self, regions: Sequence[SlotRegion]) -> None:
        self.inner.register(regions)

    def unregister(self, regions: Sequence[SlotRegion]) -> None:
        self.inner.unregister(regions)

    def put(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        return self._call(self.inner.put, self.control.fail_put, keys, addresses, sizes)

    def get_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        return self._call(self.inner.get_into, self.control.fail_get, keys, addresses, sizes)

    def exists(self, keys: Sequence[str]) -> np.ndarray:
        return self.inner.exists(keys)

    def contains(self, keys: Sequence[str]) -> BatchResult:
        """The inner driver's answer, held like every put and get (lookup, L1)."""
        self.control.enter()
        try:
            return self.inner.contains(keys)
        finally:
            self.control.leave()

    @property
    def offers_contains(self) -> bool:
        return self.inner.offers_contains

    def remove(self, keys: Sequence[str]) -> BatchResult:
        return self.inner.remove(keys)

    def close(self) -> None:
        self.inner.close()

    def _call(self, call: Any, failing: frozenset[str], keys: Sequence[str], addresses: np.ndarray,
              sizes: np.ndarray) -> BatchResult:
        self.control.enter()
        try:
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
                                          np.asarray(sizes)[rest])
                status[rest] = inner.status
                for j, text in inner.reasons.items():
                    reasons[int(rest[j])] = text
            return BatchResult(status, reasons)
        finally:
            self.control.leave()


class StoreHarness(Harness):
    """A harness for a backend built on :class:`~kvwire.blob.BlobBackend`.

    Implement :meth:`new_store` and :meth:`driver`; override :meth:`plugin_end` to have the
    suite also build your backend exactly as your plugin does, for tests that need no control of
    the store; override :meth:`drop_store` to free a store after its test."""

    #: Options passed to :class:`~kvwire.blob.BlobBackend` besides namespace, timeout and queue.
    blob_options: dict[str, Any] = {}

    @abc.abstractmethod
    def new_store(self) -> Any:
        """A fresh, empty store that nothing else uses, large enough for a few MiB without
        evicting anything. Whatever it returns is passed to :meth:`driver`."""

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
        backends: list[Backend] = []
        try:
            if not faults and not hold:
                for _ in range(2):
                    end = self.plugin_end(store, namespace=namespace, timeout_s=timeout_s,
                                          max_in_flight=max_in_flight)
                    if end is None:
                        break
                    backends.append(end)
            if len(backends) < 2:
                control = StoreControl(faults)
                options = dict(self.blob_options)
                if max_in_flight is not None:
                    options["max_in_flight"] = max_in_flight
                while len(backends) < 2:
                    driver = self.driver(store)
                    if faults is not None and faults.schedule:
                        driver = FaultyDriver(driver, faults.schedule, owns_inner=True)
                    backends.append(BlobBackend(ControlledDriver(driver, control), namespace=namespace,
                                                timeout_s=timeout_s, owns_driver=True, **options))
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
            extra={"store": store, "control": control},
        )

    def close(self, ends: Ends) -> None:
        control = ends.extra.get("control")
        if isinstance(control, StoreControl):
            control.release()
        try:
            for backend in ends.backends:
                shut_down(backend, timeout_s=max(10.0, self.quiesce_grace_s))
            for backend in ends.backends:
                backend.close()
        finally:
            if ends.cleanup is not None:
                ends.cleanup()
