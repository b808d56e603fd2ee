"""The same third party's store at contract 1.2, moved up by its author from the 1.2 clauses, and
FROZEN: this file is never edited after it was added (2026-12-04).

1.2 asked a store for little: a lookup refuses a bool as a group id (L1.13), and a group id has no
bound in the contract (V1.8: this store keeps ids as Python ints, so it takes any). Repeated
names in one fetch (V4.5) its 1.0 code already served row by row."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
from store_1_1 import FrozenBackend11, FrozenHarness11

from kvwire.contract import Capabilities, Hint, InvalidSubmission, MemoryKind, OtherEnd
from kvwire.contract.lookup import LOOKUP

VERSION = (1, 2)


class FrozenBackend12(FrozenBackend11):
    def capabilities(self) -> Capabilities:
        return Capabilities(VERSION, True, True, frozenset({MemoryKind.HOST}), OtherEnd.STORE, True,
                            self.max_in_flight, True, frozenset({LOOKUP}))

    def lookup(self, groups: Sequence[int], names: np.ndarray, hint: Hint,
               timeout_s: float | None = None) -> np.ndarray:
        if any(isinstance(g, bool) for g in groups):
            raise InvalidSubmission(f"a bool is not a group id: {list(groups)!r}")
        return super().lookup(groups, names, hint, timeout_s)


class FrozenHarness12(FrozenHarness11):
    name = "frozen-1.2"
    backend_class = FrozenBackend12

    def capabilities(self) -> Capabilities:
        return Capabilities(VERSION, True, True, frozenset({MemoryKind.HOST}), OtherEnd.STORE, True, 16, True,
                            frozenset({LOOKUP}))


harness = FrozenHarness12()
