#!/usr/bin/env bash
# Mutation testing of the shipped backends with the conformance suite as the test command: each
# mutant of a module is run against the suite's quick profile through the backend's harness; a
# mutant the suite fails is killed, one it passes survived. One command per target:
#
#   scripts/mutation.sh reference-store     # kvwire/testing/reference/store.py, store_harness
#   scripts/mutation.sh blob                # kvwire/blob/backend.py, through the memory backend
#   scripts/mutation.sh files-store         # kvwire_files/store.py (packs, index, ledger), files
#   scripts/mutation.sh files-fs            # kvwire_files/fs.py (the index and ledger on disk)
#   scripts/mutation.sh files-driver        # kvwire_files/driver.py
#   scripts/mutation.sh memory-store        # kvwire_memory/store.py (also memory-driver, memory-plugin)
#   scripts/mutation.sh ucx-serving         # kvwire_ucx/serving.py, two-sided; ucx-serving@one-sided
#                                           # (also ucx-requesting, ucx-offers, ucx-protocol-server,
#                                           #  ucx-protocol-requester, ucx-protocol-events)
#   scripts/mutation.sh all                 # every target above, KVWIRE_MUTATION_JOBS at once
#   scripts/mutation.sh blob:60 files-store:40   # TARGET:N samples N mutants of that target
#
# Slow (one suite run per mutant), so not part of CI. Each run works on a copy of the sources in a
# folder of its own, so the work tree is never mutated (cosmic-ray rewrites the file it mutates in
# place) and runs of several targets, or several shards of one, go side by side.
#
# Environment:
#   KVWIRE_MUTATION_SAMPLE    mutants per target, drawn at random with KVWIRE_MUTATION_SEED (0: all; default 80)
#   KVWIRE_MUTATION_SHARD     mutants per run: a target's sample is split into runs of this many, side by
#                             side (default 0: one run per target)
#   KVWIRE_MUTATION_JOBS      runs at a time (default: the number of cores)
#   KVWIRE_MUTATION_BUDGET_S  stop everything this many seconds after the start (0: no limit; default 1800);
#                             the summary covers the mutants run by then
#   KVWIRE_MUTATION_OUT       where sessions, reports and summary.tsv go (default a temporary folder)
#   KVWIRE_MUTATION_PYTHON    the interpreter with kvwire, its backends, pytest, hypothesis and cosmic-ray
#                             (default .venv/bin/python; cosmic-ray is installed into .venv if missing)
#   KVWIRE_MUTATION_BASELINE  1 (default): first check that the unmutated suite passes for each target
set -euo pipefail
root="$(cd "$(dirname "$0")/.." && pwd)"
py="${KVWIRE_MUTATION_PYTHON:-$root/.venv/bin/python}"
sample="${KVWIRE_MUTATION_SAMPLE:-80}"
budget="${KVWIRE_MUTATION_BUDGET_S:-1800}"
seed="${KVWIRE_MUTATION_SEED:-15}"
shard_size="${KVWIRE_MUTATION_SHARD:-0}"
jobs="${KVWIRE_MUTATION_JOBS:-$(nproc)}"
baseline="${KVWIRE_MUTATION_BASELINE:-1}"
out="${KVWIRE_MUTATION_OUT:-$(mktemp -d -t kvwire-mutation-XXXXXX)}"
mkdir -p "$out"

ALL="reference-store blob files-store files-fs files-driver memory-store memory-driver memory-plugin
ucx-serving ucx-requesting ucx-offers ucx-protocol-server ucx-protocol-requester ucx-protocol-events
ucx-serving@one-sided ucx-requesting@one-sided ucx-offers@one-sided ucx-protocol-server@one-sided
ucx-protocol-requester@one-sided ucx-protocol-events@one-sided"

# target -> "module (relative to the repository)|suite arguments"
spec() {
  local name="${1%@*}" mode=""
  [[ "$1" == *@one-sided ]] && mode="one-sided"
  local ucx="--kvwire-backend ucx"
  [ "$mode" = "one-sided" ] && ucx="--kvwire-harness kvwire_ucx.harness:one_sided"
  case "$name" in
    reference-store) echo "src/kvwire/testing/reference/store.py|--kvwire-harness kvwire.testing.reference.harness:store_harness" ;;
    blob) echo "src/kvwire/blob/backend.py|--kvwire-backend memory" ;;
    files-store) echo "backends/files/src/kvwire_files/store.py|--kvwire-backend files" ;;
    files-fs) echo "backends/files/src/kvwire_files/fs.py|--kvwire-backend files" ;;
    files-driver) echo "backends/files/src/kvwire_files/driver.py|--kvwire-backend files" ;;
    memory-store) echo "backends/memory/src/kvwire_memory/store.py|--kvwire-backend memory" ;;
    memory-driver) echo "backends/memory/src/kvwire_memory/driver.py|--kvwire-backend memory" ;;
    memory-plugin) echo "backends/memory/src/kvwire_memory/__init__.py|--kvwire-backend memory" ;;
    ucx-serving) echo "backends/ucx/src/kvwire_ucx/serving.py|$ucx" ;;
    ucx-requesting) echo "backends/ucx/src/kvwire_ucx/requesting.py|$ucx" ;;
    ucx-offers) echo "backends/ucx/src/kvwire_ucx/offers.py|$ucx" ;;
    ucx-protocol-server) echo "backends/ucx/src/kvwire_ucx/protocol/server.py|$ucx" ;;
    ucx-protocol-requester) echo "backends/ucx/src/kvwire_ucx/protocol/requester.py|$ucx" ;;
    ucx-protocol-events) echo "backends/ucx/src/kvwire_ucx/protocol/events.py|$ucx" ;;
    *) echo "unknown target $1; one of: $ALL all" >&2; return 2 ;;
  esac
}

if ! "$py" -c "import cosmic_ray" 2>/dev/null; then
  "$py" -m pip install -q cosmic-ray
fi

targets=("$@")
[ ${#targets[@]} -eq 0 ] && targets=(reference-store)
[ "${targets[0]}" = "all" ] && read -r -a targets <<<"$(echo $ALL)"
for t in "${targets[@]}"; do spec "${t%%:*}" >/dev/null; done
start=$(date +%s)
deadline=0
[ "$budget" -gt 0 ] && deadline=$((start + budget))

# One run: target $1, shard $2 of $3, of a sample of $4. Its own copy of every source folder the
# suite imports.
one_run() {
  local target="$1" shard="$2" shards="$3" sample="$4"
  local module args name dir copy run pp
  IFS='|' read -r module args <<<"$(spec "$target")"
  name="${target//@/-}-$shard"
  dir="$out/$name"
  copy="$dir/tree"
  rm -rf "$dir"
  mkdir -p "$copy/backends" "$dir/run"
  cp -rL "$root/src" "$copy/src"
  for b in memory files ucx; do mkdir -p "$copy/backends/$b" && cp -rL "$root/backends/$b/src" "$copy/backends/$b/src"; done
  find "$copy" -name __pycache__ -prune -exec rm -rf {} +
  printf '[pytest]\n' > "$dir/run/pytest.ini"
  pp="$copy/src:$copy/backends/memory/src:$copy/backends/files/src:$copy/backends/ucx/src${PYTHONPATH:+:$PYTHONPATH}"
  local timeout=90
  [[ "$target" == ucx-* ]] && timeout=150
  cat > "$dir/config.toml" <<EOF
[cosmic-ray]
module-path = "$module"
timeout = $timeout.0
excluded-modules = []
test-command = "env PYTHONPATH=$pp PYTHONDONTWRITEBYTECODE=1 $py -m pytest --rootdir=$dir/run -c $dir/run/pytest.ini --pyargs kvwire.testing.suite -q -x -p no:cacheprovider $args --kvwire-profile quick --kvwire-patience 3 --kvwire-no-shrink --hypothesis-seed=0"

[cosmic-ray.distributor]
name = "local"
EOF
  (
    cd "$copy"
    "$py" -m cosmic_ray.cli init "$dir/config.toml" "$dir/session.sqlite" >/dev/null
    "$py" - "$dir/session.sqlite" "$sample" "$seed" "$shard" "$shards" <<'PYEOF'
"""Keep this shard's part of a random sample of the work items (the rest are removed). Mutants of
an annotation are left out first: under `from __future__ import annotations` (every module here)
an annotation is never evaluated, so such a mutant cannot change behaviour."""
import ast, random, sqlite3, sys
session, sample, seed, shard, shards = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
db = sqlite3.connect(session)
source = db.execute("SELECT module_path FROM mutation_specs LIMIT 1").fetchone()
spans = []
if source is not None:
    tree = ast.parse(open(source[0]).read())
    deferred = any(isinstance(n, ast.ImportFrom) and n.module == "__future__" and any(a.name == "annotations" for a in n.names)
                   for n in tree.body)
    for node in ast.walk(tree) if deferred else ():
        for ann in (getattr(node, "annotation", None), getattr(node, "returns", None)):
            if isinstance(ann, ast.expr):
                spans.append(((ann.lineno, ann.col_offset), (ann.end_lineno, ann.end_col_offset)))
def in_annotation(row, col):
    return any(a <= (row, col) < b for a, b in spans)
positions = dict(((j, (r, c)) for j, r, c in db.execute("SELECT job_id, start_pos_row, start_pos_col FROM mutation_specs")))
ids = sorted(row[0] for row in db.execute("SELECT job_id FROM work_items"))
every = list(ids)
annotations = [j for j in ids if in_annotation(*positions[j])]
total = len(ids)
ids = [j for j in ids if j not in set(annotations)]
random.Random(seed).shuffle(ids)
chosen = ids[:sample] if 0 < sample < len(ids) else ids
keep = set(chosen[shard::shards])
drop = [(i,) for i in every if i not in keep]
db.executemany("DELETE FROM mutation_specs WHERE job_id = ?", drop)
db.executemany("DELETE FROM work_items WHERE job_id = ?", drop)
db.commit()
with open(session + ".count", "w") as f:
    f.write(f"{total} {len(keep)} {len(annotations)}\n")
PYEOF
    if [ "$deadline" -gt 0 ]; then
      local left=$((deadline - $(date +%s)))
      if [ "$left" -gt 5 ]; then
        timeout "$left" "$py" -m cosmic_ray.cli exec "$dir/config.toml" "$dir/session.sqlite" >"$dir/exec.log" 2>&1 \
          || echo "stopped at the time budget" >>"$dir/exec.log"
      fi
    else
      "$py" -m cosmic_ray.cli exec "$dir/config.toml" "$dir/session.sqlite" >"$dir/exec.log" 2>&1
    fi
  )
  "$py" - "$dir/session.sqlite" "$target" "$module" >>"$out/runs.tsv" <<'PYEOF'
"""One line per run: target, module, mutants in the module, sampled here, done, killed, survived,
incompetent; and the survivors' diffs beside the session."""
import json, sqlite3, sys
session, target, module = sys.argv[1:4]
total, sampled, annotations = open(session + ".count").read().split()
db = sqlite3.connect(session)
rows = db.execute("SELECT w.job_id, r.test_outcome, r.worker_outcome, r.diff, s.operator_name, s.start_pos_row "
                  "FROM work_items w JOIN mutation_specs s ON s.job_id = w.job_id "
                  "LEFT JOIN work_results r ON r.job_id = w.job_id").fetchall()
done = [r for r in rows if r[1] is not None or r[2] is not None]
killed = sum(1 for r in done if r[1] == "KILLED")
survived = [r for r in done if r[1] == "SURVIVED"]
incompetent = sum(1 for r in done if r[1] == "INCOMPETENT" or (r[1] is None and r[2] not in (None, "NORMAL")))
with open(session + ".survivors.txt", "w") as f:
    for r in survived:
        f.write(f"=== {target} {module}:{r[5]} {r[4]}\n{r[3]}\n")
print("\t".join(map(str, (target, module, total, annotations, sampled, len(done), killed, len(survived), incompetent))))
PYEOF
}
export -f one_run spec
export out py seed deadline root ALL

printf 'target\tmodule\tmutants\tannotations\tsampled\tdone\tkilled\tsurvived\tincompetent\n' > "$out/runs.tsv"
if [ "$baseline" = "1" ]; then
  # Once per suite command, side by side: the unmutated suite must pass, or every mutant "dies".
  declare -A seen=()
  for t in "${targets[@]}"; do
    IFS='|' read -r _ args <<<"$(spec "${t%%:*}")"
    [ -n "${seen[$args]:-}" ] && continue
    seen[$args]=1
    bdir="$out/baseline-${#seen[@]}"
    mkdir -p "$bdir" && printf '[pytest]\n' > "$bdir/pytest.ini" && echo "$args" > "$bdir/args"
    # shellcheck disable=SC2086
    (cd "$bdir" && "$py" -m pytest --rootdir="$bdir" -c "$bdir/pytest.ini" --pyargs kvwire.testing.suite -q -x \
        -p no:cacheprovider $args --kvwire-profile quick --kvwire-patience 3 --kvwire-no-shrink --hypothesis-seed=0 \
        >"$bdir/log" 2>&1; echo $? > "$bdir/status") &
  done
  wait
  # A target whose unmutated suite fails here is left out (said so), the others run.
  kept=()
  for t in "${targets[@]}"; do
    IFS='|' read -r _ args <<<"$(spec "${t%%:*}")"
    for bdir in "$out"/baseline-*; do
      [ "$(cat "$bdir/args")" = "$args" ] || continue
      if [ "$(cat "$bdir/status")" = "0" ]; then
        kept+=("$t")
      else
        echo "left out $t: the unmutated suite does not pass with $args ($bdir/log):"; tail -3 "$bdir/log"
      fi
    done
  done
  targets=("${kept[@]}")
  [ ${#targets[@]} -eq 0 ] && exit 1
fi
for t in "${targets[@]}"; do
  n="$sample"
  [[ "$t" == *:* ]] && n="${t##*:}"
  count=1
  [ "$shard_size" -gt 0 ] && [ "$n" -gt 0 ] && count=$(( (n + shard_size - 1) / shard_size ))
  for ((s = 0; s < count; s++)); do echo "${t%%:*} $s $count $n"; done
done | xargs -P "$jobs" -L 1 bash -c 'one_run "$0" "$1" "$2" "$3"'
"$py" - "$out/runs.tsv" <<'PYEOF' | tee "$out/summary.tsv"
"""Per target: the shards summed, and the score (killed / (killed + survived)) over the sampled
mutants that are not of annotations."""
import collections, sys
lines = [l.rstrip("\n").split("\t") for l in open(sys.argv[1])][1:]
acc = collections.OrderedDict()
for t, m, total, annotations, sampled, done, killed, survived, incompetent in lines:
    a = acc.setdefault((t, m), [int(total), int(annotations), 0, 0, 0, 0, 0])
    for i, v in enumerate((sampled, done, killed, survived, incompetent), start=2):
        a[i] += int(v)
print("target\tmodule\tmutants\tof annotations\tsampled\tdone\tkilled\tsurvived\tincompetent\tscore")
for (t, m), (total, annotations, sampled, done, killed, survived, incompetent) in acc.items():
    score = f"{100 * killed / (killed + survived):.0f}%" if killed + survived else "-"
    print(f"{t}\t{m}\t{total}\t{annotations}\t{sampled}\t{done}\t{killed}\t{survived}\t{incompetent}\t{score}")
PYEOF
cat "$out"/*/session.sqlite.survivors.txt > "$out/survivors.txt" 2>/dev/null || true
echo "sessions, logs and survivors' diffs: $out (survivors.txt, summary.tsv)"
