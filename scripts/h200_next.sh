#!/usr/bin/env bash
# The next H200 session's open GPU work as one command (under 10 minutes), most valuable first, each
# part under its own timeout. Results land in $OUT/results.tar.gz, re-packed after every part, so a
# run cut short still returns what it made. docs/h200-notes.md says what each part settles.
#   run (device tool): python3 -m pip install ... .whl/*.whl && OUT=$OUT bash scripts/h200_next.sh
set -uo pipefail
OUT=${OUT:-.anatomy/h200-next}
R=$OUT/r; mkdir -p "$R"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
pack() { tar -czf "$OUT/results.tar.gz" -C "$OUT" r; }
part() {  # part NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2; local t0=$SECONDS
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  echo "   rc=$? $name $((SECONDS - t0)) s"; tail -3 "$R/$name.log"; pack
}
python3 scripts/env_json.py > "$R/env.json"; cat "$R/env.json"
# 0. where the efficient seed step's time goes (issues 3 and 5)
part profile-seed-efficient 90 python3 bench/profile_step.py --peer efficient --json "$R/profile-seed-efficient.json"
# 1. peak memory (issue 4): the CUDA attention hypothesis and the efficient model's fixed ~11 MiB
part forensics-seed-b2s4096-baseline 90 python3 -m anatomy.cli forensics --preset seed --batch 2 --seq 4096 \
  --variant baseline --optimizer none --device cuda --png "$R/forensics-seed-b2s4096-baseline.png" \
  --out "$R/forensics-seed-b2s4096-baseline.json"
part forensics-seed-b4s1024-efficient 60 python3 -m anatomy.cli forensics --preset seed --batch 4 --seq 1024 \
  --variant efficient --optimizer none --device cuda --png "$R/forensics-seed-b4s1024-efficient.png" \
  --out "$R/forensics-seed-b4s1024-efficient.json"
# 2. ±3% on drawn configs (issue 4): rows are written as they finish
part probe-memory-hypothesis 120 python3 scripts/probe_memory.py --skip-named --hypothesis 32 --seed 2026 \
  --out "$R/probe_memory_hypothesis.json"
# 3. the timing model's measured profile (issue 5)
part calibrate 130 python3 -m anatomy.cli calibrate --out "$R/h200.json" --budget-s 100
echo done
