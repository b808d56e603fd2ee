"""Authenticated pulls: a shared secret signs each pull request (HMAC-SHA256 over what it asks
for, who asks and when), the serving worker refuses unsigned, forged, stale or replayed requests,
and an allowlist names the workers allowed to pull.

The credentials travel, unread, in the requester's hint field ``credentials`` and reach the
serving holder as ``PullRequest.credentials``; the backend never interprets them."""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np

from kvwire.contract.serving import PullRequest

__all__ = ["PullGuard", "sign_pull", "MAX_SKEW_S"]

_MAGIC = b"KVWA"
_VERSION = 1
_HEAD = struct.Struct("<4sBQ16sB")   # magic, version, timestamp ns, nonce, worker-name length
MAX_SKEW_S = 30.0
_REPLAY_CACHE = 65536


def _mac(secret: bytes, stamp: int, nonce: bytes, worker: bytes, groups: tuple[int, ...], names: np.ndarray) -> bytes:
    h = hmac.new(secret, b"kvwire-pull-v1", hashlib.sha256)
    h.update(struct.pack("<Q", stamp))
    h.update(nonce)
    h.update(struct.pack("<B", len(worker)) + worker)
    h.update(struct.pack(f"<{len(groups) + 1}q", len(groups), *groups))
    names = np.ascontiguousarray(names, dtype=np.uint8)
    h.update(struct.pack("<QQ", *names.shape) if names.ndim == 2 else b"")
    h.update(names.tobytes())
    return h.digest()


def sign_pull(secret: bytes, worker: str, groups: tuple[int, ...], names: np.ndarray, *, now_ns: int | None = None) -> bytes:
    """Credentials for a pull of ``names`` in ``groups`` by ``worker``."""
    raw_worker = worker.encode()[:255]
    stamp = time.time_ns() if now_ns is None else now_ns
    nonce = os.urandom(16)
    return _HEAD.pack(_MAGIC, _VERSION, stamp, nonce, len(raw_worker)) + raw_worker + _mac(
        secret, stamp, nonce, raw_worker, tuple(groups), names)


@dataclass
class PullGuard:
    """Decides, for each incoming pull, whether to serve it: ``check(request)`` returns ``None``
    to serve, or the reason to refuse. Counts refusals by kind."""

    secret: bytes | None = None
    allowed: Collection[str] | None = None
    max_skew_s: float = MAX_SKEW_S

    def __post_init__(self) -> None:
        self.refused: dict[str, int] = {}
        self._seen: OrderedDict[bytes, None] = OrderedDict()
        self._lock = threading.Lock()

    def _refuse(self, kind: str, reason: str) -> str:
        with self._lock:
            self.refused[kind] = self.refused.get(kind, 0) + 1
        return reason

    def check(self, request: PullRequest) -> str | None:
        who = request.peer
        if self.secret is not None:
            cred = request.credentials
            if len(cred) < _HEAD.size + 32:
                return self._refuse("unauthenticated", "the pull carries no valid credentials; this worker requires signed pulls")
            magic, version, stamp, nonce, wlen = _HEAD.unpack_from(cred)
            if magic != _MAGIC or version != _VERSION or len(cred) != _HEAD.size + wlen + 32:
                return self._refuse("unauthenticated", "the pull's credentials are malformed")
            worker = cred[_HEAD.size:_HEAD.size + wlen]
            expected = _mac(self.secret, stamp, nonce, worker, request.groups, request.names)
            if not hmac.compare_digest(expected, cred[-32:]):
                return self._refuse("forged", "the pull's signature does not match (wrong secret or altered request)")
            if abs(time.time_ns() - stamp) > self.max_skew_s * 1e9:
                return self._refuse("stale", f"the pull was signed more than {self.max_skew_s:g} s away from now")
            with self._lock:
                if nonce in self._seen:
                    self.refused["replayed"] = self.refused.get("replayed", 0) + 1
                    return "the pull's credentials were already used (replay)"
                self._seen[nonce] = None
                while len(self._seen) > _REPLAY_CACHE:
                    self._seen.popitem(last=False)
            who = worker.decode(errors="replace")
        if self.allowed is not None and who not in self.allowed and request.peer not in self.allowed:
            return self._refuse("not-allowed", f"peer {who!r} is not on this worker's allowlist")
        return None
