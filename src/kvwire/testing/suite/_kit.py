"""Helpers shared by several files of the suite (private: not part of the suite's public surface).
Each came verbatim from the suite file that first needed it."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager

import pytest

from kvwire.contract import (
    Capabilities,
    MemoryKind,
    PullRequest,
    View,
)
from kvwire.contract.backend import Backend
from kvwire.testing import needs, profiles
from kvwire.testing.exchange import Exchange
from kvwire.testing.harness import Harness
from kvwire.testing.holder import (
    Submission,
    wait_for,
)
from kvwire.testing.layout import Bench
from kvwire.testing.plans import (
    paged_exchange,
)


def _schedule_or_skip(ex: Exchange) -> None:
    if not ex.store:
        pytest.skip("backend's other end is a peer; store fault schedules apply to stores")


def _patience() -> float:
    return profiles.active().patience_s


def _held_answer(ex: Exchange, bench: Bench, what: str):  # type: ignore[no-untyped-def]
    """Hold the serving end's answers, pull every block of the bench (offered here), and answer
    the pull with the held prefix: the hold, the pull and the answer, once the answer is on the
    wire (published, not yet at the requester). Skips when the harness cannot hold it there."""
    if ex.ends.hold is None:
        pytest.skip("harness cannot hold the serving end's answers on the wire (Ends.hold)")
    ex.offer(bench)
    holder = ex.holder()
    sub = ex.fetch(bench.sink_view())
    (request,) = holder.take(1)
    hold = ex.ends.hold()
    answer = holder.answer(request)
    assert answer.publish is not None
    wait_for(lambda: hold.waiting() > 0 or sub.wakes.count > 0, _patience(),
             f"A3: {what}: the serving end's answer reaching the wire")
    if hold.waiting() == 0:
        hold.release()
        holder.finish(answer)
        ex.settle(sub)
        pytest.skip("the harness's hold did not hold the serving end's answer on the wire")
    return hold, sub, answer


# -- N2.4: a serving end busy with pulls waiting for its holder ---------------------------------------------

def _requesters(ex: Exchange, harness: Harness, plan, kind: MemoryKind, count: int) -> list[tuple[Backend, Bench]]:  # type: ignore[no-untyped-def]
    """``count`` requesters of the serving end, each with its own sink memory of ``plan``."""
    out: list[tuple[Backend, Bench]] = []
    for i in range(count):
        backend = ex.ends.sink if i == 0 else ex.ends.make_another_sink()
        out.append((backend, Bench(harness, None, backend, plan, kind)))
    return out


# -- tickets, addresses and answers (H1.11, H1.13, N2.3, N2.12) -------------------------------

def _pulls(
    harness: Harness, specs: list[tuple[int, int]], seed: int, need: Callable[[Capabilities], None],
    in_flight: int = 1,
) -> AbstractContextManager[tuple[Capabilities, Exchange, Bench]]:
    """For a ``serve-pulls`` peer that also declares ``need`` and takes ``in_flight`` attempts at
    once: an exchange and a bench of PAGED groups of ``(slot_bytes, rows)`` that share their
    names (the blocks of a pull)."""
    return paged_exchange(harness, specs, seed, needs.serve_pulls, need, shared=True, in_flight=in_flight)


def _one_pull(ex: Exchange, bench: Bench, select: dict[int, list[int]] | None = None) -> tuple[Submission, PullRequest]:
    ex.offer(bench)
    sub = ex.fetch(bench.sink_view(select))
    (request,) = ex.holder().take(1)
    return sub, request


def _refused_pulls_left_no_trace(ex: Exchange, bench: Bench, good: View, why: str) -> None:
    """After pulls refused for their ``why``: none reached the serving end (S3.4), the rows are
    untouched (S3.5), and a pull of ``good`` afterwards delivers."""
    assert not ex.holder().serving.incoming(), f"S3.4: a pull refused for its {why} reached the serving end"
    bench.verify(f"S3.5: after pulls refused for their {why}")
    out = ex.fetch_settled(good)
    bench.apply_fetch(out)
    assert out.is_delivered and all(m.all() for m in out.masks), f"N2: a good pull afterwards must deliver: {out!r}"
