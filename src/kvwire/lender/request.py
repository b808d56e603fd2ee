"""A request's hold on the cache: its tokens, its block table, its state slots, and which of its
rows are valid. Its bookkeeping lives in its own methods, which only the
:class:`~kvwire.lender.Lender` that opened it calls, under its lock; the read-only arrays it
exposes are the caller's to read at any time."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np

from kvwire.lender.errors import LeaseError
from kvwire.lender.names import chain_names, names_array, state_name

if TYPE_CHECKING:
    from collections.abc import Mapping

__all__ = ["Request"]


def _readonly(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.setflags(write=False)
    return view


class Request:
    """What :meth:`Lender.open_request` returns: the request pins its block slots (reused ones
    and allocated ones) and state slots until :meth:`Lender.close_request`.

    ``cached_tokens`` tokens were found in the reuse tree at open and need not be computed;
    ``block_table[i]`` is the slot of block ``i`` in every PAGED pool; ``state_slots[group_id]``
    is the request's slot in each STATE pool.

    A lender that keeps STATE checkpoints (``Lender(..., checkpoints=True)``) gives every block
    of the request a checkpoint row in each STATE pool (``checkpoint_rows[i]``): the state after
    block ``i``. ``checkpointed[i]`` says whether that row holds it, in every STATE group."""

    __slots__ = (
        "request_id", "prompt_tokens", "cached_tokens", "_block_tokens", "_root", "_block_table", "_state_slots",
        "_token_buf", "_length", "_keys", "_names", "_valid", "_writing", "_state_writing", "_state_reading",
        "_committed", "_computed", "_checkpoints", "_extra_pins", "_closed", "_ckpt_rows", "_ckpt",
        "_ckpt_writing",
    )

    def __init__(self, request_id: int, tokens: np.ndarray, capacity_tokens: int, block_tokens: int,
                 root: bytes, block_table: np.ndarray, state_slots: dict[int, int], keys: list[bytes],
                 paged_groups: int, cached_blocks: int, checkpoint_rows: np.ndarray | None = None,
                 checkpointed: np.ndarray | None = None) -> None:
        self.request_id = request_id
        self.prompt_tokens = int(tokens.size)
        self.cached_tokens = cached_blocks * block_tokens
        self._block_tokens = block_tokens
        self._root = root  # the scope digest: the name chain's start
        self._block_table = block_table
        self._block_table.setflags(write=False)
        self._state_slots = MappingProxyType(dict(state_slots))
        self._token_buf = np.zeros(capacity_tokens, dtype="<i8")
        self._token_buf[: tokens.size] = tokens
        self._length = int(tokens.size)
        self._keys = keys
        self._names = names_array(keys)
        blocks = block_table.size
        self._valid = np.zeros((paged_groups, blocks), dtype=bool)
        self._valid[:, :cached_blocks] = True
        self._writing = np.zeros(blocks, dtype=bool)
        self._state_writing = False
        self._state_reading = 0  # unstaged read leases that lend the state slots in place
        self._committed = cached_blocks
        self._computed = self.cached_tokens
        self._checkpoints: dict[int, int | None] = {gid: None for gid in state_slots}
        self._extra_pins: list[int] = []
        self._closed = False
        self._ckpt_rows = checkpoint_rows
        if checkpoint_rows is not None:
            checkpoint_rows.setflags(write=False)
            for gid in self._checkpoints:
                self._checkpoints[gid] = self.cached_tokens  # the lender restored the state there
        self._ckpt = np.zeros(blocks, dtype=bool)
        if checkpointed is not None:
            self._ckpt[: checkpointed.size] = checkpointed
        self._ckpt_writing = False

    # -- what anyone may read ----------------------------------------------------------------

    @property
    def tokens(self) -> np.ndarray:
        """The request's tokens so far (prompt, then any added by ``Lender.extend``); read-only."""
        return _readonly(self._token_buf[: self._length])

    @property
    def length(self) -> int:
        """Tokens so far."""
        return self._length

    @property
    def block_table(self) -> np.ndarray:
        """Slot of each block (int64, read-only), enough for the prompt plus ``max_new_tokens``."""
        return self._block_table

    @property
    def state_slots(self) -> Mapping[int, int]:
        return self._state_slots

    @property
    def names(self) -> np.ndarray:
        """Names of the request's whole blocks so far, ``(blocks, 32)`` uint8, read-only."""
        return _readonly(self._names)

    def block_key(self, block: int) -> bytes:
        """The name of whole block ``block`` as bytes."""
        return self._keys[block]

    @property
    def checkpoint_rows(self) -> np.ndarray | None:
        """Each block's checkpoint row in every STATE pool (int64, read-only), or ``None`` when
        the lender keeps no checkpoints: the model writes the state after block ``i`` there."""
        return self._ckpt_rows

    @property
    def checkpointed(self) -> np.ndarray:
        """Per block, whether its checkpoint row holds the state after it (read-only)."""
        return _readonly(self._ckpt)

    @property
    def committed_blocks(self) -> int:
        """Leading blocks named and committed (reused at open, or put in the tree by commit)."""
        return self._committed

    @property
    def checkpoints(self) -> Mapping[int, int | None]:
        """Each STATE group's exact checkpoint (token count), ``None`` where none is held."""
        return MappingProxyType(dict(self._checkpoints))

    def checkpoint(self, group_id: int) -> int | None:
        return self._checkpoints[group_id]

    @property
    def extra_pins(self) -> tuple[int, ...]:
        """Tree slots this request pins besides its block table: blocks whose name the tree held
        under another slot when this request committed its own copy."""
        return tuple(self._extra_pins)

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the lender's bookkeeping (called under the lender's lock) ------------------------------

    def extend(self, new: np.ndarray) -> None:
        """Appends ``new`` tokens within the request's room and names the blocks they complete."""
        end = self._length + new.size
        if end > self._token_buf.size:
            raise ValueError(
                f"request {self.request_id} has room for {self._token_buf.size} tokens; "
                f"extending by {new.size} would make {end} (open it with a larger max_new_tokens)"
            )
        self._token_buf[self._length:end] = new
        self._length = end
        known = len(self._keys)
        parent = self._keys[-1] if known else self._root
        more = chain_names(self._token_buf[:end], self._block_tokens, parent, known)
        if more:
            self._keys.extend(more)
            self._names = np.concatenate([self._names, names_array(more)])

    def check_commit(self, upto_tokens: int, checkpoint: int, has_state: bool) -> None:
        """Raises unless blocks up to ``upto_tokens`` and the state at ``checkpoint`` may be
        committed now (in range, not lent for writing, state not lent in place for reading)."""
        if not 0 <= upto_tokens <= self._length:
            raise ValueError(
                f"upto_tokens must lie in [0, {self._length}] for request {self.request_id}, got {upto_tokens}"
            )
        start, stop = self._committed, upto_tokens // self._block_tokens
        if stop > start and self._writing[start:stop].any():
            busy = start + int(np.argmax(self._writing[start:stop]))
            raise LeaseError(
                f"block {busy} of request {self.request_id} is lent for writing; release the write lease before commit"
            )
        if not has_state:
            return
        if self._state_writing:
            raise LeaseError(f"the state of request {self.request_id} is lent for writing; release first")
        moves = any(c != checkpoint for c in self._checkpoints.values())
        if moves and self._state_reading:
            raise LeaseError(
                f"the state of request {self.request_id} is lent for reading in place; release that "
                "lease (or lend it staged, which reads a copy) before the state moves"
            )
        if not 0 <= checkpoint <= self._length:
            raise ValueError(f"state_tokens must lie in [0, {self._length}], got {checkpoint}")

    def committed(self, upto_tokens: int, checkpoint: int, extra_pins: Iterable[int],
                  computed_from: int | None = None) -> None:
        """Records a commit :meth:`check_commit` allowed: blocks up to ``upto_tokens`` valid and
        committed, every STATE group at ``checkpoint``, and the tree slots it pinned besides.
        ``computed_from``: the model computed ``[computed_from, upto_tokens)`` and wrote the
        checkpoint of every block it completed there."""
        stop = upto_tokens // self._block_tokens
        if computed_from is not None and self._ckpt_rows is not None:
            self._ckpt[computed_from // self._block_tokens:stop] = True  # blocks ending after it
        self._valid[:, :stop] = True
        self._extra_pins.extend(extra_pins)
        self._committed = max(self._committed, stop)
        self._computed = max(self._computed, upto_tokens)
        for gid in self._checkpoints:
            self._checkpoints[gid] = checkpoint

    def close(self) -> np.ndarray | None:
        """Marks the request closed; the tree slots it pinned besides its block table (to unpin),
        or ``None`` if it was closed already."""
        if self._closed:
            return None
        self._closed = True
        extra = np.array(self._extra_pins, dtype=np.int64)
        self._extra_pins.clear()
        return extra

    def resume_bounds(self, paged: bool, state: bool) -> int:
        """See :meth:`Lender.resume_bounds`."""
        length, bt = self._length, self._block_tokens
        if paged:
            whole = length // bt
            complete = self._valid[:, :whole].all(axis=0)
            gap = int(np.argmin(complete)) if not complete.all() else whole
            bound = gap * bt
            if gap >= self._computed // bt:
                bound = max(bound, min(self._computed, length))
        else:
            bound = length
        if not state:
            return bound
        points = set(self._checkpoints.values())
        if self._ckpt_rows is not None:
            # a checkpoint that arrived whole (or the live state) at or before the paged bound
            best = 0
            if len(points) == 1 and (live := next(iter(points))) is not None and live <= bound:
                best = live
            held = np.flatnonzero(self._ckpt[: bound // bt])
            if held.size:
                best = max(best, (int(held[-1]) + 1) * bt)
            return best
        if len(points) != 1:
            return 0
        (point,) = points
        if point is None or point > bound:
            return 0
        return point

    def first_incomplete_block(self) -> int:
        """The first prompt block some PAGED group lacks (the prompt's whole blocks if none)."""
        end = self.prompt_tokens // self._block_tokens
        complete = self._valid[:, :end].all(axis=0)
        return int(np.argmin(complete)) if not complete.all() else end

    def state_name(self, group_id: int, point: int) -> bytes:
        """The name of the STATE group's slot at the exact checkpoint ``point``."""
        bt = self._block_tokens
        parent = self._keys[point // bt - 1] if point >= bt else self._root
        return state_name(self._token_buf, bt, point, group_id, parent)

    def check_checkpoint_writable(self, block: int) -> None:
        """Raises unless the checkpoint of ``block`` may be lent for a fetch: a block of this
        request's own (not committed, hence not shared), with no other checkpoint lent."""
        if self._ckpt_rows is None:
            raise LeaseError("this lender keeps no STATE checkpoints (build it with checkpoints=True)")
        if not self._committed <= block < self._block_table.size:
            raise ValueError(f"the checkpoint of block {block} of request {self.request_id} cannot be fetched: "
                             f"blocks before {self._committed} are committed and shared")
        if self._ckpt_writing:
            raise LeaseError(f"a checkpoint of request {self.request_id} is already lent for writing")

    def begin_checkpoint_write(self, block: int) -> None:
        self._ckpt_writing = True
        self._ckpt[block] = False  # a fetch may leave any bytes in a row it does not deliver

    def checkpoint_arrived(self, block: int) -> None:
        self._ckpt[block] = True

    def end_checkpoint_write(self) -> None:
        self._ckpt_writing = False

    def begin_read(self, state_in_place: bool) -> None:
        """A read lease is lent; ``state_in_place``: it lends the state slots unstaged."""
        if state_in_place:
            self._state_reading += 1

    def end_read(self, state_in_place: bool) -> None:
        if state_in_place:
            self._state_reading -= 1

    def check_state_free(self, *, for_write: bool) -> None:
        """Raises if the state is lent for writing (or, ``for_write``, read in place)."""
        if self._state_writing:
            raise LeaseError(f"the state of request {self.request_id} is already lent for writing; "
                             "mark and release that lease first")
        if for_write and self._state_reading:
            raise LeaseError(
                f"the state of request {self.request_id} is lent for reading in place; release that lease first"
            )

    def begin_write(self, first_block: int, end: int, state_groups: Sequence[int], *, in_place: bool) -> None:
        """A write lease over blocks ``[first_block, end)`` (and ``state_groups``' slots) is lent.
        In place, those rows stop being valid until marked: a fetch may leave any bytes in the
        rows it does not deliver (A7). The caller checked :meth:`check_writable` first."""
        self._writing[first_block:end] = True
        if in_place:
            self._valid[:, first_block:end] = False
            self._computed = min(self._computed, first_block * self._block_tokens)
            for gid in state_groups:
                self._checkpoints[gid] = None
        if state_groups:
            self._state_writing = True

    def arrived(self, blocks: Sequence[np.ndarray], checkpoints: Mapping[int, int]) -> None:
        """Rows a write lease marked: ``blocks[k]`` the block indices now valid in PAGED group
        ``k``; ``checkpoints`` the STATE groups now at an exact checkpoint."""
        for k, index in enumerate(blocks):
            self._valid[k, index] = True
        self._checkpoints.update(checkpoints)

    def end_write(self, blocks: np.ndarray, state: bool) -> None:
        self._writing[blocks] = False
        if state:
            self._state_writing = False

    def check_writable(self, first_block: int, end: int) -> None:
        """Raises if a block in ``[first_block, end)`` is lent for writing already."""
        if self._writing[first_block:end].any():
            busy = first_block + int(np.argmax(self._writing[first_block:end]))
            raise LeaseError(f"block {busy} of request {self.request_id} is already lent for writing")

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"Request({self.request_id}, {state}, tokens={self._length}, cached={self.cached_tokens}, "
                f"blocks={self._block_table.size}, committed={self._committed})")
