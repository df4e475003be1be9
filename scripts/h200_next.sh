#!/usr/bin/env bash
# The next H200 command: the measurements the calculator's claims are checked against, in one run
# under 10 minutes, most valuable first. Each part has its own timeout, capped by what is left of
# the run's budget; results land in $OUT/results.tar.gz, re-packed after every part, so a run cut
# short still returns what it made. docs/h200-notes.md says what each part settles.
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
  echo "   rc=$? $name $((SECONDS - t0)) s"; tail -2 "$R/$name.log"; pack
}
python3 scripts/env_json.py > "$R/env.json"; cat "$R/env.json"
# where the efficient model's backward peak differs from the walk on small configs (issue 4): the
# peak inside backward, with the raw snapshot for an offline replay
fx() {  # fx NAME CONFIG-FLAGS...
  local name=$1; shift
  part "forensics-$name" 40 python3 -m anatomy.cli forensics "$@" --variant efficient --optimizer none --device cuda \
    --peak-phase backward --png "$R/forensics-$name.png" --out "$R/forensics-$name.json" --snapshot "$R/snap-$name.pkl"
}
fx hyp31 --hidden 128 --layers 1 --heads 2 --kv-heads 1 --intermediate 256 --vocab 49999 --batch 4 --seq 2048
fx hyp23 --hidden 512 --layers 3 --heads 8 --kv-heads 8 --intermediate 192 --vocab 1000 --tie-embeddings --batch 4 --seq 256
fx tiny-gqa --hidden 256 --layers 2 --heads 8 --kv-heads 2 --intermediate 640 --vocab 5000 --batch 4 --seq 512
fx hyp10 --hidden 1024 --layers 2 --heads 8 --kv-heads 1 --intermediate 2432 --vocab 3128 --batch 1 --seq 128
fx seed-b4s1024 --preset seed --batch 4 --seq 1024
# this machine's profile, then per-component GPU and host time on named and drawn configs (issue 5)
part calibrate 60 python3 -m anatomy.cli calibrate --out "$R/h200.json" --budget-s 40
part probe-timing 150 python3 scripts/probe_timing.py --out "$R/probe_timing.json"
part probe-timing-hypothesis 120 python3 scripts/probe_timing.py --skip-named --hypothesis 32 --seed 2026 \
  --out "$R/probe_timing_hypothesis.json"
echo done
