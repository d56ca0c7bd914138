#!/usr/bin/env bash
# One call on the lent GPU machine: clocks, info, build, the GPU test suite, compute-sanitizer.
# Usage there (from the repo root): bash tests/device_check.sh  — logs go to $OUT (or ./device-logs).
set -uo pipefail
OUT=${OUT:-device-logs}; mkdir -p "$OUT"
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 HYPOTHESIS_PROFILE=gpu
smi() { nvidia-smi --query-gpu=name,clocks.sm,temperature.gpu,clocks_event_reasons.active --format=csv,noheader; }
status=0
step() { local name=$1; shift; echo "=== $name: $*"; "$@" 2>&1 | tee "$OUT/$name.log"; local rc=${PIPESTATUS[0]}; echo "=== $name rc=$rc"; [ "$rc" = 0 ] || status=1; }

smi | tee "$OUT/smi.log"
step info python -m cuflash info
step build python -m cuflash build
step gpu_tests python -m pytest -m gpu -q -p no:cacheprovider ${PYTEST_ARGS:-}
# memcheck and racecheck on aligned and misaligned, fp16 and bf16, small and odd shapes (CuPy only: lean process)
cat > /tmp/sanitize_case.py <<'PY'
import cupy as cp, numpy as np
from cuflash import api, reference
for dtype, shape, offset in (("float16", (2, 129, 3, 128), 0), ("bfloat16", (1, 7, 2, 96), 1), ("float16", (3, 1, 5, 256), 8), ("bfloat16", (2, 1021, 1, 32), 0)):
    n = int(np.prod(shape))
    base = cp.random.standard_normal(2 * (n + offset)).astype(cp.float16 if dtype == "float16" else cp.float32)
    if dtype == "bfloat16":
        import ml_dtypes; base = cp.asarray(cp.asnumpy(base).astype(ml_dtypes.bfloat16))
    o = base[offset:offset + n].reshape(shape); g = base[n + offset:2 * n + offset].reshape(shape)
    d = api.backward_preprocess(g, o)
    ref = reference.backward_preprocess(cp.asnumpy(g).astype(np.float64), cp.asnumpy(o).astype(np.float64))
    print(dtype, shape, offset, float(np.abs(d.get() - ref).max()))
PY
step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 python /tmp/sanitize_case.py
step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 python /tmp/sanitize_case.py
smi | tee -a "$OUT/smi.log"
exit $status
