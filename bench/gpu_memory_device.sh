#!/bin/bash
# One GPU lease for issue 33 row 2's direct path (run from the repo root on the GPU host, through
# the device tool): install kvwire without the network, the memory store's option `device` under
# its CUDA tests and the whole conformance suite, then the core bench, memory-device beside the
# staged memory store. Results go to $OUT (the device tool brings them back).
set -x
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name --format=csv,noheader
python -m pip install -q --no-index --no-deps --no-build-isolation -e . -e backends/memory -e backends/files \
    -e integrations/vllm 2>&1 | tail -3
python -c "import kvwire.copying as c; print(c.COPY_NAME)"
timeout 120 python -m pytest -q -p no:cacheprovider tests/memory/test_memory_device.py tests/lender/test_blockcopy.py \
    -k "device or spans" 2>&1 | tail -25 | tee "$OUT/tests_device.txt"
timeout 120 python -m pytest -q -p no:cacheprovider tests/vllm_core/test_core_roundtrip.py -k memory-device 2>&1 \
    | tail -12 | tee "$OUT/tests_core.txt"
KVWIRE_MEMORY_DEVICE=1 timeout 200 python -m pytest -q -p no:cacheprovider --pyargs kvwire.testing.suite \
    --kvwire-backend memory 2>&1 | tail -15 | tee "$OUT/suite_device.txt"
timeout 240 python bench/bench_gpu.py --sections core --tokens 8192,32768 --repeat 5 --copy-threads 8 \
    --stores memory-device,memory --out "$OUT/core.txt" > "$OUT/core.log" 2>&1
tail -30 "$OUT/core.txt"; tail -5 "$OUT/core.log"
echo "elapsed $SECONDS s"
