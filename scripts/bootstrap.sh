#!/usr/bin/env bash
# Create or refresh the repo's virtual environment (.venv) with everything the demo and the tests
# need: the Debian libraries Mooncake links against, torch 2.13.0 (the CPU wheel on this disk),
# the core in editable mode, and every in-repo plugin and example plugin. Idempotent: when no
# pyproject.toml and not this script changed since the last run, it does nothing. vLLM's venv is
# another script's (bootstrap_vllm.sh): only `./dev.sh test` needs it.
set -euo pipefail
top="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$top"
venv="$top/.venv"
py="${PYTHON:-python3}"

say() { printf '[bootstrap] %s\n' "$*" >&2; }
# shellcheck source=scripts/progress.sh
. "$top/scripts/progress.sh"

# 1. Debian libraries for Mooncake's shared objects (libibverbs, librdmacm, libnuma).
need_apt=()
for pkg in libibverbs1 librdmacm1 libnuma1; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need_apt+=("$pkg")
done
if ((${#need_apt[@]})); then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    apt_install() {
      apt-get update -qq >/dev/null
      DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "$@" >/dev/null
    }
    step "installing ${need_apt[*]} with apt-get (Mooncake's shared objects link against them)" \
      apt_install "${need_apt[@]}"
  else
    say "WARNING: ${need_apt[*]} missing and not root: the Mooncake backend will report its library as unavailable"
  fi
fi

# 2. The virtual environment and what goes into it.
shopt -s nullglob
projects=()
for p in backends/*/ examples/*/ integrations/vllm/; do  # kvwire-vllm: its vLLM-free core is tested here
  if [ -f "$p/pyproject.toml" ]; then projects+=("$p"); fi
done
stamp_src="$(cat scripts/bootstrap.sh pyproject.toml setup.py src/kvwire/_copy.c "${projects[@]/%//pyproject.toml}" | sha256sum | cut -d' ' -f1)"
if [ -x "$venv/bin/python" ] && [ -f "$venv/.kvwire-stamp" ] && [ "$(cat "$venv/.kvwire-stamp")" = "$stamp_src" ]; then
  exit 0
fi
start=$SECONDS
say "setting up $venv (torch, then kvwire and its plugins): about a minute or two the first time;"
say "later runs skip this step until a pyproject.toml or this script changes"
[ -x "$venv/bin/python" ] || { say "creating $venv"; "$py" -m venv "$venv"; }
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# torch first and pinned: a looser request later is then already satisfied, never upgraded.
# setuptools >= 68 in the venv itself: tests build throwaway plugins without build isolation.
step "1/2 installing torch==2.13.0 (CPU build, the largest part) and setuptools" \
  "${pip[@]}" "torch==2.13.0" "setuptools>=68"
mooncake_extra=cpu
command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1 && mooncake_extra=cuda
args=(-e ".[testing,bench]")
for p in "${projects[@]}"; do
  case "$p" in
    backends/mooncake/) args+=(-e "${p}[${mooncake_extra}]") ;;
    backends/ucx/) args+=(-e "${p}[nixl]") ;;
    *) args+=(-e "$p") ;;
  esac
done
# pytest below 9.2: pytest 9.2 keeps node ids where pytest-xdist 3.8 cannot add its '@group'
# suffix, so --dist loadgroup silently stops grouping (tests/conftest.py refuses such a run).
names=("${projects[@]%/}"); names=("${names[@]##*/}")
step "2/2 installing kvwire and its plugins (${names[*]}) in editable mode, with Mooncake, UCX, NIXL and the test and bench tools" \
  "${pip[@]}" "${args[@]}" "torch==2.13.0" "pytest>=8,<9.2"
echo "$stamp_src" > "$venv/.kvwire-stamp"
say "$venv ready in $((SECONDS - start)) s"
