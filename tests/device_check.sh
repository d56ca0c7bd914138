#!/usr/bin/env bash
# One call on the lent GPU machine: clocks, info, build, the main job's checks, the GPU test suite,
# compute-sanitizer, and with
# BENCH=1 the forward benchmark against the peers (BENCH_ARGS passes its options), with BENCH_BWD=1 the
# backward's (BENCH_BWD_ARGS).
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
step main_job python -m cuflash --no-bench --checks 5   # the main job's checks (fresh random draws)
step gpu_tests python -m pytest -m gpu -q -p no:cacheprovider ${PYTEST_ARGS:-}
# memcheck and racecheck on aligned and misaligned, fp16 and bf16, small and odd shapes (CuPy only: lean process)
step memcheck compute-sanitizer --tool memcheck --error-exitcode 1 python tests/sanitize_cases.py
step racecheck compute-sanitizer --tool racecheck --error-exitcode 1 python tests/sanitize_cases.py
step synccheck compute-sanitizer --tool synccheck --error-exitcode 1 python tests/sanitize_cases.py
if [ -n "${BENCH:-}" ]; then
  step bench python benchmarks/bench_fwd.py --out "$OUT" ${BENCH_ARGS:-}
  step bench_jax python benchmarks/bench_fwd.py --out "$OUT" --jax ${BENCH_ARGS:-}
fi
if [ -n "${BENCH_BWD:-}" ]; then
  step bench_bwd python benchmarks/bench_fwd.py --out "$OUT" --backward ${BENCH_BWD_ARGS:-}
fi
if [ -n "${BENCH:-}${BENCH_BWD:-}" ]; then
  step report python benchmarks/report.py "$OUT"
fi
smi | tee -a "$OUT/smi.log"
exit $status
