#!/bin/bash
# Packs ucxx and NIXL for Python 3.12 into one archive small enough to carry to the H200 host of
# the `device` tool (it has no network, and carries at most 64 MiB; the wheels are 190 MB). Run
# here, where PyPI is reachable:
#
#     bash bench/device_ucx_bundle.sh .h200/ucx312.tar.xz      # ~13 MB
#
# and on the device host, from the repository root (Python 3.12, numpy installed there):
#
#     tar -C /tmp -xJf .h200/ucx312.tar.xz
#     python -m pip install --no-index --no-deps --no-build-isolation -e . -e backends/memory -e backends/ucx
#     PYTHONPATH=/tmp/b312 python bench/bench_ucx.py --mode one-sided --trace
#
# What is kept of UCX's modules (in ucxx's UCX and in NIXL's): cma for host memory, and cuda
# (cuda_copy, cuda_ipc) with its memory hooks for device rows; they load only where libcuda does,
# and link only the host's driver and the libcudart the libucx wheel ships.
# What is dropped: what no transfer here loads (headers, static libraries, the InfiniBand modules,
# the perftest tools, NIXL's other plugins, the CUDA Python bindings beyond the namespace ucxx
# imports, nixl_ep). What NIXL's libraries need is kept by their dynamic links.
set -euo pipefail
out=$(realpath -m "${1:?usage: $0 OUT.tar.xz}")
mkdir -p "$(dirname "$out")"
python=${PYTHON:-.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$python" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$work/wheels" \
    ucxx-cu12==0.52.0 libucxx-cu12==0.52.0 libucx-cu12==1.21.0 nixl-cu12==1.5.1 librmm-cu12==26.10.0 \
    rapids-logger==0.3.0 cuda-bindings==12.9.10 cuda-pathfinder==1.9.1 nvidia-ml-py==13.615.71
mkdir "$work/b312"
for wheel in "$work"/wheels/*.whl; do "$python" -m zipfile -e "$wheel" "$work/b312"; done
cd "$work/b312"
rm -rf nixl_ep_cu12 nixl_cu12.scripts nixl_cu12-*.data/headers cuda/bindings cuda/core \
    libucxx/include libucxx/lib64/cmake librmm/include librmm/lib64/cmake \
    libucx/bin libucx/include libucx/share libucx/lib/cmake libucx/lib/pkgconfig
find libucx nixl_cu12.libs -name '*.a' -delete -o -name '*.la' -delete
# UCX: one copy of each library (the soname, the loader's name a link to it); cma and cuda modules
(cd libucx/lib && rm -f ./*.so.0.0.0 ucx/*.so ucx/*.so.0.0.0 ucx/*perftest* \
    && for f in *.so; do rm "$f"; ln -s "$f.0" "$f"; done \
    && find ucx -type f ! -name 'libuct_cma*' ! -name 'libuct_cuda.so*' ! -name 'libucm_cuda.so*' -delete \
    && for f in ucx/*.so.0; do ln -s "$(basename "$f")" "${f%.0}"; done)
# (UCX opens a module by its loader's name, ucx/libuct_cuda.so: without those links it loads no
# module at all, silently, and takes a device pointer for host memory.)
# NIXL: its UCX plugin and what it and the bindings link, nothing else
plugins=.nixl_cu12.mesonpy.libs/plugins
find "$plugins" -type f ! -name libplugin_UCX.so -delete
find nixl_cu12.libs/nixl -type f -delete
find nixl_cu12.libs/ucx -type f ! -name 'libuct_cma.so*' ! -name 'libuct_cuda.so*' ! -name 'libucm_cuda.so*' -delete
keep=$(ldd nixl_cu12/_bindings*.so "$plugins/libplugin_UCX.so" | awk '/=> \// {print $3}' | sort -u)
for lib in nixl_cu12.libs/*.so* .nixl_cu12.mesonpy.libs/*.so*; do
    grep -qxF "$(realpath "$lib")" <<<"$(for k in $keep; do realpath "$k"; done)" || rm -f "$lib"
done
find . -name __pycache__ -prune -exec rm -rf {} +
cd "$work"
tar -cJf "$out" b312
echo "$out: $(du -h "$out" | cut -f1) ($(du -sh b312 | cut -f1) unpacked)"
