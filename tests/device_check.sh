#!/usr/bin/env bash
# One call on the lent GPU machine: clocks, info, build, the GPU test suite, compute-sanitizer, and with
# BENCH=1 the forward benchmark against the peers (BENCH_ARGS passes its options).
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
import cupy as cp, numpy as np, ml_dtypes
import cuflash
from cuflash import api, reference
def randn(shape, dtype, offset=0):
    n = int(np.prod(shape))
    x = np.random.standard_normal(n + offset).astype(np.float16 if dtype == "float16" else ml_dtypes.bfloat16)
    return cp.asarray(x)[offset:].reshape(shape)
for dtype, shape, offset in (("float16", (2, 129, 3, 128), 0), ("bfloat16", (1, 7, 2, 96), 1), ("float16", (3, 1, 5, 256), 8)):
    o, g = randn(shape, dtype, offset), randn(shape, dtype)
    d = api.backward_preprocess(g, o)
    print("bwd_preprocess", dtype, shape, float(np.abs(d.get() - reference.backward_preprocess(cp.asnumpy(g).astype(np.float64), cp.asnumpy(o).astype(np.float64))).max()))
for dtype, sq, sk, h, hkv, d, kw in (("bfloat16", 200, 333, 4, 2, 128, dict(causal=True)), ("float16", 77, 50, 2, 1, 64, dict(window=(16, 8), softcap=5.0)),
                                     ("bfloat16", 130, 130, 2, 2, 256, {}), ("float16", 65, 1, 2, 2, 40, dict(causal=True))):
    q, k, v = randn((1, sq, h, d), dtype), randn((1, sk, hkv, d), dtype), randn((1, sk, hkv, d), dtype)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    ref, _ = reference.forward(*(cp.asnumpy(x).astype(np.float64) for x in (q, k, v)), **kw)
    print("fwd_sm80", dtype, (sq, sk, h, hkv, d), kw, float(np.abs(cp.asnumpy(out).astype(np.float64) - ref).max()))
cu = cp.asarray(np.array([0, 5, 5, 140], np.int32))
q, k = randn((140, 4, 64), "float16"), randn((140, 2, 64), "float16")
out = cuflash.attention_varlen(q, k, k, cu, cu, 135, 135, causal=True)
print("fwd_sm80 varlen", float(cp.abs(out.astype(cp.float32)).max()))
PY
step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 python /tmp/sanitize_case.py
step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 python /tmp/sanitize_case.py
if [ -n "${BENCH:-}" ]; then
  step bench python benchmarks/bench_fwd.py --out "$OUT" ${BENCH_ARGS:-}
  step bench_jax python benchmarks/bench_fwd.py --out "$OUT" --jax ${BENCH_ARGS:-}
  step report python benchmarks/report.py "$OUT"
fi
smi | tee -a "$OUT/smi.log"
exit $status
