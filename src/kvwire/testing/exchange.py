"""Moving a bench's rows from ``source`` to ``sink`` the way the declared other end implies:
through a store (publish, then fetch), from a serving peer (fetch, the suite answers the pull),
or between plain peers (publish and fetch at once)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from kvwire.contract import Capabilities, Hint, Outcome, View
from kvwire.contract.capabilities import SERVE_PULLS, OtherEnd
from kvwire.testing.harness import Ends
from kvwire.testing.holder import Submission, settle, submit
from kvwire.testing.layout import Bench
from kvwire.testing.serving import ReuseTree, ServingHolder

__all__ = ["Exchange", "Transfer"]

Select = Mapping[int, Sequence[int]] | None


@dataclass
class Transfer:
    """The outcomes of one transfer: the source side's (the publish, or the serving holder's
    answer; ``None`` when nothing was published) and the sink's fetch."""

    published: Outcome | None
    fetched: Outcome


class Exchange:
    """Submits on a pair of ends and waits as a holder does."""

    def __init__(self, ends: Ends, patience_s: float) -> None:
        self.ends = ends
        self.patience_s = patience_s
        self.caps: Capabilities = ends.source.capabilities()
        self.serving: ServingHolder | None = None

    @property
    def store(self) -> bool:
        return self.caps.other_end is OtherEnd.STORE

    @property
    def serves_pulls(self) -> bool:
        return self.caps.other_end is OtherEnd.PEER and SERVE_PULLS in self.caps.protocols

    def publish(self, view: View, hint: Hint | None = None) -> Submission:
        return submit(self.ends.source, "publish", view, hint or self.ends.publish_hint)

    def fetch(self, view: View, hint: Hint | None = None) -> Submission:
        return submit(self.ends.sink, "fetch", view, hint or self.ends.fetch_hint)

    def settle(self, sub: Submission, *, quiesce: bool = True, purpose: str | None = None) -> Outcome:
        return settle(sub, self.patience_s, quiesce=quiesce, purpose=purpose)

    def holder(self) -> ServingHolder:
        """The suite as the serving end's holder (started on first use)."""
        if self.serving is None:
            self.serving = ServingHolder(self.ends.source, ReuseTree(), self.patience_s)
            self.serving.start()
        return self.serving

    def offer(self, bench: Bench, select: Select = None) -> Outcome | None:
        """Make the other end hold the source rows of ``select``: publish them to a store (and
        wait), or put them in the serving holder's reuse tree. For plain peers, nothing: their
        rows move in :meth:`transfer`."""
        if self.store:
            return self.settle(self.publish(bench.source_view(select)))
        if self.serves_pulls:
            tree = self.holder().tree
            tree.add_view(bench.source_view(select))
            for gi, g in enumerate(bench.plan.groups):
                tree.regions.setdefault(g.group_id, bench.source.memories[gi].region)
        return None

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
        against memory (A7, S2); return both outcomes."""
        if self.store or self.serves_pulls:
            published = self.offer(bench, offer)
            sub = self.fetch(bench.sink_view(take))
            if self.serves_pulls:
                holder = self.holder()
                (request,) = holder.take(1)
                answer = holder.answer(request)
                holder.finish(answer)
                assert answer.publish is not None
                published = answer.publish.outcome
            fetched = self.settle(sub)
        else:
            pub = self.publish(bench.source_view(offer))
            sub = self.fetch(bench.sink_view(take))
            published = self.settle(pub)
            fetched = self.settle(sub)
        bench.apply_fetch(fetched, take)
        return Transfer(published, fetched)
