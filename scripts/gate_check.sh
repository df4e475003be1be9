#!/usr/bin/env bash
# The regression gate's own check, on one CUDA machine, from the repo root:
#   0. the GPU's facts to $WORK/env.json (scripts/env_json.py); without a GPU-time baseline (BASELINE, default
#      the committed baselines.json), or with RECORD=1, record one first: $WORK/baseline.json;
#   1. "unmodified": the benchmarks against the baseline; nothing may fail;
#   2. once per slowdown target (validations/slowdown.py), ANATOMY_SLOWDOWN=<target>=<1 + 1.5 x threshold>:
#      every benchmark of the target's own must fail, and no benchmark whose work never called it.
# Each run is the design card's gate (--benchmark-compare=BASELINE --benchmark-compare-fail=median:X%) over
# the benchmark tests; scripts/gate_check_summary.py then writes $WORK/gate_check.json over every run in $WORK.
#
#   bash scripts/gate_check.sh                               # THRESHOLD=5 (%), unmodified + every target
#   RUNS="gpt_oss rope_qkv" bash scripts/gate_check.sh       # more runs into the same $WORK, summary over all
#   THRESHOLD=4 RUNS="unmodified rms_norm" bash scripts/gate_check.sh -m "gpu and not slow"
#
# Env: WORK (default .anatomy/gate-check: baseline, reports, logs; kept between calls on one machine), OUT
# (if set, everything in WORK is copied there after each run), BASELINE (default: baselines.json when it is
# on GPU time, else $WORK/baseline.json, recorded when missing or with RECORD=1), THRESHOLD (percent,
# default 5), FACTOR (default 1 + 1.5 x THRESHOLD / 100), RUNS (default: unmodified and every target),
# DEADLINE_S (default 560: no run starts that the last run's duration says would end after it), SELECT (the
# test files, default every benchmark test).
# Extra arguments go to every pytest run (default -m gpu). Exit 0 when every run in WORK behaved,
# 1 when one did not or runs were left for another call, 2 without a GPU.
set -uo pipefail
WORK=${WORK:-.anatomy/gate-check}
THRESHOLD=${THRESHOLD:-5}
FACTOR=${FACTOR:-$(python3 -c "print(round(1 + 1.5 * $THRESHOLD / 100, 6))")}
ALL_TARGETS="rms_norm swiglu gpt_oss rope_qkv linear_ce attention adamw fused_ademamix"
RUNS=${RUNS:-unmodified $ALL_TARGETS}
DEADLINE_S=${DEADLINE_S:-560}
read -r -a SELECT <<< "${SELECT:-validations/test_bench_kernels.py validations/test_benchmarks.py validations/test_optim.py::test_step_bandwidth}"
ARGS=("$@"); [ ${#ARGS[@]} -eq 0 ] && ARGS=(-m gpu)
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1 PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True
unset ANATOMY_SLOWDOWN

if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gate_check: error: needs a CUDA GPU; this machine has none" >&2
  exit 2
fi
mkdir -p "$WORK"
python3 -m scripts.env_json > "$WORK/env.json" 2>/dev/null || { rm -f "$WORK/env.json"; echo "gate_check: warning: no env.json (scripts/env_json.py failed)" >&2; }
PYTEST=(python3 -m pytest "${SELECT[@]}" -q -p no:cacheprovider --benchmark-enable
        --benchmark-columns=median,iqr,rounds --benchmark-sort=fullname "${ARGS[@]}")
T0=$SECONDS; last=0
publish() { [ -n "${OUT:-}" ] && mkdir -p "$OUT" && cp -r "$WORK"/. "$OUT"/ ; true; }

on_gpu_time() {  # does every benchmark of $1 carry the gpu_time timer?
  python3 - "$1" <<'PY' 2>/dev/null
import json, sys
b = json.load(open(sys.argv[1]))["benchmarks"]
sys.exit(0 if b and all(x["options"].get("timer") == "gpu_time" for x in b) else 1)
PY
}

if [ -z "${BASELINE:-}" ]; then
  if on_gpu_time baselines.json && [ "${RECORD:-0}" != 1 ]; then BASELINE=baselines.json
  else BASELINE=$WORK/baseline.json; fi
fi
if [ "${RECORD:-0}" = 1 ] || ! on_gpu_time "$BASELINE"; then
  BASELINE=$WORK/baseline.json
  echo "== record: no GPU-time baseline (or RECORD=1): recording $BASELINE"
  t=$SECONDS
  "${PYTEST[@]}" --benchmark-json="$BASELINE" > "$WORK/record.log" 2>&1
  rc=$?; last=$((SECONDS - t)); tail -1 "$WORK/record.log"; echo "   rc=$rc, $last s"
  publish
  [ $rc -ne 0 ] && { echo "gate_check: recording failed; see $WORK/record.log" >&2; exit 1; }
fi
GATE=(--benchmark-compare="$BASELINE" --benchmark-compare-fail=median:${THRESHOLD}%)
echo "== gate: median:${THRESHOLD}% against $BASELINE; slowdown factor $FACTOR; runs: $RUNS"

left=()
for name in $RUNS; do
  if [ $((SECONDS - T0 + last)) -gt "$DEADLINE_S" ]; then left+=("$name"); continue; fi
  case " unmodified $ALL_TARGETS " in *" $name "*) ;; *) echo "gate_check: error: unknown run $name" >&2; exit 2;; esac
  slow=(); [ "$name" != unmodified ] && slow=(ANATOMY_SLOWDOWN="$name=$FACTOR")
  t=$SECONDS
  env "${slow[@]}" "${PYTEST[@]}" "${GATE[@]}" --benchmark-json="$WORK/$name.json" --junitxml="$WORK/$name.xml" \
    > "$WORK/$name.log" 2>&1
  rc=$?; last=$((SECONDS - t))
  echo $rc > "$WORK/$name.rc"
  printf '== %-15s rc=%d %4d s  %s %s\n' "$name" $rc $last "$(grep -E '(passed|failed|error).* in [0-9.]+s' "$WORK/$name.log" | tail -1)" \
    "$(grep -o "[0-9]* of [0-9]* benchmarks failed" "$WORK/$name.log" | tail -1 | sed 's/$/ the gate/')"
  [ -f "$WORK/$name.json" ] || echo "   no report: see $WORK/$name.log" >&2
  publish
done
echo "== $((SECONDS - T0)) s${left:+; left for another call (the deadline): RUNS=\"${left[*]}\"}"

SPECS=()
for name in unmodified $ALL_TARGETS; do
  [ -f "$WORK/$name.rc" ] || continue
  xml=""; [ -f "$WORK/$name.xml" ] && xml=":$WORK/$name.xml"
  if [ -f "$WORK/$name.json" ]; then SPECS+=("$name=$WORK/$name.json:$(cat "$WORK/$name.rc")$xml")
  else SPECS+=("$name=:$(cat "$WORK/$name.rc")$xml"); fi
done
python3 -m scripts.gate_check_summary "$BASELINE" "$THRESHOLD" "$WORK/gate_check.json" "${SPECS[@]}"
rc=$?
publish
[ ${#left[@]} -gt 0 ] && exit 1
exit $rc
