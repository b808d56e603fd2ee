# Sourced by the bootstrap scripts: say what a long step does while it runs, so a set-up never
# sits silent for minutes. Needs say() defined by the sourcing script.

_ticker=""
trap '[ -z "$_ticker" ] || kill "$_ticker" 2>/dev/null || true' EXIT

# step WHAT CMD...: say WHAT, run CMD, and every 15 s while it runs say that it still works and
# for how long; CMD's exit status is step's. CMD runs as a job of its own so that `set -e` holds
# inside it (a function called on the left of `||` would run with -e ignored).
step() {
  local what="$1" began=$SECONDS rc=0 pid
  shift
  say "$what"
  ( while sleep 15; do say "  ... still working ($((SECONDS - began)) s)"; done ) &
  _ticker=$!
  "$@" &
  pid=$!
  wait "$pid" || rc=$?
  kill "$_ticker" 2>/dev/null || true
  wait "$_ticker" 2>/dev/null || true
  _ticker=""
  return "$rc"
}
