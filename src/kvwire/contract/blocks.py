"""The optional protocol ``block-objects`` (K1, contract 1.3): a store keeps all the groups of one
block as one object, asked for per submission by the store hint field ``blocks``.

A holder checks ``BLOCK_OBJECTS in capabilities().protocols`` (B4.8), then puts
``blocks=block_layout(view)`` in its store hint; a fetch with the same layout finds the object,
any other misses (K1.5)."""

from __future__ import annotations

import re
from collections.abc import Iterable

from kvwire.contract.view import View

__all__ = ["BLOCK_OBJECTS", "BLOCKS_FIELD", "block_layout", "parse_block_layout"]

#: The optional protocol of a store that keeps one object per block across groups (K1).
BLOCK_OBJECTS = "block-objects"

#: The store hint field that asks for block objects (K1.2).
BLOCKS_FIELD = "blocks"

_PAIR = re.compile(r"^(0|[1-9][0-9]{0,18}):([1-9][0-9]{0,18})$")


def block_layout(groups: View | Iterable[tuple[int, int]]) -> str:
    """The block layout of a view, or of ``(group id, row bytes)`` pairs: ``"ID:BYTES"`` for each
    group in ascending id, joined by commas (K1.2). Raises ``ValueError`` for a repeated group
    id, a negative id or a row size below one byte."""
    if isinstance(groups, View):
        pairs = [(g.group_id, g.region.slot_bytes) for g in groups.groups]
    else:
        pairs = [(int(g), int(b)) for g, b in groups]
    pairs.sort()
    ids = [g for g, _ in pairs]
    if len(set(ids)) != len(ids):
        raise ValueError(f"a block layout names each group once, got group ids {ids}")
    for group, size in pairs:
        if group < 0 or size < 1:
            raise ValueError(f"a block layout needs group ids >= 0 and row sizes >= 1 byte, got {group}:{size}")
    return ",".join(f"{g}:{b}" for g, b in pairs)


def parse_block_layout(text: object) -> tuple[tuple[int, int], ...]:
    """The ``(group id, row bytes)`` pairs of a block layout, in ascending id. Raises
    ``ValueError`` saying what is wrong for anything :func:`block_layout` would not write."""
    if not isinstance(text, str):
        raise ValueError(f"a block layout is a str such as '0:4096,1:4096', got {type(text).__name__}")
    if text == "":
        return ()
    pairs = []
    for part in text.split(","):
        match = _PAIR.match(part)
        if match is None:
            raise ValueError(f"block layout {text[:200]!r}: {part[:40]!r} is not 'ID:BYTES' (decimal, no signs, "
                             "no leading zeros, bytes >= 1)")
        pairs.append((int(match[1]), int(match[2])))
    ids = [g for g, _ in pairs]
    if ids != sorted(set(ids)):
        raise ValueError(f"block layout {text[:200]!r}: group ids must be distinct and ascending")
    return tuple(pairs)
