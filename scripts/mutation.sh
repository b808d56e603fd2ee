#!/usr/bin/env bash
# Mutation testing of the reference store backend (src/kvwire/testing/reference/store.py) with
# the conformance suite as the test command: each mutant of the file is run against the suite's
# quick profile through store_harness; a mutant the suite fails is killed, one it passes survived.
#
# Slow (one suite run per mutant), so not part of CI. It works on a copy of src/ in a temporary
# folder, so the work tree is never mutated (cosmic-ray rewrites the file it mutates in place).
#
#   scripts/mutation.sh                 # a random sample of 80 mutants, at most 30 minutes
#   KVWIRE_MUTATION_SAMPLE=0 KVWIRE_MUTATION_BUDGET_S=0 scripts/mutation.sh   # every mutant, no limit
#
# Environment: KVWIRE_MUTATION_SAMPLE (how many mutants, drawn at random with
# KVWIRE_MUTATION_SEED; 0: all), KVWIRE_MUTATION_BUDGET_S (stop after this many seconds; 0: no
# limit), KVWIRE_MUTATION_OUT (where the session and report go; default a temporary folder).
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="$root/.venv/bin/python"
sample="${KVWIRE_MUTATION_SAMPLE:-80}"
budget="${KVWIRE_MUTATION_BUDGET_S:-1800}"
seed="${KVWIRE_MUTATION_SEED:-15}"
out="${KVWIRE_MUTATION_OUT:-$(mktemp -d -t kvwire-mutation-XXXXXX)}"
mkdir -p "$out"

if ! "$py" -c "import cosmic_ray" 2>/dev/null; then
  "$py" -m pip install -q cosmic-ray
fi

# The copy that gets mutated; the suite imports kvwire from it (PYTHONPATH comes before the
# editable install's path entry).
copy="$out/tree"
rm -rf "$copy"
mkdir -p "$copy"
cp -r "$root/src" "$copy/src"
find "$copy/src" -name __pycache__ -prune -exec rm -rf {} +
run="$out/run"
mkdir -p "$run"
printf '[pytest]\n' > "$run/pytest.ini"

cat > "$out/config.toml" <<EOF
[cosmic-ray]
module-path = "src/kvwire/testing/reference/store.py"
timeout = 120.0
excluded-modules = []
test-command = "env PYTHONPATH=$copy/src PYTHONDONTWRITEBYTECODE=1 $py -m pytest --rootdir=$run -c $run/pytest.ini --pyargs kvwire.testing.suite -q -x -p no:cacheprovider --kvwire-harness kvwire.testing.reference.harness:store_harness --kvwire-profile quick --kvwire-patience 3 --kvwire-no-shrink --hypothesis-seed=0"

[cosmic-ray.distributor]
name = "local"
EOF

cd "$copy"
session="$out/session.sqlite"
rm -f "$session"
"$py" -m cosmic_ray.cli init "$out/config.toml" "$session"
"$py" - "$session" "$sample" "$seed" <<'EOF'
"""Keep a random sample of the work items (the rest are removed from the session)."""
import random, sqlite3, sys
session, sample, seed = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
db = sqlite3.connect(session)
ids = [row[0] for row in db.execute("SELECT job_id FROM work_items")]
print(f"{len(ids)} mutants of store.py", flush=True)
if 0 < sample < len(ids):
    keep = set(random.Random(seed).sample(ids, sample))
    drop = [(i,) for i in ids if i not in keep]
    db.executemany("DELETE FROM mutation_specs WHERE job_id = ?", drop)
    db.executemany("DELETE FROM work_items WHERE job_id = ?", drop)
    db.commit()
    print(f"kept a random sample of {sample} (seed {seed})", flush=True)
EOF
echo "baseline: the unmutated copy must pass"
"$py" -m cosmic_ray.cli baseline "$out/config.toml" 2>&1 | tail -3 || true
if [ "$budget" -gt 0 ]; then
  timeout "$budget" "$py" -m cosmic_ray.cli exec "$out/config.toml" "$session" || echo "stopped at the time budget ($budget s); the report covers the mutants run so far"
else
  "$py" -m cosmic_ray.cli exec "$out/config.toml" "$session"
fi
"$root/.venv/bin/cr-report" --show-output "$session" > "$out/report.txt" || true
"$root/.venv/bin/cr-report" "$session" | tail -4
echo "session: $session; survivors with their diffs: $out/report.txt"
