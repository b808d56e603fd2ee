"""The one-sided mode's transport: a NIXL agent (UCX backend; ``DRAM`` segments for host
regions, ``VRAM`` for device ones) that registers this backend's regions and reads rows straight
out of a peer's registered memory.

Only the opt-in ``mode="one-sided"`` loads it (``pip install 'kvwire-ucx[nixl]'``, which brings
``nixl-cu12==1.5.1``). Every call into the agent goes through one lock: the holder's thread
registers regions while the engine thread reads. Descriptor lists are built from numpy arrays
here, never with NIXL's own (pickle-based) descriptor serialization.

Measured behaviour this relies on (nixl-cu12 1.5.1, its bundled UCX 1.23, loopback):

- a ``READ`` of registered host memory goes through cma zero-copy and usually completes inside
  ``transfer()``; the target does not take part, except that NIXL's connection wire-up needs the
  target agent progressed (``get_new_notifs``) once;
- a remote address outside the peer's registered regions is refused when the transfer is
  created (``NIXL_ERR_NOT_FOUND``): a reader reaches only what the other end registered;
- a peer that dies mid-transfer makes ``transfer``/``check_xfer_state`` raise
  ``nixlRemoteDisconnectError`` within milliseconds;
- a process that made a UCX-backend agent segfaults at exit unless ``UCX_MODULES=^ib``, which is
  set here when it is unset and the host has no InfiniBand devices."""

from __future__ import annotations

import importlib
import importlib.util
import os
import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvwire.contract import MemoryKind, SlotRegion
from kvwire_ucx.cuda import CudaError, make_current

__all__ = ["NixlAgent", "NixlError", "nixl_problem", "INSTALL_HINT"]

INSTALL_HINT = "pip install 'kvwire-ucx[nixl]' (nixl-cu12==1.5.1; on a CPU-only host add --no-deps and numpy)"
_MODULES = ("nixl_cu12", "nixl_cu13", "nixl")


class NixlError(RuntimeError):
    """A NIXL call failed; the message names the call and NIXL's error."""


def nixl_problem() -> str | None:
    """Why NIXL cannot be loaded here, or ``None``; imports nothing heavy."""
    for name in _MODULES:
        try:
            if importlib.util.find_spec(name) is not None:
                return None
        except (ImportError, ValueError):
            continue
    return f"the one-sided mode needs NIXL, which is not installed: {INSTALL_HINT}"


def _api() -> Any:
    problem = nixl_problem()
    if problem is not None:
        raise NixlError(problem)
    if "UCX_MODULES" not in os.environ and not _has_infiniband():
        os.environ["UCX_MODULES"] = "^ib"  # else the UCX backend's agent crashes the process at exit
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    os.environ.setdefault("UCX_MEMTYPE_CACHE", "n")  # else GPU memory torch allocated reads as host (kvwire_ucx.cuda)
    for name in _MODULES:
        try:
            return importlib.import_module(f"{name}._api")
        except ImportError:
            continue
    raise NixlError(f"NIXL is installed but none of {', '.join(_MODULES)} imports")


def _has_infiniband() -> bool:
    try:
        return bool(os.listdir("/sys/class/infiniband"))
    except OSError:
        return False


class NixlAgent:
    """One backend's NIXL agent. ``name`` must be unique among the agents that will meet."""

    def __init__(self, name: str, *, loopback: bool) -> None:
        api = _api()
        self.name = name
        self._lock = threading.Lock()
        try:
            agent = api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=False, backends=[]))
            agent.create_backend("UCX", {"ucx_devices": "lo"} if loopback else {})
        except Exception as exc:
            raise NixlError(f"creating NIXL agent {name!r} with the UCX backend failed: {_what(exc)}") from None
        self._agent = agent
        self._generation = 0
        self._metadata: bytes | None = None
        self._peers: dict[bytes, int] = {}  # remote agent name -> generation of its metadata loaded

    # ------------------------------------------------------------ registration (holder thread)

    def register(self, regions: Sequence[SlotRegion]) -> list[Any]:
        """Register regions with the agent (host ones as ``DRAM``, device ones as ``VRAM``); the
        handles for :meth:`deregister`. A refused batch leaves nothing registered."""
        host = [(r.base, r.nbytes, 0, "") for r in regions if r.memory_kind is MemoryKind.HOST]
        device = [(r.base, r.nbytes, r.device or 0, "") for r in regions if r.memory_kind is MemoryKind.DEVICE]
        if device:
            _current(device[0][2])
        handles: list[Any] = []
        with self._lock:
            try:
                for descs, memory in ((host, "DRAM"), (device, "VRAM")):
                    if descs:
                        handles.append(self._agent.register_memory(descs, memory))
            except Exception as exc:
                for handle in handles:
                    self._agent.deregister_memory(handle)
                raise NixlError(f"NIXL could not register {len(host)} host and {len(device)} device region(s): "
                                f"{_what(exc)}") from None
            finally:
                self._generation += 1
                self._metadata = None
        return handles

    def deregister(self, handles: list[Any]) -> None:
        with self._lock:
            try:
                for handle in handles:
                    self._agent.deregister_memory(handle)
            finally:
                self._generation += 1
                self._metadata = None

    # ------------------------------------------------------------ serving side (engine thread)

    def metadata(self) -> tuple[int, bytes]:
        """This agent's metadata and its generation (which changes with every registration)."""
        with self._lock:
            if self._metadata is None:
                self._metadata = bytes(self._agent.get_agent_metadata())
            return self._generation, self._metadata

    def progress(self) -> None:
        """Let NIXL answer a peer's connection wire-up (it has no fd to wake on)."""
        with self._lock:
            try:
                self._agent.get_new_notifs()
            except Exception:
                pass  # a notification from a dying peer; its transfers fail on their side

    # ------------------------------------------------------------ reading side (engine thread)

    def knows(self, peer: bytes, generation: int) -> bool:
        return self._peers.get(peer) == generation

    def generation_of(self, peer: bytes) -> int | None:
        """The generation of ``peer``'s metadata loaded here, or ``None``."""
        return self._peers.get(peer)

    def load_peer(self, peer: bytes, generation: int, metadata: bytes) -> None:
        """Load (or refresh) a peer agent's metadata; it must name ``peer``."""
        with self._lock:
            try:
                loaded = self._agent.add_remote_agent(metadata)
            except Exception as exc:
                raise NixlError(f"NIXL refused the metadata of agent {peer!r}: {_what(exc)}") from None
            loaded = loaded.encode() if isinstance(loaded, str) else bytes(loaded)
            if loaded != peer:
                try:
                    self._agent.remove_remote_agent(loaded)
                except Exception:
                    pass
                raise NixlError(f"the metadata sent for agent {peer!r} is that of agent {loaded!r}")
            self._peers[peer] = generation

    def forget_peer(self, peer: bytes) -> None:
        with self._lock:
            if self._peers.pop(peer, None) is None:
                return
            try:
                self._agent.remove_remote_agent(peer.decode())
            except Exception:
                pass

    def read(self, local: np.ndarray, remote: np.ndarray, peer: bytes, memories: tuple[int, int] = (-1, -1)
             ) -> tuple[Any, bool]:
        """Start reading ``remote`` rows of ``peer`` into ``local`` rows (each an ``(n, 3)``
        uint64 array of address, length, device), which lie in ``memories`` (here, there: -1
        host, else the CUDA device); returns the transfer handle and whether it is done already.
        Raises :class:`NixlError` if it could not start or failed."""
        here, there = memories
        if here >= 0:
            _current(here)
        with self._lock:
            try:
                handle = self._agent.initialize_xfer(
                    "READ", self._agent.get_xfer_descs(local, "VRAM" if here >= 0 else "DRAM"),
                    self._agent.get_xfer_descs(remote, "VRAM" if there >= 0 else "DRAM"), peer.decode(), b"")
            except Exception as exc:
                raise NixlError(f"NIXL could not set up a read of {len(remote)} span(s) from {peer!r}: "
                                f"{_what(exc)}") from None
            try:
                state = self._agent.transfer(handle)
            except Exception as exc:
                self._release_locked(handle)
                raise NixlError(f"reading from {peer!r} failed: {_what(exc)}") from None
            if state == "ERR":
                self._release_locked(handle)
                raise NixlError(f"reading from {peer!r} failed (NIXL state ERR)")
            return handle, state == "DONE"

    def done(self, handle: Any) -> bool:
        """Whether the read finished; raises :class:`NixlError` if it failed."""
        with self._lock:
            try:
                state = self._agent.check_xfer_state(handle)
            except Exception as exc:
                raise NixlError(f"a read failed: {_what(exc)}") from None
        if state == "ERR":
            raise NixlError("a read failed (NIXL state ERR)")
        return state == "DONE"

    def release(self, handle: Any) -> bool:
        """Release a transfer handle, cancelling the transfer if it still runs; whether that
        worked (if not, the transfer is still running: try again later)."""
        with self._lock:
            return self._release_locked(handle)

    def _release_locked(self, handle: Any) -> bool:
        try:
            self._agent.release_xfer_handle(handle)
        except Exception:
            return False
        return True

    def close(self) -> None:
        """Forget every peer (the agent itself goes with the last reference)."""
        for peer in list(self._peers):
            self.forget_peer(peer)


def _current(device: int) -> None:
    try:
        make_current(device)
    except CudaError as exc:
        raise NixlError(f"NIXL's UCX copies device rows in a CUDA context, and making device {device}'s current "
                        f"failed: {exc}") from None


def _what(exc: BaseException) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def coalesce(local: np.ndarray, remote: np.ndarray, sizes: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Merge rows that are adjacent both here and there into single spans: ``local`` and
    ``remote`` are row addresses (uint64), ``sizes`` their lengths, all in transfer order.
    Returns the ``(n, 3)`` local and remote descriptor arrays."""
    n = len(local)
    if n == 0:
        empty = np.zeros((0, 3), dtype=np.uint64)
        return empty, empty.copy()
    local = local.astype(np.uint64, copy=False)
    remote = remote.astype(np.uint64, copy=False)
    sizes = sizes.astype(np.uint64, copy=False)
    follows = (local[1:] == local[:-1] + sizes[:-1]) & (remote[1:] == remote[:-1] + sizes[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~follows)))
    lengths = np.add.reduceat(sizes, starts)
    out_local = np.zeros((len(starts), 3), dtype=np.uint64)
    out_remote = np.zeros((len(starts), 3), dtype=np.uint64)
    out_local[:, 0], out_local[:, 1] = local[starts], lengths
    out_remote[:, 0], out_remote[:, 1] = remote[starts], lengths
    return out_local, out_remote
