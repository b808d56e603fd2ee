"""The ``mooncake`` plugin as a user builds it (``kvwire.registry.load("mooncake").build(...)``),
against a real master: publish on one backend, fetch on another, in another process, and what a
user sees when objects vanish, space runs out, or the master dies."""

from __future__ import annotations

import hashlib
import json
import multiprocessing
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
from kvwire_mooncake.master import MasterProcess
from mooncake_support import (
    DEAD_MASTER_BOUND_S,
    Rows,
    fetch_in_child,
    names_for,
    until_serving,
    view_of,
    wait_for,
)

from kvwire.blob import BlobBackend, KeyStatus, store_keys
from kvwire.contract import Attempt, Hint, Outcome
from kvwire.registry import ConfigError, load

pytestmark = pytest.mark.usefixtures("mooncake_ready")

ROW = 128 << 10
HINT = Hint.of("store", namespace="backend-tests")


def build(master: str, **options: Any) -> BlobBackend:
    backend = load("mooncake").build({"master": master, "segment_bytes": 64 << 20, "setup_retries": 1,
                                      "timeout_s": 10.0, **options})
    assert isinstance(backend, BlobBackend)
    return backend


class Finished:
    """An attempt driven to its end: the outcome, and when it concluded and quiesced."""

    def __init__(self, submit: Callable[[Callable[[], None]], Attempt], limit_s: float) -> None:
        woken = threading.Event()
        began = time.monotonic()
        self.attempt = submit(woken.set)
        self.concluded_s = self.quiesced_s = float("inf")
        deadline = began + limit_s
        while time.monotonic() < deadline:
            if self.attempt.poll() is not None and self.concluded_s == float("inf"):
                self.concluded_s = time.monotonic() - began
            if self.attempt.quiesced() and self.quiesced_s == float("inf"):
                self.quiesced_s = time.monotonic() - began
            if self.concluded_s < float("inf") and self.quiesced_s < float("inf"):
                break
            woken.wait(0.05)
            woken.clear()
        outcome = self.attempt.poll()
        assert outcome is not None, f"the attempt did not conclude within {limit_s:g} s"
        assert self.attempt.quiesced(), f"the attempt did not quiesce within {limit_s:g} s"
        self.outcome: Outcome = outcome


def publish(backend: BlobBackend, rows: Rows, names: np.ndarray, limit_s: float = 15.0) -> Finished:
    return Finished(lambda wake: backend.publish(view_of(rows, names), HINT, wake), limit_s)


def fetch(backend: BlobBackend, rows: Rows, names: np.ndarray, limit_s: float = 15.0) -> Finished:
    return Finished(lambda wake: backend.fetch(view_of(rows, names), HINT, wake), limit_s)


@pytest.fixture(scope="session")
def writer(master: MasterProcess) -> Iterator[BlobBackend]:
    backend = build(master.address)
    yield backend
    backend.close()


@pytest.fixture(scope="session")
def reader(master: MasterProcess) -> Iterator[BlobBackend]:
    backend = build(master.address)
    yield backend
    backend.close()


@pytest.fixture
def registered(request: pytest.FixtureRequest) -> Callable[[BlobBackend, int, int], Rows]:
    def make(backend: BlobBackend, slot_bytes: int, slot_count: int) -> Rows:
        rows = Rows(slot_bytes, slot_count)
        registration = backend.register_regions([rows.region])
        request.addfinalizer(registration.close)
        return rows

    return make


def test_rows_published_by_one_backend_are_fetched_by_another(
        writer: BlobBackend, reader: BlobBackend, registered: Callable[[BlobBackend, int, int], Rows]) -> None:
    src, dst = registered(writer, ROW, 6), registered(reader, ROW, 6)
    expected = src.fill_random(11)
    names = names_for(6)

    published = publish(writer, src, names)
    assert published.outcome.is_delivered and published.outcome.masks[0].all()
    fetched = fetch(reader, dst, names)

    assert fetched.outcome.is_delivered and fetched.outcome.masks[0].all()
    assert np.array_equal(dst.array, expected)


def test_a_submission_of_many_small_rows_moves_whole_within_its_deadline(
        writer: BlobBackend, reader: BlobBackend, registered: Callable[[BlobBackend, int, int], Rows]) -> None:
    """32768 rows of 8 bytes in one publish and one fetch: every row moves, within the
    deadline. One client call of 8192 such rows overflowed Mooncake's transfer queue (about half
    the rows failed, and the call stayed inside the client past the deadline and its grace), so
    the driver declares max_batch_keys and the backend cuts chunks at it."""
    count = 32768
    src, dst = registered(writer, 8, count), registered(reader, 8, count)
    expected = src.fill_random(13)
    names = names_for(count)
    published = publish(writer, src, names, limit_s=10.0)
    assert published.outcome.is_delivered and published.outcome.masks[0].all(), published.outcome
    fetched = fetch(reader, dst, names, limit_s=10.0)
    assert fetched.outcome.is_delivered and fetched.outcome.masks[0].all(), fetched.outcome
    assert np.array_equal(dst.array, expected)


def test_a_submissions_store_calls_go_one_at_a_time(
        writer: BlobBackend, reader: BlobBackend, registered: Callable[[BlobBackend, int, int], Rows],
        monkeypatch: pytest.MonkeyPatch) -> None:
    """3000 rows in one publish and one fetch are three calls of at most max_batch_keys, which
    the client gets one after another (the driver's chunks_at_once), never two at once: two
    calls of one client at once moved a prompt's blocks at 0.6x the speed of one at a time.
    Each call waits a moment for a second to join it, so calls that could overlap do."""
    count = 3000
    src, dst = registered(writer, 8, count), registered(reader, 8, count)
    expected = src.fill_random(15)
    names = names_for(count)
    seen = {"inside": 0, "most": 0, "calls": 0}
    cond = threading.Condition()

    def counted(call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapped(*args: Any) -> Any:
            with cond:
                seen["inside"] += 1
                seen["calls"] += 1
                seen["most"] = max(seen["most"], seen["inside"])
                cond.notify_all()
                cond.wait_for(lambda: seen["inside"] >= 2, 0.1)
            try:
                return call(*args)
            finally:
                with cond:
                    seen["inside"] -= 1
        return wrapped

    monkeypatch.setattr(writer.driver, "put", counted(writer.driver.put))
    monkeypatch.setattr(reader.driver, "get_into", counted(reader.driver.get_into))
    published = publish(writer, src, names)
    assert published.outcome.is_delivered and published.outcome.masks[0].all(), published.outcome
    fetched = fetch(reader, dst, names)
    assert fetched.outcome.is_delivered and fetched.outcome.masks[0].all(), fetched.outcome
    assert np.array_equal(dst.array, expected)
    assert (seen["calls"], seen["most"]) == (6, 1), seen


def test_a_second_publish_of_the_same_names_is_held_not_failed(
        writer: BlobBackend, reader: BlobBackend, registered: Callable[[BlobBackend, int, int], Rows]) -> None:
    first, second, dst = registered(writer, ROW, 2), registered(writer, ROW, 2), registered(reader, ROW, 2)
    kept = first.fill_random(12)
    second.fill_random(13)
    names = names_for(2)
    assert publish(writer, first, names).outcome.is_delivered
    again = publish(writer, second, names)
    assert again.outcome.is_delivered and again.outcome.masks[0].all()
    assert fetch(reader, dst, names).outcome.masks[0].all()
    assert np.array_equal(dst.array, kept)


def test_a_fetch_in_another_process_reads_what_this_one_published(
        master: MasterProcess, writer: BlobBackend, registered: Callable[[BlobBackend, int, int], Rows]) -> None:
    src = registered(writer, ROW, 8)
    expected = src.fill_random(14)
    names = names_for(8)
    assert publish(writer, src, names).outcome.masks[0].all()
    missing = names_for(1)

    context = multiprocessing.get_context("spawn")  # a Mooncake client must not be forked
    parent_end, child_end = context.Pipe()
    child = context.Process(
        target=fetch_in_child,
        args=(child_end, master.address, HINT.to_bytes(), ROW, np.concatenate([names, missing]).tobytes()),
    )
    child.start()
    try:
        if not parent_end.poll(60):
            pytest.fail("the child process sent no answer within 60 s")
        answer = json.loads(parent_end.recv_bytes())
    finally:
        child.join(30)
        if child.is_alive():
            child.kill()
            child.join()
    assert child.exitcode == 0
    assert answer["status"] == "delivered", answer
    assert answer["mask"] == [True] * 8 + [False]
    assert answer["sha256"] == [hashlib.sha256(row.tobytes()).hexdigest() for row in expected]


def test_an_object_removed_before_the_fetch_is_a_miss_not_a_failure(
        writer: BlobBackend, reader: BlobBackend, registered: Callable[[BlobBackend, int, int], Rows]) -> None:
    src, dst = registered(writer, ROW, 4), registered(reader, ROW, 4)
    expected = src.fill_random(15)
    names = names_for(4)
    assert publish(writer, src, names).outcome.masks[0].all()
    gone = store_keys("backend-tests", 0, names[[1, 3]])
    wait_for(lambda: (writer.driver.remove(gone).status == KeyStatus.OK).all(), 5.0,
             "the store to let the objects be removed")

    fetched = fetch(reader, dst, names)

    assert fetched.outcome.is_delivered, fetched.outcome
    assert fetched.outcome.masks[0].tolist() == [True, False, True, False]
    assert np.array_equal(dst.array[[0, 2]], expected[[0, 2]])


def test_options_are_validated_before_anything_starts(master: MasterProcess) -> None:
    plugin = load("mooncake")
    for bad, match in (({"segment_bytes": 1 << 20}, "segment_bytes"), ({"master": "nowhere"}, "host:port"),
                       ({"protocol": "carrier-pigeon"}, "protocol"), ({"namespace": "/x"}, "namespace"),
                       ({"timeout_s": 0}, "timeout_s"), ({"colour": "blue"}, "colour")):
        with pytest.raises(ConfigError, match=match):
            plugin.build({"master": master.address, **bad})


# -- a store with little space ---------------------------------------------------------------


def test_a_publish_to_a_full_store_is_partly_declined_not_failed(
        registered: Callable[[BlobBackend, int, int], Rows]) -> None:
    # The only client of its master, with the smallest segment Mooncake takes (16 MiB).
    with MasterProcess(lease_ttl_ms=10_000) as small:
        backend = build(small.address, segment_bytes=16 << 20)
        try:
            src = registered(backend, 1 << 20, 24)
            expected = src.fill_random(16)
            names = names_for(24)
            published = publish(backend, src, names)
            held = published.outcome.masks[0]
            assert published.outcome.is_delivered, published.outcome
            assert held.any() and not held.all()
            dst = registered(backend, 1 << 20, 24)
            fetched = fetch(backend, dst, names)
            assert fetched.outcome.is_delivered
            found = fetched.outcome.masks[0]
            # Above its high watermark (90 %) the master evicts a share of the objects in the
            # background, so a row the store took may be gone by the fetch (seen under CPU
            # load); a row it declined must never be found, and what is found is byte-exact.
            assert found.any() and not (found & ~held).any(), (found.tolist(), held.tolist())
            assert np.array_equal(dst.array[found], expected[found])
        finally:
            backend.close()


# -- a master that dies ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def fragile_backend(mooncake_ready: None) -> Iterator[tuple[MasterProcess, BlobBackend]]:
    master = MasterProcess().start()
    # Its segment at setup: the fixture probes the store with puts before any test registers.
    backend = build(master.address, segment_bytes=16 << 20, timeout_s=8.0, segment_when="setup")
    try:
        yield master, backend
    finally:
        if not master.running():
            master.start()  # a client whose master is gone takes ~11 s to close
        until_serving(backend.driver.client)  # type: ignore[attr-defined]
        backend.close()
        master.stop()


@pytest.fixture
def endangered(fragile_backend: tuple[MasterProcess, BlobBackend]) -> tuple[MasterProcess, BlobBackend]:
    master, backend = fragile_backend
    if not master.running():
        master.start()
    until_serving(backend.driver.client)  # type: ignore[attr-defined]
    return master, backend


def test_a_fetch_after_the_master_died_fails_within_its_deadline(
        endangered: tuple[MasterProcess, BlobBackend], registered: Callable[[BlobBackend, int, int], Rows]) -> None:
    master, backend = endangered
    dst = registered(backend, ROW, 4)
    master.kill()
    fetched = fetch(backend, dst, names_for(4))
    assert fetched.outcome.is_failed, fetched.outcome
    assert "-900" in (fetched.outcome.reason or ""), fetched.outcome.reason
    assert fetched.concluded_s < DEAD_MASTER_BOUND_S and fetched.quiesced_s < DEAD_MASTER_BOUND_S
    assert not fetched.outcome.masks[0].any()


def test_a_fetch_in_flight_when_the_master_dies_fails_at_once(
        endangered: tuple[MasterProcess, BlobBackend], registered: Callable[[BlobBackend, int, int], Rows]) -> None:
    master, backend = endangered
    dst = registered(backend, ROW, 4)
    driver = backend.driver

    def submit(wake: Callable[[], None]) -> Attempt:
        master.freeze()
        attempt = backend.fetch(view_of(dst, names_for(4)), HINT, wake)
        wait_for(lambda: driver.in_progress > 0, 5.0, "the fetch to be inside the Mooncake client")  # type: ignore[attr-defined]
        master.kill()
        return attempt

    fetched = Finished(submit, DEAD_MASTER_BOUND_S)
    assert fetched.outcome.is_failed, fetched.outcome
    assert "-900" in (fetched.outcome.reason or "") or "-901" in (fetched.outcome.reason or "")


def test_a_fetch_from_a_hung_master_fails_at_its_deadline_and_then_quiesces(
        endangered: tuple[MasterProcess, BlobBackend], registered: Callable[[BlobBackend, int, int], Rows]) -> None:
    master, backend = endangered
    dst = registered(backend, ROW, 2)
    master.freeze()
    try:
        fetched = Finished(
            lambda wake: backend.fetch(view_of(dst, names_for(2)), Hint.of("store", timeout_s=1.0), wake), 10.0)
    finally:
        master.kill()
    assert fetched.outcome.is_failed and "deadline" in (fetched.outcome.reason or ""), fetched.outcome
    assert 0.9 <= fetched.concluded_s < 2.0
    # The call inside the client returns at the RPC timeout (3 s here): then access has ended.
    assert fetched.quiesced_s < 3.0 + 2.0
