"""Fault injection for store drivers: :class:`FaultyDriver` wraps any
:class:`~kvwire.blob.StoreDriver` and misbehaves on a schedule.

A schedule is plain data, a tuple of frozen fault records, so hypothesis strategies can draw
it. Each record names the operation it hits (``"put"``, ``"get"`` for ``get_into``,
``"exists"``, ``"remove"``) and which call of that operation, counted from 1 in arrival order
(``None``: every call). Key ranges ``[start:stop]`` index the keys *of that call*.

    driver = FaultyDriver(MemoryDriver(store), [FailKeys("get", call=2, start=3), Slow("put", delay_s=0.01)])
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal

import numpy as np

from kvwire.blob.driver import BatchResult, KeyStatus, StoreDriver, overrides_parts
from kvwire.contract import SlotRegion

__all__ = [
    "OPS",
    "Op",
    "FailCall",
    "FailKeys",
    "Decline",
    "Evict",
    "Block",
    "Slow",
    "Fault",
    "FaultyDriver",
]

Op = Literal["put", "get", "exists", "remove"]
OPS: tuple[str, ...] = ("put", "get", "exists", "remove")


def _check_call(kind: str, op: str, call: int | None) -> None:
    if op not in OPS:
        raise ValueError(f"{kind}.op must be one of {', '.join(OPS)}, got {op!r}")
    if call is not None and (isinstance(call, bool) or not isinstance(call, int) or call < 1):
        raise ValueError(f"{kind}.call counts calls from 1 (or is None for every call), got {call!r}")


def _check_range(kind: str, start: int, stop: int | None) -> None:
    if start < 0 or (stop is not None and stop < start):
        raise ValueError(f"{kind} keys [{start}:{stop}] must satisfy 0 <= start <= stop")


@dataclass(frozen=True, slots=True)
class FailCall:
    """That call fails whole: every key answers ``FAILED`` with ``reason`` and the inner driver
    is not reached. With ``raises``, the call raises ``RuntimeError`` instead (a broken driver)."""

    op: Op = "get"
    call: int | None = 1
    reason: str = "injected fault: the store failed the call"
    raises: bool = False

    def __post_init__(self) -> None:
        _check_call("FailCall", self.op, self.call)


@dataclass(frozen=True, slots=True)
class FailKeys:
    """Keys ``[start:stop]`` of that call answer ``FAILED`` and never reach the inner driver; the
    other keys do. ``FailKeys(start=k)`` fails the later part of a batch. For ``exists`` the
    failed keys answer false."""

    op: Op = "get"
    call: int | None = 1
    start: int = 0
    stop: int | None = None
    reason: str = "injected fault: the store failed these keys"

    def __post_init__(self) -> None:
        _check_call("FailKeys", self.op, self.call)
        _check_range("FailKeys", self.start, self.stop)


@dataclass(frozen=True, slots=True)
class Decline:
    """Keys ``[start:stop]`` of that ``put`` are declined for space: answered ``DECLINED``, not
    stored."""

    call: int | None = 1
    start: int = 0
    stop: int | None = None
    reason: str = "injected: the store has no space"

    def __post_init__(self) -> None:
        _check_call("Decline", "put", self.call)
        _check_range("Decline", self.start, self.stop)

    @property
    def op(self) -> Op:
        return "put"


@dataclass(frozen=True, slots=True)
class Evict:
    """Just before that call reaches the inner driver, the objects of its keys ``[start:stop]``
    are removed from the store behind the caller's back (a fetch then misses them)."""

    op: Op = "get"
    call: int | None = 1
    start: int = 0
    stop: int | None = None

    def __post_init__(self) -> None:
        _check_call("Evict", self.op, self.call)
        _check_range("Evict", self.start, self.stop)


@dataclass(frozen=True, slots=True)
class Block:
    """That call waits inside the driver, before reaching the inner one, until ``release`` is
    set. :meth:`FaultyDriver.wait_blocked` tells when calls are stuck there."""

    op: Op = "put"
    call: int | None = 1
    release: threading.Event = field(default_factory=threading.Event, compare=False, repr=False)

    def __post_init__(self) -> None:
        _check_call("Block", self.op, self.call)


@dataclass(frozen=True, slots=True)
class Slow:
    """That call sleeps ``delay_s`` inside the driver before doing anything else."""

    op: Op = "get"
    call: int | None = None
    delay_s: float = 0.01

    def __post_init__(self) -> None:
        _check_call("Slow", self.op, self.call)
        if not (math.isfinite(self.delay_s) and self.delay_s >= 0):
            raise ValueError(f"Slow.delay_s must be a finite number >= 0, got {self.delay_s!r}")


Fault = FailCall | FailKeys | Decline | Evict | Block | Slow


class FaultyDriver(StoreDriver):
    """``inner`` with ``faults`` injected. Everything not hit by a fault reaches ``inner``
    unchanged; ``register``/``unregister`` always do. With ``owns_inner``, :meth:`close` also
    closes ``inner``; it always releases every :class:`Block` first."""

    def __init__(self, inner: StoreDriver, faults: Iterable[Fault] = (), *, owns_inner: bool = False) -> None:
        if not isinstance(inner, StoreDriver):
            raise TypeError(f"FaultyDriver wraps a StoreDriver, got {type(inner).__name__}")
        self.inner = inner
        self.faults: tuple[Fault, ...] = tuple(faults)
        for fault in self.faults:
            if not isinstance(fault, (FailCall, FailKeys, Decline, Evict, Block, Slow)):
                raise TypeError(f"not a fault record: {fault!r}")
        self.memory_kinds = inner.memory_kinds
        self.max_batch_keys = inner.max_batch_keys
        self.chunks_at_once = inner.chunks_at_once
        self._owns_inner = owns_inner
        self._cond = threading.Condition()
        self._calls: Counter[str] = Counter()
        self._blocked = 0

    # -- observing -----------------------------------------------------------------------------

    @property
    def calls(self) -> Mapping[str, int]:
        """How many calls of each operation have arrived so far."""
        with self._cond:
            return {op: self._calls[op] for op in OPS}

    @property
    def blocked(self) -> int:
        """How many calls are waiting inside a :class:`Block` now."""
        return self._blocked

    def wait_blocked(self, count: int = 1, timeout_s: float = 5.0) -> bool:
        """Wait until at least ``count`` calls are stuck in a :class:`Block`; false on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: self._blocked >= count, timeout=timeout_s)

    def release_all(self) -> None:
        """Set the release event of every :class:`Block` in the schedule."""
        for fault in self.faults:
            if isinstance(fault, Block):
                fault.release.set()

    # -- the driver ----------------------------------------------------------------------------

    def register(self, regions: Sequence[SlotRegion]) -> None:
        self.inner.register(regions)

    def unregister(self, regions: Sequence[SlotRegion]) -> None:
        self.inner.unregister(regions)

    def put(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        return self._batch("put", self.inner.put, keys, addresses, sizes)

    def get_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        return self._batch("get", self.inner.get_into, keys, addresses, sizes)

    def put_parts(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        """The inner driver's own parts call where it has one, counted and faulted as a
        ``"put"``; else the bounce through :meth:`put` (which counts and faults each put)."""
        if not overrides_parts(self.inner):
            return super().put_parts(keys, addresses, sizes)
        return self._batch("put", self.inner.put_parts, keys, addresses, sizes, parts=True)

    def get_parts_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        """As :meth:`put_parts`, for reads (a ``"get"``)."""
        if not overrides_parts(self.inner):
            return super().get_parts_into(keys, addresses, sizes)
        return self._batch("get", self.inner.get_parts_into, keys, addresses, sizes, parts=True)

    @property
    def offers_parts(self) -> bool:
        return self.inner.offers_parts

    def remove(self, keys: Sequence[str]) -> BatchResult:
        return self._batch("remove", lambda k, _a, _s: self.inner.remove(k), keys, None, None)

    def exists(self, keys: Sequence[str]) -> np.ndarray:
        faults = self._arrive("exists", keys)
        answer = np.zeros(len(keys), dtype=bool)
        whole = next((f for f in faults if isinstance(f, FailCall)), None)
        if whole is not None:
            if whole.raises:
                raise RuntimeError(whole.reason)
            return answer
        passed = np.ones(len(keys), dtype=bool)
        for fault in faults:
            if isinstance(fault, FailKeys):
                passed[fault.start:fault.stop] = False
        idx = np.flatnonzero(passed)
        if idx.size:
            answer[idx] = self.inner.exists([keys[i] for i in idx.tolist()])
        return answer

    def contains(self, keys: Sequence[str]) -> BatchResult:
        """The inner driver's ``contains`` (L1), counted and faulted as an ``"exists"`` call: a
        failed key answers ``FAILED`` (a lookup fault, never "not held")."""
        return self._batch("exists", lambda k, _a, _s: self.inner.contains(k), keys, None, None)

    @property
    def offers_contains(self) -> bool:
        return self.inner.offers_contains

    def close(self) -> None:
        self.release_all()
        if self._owns_inner:
            self.inner.close()

    # -- how faults apply ----------------------------------------------------------------------

    def _arrive(self, op: str, keys: Sequence[str]) -> list[Fault]:
        """Count the call, then apply the faults that act before the inner driver: slow down,
        block, evict. Returns the faults that hit this call."""
        with self._cond:
            self._calls[op] += 1
            number = self._calls[op]
        faults = [f for f in self.faults if f.op == op and (f.call is None or f.call == number)]
        for fault in faults:
            if isinstance(fault, Slow) and fault.delay_s:
                time.sleep(fault.delay_s)
        for fault in faults:
            if isinstance(fault, Block):
                with self._cond:
                    self._blocked += 1
                    self._cond.notify_all()
                try:
                    fault.release.wait()
                finally:
                    with self._cond:
                        self._blocked -= 1
        for fault in faults:
            if isinstance(fault, Evict):
                doomed = list(keys[fault.start:fault.stop])
                if doomed:
                    self.inner.remove(doomed)
        return faults

    def _batch(self, op: str, call, keys: Sequence[str], addresses: np.ndarray | None,  # type: ignore[no-untyped-def]
               sizes: np.ndarray | None, *, parts: bool = False) -> BatchResult:
        faults = self._arrive(op, keys)
        n = len(keys)
        whole = next((f for f in faults if isinstance(f, FailCall)), None)
        if whole is not None:
            if whole.raises:
                raise RuntimeError(whole.reason)
            return BatchResult.uniform(n, KeyStatus.FAILED, whole.reason)
        status = np.full(n, 255, dtype=np.uint8)  # 255: not injected, ask the inner driver
        why = [""] * n
        for fault in faults:
            if isinstance(fault, (FailKeys, Decline)):
                code = KeyStatus.FAILED if isinstance(fault, FailKeys) else KeyStatus.DECLINED
                hit = np.zeros(n, dtype=bool)
                hit[fault.start:fault.stop] = True
                hit &= status == 255
                status[hit] = int(code)
                for i in np.flatnonzero(hit).tolist():
                    why[i] = fault.reason
        reasons = {i: why[i] for i in range(n) if why[i]}
        idx = np.flatnonzero(status == 255)
        if idx.size:
            sub_keys = [keys[i] for i in idx.tolist()]
            if addresses is None or sizes is None:
                inner = call(sub_keys, None, None)
            else:
                # a parts call's sizes are its parts', the same for every key
                inner = call(sub_keys, np.asarray(addresses)[idx], np.asarray(sizes) if parts else np.asarray(sizes)[idx])
            status[idx] = inner.status
            for j, text in inner.reasons.items():
                reasons[int(idx[j])] = text
        return BatchResult(status, reasons)

    def __repr__(self) -> str:
        return f"FaultyDriver({self.inner!r}, {len(self.faults)} faults)"
