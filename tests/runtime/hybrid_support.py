"""What the hybrid-model tests share: the model, prompts, comparing logits, and a fault-injecting
wrapper that makes a real backend lose every STATE row it fetches."""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch

from kvwire.contract import Attempt, Backend, CacheKind, Capabilities, Hint, Outcome, SlotRegion, View
from kvwire.contract.backend import Registration, WakeFn
from kvwire.runtime import ModelConfig

MODEL = ModelConfig.hybrid(heads=2, head_dim=16, block_tokens=16, max_tokens=1024, seed=3)
B = MODEL.block_tokens
#: Written over a lost STATE row: a float32 near its maximum, which no real state holds.
POISON = 0x7E


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, MODEL.vocab, n)


def same(got: torch.Tensor, want: torch.Tensor) -> bool:
    """Whether two logits tensors agree (a pulled prefix decodes as a local prefill does)."""
    return bool(torch.allclose(got, want, rtol=1e-4, atol=1e-5))


class _LosesState(Attempt):
    """The inner attempt, except that its STATE rows never arrive: their bits are false and,
    once the inner attempt has quiesced, their bytes are overwritten (a row whose bit is false
    has undefined contents, A7.3), so a holder that used them would compute garbage."""

    def __init__(self, inner: Attempt, view: View, lost: list[int]) -> None:
        self.inner, self.view, self.lost = inner, view, lost
        self.scribbled = False

    def poll(self) -> Outcome | None:
        outcome = self.inner.poll()
        if outcome is None:
            return None
        masks = [np.zeros_like(m) if i in self.lost else m for i, m in enumerate(outcome.masks)]
        return Outcome(outcome.status, tuple(masks), outcome.reason, outcome.by_peer, outcome.cause)

    def quiesced(self) -> bool:
        if not self.inner.quiesced():
            return False
        if not self.scribbled:
            for i in self.lost:
                group = self.view.groups[i]
                for address in group.addresses():
                    ctypes.memset(int(address), POISON, group.region.slot_bytes)
            self.scribbled = True
        return True

    def cancel(self) -> None:
        self.inner.cancel()


class LosesState(Backend):
    """A real backend whose fetches lose every STATE row (see :class:`_LosesState`); counts them."""

    def __init__(self, inner: Backend) -> None:
        self.inner = inner
        self.rows_lost = 0

    def capabilities(self) -> Capabilities:
        return self.inner.capabilities()

    def register_regions(self, regions: Sequence[SlotRegion]) -> Registration:
        return self.inner.register_regions(regions)

    def fetch(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        attempt = self.inner.fetch(view, hint, wake)
        lost = [i for i, g in enumerate(view.groups) if g.kind is CacheKind.STATE]
        if not lost:
            return attempt
        self.rows_lost += len(lost)
        return _LosesState(attempt, view, lost)

    def publish(self, view: View, hint: Hint, wake: WakeFn) -> Attempt:
        return self.inner.publish(view, hint, wake)

    def shutdown(self) -> frozenset[Attempt]:
        return self.inner.shutdown()

    def close(self) -> None:
        self.inner.close()
