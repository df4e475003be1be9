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
# where the efficient seed step's time goes, and this machine's profile (issues 3, 5)
part profile-seed-efficient 60 python3 bench/profile_step.py --peer efficient --json "$R/profile-seed-efficient.json" \
  --trace "$R/trace-seed-efficient.json.gz"
part calibrate 60 python3 -m anatomy.cli calibrate --out "$R/h200.json" --budget-s 40
# per-component time on named and drawn configs (issue 5)
part probe-timing 150 python3 scripts/probe_timing.py --out "$R/probe_timing.json"
part probe-timing-hypothesis 120 python3 scripts/probe_timing.py --skip-named --hypothesis 32 --seed 2026 \
  --out "$R/probe_timing_hypothesis.json"
# peak memory with this tree's MLP (issue 4)
part probe-memory 60 python3 scripts/probe_memory.py --out "$R/probe_memory.json"
part probe-memory-hypothesis 60 python3 scripts/probe_memory.py --skip-named --hypothesis 32 --seed 2026 \
  --out "$R/probe_memory_hypothesis.json"
# the peers, one process each, in one session (issue 3)
for peer in efficient hf-liger hf efficient-compile; do
  part "step-seed-$peer" 60 python3 bench/step.py --peer "$peer" --json "$R/step-seed-$peer.json"
done
for peer in efficient hf-liger; do
  part "step-1b-$peer" 60 python3 bench/step.py --peer "$peer" --preset anchor-1b --batch 4 --json "$R/step-1b-$peer.json"
done
echo done
