#!/usr/bin/env bash
# The benchmark regression gate, shown end to end on one GPU (about two minutes; docs/benchmarks.md):
#   1. record a baseline of the seed-step benchmarks (--benchmark-json), and pick the gated ones
#      (scripts/gate_select.py: GPU-bound rounds, IQR <= 5% of the median);
#   2. re-run those with ANATOMY_BENCH_SLOWDOWN=attention:1.2 (a calibrated 20% slowdown of the
#      attention benchmarks, injected by validations/test_benchmarks.py only): the gate must FAIL,
#      on attention benchmarks only;
#   3. re-run them unmodified: the gate must PASS.
# Usage, from the repo root on a CUDA machine:  bash scripts/bench_gate_demo.sh [extra pytest args]
# DIR (default .anatomy/bench-gate-demo) receives the JSON reports and logs. Exit 0 when the gate
# behaved as described, 1 when it did not, 2 without a GPU.
set -uo pipefail
DIR=${DIR:-.anatomy/bench-gate-demo}
SELECT=${SELECT:-gpu and slow}                # the seed step, B=16 S=4096
SLOWDOWN=${SLOWDOWN:-attention:1.2}
COMP=${SLOWDOWN%%:*}; [ "$COMP" = rms_norm ] && COMP=norm; [ "$COMP" = swiglu ] && COMP=mlp
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
unset ANATOMY_BENCH_SLOWDOWN

if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "bench_gate_demo: error: needs a CUDA GPU; this machine has none" >&2
  exit 2
fi
mkdir -p "$DIR"
PYTEST=(python3 -m pytest -q -p no:cacheprovider --benchmark-enable --benchmark-columns=min,median,iqr,rounds
        --benchmark-sort=name "$@")
GATE=(--benchmark-compare="$DIR/baseline.json" --benchmark-compare-fail=median:10%)

echo "== 1. record the baseline -> $DIR/baseline.json"
"${PYTEST[@]}" validations/test_benchmarks.py -m "$SELECT" --benchmark-json="$DIR/baseline.json" \
  > "$DIR/1-record.log" 2>&1
rc=$?; tail -1 "$DIR/1-record.log"
if [ $rc -ne 0 ]; then echo "bench_gate_demo: recording failed (rc=$rc); see $DIR/1-record.log" >&2; exit 1; fi
mapfile -t IDS < <(python3 scripts/gate_select.py "$DIR/baseline.json")
printf '%s\n' "${IDS[@]}" > "$DIR/gated.txt"
echo "   ${#IDS[@]} benchmarks gated ($DIR/gated.txt); $(grep -c "/$COMP/" "$DIR/gated.txt") of them $COMP"

echo "== 2. ANATOMY_BENCH_SLOWDOWN=$SLOWDOWN: the gate must fail"
ANATOMY_BENCH_SLOWDOWN=$SLOWDOWN "${PYTEST[@]}" "${IDS[@]}" "${GATE[@]}" --benchmark-json="$DIR/slowed.json" \
  > "$DIR/2-slowed.log" 2>&1
slowed=$?
sed -n '/Performance has regressed:/,/^-\{10,\}/p' "$DIR/2-slowed.log"
echo "   rc=$slowed"

echo "== 3. unmodified: the gate must pass"
"${PYTEST[@]}" "${IDS[@]}" "${GATE[@]}" --benchmark-json="$DIR/unmodified.json" > "$DIR/3-unmodified.log" 2>&1
same=$?
sed -n '/Performance has regressed:/,/^-\{10,\}/p' "$DIR/3-unmodified.log"
tail -1 "$DIR/3-unmodified.log"
echo "   rc=$same"

# the slowed run must fail through the gate (not through a broken test), and name only $COMP benchmarks
regressed=$(sed -n '/Performance has regressed:/,/^-\{10,\}/p' "$DIR/2-slowed.log" | grep -c "has failed" || true)
others=$(sed -n '/Performance has regressed:/,/^-\{10,\}/p' "$DIR/2-slowed.log" | grep "has failed" \
  | grep -vc "/$COMP/" || true)
if [ $slowed -ne 0 ] && [ "$regressed" -gt 0 ] && [ "$others" -eq 0 ] && [ $same -eq 0 ]; then
  echo "gate OK: $regressed $COMP benchmark(s) failed at +20%, nothing else; the unmodified run passed"
  exit 0
fi
echo "gate NOT as expected: slowed rc=$slowed ($regressed regressed, $others not $COMP), unmodified rc=$same" >&2
exit 1
