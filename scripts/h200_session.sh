#!/usr/bin/env bash
# One batched H200 session: GPU claims, probes, kernel and step benchmarks. Everything lands in
# $OUT/results.tar.gz (re-packed after each part, so a cut-short run still returns what it made).
set -uo pipefail
OUT=${OUT:-.anatomy/h200}
R=$OUT/r; mkdir -p "$R"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
pack() { tar -czf "$OUT/results.tar.gz" -C "$OUT" r; }
part() { local name=$1; shift; local t0=$SECONDS; echo "== $name"; "$@" > "$R/$name.log" 2>&1; echo "   rc=$? ${name} $((SECONDS - t0)) s"; tail -4 "$R/$name.log"; pack; }
python3 scripts/env_json.py > "$R/env.json"; cat "$R/env.json"
part pytest-gpu python3 -m pytest validations -m gpu -q -p no:cacheprovider --timeout 240 --ignore=validations/test_distributed.py --ignore=validations/test_train.py --claims-report "$R/claims-gpu.json"
for peer in efficient hf-liger hf baseline; do
  part "step-seed-$peer" python3 bench/step.py --peer $peer --json "$R/step-seed-$peer.json"
done
part kernels-seed python3 bench/kernels.py --json "$R/kernels-seed.json"
part probe-sdpa bash -c "python3 scripts/probe_sdpa.py > $R/probe_sdpa.json"
part probe-memory python3 scripts/probe_memory.py --hypothesis 32 --seed 2026 --out "$R/probe_memory_hypothesis.json"
for peer in efficient hf-liger; do
  part "step-1b-$peer" python3 bench/step.py --peer $peer --preset anchor-1b --batch 4 --json "$R/step-1b-$peer.json"
done
part step-seed-baseline-compile python3 bench/step.py --peer baseline-compile --json "$R/step-seed-baseline-compile.json"
echo done
