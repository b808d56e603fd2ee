#!/bin/bash
# One GPU lease for issue 33 (run from the repo root on the GPU host, through the device tool, with
# `.h200` carried: bench/device_ucx_bundle.sh's archive, and kvwire._copy built for Python 3.12 where
# the host has no compiler). Everything that runs on a GPU, most wanted first, each step bounded so
# the whole fits one 600 s call:
#   1. install without the network; which copy helpers loaded
#   2. the device tests: the memory store's option device, the block and span kernels, the worker
#      core on CUDA tensors, device rows over kvwire-ucx between two processes
#   3. row 2: the connector's core, staged through memory / files beside memory-device
#   4. row 3: bench_gpu_ucx, both modes
#   5. the conformance suite against memory-device, required (what time is left)
# STEPS (default tests,core,ucx,suite; also ucx-spin: row 3 one-sided with spin_us 500; ucx-profile:
# row 3 one-sided with the puller's calls under cProfile) picks among 2-5. Results go to $OUT (the device tool brings
# them back).
set -x
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
BUDGET=${BUDGET:-590}
STEPS=${STEPS:-tests,core,ucx,suite}
step() { [[ ",$STEPS," == *",$1,"* ]]; }
left() { echo $(( BUDGET - SECONDS > 5 ? BUDGET - SECONDS : 5 )); }
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader | tee "$OUT/machine.txt"
nproc >> "$OUT/machine.txt"
python -c "import sys, torch; print(sys.version.split()[0], torch.__version__, torch.version.cuda)" >> "$OUT/machine.txt"
tar -C /tmp -xJf .h200/ucx312.tar.xz
python -m pip install -q --no-index --no-deps --no-build-isolation -e . -e backends/memory -e backends/files \
    -e backends/ucx -e integrations/vllm 2>&1 | tail -3
ls src/kvwire/_copy*.so >/dev/null 2>&1 || cp .h200/_copy.cpython-312-x86_64-linux-gnu.so src/kvwire/
export PYTHONPATH=/tmp/b312
python -c "import kvwire.copying as c; from kvwire.lender import blockcopy as b; print('host copy', c.COPY_NAME); print('device copy', b.implementation())" \
    | tee -a "$OUT/machine.txt"
step tests && { echo "== tests" ; date -u
timeout 150 python -m pytest -q -p no:cacheprovider -rs tests/gpu tests/memory/test_memory_device.py \
    tests/lender/test_blockcopy.py tests/vllm_core/test_core_roundtrip.py 2>&1 | tail -40 | tee "$OUT/tests.txt"; }
step core && { echo "== core (row 2)"; date -u
timeout 240 python bench/bench_gpu.py --sections core --tokens 8192,32768 --repeat 5 --copy-threads 8 \
    --stores ${CORE_STORES:-memory-device,memory,files} --out "$OUT/core.txt" > "$OUT/core.log" 2>&1
tail -30 "$OUT/core.txt"; tail -5 "$OUT/core.log"; }
step ucx && { echo "== ucx (row 3)"; date -u
timeout $(( $(left) < 120 ? $(left) : 120 )) python bench/bench_gpu_ucx.py --runs 5 --sizes-mib 16,256,1024 \
    > "$OUT/ucx.txt" 2>&1
tail -30 "$OUT/ucx.txt"; }
step ucx-spin && { echo "== ucx (row 3), progress threads spinning 500 us"; date -u
timeout $(( $(left) < 90 ? $(left) : 90 )) python bench/bench_gpu_ucx.py --runs 5 --sizes-mib 16,256,1024 \
    --modes one-sided --spin-us 500 > "$OUT/ucx_spin.txt" 2>&1
tail -20 "$OUT/ucx_spin.txt"; }
step ucx-profile && { echo "== ucx (row 3), one-sided, the puller profiled"; date -u
timeout $(( $(left) < 90 ? $(left) : 90 )) python bench/bench_gpu_ucx.py --runs 5 --sizes-mib 16,1024 \
    --modes one-sided --profile 5 > "$OUT/ucx_profile.txt" 2>&1
tail -80 "$OUT/ucx_profile.txt"; }
step suite && { echo "== suite, memory-device"; date -u
timeout "$(left)" python -m pytest -q -p no:cacheprovider -rf --pyargs kvwire.testing.suite \
    --kvwire-backend memory-device --kvwire-require memory-device 2>&1 | tail -25 | tee "$OUT/suite_device.txt"; }
echo "elapsed $SECONDS s"
