#!/usr/bin/env bash
# The two commands of the README:
#   ./dev.sh demo   set up .venv (idempotent) and run the main job: the demo on the in-memory backend
#   ./dev.sh test   set up .venv and .venv-vllm (idempotent) and run the whole test suite
set -euo pipefail
top="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
cd "$top"
"$top/scripts/bootstrap.sh"
export PATH="$top/.venv/bin:$PATH"
case "${1:-}" in
  demo) shift; exec kvwire demo "$@" ;;
  test)
    shift
    # vLLM's own venv (.venv-vllm) for the vLLM connector's engines, stamped on its own: only the
    # tests use it, so the demo never waits for it.
    "$top/scripts/bootstrap_vllm.sh"
    # Everything: our tests, and the conformance suite against every installed backend that
    # registers a harness (thorough profile). pytest exits 5 when it collected nothing: that
    # is a broken run, never a pass. Arguments replace the default selection. Three pytest-xdist
    # workers on this kind of 2-core machine: with two, a whole run used 44 of its 75 core-minutes
    # (user+sys of a 37.5-minute run; the rest waited on deadlines, servers and engine starts), and
    # the vLLM group alone keeps one worker for most of the run. --dist loadgroup keeps each xdist_group on one worker: the
    # vLLM modules (their engines never start two at once) and the UCX protocol module (its last
    # test checks what the others drove). --max-worker-restart=0: pytest-xdist 3.8 under
    # loadgroup hangs for good once it replaces a crashed worker (it hands the replacement the dead
    # worker's finished tests as empty units and waits on them: pytest-xdist issues 1323, 1378);
    # seen here after a UCX segfault, with every test done but 24 and nothing left running. Without
    # a replacement the other workers finish the run, which fails on the crash. The run ends with
    # its 40 slowest tests (--durations), so a CI log says where its time goes.
    if [ "$#" -eq 0 ]; then
      set -- tests --pyargs kvwire.testing.suite --kvwire-profile thorough -n 3 --dist loadgroup \
        --max-worker-restart=0 --durations=40
    fi
    # Every backend this repository ships must load here: a broken import fails the run, it
    # never turns into skips (kvwire.testing.require). A distribution lists in [tool.kvwire]
    # cuda-only the backends that work only with a CUDA device (memory-device): those are
    # required only where torch sees one, and elsewhere their tests skip saying why.
    KVWIRE_REQUIRE="$(python - <<'PY'
import pathlib, tomllib
names, cuda_only = [], set()
for pyproject in sorted(pathlib.Path(".").glob("*/*/pyproject.toml")):
    if pyproject.parts[0] not in ("backends", "examples"):
        continue
    meta = tomllib.loads(pyproject.read_text())
    eps = meta.get("project", {}).get("entry-points", {})
    names += list(eps.get("kvwire.backends", {}))
    cuda_only |= set(meta.get("tool", {}).get("kvwire", {}).get("cuda-only", ()))
if cuda_only & set(names):
    try:
        import torch
        has_cuda = torch.cuda.is_available()
    except ImportError:
        has_cuda = False
    if not has_cuda:
        names = [n for n in names if n not in cuda_only]
print(",".join(names))
PY
)"
    export KVWIRE_REQUIRE
    exec python -m pytest -p no:cacheprovider "$@" ;;
  *) echo "usage: ./dev.sh demo|test [args...]" >&2; exit 2 ;;
esac
