"""Waits on a caller's deadline of any length go to threading primitives in pieces."""

from __future__ import annotations

import threading

import pytest

from kvwire import waiting


def test_a_far_timeout_is_cut_and_none_stays_none() -> None:
    assert waiting.piece(None) is None
    assert waiting.piece(0.5) == 0.5
    assert waiting.piece(1e300) == waiting.LONGEST_WAIT_S
    with pytest.raises(OverflowError):  # what a piece avoids: the platform's bound on one wait
        threading.Event().wait(1e300)


def test_wait_for_spans_pieces_and_answers_the_predicate(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(waiting, "LONGEST_WAIT_S", 0.02)
    cond = threading.Condition()
    ready = threading.Event()
    threading.Timer(0.15, ready.set).start()  # set without a notify: only a new piece sees it
    asked = []

    def never() -> bool:
        asked.append(1)
        return False

    with cond:
        assert waiting.wait_for(cond, ready.is_set, 1e300)
        assert not waiting.wait_for(cond, never, 0.1)
    # Unnotified, the predicate is asked once per piece: a wait of 0.1 s in pieces of 0.02 s asks
    # it more than twice (a wait that gave up at once, or waited in one piece, asks it at most twice).
    assert len(asked) > 2, asked
