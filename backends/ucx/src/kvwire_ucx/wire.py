"""The control channel's messages and their byte encoding: pickle-free, versioned, bounded.

Every frame is a 12-byte header (magic ``KVWC``, version, message type, flags, body length)
followed by the body. Decoding checks every length against the bounds below before it reads,
never executes anything, and raises :class:`WireError` for anything malformed; the caller drops
the connection and counts it.

The flow of one pull (requester R, serving end S), all on one TCP connection per pair:
``Hello`` both ways (instance id and UCX worker address). R posts receives for a first window of
rows, then sends ``Pull`` naming the blocks, with ``credit`` = how many rows it posted. S answers
every ``Pull`` exactly once, with ``Offer`` (rows served per group: a prefix) or ``Decline``;
after an ``Offer`` it sends at once the offered rows within the credit. R then posts receives for
further windows and names them with ``Go``; S sends the offered rows each ``Go`` names, and
nothing else. R ``Ack`` once every offered row arrived. Either end may stop: R ``Cancel``, S
``Decline`` (after an ``Offer``: stop). Credit and ``Go`` once given are always honoured, so no
send waits for a receive that will not come; receives for rows not offered are completed by R
itself once the answer says so.

Rows are numbered block-major: row ``i`` of group index ``g`` is ``i * groups + g``. Credit,
``Go`` and ``Ack`` count rows, as before version 3; what moves is one UCX tag message per
*message*: a run of one group's rows adjacent in memory at both ends, within one window (the
credit, or one ``Go``'s rows). Its tag is ``tag_base << 24 | number of its first row``, and it is
received into the run of rows it carries. The ``Pull`` names R's ``breaks`` (per group, the rows
whose lent slot does not follow the row before's), the ``Offer`` S's among the offered rows; a
group's breaks may be "every row on its own" (``EVERY_ROW``: what an end sends when its breaks do
not fit a frame). Both ends cut each window at the breaks of either and at the window's ends, so
they cut the same messages. The credit's receives are posted before R knows S's breaks, so the
credit goes one row per message (R keeps it to ``CREDIT_BYTES``, 1 MiB, or the window); each
``Go``'s window goes in messages, and R sizes it in receives, not bytes: as many as
``window_bytes`` of its smallest rows would take one each, so rows adjacent at both ends are
named at once (a window of bytes would take a control round trip per 64 MiB). A receive that R completes itself (rows not offered, a stop)
is drained per posted receive, as before: a zero-byte message of its tag.

One-sided pulls (the opt-in ``mode="one-sided"``, for trusted clusters): R sends the ``Pull`` as
type ``PULL_ONE_SIDED`` with no credit. A serving end in that mode answers with ``ReadOffer``
instead of ``Offer``: the rows served per group, and where they lie in its memory as runs of rows
adjacent there (per group: the address of a run's first row and its row count, the runs in row
order; version 2, where version 1 sent one address per row), with its NIXL agent's name and
metadata (remote keys of its registered regions; sent again only when they changed). R reads the
rows itself (NIXL ``READ``), rows adjacent at both ends as one span, a batch of block ranges at
once (every range of a pull up to a bound, not one after another), then ``Ack``s; no ``Go`` is
used. A serving
end declines a pull of the other mode: modes never mix (see the README). Where a served group's
rows lie in GPU memory the answer is a ``READ_OFFER_DEVICE``: the same body followed by each
group's memory (``-1`` host, else the CUDA device index), since a reader must name the memory it
reads; a ``READ_OFFER`` is all host memory.

Pushed offers (version 4, one-sided only): each end's ``Hello`` carries ``flags``; a requester in
the one-sided mode sets ``HELLO_TAKES_PUSHES``. To such a connection a serving end that serves
pushes every standing offer (O1) after its own ``Hello``, and each later one when it is made:
``PushOffer`` (offer id, the time it has left in ms, NIXL agent name, generation and metadata as a
``ReadOffer`` carries them, and per group its id, slot size, memory, name width, row count, run
count, then its names, its runs' addresses and their row counts). R keeps each connection's pushed
offers; a fetch one of them covers whole (every group, slot size and name, O1.4) is read at once
with no ``Pull``, and R sends it neither ``Ack`` nor ``Cancel``; any other goes the old way. R
starts no read from an offer past its local deadline (the push's arrival plus the time left, less
a margin) nor within the grace of it. When the offer concludes, S sends ``Withdraw`` (offer id);
R fails the fetches reading it, stops their reads, and answers ``Withdrawn`` (offer id) once
none is in flight; the offer quiesces once every connection it was pushed to answered or closed
(S closes one that has not answered within its grace). A ``PushOffer`` is decoded with every
length checked first: at most ``MAX_GROUPS`` groups, ``MAX_PUSH_ROWS`` rows a group, runs as a
``ReadOffer``'s; an offer beyond them, or beyond one frame, is not pushed.

The ``ReadOffer`` body: the head (transfer, generation, agent name bytes, metadata bytes, groups),
the agent name, the metadata, each group's row count (u32), each group's run count (u32), then per
group its runs' addresses (u64 each) followed by their row counts (u32 each), then (device only)
each group's memory (i16). The decoder refuses a group with more runs than rows, rows without a
run, a run of no rows or of more rows than the group's, and run lengths not adding up to the
group's rows; a run reaching past the 64-bit address space is refused when R takes it up. An
answer is cut to the longest common block prefix whose runs fit one frame.

Versions: every frame carries :data:`WIRE_VERSION`; a frame of another version is refused when its
header arrives (``Hello`` is the first frame each way, so two ends of different versions learn it
at once: "control frame version 3 is not supported (this end speaks 4)"). Version 4 added the
pushed offers and ``Hello.flags``: a version-3 end could not parse either, so the version moved
rather than negotiate them inside version 3.

Why one file of this size: one codec, so every frame's bounds are read and written in one place
(and fuzzed as a whole)."""

from __future__ import annotations

import collections
import enum
import struct
from dataclasses import dataclass

import numpy as np

__all__ = [
    "Ack",
    "Cancel",
    "Decline",
    "FrameReader",
    "Go",
    "Hello",
    "MAX_BLOCKS",
    "MAX_GROUPS",
    "MAX_MESSAGE_BYTES",
    "MAX_NAME_BYTES",
    "MAX_REASON_BYTES",
    "MAX_ROWS",
    "MAX_TAG_BASE",
    "MAX_WORKER_ADDRESS_BYTES",
    "Message",
    "MessageType",
    "Offer",
    "Pull",
    "PushOffer",
    "PushedGroup",
    "ReadOffer",
    "WIRE_VERSION",
    "WireError",
    "Withdraw",
    "Withdrawn",
    "clip_reason",
    "decode",
    "encode",
    "EVERY_ROW",
    "fit_breaks",
    "offer_breaks_room",
    "pull_breaks_room",
    "run_breaks",
]

MAGIC = b"KVWC"
#: 2: a ReadOffer names runs of adjacent rows (address, rows) instead of each row's address.
#: 3: a two-sided Pull and an Offer name where each end's rows stop being adjacent (``breaks``).
#: 4: pushed offers (``PushOffer``, ``Withdraw``, ``Withdrawn``) and a ``Hello`` that says
#: whether its end takes them (``flags``).
#: A frame of another version is refused when its header arrives (``Hello`` is the first frame,
#: so an end of another version is told at once: "control frame version 3 is not supported").
WIRE_VERSION = 4
#: ``Hello.flags``: this end runs one-sided and takes pushed offers on this connection.
HELLO_TAKES_PUSHES = 0x1
_HELLO_FLAGS = HELLO_TAKES_PUSHES
#: A group's ``breaks`` entry meaning "every row on its own" (no run of rows is adjacent).
EVERY_ROW = 0xFFFFFFFF
#: Bounds: a frame's body never exceeds MAX_MESSAGE_BYTES; a pull names at most MAX_BLOCKS
#: blocks for at most MAX_GROUPS groups, so a transfer moves at most MAX_ROWS rows.
MAX_MESSAGE_BYTES = 4 << 20
MAX_BLOCKS = 1 << 15
MAX_GROUPS = 1 << 9
#: Group ids travel in 32 bits; a view with a larger one is refused at submission.
MAX_GROUP_ID = (1 << 32) - 1
MAX_ROWS = 1 << 24
#: A pushed offer's bounds (contract O1.12): at most MAX_PUSH_ROWS rows per group (a pull names
#: no more blocks), at most MAX_GROUPS groups, and the whole push in one frame
#: (MAX_MESSAGE_BYTES, the NIXL metadata included); an offer beyond them is not pushed, and pulls
#: of it go the old way (a Pull, answered by a ReadOffer).
MAX_PUSH_ROWS = MAX_BLOCKS
MAX_NAME_BYTES = 64
MAX_REASON_BYTES = 1024
MAX_WORKER_ADDRESS_BYTES = 4096
#: The requester's credentials travel unread by either backend, at most this long.
MAX_CREDENTIAL_BYTES = 4096
#: A ReadOffer's group memory: -1 host, else a CUDA device index below this.
MAX_DEVICE = 1 << 10
#: A ReadOffer's NIXL agent name and metadata are at most this long.
MAX_AGENT_NAME_BYTES = 64
MAX_AGENT_METADATA_BYTES = 1 << 20
#: A transfer's UCX tags are ``tag_base << 24 | row``; tag_base has 40 bits.
TAG_ROW_BITS = 24
MAX_TAG_BASE = (1 << 40) - 1

_HEADER = struct.Struct("<4sBBHI")
HEADER_BYTES = _HEADER.size
_U64 = struct.Struct("<Q")
_U32 = struct.Struct("<I")
_PULL_HEAD = struct.Struct("<QQIHIBHI")  # transfer, tag_base, timeout_ms, groups, count, width, credentials, credit
_GROUP = struct.Struct("<IQ")  # group id, slot bytes
_OFFER_HEAD = struct.Struct("<QH")
_GO = struct.Struct("<QII")
_ACK = struct.Struct("<QI")
_TEXT_HEAD = struct.Struct("<QH")
_HELLO_HEAD = struct.Struct("<QBH")  # instance, flags, worker address bytes
_PUSH_HEAD = struct.Struct("<QQIBIH")  # offer, metadata generation, remaining ms, name bytes, metadata bytes, groups
_PUSH_GROUP = struct.Struct("<IQhBII")  # group id, slot bytes, memory, name width, rows, runs
_OFFER_ID = struct.Struct("<Q")
_READ_OFFER_HEAD = struct.Struct("<QQBIH")  # transfer, metadata generation, name bytes, metadata bytes, groups
_RUN_BYTES = 12  # a ReadOffer's run: address (u64), rows (u32)


class WireError(ValueError):
    """Bytes on the control channel are not a valid message; the message says what is wrong."""


class MessageType(enum.IntEnum):
    HELLO = 1
    PULL = 2
    OFFER = 3
    DECLINE = 4
    GO = 5
    CANCEL = 6
    ACK = 7
    PULL_ONE_SIDED = 8
    READ_OFFER = 9
    READ_OFFER_DEVICE = 10
    PUSH_OFFER = 11
    WITHDRAW = 12
    WITHDRAWN = 13


@dataclass(frozen=True, slots=True)
class Hello:
    """First message each way: who this end is and how UCX reaches its worker."""

    instance: int
    worker_address: bytes
    flags: int = 0  #: HELLO_TAKES_PUSHES: this end takes pushed offers (version 4)

    def __post_init__(self) -> None:
        _check_u64(self.instance, "Hello.instance")
        if not isinstance(self.flags, int) or self.flags & ~_HELLO_FLAGS or not 0 <= self.flags < 256:
            raise WireError(f"Hello.flags must be a combination of {_HELLO_FLAGS:#x}, got {self.flags!r}")
        if not 1 <= len(self.worker_address) <= MAX_WORKER_ADDRESS_BYTES:
            raise WireError(
                f"Hello.worker_address must be 1..{MAX_WORKER_ADDRESS_BYTES} bytes, got {len(self.worker_address)}"
            )


@dataclass(frozen=True, slots=True)
class Pull:
    """R asks for ``count`` blocks by name (``names``: ``count * width`` bytes, prefix order),
    the same blocks in every group of ``groups`` (``(group id, slot bytes)`` pairs).
    ``credentials`` are the requester holder's, passed to the serving holder unread; ``credit``
    is how many rows (block-major numbers ``[0, credit)``) R posted receives for already."""

    transfer: int
    tag_base: int
    timeout_ms: int
    groups: tuple[tuple[int, int], ...]
    width: int
    names: bytes
    credentials: bytes = b""
    credit: int = 0
    one_sided: bool = False  #: R asks to read the rows itself (encoded as type PULL_ONE_SIDED)
    #: two-sided: per group, the rows (1..count-1, ascending) whose slot at R does not follow the
    #: row before's, or ``None``: every row on its own (empty given: ``None`` for every group)
    breaks: tuple[tuple[int, ...] | None, ...] = ()

    def __post_init__(self) -> None:
        _check_u64(self.transfer, "Pull.transfer")
        if self.one_sided and self.breaks:
            raise WireError("a one-sided Pull carries no breaks (the serving end sends no rows)")
        if self.one_sided and self.credit:
            raise WireError(f"a one-sided Pull posts no receives, so its credit is 0, got {self.credit}")
        if not 0 <= self.tag_base <= MAX_TAG_BASE:
            raise WireError(f"Pull.tag_base must fit in 40 bits, got {self.tag_base}")
        if not 1 <= self.timeout_ms < 1 << 32:
            raise WireError(f"Pull.timeout_ms must be 1..2**32-1, got {self.timeout_ms}")
        if not 1 <= len(self.groups) <= MAX_GROUPS:
            raise WireError(f"a Pull names 1..{MAX_GROUPS} groups, got {len(self.groups)}")
        ids = [g for g, _ in self.groups]
        if len(set(ids)) != len(ids):
            raise WireError(f"Pull group ids must be unique, got {ids}")
        for gid, slot in self.groups:
            if not 0 <= gid <= MAX_GROUP_ID:
                raise WireError(f"Pull group id {gid} does not fit in 32 bits")
            if not 1 <= slot < 1 << 64:
                raise WireError(f"Pull slot size of group {gid} must be 1..2**64-1 bytes, got {slot}")
        if not 1 <= self.width <= MAX_NAME_BYTES:
            raise WireError(f"Pull name width must be 1..{MAX_NAME_BYTES}, got {self.width}")
        if len(self.names) % self.width:
            raise WireError(f"Pull names hold {len(self.names)} bytes, not a multiple of width {self.width}")
        if not 1 <= self.count <= MAX_BLOCKS:
            raise WireError(f"a Pull names 1..{MAX_BLOCKS} blocks, got {self.count}")
        if len(self.credentials) > MAX_CREDENTIAL_BYTES:
            raise WireError(f"Pull credentials exceed {MAX_CREDENTIAL_BYTES} bytes ({len(self.credentials)})")
        if not 0 <= self.credit <= self.count * len(self.groups):
            raise WireError(f"Pull credit must be 0..{self.count * len(self.groups)} rows, got {self.credit}")
        if not self.one_sided:
            if not self.breaks:
                object.__setattr__(self, "breaks", (None,) * len(self.groups))
            _check_breaks(self.breaks, (self.count,) * len(self.groups), "Pull")

    @property
    def count(self) -> int:
        return len(self.names) // self.width


@dataclass(frozen=True, slots=True)
class Offer:
    """S answers a pull: how many leading blocks it serves, per group in the pull's order."""

    transfer: int
    counts: tuple[int, ...]
    #: per group, the offered rows (1..count-1, ascending) whose slot at S does not follow the row
    #: before's, or ``None``: every row on its own (empty given: ``None`` for every group)
    breaks: tuple[tuple[int, ...] | None, ...] = ()

    def __post_init__(self) -> None:
        _check_u64(self.transfer, "Offer.transfer")
        if not 1 <= len(self.counts) <= MAX_GROUPS:
            raise WireError(f"an Offer gives 1..{MAX_GROUPS} counts, got {len(self.counts)}")
        if any(not 0 <= c <= MAX_BLOCKS for c in self.counts):
            raise WireError(f"Offer counts must be 0..{MAX_BLOCKS}, got {list(self.counts)}")
        if not self.breaks:
            object.__setattr__(self, "breaks", (None,) * len(self.counts))
        _check_breaks(self.breaks, self.counts, "Offer")


@dataclass(frozen=True, slots=True, eq=False)
class ReadOffer:
    """S answers a one-sided pull: ``counts`` leading blocks per group (in the pull's order), and
    ``runs[g]``, where those rows lie in S's memory as runs of rows adjacent there: an ``(n, 2)``
    uint64 array of (address of the run's first row, rows in the run), in row order, the rows
    summing to ``counts[g]`` (row ``i`` of a run lies at its address plus ``i`` slots). ``agent``
    names S's NIXL agent; ``metadata`` is that agent's metadata at ``generation`` (its registered
    regions and their remote keys), or empty when this connection was sent that generation
    already. ``memories[g]`` is where group ``g``'s rows lie: ``-1`` host memory, else the index
    of the CUDA device (empty: all host)."""

    transfer: int
    counts: tuple[int, ...]
    agent: bytes
    generation: int
    metadata: bytes
    runs: tuple[np.ndarray, ...]
    memories: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        _check_u64(self.transfer, "ReadOffer.transfer")
        _check_u64(self.generation, "ReadOffer.generation")
        if not 1 <= len(self.counts) <= MAX_GROUPS:
            raise WireError(f"a ReadOffer gives 1..{MAX_GROUPS} counts, got {len(self.counts)}")
        if any(not 0 <= c <= MAX_BLOCKS for c in self.counts):
            raise WireError(f"ReadOffer counts must be 0..{MAX_BLOCKS}, got {list(self.counts)}")
        if not 1 <= len(self.agent) <= MAX_AGENT_NAME_BYTES:
            raise WireError(f"ReadOffer.agent must be 1..{MAX_AGENT_NAME_BYTES} bytes, got {len(self.agent)}")
        if len(self.metadata) > MAX_AGENT_METADATA_BYTES:
            raise WireError(f"ReadOffer.metadata exceeds {MAX_AGENT_METADATA_BYTES} bytes ({len(self.metadata)})")
        if len(self.runs) != len(self.counts):
            raise WireError(f"a ReadOffer gives runs for {len(self.runs)} groups and counts for {len(self.counts)}")
        if self.memories and len(self.memories) != len(self.counts):
            raise WireError(f"a ReadOffer gives memories for {len(self.memories)} groups and counts for "
                            f"{len(self.counts)}")
        if any(not isinstance(m, int) or not -1 <= m < MAX_DEVICE for m in self.memories):
            raise WireError(f"ReadOffer memories must be -1 (host) or a device index 0..{MAX_DEVICE - 1}, "
                            f"got {list(self.memories)}")
        if self.memories and all(m == -1 for m in self.memories):
            object.__setattr__(self, "memories", ())  # all host: one spelling
        for g, (c, r) in enumerate(zip(self.counts, self.runs, strict=True)):
            if (not isinstance(r, np.ndarray) or r.dtype != np.uint64 or r.ndim != 2 or r.shape[1] != 2
                    or not r.shape[0] <= c):
                raise WireError(f"ReadOffer runs of group {g} must be at most {c} (address, rows) uint64 pairs, got "
                                f"{getattr(r, 'dtype', type(r).__name__)} {getattr(r, 'shape', '')}")
            _check_runs(r[:, 1], c, g)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ReadOffer):
            return NotImplemented
        return (self.transfer, self.counts, self.agent, self.generation, self.metadata, self.memories) == (
            other.transfer, other.counts, other.agent, other.generation, other.metadata, other.memories
        ) and all(np.array_equal(a, b) for a, b in zip(self.runs, other.runs, strict=True))

    __hash__ = None  # type: ignore[assignment]

    def checked_runs(self, group: int, slot_bytes: int) -> np.ndarray:
        """The runs of group index ``group``, rows of ``slot_bytes``; raises :class:`WireError`
        if a run would reach past the 64-bit address space."""
        runs = self.runs[group]
        starts, rows = runs[:, 0], runs[:, 1]
        # each run ends below 2**64 - 1: rows * slot <= 2**64 - 1 - start, checked without wrapping
        if len(runs) and np.any(rows > (np.uint64(2**64 - 1) - starts) // np.uint64(slot_bytes)):
            raise WireError(f"ReadOffer runs of group {group} reach past the 64-bit address space")
        return runs

    @staticmethod
    def body_bytes(groups: int, runs: int, agent: bytes, metadata: bytes) -> int:
        """How long the body of a ReadOffer of ``groups`` groups and ``runs`` runs in all is (at
        most: a device answer's memories counted)."""
        return _READ_OFFER_HEAD.size + len(agent) + len(metadata) + 10 * groups + _RUN_BYTES * runs


def run_breaks(addresses: np.ndarray, slot_bytes: int) -> np.ndarray:
    """The rows (after the first) that start a run, ascending: the runs of the first ``m`` rows
    number ``1 + searchsorted(breaks, m)`` (for ``m > 0``)."""
    addresses = np.asarray(addresses, dtype=np.uint64)
    if len(addresses) < 2:
        return np.zeros(0, dtype=np.int64)
    return np.flatnonzero(addresses[1:] != addresses[:-1] + np.uint64(slot_bytes)) + 1


@dataclass(frozen=True, slots=True)
class Decline:
    """S refuses a pull, or stops one it offered; ``reason`` says why."""

    transfer: int
    reason: str

    def __post_init__(self) -> None:
        _check_u64(self.transfer, "Decline.transfer")
        _check_reason(self.reason, "Decline")


@dataclass(frozen=True, slots=True)
class Go:
    """R posted receives for rows ``[start, end)`` of the transfer; S sends exactly those."""

    transfer: int
    start: int
    end: int

    def __post_init__(self) -> None:
        _check_u64(self.transfer, "Go.transfer")
        if not 0 <= self.start < self.end <= MAX_ROWS:
            raise WireError(f"Go rows must satisfy 0 <= start < end <= {MAX_ROWS}, got [{self.start}, {self.end})")


@dataclass(frozen=True, slots=True)
class Cancel:
    """R stops a pull; S sends nothing more for it beyond rows already named by ``Go``."""

    transfer: int
    reason: str

    def __post_init__(self) -> None:
        _check_u64(self.transfer, "Cancel.transfer")
        _check_reason(self.reason, "Cancel")


@dataclass(frozen=True, slots=True)
class Ack:
    """R received all ``rows`` rows of the transfer whole."""

    transfer: int
    rows: int

    def __post_init__(self) -> None:
        _check_u64(self.transfer, "Ack.transfer")
        if not 0 <= self.rows <= MAX_ROWS:
            raise WireError(f"Ack.rows must be 0..{MAX_ROWS}, got {self.rows}")


@dataclass(frozen=True, slots=True, eq=False)
class PushedGroup:
    """One group of a pushed offer: its id, slot size, memory (``-1`` host, else the CUDA
    device index), the names of its rows (``rows * width`` bytes, row order, each once) and
    where the rows lie as runs (``(n, 2)`` uint64: address of a run's first row, rows), as a
    ``ReadOffer`` names them."""

    group_id: int
    slot_bytes: int
    memory: int
    width: int
    names: bytes
    runs: np.ndarray

    @property
    def rows(self) -> int:
        return len(self.names) // self.width

    def __post_init__(self) -> None:
        if not 0 <= self.group_id <= MAX_GROUP_ID:
            raise WireError(f"PushOffer group id {self.group_id} does not fit in 32 bits")
        if not 1 <= self.slot_bytes < 1 << 64:
            raise WireError(f"PushOffer slot size of group {self.group_id} must be 1..2**64-1 bytes, "
                            f"got {self.slot_bytes}")
        if not -1 <= self.memory < MAX_DEVICE:
            raise WireError(f"PushOffer memory of group {self.group_id} must be -1 (host) or a device index "
                            f"0..{MAX_DEVICE - 1}, got {self.memory}")
        if not 1 <= self.width <= MAX_NAME_BYTES:
            raise WireError(f"PushOffer name width of group {self.group_id} must be 1..{MAX_NAME_BYTES}, "
                            f"got {self.width}")
        if len(self.names) % self.width:
            raise WireError(f"PushOffer names of group {self.group_id} hold {len(self.names)} bytes, not a multiple "
                            f"of width {self.width}")
        rows = self.rows
        if rows > MAX_PUSH_ROWS:
            raise WireError(f"a PushOffer group holds at most {MAX_PUSH_ROWS} rows, group {self.group_id} has {rows}")
        if self.runs.ndim != 2 or self.runs.shape[1] != 2 or len(self.runs) > rows or (rows and not len(self.runs)):
            raise WireError(f"PushOffer group {self.group_id} gives {len(self.runs)} runs for {rows} rows "
                            f"(1..{rows} when it has rows)")
        _check_runs(self.runs[:, 1], rows, self.group_id, "PushOffer")
        starts, counts = self.runs[:, 0], self.runs[:, 1]
        if len(counts) and np.any(counts > (np.uint64(2**64 - 1) - starts) // np.uint64(self.slot_bytes)):
            raise WireError(f"PushOffer runs of group {self.group_id} reach past the 64-bit address space")


@dataclass(frozen=True, slots=True, eq=False)
class PushOffer:
    """S pushes a standing offer (O1) to an R that takes pushes (version 4): R may read the
    rows of any pull that this offer covers whole without asking (no ``Pull``), for
    ``remaining_ms`` from when the push arrived (less a margin), until S sends ``Withdraw``.
    ``agent``/``generation``/``metadata`` are as in a ``ReadOffer`` (metadata empty when this
    connection was sent that generation already); ``groups`` are the offer's groups."""

    offer: int
    remaining_ms: int
    agent: bytes
    generation: int
    metadata: bytes
    groups: tuple[PushedGroup, ...]

    def __post_init__(self) -> None:
        _check_u64(self.offer, "PushOffer.offer")
        _check_u64(self.generation, "PushOffer.generation")
        if not 1 <= self.remaining_ms < 1 << 32:
            raise WireError(f"PushOffer.remaining_ms must be 1..2**32-1, got {self.remaining_ms}")
        if not 1 <= len(self.agent) <= MAX_AGENT_NAME_BYTES:
            raise WireError(f"PushOffer.agent must be 1..{MAX_AGENT_NAME_BYTES} bytes, got {len(self.agent)}")
        if len(self.metadata) > MAX_AGENT_METADATA_BYTES:
            raise WireError(f"PushOffer.metadata exceeds {MAX_AGENT_METADATA_BYTES} bytes ({len(self.metadata)})")
        if not 1 <= len(self.groups) <= MAX_GROUPS:
            raise WireError(f"a PushOffer gives 1..{MAX_GROUPS} groups, got {len(self.groups)}")
        ids = [g.group_id for g in self.groups]
        if len(set(ids)) != len(ids):
            raise WireError(f"PushOffer group ids must be unique, got {ids}")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, PushOffer):
            return NotImplemented
        return (self.offer, self.remaining_ms, self.agent, self.generation, self.metadata, len(self.groups)) == (
            other.offer, other.remaining_ms, other.agent, other.generation, other.metadata, len(other.groups)
        ) and all(_same_group(a, b) for a, b in zip(self.groups, other.groups, strict=True))

    __hash__ = None  # type: ignore[assignment]

    @staticmethod
    def body_bytes(groups: tuple[tuple[int, int, int], ...], agent: bytes, metadata: bytes) -> int:
        """How long the body of a push is whose groups have ``(rows, width, runs)`` each."""
        return (_PUSH_HEAD.size + len(agent) + len(metadata)
                + sum(_PUSH_GROUP.size + rows * width + _RUN_BYTES * runs for rows, width, runs in groups))


def _same_group(a: PushedGroup, b: PushedGroup) -> bool:
    return (a.group_id, a.slot_bytes, a.memory, a.width, a.names) == (b.group_id, b.slot_bytes, b.memory, b.width,
                                                                      b.names) and np.array_equal(a.runs, b.runs)


@dataclass(frozen=True, slots=True)
class Withdraw:
    """S withdraws the offer it pushed: R starts no more reads of it, fails those in flight,
    and answers ``Withdrawn`` once none is."""

    offer: int

    def __post_init__(self) -> None:
        _check_u64(self.offer, "Withdraw.offer")


@dataclass(frozen=True, slots=True)
class Withdrawn:
    """R answers a ``Withdraw``: no read of that offer is in flight at this end, nor will be."""

    offer: int

    def __post_init__(self) -> None:
        _check_u64(self.offer, "Withdrawn.offer")


Message = Hello | Pull | Offer | ReadOffer | Decline | Go | Cancel | Ack | PushOffer | Withdraw | Withdrawn


def clip_reason(reason: str) -> str:
    """``reason`` cut to what a message can carry (whole UTF-8 characters)."""
    raw = reason.encode("utf-8", "replace")
    return raw[:MAX_REASON_BYTES].decode("utf-8", "ignore")


def encode(message: Message) -> bytes:
    """One frame: header plus body."""
    kind: MessageType
    if isinstance(message, Hello):
        kind = MessageType.HELLO
        body = _HELLO_HEAD.pack(message.instance, message.flags, len(message.worker_address)) + message.worker_address
    elif isinstance(message, Pull):
        kind = MessageType.PULL_ONE_SIDED if message.one_sided else MessageType.PULL
        head = _PULL_HEAD.pack(
            message.transfer, message.tag_base, message.timeout_ms, len(message.groups), message.count,
            message.width, len(message.credentials), message.credit,
        )
        # one join: a pull of 16384 blocks carries 256 KiB of names, and each ``+`` copied them
        body = b"".join((head, *(_GROUP.pack(g, s) for g, s in message.groups), message.names, message.credentials,
                         _pack_breaks(message.breaks)))
    elif isinstance(message, Offer):
        kind = MessageType.OFFER
        body = _OFFER_HEAD.pack(message.transfer, len(message.counts)) + struct.pack(
            f"<{len(message.counts)}I", *message.counts
        ) + _pack_breaks(message.breaks)
    elif isinstance(message, ReadOffer):
        kind = MessageType.READ_OFFER_DEVICE if message.memories else MessageType.READ_OFFER
        head = _READ_OFFER_HEAD.pack(message.transfer, message.generation, len(message.agent),
                                     len(message.metadata), len(message.counts))
        memories = struct.pack(f"<{len(message.memories)}h", *message.memories) if message.memories else b""
        ngroups = len(message.counts)
        body = b"".join((head, message.agent, message.metadata,
                         struct.pack(f"<{ngroups}I", *message.counts),
                         struct.pack(f"<{ngroups}I", *(len(r) for r in message.runs)),
                         *(part for r in message.runs
                           for part in (r[:, 0].astype("<u8").tobytes(), r[:, 1].astype("<u4").tobytes())),
                         memories))
    elif isinstance(message, (Decline, Cancel)):
        kind = MessageType.DECLINE if isinstance(message, Decline) else MessageType.CANCEL
        raw = message.reason.encode()
        body = _TEXT_HEAD.pack(message.transfer, len(raw)) + raw
    elif isinstance(message, Go):
        kind = MessageType.GO
        body = _GO.pack(message.transfer, message.start, message.end)
    elif isinstance(message, Ack):
        kind = MessageType.ACK
        body = _ACK.pack(message.transfer, message.rows)
    elif isinstance(message, PushOffer):
        kind = MessageType.PUSH_OFFER
        head = _PUSH_HEAD.pack(message.offer, message.generation, message.remaining_ms, len(message.agent),
                               len(message.metadata), len(message.groups))
        body = b"".join((head, message.agent, message.metadata,
                         *(_PUSH_GROUP.pack(g.group_id, g.slot_bytes, g.memory, g.width, g.rows, len(g.runs))
                           for g in message.groups),
                         *(part for g in message.groups
                           for part in (g.names, g.runs[:, 0].astype("<u8").tobytes(),
                                        g.runs[:, 1].astype("<u4").tobytes()))))
    elif isinstance(message, (Withdraw, Withdrawn)):
        kind = MessageType.WITHDRAW if isinstance(message, Withdraw) else MessageType.WITHDRAWN
        body = _OFFER_ID.pack(message.offer)
    else:
        raise TypeError(f"not a control-channel message: {type(message).__name__}")
    if len(body) > MAX_MESSAGE_BYTES:
        raise WireError(f"message body of {len(body)} bytes exceeds {MAX_MESSAGE_BYTES}")
    return _HEADER.pack(MAGIC, WIRE_VERSION, kind, 0, len(body)) + body


def read_header(header: bytes | memoryview) -> tuple[MessageType, int]:
    """The type and body length a header announces; checks magic, version, flags and bound."""
    if len(header) != HEADER_BYTES:
        raise WireError(f"a frame header is {HEADER_BYTES} bytes, got {len(header)}")
    magic, version, kind, flags, length = _HEADER.unpack(header)
    if magic != MAGIC:
        raise WireError(f"not a kvwire-ucx control frame: bad magic {magic!r}")
    if version != WIRE_VERSION:
        raise WireError(f"control frame version {version} is not supported (this end speaks {WIRE_VERSION})")
    try:
        message_type = MessageType(kind)
    except ValueError:
        raise WireError(f"unknown control message type {kind}") from None
    if flags:
        raise WireError(f"control frame flags must be 0, got {flags:#x}")
    if length > MAX_MESSAGE_BYTES:
        raise WireError(f"control frame announces {length} bytes, more than the maximum {MAX_MESSAGE_BYTES}")
    return message_type, length


def decode(frame: bytes) -> Message:
    """Decode exactly one whole frame; anything else raises :class:`WireError`."""
    frame = bytes(frame)
    if len(frame) < HEADER_BYTES:
        raise WireError(f"a frame is at least {HEADER_BYTES} bytes, got {len(frame)}")
    kind, length = read_header(frame[:HEADER_BYTES])
    if len(frame) - HEADER_BYTES != length:
        raise WireError(f"frame header announces {length} body bytes, got {len(frame) - HEADER_BYTES}")
    return decode_body(kind, frame[HEADER_BYTES:])


def decode_body(kind: MessageType, body: bytes | memoryview) -> Message:
    """The message of type ``kind`` whose body is exactly ``body``."""
    reader = _Reader(body)
    try:
        message = _decode(kind, reader)
    except struct.error as exc:  # only from unpacking a slice of checked length; belt and braces
        raise WireError(f"malformed {kind.name} body: {exc}") from None
    if reader.left():
        raise WireError(f"{kind.name} body has {reader.left()} trailing bytes")
    return message


def _decode(kind: MessageType, reader: _Reader) -> Message:
    if kind is MessageType.HELLO:
        instance, flags, size = reader.unpack(_HELLO_HEAD)
        if size > MAX_WORKER_ADDRESS_BYTES:
            raise WireError(f"Hello worker address of {size} bytes exceeds {MAX_WORKER_ADDRESS_BYTES}")
        return Hello(instance, reader.take(size), flags)
    if kind in (MessageType.PULL, MessageType.PULL_ONE_SIDED):
        transfer, tag_base, timeout_ms, ngroups, count, width, credential_bytes, credit = reader.unpack(_PULL_HEAD)
        if not 1 <= ngroups <= MAX_GROUPS:
            raise WireError(f"a Pull names 1..{MAX_GROUPS} groups, got {ngroups}")
        if not 1 <= count <= MAX_BLOCKS:
            raise WireError(f"a Pull names 1..{MAX_BLOCKS} blocks, got {count}")
        if not 1 <= width <= MAX_NAME_BYTES:
            raise WireError(f"Pull name width must be 1..{MAX_NAME_BYTES}, got {width}")
        if credential_bytes > MAX_CREDENTIAL_BYTES:
            raise WireError(f"Pull credentials of {credential_bytes} bytes exceed {MAX_CREDENTIAL_BYTES}")
        groups = tuple((gid, slot) for gid, slot in (reader.unpack(_GROUP) for _ in range(ngroups)))
        names = reader.take(count * width)
        credentials = reader.take(credential_bytes)
        one_sided = kind is MessageType.PULL_ONE_SIDED
        breaks = () if one_sided else _unpack_breaks(reader, (count,) * ngroups, "Pull")
        return Pull(transfer, tag_base, timeout_ms, groups, width, names, credentials, credit, one_sided=one_sided,
                    breaks=breaks)
    if kind is MessageType.OFFER:
        transfer, ngroups = reader.unpack(_OFFER_HEAD)
        if not 1 <= ngroups <= MAX_GROUPS:
            raise WireError(f"an Offer gives 1..{MAX_GROUPS} counts, got {ngroups}")
        counts = struct.unpack(f"<{ngroups}I", reader.take(4 * ngroups))
        if any(c > MAX_BLOCKS for c in counts):
            raise WireError(f"Offer counts must be 0..{MAX_BLOCKS}, got {list(counts)}")
        return Offer(transfer, tuple(counts), _unpack_breaks(reader, counts, "Offer"))
    if kind in (MessageType.READ_OFFER, MessageType.READ_OFFER_DEVICE):
        transfer, generation, name_bytes, metadata_bytes, ngroups = reader.unpack(_READ_OFFER_HEAD)
        if not 1 <= name_bytes <= MAX_AGENT_NAME_BYTES:
            raise WireError(f"ReadOffer agent name must be 1..{MAX_AGENT_NAME_BYTES} bytes, got {name_bytes}")
        if metadata_bytes > MAX_AGENT_METADATA_BYTES:
            raise WireError(f"ReadOffer metadata of {metadata_bytes} bytes exceeds {MAX_AGENT_METADATA_BYTES}")
        if not 1 <= ngroups <= MAX_GROUPS:
            raise WireError(f"a ReadOffer gives 1..{MAX_GROUPS} counts, got {ngroups}")
        agent = reader.take(name_bytes)
        metadata = reader.take(metadata_bytes)
        counts = struct.unpack(f"<{ngroups}I", reader.take(4 * ngroups))
        if any(c > MAX_BLOCKS for c in counts):
            raise WireError(f"ReadOffer counts must be 0..{MAX_BLOCKS}, got {list(counts)}")
        nruns = struct.unpack(f"<{ngroups}I", reader.take(4 * ngroups))
        for g, (c, n) in enumerate(zip(counts, nruns, strict=True)):
            if n > c or (c and not n):
                raise WireError(f"ReadOffer group {g} gives {n} runs for {c} rows (1..{c} when it has rows)")
        runs = []
        for g, (c, n) in enumerate(zip(counts, nruns, strict=True)):
            pairs = np.empty((n, 2), dtype=np.uint64)
            pairs[:, 0] = np.frombuffer(reader.take(8 * n), dtype="<u8")
            pairs[:, 1] = np.frombuffer(reader.take(4 * n), dtype="<u4")
            _check_runs(pairs[:, 1], c, g)
            runs.append(pairs)
        memories: tuple[int, ...] = ()
        if kind is MessageType.READ_OFFER_DEVICE:
            memories = struct.unpack(f"<{ngroups}h", reader.take(2 * ngroups))
            if any(not -1 <= m < MAX_DEVICE for m in memories) or all(m == -1 for m in memories):
                raise WireError(f"READ_OFFER_DEVICE memories must be -1 or 0..{MAX_DEVICE - 1}, one a device, got "
                                f"{list(memories)}")
        return ReadOffer(transfer, tuple(counts), agent, generation, metadata, tuple(runs), memories)

    if kind in (MessageType.DECLINE, MessageType.CANCEL):
        transfer, size = reader.unpack(_TEXT_HEAD)
        if size > MAX_REASON_BYTES:
            raise WireError(f"{kind.name} reason of {size} bytes exceeds {MAX_REASON_BYTES}")
        try:
            reason = reader.take(size).decode()
        except UnicodeDecodeError:
            raise WireError(f"{kind.name} reason is not valid UTF-8") from None
        return Decline(transfer, reason) if kind is MessageType.DECLINE else Cancel(transfer, reason)
    if kind is MessageType.PUSH_OFFER:
        return _decode_push(reader)
    if kind in (MessageType.WITHDRAW, MessageType.WITHDRAWN):
        (offer,) = reader.unpack(_OFFER_ID)
        return Withdraw(offer) if kind is MessageType.WITHDRAW else Withdrawn(offer)
    if kind is MessageType.GO:
        return Go(*reader.unpack(_GO))
    if kind is MessageType.ACK:
        return Ack(*reader.unpack(_ACK))
    raise WireError(f"unknown control message type {kind}")  # pragma: no cover - enum is closed


def _decode_push(reader: _Reader) -> PushOffer:
    offer, generation, remaining_ms, name_bytes, metadata_bytes, ngroups = reader.unpack(_PUSH_HEAD)
    if not 1 <= name_bytes <= MAX_AGENT_NAME_BYTES:
        raise WireError(f"PushOffer agent name must be 1..{MAX_AGENT_NAME_BYTES} bytes, got {name_bytes}")
    if metadata_bytes > MAX_AGENT_METADATA_BYTES:
        raise WireError(f"PushOffer metadata of {metadata_bytes} bytes exceeds {MAX_AGENT_METADATA_BYTES}")
    if not 1 <= ngroups <= MAX_GROUPS:
        raise WireError(f"a PushOffer gives 1..{MAX_GROUPS} groups, got {ngroups}")
    agent = reader.take(name_bytes)
    metadata = reader.take(metadata_bytes)
    heads = [reader.unpack(_PUSH_GROUP) for _ in range(ngroups)]
    for gid, _, _, width, rows, nruns in heads:  # every length checked before any is read
        if not 1 <= width <= MAX_NAME_BYTES:
            raise WireError(f"PushOffer name width of group {gid} must be 1..{MAX_NAME_BYTES}, got {width}")
        if rows > MAX_PUSH_ROWS:
            raise WireError(f"a PushOffer group holds at most {MAX_PUSH_ROWS} rows, group {gid} has {rows}")
        if nruns > rows or (rows and not nruns):
            raise WireError(f"PushOffer group {gid} gives {nruns} runs for {rows} rows (1..{rows} when it has rows)")
    groups = []
    for gid, slot, memory, width, rows, nruns in heads:
        names = reader.take(rows * width)
        runs = np.empty((nruns, 2), dtype=np.uint64)
        runs[:, 0] = np.frombuffer(reader.take(8 * nruns), dtype="<u8")
        runs[:, 1] = np.frombuffer(reader.take(4 * nruns), dtype="<u4")
        groups.append(PushedGroup(gid, slot, memory, width, names, runs))
    return PushOffer(offer, remaining_ms, agent, generation, metadata, tuple(groups))


class FrameReader:
    """Cuts a byte stream into messages. Rejects a bad header as soon as its 12 bytes arrive, so
    an oversized or foreign frame is never buffered.

    The chunks read are kept as they came and joined once, when a frame is whole: a frame in one
    chunk is decoded from it without a copy. (A bytearray that took each chunk and gave up each
    frame copied a 256 KiB Pull four times, ~0.3 ms on a two-core host.)"""

    __slots__ = ("_chunks", "_offset", "_size", "_need")

    def __init__(self) -> None:
        self._chunks: collections.deque[bytes] = collections.deque()
        self._offset = 0  # bytes of the first chunk already taken
        self._size = 0    # bytes held, from the offset on
        self._need: tuple[MessageType, int] | None = None

    def feed(self, *chunks: bytes) -> list[Message]:
        """Messages completed by ``chunks`` (read in this order), in order; raises
        :class:`WireError` on garbage."""
        for chunk in chunks:
            if chunk:
                self._chunks.append(chunk)
                self._size += len(chunk)
        out: list[Message] = []
        while True:
            if self._need is None:
                if self._size < HEADER_BYTES:
                    return out
                self._need = read_header(self._take(HEADER_BYTES))
            kind, length = self._need
            if self._size < length:
                return out
            body = self._take(length)
            self._need = None
            out.append(decode_body(kind, body))

    def _take(self, n: int) -> bytes | memoryview:
        """The next ``n`` held bytes (at most one copy, none for a whole chunk)."""
        if not n:
            return b""  # an empty body (no valid message has one: the decoder refuses it)
        self._size -= n
        first, at = self._chunks[0], self._offset
        if len(first) - at >= n:
            if at == 0 and len(first) == n:
                self._chunks.popleft()
                return first
            self._offset = at + n
            if self._offset == len(first):
                self._chunks.popleft()
                self._offset = 0
            return memoryview(first)[at:at + n]
        parts: list[bytes | memoryview] = []
        while n:
            first, at = self._chunks[0], self._offset
            part = min(n, len(first) - at)
            parts.append(memoryview(first)[at:at + part])
            n -= part
            if at + part == len(first):
                self._chunks.popleft()
                self._offset = 0
            else:
                self._offset = at + part
        return b"".join(parts)

    @property
    def buffered(self) -> int:
        """Bytes held waiting for the rest of a frame."""
        return self._size + (HEADER_BYTES if self._need is not None else 0)


class _Reader:
    __slots__ = ("data", "pos")

    def __init__(self, data: bytes | memoryview) -> None:
        self.data = data
        self.pos = 0

    def _check(self, n: int) -> None:
        if n > len(self.data) - self.pos:
            raise WireError(f"message ends early: wanted {n} bytes at offset {self.pos} of {len(self.data)}")

    def take(self, n: int) -> bytes:
        self._check(n)
        chunk = self.data[self.pos : self.pos + n]
        self.pos += n
        return chunk if isinstance(chunk, bytes) else bytes(chunk)

    def unpack(self, layout: struct.Struct) -> tuple[int, ...]:
        self._check(layout.size)
        values = layout.unpack_from(self.data, self.pos)
        self.pos += layout.size
        return values

    def left(self) -> int:
        return len(self.data) - self.pos


def _check_u64(value: int, what: str) -> None:
    if not isinstance(value, int) or not 0 <= value < 1 << 64:
        raise WireError(f"{what} must be an unsigned 64-bit int, got {value!r}")


def _check_breaks(breaks: tuple[tuple[int, ...] | None, ...], rows: tuple[int, ...], what: str) -> None:
    """Per group: ``None``, or rows in 1..rows-1, strictly ascending."""
    if len(breaks) != len(rows):
        raise WireError(f"a {what} gives breaks for {len(breaks)} groups, not {len(rows)}")
    for g, (b, n) in enumerate(zip(breaks, rows, strict=True)):
        if b is None:
            continue
        if not isinstance(b, tuple) or len(b) > max(n - 1, 0):
            raise WireError(f"{what} breaks of group {g} must be a tuple of at most {max(n - 1, 0)} rows")
        if not b:
            continue
        rows_at = np.asarray(b)
        if (rows_at.dtype.kind not in "iu" or rows_at.ndim != 1 or int(rows_at[0]) < 1 or int(rows_at[-1]) >= n
                or (len(rows_at) > 1 and bool((np.diff(rows_at) <= 0).any()))):
            raise WireError(f"{what} breaks of group {g} must be rows ascending strictly within 1..{n - 1}")


def _pack_breaks(breaks: tuple[tuple[int, ...] | None, ...]) -> bytes:
    """Per group: a u32 count (EVERY_ROW for ``None``), then that many u32 rows."""
    parts = []
    for b in breaks:
        if b is None:
            parts.append(_U32.pack(EVERY_ROW))
        else:
            parts.append(_U32.pack(len(b)) + struct.pack(f"<{len(b)}I", *b))
    return b"".join(parts)


def _unpack_breaks(reader: _Reader, rows: tuple[int, ...], what: str) -> tuple[tuple[int, ...] | None, ...]:
    out: list[tuple[int, ...] | None] = []
    for g, n in enumerate(rows):
        (size,) = reader.unpack(_U32)
        if size == EVERY_ROW:
            out.append(None)
            continue
        if size > max(n - 1, 0):
            raise WireError(f"{what} group {g} gives {size} breaks for {n} rows (at most {max(n - 1, 0)})")
        out.append(struct.unpack(f"<{size}I", reader.take(4 * size)))
    breaks = tuple(out)
    _check_breaks(breaks, rows, what)
    return breaks


def fit_breaks(breaks: tuple[tuple[int, ...] | None, ...], room: int) -> tuple[tuple[int, ...] | None, ...]:
    """``breaks`` in at most ``room`` encoded bytes: the groups with the most breaks become
    ``None`` (every row on its own: always true, only slower) until they fit."""
    size = sum(4 + 4 * len(b) for b in breaks if b is not None) + 4 * sum(b is None for b in breaks)
    if size <= room:
        return breaks
    out = list(breaks)
    for g in sorted((g for g, b in enumerate(breaks) if b), key=lambda g: -len(breaks[g] or ())):
        size -= 4 * len(out[g] or ())
        out[g] = None
        if size <= room:
            break
    return tuple(out)


def pull_breaks_room(groups: int, names: int, credentials: int) -> int:
    """The bytes a Pull of ``groups`` groups, ``names`` name bytes and ``credentials`` bytes
    leaves for its breaks."""
    return MAX_MESSAGE_BYTES - _PULL_HEAD.size - _GROUP.size * groups - names - credentials


def offer_breaks_room(groups: int) -> int:
    """The bytes an Offer of ``groups`` groups leaves for its breaks."""
    return MAX_MESSAGE_BYTES - _OFFER_HEAD.size - 4 * groups


def _check_runs(rows: np.ndarray, count: int, group: int, what: str = "ReadOffer") -> None:
    """A group's run lengths: each at least one row, summing to its ``count`` rows."""
    if len(rows) and (int(rows.min()) < 1 or int(rows.max()) > count):
        raise WireError(f"{what} runs of group {group} must be 1..{count} rows each")
    if int(rows.sum()) != count:
        raise WireError(f"{what} runs of group {group} hold {int(rows.sum())} rows, not its {count}")


def _check_reason(reason: str, what: str) -> None:
    if not isinstance(reason, str):
        raise WireError(f"{what}.reason must be a str, got {type(reason).__name__}")
    try:
        size = len(reason.encode())
    except UnicodeEncodeError:
        raise WireError(f"{what}.reason is not encodable as UTF-8; pass it through clip_reason()") from None
    if size > MAX_REASON_BYTES:
        raise WireError(f"{what}.reason exceeds {MAX_REASON_BYTES} bytes")
