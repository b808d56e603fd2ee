"""An atheris (libFuzzer) target over every decoder of received bytes. Any exception other than
the decoder's own named error is a crash; so is a hang (libFuzzer's -timeout)."""

from __future__ import annotations

import sys

import atheris

with atheris.instrument_imports():
    from kvwire.contract import Hint
    from kvwire.contract.serving import PullRequest
    from kvwire.holding import PullGuard, StateError, TransceiverState

    try:
        from kvwire_ucx import wire
    except ImportError:  # the ucx plugin is not installed: fuzz the rest
        wire = None

import numpy as np

GUARD = PullGuard(b"secret")
NAMES = np.zeros((2, 32), np.uint8)


def one_input(data: bytes) -> None:
    fdp = atheris.FuzzedDataProvider(data)
    which = fdp.ConsumeIntInRange(0, 3)
    raw = fdp.ConsumeBytes(fdp.remaining_bytes())
    if which == 0:
        try:
            TransceiverState.from_bytes(raw)
        except StateError:
            pass
    elif which == 1:
        try:
            Hint.from_bytes(raw)
        except ValueError:
            pass
    elif which == 2:
        reason = GUARD.check(PullRequest(Hint.of("ticket"), (0, 1), (64, 64), NAMES, "peer", raw))
        assert isinstance(reason, str) and reason
    elif wire is not None:
        try:
            wire.decode(raw)
        except wire.WireError:
            pass


if __name__ == "__main__":
    atheris.Setup(sys.argv, one_input)
    atheris.Fuzz()
