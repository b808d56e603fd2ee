"""The Mooncake Store driver: :class:`~kvwire.blob.driver.StoreDriver` over one
``mooncake.store.MooncakeDistributedStore`` client.

Rows move zero-copy: regions are registered with the client (``register_buffer``), puts read
them with ``batch_put_from`` and gets write them with ``batch_get_into``; no Python bytes are
made on the way. A block object (K1) is one Mooncake object holding a block's row of every group,
one after another: ``batch_put_from_multi_buffers`` gathers it from the rows, and
``batch_get_into_multi_buffers`` scatters one that lies in this client's own segment back into
them. One that lies in another client's segment is read whole into a bounce buffer with
``batch_get_into`` and scattered here: the transfer engine moves one TCP request per destination
buffer, and 256 blocks of 32 x 16 KiB from another segment took 721 ms into their rows against
182 ms into one buffer each plus the scatter (``bench/results/blocks-2026-12-04.txt``). Mooncake answers with status codes, never exceptions; :mod:`kvwire_mooncake.codes`
maps them to per-key statuses.

Time bounds (measured with 0.3.13 over TCP): a call against a master that died returns
``-900`` after ~4.3 s, and once the client's own pings have noticed (about 1 s) this driver fails
calls at once without trying; a call against a master that hangs returns ``-901`` after
``rpc_timeout_s``. ``close()`` takes 1-2 s, and ~11 s while the master is unreachable (the client
tries to unmount its segment)."""

from __future__ import annotations

import collections
import ctypes
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvwire.blob import parts as blob_parts
from kvwire.blob.driver import BatchResult, KeyStatus, StoreDriver, call_deadline
from kvwire.blob.parts import check_parts, lend, pieces, scatter
from kvwire.contract import MemoryKind, SlotRegion
from kvwire_mooncake import codes
from kvwire_mooncake.library import store_module
from kvwire_mooncake.master import MasterProcess
from kvwire_mooncake.options import ClientSettings

__all__ = ["MooncakeDriver", "MooncakeSetupError"]

log = logging.getLogger(__name__)

_HEALTHY, _NOT_INITIALISED, _MASTER_UNREACHABLE = 0, 1, 2
#: A get refused with -600 is explained by asking the object's size, for this many keys at most.
_EXPLAIN_AT_MOST = 8
#: The longest a put waits for another put of this driver writing the same key (Mooncake answers
#: the second 0 and holds the first's object once it ends).
_OTHER_PUT_WAIT_S = 5.0
#: Block objects whose every part is at least this large are read straight into their parts from
#: any segment, one transfer request per part; smaller parts of a remote object are read whole
#: into a bounce buffer and scattered here (one request per object: for 2 parts of 16 KiB, the
#: tiny test model's, per-part requests were slower). At 32 parts of 128 KiB (an 8B-class model's
#: block) the bounce and its copy cost 0.6 GB/s against Mooncake's own multi-buffer read.
_DIRECT_PART_BYTES = 64 << 10
#: Mooncake's code for a read whose lease on the object ran out before the transfer was done
#: (the object stays; its bytes in the row may be torn): such objects are read once more.
_LEASE_EXPIRED = -707

#: How long a key found absent right after its put answered 0 is asked for again before the put is
#: called not stored (a dead writer's unfinished put, or eviction at once, keeps it absent).
_SETTLE_S = 0.25


class MooncakeSetupError(RuntimeError):
    """A Mooncake client could not be set up; the message names the master and what to check."""


class MooncakeDriver(StoreDriver):
    """A store driver over one Mooncake client. Thread-safe: the client takes concurrent calls,
    and ``close()`` waits for calls in progress before it closes the client.

    ``put`` reports ``ALREADY_THERE`` for a key that names an object before the call (checked with
    ``batch_is_exist``: Mooncake's put of an existing key answers 0 and keeps the first object)
    and ``OK`` for the others that were stored, including a key another writer stored between
    that check and the put; either way the store holds an object under the key afterwards and the
    first object's bytes are never changed."""

    memory_kinds = frozenset({MemoryKind.HOST})
    #: One put or get of 8192 small objects overflowed the client's TCP transfer queue here ("TCP
    #: lane queue-full rejection"): about half the rows failed, and the call stayed inside the
    #: client for 30 s and more, past any deadline; 4096 moved in 0.1 s on a quiet machine, and
    #: 2048 per call (two workers' calls at once) still lost a few rows on a loaded one. The queue
    #: holds one request per buffer: a multi-buffer call of 128 block objects of 32 parts (4096
    #: buffers) to another client's segment failed most of them (-800), as 4096 single-buffer
    #: keys did, and 2048 objects of 32 stayed 60 s inside the client; so a parts call counts
    #: each part against this bound (the blob backend sends 1024 // 32 = 32 such objects a call).
    max_batch_keys = 1024
    #: One call of a submission at a time: two calls of one client at once move less than one
    #: alone. A 2048-token prompt of an 8B-class model (63 block objects of 32 x 128 KiB,
    #: 252 MiB, cut in 4 calls) to a third client's segment: published in 169 ms and fetched in
    #: 159 ms on two workers at once, 114 and 98 ms one call after another, 104 and 96 ms in one
    #: call the way vLLM's MooncakeStoreConnector makes it (bench/results/vllm-shapes-2026-12-05-2.txt).
    #: Since the transfer queue is the client's, it also keeps one submission's spans in flight
    #: within ``max_batch_keys``.
    chunks_at_once = 1

    def __init__(self, client: Any, *, master: str, owned_master: MasterProcess | None = None,
                 close_client: bool = True, check_existing: bool = True, mount_segment_bytes: int = 0,
                 protocol: str = "tcp", holds_segment: bool = True) -> None:
        """A driver over ``client``, a set-up ``MooncakeDistributedStore`` reaching ``master``.
        ``close()`` closes the client unless ``close_client`` is false (a client shared by
        several drivers), and stops ``owned_master`` if given. With ``check_existing`` false,
        ``put`` skips the existence check (one master round trip per call) and reports every
        stored key ``OK``, never ``ALREADY_THERE``. With ``mount_segment_bytes`` the client
        contributes a segment of that size (over ``protocol``) when the first region is
        registered, not before: a driver that never moves rows holds no objects. ``holds_segment``
        false says the client contributes no segment, so every object lies in another's."""
        self._client = client
        self._mount_segment_bytes = int(mount_segment_bytes)
        self._protocol = protocol
        self._check_existing = check_existing
        self._master = master
        self._owned_master = owned_master
        self._close_client = close_client
        self._registered: dict[int, SlotRegion] = {}
        self._cond = threading.Condition()
        self._active = 0
        #: Keys with a put of this driver in progress, by how many (under ``_cond``): a put that
        #: finds its key absent after Mooncake answered 0 waits for these before it decides.
        self._putting: collections.Counter[str] = collections.Counter()
        self._closed = False
        self._holds_segment = holds_segment
        #: The transport endpoint of this client's own segment ("" when it holds none, None when
        #: it could not be told), found once by the first block read (:meth:`_own_endpoint`).
        self._endpoint: str | None = None
        self._endpoint_known = False
        self._probing = threading.Lock()

    @classmethod
    def connect(cls, settings: ClientSettings, *, check_existing: bool = True) -> MooncakeDriver:
        """A driver with a client set up against ``settings.master``, or against a private
        master it starts (and stops on ``close()``) when that is empty. Raises
        :class:`MooncakeSetupError` naming the master when the client cannot be set up, and
        :class:`~kvwire_mooncake.library.MooncakeUnavailable` when the library cannot load."""
        module = store_module()
        owned: MasterProcess | None = None
        master = settings.master
        if not master:
            owned = MasterProcess().start()
            master = owned.address
            log.info("started a private mooncake_master at %s", master)
        try:
            _apply_environment(settings.environment())
            client = module.MooncakeDistributedStore()
            hostname = settings.hostname_for(master)
            started = time.monotonic()
            later = settings.segment_bytes if settings.segment_when == "registered" else 0
            rc = client.setup(
                hostname, settings.metadata_server, settings.segment_bytes - later, settings.local_buffer_bytes,
                settings.protocol, settings.rdma_devices, master,
            )
            if rc != 0:
                client.close()
                raise MooncakeSetupError(_setup_failure(rc, master, settings, time.monotonic() - started))
        except BaseException:
            if owned is not None:
                owned.stop()
            raise
        log.info("mooncake client %s set up against master %s (%s, segment %d bytes%s)",
                 hostname, master, settings.protocol, settings.segment_bytes,
                 ", contributed at the first registration" if later else "")
        return cls(client, master=master, owned_master=owned, check_existing=check_existing,
                   mount_segment_bytes=later, protocol=settings.protocol, holds_segment=settings.segment_bytes > 0)

    @property
    def master(self) -> str:
        """The master's ``host:port``."""
        return self._master

    @property
    def in_progress(self) -> int:
        """How many store calls are running now."""
        with self._cond:
            return self._active

    @property
    def client(self) -> Any:
        """The Mooncake client itself (for measurements against the raw calls)."""
        return self._client

    # -- registration ---------------------------------------------------------------------------

    def register(self, regions: Sequence[SlotRegion]) -> None:
        done: list[SlotRegion] = []
        with self._cond:
            if self._closed:
                raise RuntimeError("the Mooncake driver is closed; it registers nothing")
            if regions and self._mount_segment_bytes:
                self._mount_segment_locked()
            for region in regions:
                if region.memory_kind not in self.memory_kinds:
                    self._unregister_locked(done)
                    raise RuntimeError(
                        f"region {region.region_id}: the Mooncake driver reaches {region.memory_kind.value} "
                        "memory only through a CUDA build with GPU-direct transport; it takes host memory"
                    )
                rc = int(self._client.register_buffer(region.base, region.nbytes))
                if rc != 0:
                    self._unregister_locked(done)
                    raise RuntimeError(
                        f"Mooncake refused to register region {region.region_id} ({region.nbytes} bytes at "
                        f"{region.base:#x}): {codes.describe('register_buffer', rc)}"
                        + (" (it overlaps a registered span)" if rc == -600 else "")
                    )
                self._registered[region.base] = region
                done.append(region)

    def _mount_segment_locked(self) -> None:
        """Contribute the segment deferred at setup (``segment_when = registered``), once."""
        size = self._mount_segment_bytes
        answer = self._client.allocate_and_mount_segment(size, self._protocol, "")
        rc = int(answer.get("ret", -1)) if isinstance(answer, dict) else int(answer)
        if rc != 0:
            raise RuntimeError(
                f"Mooncake could not mount this client's {size}-byte segment (segment_when = registered): "
                f"{codes.describe('allocate_and_mount_segment', rc)}")
        self._mount_segment_bytes = 0
        log.info("mooncake client contributed its %d-byte segment at its first registration", size)

    @property
    def segment_pending(self) -> bool:
        """Whether the client's segment waits for the first registration to be contributed."""
        return self._mount_segment_bytes > 0

    def unregister(self, regions: Sequence[SlotRegion]) -> None:
        with self._cond:
            self._unregister_locked(regions)

    def _unregister_locked(self, regions: Sequence[SlotRegion]) -> None:
        for region in regions:
            if self._registered.get(region.base) != region:
                continue
            del self._registered[region.base]
            if self._closed:
                continue
            rc = int(self._client.unregister_buffer(region.base))
            if rc != 0:
                log.debug("unregister of region %d: %s", region.region_id, codes.describe("unregister_buffer", rc))

    # -- store calls ----------------------------------------------------------------------------

    def _batch(self, n: int, work: Callable[[int], BatchResult]) -> BatchResult:
        """``work(n)`` for a batch of ``n`` keys, counted as a call in progress; an empty batch
        and a refused call (closed, master unreachable) answer without it."""
        if n == 0:
            return BatchResult(np.empty(0, dtype=np.uint8))
        refused = self._enter(n)
        if refused is not None:
            return refused
        try:
            return work(n)
        finally:
            self._leave()

    def _enter(self, n: int) -> BatchResult | None:
        """``None`` if the call may proceed (and counts it), else the answer for every key."""
        with self._cond:
            if self._closed:
                return BatchResult.uniform(n, KeyStatus.FAILED, "the Mooncake driver is closed")
            health = int(self._client.health_check())
            if health == _MASTER_UNREACHABLE:
                return BatchResult.uniform(
                    n, KeyStatus.FAILED,
                    f"the Mooncake master at {self._master} is unreachable (the client's health check "
                    "failed; calls now return -900 RPC_FAIL after ~4 s), so the call was not attempted",
                )
            if health == _NOT_INITIALISED:
                return BatchResult.uniform(n, KeyStatus.FAILED, "the Mooncake client is not set up or was closed")
            self._active += 1
            return None

    def _leave(self) -> None:
        with self._cond:
            self._active -= 1
            if self._active == 0:
                self._cond.notify_all()

    def put(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        def put_rows(chosen: list[str], rows: np.ndarray | None) -> list[int]:
            at, lengths = np.asarray(addresses, dtype=np.uint64), np.asarray(sizes, dtype=np.uint64)
            if rows is not None:
                at, lengths = at[rows], lengths[rows]
            return self._client.batch_put_from(chosen, at.tolist(), lengths.tolist())  # type: ignore[no-any-return]

        return self._batch(len(keys), lambda n: self._put(keys, put_rows, n))

    def put_parts(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        """Block objects, each gathered from its parts by one ``batch_put_from_multi_buffers``
        call for the batch (no copy on this side)."""
        at, lengths, _ = check_parts("put_parts", keys, addresses, sizes)
        each = lengths.tolist()

        def put_rows(chosen: list[str], rows: np.ndarray | None) -> list[int]:
            buffers = (at if rows is None else at[rows]).tolist()
            return self._client.batch_put_from_multi_buffers(  # type: ignore[no-any-return]
                chosen, buffers, [each] * len(chosen))

        return self._batch(len(keys), lambda n: self._put(keys, put_rows, n))

    def _put(self, keys: Sequence[str], put_rows: Callable[[list[str], np.ndarray | None], list[int]],
             n: int) -> BatchResult:
        """A put of ``keys``: ``put_rows(keys, rows)`` stores the keys of ``rows`` (``None``:
        all) and answers the client's codes."""
        keys = _as_list(keys)
        with self._cond:
            self._putting.update(keys)
        try:
            result = self._put_now(keys, put_rows, n)
        finally:
            with self._cond:
                self._putting.subtract(keys)
                self._putting += collections.Counter()  # drop the keys at zero
                self._cond.notify_all()
        return self._confirm(keys, result)

    def _put_now(self, keys: list[str], put_rows: Callable[[list[str], np.ndarray | None], list[int]],
                 n: int) -> BatchResult:
        """The put itself: its codes, not yet confirmed."""
        found = self._client.batch_is_exist(keys) if self._check_existing else None
        fresh = found is None or not any(found)  # no key there yet (a negative code is an error)
        if fresh:  # the common case: nothing there yet, put every key
            answer = put_rows(keys, None)
            if not any(answer):  # every key stored; checked on the list, before any numpy
                return BatchResult.ok(n)
            return codes.put_result(np.asarray(answer, dtype=np.int64))
        exist = np.asarray(found, dtype=np.int64)
        status = np.full(n, int(KeyStatus.FAILED), dtype=np.uint8)
        reasons: dict[int, str] = {}
        status[exist == 1] = int(KeyStatus.ALREADY_THERE)
        for i in np.flatnonzero(exist < 0).tolist():
            reasons[i] = codes.describe("exists check before put", int(exist[i]))
        todo = np.flatnonzero(exist == 0)
        if todo.size:
            answer = put_rows([keys[i] for i in todo.tolist()], todo)
            sub = codes.put_result(np.asarray(answer, dtype=np.int64))
            status[todo] = sub.status
            for j, why in sub.reasons.items():
                reasons[int(todo[j])] = why
        return BatchResult(status, reasons)

    def _confirm(self, keys: list[str], result: BatchResult) -> BatchResult:
        """``result`` with each key the put stored (``OK``) asked for once more. Mooncake answers
        0 to a put of a key that an unfinished put holds (its writer died mid-put) and stores
        nothing until the master discards that put (``put_start_discard_timeout_sec``, 30 s by
        default); a full store may also evict a key within the batch that put it. A key the
        store does not hold after its put is ``DECLINED`` (not stored), never read held.

        Mooncake also answers 0 to a put of a key that another put of this driver is still
        writing (two attempts publishing the same name at once), and holds it a moment later: a
        key found absent while such a put is in progress is asked for again once that put has
        ended (waiting no longer than the attempt's deadline allows), and an absent key is asked
        for a few more times over :data:`_SETTLE_S`, since a put that has just returned may
        still read absent for a moment."""
        stored = np.flatnonzero(result.status == KeyStatus.OK)
        if stored.size == 0:
            return result
        there = self._client.batch_is_exist([keys[i] for i in stored.tolist()])
        if type(there) is list and all(t == 1 for t in there):  # the common case, before any numpy
            return result
        there_codes = np.asarray(there, dtype=np.int64)
        absent = stored[there_codes == 0]
        if absent.size:
            self._wait_for_other_puts([keys[i] for i in absent.tolist()])
            self._ask_again(keys, stored, there_codes)
        status = np.array(result.status, dtype=np.uint8, copy=True)
        status[stored[there_codes == 0]] = KeyStatus.DECLINED
        reasons = dict(result.reasons)
        for i, code in zip(stored.tolist(), there_codes.tolist(), strict=True):
            if code == 0:
                reasons[i] = ("Mooncake answered 0 to the put but holds no object under the key: an unfinished put of "
                              "it (by a writer that died mid-put) blocks it, or the full store evicted it at once")
            elif code != 1:
                status[i] = KeyStatus.FAILED
                reasons[i] = codes.describe("exists check after put", code)
        return BatchResult(status, reasons)

    def _ask_again(self, keys: list[str], stored: np.ndarray, there_codes: np.ndarray) -> None:
        """Asks for the keys of ``stored`` that ``there_codes`` calls absent (0) again, a few
        times over at most :data:`_SETTLE_S` (and never past the attempt's deadline), updating
        ``there_codes`` in place: the object of a put that has just ended (this driver's or
        another process's) may be reported absent for a moment after that put returned
        (measured here: an exists check 0.2 ms after the other put returned said 0, one 0.3 ms
        later said 1)."""
        deadline = call_deadline()
        until = time.monotonic() + _SETTLE_S
        if deadline is not None:
            until = min(until, deadline)
        pause = 0.001
        while True:
            absent = np.flatnonzero(there_codes == 0)
            if absent.size == 0:
                return
            again = self._client.batch_is_exist([keys[i] for i in stored[absent].tolist()])
            there_codes[absent] = np.asarray(again, dtype=np.int64)
            left = until - time.monotonic()
            if left <= 0 or not (there_codes == 0).any():
                return
            time.sleep(min(pause, left))
            pause *= 2

    def _wait_for_other_puts(self, keys: list[str]) -> bool:
        """Waits until no put of this driver is writing any of ``keys`` (at most until the
        calling attempt's deadline, and never past :data:`_OTHER_PUT_WAIT_S`); true if one was."""
        deadline = call_deadline()
        until = time.monotonic() + _OTHER_PUT_WAIT_S
        if deadline is not None:
            until = min(until, deadline)
        waited = False
        with self._cond:
            while any(self._putting[k] for k in keys):
                waited = True
                left = until - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
        return waited

    def get_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        spans = _Spans(np.asarray(addresses, dtype=np.uint64), np.asarray(sizes, dtype=np.int64), None)
        return self._batch(len(keys), lambda n: self._get(keys, spans, n))

    def get_parts_into(self, keys: Sequence[str], addresses: np.ndarray, sizes: np.ndarray) -> BatchResult:
        """Block objects, each scattered into its parts by one ``batch_get_into_multi_buffers``
        call for the batch (no copy on this side). An object of another size fails its key."""
        at, lengths, total = check_parts("get_parts_into", keys, addresses, sizes)
        spans = _Spans(at, np.full(len(keys), total, dtype=np.int64), lengths)
        return self._batch(len(keys), lambda n: self._get(keys, spans, n))

    def _get(self, keys: Sequence[str], spans: _Spans, n: int) -> BatchResult:
        keys = _as_list(keys)
        if len(set(keys)) != n:
            return self._get_repeated(keys, spans, n)
        wanted = spans.sizes.tolist()
        answer = self._read(keys, spans)
        if type(answer) is list and answer == wanted:  # every row read whole; compared before any numpy
            return BatchResult.ok(n)
        sizes = spans.sizes
        got = np.asarray(answer, dtype=np.int64)
        expired = np.flatnonzero(got == _LEASE_EXPIRED)
        if expired.size:
            # The master's read lease on these objects ran out while a long call was still on its
            # way (a large batch on a busy host): the objects are there, but what landed in their
            # rows may be torn. Read them once more, alone, under a fresh lease.
            log.info("mooncake client %s: %d of %d objects outlived their read lease; reading them again",
                     self._master, expired.size, n)
            got[expired] = np.asarray(self._read([keys[i] for i in expired.tolist()], spans.select(expired)),
                                      dtype=np.int64)
        result = codes.get_result(got, sizes)
        if not result.reasons:  # every row whole, or only misses
            return result
        too_small = np.flatnonzero(got == -600)[:_EXPLAIN_AT_MOST]
        if too_small.size == 0:
            return result
        reasons = dict(result.reasons)
        for i in too_small.tolist():
            stored = int(self._client.get_size(keys[i]))
            if stored >= 0 and stored != int(sizes[i]):
                reasons[i] = (
                    f"size mismatch: the stored object has {stored} bytes, the row holds {int(sizes[i])} "
                    f"({codes.describe('get', -600)})"
                )
        return BatchResult(result.status, reasons)

    def _read(self, keys: list[str], spans: _Spans) -> Any:
        """The client's answer for a get of distinct ``keys`` into ``spans``."""
        return spans.read(self._client, keys) if spans.parts is None else self._read_blocks(keys, spans)

    def _read_blocks(self, keys: list[str], spans: _Spans) -> list[int]:
        """The client's answer for a get of block objects (distinct keys) into ``spans``: those
        in this client's own segment straight into their parts (one memory copy per part),
        the others whole into a bounce buffer, then scattered here (one transfer request per
        object, not one per part)."""
        parts = spans.parts
        assert parts is not None
        client = self._client
        if int(parts.min()) >= _DIRECT_PART_BYTES:  # parts large enough to be transfer requests of their own
            return client.batch_get_into_multi_buffers(  # type: ignore[no-any-return]
                keys, spans.addresses.tolist(), [parts.tolist()] * len(keys))
        remote = self._remote(keys)
        if not remote.any():
            return client.batch_get_into_multi_buffers(  # type: ignore[no-any-return]
                keys, spans.addresses.tolist(), [parts.tolist()] * len(keys))
        answer = np.empty(len(keys), dtype=np.int64)
        near = np.flatnonzero(~remote)
        if near.size:
            answer[near] = client.batch_get_into_multi_buffers(
                [keys[i] for i in near.tolist()], spans.addresses[near].tolist(), [parts.tolist()] * near.size)
        far = np.flatnonzero(remote)
        total = int(spans.sizes[0])
        each = np.int64(total)
        with lend(self, min(far.size, max(1, blob_parts.BOUNCE_BYTES // total)) * total) as bounce:
            for lo, hi in pieces(far.size, total):
                rows = far[lo:hi]
                starts = (bounce.base + np.arange(hi - lo, dtype=np.uint64) * np.uint64(total)).tolist()
                got = np.asarray(client.batch_get_into([keys[i] for i in rows.tolist()], starts, [total] * (hi - lo)),
                                 dtype=np.int64)
                whole = np.flatnonzero(got == each)
                if whole.size:
                    scatter(bounce.base, spans.addresses[rows[whole]], parts.astype(np.int64), total, objects=whole)
                answer[rows] = got
        return answer.tolist()  # type: ignore[no-any-return]

    def _remote(self, keys: list[str]) -> np.ndarray:
        """Which keys' objects lie in another client's segment (or in none: a miss costs the
        same either way), from the master's replica descriptors (one call). All false when this
        client's own segment could not be told: each block is then read into its parts."""
        n = len(keys)
        own = self._own_endpoint()
        if own is None:
            return np.zeros(n, dtype=bool)
        if not own:  # this client holds no segment
            return np.ones(n, dtype=bool)
        replicas = self._client.batch_get_replica_desc(keys)
        if not isinstance(replicas, dict):
            return np.zeros(n, dtype=bool)
        here = [any(_endpoint_of(r) == own for r in replicas.get(key, ())) for key in keys]
        return ~np.fromiter(here, dtype=bool, count=n)

    def _own_endpoint(self) -> str | None:
        """The transport endpoint of this client's own segment: found once, by storing a probe
        object there (``ReplicateConfig.preferred_segment``) and asking where it lies; "" when
        the client holds no segment; None when it cannot be told (then asked again next time
        only while the segment waits for its first registration)."""
        if self._endpoint_known:
            return self._endpoint
        with self._probing:
            if self._endpoint_known:
                return self._endpoint
            if not self._holds_segment:
                self._endpoint, self._endpoint_known = "", True
                return ""
            if self._mount_segment_bytes:
                return None  # the segment comes with the first registration
            self._endpoint, self._endpoint_known = self._probe(), True
            return self._endpoint

    def _probe(self) -> str | None:
        client = self._client
        key = f"kvwire-probe/{uuid.uuid4().hex}"
        try:
            config = store_module().ReplicateConfig()
            config.preferred_segment = client.get_hostname()
            if int(client.put(key, b"\0", config)) != 0:
                return None
            try:
                found = {_endpoint_of(r) for r in client.get_replica_desc(key)}
            finally:
                client.remove(key, True)
        except Exception as exc:  # the reads stay correct without it
            log.info("mooncake client %s: could not tell where its own segment is (%s); block objects are "
                     "read straight into their rows", self._master, exc)
            return None
        if len(found) != 1:
            return None
        endpoint = found.pop()
        log.debug("mooncake client %s: its own segment is at %s", client.get_hostname(), endpoint)
        return endpoint

    def _get_repeated(self, keys: list[str], spans: _Spans, n: int) -> BatchResult:
        """A get that names one object on several rows (a fetch may, V4.5): Mooncake's
        ``batch_get_into`` (and its multi-buffer form) writes only one destination of a repeated
        key yet reports every one read whole, so each object is read once, into its first row,
        and copied from there to its other rows. A key names one object, so its rows have one
        size (and, for block objects, one layout)."""
        first_row: dict[str, int] = {}
        for i, key in enumerate(keys):
            first_row.setdefault(key, i)
        read_rows = sorted(first_row.values())
        read = self._get([keys[i] for i in read_rows], spans.select(np.asarray(read_rows, dtype=np.int64)),
                         len(read_rows))
        answer_of = {row: j for j, row in enumerate(read_rows)}  # a read row -> its place in ``read``
        status = np.empty(n, dtype=np.uint8)
        reasons: dict[int, str] = {}
        for i, key in enumerate(keys):
            source = first_row[key]
            j = answer_of[source]
            status[i] = read.status[j]
            if j in read.reasons:
                reasons[i] = read.reasons[j]
            if i != source and status[i] == KeyStatus.OK:
                spans.copy(i, source)
        return BatchResult(status, reasons)

    def exists(self, keys: Sequence[str]) -> np.ndarray:
        n = len(keys)
        if n == 0:
            return np.zeros(0, dtype=bool)
        refused = self._enter(n)
        if refused is not None:
            log.warning("exists: %s; answering 'not stored' for %d key(s)", refused.first_reason(), n)
            return np.zeros(n, dtype=bool)
        try:
            answer = np.asarray(self._client.batch_is_exist(list(keys)), dtype=np.int64)
        finally:
            self._leave()
        if (answer < 0).any():
            code = int(answer[answer < 0][0])
            log.warning("exists: %s; answering 'not stored' for those keys", codes.describe("batch_is_exist", code))
        return answer == 1

    def contains(self, keys: Sequence[str]) -> BatchResult:
        """One ``batch_is_exist`` call (lookup, L1): 1 is ``OK`` (held), 0 ``MISSING``, and a
        negative code ``FAILED`` with its meaning; a refused call (closed, master unreachable)
        fails every key. Unlike :meth:`exists`, a fault is never read as "not stored"."""
        return self._batch(len(keys), lambda n: self._contains(keys, n))

    def _contains(self, keys: Sequence[str], n: int) -> BatchResult:
        answer = self._client.batch_is_exist(_as_list(keys))
        if type(answer) is list and all(a == 1 for a in answer) and len(answer) == n:
            return BatchResult.ok(n)
        found = np.asarray(answer, dtype=np.int64)
        if found.shape != (n,):
            return BatchResult.uniform(n, KeyStatus.FAILED,
                                       f"batch_is_exist answered {found.size} codes for {n} keys")
        status = np.full(n, int(KeyStatus.FAILED), dtype=np.uint8)
        status[found == 1] = int(KeyStatus.OK)
        status[found == 0] = int(KeyStatus.MISSING)
        bad = np.flatnonzero((found != 1) & (found != 0))
        reasons = {int(i): codes.describe("batch_is_exist", int(found[i])) for i in bad[:_EXPLAIN_AT_MOST].tolist()}
        for i in bad[_EXPLAIN_AT_MOST:].tolist():
            reasons[int(i)] = reasons[int(bad[0])]
        return BatchResult(status, reasons)

    def remove(self, keys: Sequence[str]) -> BatchResult:
        return self._batch(len(keys), lambda n: self._remove(keys, n))

    def _remove(self, keys: Sequence[str], n: int) -> BatchResult:
        answer = self._client.batch_remove(list(keys), False)
        return codes.remove_result(np.asarray(answer, dtype=np.int64))

    # -- lifecycle ------------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for calls in progress, unregister what is registered, close the client, and
        stop the master this driver started. Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._cond.wait_for(lambda: self._active == 0)
            self._unregister_locked(list(self._registered.values()))
            self._closed = True
        started = time.monotonic()
        try:
            if self._close_client:
                self._client.close()
        finally:
            took = time.monotonic() - started
            if took > 5:
                log.info("closing the Mooncake client took %.1f s (its master %s was unreachable)", took, self._master)
            if self._owned_master is not None:
                self._owned_master.stop()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"MooncakeDriver(master={self._master}, {state}, {len(self._registered)} region(s))"


class _Spans:
    """Where a get writes each key's object: ``addresses[i]`` (``sizes[i]`` bytes), or for block
    objects (``parts``, the part sizes) ``addresses[i, p]``, part after part; ``sizes[i]`` is
    then the object's size."""

    __slots__ = ("addresses", "sizes", "parts")

    def __init__(self, addresses: np.ndarray, sizes: np.ndarray, parts: np.ndarray | None) -> None:
        self.addresses = addresses
        self.sizes = sizes
        self.parts = parts

    def select(self, rows: np.ndarray) -> _Spans:
        return _Spans(self.addresses[rows], self.sizes[rows], self.parts)

    def read(self, client: Any, keys: list[str]) -> Any:
        """The client's answer for a get of ``keys`` into these spans: bytes read, or a code."""
        if self.parts is None:
            return client.batch_get_into(keys, self.addresses.tolist(), self.sizes.tolist())
        return client.batch_get_into_multi_buffers(keys, self.addresses.tolist(), [self.parts.tolist()] * len(keys))

    def copy(self, row: int, source: int) -> None:
        """Copy what was read into row ``source`` to row ``row`` as well."""
        if self.parts is None:
            ctypes.memmove(int(self.addresses[row]), int(self.addresses[source]), int(self.sizes[row]))
            return
        for to, fro, size in zip(self.addresses[row].tolist(), self.addresses[source].tolist(),
                                 self.parts.tolist(), strict=True):
            ctypes.memmove(to, fro, size)


def _endpoint_of(replica: Any) -> str:
    """The transport endpoint of the segment a replica descriptor names."""
    return str(replica.get_memory_descriptor().buffer_descriptor.transport_endpoint)


def _as_list(keys: Sequence[str]) -> list[str]:
    """The keys as the list the client's batch calls take (a list is passed as it is)."""
    return keys if type(keys) is list else list(keys)


#: The ``MC_*`` values this module put into the environment: those it may change again.
_ours: dict[str, str] = {}


def _apply_environment(wanted: dict[str, str]) -> None:
    """Set the ``MC_*`` variables the client reads at setup, except those the user set (a
    value already in the environment that this module did not put there wins)."""
    for key, value in wanted.items():
        current = os.environ.get(key)
        if current is None or _ours.get(key) == current:
            os.environ[key] = value
            _ours[key] = value


def _setup_failure(rc: int, master: str, settings: ClientSettings, took: float) -> str:
    if rc == -1:
        return (
            f"could not reach the Mooncake master at {master}: setup returned -1 after {took:.1f} s "
            f"({os.environ.get('MC_STORE_CLIENT_SETUP_RETRIES', settings.setup_retries)} attempt(s)). "
            "Is mooncake_master running there? Set the backend option 'master' or $MOONCAKE_MASTER, "
            "or leave both empty to start a private master."
        )
    return (
        f"Mooncake client setup against {master} failed: {codes.describe('setup', rc)} "
        f"(segment {settings.segment_bytes} bytes, local buffer {settings.local_buffer_bytes} bytes, "
        f"protocol {settings.protocol})"
    )
