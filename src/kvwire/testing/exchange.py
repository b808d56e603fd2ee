"""Moving a bench's rows from ``source`` to ``sink`` the way the declared other end implies:
through a store (publish, then fetch), from a serving peer (fetch, the suite answers the pull),
or between plain peers (publish and fetch at once)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvwire.contract import Capabilities, Hint, Outcome, View
from kvwire.contract.capabilities import SERVE_PULLS, OtherEnd
from kvwire.testing import profiles
from kvwire.testing.harness import Ends, Hold, Unavailable
from kvwire.testing.holder import Submission, Wakes, settle, submit, wait_for
from kvwire.testing.layout import Bench
from kvwire.testing.serving import NameTable, Offered, PullHold, SuiteServer

__all__ = ["Exchange", "Transfer"]

Select = Mapping[int, Sequence[int]] | None


@dataclass
class Transfer:
    """The outcomes of one transfer: the source side's (the publish, or the serving holder's
    answer; ``None`` when nothing was published) and the sink's fetch; and the views submitted,
    in that order (the publish's left out when nothing was published)."""

    published: Outcome | None
    fetched: Outcome
    views: tuple[View, ...] = ()


class Exchange:
    """Submits on a pair of ends and waits as a holder does. ``grace_s``: the quiescence grace
    the backend's harness documents (A8); a wait for quiescence allows it beyond the patience,
    so a backend that takes its documented grace to stop touching memory is not failed for it."""

    def __init__(self, ends: Ends, patience_s: float, grace_s: float = 0.0) -> None:
        self.ends = ends
        self.patience_s = patience_s
        self.grace_s = grace_s
        self.caps: Capabilities = ends.source.capabilities()
        self.serving: SuiteServer | None = None

    @property
    def store(self) -> bool:
        return self.caps.other_end is OtherEnd.STORE

    @property
    def serves_pulls(self) -> bool:
        return self.caps.other_end is OtherEnd.PEER and SERVE_PULLS in self.caps.protocols

    def publish(self, view: View, hint: Hint | None = None) -> Submission:
        return submit(self.ends.source, "publish", view, hint or self.ends.publish_hint)

    def fetch(self, view: View, hint: Hint | None = None, wakes: Wakes | None = None) -> Submission:
        return submit(self.ends.sink, "fetch", view, hint or self.ends.fetch_hint, wakes)

    def settle(self, sub: Submission, *, quiesce: bool = True, purpose: str | None = None) -> Outcome:
        return settle(sub, self.patience_s + (self.grace_s if quiesce else 0.0), quiesce=quiesce, purpose=purpose)

    def serve_one(self) -> None:
        """For a serving peer: answer the next pull from the reuse tree and wait until the answer
        quiesced. For a store: nothing."""
        if self.serves_pulls:
            holder = self.holder()
            (request,) = holder.take(1)
            holder.finish(holder.answer(request))

    def fetch_settled(self, view: View, hint: Hint | None = None) -> Outcome:
        """Fetch ``view`` (answering the pull when the other end is the suite) and wait."""
        sub = self.fetch(view, hint)
        self.serve_one()
        return self.settle(sub)

    def holder(self, wakes: Wakes | None = None) -> SuiteServer:
        """The suite as the serving end's holder (started on first use, serving with ``wakes``
        when given, else a fresh :class:`Wakes`)."""
        if self.serving is None:
            self.serving = SuiteServer(self.ends.source, NameTable(), self.patience_s, wakes)
            self.serving.start()
        return self.serving

    def offer(self, bench: Bench, select: Select = None) -> Outcome | None:
        """Make the other end hold the source rows of ``select``: publish them to a store (and
        wait), or put them in the serving holder's reuse tree (and start serving). For plain
        peers, nothing: their rows move in :meth:`transfer`. ``{}`` offers nothing."""
        return self._offer(bench, select)[0]

    def _offer(self, bench: Bench, select: Select) -> tuple[Outcome | None, View | None]:
        """:meth:`offer`, and the view it published to a store (``None`` when it published none)."""
        if self.store:
            if select is not None and not any(len(rows) for rows in select.values()):
                return None, None
            view = bench.source_view(select)
            return self.settle(self.publish(view)), view
        if self.serves_pulls:
            tree = self.holder().tree
            tree.add_view(bench.source_view(select))
            for gi, g in enumerate(bench.plan.groups):
                tree.regions.setdefault(g.group_id, bench.source.memories[gi].region)
        return None, None

    def stand(self, bench: Bench, select: Select = None, timeout_s: float | None = None,
              wakes: Wakes | None = None) -> Offered:
        """For a backend that declares ``offer-pulls`` (O1): the serving holder holds every source
        row of the bench in its reuse tree (and serves), and makes a standing offer of the source
        rows of ``select`` (all by default), with ``timeout_s`` and ``wakes`` when given."""
        self.offer(bench)
        return self.holder().offer(bench.source_view(select), timeout_s, wakes)

    def held_fetch(self, bench: Bench, hint: Hint | None = None,
                   wakes: Wakes | None = None) -> tuple[Submission, Hold]:
        """Offer the bench's rows, then fetch them all (with ``wakes``, when given) while the
        other end holds the request: a held store, or the suite as serving holder not answering
        yet. Returns once the other end has the request (or the backend woke the holder without
        it)."""
        if self.store:
            if self.ends.hold is None:
                raise Unavailable("the harness cannot hold the backend's other end")
            self.offer(bench)
            hold = self.ends.hold()
            sub = self.fetch(bench.sink_view(), hint, wakes)
            self._wait_held(hold, sub, "fetch")
            return sub, hold
        if self.serves_pulls:
            self.offer(bench)
            sub = self.fetch(bench.sink_view(), hint, wakes)
            (request,) = self.holder().take(1)
            return sub, PullHold(self.holder(), request)
        raise Unavailable("the backend's other end is a peer without the serve-pulls protocol; the suite cannot hold it")

    def held_publish(self, bench: Bench, hint: Hint | None = None) -> tuple[Submission, Hold]:
        """Publish the bench's source rows to a store that holds the request. Returns once the
        store has the request (or the backend woke the holder without it)."""
        if not self.store or self.ends.hold is None:
            raise Unavailable("the harness cannot hold a store for the backend's publish")
        hold = self.ends.hold()
        sub = self.publish(bench.source_view(), hint)
        self._wait_held(hold, sub, "publish")
        return sub, hold

    @staticmethod
    def _wait_held(hold: Hold, sub: Submission, op: str) -> None:
        # Wait on the other end, or on a wake should the backend conclude without it; never on
        # poll(), which the tests check for blocking.
        wait_for(lambda: hold.waiting() > 0 or sub.wakes.count > 0, profiles.active().patience_s,
                 f"A3: the held other end receiving the {op}")

    def expected(self, bench: Bench, offer: Select, take: Select) -> list[np.ndarray]:
        """The fetch mask each group of ``take``'s view must carry when the rows of ``offer`` are
        held: from a store, exactly the taken rows that were offered; from a serving peer, the
        taken rows up to the first one not held (a prefix, N2)."""
        offered = bench.rows_of(offer)
        taken = bench.rows_of(take)
        out = []
        for gi in bench.groups_in(take):
            held = np.isin(taken[gi], offered[gi])
            if self.serves_pulls:
                gap = np.flatnonzero(~held)
                if gap.size:
                    held[gap[0]:] = False
            out.append(held)
        if self.serves_pulls and out:
            # One pull names blocks for every group: the prefix is the shortest over groups.
            shortest = min(int(m.sum()) for m in out)
            out = [np.arange(m.size) < shortest for m in out]
        return out

    def transfer(self, bench: Bench, offer: Select = None, take: Select = None) -> Transfer:
        """Offer the source rows of ``offer``, fetch the sink rows of ``take``; check the fetch
        against memory (A7, S2); return both outcomes and the views submitted."""
        if self.store or self.serves_pulls:
            published, source = self._offer(bench, offer)
            sub = self.fetch(bench.sink_view(take))
            if self.serves_pulls:
                holder = self.holder()
                (request,) = holder.take(1)
                answer = holder.answer(request)
                holder.finish(answer)
                assert answer.publish is not None
                published, source = answer.publish.outcome, answer.publish.view
            fetched = self.settle(sub)
        else:
            pub = self.publish(bench.source_view(offer))
            sub = self.fetch(bench.sink_view(take))
            published = self.settle(pub)
            fetched = self.settle(sub)
            source = pub.view
        bench.apply_fetch(fetched, take)
        return Transfer(published, fetched, (sub.view,) if source is None else (source, sub.view))
