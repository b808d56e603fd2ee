"""The frozen stores as their authors did NOT write them: each claiming one minor version more than
it implements (and, for 1.1, also naming lookup's 1.2 clauses). The suite must fail each of these
on the clauses that version added: that is what shows the frozen stores pass because the suite
checks only the clauses of the version they declare, not because it never looks. Not frozen."""

from __future__ import annotations

from store_1_0 import VERSION as V10
from store_1_0 import FrozenBackend, FrozenHarness
from store_1_1 import VERSION as V11
from store_1_1 import FrozenBackend11, FrozenHarness11

from kvwire.contract import LOOKUP, Capabilities, MemoryKind, OtherEnd


def _claim(version: tuple[int, int], protocols: frozenset[str], max_in_flight: int = 16) -> Capabilities:
    return Capabilities(version, True, True, frozenset({MemoryKind.HOST}), OtherEnd.STORE, True, max_in_flight, True,
                        protocols)


class Claims11(FrozenBackend):
    def capabilities(self) -> Capabilities:
        return _claim((V10[0], V10[1] + 1), frozenset(), self.max_in_flight)


class Claims12(FrozenBackend11):
    def capabilities(self) -> Capabilities:
        return _claim((V11[0], V11[1] + 1), frozenset({LOOKUP}), self.max_in_flight)


class Harness10Claims11(FrozenHarness):
    name = "frozen-1.0-claims-1.1"
    backend_class = Claims11

    def capabilities(self) -> Capabilities:
        return _claim((1, 1), frozenset())


class Harness11Claims12(FrozenHarness11):
    name = "frozen-1.1-claims-1.2"
    backend_class = Claims12

    def capabilities(self) -> Capabilities:
        return _claim((1, 2), frozenset({LOOKUP}))


claims_1_1 = Harness10Claims11()
claims_1_2 = Harness11Claims12()
