#!/usr/bin/env bash
# The next H200 command: the GPU suite and the records the calculator's claims are checked against,
# in one run under 10 minutes, most valuable first. Each part has its own timeout, capped by what is
# left of the run's budget; results land in $OUT/results.tar.gz, re-packed after every part, so a run
# cut short still returns what it made. docs/h200-notes.md says what each part settles.
#   run (device tool): python3 -m pip install ... .whl/*.whl && OUT=$OUT bash scripts/h200_next.sh
set -uo pipefail
OUT=${OUT:-.anatomy/h200-next}
R=$OUT/r; mkdir -p "$R"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
END=$((SECONDS + ${BUDGET_S:-570}))
pack() { tar -czf "$OUT/results.tar.gz" -C "$OUT" r; }
part() {  # part NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2; local t0=$SECONDS left=$((END - SECONDS))
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then echo "== $name skipped: the run's budget is spent"; return; fi
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  echo "   rc=$? $name $((SECONDS - t0)) s" | tee -a "$R/walltimes.txt"; tail -2 "$R/$name.log"; pack
}
python3 scripts/env_json.py > "$R/env.json"; cat "$R/env.json"
# the regression gate on the seed step's GPU-bound benchmarks: a 20% attention slowdown fails,
# the unmodified tree passes (issue 4)
part gate-demo 240 env DIR="$R/gate" bash scripts/bench_gate_demo.sh
# the two drawn configs whose allocator-trace peaks the walk misses: snapshots for an offline replay
fx() {  # fx NAME PEAK-PHASE CONFIG-FLAGS...
  local name=$1 phase=$2; shift 2
  part "forensics-$name" 40 python3 -m anatomy.cli forensics "$@" --variant efficient --optimizer none --device cuda \
    --peak-phase "$phase" --png "$R/forensics-$name.png" --out "$R/forensics-$name.json" --snapshot "$R/snap-$name.pkl"
}
fx hyp16-forward forward --hidden 1024 --layers 1 --heads 8 --kv-heads 1 --intermediate 128 --vocab 1000 --batch 1 --seq 128
fx hyp22-backward backward --hidden 512 --layers 3 --heads 8 --kv-heads 8 --intermediate 192 --vocab 9480 \
  --tie-embeddings --batch 4 --seq 256
echo done
