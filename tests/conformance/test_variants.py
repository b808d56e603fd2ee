"""The suite asks no more than the contract: it passes every correct backend of ``variants.py``,
each of which uses a freedom the contract gives (late and spurious wakes, conclusion and
quiescence apart and in either order, small chunks on worker threads, a queue of one, contract
1.0). A failure here is the suite refusing a correct third-party backend, or the variant breaking
a rule: the output names the test, and the variant's docstring the freedom it uses."""

from __future__ import annotations

from pathlib import Path

import pytest
from test_mutants import run_suite

VARIANTS_FILE = Path(__file__).with_name("variants.py")


@pytest.mark.parametrize("variant", ["late_reports", "late_reports_peer", "threaded_chunks", "queue_of_one",
                                     "speaks_1_0"])
def test_suite_passes_a_correct_backend_that_uses_a_freedom(tmp_path: Path, variant: str) -> None:
    code, tests, output = run_suite(tmp_path, f"--kvwire-harness={VARIANTS_FILE}:{variant}")
    failed = [t["nodeid"] for t in tests if t["outcome"] == "failed"]
    assert code == 0 and not failed, f"the suite failed the correct variant {variant}: {failed}\n{output[-3000:]}"
    passed = [t for t in tests if t["outcome"] == "passed"]
    assert len(passed) >= 100, f"only {len(passed)} suite tests ran against {variant}:\n{output[-3000:]}"
