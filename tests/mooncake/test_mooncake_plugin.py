"""The plugin as ``kvwire backends`` shows it, and the private master it can start."""

from __future__ import annotations

import os
import socket
from typing import Any

import pytest
from kvwire_mooncake import library, local_services
from kvwire_mooncake.master import MasterError, MasterProcess

from kvwire.registry import load, survey


def _row() -> Any:
    (row,) = [r for r in survey() if r.entry.name == "mooncake"]
    return row


@pytest.mark.parametrize(
    ("failure", "says"),
    [
        (ImportError("libibverbs.so.1: cannot open shared object file: No such file or directory"),
         "apt-get install -y libibverbs1 librdmacm1 libnuma1"),
        (ModuleNotFoundError("No module named 'mooncake'", name="mooncake"), "not installed"),
        (ImportError("libcudart.so.12: cannot open shared object file: No such file or directory"),
         "kvwire-mooncake[cpu]"),
    ],
    ids=["no-libibverbs", "not-installed", "cuda-build-without-cuda"],
)
def test_a_plugin_whose_library_cannot_load_is_listed_with_the_reason_and_the_fix(
        monkeypatch: pytest.MonkeyPatch, failure: ImportError, says: str) -> None:
    def refuse(name: str) -> object:
        raise failure

    monkeypatch.setattr(library.importlib, "import_module", refuse)
    row = _row()
    assert row.plugin is not None, "the plugin itself must still load"
    assert row.problem is not None and says in row.problem
    assert library.INSTALL_HINT in row.problem


def test_a_working_library_is_listed_without_a_problem(mooncake_ready: None) -> None:
    row = _row()
    assert row.problem is None
    assert row.plugin.capabilities == load("mooncake").capabilities


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as fh:
        return fh.read().split(")")[-1].split()[0] != "Z"


def test_a_private_master_serves_until_stopped_and_leaves_no_process(mooncake_ready: None) -> None:
    with MasterProcess() as master:
        pid = master.pid
        assert pid is not None and _alive(pid)
        with socket.create_connection(("127.0.0.1", master.rpc_port), timeout=2):
            pass
    assert not _alive(pid)
    assert master.stop() is not None  # idempotent


def test_a_master_that_cannot_bind_its_port_says_so_and_leaves_no_process(mooncake_ready: None) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        master = MasterProcess(metrics_port=taken.getsockname()[1])
        with pytest.raises(MasterError, match="exited"):
            master.start()
    assert not master.running()


def test_a_master_whose_rpc_port_is_taken_says_so_and_leaves_no_process(mooncake_ready: None) -> None:
    # The master answers /health before it binds its RPC port and exits after if that port is
    # taken: ready must mean the master itself listens there, not that something answers.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        master = MasterProcess(rpc_port=taken.getsockname()[1])
        with pytest.raises(MasterError, match="exited"):
            master.start()
    assert not master.running()


def test_a_master_whose_picked_port_was_taken_before_it_bound_starts_on_fresh_ports(
        mooncake_ready: None, monkeypatch: pytest.MonkeyPatch) -> None:
    # Another process may take a port between the pick and the master's bind (stop 52's CI: the
    # master exited, its address refused connections).
    import kvwire_mooncake.master as master_module
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        stolen = taken.getsockname()[1]
        picks = iter([stolen])
        real_pick = master_module.free_port
        monkeypatch.setattr(master_module, "free_port", lambda host="127.0.0.1": next(picks, None) or real_pick(host))
        with MasterProcess() as master:
            assert master.rpc_port != stolen
            with socket.create_connection(("127.0.0.1", master.rpc_port), timeout=2):
                pass
            pid = master.pid
    assert pid is not None and not _alive(pid)


def test_local_services_start_one_master_for_every_backend_built_inside(
        mooncake_ready: None, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("MOONCAKE_MASTER", raising=False)
    plugin = load("mooncake")
    with local_services(plugin.resolve({})) as extra:
        address = extra["master"]
        host, port = address.rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=2):
            pass
    with pytest.raises(OSError):
        socket.create_connection((host, int(port)), timeout=1).close()
    with local_services(plugin.resolve({"master": "10.0.0.1:50051"})) as extra:
        assert dict(extra) == {}


def test_the_raw_transfer_for_kvwire_bench_moves_the_rows(master: MasterProcess) -> None:
    plugin = load("mooncake")
    seconds = plugin.extra["raw_bench"](plugin.resolve({"master": master.address, "segment_bytes": 16 << 20}),
                                        64 << 10, 8, 1)
    assert 0 < seconds < 5
