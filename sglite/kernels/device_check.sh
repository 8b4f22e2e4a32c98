#!/usr/bin/env bash
# One short GPU check for sglite's Triton kernels (run from anywhere; ~2-4 min on an H200):
#   1. the kernel tests compiled for CUDA (SGLITE_TEST_DEVICE=cuda; same files CI interprets on CPU),
#   2. sglite/kernels/bench.py: per-op bandwidth vs copy bandwidth, decode 64 x 4k and masked sampling 64 x 49k.
# Works without installing sglite: the checkout root goes on PYTHONPATH.
# Results go to $OUT (the device tool's folder) or /tmp/sglite_device_check: tests.log, bench.md, bench.json.
set -uo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$ROOT"
OUT="${OUT:-/tmp/sglite_device_check}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1

if ! "$PY" -c "import sglite.kernels" >/dev/null 2>&1; then
  export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
fi

{
  nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem --format=csv 2>&1
  "$PY" -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, torch.cuda.get_device_name())"
} | tee "$OUT/env.txt"

SGLITE_TEST_DEVICE=cuda timeout "${TEST_TIMEOUT:-240}" "$PY" -m pytest -q -p no:cacheprovider \
  tests/kernels/test_attention.py tests/kernels/test_matmul.py tests/kernels/test_sampling.py tests/kernels/test_dispatch.py 2>&1 | tee "$OUT/tests.log"
test_rc=${PIPESTATUS[0]}

timeout "${BENCH_TIMEOUT:-240}" "$PY" -m sglite.kernels.bench --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.md"
bench_rc=${PIPESTATUS[0]}

echo "tests rc=$test_rc bench rc=$bench_rc"
exit $(( test_rc != 0 || bench_rc != 0 ))
