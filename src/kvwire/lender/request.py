"""A request's hold on the cache: its tokens, its block table, its state slots, and which of its
rows are valid. Only the :class:`~kvwire.lender.Lender` that opened it changes it, under its
lock; the read-only arrays it exposes are the caller's to read at any time."""

from __future__ import annotations

from types import MappingProxyType
from typing import TYPE_CHECKING

import numpy as np

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
    is the request's slot in each STATE pool."""

    __slots__ = (
        "request_id", "prompt_tokens", "cached_tokens", "_block_table", "_state_slots",
        "_token_buf", "_length", "_keys", "_names", "_valid", "_writing", "_state_writing", "_state_reading",
        "_committed", "_computed", "_checkpoints", "_extra_pins", "_closed",
    )

    def __init__(self, request_id: int, tokens: np.ndarray, capacity_tokens: int, block_tokens: int,
                 block_table: np.ndarray, state_slots: dict[int, int], keys: list[bytes],
                 names: np.ndarray, paged_groups: int, cached_blocks: int) -> None:
        self.request_id = request_id
        self.prompt_tokens = int(tokens.size)
        self.cached_tokens = cached_blocks * block_tokens
        self._block_table = block_table
        self._block_table.setflags(write=False)
        self._state_slots = MappingProxyType(dict(state_slots))
        self._token_buf = np.zeros(capacity_tokens, dtype="<i8")
        self._token_buf[: tokens.size] = tokens
        self._length = int(tokens.size)
        self._keys = keys
        self._names = names
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

    @property
    def tokens(self) -> np.ndarray:
        """The request's tokens so far (prompt, then any added by ``Lender.extend``); read-only."""
        return _readonly(self._token_buf[: self._length])

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

    @property
    def committed_blocks(self) -> int:
        """Leading blocks named and committed (reused at open, or put in the tree by commit)."""
        return self._committed

    @property
    def checkpoints(self) -> Mapping[int, int | None]:
        """Each STATE group's exact checkpoint (token count), ``None`` where none is held."""
        return MappingProxyType(dict(self._checkpoints))

    @property
    def closed(self) -> bool:
        return self._closed

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"Request({self.request_id}, {state}, tokens={self._length}, cached={self.cached_tokens}, "
                f"blocks={self._block_table.size}, committed={self._committed})")
