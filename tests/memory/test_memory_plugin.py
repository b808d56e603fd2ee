"""The ``memory`` plugin as a user meets it: found by the registry, configured by options,
two workers of one process sharing a store by name."""

from __future__ import annotations

import threading

import kvwire_memory
import numpy as np
import pytest

from kvwire.contract import CacheKind, Hint, LayerGroupRows, MemoryKind, SlotRegion, TokenRange, View
from kvwire.registry import ConfigError, Plugin, load, load_config

STORE = Hint.of("store")


def rows(array: np.ndarray, ids: list[int]) -> tuple[SlotRegion, View]:
    region = SlotRegion(0, array.ctypes.data, array.shape[1], array.shape[0], MemoryKind.HOST)
    names = np.zeros((len(ids), 8), dtype=np.uint8)
    names[:, 0] = ids
    group = LayerGroupRows(0, CacheKind.PAGED, region, np.arange(len(ids)), TokenRange(0, 16 * len(ids)), names)
    return region, View((group,))


def move(backend, op: str, array: np.ndarray, ids: list[int]):  # type: ignore[no-untyped-def]
    region, view = rows(array, ids)
    done = threading.Event()
    with backend.register_regions([region]):
        attempt = getattr(backend, op)(view, STORE, done.set)
        while not (attempt.poll() is not None and attempt.quiesced()):
            assert done.wait(5.0), "no wake within 5 s"  # W1: a wake follows every change
            done.clear()
        return attempt.poll()


def test_the_registry_finds_the_plugin_by_its_entry_point():
    plugin = load("memory")
    assert isinstance(plugin, Plugin) and plugin is kvwire_memory.plugin
    assert plugin.contract_version[0] == 1
    assert {o.name for o in plugin.options} == {
        "capacity_bytes", "eviction", "timeout_s", "max_in_flight", "namespace", "store", "copy_threads"}


def test_the_device_plugin_is_its_own_entry_and_declares_device_memory():
    # B4.3: what a plugin declares, every backend it builds declares; so CUDA rows get a plugin
    plugin = load("memory-device")
    assert plugin is kvwire_memory.device_plugin
    assert plugin.capabilities.memory_kinds == frozenset({MemoryKind.HOST, MemoryKind.DEVICE})
    assert {o.name for o in plugin.options} == {o.name for o in load("memory").options}
    assert plugin.option("store").default != load("memory").option("store").default
    assert MemoryKind.DEVICE not in load("memory").capabilities.memory_kinds


def test_the_memory_plugin_refuses_the_old_device_option_naming_it(store_name):
    with pytest.raises(ConfigError, match="device"):
        load("memory").build({"store": store_name, "device": True})


def test_declared_capabilities_equal_what_the_backend_returns(store_name):
    plugin = load("memory")
    backend = plugin.build({"store": store_name})
    try:
        assert backend.capabilities() == plugin.capabilities
        caps = plugin.capabilities
        assert caps.fetch and caps.publish and caps.content_addressed and caps.cancellation
        assert caps.memory_kinds == frozenset({MemoryKind.HOST})
    finally:
        backend.close()


@pytest.mark.parametrize("options,named", [
    ({"capacity": 10}, "capacity"),
    ({"capacity_bytes": "lots"}, "capacity_bytes"),
    ({"capacity_bytes": 0}, "capacity_bytes"),
    ({"eviction": "sometimes"}, "eviction"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"max_in_flight": 0}, "max_in_flight"),
    ({"namespace": "has space"}, "namespace"),
    ({"copy_threads": 0}, "copy_threads"),
    ({"copy_threads": 65}, "copy_threads"),
    ({"copy_threads": "many"}, "copy_threads"),
    ({"copy_threads": 2.5}, "copy_threads"),
    ({"copy_threads": True}, "copy_threads"),
])
def test_a_bad_option_is_a_config_error_naming_it(options, named):
    with pytest.raises(ConfigError, match=named):
        load("memory").build(options)


def test_a_store_name_reused_with_other_settings_is_a_config_error(store_name):
    plugin = load("memory")
    backend = plugin.build({"store": store_name, "capacity_bytes": 1000})
    try:
        with pytest.raises(ConfigError, match="store.*capacity_bytes=1000"):
            plugin.build({"store": store_name, "capacity_bytes": 2000})
        with pytest.raises(ConfigError, match="eviction"):
            plugin.build({"store": store_name, "capacity_bytes": 1000, "eviction": False})
    finally:
        backend.close()


def test_options_come_from_the_environment_too(store_name):
    config = load_config(environ={"KVWIRE_BACKEND": "memory", "KVWIRE_BACKEND_STORE": store_name,
                                  "KVWIRE_BACKEND_MAX_IN_FLIGHT": "8"})
    backend = config.build()
    try:
        assert backend.capabilities().max_in_flight == 8
    finally:
        backend.close()


def test_two_backends_naming_one_store_share_it_and_other_stores_do_not(store_name):
    plugin = load("memory")
    writer = plugin.build({"store": store_name})
    reader = plugin.build({"store": store_name})
    stranger = plugin.build({"store": store_name + "-other"})
    try:
        src = np.random.default_rng(1).integers(0, 256, (3, 512), dtype=np.uint8)
        dst, elsewhere = np.zeros_like(src), np.zeros_like(src)
        assert move(writer, "publish", src, [1, 2, 3]).masks[0].all()
        got = move(reader, "fetch", dst, [1, 2, 3])
        assert got.is_delivered and got.masks[0].all()
        np.testing.assert_array_equal(dst, src)
        miss = move(stranger, "fetch", elsewhere, [1, 2, 3])
        assert miss.is_delivered and not miss.masks[0].any()
    finally:
        for backend in (writer, reader, stranger):
            backend.close()
        kvwire_memory.forget_store(store_name + "-other")


def test_with_eviction_the_oldest_objects_make_room(store_name):
    backend = load("memory").build({"store": store_name, "capacity_bytes": 2 * 256})
    try:
        for ids in ([1], [2], [3]):
            assert move(backend, "publish", np.full((1, 256), ids[0], dtype=np.uint8), ids).masks[0].all()
        dst = np.zeros((3, 256), dtype=np.uint8)
        got = move(backend, "fetch", dst, [1, 2, 3])
        np.testing.assert_array_equal(got.masks[0], [False, True, True])
        np.testing.assert_array_equal(dst[1:, 0], [2, 3])
    finally:
        backend.close()


def test_without_eviction_a_full_store_declines(store_name):
    backend = load("memory").build({"store": store_name, "capacity_bytes": 2 * 256, "eviction": False})
    try:
        src = np.ones((3, 256), dtype=np.uint8)
        sent = move(backend, "publish", src, [1, 2, 3])
        assert sent.is_delivered
        np.testing.assert_array_equal(sent.masks[0], [True, True, False])
    finally:
        backend.close()


def test_closing_a_backend_keeps_the_process_store(store_name):
    plugin = load("memory")
    first = plugin.build({"store": store_name})
    move(first, "publish", np.full((1, 64), 7, dtype=np.uint8), [9])
    first.close()
    second = plugin.build({"store": store_name})
    try:
        dst = np.zeros((1, 64), dtype=np.uint8)
        assert move(second, "fetch", dst, [9]).masks[0].all() and (dst == 7).all()
    finally:
        second.close()
