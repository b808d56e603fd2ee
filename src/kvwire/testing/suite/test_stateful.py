"""The holder model: a stateful run of the backend against a plain model (S1, S2, S3, A1, A2,
A4, A5, A7, W1, B3 at every step). See :mod:`kvwire.testing.stateful`."""

from __future__ import annotations

import pytest
from hypothesis.stateful import run_state_machine_as_test

from kvwire.contract import OtherEnd
from kvwire.testing import needs
from kvwire.testing.harness import Harness
from kvwire.testing.marks import checks
from kvwire.testing.stateful import holder_model, settings_for_machine


@checks()
def test_stateful_holder_model(kvwire_harness: Harness) -> None:
    caps = kvwire_harness.capabilities()
    needs.transfer(caps)
    needs.names(caps)
    if needs.shares_names(caps) or caps.other_end is not OtherEnd.STORE:
        pytest.skip("backend's other end is a peer; the holder model drives a store")
    kind = needs.usable_kind(kvwire_harness, caps)
    run_state_machine_as_test(holder_model(kvwire_harness, kind), settings=settings_for_machine())


@checks()
def test_stateful_pull_model(kvwire_harness: Harness) -> None:
    """The holder model of a serving peer: both holders in any interleaving of pulls, answers,
    declines, cancels, evictions and waits (N2, S1, S2, A1, A2, A4, A5, A7, W1 at every step)."""
    from kvwire.testing.stateful_pulls import pull_model, settings_for_pull_machine

    caps = kvwire_harness.capabilities()
    needs.serve_pulls(caps)
    needs.transfer(caps)
    kind = needs.usable_kind(kvwire_harness, caps)
    run_state_machine_as_test(pull_model(kvwire_harness, kind), settings=settings_for_pull_machine())
