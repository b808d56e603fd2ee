"""Mutants that each break one block-object clause (K1: the optional block-objects protocol). Every
harness below is registered once, in ``tests/conformance/mutant_table.py``, with the clause it
breaks and the ``-k`` selection of the suite's tests that must catch it. A mutant either wraps a
correct backend through :mod:`kit` (the memory backend, or the reference peer for the serving
protocol) and breaks the clause from outside, or subclasses a reference backend
(:mod:`kvwire.testing.reference`) and overrides the one method where the bug lives.

Point the suite at one with ``--kvwire-harness tests/conformance/mutants/blocks.py:NAME``."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
from kit import Mutant, MutantHarness  # beside this file; on sys.path when loaded as a harness

from kvwire.contract import Capabilities, Cause, Hint, InvalidSubmission, OutcomeStatus, View, WakeFn
from kvwire.contract.blocks import BLOCKS_FIELD, parse_block_layout
from kvwire.testing.reference.core import Access, ReferenceAttempt, read_rows
from kvwire.testing.reference.harness import ControlledStore, ReferenceStoreHarness
from kvwire.testing.reference.store import ReferenceStoreBackend, RowStatus, Space, StoreReply, _Call, _Work


class _BlockStoreHarness(ReferenceStoreHarness):
    """The reference store's harness, building ``backend`` (a broken subclass) and declaring what
    it declares."""

    def __init__(self, backend: type[ReferenceStoreBackend]) -> None:
        self.backend = backend

    def make_backend(self, end: ControlledStore, *, timeout_s: float, max_in_flight: int) -> ReferenceStoreBackend:
        return self.backend(end, namespace="default", timeout_s=timeout_s, max_in_flight=max_in_flight)

    def capabilities(self) -> Capabilities:
        return getattr(self.backend, "declare", lambda caps: caps)(super().capabilities())


def _mutant(name: str, backend: type[ReferenceStoreBackend]) -> MutantHarness:
    return MutantHarness(name.replace("_", "-"), Mutant, inner=_BlockStoreHarness(backend))


def _blocks(hint: Hint) -> bool:
    return isinstance(hint, Hint) and any(key == BLOCKS_FIELD for key, _ in hint.fields)


class _StoreWrapper:
    """A store end that forwards every call; subclasses change the calls of block objects (a str
    space) only."""

    def __init__(self, end: Any) -> None:
        self.end = end

    def put(self, namespace: str, space: Space, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        return self.end.put(namespace, space, names, rows)  # type: ignore[no-any-return]

    def get(self, namespace: str, space: Space, names: np.ndarray, row_bytes: int) -> StoreReply:
        return self.end.get(namespace, space, names, row_bytes)  # type: ignore[no-any-return]

    def contains(self, namespace: str, space: Space, names: np.ndarray) -> StoreReply:
        return self.end.contains(namespace, space, names)  # type: ignore[no-any-return]


def _wrapping(wrapper: type[_StoreWrapper]) -> Any:
    """A backend class decorator: build the backend over ``wrapper(store)``."""

    def decorate(cls: type[ReferenceStoreBackend]) -> type[ReferenceStoreBackend]:
        init = cls.__init__

        def __init__(self: ReferenceStoreBackend, store: Any, **options: Any) -> None:
            init(self, wrapper(store), **options)

        cls.__init__ = __init__  # type: ignore[method-assign]
        return cls

    return decorate


# -- K1.1 ------------------------------------------------------------------------------------------

class BlocksDeclaredForNamelessRows(ReferenceStoreBackend):
    """K1.1: names ``block-objects`` without declaring content addressing ("a block is found by
    its position in the layout"), though it still keys objects by name."""

    @staticmethod
    def declare(caps: Capabilities) -> Capabilities:
        return dataclasses.replace(caps, content_addressed=False)

    def capabilities(self) -> Capabilities:
        return self.declare(super().capabilities())


class FetchRefusesTheBlocksField(ReferenceStoreBackend):
    """K1.1: only a publish takes ``blocks`` ("the layout matters when storing"); a fetch refuses
    the field as one it does not understand."""

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        if _blocks(hint):
            raise InvalidSubmission(f"store hint field {BLOCKS_FIELD!r} is not understood by a fetch")
        return super().fetch(view, hint, wake)


class LookupRefusesTheBlocksField(ReferenceStoreBackend):
    """K1.1: a lookup refuses ``blocks`` as a hint field it does not understand."""

    def lookup(self, groups: Any, names: np.ndarray, hint: Hint, timeout_s: float | None = None) -> np.ndarray:
        if _blocks(hint):
            raise InvalidSubmission(f"a lookup does not understand the store hint field {BLOCKS_FIELD!r}")
        return super().lookup(groups, names, hint, timeout_s)


# -- K1.3 ------------------------------------------------------------------------------------------

class MisfitNamesTaken(ReferenceStoreBackend):
    """K1.3: a block's name is taken from the first group; the names of the other groups are
    never compared with it."""

    def _check_blocks(self, view: View, blocks: object) -> None:  # type: ignore[override]
        first = view.groups[0].names if view.groups else None
        groups = [dataclasses.replace(g, names=first[: g.rows] if first is not None and g.names is not None
                                      and g.names.shape == first.shape else g.names) for g in view.groups]
        ReferenceStoreBackend._check_blocks(View(tuple(groups)), blocks)


class OneBlockNamesUnchecked(ReferenceStoreBackend):
    """K1.3: names are compared across groups only for a view of several blocks ("one block has
    one name anyway")."""

    def _check_blocks(self, view: View, blocks: object) -> None:  # type: ignore[override]
        if view.groups and all(g.rows == 1 for g in view.groups):
            view = View(tuple(dataclasses.replace(g, names=view.groups[0].names) for g in view.groups))
        ReferenceStoreBackend._check_blocks(view, blocks)


class LayoutCheckedByGroupIds(ReferenceStoreBackend):
    """K1.3: ``blocks`` is checked for the view's group ids only; a row size that differs passes
    (the store keys objects by the layout it computes itself)."""

    def _check_blocks(self, view: View, blocks: object) -> None:  # type: ignore[override]
        try:
            ids = [g for g, _ in parse_block_layout(blocks)]
        except ValueError:
            ids = None
        if ids is not None and ids == sorted(g.group_id for g in view.groups):
            blocks = ",".join(f"{g.group_id}:{g.region.slot_bytes}"
                              for g in sorted(view.groups, key=lambda g: g.group_id))
        ReferenceStoreBackend._check_blocks(view, blocks)


class LayoutInViewOrder(ReferenceStoreBackend):
    """K1.3 (K1.2): the layout it expects lists the groups in view order, not ascending id, so a
    fitting view whose groups are not in ascending id is refused."""

    def _check_blocks(self, view: View, blocks: object) -> None:  # type: ignore[override]
        expected = ",".join(f"{g.group_id}:{g.region.slot_bytes}" for g in view.groups)
        if blocks != expected:
            raise InvalidSubmission(f"store hint field {BLOCKS_FIELD!r} must be {expected!r}, got {blocks!r}")
        ReferenceStoreBackend._check_blocks(view, ",".join(sorted(expected.split(","),
                                                                  key=lambda p: int(p.split(":")[0]))))


class MisfitPublishStoresFirst(ReferenceStoreBackend):
    """K1.3 (S3.4): a block publish hands each group's rows to the store before checking that
    the view fits, so a refused one has stored them as per-group objects."""

    def _check(self, op: str, view: View, hint: Hint, wake: WakeFn) -> _Work:
        if op == "publish" and _blocks(hint) and isinstance(view, View):
            namespace = self._namespace_of(hint)
            for i, group in enumerate(view.groups):
                if group.rows and group.names is not None:
                    rows = read_rows(self._table.locate(group, i), group.region.slot_bytes)
                    # stored here, before the refusal, not queued for a worker: a queued put could
                    # land after the suite's check and let the mutant pass by timing alone
                    self._store.put(namespace, group.group_id, group.names, rows)
        return super()._check(op, view, hint, wake)


class MisfitRefusalKeepsASlot(ReferenceStoreBackend):
    """K1.3 (S3.6): the fit of a block view is checked after the queue slot is taken, and a
    refusal never gives the slot back."""

    def _check_blocks(self, view: View, blocks: object) -> None:  # type: ignore[override]
        try:
            ReferenceStoreBackend._check_blocks(view, blocks)
        except InvalidSubmission:
            with self._runner.lock:
                if len(self._runner.live) < self._runner.max_in_flight:
                    self._runner.admit_locked(ReferenceAttempt(self._runner, "fetch", view, lambda: None, 3600.0),
                                               "submission")
            raise


class BlockViewWithoutRowsRefused(ReferenceStoreBackend):
    """K1.3 (V1.7): a block view without rows (no groups, or groups of no rows) is refused ("block
    objects need at least one block")."""

    def _check_blocks(self, view: View, blocks: object) -> None:  # type: ignore[override]
        ReferenceStoreBackend._check_blocks(view, blocks)
        if not view.rows:
            raise InvalidSubmission("block objects need at least one block")


# -- K1.4 ------------------------------------------------------------------------------------------

class BlockStoredPerGroup(ReferenceStoreBackend):
    """K1.4: a block is stored as one object per group (keyed by the layout and the group), one
    store call per group: a block the store declines in one call is a false bit in that group
    only."""

    @staticmethod
    def _calls(view: View, layout: str | None) -> tuple[_Call, ...]:
        if layout is None:
            return ReferenceStoreBackend._calls(view, None)
        return tuple(_Call(f"{layout}|{g.group_id}", g.names, (gi,))
                     for gi, g in enumerate(view.groups) if g.rows and g.names is not None)


class _FirstGroupDeclines(ReferenceAttempt):
    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        if self.outcome is None and self.op == "publish" and self.moved:
            for mask in self.moved[1:]:
                mask[:] = True  # the store's answer is applied to the view's first group only
        return super().conclude_locked(status, cause, reason, by_peer=by_peer)


class DeclineInOneGroupOnly(ReferenceStoreBackend):
    """K1.4: a block publish applies the store's answer to the first group's mask only; the
    other groups' bits say held for every block, declined ones included."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        if _blocks(hint):
            attempt.__class__ = _FirstGroupDeclines
        return attempt


class _DeclinedAsHeld(_StoreWrapper):
    def put(self, namespace: str, space: Space, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        reply = self.end.put(namespace, space, names, rows)
        if isinstance(space, str):
            status = reply.status.copy()
            status[status == RowStatus.DECLINED] = RowStatus.HELD
            reply = StoreReply(status, reply.data, reply.reason)
        return reply  # type: ignore[no-any-return]


@_wrapping(_DeclinedAsHeld)
class DeclinedBlockMarkedHeld(ReferenceStoreBackend):
    """K1.4 (A5.11): a block the store declines for space is marked held ("a declined block is
    retried later")."""


# -- K1.5 ------------------------------------------------------------------------------------------

class _IdsOnly(_StoreWrapper):
    @staticmethod
    def _ids(space: Space) -> Space:
        return ",".join(part.split(":")[0] for part in space.split(",")) + ":" if isinstance(space, str) else space

    def put(self, namespace: str, space: Space, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        return self.end.put(namespace, self._ids(space), names, rows)  # type: ignore[no-any-return]

    def get(self, namespace: str, space: Space, names: np.ndarray, row_bytes: int) -> StoreReply:
        return self.end.get(namespace, self._ids(space), names, row_bytes)  # type: ignore[no-any-return]

    def contains(self, namespace: str, space: Space, names: np.ndarray) -> StoreReply:
        return self.end.contains(namespace, self._ids(space), names)  # type: ignore[no-any-return]


@_wrapping(_IdsOnly)
class LayoutWithoutRowSizes(ReferenceStoreBackend):
    """K1.5: block objects are keyed by the layout's group ids without their row sizes, so a
    fetch of the same groups with one other row size reads the object published with another."""


class _PartsAlikeAttempt(ReferenceAttempt):
    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        if self.outcome is None and self.moved:
            whole = np.logical_and.reduce(self.moved)
            for mask in self.moved:
                mask[:] = whole
        return super().conclude_locked(status, cause, reason, by_peer=by_peer)


class PartOfABlockFound(ReferenceStoreBackend):
    """K1.5: each group's row of a block is its own object, keyed by group and row size, and a
    block is marked where every group of the view found its part: a fetch of a subset of the
    published groups finds the block (a part of it)."""

    @staticmethod
    def _calls(view: View, layout: str | None) -> tuple[_Call, ...]:
        if layout is None:
            return ReferenceStoreBackend._calls(view, None)
        return tuple(_Call(f"part:{g.group_id}:{g.region.slot_bytes}", g.names, (gi,))
                     for gi, g in enumerate(view.groups) if g.rows and g.names is not None)

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        if _blocks(hint):
            attempt.__class__ = _PartsAlikeAttempt
        return attempt


class BlockBytesInViewOrder(ReferenceStoreBackend):
    """K1.5 (A7): a block object holds the groups' rows in view order, not ascending group id, so
    a fetch whose view lists the groups in another order than the publish's reads them shuffled."""

    @staticmethod
    def _calls(view: View, layout: str | None) -> tuple[_Call, ...]:
        calls = ReferenceStoreBackend._calls(view, layout)
        if layout is None or not calls:
            return calls
        return (_Call(calls[0].space, calls[0].names, tuple(range(len(view.groups)))),)


# -- K1.6 ------------------------------------------------------------------------------------------

class _FallsBackToPerGroup(_StoreWrapper):
    def get(self, namespace: str, space: Space, names: np.ndarray, row_bytes: int) -> StoreReply:
        reply: StoreReply = self.end.get(namespace, space, names, row_bytes)
        missed = np.flatnonzero(reply.status == RowStatus.MISSING)
        if not isinstance(space, str) or not missed.size or reply.data is None:
            return reply
        status, data = reply.status.copy(), reply.data.copy()
        parts, found = [], np.ones(missed.size, dtype=bool)
        for group, size in parse_block_layout(space):  # the per-group objects of the same names
            part = self.end.get(namespace, group, names[missed], size)
            found &= part.status == RowStatus.HELD
            parts.append(part.data)
        data[missed[found]] = np.concatenate(parts, axis=1)[found]
        status[missed[found]] = RowStatus.HELD
        return StoreReply(status, data, reply.reason)


@_wrapping(_FallsBackToPerGroup)
class BlockFetchFallsBackToPerGroup(ReferenceStoreBackend):
    """K1.6: a block fetch that misses reads the per-group objects of the same names, and marks
    the block where every group has one."""


class _AlsoPerGroup(_StoreWrapper):
    def put(self, namespace: str, space: Space, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        reply: StoreReply = self.end.put(namespace, space, names, rows)
        if isinstance(space, str):
            start = 0
            for group, size in parse_block_layout(space):
                self.end.put(namespace, group, names, rows[:, start:start + size])
                start += size
        return reply


@_wrapping(_AlsoPerGroup)
class BlockPublishAlsoPerGroup(ReferenceStoreBackend):
    """K1.6: a block publish also stores each group's row as a per-group object ("so readers
    without ``blocks`` find it too")."""


class OneGroupBlockAsPerGroupObject(ReferenceStoreBackend):
    """K1.6: a block of one group is kept as that group's per-group object ("its object holds
    the same single row"), so per-group and block fetches of one group find each other's."""

    @staticmethod
    def _calls(view: View, layout: str | None) -> tuple[_Call, ...]:
        return ReferenceStoreBackend._calls(view, None if layout is not None and len(view.groups) == 1 else layout)


# -- K1.7 ------------------------------------------------------------------------------------------

class LookupIgnoresTheLayout(ReferenceStoreBackend):
    """K1.7: a lookup with ``blocks`` checks the field, then asks about the per-group objects of
    the groups listed."""

    def _lookup_spaces(self, ids: tuple[int, ...], hint: Hint) -> tuple[Space, ...]:  # type: ignore[override]
        ReferenceStoreBackend._lookup_spaces(ids, hint)
        return ids


class LookupTakesAnyGroups(ReferenceStoreBackend):
    """K1.7: a lookup with ``blocks`` asks about the layout's objects whatever groups it lists."""

    def _lookup_spaces(self, ids: tuple[int, ...], hint: Hint) -> tuple[Space, ...]:  # type: ignore[override]
        value = hint.get(BLOCKS_FIELD)
        if _blocks(hint) and isinstance(value, str):
            try:
                parse_block_layout(value)
            except ValueError as exc:
                raise InvalidSubmission(f"store hint field {BLOCKS_FIELD!r}: {exc}") from None
            return (value,)
        return ReferenceStoreBackend._lookup_spaces(ids, hint)


# -- K1.8 ------------------------------------------------------------------------------------------

class BlockHintDeadlineIgnored(ReferenceStoreBackend):
    """K1.8 (A8.4): the block path builds its own store hint from the fields, so a block
    submission gets the backend's deadline option, never the hint's ``timeout_s``."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        if _blocks(hint):
            hint = Hint(hint.kind, hint.fields)
        return super()._submit(op, view, hint, wake)


class _CancelWhenTheStoreAnswers(ReferenceAttempt):
    wants_cancel = False

    def cancel(self) -> None:
        with self.runner.lock:
            if self.outcome is None and self.access is Access.TOUCHING:
                self.wants_cancel = True  # concluded once the store call returns
                return
        super().cancel()

    def conclude_locked(self, status: OutcomeStatus, cause: Cause | None = None, reason: str | None = None,
                        *, by_peer: bool = False) -> bool:
        if self.wants_cancel and self.outcome is None:
            self.moved = self.view.row_masks()
            status, cause, reason = OutcomeStatus.CANCELLED, Cause.HOLDER_CANCELLED, "cancelled by the holder"
        return super().conclude_locked(status, cause, reason, by_peer=by_peer)


class CancelWaitsForTheStore(ReferenceStoreBackend):
    """K1.8 (A4.4): a block submission's cancel takes effect only once its store call returns (a
    block is moved whole or not at all), so a cancel of a held one does not conclude it."""

    def _submit(self, op: str, view: View, hint: Hint, wake: WakeFn) -> ReferenceAttempt:
        attempt = super()._submit(op, view, hint, wake)
        if _blocks(hint):
            attempt.__class__ = _CancelWhenTheStoreAnswers
        return attempt


class _OneNamespace(_StoreWrapper):
    def put(self, namespace: str, space: Space, names: np.ndarray, rows: np.ndarray) -> StoreReply:
        return self.end.put("default" if isinstance(space, str) else namespace, space, names, rows)  # type: ignore[no-any-return]

    def get(self, namespace: str, space: Space, names: np.ndarray, row_bytes: int) -> StoreReply:
        return self.end.get("default" if isinstance(space, str) else namespace, space, names, row_bytes)  # type: ignore[no-any-return]

    def contains(self, namespace: str, space: Space, names: np.ndarray) -> StoreReply:
        return self.end.contains("default" if isinstance(space, str) else namespace, space, names)  # type: ignore[no-any-return]


@_wrapping(_OneNamespace)
class BlockNamespaceIgnored(ReferenceStoreBackend):
    """K1.8 (H1.10): block objects are kept in the backend's configured namespace, whatever the
    hint names (the namespace is applied to per-group keys only)."""


class _FaultAsMiss(_StoreWrapper):
    def get(self, namespace: str, space: Space, names: np.ndarray, row_bytes: int) -> StoreReply:
        reply: StoreReply = self.end.get(namespace, space, names, row_bytes)
        if isinstance(space, str):
            status = reply.status.copy()
            status[status == RowStatus.FAILED] = RowStatus.MISSING
            reply = StoreReply(status, reply.data, "")
        return reply


@_wrapping(_FaultAsMiss)
class BlockFaultAsMiss(ReferenceStoreBackend):
    """K1.8 (A5.9): a block the store fails on a fetch passes for a miss."""


class _FirstOfEachName(_StoreWrapper):
    def get(self, namespace: str, space: Space, names: np.ndarray, row_bytes: int) -> StoreReply:
        reply: StoreReply = self.end.get(namespace, space, names, row_bytes)
        if isinstance(space, str) and len(names):
            _, first = np.unique(names, axis=0, return_index=True)
            later = np.ones(len(names), dtype=bool)
            later[first] = False
            status = reply.status.copy()
            status[later & (status == RowStatus.HELD)] = RowStatus.MISSING  # one object, one destination
            reply = StoreReply(status, reply.data, reply.reason)
        return reply


@_wrapping(_FirstOfEachName)
class RepeatedBlockFillsOneRow(ReferenceStoreBackend):
    """K1.8 (V4.5): a block fetch naming one block on several rows fills the first of them only;
    the others are passed off as misses."""


faithful = _mutant("faithful_blocks", ReferenceStoreBackend)
blocks_declared_for_nameless_rows = _mutant("blocks_declared_for_nameless_rows", BlocksDeclaredForNamelessRows)
fetch_refuses_the_blocks_field = _mutant("fetch_refuses_the_blocks_field", FetchRefusesTheBlocksField)
lookup_refuses_the_blocks_field = _mutant("lookup_refuses_the_blocks_field", LookupRefusesTheBlocksField)
misfit_names_taken = _mutant("misfit_names_taken", MisfitNamesTaken)
one_block_names_unchecked = _mutant("one_block_names_unchecked", OneBlockNamesUnchecked)
layout_checked_by_group_ids = _mutant("layout_checked_by_group_ids", LayoutCheckedByGroupIds)
layout_in_view_order = _mutant("layout_in_view_order", LayoutInViewOrder)
misfit_publish_stores_first = _mutant("misfit_publish_stores_first", MisfitPublishStoresFirst)
misfit_refusal_keeps_a_slot = _mutant("misfit_refusal_keeps_a_slot", MisfitRefusalKeepsASlot)
block_view_without_rows_refused = _mutant("block_view_without_rows_refused", BlockViewWithoutRowsRefused)
block_stored_per_group = _mutant("block_stored_per_group", BlockStoredPerGroup)
decline_in_one_group_only = _mutant("decline_in_one_group_only", DeclineInOneGroupOnly)
declined_block_marked_held = _mutant("declined_block_marked_held", DeclinedBlockMarkedHeld)
layout_without_row_sizes = _mutant("layout_without_row_sizes", LayoutWithoutRowSizes)
part_of_a_block_found = _mutant("part_of_a_block_found", PartOfABlockFound)
block_bytes_in_view_order = _mutant("block_bytes_in_view_order", BlockBytesInViewOrder)
block_fetch_falls_back_to_per_group = _mutant("block_fetch_falls_back_to_per_group", BlockFetchFallsBackToPerGroup)
block_publish_also_per_group = _mutant("block_publish_also_per_group", BlockPublishAlsoPerGroup)
one_group_block_as_per_group_object = _mutant("one_group_block_as_per_group_object", OneGroupBlockAsPerGroupObject)
lookup_ignores_the_layout = _mutant("lookup_ignores_the_layout", LookupIgnoresTheLayout)
lookup_takes_any_groups = _mutant("lookup_takes_any_groups", LookupTakesAnyGroups)
block_hint_deadline_ignored = _mutant("block_hint_deadline_ignored", BlockHintDeadlineIgnored)
cancel_waits_for_the_store = _mutant("cancel_waits_for_the_store", CancelWaitsForTheStore)
block_namespace_ignored = _mutant("block_namespace_ignored", BlockNamespaceIgnored)
block_fault_as_miss = _mutant("block_fault_as_miss", BlockFaultAsMiss)
repeated_block_fills_one_row = _mutant("repeated_block_fills_one_row", RepeatedBlockFillsOneRow)
