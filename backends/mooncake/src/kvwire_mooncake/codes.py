"""Mooncake's status codes and how each becomes a per-key :class:`~kvwire.blob.driver.KeyStatus`.

Mooncake answers every call with integers, never exceptions. This module is the one place that
says what they mean for kvwire; see the table in the package README.

* put:    ``0`` OK; ``-705`` ALREADY_THERE; ``-200`` DECLINED (no space); else FAILED.
* get:    the row size OK; ``-704`` MISSING, and ``-703`` (a writer has not finished, so no
  object is visible yet) MISSING; any other byte count FAILED (size mismatch); else FAILED.
* remove: ``0`` OK; ``-704`` MISSING; ``-706`` and ``-708`` BUSY (leased, or being
  replicated); else FAILED.

Every FAILED, DECLINED or BUSY key's reason names the operation, the code and its name."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from kvwire.blob.driver import BatchResult, KeyStatus

__all__ = ["CODE_NAMES", "describe", "put_result", "get_result", "remove_result"]

#: Mooncake Store's ``ErrorCode`` values as the 0.3.13 client returns them.
CODE_NAMES: Mapping[int, str] = {
    0: "OK",
    -1: "INTERNAL_ERROR",
    -10: "BUFFER_OVERFLOW",
    -100: "SHARD_INDEX_OUT_OF_RANGE",
    -101: "SEGMENT_NOT_FOUND",
    -102: "SEGMENT_ALREADY_EXISTS",
    -103: "CLIENT_NOT_FOUND",
    -200: "NO_AVAILABLE_HANDLE",
    -300: "INVALID_VERSION",
    -400: "INVALID_KEY",
    -500: "WRITE_FAIL",
    -600: "INVALID_PARAMS",
    -601: "ILLEGAL_CLIENT",
    -700: "INVALID_WRITE",
    -701: "INVALID_READ",
    -702: "INVALID_REPLICA",
    -703: "REPLICA_IS_NOT_READY",
    -704: "OBJECT_NOT_FOUND",
    -705: "OBJECT_ALREADY_EXISTS",
    -706: "OBJECT_HAS_LEASE",
    -707: "LEASE_EXPIRED",
    -708: "OBJECT_HAS_REPLICATION_TASK",
    -709: "OBJECT_NO_REPLICATION_TASK",
    -710: "REPLICA_NOT_FOUND",
    -711: "REPLICA_ALREADY_EXISTS",
    -712: "REPLICA_IS_GONE",
    -800: "TRANSFER_FAIL",
    -900: "RPC_FAIL",
    -901: "RPC_TIMEOUT",
    -1000: "ETCD_OPERATION_ERROR",
    -1010: "UNAVAILABLE_IN_CURRENT_STATUS",
    -1011: "UNAVAILABLE_IN_CURRENT_MODE",
}

_MEANING: Mapping[int, str] = {
    -1: "internal error in the Mooncake client or master",
    -200: "no space left in the store's segments (or no segment mounted)",
    -600: "invalid parameters (for a get: the row is smaller than the stored object)",
    -703: "a writer has not finished storing the object",
    -704: "no object under this key",
    -705: "an object under this key already exists",
    -706: "the object is leased (read or written within the master's lease TTL)",
    -707: "the lease expired before the transfer completed",
    -708: "the object is being replicated",
    -800: "the bytes could not be moved to or from the segment holding the object "
    "(its owner may have died)",
    -900: "the master is unreachable",
    -901: "the master did not answer in time (MC_RPC_TIMEOUT_MS)",
}

OK, NOT_READY, NOT_FOUND, ALREADY_EXISTS, HAS_LEASE, HAS_REPLICATION_TASK, NO_SPACE = (
    0, -703, -704, -705, -706, -708, -200,
)
# Plain ints: numpy compares and fills faster with them than with enum members.
_OK, _THERE, _DECLINED, _MISSING, _BUSY, _FAILED = (
    int(s) for s in (KeyStatus.OK, KeyStatus.ALREADY_THERE, KeyStatus.DECLINED, KeyStatus.MISSING,
                     KeyStatus.BUSY, KeyStatus.FAILED)
)


def describe(op: str, code: int) -> str:
    """``"mooncake put returned -900 (RPC_FAIL): the master is unreachable"``."""
    name = CODE_NAMES.get(code, "UNKNOWN")
    meaning = _MEANING.get(code)
    text = f"mooncake {op} returned {code} ({name})"
    return f"{text}: {meaning}" if meaning else text


def _result(status: np.ndarray, codes: np.ndarray, op: str) -> BatchResult:
    explain = np.flatnonzero((status == _FAILED) | (status == _DECLINED) | (status == _BUSY))
    if explain.size == 0:
        return BatchResult(status)
    cache: dict[int, str] = {}
    reasons = {}
    for i in explain.tolist():
        code = int(codes[i])
        if code not in cache:
            cache[code] = describe(op, code)
        reasons[i] = cache[code]
    return BatchResult(status, reasons)


def put_result(codes: np.ndarray) -> BatchResult:
    """Statuses of ``batch_put_from`` return codes."""
    codes = np.asarray(codes, dtype=np.int64)
    if not codes.any():  # every key stored: the common case
        return BatchResult(np.zeros(codes.shape, dtype=np.uint8))
    status = np.full(codes.shape, _FAILED, dtype=np.uint8)
    status[codes == OK] = _OK
    status[codes == ALREADY_EXISTS] = _THERE
    status[codes == NO_SPACE] = _DECLINED
    return _result(status, codes, "put")


def get_result(codes: np.ndarray, sizes: np.ndarray) -> BatchResult:
    """Statuses of ``batch_get_into`` answers (bytes read, or a negative code) for rows of
    ``sizes`` bytes. A byte count other than the row's is a size mismatch: FAILED, never OK."""
    codes = np.asarray(codes, dtype=np.int64)
    sizes = np.asarray(sizes, dtype=np.int64)
    whole = codes == sizes
    if whole.all():  # every row read whole: the common case
        return BatchResult(np.zeros(codes.shape, dtype=np.uint8))
    status = np.full(codes.shape, _FAILED, dtype=np.uint8)
    status[whole] = _OK
    status[(codes == NOT_FOUND) | (codes == NOT_READY)] = _MISSING
    result = _result(status, codes, "get")
    reasons = dict(result.reasons)
    for i in np.flatnonzero((codes >= 0) & (codes != sizes)).tolist():
        reasons[i] = (
            f"size mismatch: mooncake get read {int(codes[i])} bytes, the row holds "
            f"{int(sizes[i])}; the stored object is not this row's object"
        )
    return BatchResult(result.status, reasons)


def remove_result(codes: np.ndarray) -> BatchResult:
    """Statuses of ``batch_remove`` return codes."""
    codes = np.asarray(codes, dtype=np.int64)
    status = np.full(codes.shape, _FAILED, dtype=np.uint8)
    status[codes == OK] = _OK
    status[codes == NOT_FOUND] = _MISSING
    status[(codes == HAS_LEASE) | (codes == HAS_REPLICATION_TASK)] = _BUSY
    return _result(status, codes, "remove")
