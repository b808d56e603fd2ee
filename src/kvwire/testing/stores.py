"""A ready harness for store plugins built on :class:`kvwire.blob.BlobBackend`.

A store plugin subclasses :class:`StoreHarness`, says how to make a fresh store and a driver
that reaches it, and gets holds and fault injection for free: between each backend and its
driver sits a :class:`ControlledDriver` that can hold every call and fail chosen names, and
beneath it, when a test asks, a :class:`~kvwire.testing.faults.FaultyDriver` with a drawn
schedule."""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvwire.blob import BatchResult, BlobBackend, KeyStatus, StoreDriver
from kvwire.contract import Backend, Hint, SlotRegion
from kvwire.testing.faults import FaultyDriver
from kvwire.testing.gate import Gate
from kvwire.testing.harness import Ends, FaultPlan, Harness, shut_down

__all__ = ["StoreHarness", "ControlledDriver", "StoreControl"]


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
              sizes: np.ndarray) -> BatchResult:
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
                                          np.asarray(sizes)[rest])
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
            extra={"store": store, "control": control, "namespace": namespace},
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
