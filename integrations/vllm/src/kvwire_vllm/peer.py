"""Request-free pulls between engines (contract N2, ``serve-pulls``): the pieces both halves of
the connector share.

- :func:`transceiver_state` / :func:`check_state`: the serving engine's transceiver state
  (kvwire's :class:`~kvwire.holding.TransceiverState`: opaque, versioned, bounded bytes,
  JSON inside, no pickle), and the pulling engine's checks of one against its own cache.
- :class:`Doorbell`: vLLM's engine core sleeps on its input queue when no request is in it,
  and the worker (which has the peer backend) is stepped only by the engine core. A pull that
  reaches an idle engine rings this doorbell: one datagram on a UNIX socket from the worker's
  backend thread to a thread in the engine-core process, which makes the connector report
  pending work (``has_pending_push_work``) and puts vLLM's own ``WAKEUP`` sentinel into the
  engine core's input queue, so the engine steps and the pull reaches the scheduler side."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import socket
import sys
import tempfile
import threading
import weakref
from collections.abc import Callable, Mapping
from types import FrameType
from typing import Any

from kvwire.contract.capabilities import OtherEnd
from kvwire.holding import StateError, TransceiverState

__all__ = ["transceiver_state", "check_state", "source_of", "Doorbell", "ring", "layout_digest", "find_engine_core",
           "SOURCE_KEY"]

log = logging.getLogger(f"vllm.{__name__}")

#: The key of a request's ``kv_transfer_params`` that carries the serving engine's state
#: (bytes, or their base64 text, as JSON carries them).
SOURCE_KEY = "kvwire_source"


def layout_digest(layout: Mapping[str, Any]) -> bytes:
    text = json.dumps({"v": "kvwire-vllm-layout/1", **layout}, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=32).digest()


def transceiver_state(*, worker: str, backend: str, address: bytes, model_id: str, layout: Mapping[str, Any],
                      scope: bytes, block_size: int, facts: tuple[tuple[str, str], ...] = ()) -> bytes:
    return TransceiverState(worker=worker, backend=backend, other_end=OtherEnd.PEER, address=address, namespace="",
                            model_id=model_id[-256:], layout_digest=layout_digest(layout), scope_digest=scope,
                            block_tokens=block_size, facts=facts).to_bytes()


def check_state(raw: bytes, *, backend: str, layout: Mapping[str, Any], scope: bytes, block_size: int,
                facts: tuple[tuple[str, str], ...] = ()) -> TransceiverState:
    """Decode (bounded, :data:`kvwire.holding.MAX_STATE_BYTES`) and check a serving
    engine's state against this engine's cache; :class:`StateError` says which field differs
    (each fact of ``facts`` the source's state names otherwise, by name and both values)."""
    state = TransceiverState.from_bytes(raw)
    if state.other_end is not OtherEnd.PEER:
        raise StateError("the source's transceiver state names a store, not a serving engine")
    if state.backend != backend:
        raise StateError(f"the source engine uses backend {state.backend!r}, this one {backend!r}")
    theirs, mine = state.fact_map(), dict(facts)
    differ = [f"{key} {theirs[key]!r} there, {mine[key]!r} here" for key in sorted(mine)
              if key in theirs and theirs[key] != mine[key]]
    if differ:
        raise StateError("the source engine's KV cache is not this engine's: " + "; ".join(differ)
                         + ": its blocks cannot be loaded here")
    if state.block_tokens != block_size:
        raise StateError(f"the source's block size {state.block_tokens} differs from this engine's {block_size}")
    if state.layout_digest != layout_digest(layout):
        raise StateError("the source's KV cache layout differs from this engine's")
    if state.scope_digest != scope:
        raise StateError("the source's cache scope (model, weights, dtype, layout) differs from this engine's: "
                         "its block names can never match")
    return state


def source_of(params: Mapping[str, Any] | None) -> bytes | None:
    """The state bytes a request's ``kv_transfer_params`` carries, or None."""
    if not params or SOURCE_KEY not in params:
        return None
    value = params[SOURCE_KEY]
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, str) and len(value) <= 4 * 16 * 1024:
        try:
            return base64.b64decode(value, validate=True)
        except ValueError:
            raise StateError(f"kv_transfer_params[{SOURCE_KEY!r}] is neither bytes nor base64 text") from None
    raise StateError(f"kv_transfer_params[{SOURCE_KEY!r}] must be the serving engine's state (bytes or base64)")


# -- waking an idle engine core ------------------------------------------------------------------


#: Linux's abstract socket names live in no directory and go with the socket: an engine core that
#: is killed leaves nothing behind. Elsewhere the bell is a file in the temp directory.
_ABSTRACT = sys.platform.startswith("linux")


def _bell_path(engine_id: str, pid: int) -> str:
    tag = hashlib.blake2b(f"{engine_id}:{pid}".encode(), digest_size=8).hexdigest()
    if _ABSTRACT:
        return f"\0kvwire-vllm-{tag}.bell"
    return os.path.join(tempfile.gettempdir(), f"kvwire-vllm-{tag}.bell")


def _unlink_bell(path: str) -> None:
    if not path.startswith("\0"):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def find_engine_core() -> Callable[[], object] | None:
    """A weak reference to the engine core this connector is being built inside (its ``self``
    up the constructor's stack), or None (an engine built otherwise: then nothing needs waking)."""
    try:
        from vllm.v1.engine.core import EngineCore
    except ImportError:  # pragma: no cover
        return None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        obj = frame.f_locals.get("self")
        if isinstance(obj, EngineCore):
            return weakref.ref(obj)
        frame = frame.f_back
    return None


class Doorbell:
    """The engine-core end: a UNIX datagram socket named after the engine id and this process
    (an abstract name on Linux), and a thread that calls ``on_ring`` for each datagram (their
    content is ignored)."""

    def __init__(self, engine_id: str, on_ring: Callable[[], None]) -> None:
        self.path = _bell_path(engine_id, os.getpid())
        _unlink_bell(self.path)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.bind(self.path)
        self._on_ring = on_ring
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="kvwire-doorbell", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._closed:
            try:
                self._sock.recv(64)
            except OSError:
                return
            if self._closed:
                return
            try:
                self._on_ring()
            except Exception:  # the bell must outlive one bad ring
                log.exception("kvwire: doorbell handler failed")

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            ring_path(self.path)  # unblocks recv
            if threading.current_thread() is not self._thread:
                # the socket (and so an abstract name) lives on while the thread is inside recv:
                # once this returns, no ring reaches the bell
                self._thread.join(timeout=5.0)
        finally:
            self._sock.close()
            _unlink_bell(self.path)


_out = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
_out.setblocking(False)


def ring_path(path: str) -> bool:
    try:
        _out.sendto(b"!", path)
        return True
    except OSError:  # no such bell, or its queue is full (it rings anyway)
        return False


def ring(engine_id: str) -> bool:
    """The worker's end: ring the engine core's bell (the worker's parent process; or this one,
    for an engine whose worker runs in the engine core). Never blocks."""
    for pid in (os.getppid(), os.getpid()):
        if ring_path(_bell_path(engine_id, pid)):
            return True
    return False
