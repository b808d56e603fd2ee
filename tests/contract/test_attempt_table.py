"""kvwire.attempts: the attempt lifecycle the blob backends and kvwire-ucx share (admission under
``max_in_flight``, conclude once, quiesce once, wakes once per wake callable, the deadline clock,
waits of any length)."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from kvwire.attempts import AttemptTable, OwedWakes, TableAttempt, call_wakes, clock, deadline_after
from kvwire.contract import Outcome, SubmissionRejected
from kvwire.testing.holder import wait_for


def _done() -> Outcome:
    return Outcome.delivered((np.zeros(0, dtype=bool),))


class _Attempt(TableAttempt):
    def cancel(self) -> None:  # the table's users conclude a cancel through the table
        pass


def _attempt(deadline: float = float("inf")) -> TableAttempt:
    return _Attempt(lambda: None, deadline)


def test_a_slot_is_held_until_the_attempt_has_both_concluded_and_quiesced() -> None:
    table: AttemptTable[TableAttempt] = AttemptTable(2, name="the test backend")
    a, b = _attempt(), _attempt()
    table.admit(a)
    table.admit(b)
    with pytest.raises(SubmissionRejected, match="the test backend's queue is full .2 attempts"):
        table.admit(_attempt())
    assert table.conclude(a, _done()) and len(table) == 2  # concluded, not quiesced: still holds its slot
    assert table.quiesce(b) and len(table) == 2  # quiesced, not concluded
    assert table.quiesce(a) and len(table) == 1  # both: the slot is free, whether or not anyone polled
    c = _attempt()
    table.admit(c)
    assert table.not_quiesced() == frozenset({c})  # b is concluded-pending but quiesced


def test_an_attempt_concludes_once_and_quiesces_once() -> None:
    table: AttemptTable[TableAttempt] = AttemptTable(1)
    a = _attempt()
    table.admit(a)
    first = _done()
    assert table.conclude(a, first) and not table.conclude(a, _done())
    assert a.poll() is first
    assert table.quiesce(a) and not table.quiesce(a) and a.quiesced()


def test_overdue_attempts_are_found_on_the_one_clock() -> None:
    table: AttemptTable[TableAttempt] = AttemptTable(4)
    now = clock()
    late, soon, concluded = _attempt(now - 1), _attempt(now + 5), _attempt(now - 1)
    for a in (late, soon, concluded):
        table.admit(a)
    table.conclude(concluded, _done())
    with table.lock:
        overdue, nearest = table.overdue_locked(now)
    assert overdue == [late] and nearest == soon.deadline
    assert deadline_after(2.0) - clock() == pytest.approx(2.0, abs=0.5)


def test_wakes_owed_together_are_called_once_per_callable_and_a_raising_one_stops_none() -> None:
    calls: list[str] = []

    def shared() -> None:
        calls.append("shared")

    def broken() -> None:
        raise RuntimeError("a holder's bug")

    wakes = OwedWakes()
    assert wakes.add(shared)  # the first owed: the caller signals its thread
    assert not wakes.add(shared) and not wakes.add(broken)
    wakes.add(lambda: calls.append("other"))
    call_wakes(wakes.take())
    assert sorted(calls) == ["other", "shared"] and not wakes


def test_waits_of_any_length_do_not_overflow() -> None:
    """A timeout beyond threading.TIMEOUT_MAX is a finite wait like any other (issue 41), and a
    wait for quiescence ends when the attempt quiesces, before it concludes: each wait is seen
    waiting when the attempt moves on, and must end within seconds."""
    table: AttemptTable[TableAttempt] = AttemptTable(1)
    a = _attempt()
    table.admit(a)

    def waited(wait, step) -> bool:
        answers: list[bool] = []
        thread = threading.Thread(target=lambda: answers.append(wait()), daemon=True)
        thread.start()
        wait_for(lambda: table._waiters > 0, 10, "a thread waiting on the table")
        step()
        thread.join(10)
        assert not thread.is_alive(), "the wait did not end when the attempt moved on"
        return answers == [True]

    assert waited(lambda: table.wait_quiesced([a], 1e12), lambda: table.quiesce(a))
    assert waited(lambda: table.wait_idle(1e12), lambda: table.conclude(a, _done()))
    assert table.wait_idle(0.0)
