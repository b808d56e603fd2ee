"""What a cache looks like (:class:`CacheLayout` of :class:`GroupSpec`) and whose it is
(:class:`Scope`): the two things a block's name commits to besides its tokens (N1)."""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvwire.contract import CacheKind

__all__ = ["GroupSpec", "CacheLayout", "Scope", "LAYOUT_VERSION"]

#: Bumped when the digest's encoding changes; a digest of another version never matches.
LAYOUT_VERSION = 1

_DIGEST_BYTES = 32
_SCOPE_PERSON = b"kvwire-scope-v1"
_LAYOUT_PERSON = b"kvwire-layout-v1"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _dtype_from_name(name: object) -> torch.dtype:
    dtype = getattr(torch, name, None) if isinstance(name, str) else None
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown torch dtype {name!r} (expected a name such as 'float16')")
    return dtype


def _plain_int(value: object, what: str, minimum: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{what} must be an int, got {type(value).__name__}")
    if int(value) < minimum:
        raise ValueError(f"{what} must be >= {minimum}, got {value}")
    return int(value)


@dataclass(frozen=True, slots=True)
class GroupSpec:
    """One layer group's pool: ``PAGED`` holds a slot per block of ``block_tokens`` tokens (all
    PAGED groups share block slot indices); ``STATE`` holds one slot per request, an exact
    checkpoint. ``slot_shape`` is one slot's tensor shape."""

    group_id: int
    kind: CacheKind
    slot_shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        object.__setattr__(self, "group_id", _plain_int(self.group_id, "GroupSpec.group_id", 0))
        if not isinstance(self.kind, CacheKind):
            raise TypeError(f"GroupSpec.kind must be a CacheKind, got {self.kind!r}")
        shape = tuple(self.slot_shape)
        if not shape:
            raise ValueError(f"group {self.group_id}: slot_shape must have at least one dimension")
        shape = tuple(_plain_int(d, f"group {self.group_id} slot_shape entry", 1) for d in shape)
        object.__setattr__(self, "slot_shape", shape)
        if not isinstance(self.dtype, torch.dtype):
            raise TypeError(f"group {self.group_id}: dtype must be a torch.dtype, got {self.dtype!r}")

    @property
    def slot_numel(self) -> int:
        """Elements in one slot."""
        return math.prod(self.slot_shape)

    @property
    def slot_bytes(self) -> int:
        """Bytes in one slot."""
        return self.slot_numel * torch.empty((), dtype=self.dtype).element_size()

    def to_dict(self) -> dict[str, Any]:
        return {
            "group_id": self.group_id,
            "kind": self.kind.value,
            "slot_shape": list(self.slot_shape),
            "dtype": _dtype_name(self.dtype),
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> GroupSpec:
        try:
            return cls(
                group_id=d["group_id"],
                kind=CacheKind(d["kind"]),
                slot_shape=tuple(d["slot_shape"]),
                dtype=_dtype_from_name(d["dtype"]),
            )
        except KeyError as exc:
            raise ValueError(f"a layer group entry lacks the field {exc.args[0]!r}") from None


@dataclass(frozen=True, slots=True)
class CacheLayout:
    """A cache's shape: ``block_tokens`` tokens per block, ``num_blocks`` slots per PAGED pool
    (block slot ``s`` is row ``s`` of every PAGED pool), ``num_state_slots`` per STATE pool, and
    the layer groups in order."""

    block_tokens: int
    num_blocks: int
    num_state_slots: int
    groups: tuple[GroupSpec, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "block_tokens", _plain_int(self.block_tokens, "CacheLayout.block_tokens", 1))
        object.__setattr__(self, "num_blocks", _plain_int(self.num_blocks, "CacheLayout.num_blocks", 0))
        object.__setattr__(
            self, "num_state_slots", _plain_int(self.num_state_slots, "CacheLayout.num_state_slots", 0)
        )
        groups = tuple(self.groups)
        if not groups:
            raise ValueError("CacheLayout needs at least one layer group")
        for g in groups:
            if not isinstance(g, GroupSpec):
                raise TypeError(f"CacheLayout.groups holds GroupSpec, got {type(g).__name__}")
        ids = [g.group_id for g in groups]
        if len(set(ids)) != len(ids):
            raise ValueError(f"CacheLayout group ids must be unique, got {ids}")
        object.__setattr__(self, "groups", groups)
        if self.paged_groups and self.num_blocks < 1:
            raise ValueError("a layout with PAGED groups needs num_blocks >= 1")
        if self.state_groups and self.num_state_slots < 1:
            raise ValueError("a layout with STATE groups needs num_state_slots >= 1")

    @property
    def paged_groups(self) -> tuple[GroupSpec, ...]:
        return tuple(g for g in self.groups if g.kind is CacheKind.PAGED)

    @property
    def state_groups(self) -> tuple[GroupSpec, ...]:
        return tuple(g for g in self.groups if g.kind is CacheKind.STATE)

    def group(self, group_id: int) -> GroupSpec:
        """The group with this id; raises ``KeyError`` naming the ids there are."""
        for g in self.groups:
            if g.group_id == group_id:
                return g
        raise KeyError(f"no layer group {group_id}; the layout has {[g.group_id for g in self.groups]}")

    def digest(self) -> bytes:
        """32 bytes, stable across processes and machines, committing to what makes two caches'
        blocks interchangeable: ``block_tokens`` and each group's id, kind, slot shape and dtype.
        Pool sizes are left out, so workers of different capacity share names."""
        body = {
            "version": LAYOUT_VERSION,
            "block_tokens": self.block_tokens,
            "groups": [g.to_dict() for g in self.groups],
        }
        encoded = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.blake2b(encoded, digest_size=_DIGEST_BYTES, person=_LAYOUT_PERSON).digest()

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-able data (for the transceiver state); :meth:`from_dict` reads it back."""
        return {
            "version": LAYOUT_VERSION,
            "block_tokens": self.block_tokens,
            "num_blocks": self.num_blocks,
            "num_state_slots": self.num_state_slots,
            "groups": [g.to_dict() for g in self.groups],
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> CacheLayout:
        if not isinstance(d, dict):
            raise TypeError(f"a cache layout is a dict, got {type(d).__name__}")
        version = d.get("version")
        if version != LAYOUT_VERSION:
            raise ValueError(f"cache layout version {version!r} is not {LAYOUT_VERSION}, the one this kvwire reads")
        try:
            return cls(
                block_tokens=d["block_tokens"],
                num_blocks=d["num_blocks"],
                num_state_slots=d["num_state_slots"],
                groups=tuple(GroupSpec.from_dict(g) for g in d["groups"]),
            )
        except KeyError as exc:
            raise ValueError(f"a cache layout lacks the field {exc.args[0]!r}") from None


@dataclass(frozen=True, slots=True)
class Scope:
    """Whose cache this is: the model and a tenant salt. Names from different scopes never match,
    so one tenant cannot find another's cached prompt."""

    model_id: str
    tenant_salt: bytes = b""

    def __post_init__(self) -> None:
        if not isinstance(self.model_id, str) or not self.model_id:
            raise ValueError(f"Scope.model_id must be a non-empty str, got {self.model_id!r}")
        if not isinstance(self.tenant_salt, (bytes, bytearray, memoryview)):
            raise TypeError(f"Scope.tenant_salt must be bytes, got {type(self.tenant_salt).__name__}")
        object.__setattr__(self, "tenant_salt", bytes(self.tenant_salt))

    def digest(self, layout: CacheLayout) -> bytes:
        """32 bytes committing to the model id, the layout's digest (dtypes included) and the
        tenant salt; the root every block name chains from."""
        model = self.model_id.encode()
        h = hashlib.blake2b(digest_size=_DIGEST_BYTES, person=_SCOPE_PERSON)
        for part in (model, layout.digest(), self.tenant_salt):
            h.update(len(part).to_bytes(8, "little"))
            h.update(part)
        return h.digest()
