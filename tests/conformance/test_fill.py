"""How the suite fills a store (``fill_until_full``, behind every store harness's ``Ends.fill``):
it ends full for a store that makes no room, whatever its capacity, per-object overhead and
largest object; and it gives up quickly, saying why, for a store that evicts while it is filled
(a Mooncake master whose objects' leases expire mid-fill made a CI run's fill of 3917-byte rows go
on for 15 minutes before this bound)."""

from __future__ import annotations

from collections import deque

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvwire.testing.harness import Unavailable
from kvwire.testing.stores import FILL_CHUNK, fill_until_full

LIMIT = 1 << 30


class Bounded:
    """A store that never makes room: ``capacity`` bytes, each object costing ``overhead`` more
    than its size, none bigger than ``largest``."""

    def __init__(self, capacity: int, overhead: int = 0, largest: int = 1 << 40) -> None:
        self.capacity, self.overhead, self.largest = capacity, overhead, largest
        self.used = self.taken = 0
        self.puts = 0

    def put(self, size: int) -> bool:
        self.puts += 1
        if size > self.largest or self.used + size + self.overhead > self.capacity:
            return False
        self.used += size + self.overhead
        self.taken += size
        return True


class Evicting(Bounded):
    """A bounded store that, once ``patience`` puts have been refused (its objects' leases ran
    out), drops its oldest objects to take each new one."""

    def __init__(self, capacity: int, patience: int, largest: int = 1 << 40) -> None:
        super().__init__(capacity, largest=largest)
        self.patience = patience
        self.refusals = 0
        self.objects: deque[int] = deque()

    def put(self, size: int) -> bool:
        if size <= self.largest and self.used + size > self.capacity and self.refusals >= self.patience:
            while self.objects and self.used + size > self.capacity:
                self.used -= self.objects.popleft()
        if super().put(size):
            self.objects.append(size)
            return True
        self.refusals += 1
        return False


@settings(max_examples=200, deadline=None)
@given(capacity=st.integers(1, 64 << 20), overhead=st.sampled_from([0, 16, 4096]),
       largest=st.sampled_from([1 << 40, FILL_CHUNK, 1 << 20, 5000]), row=st.sampled_from([64, 3917, 4096, 65536]))
def test_a_store_that_makes_no_room_ends_full_for_a_row(capacity: int, overhead: int, largest: int, row: int) -> None:
    store = Bounded(capacity, overhead, max(largest, row))
    stored = fill_until_full(store.put, row, LIMIT)
    assert stored == store.taken
    assert store.used + row + overhead > store.capacity, "the fill ended with room for another row"


def test_a_store_whose_largest_object_is_below_the_fill_chunk_is_filled_whole() -> None:
    # refusals of sizes it never took are its object limit, not a full store
    store = Bounded(capacity=48 << 20, largest=1 << 20)
    fill_until_full(store.put, 4096, LIMIT)
    assert store.used > (48 << 20) - 4096


@pytest.mark.parametrize("largest", [1 << 40, 1 << 20])
def test_a_store_that_evicts_as_it_fills_is_given_up_on_quickly_saying_so(largest: int) -> None:
    store = Evicting(capacity=32 << 20, patience=12, largest=largest)
    with pytest.raises(Unavailable, match="makes room as it fills"):
        fill_until_full(store.put, 3917, LIMIT)
    assert store.puts < 200, f"{store.puts} puts before giving up"


def test_a_store_that_never_refuses_has_no_bound() -> None:
    puts = []
    with pytest.raises(Unavailable, match="without refusing one"):
        fill_until_full(lambda size: puts.append(size) is None, 4096, 64 << 20)
    assert sum(puts) <= (64 << 20) + FILL_CHUNK
