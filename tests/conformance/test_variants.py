"""The suite asks no more than the contract: it passes every correct backend of ``variants.py``,
each of which uses a freedom the contract gives (late and spurious wakes, conclusion and
quiescence apart and in either order, small chunks on worker threads, a queue of one, contract
1.0, no cancellation, wakes from many threads, no rows reported on a failure, one direction
only, DEVICE memory only, a client that gives up, its own queue bound, a store that keeps the
last bytes, views split and reordered, slow stops). A failure here is the suite refusing a
correct third-party backend, or the variant breaking a rule: the output names the test, and the
variant's docstring the freedom it uses."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_mutants import run_suite

from kvwire.testing.regions import cuda_devices

VARIANTS_FILE = Path(__file__).with_name("variants.py")

#: Variants under which most of the suite skips, by design, and how many tests must still pass.
FEW_PASS = {"fetch_only": 25, "publish_only": 25, "device_only": 3}


@pytest.mark.parametrize("variant", ["late_reports", "late_reports_peer", "threaded_chunks", "queue_of_one", "queue_of_one_peer",
                                     "speaks_1_0", "without_cancellation", "without_cancellation_peer",
                                     "wakes_from_many_threads", "wakes_from_many_threads_peer",
                                     "forgets_moved_rows", "forgets_moved_rows_peer", "fetch_only", "publish_only", "device_only", "gives_up",
                                     "gives_up_peer", "keeps_its_own_bound", "replacing_store",
                                     "splits_views", "slow_to_stop"])
def test_suite_passes_a_correct_backend_that_uses_a_freedom(tmp_path: Path, variant: str) -> None:
    if variant == "device_only" and cuda_devices():
        pytest.skip("device_only moves no DEVICE memory; it checks that a DEVICE-only backend skips cleanly "
                    "where no CUDA device is present")
    code, tests, output = run_suite(tmp_path, f"--kvwire-harness={VARIANTS_FILE}:{variant}")
    failed = [t["test"] for t in tests if t["outcome"] == "failed"]
    assert code == 0 and not failed, f"the suite failed the correct variant {variant}: {failed}\n{output[-3000:]}"
    passed = [t for t in tests if t["outcome"] == "passed"]
    least = FEW_PASS.get(variant, 100)
    assert len(passed) >= least, f"only {len(passed)} suite tests ran against {variant}:\n{output[-3000:]}"


def test_the_documented_grace_not_the_patience_bounds_a_wait_for_quiescence(tmp_path: Path) -> None:
    """A backend whose cancelled and failed attempts take 3 s to stop touching memory, and whose
    harness documents that grace, passes the A4 cancel test under a patience of 2 s:
    the suite waits the patience plus the grace for quiescence (A8.3), as a holder must."""
    code, tests, output = run_suite(tmp_path, f"--kvwire-harness={VARIANTS_FILE}:slower_than_patience",
                                    "--kvwire-patience=2", "-k", "A4 and cancel_is_idempotent")
    failed = [t["test"] for t in tests if t["outcome"] == "failed"]
    passed = [t["test"] for t in tests if t["outcome"] == "passed"]
    assert code == 0 and not failed and passed, f"failed {failed}, passed {passed}\n{output[-3000:]}"
