"""When a Mooncake client contributes its segment (option ``segment_when``): at setup, or at the
backend's first registration, so a backend that moves no rows (a vLLM scheduler's lookup-only
one) holds no objects."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import numpy as np
import pytest
from kvwire_mooncake.driver import MooncakeDriver
from kvwire_mooncake.master import MasterProcess
from kvwire_mooncake.options import ClientSettings
from mooncake_support import Rows

from kvwire.blob.driver import KeyStatus
from kvwire.registry import ConfigError, load

pytestmark = pytest.mark.usefixtures("mooncake_ready")

ROW = 64 << 10


@pytest.fixture
def lone_master(mooncake_ready: None) -> Iterator[MasterProcess]:
    """A master no other test's client contributes to: the segments here are these tests' own."""
    with MasterProcess(lease_ttl_ms=100) as master:
        yield master


def close_all(*drivers: MooncakeDriver) -> None:
    closers = [threading.Thread(target=d.close) for d in drivers]  # each close takes 1-2 s
    for closer in closers:
        closer.start()
    for closer in closers:
        closer.join()


def test_the_segment_is_contributed_at_the_first_registration(lone_master: MasterProcess) -> None:
    holder = MooncakeDriver.connect(ClientSettings(master=lone_master.address, segment_bytes=16 << 20,
                                                   segment_when="registered", setup_retries=1))
    writer = MooncakeDriver.connect(ClientSettings(master=lone_master.address, segment_bytes=0, setup_retries=1))
    try:
        src = Rows(ROW, 4)
        expected = src.fill_random(3)
        writer.register([src.region])
        assert holder.segment_pending
        before = writer.put(["early/0"], src.addresses()[:1], src.sizes()[:1])
        assert before.status.tolist() == [int(KeyStatus.DECLINED)]  # no segment anywhere: no space
        dst = Rows(ROW, 4)
        holder.register([dst.region])
        assert not holder.segment_pending
        names = [f"late/{i}" for i in range(4)]
        assert not writer.put(names, src.addresses(), src.sizes()).status.any()
        assert not holder.get_into(names, dst.addresses(), dst.sizes()).status.any()
        assert np.array_equal(dst.array, expected)
        more = Rows(ROW, 1)
        holder.register([more.region])  # a later registration mounts nothing more
        assert not holder.segment_pending
    finally:
        close_all(holder, writer)


def test_setup_contributes_at_once(lone_master: MasterProcess) -> None:
    holder = MooncakeDriver.connect(ClientSettings(master=lone_master.address, segment_bytes=16 << 20,
                                                   segment_when="setup", setup_retries=1))
    writer = MooncakeDriver.connect(ClientSettings(master=lone_master.address, segment_bytes=0, setup_retries=1))
    try:
        assert not holder.segment_pending
        src = Rows(ROW, 1)
        writer.register([src.region])
        assert not writer.put(["now/0"], src.addresses(), src.sizes()).status.any()
    finally:
        close_all(holder, writer)


def test_the_plugin_defers_the_segment_and_checks_the_option() -> None:
    plugin = load("mooncake")
    assert plugin.resolve({})["segment_when"] == "registered"
    with pytest.raises(ConfigError, match="segment_when"):
        plugin.resolve({"segment_when": "later"})
    with pytest.raises(ConfigError, match="segment_when"):
        ClientSettings(segment_when="later")
