"""A Worker misused as a user might: each mistake is an error that names it, raised before
anything is lent or submitted, never a silent default or a truncation; a closed worker does
nothing more. Over the embedded in-memory store (one per test), and the files store where a
namespace meets a directory other processes share."""

from __future__ import annotations

import re
import threading

import numpy as np
import pytest
from worker_support import worker_pool

from kvwire.registry import BackendConfig, ConfigError
from kvwire.runtime import Cancel, ModelConfig, Worker
from kvwire.runtime.worker import TransferError, WorkerClosed

MODEL = ModelConfig(layers=2, layers_per_group=1, heads=2, head_dim=8, block_tokens=16, max_tokens=512, seed=5)


def prompt(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, MODEL.vocab, n)


@pytest.fixture
def workers(request):
    store = f"misuse-{request.node.name}"

    def build(name: str, **kw) -> Worker:
        return Worker(MODEL, backend="memory", options={"store": store}, num_blocks=64, name=name, timeout_s=10, **kw)

    with worker_pool(build) as make:
        yield make


@pytest.mark.parametrize("namespace", ["", "/leading-slash", "a b", "x" * 129, "é"])
def test_publish_under_an_unusable_namespace_raises_naming_it_and_publishes_nothing(workers, namespace):
    """``publish(namespace="")`` used to publish under the default namespace; now every namespace
    the stores refuse is a ValueError naming it, and nothing reaches any namespace."""
    a, b = workers("A"), workers("B")
    p = prompt(64)
    a.generate(p)
    with pytest.raises(ValueError, match="namespace") as info:
        a.publish(p, namespace=namespace)
    assert repr(namespace) in str(info.value)
    assert a.counters.submissions == 0 and a.pins() == 0
    # Nothing under the default namespace (the one a's state names) either.
    pulled = b.pull(p, source=a.transceiver_state())
    assert pulled.blocks_moved == 0 and pulled.cached_tokens == 0, pulled


def test_publish_under_a_namespace_given_uses_it_not_the_default(workers):
    a, b = workers("A"), workers("B")
    p = prompt(64, seed=1)
    a.generate(p)
    assert a.publish(p, namespace="tenant-x").blocks_moved == 4
    assert b.pull(p, source=a.transceiver_state()).blocks_moved == 0, "published under the default namespace"


def test_a_namespace_that_is_not_a_str_is_refused(workers):
    a = workers("A")
    with pytest.raises(ValueError, match="namespace is a str, got bytes"):
        a.publish(prompt(32), namespace=b"tenant")  # type: ignore[arg-type]


def test_a_closed_worker_generates_moves_and_hands_out_nothing(workers):
    """Every method that would act raises WorkerClosed naming the worker; close() stays
    idempotent, and pins(), describe() and wait_served() still answer."""
    a, b = workers("A"), workers("B")
    p = prompt(48)
    a.generate(p)
    a.close()
    calls = {
        "transceiver_state": lambda: a.transceiver_state(),
        "generate": lambda: a.generate(p),
        "cached_tokens": lambda: a.cached_tokens(p),
        "publish": lambda: a.publish(p),
        "pull": lambda: a.pull(p, b.transceiver_state()),
        "offer": lambda: a.offer(p),
    }
    for name, call in calls.items():
        with pytest.raises(WorkerClosed, match="worker 'A' is closed"):
            call()
        assert a.pins() == 0, name
    assert issubclass(WorkerClosed, TransferError)  # callers catching TransferError still do
    a.close()
    a.close()
    assert a.pins() == 0 and a.describe()["name"] == "A" and a.wait_served(1)


@pytest.mark.parametrize(("bad", "error", "needle"), [
    ([1.7] * 32, ValueError, "integer token ids, got float64"),
    (np.ones(32, dtype=bool), ValueError, "integer token ids, got bool"),
    ([[1] * 32], ValueError, "1-D sequence of token ids, got shape (1, 32)"),
    ([5] * 31 + [MODEL.vocab], ValueError, f"lie in [0, {MODEL.vocab}); the prompt holds {MODEL.vocab}"),
    ([-1] + [5] * 31, ValueError, "the prompt holds -1"),
], ids=["floats", "bools", "2-D", "beyond-vocab", "negative"])
def test_a_prompt_that_is_not_token_ids_is_refused_by_every_method(workers, bad, error, needle):
    """Floats used to be truncated to ids, bools read as 0 and 1, ids beyond the vocabulary
    published or pulled as blocks nothing could ever use: each method now refuses them, naming
    the problem, and lends nothing."""
    a, b = workers("A"), workers("B")
    state = b.transceiver_state()
    for call in (lambda: a.generate(bad), lambda: a.cached_tokens(bad), lambda: a.publish(bad),
                 lambda: a.pull(bad, state)):
        with pytest.raises(error) as info:
            call()
        assert needle in str(info.value), str(info.value)
        assert a.pins() == 0 and a.counters.submissions == 0


@pytest.mark.parametrize(("timeout", "error"), [
    (-1, ValueError), (0, ValueError), (float("nan"), ValueError), (float("inf"), ValueError),
    ("5", TypeError), (True, TypeError),
], ids=["negative", "zero", "nan", "inf", "str", "bool"])
def test_a_timeout_that_is_no_number_of_seconds_is_refused_before_anything_is_lent(workers, timeout, error):
    """A pull with timeout_s=-1 used to lend its rows, then fail building the hint and drop the
    lease (its pins were lost for good); a str or a bool was read as seconds. Now each is refused
    first, naming timeout_s, and no pin is left."""
    a, b = workers("A"), workers("B")
    p = prompt(64, seed=2)
    a.generate(p)
    a.publish(p)
    state = a.transceiver_state()
    for call in (lambda: b.pull(p, state, timeout_s=timeout), lambda: a.publish(p, timeout_s=timeout)):
        with pytest.raises(error, match="timeout_s"):
            call()
        assert a.pins() == 0 and b.pins() == 0
    assert b.counters.submissions == 0
    with pytest.raises(error, match="timeout_s"):
        Worker(MODEL, backend="memory", options={"store": "misuse-ctor"}, num_blocks=8, timeout_s=timeout)
    # The worker still works afterwards.
    assert b.pull(p, state).blocks_moved == 4


def test_a_cancel_that_is_not_a_cancel_is_refused_before_submitting(workers):
    """``cancel=3`` used to fail only while waiting on an attempt already submitted, releasing
    its lease while the backend could still move its rows."""
    a, b = workers("A"), workers("B")
    p = prompt(64, seed=3)
    a.generate(p)
    for call in (lambda: a.publish(p, cancel=3), lambda: b.pull(p, a.transceiver_state(), cancel="stop")):
        with pytest.raises(TypeError, match="cancel must be a kvwire.runtime.Cancel"):
            call()
    assert a.counters.submissions == 0 and b.counters.submissions == 0
    assert a.publish(p, cancel=Cancel()).blocks_moved == 4


@pytest.mark.parametrize(("max_tokens", "error"), [(-1, ValueError), (2.5, TypeError), (True, TypeError)])
def test_generate_refuses_a_count_of_tokens_that_is_no_count(workers, max_tokens, error):
    a = workers("A")
    with pytest.raises(error, match="max_tokens"):
        a.generate(prompt(20), max_tokens=max_tokens)
    assert a.pins() == 0
    assert len(a.generate(prompt(20), max_tokens=0).tokens) == 0  # a prefill alone is allowed


def test_an_empty_worker_name_is_refused_not_replaced(workers):
    with pytest.raises(ValueError, match="worker's name is a non-empty str, got ''"):
        Worker(MODEL, backend="memory", options={"store": "misuse-name"}, num_blocks=8, name="")


@pytest.mark.parametrize(("worker", "needle"), [
    ({"timeout_s": -2.0}, "worker.timeout_s must be a finite number of seconds > 0, got -2.0"),
    ({"timeout_s": float("nan")}, "worker.timeout_s must be a finite number of seconds > 0, got nan"),
    ({"name": ""}, "worker.name must not be empty"),
])
def test_a_worker_table_a_worker_cannot_use_is_a_config_error_naming_the_key(worker, needle):
    config = BackendConfig("memory", {"store": "misuse-table"}, "test", worker)
    with pytest.raises(ConfigError, match=re.escape(needle)):
        Worker(MODEL, config=config, num_blocks=8)


def test_a_constructor_that_fails_after_building_its_backend_closes_it():
    """A bad argument the cache refuses (here num_blocks=0) used to leave the backend it built
    running: its threads stayed for the life of the process."""
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(ValueError, match="num_blocks"):
        Worker(MODEL, backend="memory", options={"store": "misuse-leak"}, num_blocks=0)
    left = [t.name for t in threading.enumerate() if t.ident not in before and t.is_alive()]
    assert not left, f"threads left running: {left}"


def test_a_files_worker_refuses_an_empty_namespace_and_stores_nothing(tmp_path):
    """Over the files store: nothing is written under any namespace for a refused publish."""
    options = {"root": str(tmp_path / "store")}
    with worker_pool(lambda name, **kw: Worker(MODEL, backend="files", options=options, num_blocks=32, name=name,
                                                  timeout_s=10)) as make:
        a = make("A")
        p = prompt(64, seed=4)
        a.generate(p)
        with pytest.raises(ValueError, match="store namespace '' is not allowed"):
            a.publish(p, namespace="")
        assert not list((tmp_path / "store" / "packs").iterdir()), "a refused publish stored a pack"
