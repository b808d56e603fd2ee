"""A state machine drives a lender as a runtime and a serving thread would — open, prefill and
commit, close, lend (read, write, by name; staged or not), deliver with random masks, mark,
release (also by an exception inside ``with``) — under pool and staging pressure, against a
plain model of what every row must hold and where every request may resume."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from lender_pages import garbage, mixed_layout, page, paged_layout, state_key, write_blocks, write_state

from kvwire.contract import CacheKind
from kvwire.lender import CacheFull, Lease, LeaseError, LeaseKind, Lender, Request, Scope, StagingBusy

STAGING = 8
prompts = st.lists(st.integers(0, 3), min_size=1, max_size=9)


@dataclass
class RequestModel:
    request: Request
    valid: np.ndarray          # (paged groups, blocks): rows committed or marked arrived
    computed: int              # tokens the model computed and committed
    checkpoints: dict[int, int | None]
    open: bool = True


@dataclass
class LeaseModel:
    lease: Lease
    owner: RequestModel | None
    staged_rows: int           # staging rows it holds (0 when not staged)
    pins: int
    keys: list[tuple[int, int, bytes]] = field(default_factory=list)  # (view group, row, key) a read row holds


class LenderMachine(RuleBasedStateMachine):
    layout = staticmethod(lambda: paged_layout(num_blocks=8))

    def __init__(self) -> None:
        super().__init__()
        self.lender = Lender(self.layout(), Scope("m", b"t"), staging_slots=STAGING)
        self.bt = self.lender.layout.block_tokens
        self.paged = self.lender.layout.paged_groups
        self.states = self.lender.layout.state_groups
        self.requests: list[RequestModel] = []
        self.leases: list[LeaseModel] = []
        self.seen: list[list[int]] = [[0, 1, 2, 0]]
        self.foreign = Lender(self.layout(), Scope("m", b"another tenant"))

    # -- what the model expects --------------------------------------------------------------

    def expected_resume(self, m: RequestModel) -> int:
        length = len(m.request.tokens)
        whole = length // self.bt
        b = 0
        while b < whole and m.valid[:, b].all():
            b += 1
        bound = b * self.bt
        if b >= m.computed // self.bt:
            bound = max(bound, min(m.computed, length))
        if not self.states:
            return bound
        points = set(m.checkpoints.values())
        if len(points) != 1:
            return 0
        (point,) = points
        return 0 if point is None or point > bound else point

    def staging_free(self) -> int:
        return STAGING - sum(lm.staged_rows for lm in self.leases)

    def writing(self, owner: RequestModel) -> list[LeaseModel]:
        return [lm for lm in self.leases if lm.owner is owner and lm.lease.kind is LeaseKind.WRITE]

    def location(self, lease: Lease, group_index: int) -> torch.Tensor:
        group = lease.view.groups[group_index]
        if lease.staged:
            return self.lender.staging(group.group_id)
        return self.lender.pool(group.group_id)

    def open_requests(self) -> list[RequestModel]:
        return [m for m in self.requests if m.open]

    # -- requests ----------------------------------------------------------------------------

    @rule(prompt=prompts, max_new=st.integers(0, 2))
    def open_request(self, prompt: list[int], max_new: int) -> None:
        held = self.lender.probe(prompt)
        before = self.lender.stats()
        try:
            request = self.lender.open_request(prompt, max_new_tokens=max_new)
        except CacheFull:
            after = self.lender.stats()
            for key in ("blocks_free", "blocks_pinned", "blocks_committed", "pins", "state_slots_free", "evictions"):
                assert after[key] == before[key], f"CacheFull left {key} changed"
            blocks = -(-(len(prompt) + max_new) // self.bt)
            idle = before["blocks_free"] + before["blocks_evictable"]
            assert idle < blocks or (self.states and before["state_slots_free"] == 0)
            return
        cached = request.cached_tokens // self.bt
        assert cached <= held and request.cached_tokens <= len(prompt) - 1
        valid = np.zeros((len(self.paged), request.block_table.size), dtype=bool)
        valid[:, :cached] = True
        self.requests.append(RequestModel(request, valid, request.cached_tokens,
                                          {g.group_id: None for g in self.states}))
        self.seen.append(prompt)

    @rule(prompt=prompts)
    def serve_whole_request(self, prompt: list[int]) -> None:
        """A request served start to end (open, compute, commit, close): fills the tree."""
        count = len(self.requests)
        self.open_request(prompt, 0)
        if len(self.requests) > count:
            m = self.requests[-1]
            self._prefill(m, len(prompt))
            self.lender.close_request(m.request)
            m.open = False
            self.requests.remove(m)

    @precondition(lambda self: self.open_requests())
    @rule(data=st.data())
    def prefill_and_commit(self, data: st.DataObject) -> None:
        m = data.draw(st.sampled_from(self.open_requests()))
        self._prefill(m, data.draw(st.integers(0, len(m.request.tokens))))

    def _prefill(self, m: RequestModel, upto: int) -> None:
        request = m.request
        stop = upto // self.bt
        busy = any(
            lm.lease.view.groups and not lm.lease.released and (
                self._write_range(lm.lease)[0] < stop and self._write_range(lm.lease)[1] > request.committed_blocks
                or any(g.kind is CacheKind.STATE for g in lm.lease.view.groups)
            )
            for lm in self.writing(m)
        )
        moves = any(c != upto for c in m.checkpoints.values())
        busy = busy or moves and any(
            lm.owner is m and lm.lease.kind is LeaseKind.READ and not lm.lease.staged and lm.lease.rows.state
            for lm in self.leases
        )
        if busy:
            try:
                self.lender.commit(request, upto)
            except LeaseError:
                return
            raise AssertionError("commit over rows lent for writing must be refused")
        start = self.lender.resume_bounds(request)
        for b in range(start // self.bt):  # what the model does not recompute must already be right
            for g in self.paged:
                assert torch.equal(self.lender.pool(g.group_id)[int(request.block_table[b])],
                                   page(request.names[b].tobytes(), g)), f"valid block {b} holds wrong bytes"
        write_blocks(self.lender, request, start // self.bt, stop)
        write_state(self.lender, request, upto)
        self.lender.commit(request, upto)
        m.valid[:, :stop] = True
        m.computed = max(m.computed, upto)
        for gid in m.checkpoints:
            m.checkpoints[gid] = upto

    @precondition(lambda self: self.open_requests())
    @rule(data=st.data(), twice=st.booleans())
    def close_request(self, data: st.DataObject, twice: bool) -> None:
        m = data.draw(st.sampled_from(self.open_requests()))
        self.lender.close_request(m.request)
        if twice:
            self.lender.close_request(m.request)
        m.open = False
        self.requests.remove(m)

    # -- leases ------------------------------------------------------------------------------

    def _write_range(self, lease: Lease) -> tuple[int, int]:
        for g in lease.view.groups:
            if g.kind is CacheKind.PAGED:
                return g.tokens.start // self.bt, g.tokens.end // self.bt
        return 0, 0

    def _read_keys(self, lease: Lease, owner: RequestModel | None) -> list[tuple[int, int, bytes]]:
        keys = []
        for k, group in enumerate(lease.view.groups):
            for row in range(group.rows):
                if group.kind is CacheKind.STATE:
                    assert owner is not None
                    keys.append((k, row, state_key(owner.request.tokens[: group.tokens.end])))
                else:
                    keys.append((k, row, group.name(row)))
        return keys

    def _check_read_rows(self, lm: LeaseModel) -> None:
        lease = lm.lease
        assert lease.wait_ready(5.0)
        for k, row, key in lm.keys:
            group = lease.view.groups[k]
            spec = self.lender.layout.group(group.group_id)
            assert torch.equal(self.location(lease, k)[int(group.slots[row])], page(key, spec)), \
                f"{lease} group {group.group_id} row {row} does not hold what its name promises"
            if lease.staged and group.kind is CacheKind.PAGED:  # a staged state is a snapshot; the model may move on
                pool_slot = int(lease.rows.block_slots[row])
                assert torch.equal(self.lender.pool(group.group_id)[pool_slot], page(key, spec))

    @precondition(lambda self: self.open_requests())
    @rule(data=st.data(), staging=st.booleans())
    def lend_read(self, data: st.DataObject, staging: bool) -> None:
        m = data.draw(st.sampled_from(self.open_requests()))
        rows = m.request.committed_blocks + int(any(m.checkpoints.values()))
        if any(m.checkpoints.values()) and any(lm.lease.rows.state for lm in self.writing(m)):
            try:
                self.lender.lend_read(m.request, staging=staging)
            except LeaseError:
                return
            raise AssertionError("lending a state for reading while it is lent for writing must be refused")
        if staging and rows > self.staging_free():
            try:
                self.lender.lend_read(m.request, staging=True)
            except StagingBusy:
                return
            raise AssertionError("a staged lease beyond the free staging rows must raise StagingBusy")
        lease = self.lender.lend_read(m.request, staging=staging)
        assert lease.kind is LeaseKind.READ
        paged_rows = m.request.committed_blocks
        lm = LeaseModel(lease, m, rows if staging else 0, paged_rows + len(lease.rows.state))
        lm.keys = self._read_keys(lease, m)
        self.leases.append(lm)
        self._check_read_rows(lm)

    @precondition(lambda self: self.open_requests())
    @rule(data=st.data(), staging=st.booleans())
    def lend_write(self, data: st.DataObject, staging: bool) -> None:
        m = data.draw(st.sampled_from(self.open_requests()))
        end = m.request.prompt_tokens // self.bt
        complete = m.valid[:, :end].all(axis=0)
        first = int(np.argmin(complete)) if not complete.all() else end
        point = end * self.bt
        wants_state = bool(self.states) and point > 0 and any(c != point for c in m.checkpoints.values())
        clash = any(
            not lm.lease.released and (
                (lambda r: r[0] < end and r[1] > first)(self._write_range(lm.lease))
                or (wants_state and any(g.kind is CacheKind.STATE for g in lm.lease.view.groups))
            )
            for lm in self.writing(m)
        ) or wants_state and any(
            lm.owner is m and lm.lease.kind is LeaseKind.READ and not lm.lease.staged and lm.lease.rows.state
            for lm in self.leases
        )
        if clash:
            try:
                self.lender.lend_write(m.request, staging=staging)
            except LeaseError:
                return
            raise AssertionError("a second write lease over the same rows must be refused")
        rows = (end - first) + int(wants_state)
        if staging and rows > self.staging_free():
            try:
                self.lender.lend_write(m.request, staging=True)
            except StagingBusy:
                return
            raise AssertionError("a staged lease beyond the free staging rows must raise StagingBusy")
        lease = self.lender.lend_write(m.request, staging=staging)
        assert self._write_range(lease) == (first, end) or not self.paged
        if not staging:  # rows written in place are not valid until marked
            m.valid[:, first:end] = False
            m.computed = min(m.computed, first * self.bt)
            for g in lease.view.groups:
                if g.kind is CacheKind.STATE:
                    m.checkpoints[g.group_id] = None
        assert sum(g.kind is CacheKind.STATE for g in lease.view.groups) == (len(self.states) if wants_state else 0)
        self.leases.append(LeaseModel(lease, m, rows if staging else 0, (end - first) + len(lease.rows.state)))

    @rule(prompt_index=st.integers(0, 50), start=st.integers(0, 2), corrupt=st.integers(-1, 3),
          staging=st.booleans(), foreign=st.booleans())
    def lend_names(self, prompt_index: int, start: int, corrupt: int, staging: bool, foreign: bool) -> None:
        prompt = self.seen[prompt_index % len(self.seen)]
        names = (self.foreign if foreign else self.lender).names(prompt)[start:].copy()
        if 0 <= corrupt < len(names):
            names[corrupt, 0] ^= 0xFF
        held = self.lender.probe_names(names)
        if foreign:
            assert held == 0, "a name from another tenant's scope must never match"
        if 0 <= corrupt < len(names):
            assert held <= corrupt
        if staging and held > self.staging_free():
            try:
                self.lender.lend_names(names, staging=True)
            except StagingBusy:
                return
            raise AssertionError("a staged lease beyond the free staging rows must raise StagingBusy")
        lease = self.lender.lend_names(names, staging=staging)
        assert lease.found == held and all(g.rows == held for g in lease.view.groups)
        assert [g.group_id for g in lease.view.groups] == [g.group_id for g in self.paged]
        for g in lease.view.groups:
            assert (g.names == names[:held]).all()
        lm = LeaseModel(lease, None, held if staging else 0, held)
        lm.keys = self._read_keys(lease, None)
        self.leases.append(lm)
        self._check_read_rows(lm)

    @rule(prompt_index=st.integers(0, 50))
    def probe(self, prompt_index: int) -> None:
        prompt = self.seen[prompt_index % len(self.seen)]
        assert self.lender.probe(prompt) == self.lender.probe_names(self.lender.names(prompt))

    @precondition(lambda self: any(lm.lease.kind is LeaseKind.WRITE and not lm.lease.marked for lm in self.leases))
    @rule(data=st.data())
    def deliver_and_mark(self, data: st.DataObject) -> None:
        """A fetching backend fills rows (right bytes where it reports a true bit, garbage where
        not), then the holder marks what arrived."""
        lm = data.draw(st.sampled_from([lm for lm in self.leases
                                        if lm.lease.kind is LeaseKind.WRITE and not lm.lease.marked]))
        self._deliver(lm, data)

    @precondition(lambda self: self.open_requests())
    @rule(data=st.data(), staging=st.booleans())
    def fetch_whole(self, data: st.DataObject, staging: bool) -> None:
        """A fetch start to end, as the holder runs it: lend, deliver, mark, release."""
        count = len(self.leases)
        self.lend_write(data, staging)
        if len(self.leases) > count:
            lm = self.leases[-1]
            self._deliver(lm, data)
            lm.lease.release()
            self.leases.remove(lm)

    def _deliver(self, lm: LeaseModel, data: st.DataObject) -> None:
        lease, owner = lm.lease, lm.owner
        assert owner is not None
        masks = [np.array(data.draw(st.lists(st.booleans(), min_size=g.rows, max_size=g.rows)), dtype=bool)
                 for g in lease.view.groups]
        untouched = {}
        for k, (group, bits) in enumerate(zip(lease.view.groups, masks, strict=True)):
            spec = self.lender.layout.group(group.group_id)
            target = self.location(lease, k)
            for row, slot in enumerate(group.slots):
                if group.kind is CacheKind.STATE:
                    key = state_key(owner.request.tokens[: group.tokens.end])
                    pool_slot = owner.request.state_slots[group.group_id]
                else:
                    key = group.name(row)
                    pool_slot = int(lease.rows.block_slots[row])
                target[int(slot)] = page(key, spec) if bits[row] else garbage(spec)
                if lease.staged and not bits[row]:
                    untouched[(group.group_id, pool_slot)] = self.lender.pool(group.group_id)[pool_slot].clone()
        assert lease.mark_arrived(masks) == sum(int(b.sum()) for b in masks)
        paged_k = 0
        for group, bits in zip(lease.view.groups, masks, strict=True):
            if group.kind is CacheKind.STATE:
                if bits[0]:
                    owner.checkpoints[group.group_id] = group.tokens.end
                continue
            blocks = np.arange(group.tokens.start // self.bt, group.tokens.end // self.bt)
            owner.valid[paged_k, blocks[bits]] = True
            paged_k += 1
        for (gid, slot), before in untouched.items():
            assert torch.equal(self.lender.pool(gid)[slot], before), "an unmarked staged row reached the pool (A7)"

    @precondition(lambda self: any(lm.lease.kind is not LeaseKind.WRITE and not lm.lease.marked for lm in self.leases))
    @rule(data=st.data())
    def mark_read(self, data: st.DataObject) -> None:
        lm = data.draw(st.sampled_from([lm for lm in self.leases
                                        if lm.lease.kind is not LeaseKind.WRITE and not lm.lease.marked]))
        masks = [np.array(data.draw(st.lists(st.booleans(), min_size=g.rows, max_size=g.rows)), dtype=bool)
                 for g in lm.lease.view.groups]
        assert lm.lease.mark_arrived(masks) == sum(int(b.sum()) for b in masks)

    @precondition(lambda self: any(lm.lease.marked for lm in self.leases))
    @rule(data=st.data())
    def mark_twice_is_refused(self, data: st.DataObject) -> None:
        lm = data.draw(st.sampled_from([lm for lm in self.leases if lm.lease.marked]))
        try:
            lm.lease.mark_arrived(lm.lease.view.row_masks())
        except LeaseError:
            return
        raise AssertionError("a second mark_arrived must raise LeaseError")

    @precondition(lambda self: self.leases)
    @rule(data=st.data(), twice=st.booleans(), by_exception=st.booleans())
    def release(self, data: st.DataObject, twice: bool, by_exception: bool) -> None:
        lm = data.draw(st.sampled_from(self.leases))
        if by_exception:
            try:
                with lm.lease:
                    raise KeyError("the holder failed mid-transfer")
            except KeyError:
                pass
        else:
            lm.lease.release()
        if twice:
            lm.lease.release()
        assert lm.lease.released
        self.leases.remove(lm)

    # -- invariants --------------------------------------------------------------------------

    @invariant()
    def pins_balance(self) -> None:
        expected = sum(m.request.block_table.size + len(m.request.extra_pins) + int(bool(self.states))
                       for m in self.requests)
        expected += sum(lm.pins for lm in self.leases)
        assert self.lender.pins() == expected
        if not self.requests and not self.leases:
            assert self.lender.pins() == 0
        stats = self.lender.stats()
        assert stats["staging_slots_free"] == self.staging_free()
        assert stats["leases_open"] == len(self.leases) and stats["requests_open"] == len(self.requests)

    @invariant()
    def the_tree_holds_what_its_names_promise(self) -> None:
        for name, slot in list(self.lender._tree.index.items()):
            for g in self.paged:
                assert torch.equal(self.lender.pool(g.group_id)[slot], page(name, g)), \
                    f"committed block in slot {slot} does not hold its name's bytes"

    @invariant()
    def lent_rows_stay_put(self) -> None:
        for lm in self.leases:
            if lm.lease.kind is not LeaseKind.WRITE:
                self._check_read_rows(lm)

    @invariant()
    def open_requests_agree_with_the_model(self) -> None:
        for m in self.requests:
            request = m.request
            assert self.lender.resume_bounds(request) == self.expected_resume(m)
            assert self.lender.probe(request.tokens) >= request.committed_blocks, \
                "a committed block pinned by an open request left the tree"

    def teardown(self) -> None:
        for lm in self.leases:
            lm.lease.release()
        for m in self.requests:
            self.lender.close_request(m.request)
        assert self.lender.pins() == 0
        stats = self.lender.stats()
        event(f"evictions: {'some' if stats['evictions'] else 'none'}")
        event(f"rows marked: {'some' if stats['rows_marked'] else 'none'}")
        assert stats["staging_slots_free"] == STAGING and stats["leases_open"] == 0
        assert stats["blocks_pinned"] == 0 and stats["state_slots_free"] == self.lender.layout.num_state_slots


class MixedLenderMachine(LenderMachine):
    """The same, with a STATE group between the two PAGED ones."""

    layout = staticmethod(lambda: mixed_layout(num_blocks=8))


_settings = settings(max_examples=75, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
TestPagedLender = LenderMachine.TestCase
TestPagedLender.settings = _settings
TestMixedLender = MixedLenderMachine.TestCase
TestMixedLender.settings = _settings
