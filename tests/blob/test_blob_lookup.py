"""The blob backend's lookup (L1) at the driver boundary: it asks exactly the keys a fetch would
read; a store fault, a driver that raises or answers nonsense, and a passed deadline are
``LookupFailed``; a driver without ``contains`` means the protocol is not declared."""

from __future__ import annotations

import threading
from collections.abc import Sequence

import numpy as np
import pytest
from blobkit import names
from kvwire_memory import MemoryDriver

from kvwire.blob import BatchResult, KeyStatus, StoreDriver, store_keys
from kvwire.contract import LOOKUP, Hint, InvalidSubmission, Lookup, LookupFailed, SubmissionRejected
from kvwire.contract.errors import SubmissionError

HINT = Hint.of("store")


class Answering(MemoryDriver):
    """A memory driver whose ``contains`` answers what the test sets, and records the keys."""

    def __init__(self, store, answer=None, raises=None, gate=None) -> None:  # type: ignore[no-untyped-def]
        super().__init__(store)
        self.answer = answer
        self.raises = raises
        self.gate = gate
        self.asked: list[list[str]] = []

    def contains(self, keys: Sequence[str]) -> BatchResult:
        self.asked.append(list(keys))
        if self.gate is not None:
            self.gate.wait()
        if self.raises is not None:
            raise self.raises
        return self.answer(keys) if self.answer is not None else super().contains(keys)


class NoContains(StoreDriver):
    """A driver that does not offer contains (like a third party's that predates lookup)."""

    def __init__(self, inner: StoreDriver) -> None:
        self.inner = inner

    def put(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
        return self.inner.put(keys, addresses, sizes)

    def get_into(self, keys, addresses, sizes):  # type: ignore[no-untyped-def]
        return self.inner.get_into(keys, addresses, sizes)

    def exists(self, keys):  # type: ignore[no-untyped-def]
        return self.inner.exists(keys)

    def remove(self, keys):  # type: ignore[no-untyped-def]
        return self.inner.remove(keys)


def test_lookup_asks_the_keys_a_fetch_would_read(store, make_backend) -> None:  # type: ignore[no-untyped-def]
    driver = Answering(store)
    backend = make_backend(driver, namespace="ns-a")
    asked = names([1, 2, 3])
    store.insert(store_keys("ns-a", 0, asked[:2])[0], b"x")
    store.insert(store_keys("ns-a", 5, asked[:2])[0], b"x")
    store.insert(store_keys("ns-a", 5, asked[:2])[1], b"x")
    assert backend.lookup([0, 5], asked, HINT).tolist() == [True, False, False]
    assert driver.asked[-1] == store_keys("ns-a", 0, asked) + store_keys("ns-a", 5, asked)
    assert backend.lookup([5], asked, Hint.of("store", namespace="ns-b")).tolist() == [False] * 3
    assert driver.asked[-1] == store_keys("ns-b", 5, asked)
    assert backend.lookup([5, 5], asked, HINT).tolist() == [True, True, False]
    assert len(driver.asked[-1]) == 3, "a group listed twice is asked about once"


def test_an_empty_lookup_asks_nothing(store, make_backend) -> None:  # type: ignore[no-untyped-def]
    driver = Answering(store)
    backend = make_backend(driver)
    answer = backend.lookup([0], np.zeros((0, 16), np.uint8), HINT)
    assert answer.shape == (0,) and answer.dtype == np.bool_ and not driver.asked


@pytest.mark.parametrize("answer, needle", [
    (lambda keys: BatchResult.uniform(len(keys), KeyStatus.FAILED, "the disk caught fire"), "the disk caught fire"),
    (lambda keys: BatchResult.uniform(len(keys), KeyStatus.BUSY), "BUSY"),
    (lambda keys: BatchResult.ok(len(keys) + 1), "statuses"),
    (lambda keys: [True] * len(keys), "not a BatchResult"),
])
def test_a_store_fault_or_a_nonsense_answer_is_lookup_failed(store, make_backend, answer, needle) -> None:  # type: ignore[no-untyped-def]
    backend = make_backend(Answering(store, answer=answer))
    with pytest.raises(LookupFailed, match=needle) as info:
        backend.lookup([0], names([1, 2]), HINT)
    assert not isinstance(info.value, SubmissionError), "LookupFailed is not a SubmissionError"


def test_a_driver_that_raises_is_lookup_failed_and_the_next_lookup_works(store, make_backend) -> None:  # type: ignore[no-untyped-def]
    driver = Answering(store, raises=OSError("connection reset"))
    backend = make_backend(driver)
    with pytest.raises(LookupFailed, match="raised OSError during a lookup: connection reset"):
        backend.lookup([0], names([1]), HINT)
    driver.raises = None
    assert backend.lookup([0], names([1]), HINT).tolist() == [False]


def test_the_deadline_comes_from_the_argument_the_hint_or_the_options(store, make_backend) -> None:  # type: ignore[no-untyped-def]
    gate = threading.Event()
    driver = Answering(store, gate=gate)
    backend = make_backend(driver, timeout_s=0.2)
    try:
        for hint, timeout in ((HINT, 0.1), (Hint.of("store", timeout_s=0.1), None), (HINT, None)):
            with pytest.raises(LookupFailed, match="deadline passed"):
                backend.lookup([0], names([1]), hint, timeout)
    finally:
        gate.set()
    assert backend.lookup([0], names([1]), HINT).tolist() == [False], "once the store answers, lookups answer"


def test_a_driver_without_contains_declares_no_lookup(store, make_backend) -> None:  # type: ignore[no-untyped-def]
    backend = make_backend(NoContains(MemoryDriver(store)))
    assert LOOKUP not in backend.capabilities().protocols
    assert isinstance(backend, Lookup)
    with pytest.raises(InvalidSubmission, match="does not declare 'lookup'"):
        backend.lookup([0], names([1]), HINT)
    declared = make_backend(MemoryDriver(store))
    assert LOOKUP in declared.capabilities().protocols


def test_after_shutdown_a_lookup_is_rejected(store, make_backend) -> None:  # type: ignore[no-untyped-def]
    backend = make_backend(MemoryDriver(store))
    assert not backend.shutdown()
    with pytest.raises(SubmissionRejected):
        backend.lookup([0], names([1]), HINT)
