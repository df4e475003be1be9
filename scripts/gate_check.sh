#!/usr/bin/env bash
# The regression gate's own check, on one CUDA machine, from the repo root:
#   0. if the baseline is not on GPU time (a wall-clock baselines.json), record one first: $OUT/baseline.json;
#   1. the benchmarks unmodified against the baseline: nothing may fail;
#   2. once per slowdown target (validations/slowdown.py), ANATOMY_SLOWDOWN=<target>=<1 + 1.5 x threshold>:
#      every benchmark of the target's own must fail, and no benchmark whose work never called it.
# Each run is the design card's gate (--benchmark-compare=BASELINE --benchmark-compare-fail=median:X%)
# over the benchmark tests; scripts/gate_check_summary.py then writes $OUT/gate_check.json.
#
#   bash scripts/gate_check.sh                        # THRESHOLD=5 (%), every target
#   THRESHOLD=4 TARGETS="rms_norm attention" bash scripts/gate_check.sh -m "gpu and not slow"
#
# Env: OUT (default .anatomy/gate-check), BASELINE (default baselines.json), THRESHOLD (percent, default 5),
# FACTOR (default 1 + 1.5 x THRESHOLD / 100), TARGETS (default: all), RECORD=1 (record a fresh baseline
# even if BASELINE is on GPU time). Extra arguments go to every pytest run (default -m gpu).
# Exit 0 when the gate behaved, 1 when it did not, 2 without a GPU.
set -uo pipefail
OUT=${OUT:-.anatomy/gate-check}
BASELINE=${BASELINE:-baselines.json}
THRESHOLD=${THRESHOLD:-5}
FACTOR=${FACTOR:-$(python3 -c "print(round(1 + 1.5 * $THRESHOLD / 100, 6))")}
TARGETS=${TARGETS:-rms_norm swiglu gpt_oss rope_qkv linear_ce attention adamw fused_ademamix}
SELECT=(validations/test_benchmarks.py validations/test_bench_kernels.py validations/test_optim.py::test_step_bandwidth)
ARGS=("$@"); [ ${#ARGS[@]} -eq 0 ] && ARGS=(-m gpu)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
unset ANATOMY_SLOWDOWN

if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gate_check: error: needs a CUDA GPU; this machine has none" >&2
  exit 2
fi
mkdir -p "$OUT"
PYTEST=(python3 -m pytest "${SELECT[@]}" -q -p no:cacheprovider --benchmark-enable
        --benchmark-columns=median,iqr,rounds --benchmark-sort=fullname "${ARGS[@]}")
T0=$SECONDS

on_gpu_time() {  # does every benchmark of $1 carry the gpu_time timer?
  python3 - "$1" <<'PY' 2>/dev/null
import json, sys
b = json.load(open(sys.argv[1]))["benchmarks"]
sys.exit(0 if b and all(x["options"].get("timer") == "gpu_time" for x in b) else 1)
PY
}

if [ "${RECORD:-0}" = 1 ] || ! on_gpu_time "$BASELINE"; then
  echo "== 0. $BASELINE is not a GPU-time baseline (or RECORD=1): recording $OUT/baseline.json"
  t=$SECONDS
  "${PYTEST[@]}" --benchmark-json="$OUT/baseline.json" > "$OUT/0-record.log" 2>&1
  rc=$?; tail -1 "$OUT/0-record.log"; echo "   rc=$rc, $((SECONDS - t)) s"
  [ $rc -ne 0 ] && { echo "gate_check: recording failed; see $OUT/0-record.log" >&2; exit 1; }
  BASELINE=$OUT/baseline.json
fi
GATE=(--benchmark-compare="$BASELINE" --benchmark-compare-fail=median:${THRESHOLD}%)

RUNS=()
run() {  # name, then env assignments for the run
  local name=$1; shift
  local t=$SECONDS
  env "$@" "${PYTEST[@]}" "${GATE[@]}" --benchmark-json="$OUT/$name.json" > "$OUT/$name.log" 2>&1
  local rc=$?
  printf '== %-15s rc=%d %4d s  %s\n' "$name" $rc $((SECONDS - t)) "$(grep -E '^[0-9]+ (passed|failed)|(passed|failed).* in ' "$OUT/$name.log" | tail -1)"
  if [ -f "$OUT/$name.json" ]; then RUNS+=("$name=$OUT/$name.json:$rc")
  else RUNS+=("$name=:$rc"); echo "   no report: see $OUT/$name.log" >&2; fi
}

echo "== gate: median:${THRESHOLD}% against $BASELINE; slowdown factor $FACTOR; $OUT"
run unmodified
for target in $TARGETS; do
  run "$target" ANATOMY_SLOWDOWN="$target=$FACTOR"
done
echo "== total $((SECONDS - T0)) s"
python3 scripts/gate_check_summary.py "$BASELINE" "$THRESHOLD" "$OUT/gate_check.json" "${RUNS[@]}"
