"""The pull protocol's two state machines, driven without I/O: every transition of the
requesting side and of the serving side, every ordering of cancel, answer, rows, deadline and
peer death, and the two cancel-meets-the-answer races (55dfe49, c5d6258) as fixed cases. No
sockets, no threads, no clocks: microseconds per case, the same result every run.

``test_zz_every_transition_is_driven`` (last) checks that the cases above drove every entry of
both transition tables.

Why one file of this size: that last check reads what every case of both machines recorded in
this module's run (``DRIVEN``), so the cases of both tables and the check belong to one module;
a case stays a few lines beside the table entry it drives. For the same reason the module is one
xdist group: under ``-n 2`` its cases would otherwise be spread over two processes, and the check
would see only the half its own process ran."""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterable

import numpy as np
import pytest
from kvwire_ucx import wire
from kvwire_ucx.protocol import events as ev
from kvwire_ucx.protocol import requester as rq
from kvwire_ucx.protocol import server as sv
from kvwire_ucx.protocol.requester import PullRequester, PullSpec, RequesterState
from kvwire_ucx.protocol.server import PullServer, ReplySpec, ServerState

from kvwire.contract import Cause, OutcomeStatus

R, S = RequesterState, ServerState
SLOT = 8
DRIVEN: dict[tuple[str, str, str], str] = {}  # (machine, state, event) -> the first test that drove it
RAN: set[str] = set()  # node ids of this module's tests that ran in this process
pytestmark = pytest.mark.xdist_group("ucx-protocol")


@pytest.fixture(autouse=True)
def _ran(request: pytest.FixtureRequest):
    yield
    RAN.add(request.node.nodeid)


def _caller() -> str:
    """The innermost test function on the stack. Walks the frames' code objects: inspect.stack()
    read every frame's source and, for frames of no module file (xdist's worker runs under
    ``-c``), scanned all of sys.modules, per event: the 720-orderings tests spent nearly all their
    time there (13 s alone, 187 s beside two more xdist workers)."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name.startswith("test_"):
            return frame.f_code.co_name
        frame = frame.f_back
    return "?"


class Driven:
    """Records which transitions a machine went through, and under which test."""

    def __init__(self, machine: PullRequester | PullServer, kind: str) -> None:
        self.m = machine
        self.kind = kind
        self.log: list[ev.Action] = []

    def __call__(self, event: object) -> list[ev.Action]:
        key = (self.kind, self.m.state.name, type(event).__name__)
        if key not in DRIVEN:
            DRIVEN[key] = _caller()
        actions = self.m.handle(event)
        for a in actions:  # an Ack (a fetch's last word) goes after the holder's wakes; nothing else waits so
            if isinstance(a, ev.Send):
                assert a.after_wakes == isinstance(a.message, wire.Ack), a
        self.log.extend(actions)
        return actions

    @property
    def state(self):
        return self.m.state

    def sent(self, kind: type | tuple[type, ...] = object) -> list[wire.Message]:
        return [a.message for a in self.log if isinstance(a, ev.Send) and isinstance(a.message, kind)]

    def outcomes(self):
        return [a.outcome for a in self.log if isinstance(a, ev.Conclude)]

    def count(self, kind: type) -> int:
        return sum(isinstance(a, kind) for a in self.log)


def of(actions: Iterable[ev.Action], kind: type) -> list:
    return [a for a in actions if isinstance(a, kind)]


# ====================================================================== the requesting side

def requester(*, blocks: int = 4, groups: int = 2, window_rows: int | None = None, one_sided: bool = False,
              slot: int = SLOT, ranges_at_once: int = rq.READ_RANGES_AT_ONCE, breaks: tuple = ()) -> Driven:
    window = (window_rows if window_rows is not None else blocks * groups) * slot
    spec = PullSpec(transfer=7, tag_base=3, group_ids=tuple(range(10, 10 + groups)), slot_bytes=(slot,) * groups,
                    blocks=blocks, width=4, names=bytes(4 * blocks), timeout_s=2.0, window_bytes=window,
                    one_sided=one_sided, peer="P", ranges_at_once=ranges_at_once, breaks=breaks)
    return Driven(PullRequester(spec), "requester")


def rows(pairs: Iterable[tuple[int, int]], failures=()) -> ev.RowsCompleted:
    return ev.RowsCompleted.of(list(pairs), failures)


def every_row(blocks: int = 4, groups: int = 2, counts: tuple[int, ...] | None = None) -> ev.RowsCompleted:
    return rows((gi, ri) for ri in range(blocks) for gi in range(groups) if counts is None or ri < counts[gi])


def started(**kwargs) -> Driven:
    d = requester(**kwargs)
    d(ev.Start(2000))
    return d


def test_start_posts_the_first_window_then_asks_with_it_as_credit() -> None:
    d = requester(window_rows=3)
    actions = d(ev.Start(1500))
    assert [type(a) for a in actions] == [ev.PostReceives, ev.Send, ev.Note, ev.ArmDeadline]
    post, pull = actions[0], actions[1].message
    assert (post.start, post.end, post.counts) == (0, 3, None)
    assert isinstance(pull, wire.Pull) and pull.credit == 3 and pull.timeout_ms == 1500 and not pull.one_sided
    assert d.state is R.ASKED and d.m.outstanding == 3


def test_a_one_sided_start_asks_with_no_credit() -> None:
    d = requester(one_sided=True)
    actions = d(ev.Start(1500))
    assert not of(actions, ev.PostReceives)
    (pull,) = d.sent(wire.Pull)
    assert pull.one_sided and pull.credit == 0 and d.state is R.ASKED


def test_a_pull_the_wire_cannot_carry_fails_at_start_having_posted_and_sent_nothing() -> None:
    for one_sided in (False, True):
        spec = PullSpec(transfer=7, tag_base=3, group_ids=(0, 1 << 32), slot_bytes=(SLOT, SLOT), blocks=4, width=4,
                        names=bytes(16), timeout_s=2.0, window_bytes=8 * SLOT, one_sided=one_sided, peer="P")
        d = Driven(PullRequester(spec), "requester")
        actions = d(ev.Start(1500))
        assert [type(a) for a in actions] == [ev.Conclude, ev.Quiesce] and d.state is R.DONE
        (outcome,) = d.outcomes()
        assert outcome.status is OutcomeStatus.FAILED and outcome.cause is Cause.FAULT
        assert "32 bits" in outcome.reason and not any(m.any() for m in outcome.masks)


def test_a_fetch_cancelled_or_shut_down_before_it_started_ends_quietly() -> None:
    for event, cause in ((ev.HolderCancelled(), Cause.HOLDER_CANCELLED), (ev.Shutdown(), Cause.SHUTDOWN)):
        d = requester()
        d(event)
        assert d.state is R.DONE and not d.sent() and d.count(ev.Quiesce) == 1
        assert d.outcomes()[0].cause is cause


def test_the_whole_prefix_arrives_and_is_acknowledged_once() -> None:
    d = started()
    d(ev.Offered((4, 4)))
    assert d.state is R.RECEIVING
    d(every_row())
    assert d.state is R.DONE
    (ack,) = d.sent(wire.Ack)
    assert ack.rows == 8 and not d.sent(wire.Cancel)
    (outcome,) = d.outcomes()
    assert outcome.is_delivered and all(m.all() for m in outcome.masks)
    assert d.count(ev.Quiesce) == 1


def test_rows_that_overtake_the_offer_count_and_the_offer_concludes() -> None:
    d = started()
    d(every_row())
    assert d.state is R.ASKED and d.m.received == 8
    d(ev.Offered((4, 4)))
    assert d.state is R.DONE and d.sent(wire.Ack)[0].rows == 8 and d.outcomes()[0].is_delivered


def test_a_partial_offer_drains_the_receives_not_offered_and_marks_the_prefix() -> None:
    d = started()
    actions = d(ev.Offered((2, 1)))
    assert of(actions, ev.Drain) == [ev.Drain((2, 1))]
    d(every_row(counts=(2, 1)))
    assert d.state is R.DRAINING  # delivered; the drained receives still complete
    assert d.outcomes()[0].is_delivered and [m.tolist() for m in d.outcomes()[0].masks] == [
        [True, True, False, False], [True, False, False, False]]
    d(rows((gi, ri) for ri in range(4) for gi in range(2) if ri >= (2, 1)[gi]))  # drained: no data
    assert d.state is R.DONE and d.count(ev.Quiesce) == 1 and d.m.received == 3


def test_an_offer_of_nothing_is_delivered_with_no_rows() -> None:
    d = started()
    d(ev.Offered((0, 0)))
    assert d.sent(wire.Ack)[0].rows == 0 and d.outcomes()[0].is_delivered and d.state is R.DRAINING
    d(every_row())
    assert d.state is R.DONE and d.outcomes()[0].rows_delivered == 0


def test_windows_are_refilled_and_named_by_go_once_half_arrived() -> None:
    d = started(blocks=8, window_rows=4)
    d(ev.Offered((8, 8)))
    assert not d.sent(wire.Go)
    d(rows([(0, 0)]))
    assert not d.sent(wire.Go)  # 3 of 4 still in flight: more than half
    actions = d(rows([(1, 0), (0, 1)]))
    (post,) = of(actions, ev.PostReceives)
    (go,) = d.sent(wire.Go)
    assert (post.start, post.end) == (go.start, go.end) == (4, 7)
    assert d.m.outstanding == 4
    done = 3
    while d.state is R.RECEIVING:  # the rows arrive in posting order, two at a time
        d(rows([(seq % 2, seq // 2) for seq in range(done, min(done + 2, d.m.next_seq))]))
        done = min(done + 2, d.m.next_seq)
    gos = d.sent(wire.Go)
    posts = [a for a in d.log if isinstance(a, ev.PostReceives)]
    assert [(g.start, g.end) for g in gos] == [(p.start, p.end) for p in posts[1:]]
    assert all(a.end == b.start for a, b in zip(gos, gos[1:], strict=False)) and gos[-1].end == 16
    assert d.state is R.DONE and d.outcomes()[0].rows_delivered == 16 and len(d.sent(wire.Ack)) == 1


def test_a_decline_ends_the_receives_posted_on_credit() -> None:
    d = started()
    actions = d(ev.Declined("tenant mismatch"))
    assert of(actions, ev.Drain) == [ev.Drain(None)] and of(actions, ev.Note)[0].step == "answered"
    (outcome,) = d.outcomes()
    assert outcome.is_failed and outcome.cause is Cause.DECLINED and "tenant mismatch" in outcome.reason
    assert not d.sent(wire.Cancel) and d.state is R.DRAINING
    d(every_row())
    assert d.state is R.DONE and d.outcomes()[0].rows_delivered == 0


def test_a_shutdown_before_the_answer_cancels_the_pull() -> None:
    d = started()
    d(ev.Shutdown())
    assert d.state is R.STOPPED_UNANSWERED and d.outcomes()[0].cause is Cause.SHUTDOWN
    assert d.sent(wire.Cancel)[0].reason == "the requester shut down"


def test_the_deadline_before_the_answer_cancels_and_the_grace_forces_the_close() -> None:
    d = started()
    actions = d(ev.DeadlinePassed())
    assert d.state is R.STOPPED_UNANSWERED and of(actions, ev.ArmGrace)
    assert d.outcomes()[0].cause is Cause.DEADLINE and "before the peer answered" in d.outcomes()[0].reason
    assert len(d.sent(wire.Cancel)) == 1
    d(ev.DeadlinePassed())  # a second deadline (another timer) arms the grace again, nothing else
    d(ev.HolderCancelled())
    d(ev.Shutdown())
    assert len(d.sent(wire.Cancel)) == 1 and len(d.outcomes()) == 1
    assert of(d(ev.GraceExpired()), ev.CloseConnection)
    d(ev.ConnectionLost("forced", Cause.FAULT))
    assert d.state is R.DRAINING and d.log[-1] == ev.Drain(None)
    d(every_row())
    assert d.state is R.DONE and len(d.outcomes()) == 1


def test_a_stopped_pull_takes_its_late_answer_and_drains() -> None:
    d = started()
    d(ev.HolderCancelled())
    d(rows([(0, 0)]))
    assert d.state is R.STOPPED_UNANSWERED
    d(ev.Declined("the requester cancelled the pull"))
    assert d.state is R.DRAINING and d.log[-2:] == [ev.Note("answered"), ev.Drain(None)]
    d(rows((gi, ri) for ri in range(4) for gi in range(2) if (gi, ri) != (0, 0)))
    assert d.state is R.DONE and len(d.outcomes()) == 1 and len(d.sent(wire.Cancel)) == 1


def test_the_peer_going_away_fails_the_pull_and_drains() -> None:
    d = started()
    d(ev.ConnectionLost("peer P is gone", Cause.PEER_GONE))
    assert d.outcomes()[0].cause is Cause.PEER_GONE and d.state is R.DRAINING and not d.sent(wire.Cancel)
    d(ev.ConnectionLost("again"))
    d(every_row())
    assert d.state is R.DONE


def test_rows_from_a_peer_the_address_does_not_name_never_count() -> None:
    """Rows that landed in the first window before the peer's Hello showed another instance
    answering at the address (a stale address) are not the named peer's: none stays delivered.
    A peer that merely went away keeps the rows it delivered (A5)."""
    for untrusted, kept in ((False, 2), (True, 0)):
        d = started()
        d(rows([(0, 0), (1, 0)]))
        d(ev.ConnectionLost("another kvwire-ucx backend answers at P", Cause.PEER_GONE, untrusted))
        (outcome,) = d.outcomes()
        assert outcome.is_failed and outcome.cause is Cause.PEER_GONE and outcome.rows_delivered == kept


def test_a_stop_while_receiving_cancels_and_waits_for_the_rows_named() -> None:
    for event, cause in ((ev.HolderCancelled(), Cause.HOLDER_CANCELLED), (ev.Shutdown(), Cause.SHUTDOWN),
                         (ev.DeadlinePassed(), Cause.DEADLINE)):
        d = started()
        d(ev.Offered((4, 4)))
        d(rows([(0, 0)]))
        d(event)
        assert d.state is R.DRAINING and d.outcomes()[0].cause is cause and len(d.sent(wire.Cancel)) == 1
        d(ev.Declined("a stop that crossed the Cancel"))
        d(ev.DeadlinePassed())
        d(ev.HolderCancelled())
        d(ev.Shutdown())
        d(ev.ConnectionLost("gone"))
        assert of(d(ev.GraceExpired()), ev.CloseConnection)
        d(rows((gi, ri) for ri in range(4) for gi in range(2) if (gi, ri) != (0, 0)))
        assert d.state is R.DONE and not d.sent(wire.Ack) and len(d.outcomes()) == 1


def test_a_stop_from_the_serving_end_is_acknowledged() -> None:
    d = started()
    d(ev.Offered((4, 4)))
    d(ev.Declined("the serving end's deadline passed"))
    (cancel,) = d.sent(wire.Cancel)
    assert cancel.reason == "acknowledging the stop" and d.outcomes()[0].cause is Cause.DECLINED
    d(every_row())
    assert d.state is R.DONE


def test_a_row_that_fails_fails_the_pull_saying_which() -> None:
    d = started()
    d(ev.Offered((4, 4)))
    d(rows([(0, 0)], failures=[(1, 0, "UCXXConnectionResetError: reset", True)]))
    outcome = d.outcomes()[0]
    assert outcome.cause is Cause.PEER_GONE and "row 0 of group 11" in outcome.reason
    assert len(d.sent(wire.Cancel)) == 1 and d.state is R.DRAINING
    d(rows((gi, ri) for ri in range(1, 4) for gi in range(2)))
    assert d.state is R.DONE
    before = started()
    before(rows([], failures=[(0, 0, "UCXXMessageTruncatedError: too long", False)]))
    assert before.state is R.STOPPED_UNANSWERED and before.outcomes()[0].cause is Cause.FAULT
    lone = started(blocks=1, groups=1)
    lone(rows([], failures=[(0, 0, "reset", True)]))
    assert lone.state is R.DONE


def test_a_receive_that_cannot_be_posted_fails_the_pull() -> None:
    d = started(window_rows=3)
    d(ev.PostFailed("no memory", reached=2))
    assert d.outcomes()[0].cause is Cause.FAULT and d.m.outstanding == 2 and d.state is R.DRAINING
    assert d.log[-1] == ev.Drain(None) and len(d.sent(wire.Cancel)) == 1
    d(rows([(0, 0), (1, 0)]))
    assert d.state is R.DONE
    later = started(blocks=8, window_rows=4)
    later(ev.Offered((8, 8)))
    later(rows([(0, 0), (1, 0), (0, 1)]))
    later(ev.PostFailed("no memory", reached=later.m.next_seq))
    assert later.state is R.DRAINING and later.outcomes()[0].cause is Cause.FAULT


def test_a_message_that_cannot_be_posted_uncounts_exactly_its_unposted_rows() -> None:
    """A window goes as messages (runs of one group's rows), so a message of group 0 posted
    before the failed one may reach past the failed message's first row: the rows left out are
    the ones the mover names (``unposted``), not those from ``reached`` on."""
    d = started(blocks=8, window_rows=4)  # credit: numbers 0-3 (blocks 0-1 of 2 groups)
    d(ev.Offered((8, 8)))
    actions = d(rows([(0, 0), (1, 0), (0, 1), (1, 1)]))
    assert of(actions, ev.PostReceives) == [ev.PostReceives(4, 8, (8, 8))] and d.m.outstanding == 4
    # the window's messages: group 0's rows 2-3 (numbers 4, 6), then group 1's (5, 7), which failed
    d(ev.PostFailed("no memory", reached=5, unposted=np.array([1, 1])))
    assert d.m.outstanding == 2 and d.state is R.DRAINING and d.m.inflight_bytes == 2 * SLOT
    d(rows([(0, 2), (0, 3)]))
    assert d.state is R.DONE


def test_after_the_offer_a_window_counts_receives_so_adjacent_rows_go_at_once() -> None:
    """The credit is one receive per row (4 rows: the window); after the Offer, the window is 4
    receives, and rows adjacent at both ends take one receive per group: the 12 rows left go in
    one Go window of 2 receives (by bytes it would have been 4 rows)."""
    d = started(blocks=8, window_rows=4, breaks=((), ()))
    assert d.sent(wire.Pull)[0].credit == 4 and d.m.receives_out == 4
    d(ev.Offered((8, 8), ((), ())))
    actions = d(rows([(0, 0), (1, 0), (0, 1), (1, 1)]))
    assert of(actions, ev.PostReceives) == [ev.PostReceives(4, 16, (8, 8))] and d.sent(wire.Go)[-1] == wire.Go(7, 4, 16)
    assert d.m.receives_out == 2 and d.m.outstanding == 12
    d(ev.RowsCompleted(np.array([0] * 6 + [1] * 6), np.array(list(range(2, 8)) * 2), receives=2))
    assert d.state is R.DONE and d.sent(wire.Ack)[0].rows == 16
    # the serving end's breaks cut the window too: group 0's rows break at 5 there, so 3 receives
    e = started(blocks=8, window_rows=4, breaks=((), ()))
    e(ev.Offered((8, 8), ((5,), ())))
    actions = e(rows([(0, 0), (1, 0), (0, 1), (1, 1)]))
    assert of(actions, ev.PostReceives) == [ev.PostReceives(4, 16, (8, 8))] and e.m.receives_out == 3
    # and a budget of receives cuts the window before the first message past it
    f = started(blocks=8, window_rows=2, breaks=((3,), ()))
    f(ev.Offered((8, 8), ((), ())))
    actions = f(rows([(0, 0), (1, 0)]))
    # messages from number 2: group 0 rows 1-2 (numbers 2, 4), group 1 rows 1-7 (3..15), group 0 rows 3-7 (6..14)
    assert of(actions, ev.PostReceives) == [ev.PostReceives(2, 6, (8, 8))] and f.m.receives_out == 2
    assert f.m.outstanding == 4  # group 0 rows 1-2, group 1 rows 1-2 (cut at number 6)


def test_answers_that_do_not_fit_the_pull_are_violations() -> None:
    d = started()
    assert of(d(ev.Offered((5, 4))), ev.Violation) and d.state is R.ASKED  # more rows than asked
    assert of(d(ev.Offered((4,))), ev.Violation)  # other groups
    assert of(d(ev.ReadOffered((4, 4))), ev.Violation)  # two-sided pull, one-sided answer
    d(ev.Offered((4, 4)))
    assert of(d(ev.Offered((4, 4))), ev.Violation) and of(d(ev.ReadOffered((4, 4))), ev.Violation)
    d(rows([(0, 0)]))
    d(ev.HolderCancelled())
    assert of(d(ev.Offered((4, 4))), ev.Violation) and of(d(ev.ReadOffered((4, 4))), ev.Violation)
    one = started(one_sided=True)
    assert of(one(ev.Offered((4, 4))), ev.Violation) and one.state is R.ASKED
    assert of(one(ev.ReadOffered((4, 4), agent_known=False)), ev.Violation) and one.state is R.ASKED
    stopped = started()
    stopped(ev.HolderCancelled())
    assert of(stopped(ev.Offered((9, 9))), ev.Violation) and stopped.state is R.STOPPED_UNANSWERED


def test_a_one_sided_pull_reads_its_ranges_at_once_then_acknowledges() -> None:
    """Every planned range is read in one batch (not one range after another: that took twice a
    bare read of the span on an H100); the pull concludes when the batch is read."""
    d = started(one_sided=True, blocks=5, window_rows=4)  # 2 blocks of 2 groups per range
    actions = d(ev.ReadOffered((5, 3)))
    (plan,) = of(actions, ev.PlanReads)
    assert plan.ranges == ((0, 2), (2, 4), (4, 5)) and of(actions, ev.StartRead) == [ev.StartRead(0, 3)]
    assert d.state is R.READING
    assert of(d(ev.Offered((5, 3))), ev.Violation) and of(d(ev.ReadOffered((5, 3))), ev.Violation)
    assert not of(d(ev.ReadCompleted()), ev.StartRead)
    assert d.state is R.DONE and d.sent(wire.Ack)[0].rows == 8
    assert [m.tolist() for m in d.outcomes()[0].masks] == [[True] * 5, [True] * 3 + [False] * 2]


def test_a_pull_a_pushed_offer_answers_sends_no_pull_ack_or_cancel() -> None:
    """A fetch answered from an offer the serving end pushed: Start(pushed) asks nothing (no
    Pull, a "pushed" note, its deadline armed); the answer made at this end is read as a
    ReadOffer's; its end says nothing to the serving end, which keeps no reply for it."""
    d = requester(one_sided=True, blocks=5, window_rows=4)
    actions = d(ev.Start(2000, pushed=True))
    assert [type(a) for a in actions] == [ev.Note, ev.ArmDeadline] and actions[0].step == "pushed"
    assert d.state is R.ASKED and not d.sent()
    assert of(d(ev.ReadOffered((5, 5))), ev.StartRead) == [ev.StartRead(0, 3)] and d.state is R.READING
    d(ev.ReadCompleted())
    assert d.state is R.DONE and d.outcomes()[0].is_delivered and not d.sent()
    two_sided = requester(blocks=2)  # a two-sided fetch is never pushed: it asks whatever the event says
    assert len(two_sided.sent(wire.Pull)) == 0 and two_sided(ev.Start(2000, pushed=True))
    assert len(two_sided.sent(wire.Pull)) == 1
    for stop in (ev.HolderCancelled(), ev.DeadlinePassed(), ev.Shutdown()):
        before = requester(one_sided=True)
        before(ev.Start(2000, pushed=True))
        before(stop)  # stopped before the answer (held): concluded and done, nothing said
        assert before.state is R.DONE and not before.outcomes()[0].is_delivered and not before.sent()
        reading = requester(one_sided=True)
        reading(ev.Start(2000, pushed=True))
        reading(ev.ReadOffered((4, 4)))
        reading(stop)
        assert reading.state is R.DRAINING and not reading.sent()
        reading(ev.ReadStopped())
        assert reading.state is R.DONE
    withdrawn = requester(one_sided=True)
    withdrawn(ev.Start(2000, pushed=True))
    withdrawn(ev.ReadOffered((4, 4)))
    withdrawn(ev.Declined("the serving end withdrew the standing offer"))  # its offer withdrawn mid-read
    out = withdrawn.outcomes()[0]
    assert out.is_failed and out.cause is Cause.DECLINED and "withdrew" in out.reason and not withdrawn.sent()
    assert withdrawn.state is R.DRAINING
    withdrawn(ev.ReadCompleted())  # the read in flight finished: only now is the fetch quiesced
    assert withdrawn.state is R.DONE and withdrawn.count(ev.Quiesce) == 1 and not withdrawn.sent()
    failed = requester(one_sided=True)
    failed(ev.Start(2000, pushed=True))
    failed(ev.ReadOffered((4, 4)))
    failed(ev.ReadFailed("injected", Cause.FAULT, stopped=True))
    assert failed.state is R.DONE and failed.outcomes()[0].is_failed and not failed.sent()


def test_a_one_sided_pull_reads_a_bounded_number_of_ranges_at_once() -> None:
    d = started(one_sided=True, blocks=5, window_rows=4, ranges_at_once=2)
    actions = d(ev.ReadOffered((5, 3)))
    assert of(actions, ev.StartRead) == [ev.StartRead(0, 2)] and d.state is R.READING
    assert of(d(ev.ReadCompleted()), ev.StartRead) == [ev.StartRead(2, 3)]
    assert [m.tolist() for m in d.m.masks] == [[True] * 4 + [False], [True] * 3 + [False] * 2]
    d(ev.ReadCompleted())
    assert d.state is R.DONE and d.sent(wire.Ack)[0].rows == 8


def test_a_one_sided_answer_of_nothing_or_an_unusable_agent() -> None:
    d = started(one_sided=True)
    d(ev.ReadOffered((0, 0)))
    assert d.state is R.DONE and d.sent(wire.Ack)[0].rows == 0 and d.outcomes()[0].is_delivered
    bad = started(one_sided=True)
    bad(ev.ReadOffered((4, 4), problem="peer P's NIXL agent is unusable: refused"))
    assert bad.state is R.DONE and bad.outcomes()[0].cause is Cause.FAULT and len(bad.sent(wire.Cancel)) == 1


def test_a_read_that_fails_or_is_stopped() -> None:
    d = started(one_sided=True)
    d(ev.ReadOffered((4, 4)))
    d(ev.ReadFailed("reading rows from P failed: disconnected", Cause.PEER_GONE, stopped=False))
    # concluded, but the read has not stopped: the serving end is not told yet (its rows stay pinned)
    assert d.state is R.DRAINING and d.outcomes()[0].cause is Cause.PEER_GONE and not d.sent(wire.Cancel)
    d(ev.ReadFailed("still failing", stopped=False))
    assert of(d(ev.GraceExpired()), ev.ReleaseRead) and not d.sent(wire.Cancel)
    d(ev.ReadStopped())
    assert d.state is R.DONE and len(d.sent(wire.Cancel)) == 1
    quick = started(one_sided=True)
    quick(ev.ReadOffered((4, 4)))
    quick(ev.ReadFailed("could not start", stopped=True))
    assert quick.state is R.DONE
    late = started(one_sided=True)
    late(ev.ReadOffered((4, 4)))
    late(ev.ReadFailed("failed", stopped=False))
    late(ev.ReadFailed("failed, let go", stopped=True))
    assert late.state is R.DONE


def test_a_stop_while_reading_waits_for_the_read_in_flight() -> None:
    for event in (ev.HolderCancelled(), ev.Shutdown(), ev.DeadlinePassed(), ev.ConnectionLost("gone"),
                  ev.Declined("stop")):
        d = started(one_sided=True, window_rows=2)
        d(ev.ReadOffered((4, 4)))
        d(event)
        assert d.state is R.DRAINING and len(d.outcomes()) == 1
        # nothing is said while the read is in flight: a Cancel would let the serving end unpin
        # rows the read still reads
        assert not d.sent((wire.Cancel, wire.Ack)), event
        for later in (ev.HolderCancelled(), ev.Shutdown(), ev.DeadlinePassed(), ev.ConnectionLost("gone")):
            d(later)
        d(ev.ReadCompleted())  # the range in flight finishes; no next one starts
        assert d.state is R.DONE and not of(d.log, ev.StartRead)[1:] and not d.sent(wire.Ack)
        # the connection was lost meanwhile (the last of the later events): no one is left to tell
        assert not d.sent(wire.Cancel), event
    for event in (ev.HolderCancelled(), ev.Shutdown(), ev.DeadlinePassed(), ev.Declined("stop")):
        d = started(one_sided=True, window_rows=2)
        d(ev.ReadOffered((4, 4)))
        d(event)
        assert not d.sent((wire.Cancel, wire.Ack)), event
        d(ev.ReadCompleted())
        # once the read in flight has finished, the serving end hears it, once
        assert d.state is R.DONE and len(d.sent(wire.Cancel)) == 1 and not d.sent(wire.Ack), event


def test_race_55dfe49_an_offer_after_the_holders_cancel_still_ends_with_a_cancel() -> None:
    """The offer arrives after the holder cancelled: the serving end must hear a Cancel (it
    did not before 55dfe49, and waited for an Ack until its deadline)."""
    d = started()
    d(ev.HolderCancelled())
    d(ev.Offered((4, 4)))
    d(every_row())
    assert d.state is R.DONE and len(d.sent(wire.Cancel)) == 1 and not d.sent(wire.Ack)
    assert d.m.events() == ["Start", "HolderCancelled", "Offered", "RowsCompleted"]
    # and the other order: the cancel reaches the machine after it took the offer
    e = started()
    e(ev.Offered((4, 4)))
    e(ev.HolderCancelled())
    e(every_row())
    assert e.state is R.DONE and len(e.sent(wire.Cancel)) == 1 and not e.sent(wire.Ack)


def test_race_c5d6258_a_cancel_after_every_row_overtook_the_offer_still_tells_the_serving_end() -> None:
    """Every receive completed before the offer came; the holder cancels: nothing is posted,
    and the serving end must still hear a Cancel (before c5d6258 it heard nothing)."""
    d = started()
    d(every_row())
    actions = d(ev.HolderCancelled())
    assert d.state is R.DONE and [type(m) for m in d.sent()] == [wire.Pull, wire.Cancel]
    assert of(actions, ev.Quiesce) and d.outcomes()[0].cause is Cause.HOLDER_CANCELLED


REQUESTER_EVENTS = ("cancel", "offer", "rows", "deadline", "lost")


class FakeRequesterEnd:
    """Plays the engine and the serving end around a requesting machine: posted receives, the
    drains, the credit rows the serving end sends once it answered, and the rule that nothing
    more reaches a machine that is DONE or whose connection closed."""

    def __init__(self, d: Driven, counts: tuple[int, ...]) -> None:
        self.d, self.counts = d, counts
        self.posted: set[tuple[int, int]] = set()
        self.drained: set[tuple[int, int]] = set()
        self.closed = False
        self.apply(d(ev.Start(2000)))

    def apply(self, actions: list[ev.Action]) -> None:
        for action in actions:
            if isinstance(action, ev.PostReceives):
                for seq in range(action.start, action.end):
                    ri, gi = divmod(seq, 2)
                    if action.counts is None or ri < action.counts[gi]:
                        self.posted.add((gi, ri))
            elif isinstance(action, ev.Drain):
                self.drained |= {(g, r) for g, r in self.posted if action.counts is None or r >= action.counts[g]}
            elif isinstance(action, (ev.Violation, ev.CloseConnection)):
                self.feed(ev.ConnectionLost("closed", Cause.FAULT))

    def feed(self, event: object) -> None:
        if self.d.state is R.DONE:
            return
        if isinstance(event, ev.ConnectionLost):
            if self.closed:
                return
            self.closed = True
        self.apply(self.d(event))

    def step(self, name: str) -> None:
        if name == "cancel":
            self.feed(ev.HolderCancelled())
        elif name == "deadline":
            self.feed(ev.DeadlinePassed())
        elif name == "lost":
            self.feed(ev.ConnectionLost("peer P is gone"))
        elif not self.closed and name == "offer":
            self.feed(ev.Offered(self.counts))
        elif not self.closed and name == "rows":  # the serving end's rows, sent on the credit
            self.complete({(g, r) for g, r in self.posted - self.drained if r < self.counts[g]})

    def complete(self, which: set[tuple[int, int]]) -> None:
        which &= self.posted
        if which:
            self.posted -= which
            self.feed(rows(sorted(which)))

    def finish(self) -> None:
        """What is left: drained receives complete; the grace closes a connection left open."""
        self.complete(set(self.drained))
        if self.d.state is not R.DONE:
            self.feed(ev.GraceExpired())
            self.complete(set(self.drained))


@pytest.mark.parametrize("counts", [(4, 4), (2, 0)])
def test_every_ordering_of_cancel_answer_rows_deadline_and_peer_death(counts) -> None:
    """120 orderings x 2 answers: each ends quiesced, concluded once by its first stop, and says
    exactly one last word (an Ack, a Cancel, or none when the peer went first)."""
    for order in itertools.permutations(REQUESTER_EVENTS):
        d = requester()
        end = FakeRequesterEnd(d, counts)
        for name in order:
            end.step(name)
        end.finish()
        assert d.state is R.DONE, (order, d.m.events())
        assert d.count(ev.Quiesce) == 1, order
        last_words = d.sent((wire.Ack, wire.Cancel))
        assert len(last_words) <= 1, (order, last_words)
        first = d.outcomes()[0]
        heard = [e for e in d.m.events() if e in ("HolderCancelled", "DeadlinePassed", "ConnectionLost")]
        if first.is_delivered:
            assert "Offered" in d.m.events() and last_words and isinstance(last_words[0], wire.Ack), order
        else:
            expected = {"HolderCancelled": Cause.HOLDER_CANCELLED, "DeadlinePassed": Cause.DEADLINE,
                        "ConnectionLost": Cause.PEER_GONE}[heard[0]]
            assert first.cause is expected, (order, first)
            assert bool(last_words) is (heard[0] != "ConnectionLost"), (order, last_words)
            assert not last_words or isinstance(last_words[0], wire.Cancel), order


# ====================================================================== the serving side

def server(*, blocks: int = 4, groups: int = 2, credit: int = 8, one_sided: bool = False) -> Driven:
    return Driven(PullServer(ReplySpec(7, credit, groups, blocks, one_sided=one_sided, peer="Q")), "server")


def answered(counts=(4, 4), **kwargs) -> Driven:
    d = server(**kwargs)
    d(ev.Answered(counts, (4,) * len(counts)))
    return d


def test_an_answer_offers_sends_the_credit_and_concludes_on_the_ack() -> None:
    d = server(credit=5)
    actions = d(ev.Answered((4, 4), (4, 4)))
    assert d.sent() == [wire.Offer(7, (4, 4))] and of(actions, ev.SendRows) == [ev.SendRows(0, 5, (4, 4))]
    assert of(actions, ev.ArmDeadline) and d.state is S.SENDING and d.m.outstanding == 5
    d(ev.SendsCompleted(5))
    assert d.state is S.SENDING  # rows 5..7 are not named yet
    assert of(d(ev.GoReceived(5, 8)), ev.SendRows) == [ev.SendRows(5, 8, (4, 4))]
    d(ev.SendsCompleted(3))
    assert d.state is S.AWAITING_ACK and d.count(ev.Quiesce) == 1
    d(ev.AckReceived(8))
    assert d.state is S.DONE and d.outcomes()[0].is_delivered and d.count(ev.Quiesce) == 1


def test_a_go_that_names_the_last_rows_at_once_quiesces_on_their_completion() -> None:
    d = answered(credit=2)
    d(ev.SendsCompleted(2))
    d(ev.GoReceived(2, 8))
    d(ev.AckReceived(8))
    assert d.state is S.DRAINING and d.outcomes()[0].is_delivered  # the receiver finished first
    d(ev.SendsCompleted(6))
    assert d.state is S.DONE and d.count(ev.Quiesce) == 1
    short = answered((1, 0), credit=1)
    assert short.state is S.SENDING
    short(ev.GoReceived(1, 2))  # rows past the offered ones: nothing to send, and all offered named
    assert short.state is S.SENDING and short.m.outstanding == 1
    none_named = answered((0, 1), credit=1)  # the credit names row 0 of group 0, not offered
    assert none_named.m.outstanding == 0 and none_named.state is S.SENDING
    none_named(ev.GoReceived(1, 2))
    assert none_named.state is S.SENDING
    tiny = answered((1, 1), credit=2)
    tiny(ev.SendsCompleted(2))
    assert tiny.state is S.AWAITING_ACK
    assert of(tiny(ev.GoReceived(2, 8)), ev.SendRows) and tiny.m.outstanding == 0
    assert tiny.state is S.AWAITING_ACK  # a Go for rows past the offered ones sends nothing
    first = server(credit=2)
    first(ev.Answered((1, 0), (1, 0)))
    assert first.m.outstanding == 1
    gone = server(credit=1)
    gone(ev.Answered((0, 1), (0, 1)))
    gone(ev.GoReceived(1, 2))
    assert gone.state is S.SENDING


def test_rows_that_do_not_fit_the_pull_refuse_it() -> None:
    d = server()
    d(ev.Answered((4, 4), (4, 4), refusal="slot size differs in group 10"))
    assert d.state is S.DONE and isinstance(d.sent()[0], wire.Decline)
    assert d.outcomes()[0].cause is Cause.DECLINED and d.count(ev.Quiesce) == 1


def test_nothing_held_is_delivered_on_the_answer_alone() -> None:
    for one_sided in (False, True):
        d = server(one_sided=one_sided)
        d(ev.Answered((0, 0), (0, 0)))
        assert d.state is S.DONE and d.outcomes()[0].is_delivered and not of(d.log, ev.SendRows)


def test_peer_mistakes_are_violations() -> None:
    d = server()
    assert of(d(ev.GoReceived(0, 1)), ev.Violation) and d.state is S.WAITING
    d(ev.AckReceived(3))  # an Ack before any answer: nothing to confirm
    d(ev.Answered((4, 4), (4, 4)))
    assert of(d(ev.GoReceived(3, 9)), ev.Violation)  # not where the credit ended
    assert of(d(ev.GoReceived(8, 9)), ev.Violation)  # past the pull's rows
    assert of(d(ev.AckReceived(5)), ev.Violation) and d.state is S.SENDING
    d(ev.SendsCompleted(8))
    assert of(d(ev.AckReceived(5)), ev.Violation) and d.state is S.AWAITING_ACK
    one = answered(one_sided=True)
    assert of(one(ev.GoReceived(0, 1)), ev.Violation) and of(one(ev.AckReceived(1)), ev.Violation)
    one(ev.DeadlinePassed())
    assert of(one(ev.GoReceived(0, 1)), ev.Violation)
    drain = answered()
    drain(ev.CancelReceived("stop"))
    assert of(drain(ev.GoReceived(8, 8 + 1)), ev.Violation)


def test_a_one_sided_answer_offers_reads_and_ends_on_the_ack_or_cancel() -> None:
    for last, status in ((ev.AckReceived(8), OutcomeStatus.DELIVERED), (ev.CancelReceived("no"), OutcomeStatus.CANCELLED),
                         (ev.ConnectionLost("gone"), OutcomeStatus.FAILED)):
        d = server(one_sided=True)
        actions = d(ev.Answered((4, 4), (4, 4)))
        assert of(actions, ev.SendReadOffer) == [ev.SendReadOffer((4, 4))] and d.state is S.OFFERED_READS
        assert not d.count(ev.Quiesce)  # the requester may read until it says it finished
        d(last)
        assert d.state is S.DONE and d.outcomes()[0].status is status and d.count(ev.Quiesce) == 1


def test_a_one_sided_stop_waits_for_the_requesters_word_or_the_grace() -> None:
    for event in (ev.DeadlinePassed(), ev.HolderCancelled(), ev.Shutdown()):
        for last in (ev.AckReceived(8), ev.CancelReceived("ok"), ev.ConnectionLost("gone")):
            d = answered(one_sided=True)
            d(event)
            assert d.state is S.STOPPING and isinstance(d.sent()[-1], wire.Decline) and not d.count(ev.Quiesce)
            d(ev.DeadlinePassed())
            assert of(d(ev.GraceExpired()), ev.CloseConnection)
            d(last)
            assert d.state is S.DONE and d.count(ev.Quiesce) == 1 and len(d.outcomes()) == 1


@pytest.mark.parametrize(("event", "cause", "declines"), [
    (ev.CancelReceived("the requester cancelled the pull"), Cause.PEER_CANCELLED, True),
    (ev.AnswerUnclaimed(), Cause.DEADLINE, True),
    (ev.ConnectionLost("gone"), Cause.PEER_GONE, False),
    (ev.Shutdown(), Cause.SHUTDOWN, True),
])
def test_a_pull_that_ends_before_the_answer_concludes_the_late_answer_at_once(event, cause, declines) -> None:
    d = server()
    d(event)
    assert d.state is S.GONE and bool(d.sent(wire.Decline)) is declines
    d(ev.Answered((4, 4), (4, 4)))
    assert d.state is S.DONE and d.outcomes()[0].cause is cause and d.count(ev.Quiesce) == 1
    assert len(d.sent()) == int(declines)  # the pull's one answer went out already (or could not)
    for late in (ev.AnswerWithdrawn(), ev.HolderDeclined("no")):
        g = server()
        g(event)
        g(late)
        assert g.state is S.DONE and len(g.sent()) == int(declines)


def test_the_holder_declines_or_withdraws_before_the_answer() -> None:
    d = server()
    d(ev.HolderDeclined("tenant mismatch"))
    assert d.state is S.DONE and d.sent() == [wire.Decline(7, "tenant mismatch")] and not d.count(ev.Quiesce)
    w = server()
    w(ev.AnswerWithdrawn())
    assert w.state is S.DONE and w.sent() == [wire.Decline(7, "the serving end cancelled its answer")]
    assert w.count(ev.Quiesce) == 1


@pytest.mark.parametrize(("event", "cause"), [(ev.DeadlinePassed(), Cause.DEADLINE),
                                              (ev.HolderCancelled(), Cause.HOLDER_CANCELLED),
                                              (ev.Shutdown(), Cause.SHUTDOWN)])
def test_a_stop_while_sending_tells_the_requester_and_honours_what_it_named(event, cause) -> None:
    d = answered(credit=3)
    d(event)
    assert d.state is S.STOPPING and d.outcomes()[0].cause is cause and isinstance(d.sent()[-1], wire.Decline)
    for again in (ev.DeadlinePassed(), ev.HolderCancelled(), ev.Shutdown()):
        d(again)
    assert len(d.sent(wire.Decline)) == 1
    d(ev.SendsCompleted(3))
    assert d.state is S.STOPPING  # a Go may have crossed the stop
    assert of(d(ev.GoReceived(3, 8)), ev.SendRows)
    d(ev.SendsCompleted(1, failures=((1, 3, "reset"),)))
    d(ev.SendsCompleted(3))
    assert d.state is S.STOPPED and d.count(ev.Quiesce) == 1
    for again in (ev.DeadlinePassed(), ev.HolderCancelled(), ev.Shutdown()):
        d(again)
    assert of(d(ev.GoReceived(8, 8)), ev.SendRows) and d.m.outstanding == 0 and d.state is S.STOPPED
    assert of(d(ev.GraceExpired()), ev.CloseConnection)
    d(ev.CancelReceived("acknowledging the stop"))
    assert d.state is S.DONE and d.count(ev.Quiesce) == 1 and len(d.outcomes()) == 1


def test_a_stopped_reply_ends_on_the_requesters_word_or_its_going() -> None:
    for last in (ev.AckReceived(8), ev.CancelReceived("ok"), ev.ConnectionLost("gone")):
        d = answered(credit=3)
        d(ev.DeadlinePassed())
        d(last)
        assert d.state is S.DRAINING
        d(ev.ConnectionLost("gone"))
        for late in (ev.AckReceived(8), ev.CancelReceived("twice"), ev.DeadlinePassed(), ev.HolderCancelled(),
                     ev.Shutdown()):
            d(late)
        assert of(d(ev.GraceExpired()), ev.CloseConnection)
        d(ev.SendsCompleted(3))
        assert d.state is S.DONE and d.count(ev.Quiesce) == 1 and len(d.outcomes()) == 1
        quiet = answered(credit=3)
        quiet(ev.DeadlinePassed())
        quiet(ev.SendsCompleted(3))
        quiet(last)
        assert quiet.state is S.DONE and quiet.count(ev.Quiesce) == 1


def test_a_stop_after_every_row_was_sent_is_already_quiesced() -> None:
    for event in (ev.DeadlinePassed(), ev.HolderCancelled(), ev.Shutdown()):
        d = answered()
        d(ev.SendsCompleted(8))
        d(event)
        assert d.state is S.STOPPED and d.count(ev.Quiesce) == 1
        d(ev.AckReceived(8))
        assert d.state is S.DONE and d.count(ev.Quiesce) == 1
        s = answered()
        s(event)
        s(ev.SendsCompleted(8))
        s(ev.ConnectionLost("gone"))
        assert s.state is S.DONE
    late = answered(credit=3)
    late(ev.SendsCompleted(3))
    late(ev.GoReceived(3, 8))
    late(ev.SendsCompleted(5))
    late(ev.DeadlinePassed())
    assert late.state is S.STOPPED
    late(ev.GraceExpired())
    assert of(late.log, ev.CloseConnection)


def test_the_requester_ending_the_pull_while_rows_go_out() -> None:
    for last, status in ((ev.AckReceived(8), OutcomeStatus.DELIVERED), (ev.CancelReceived("no"), OutcomeStatus.CANCELLED),
                         (ev.ConnectionLost("gone"), OutcomeStatus.FAILED)):
        d = answered()
        d(last)
        assert d.state is S.DRAINING and d.outcomes()[0].status is status
        d(ev.SendsCompleted(8))
        assert d.state is S.DONE and d.count(ev.Quiesce) == 1
        q = answered()
        q(ev.SendsCompleted(8))
        q(last)
        assert q.state is S.DONE and q.count(ev.Quiesce) == 1
    c = answered()
    c(ev.CancelReceived(""))
    assert c.outcomes()[0].by_peer and c.outcomes()[0].cause is Cause.PEER_CANCELLED


def test_a_row_that_cannot_be_sent_fails_the_reply_and_stops_the_requester() -> None:
    d = answered()
    d(ev.SendsCompleted(7, failures=((1, 3, "UCXXConnectionResetError: reset"),)))
    assert d.state is S.STOPPED and d.outcomes()[0].cause is Cause.PEER_GONE
    assert isinstance(d.sent()[-1], wire.Decline) and d.count(ev.Quiesce) == 1
    p = answered(credit=3)
    p(ev.SendFailed("endpoint closed", posted=1))
    assert of(p.log, ev.CloseConnection)[0].lost and p.m.outstanding == 1
    p(ev.DeadlinePassed())
    p(ev.GoReceived(3, 8))
    p(ev.SendFailed("endpoint closed", posted=2))
    assert p.m.outstanding == 3
    p(ev.ConnectionLost("gone"))
    assert p.state is S.DRAINING
    p(ev.SendsCompleted(3))
    assert p.state is S.DONE


SERVER_EVENTS = ("cancel", "sent", "deadline", "lost", "holder-cancel", "ack")


@pytest.mark.parametrize("one_sided", [False, True])
def test_every_ordering_of_the_requesters_word_sends_deadline_death_and_cancel(one_sided) -> None:
    """720 orderings: each ends quiesced once, concluded once by whatever came first, and tells
    the requester to stop at most once."""
    for order in itertools.permutations(SERVER_EVENTS):
        d = answered(one_sided=one_sided)
        closed = False
        for name in order:
            if d.state is S.DONE:
                break
            if name == "sent":
                if d.m.outstanding:
                    d(ev.SendsCompleted(d.m.outstanding))
            elif name == "lost":
                if not closed:
                    closed = True
                    d(ev.ConnectionLost("gone"))
            elif closed:
                continue
            elif name == "cancel":
                d(ev.CancelReceived("stop"))
            elif name == "ack":
                if "CancelReceived" not in d.m.events():
                    d(ev.AckReceived(8))
            elif name == "deadline":
                d(ev.DeadlinePassed())
            else:
                d(ev.HolderCancelled())
        if d.state is not S.DONE and d.m.outstanding:
            d(ev.SendsCompleted(d.m.outstanding))
        if d.state is not S.DONE:
            d(ev.ConnectionLost("the grace closed it"))
        assert d.state is S.DONE, (order, d.m.events())
        assert d.count(ev.Quiesce) == 1, order
        assert len(d.sent(wire.Decline)) <= 1, order
        assert len(d.outcomes()) >= 1


# ====================================================================== the tables themselves

def _all_events(module) -> list[type]:
    return [getattr(ev, name) for name in ev.__all__ if isinstance(getattr(ev, name), type)
            and not name.startswith(("Action", "Protocol")) and name[0].isupper()
            and getattr(ev, name).__module__ == ev.__name__ and not issubclass(getattr(ev, name), Exception)]


def _sample(kind: type) -> object:
    fields = getattr(kind, "__dataclass_fields__", {})
    values = {"reason": "r", "cause": Cause.FAULT, "counts": (1, 1), "rows": (1, 1) if kind is ev.Answered else 1,
              "remaining_ms": 1, "reached": 0, "posted": 0, "start": 0, "end": 1, "ok": 0,
              "groups": np.zeros(0, dtype=np.int64)}
    if kind is ev.RowsCompleted:
        return ev.RowsCompleted.of([])
    return kind(**{name: values[name] for name in fields if name in values})


ACTIONS = {"Send", "PostReceives", "Drain", "SendRows", "SendReadOffer", "PlanReads", "StartRead", "ReleaseRead",
           "Conclude", "Quiesce", "Note", "ArmDeadline", "ArmGrace", "Violation", "CloseConnection", "Count"}


@pytest.mark.parametrize(("machine", "table", "states"), [
    (lambda: requester().m, rq.TRANSITIONS, RequesterState),
    (lambda: server().m, sv.TRANSITIONS, ServerState),
])
def test_an_event_a_state_cannot_take_raises_a_protocol_error(machine, table, states) -> None:
    events = [e for e in _all_events(ev) if e.__name__ not in ACTIONS]
    impossible = [(s, e) for s in states for e in events if (s, e) not in table]
    assert impossible, "each machine has events that some state cannot take"
    for state, event in impossible:
        m = machine()
        m.state = state
        with pytest.raises(ev.ProtocolError, match=f"{event.__name__} cannot happen in state {state.name}"):
            m.handle(_sample(event))


def test_zz_every_transition_is_driven(request: pytest.FixtureRequest) -> None:
    """Every (state, event) entry of both tables was driven by a case above (run the whole file)."""
    here = request.node.nodeid
    cases = [i.nodeid for i in request.session.items
             if i.nodeid.split("::")[0] == here.split("::")[0] and i.nodeid != here]
    absent = [c for c in cases if c not in RAN]
    if absent or not cases:
        pytest.skip(f"{len(absent)} of this module's {len(cases)} cases did not run in this process "
                    "before this check; run the whole file in one process")
    missing = [("requester", s.name, e.__name__) for s, e in rq.TRANSITIONS
               if ("requester", s.name, e.__name__) not in DRIVEN]
    missing += [("server", s.name, e.__name__) for s, e in sv.TRANSITIONS
                if ("server", s.name, e.__name__) not in DRIVEN]
    assert not missing, missing
