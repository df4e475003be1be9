#!/usr/bin/env bash
# The next H200 command: the GPU suite and the records the calculator's claims are checked against,
# in one run under 10 minutes, most valuable first. Each part has its own timeout, capped by what is
# left of the run's budget; results land in $OUT/results.tar.gz, re-packed after every part, so a run
# cut short still returns what it made. docs/h200-notes.md says what each part settles.
#   run (device tool): python3 -m pip install ... .whl/*.whl && OUT=$OUT bash scripts/h200_next.sh
# The working tree is over the device tool's 64 MiB with reports/ (session 10 on); these parts need none of it,
# so leave it out of the copy first: git sparse-checkout set --no-cone '/*' '!/reports/' (after: disable).
set -uo pipefail
OUT=${OUT:-.anatomy/h200-next}
R=$OUT/r; mkdir -p "$R"; export R
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
END=$((SECONDS + ${BUDGET_S:-570}))
pack() { tar -czf "$OUT/results.tar.gz" -C "$OUT" r; }
part() {  # part NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2; local t0=$SECONDS left=$((END - SECONDS))
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi  # ONLY="a b": just those parts
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then echo "== $name skipped: the run's budget is spent"; return; fi
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  echo "   rc=$? $name $((SECONDS - t0)) s" | tee -a "$R/walltimes.txt"; tail -2 "$R/$name.log"; pack
}
python3 scripts/env_json.py > "$R/env.json"; cat "$R/env.json"
SPLIT="env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"
# peak memory under expandable segments (the claim's allocator setting), named and drawn configs (issue 4)
part probe-memory 90 $SPLIT python3 scripts/probe_memory.py --out "$R/probe_memory.json"
part probe-memory-hypothesis 90 $SPLIT python3 scripts/probe_memory.py --skip-named --hypothesis 32 --seed 2026 \
  --out "$R/probe_memory_hypothesis.json"
# the default allocator's named rows again, now with its requested_bytes counters beside each figure
part probe-memory-default 70 python3 scripts/probe_memory.py --out "$R/probe_memory_default.json"
part probe-memory-default-hypothesis 70 python3 scripts/probe_memory.py --skip-named --hypothesis 32 --seed 2026 \
  --out "$R/probe_memory_default_hypothesis.json"
# this machine's profile, then per-component timing: named configs and 40 drawn training-sized ones (issue 5)
# session 7 (issue 5): GEMMs in a loop, after a producer kernel and after idle, with clocks; the fused kernels'
# GPU-only time at the seed and wide shapes (issue 3's bandwidth targets)
part gemm-conditions 90 python3 scripts/probe_gemm_conditions.py --out "$R/gemm_conditions.json"
part tune-rms-norm 150 python3 scripts/tune_rms_norm.py --out "$R/tune_rms_norm.json"
part kernels-seed 60 python3 -m anatomy.kernels.bench --shape seed --json "$R/kernels-seed.json"
part kernels-wide 60 python3 -m anatomy.kernels.bench --shape wide --json "$R/kernels-wide.json"
part gpu-kernels 90 python3 -m pytest validations/test_kernels.py validations/test_efficient.py validations/test_fast_path.py -m gpu -q \
  -p no:cacheprovider --claims-report "$R/claims-kernels-gpu.json"
# session 8 (issues 5, 3): the fused ops' eager fast path against the custom-op route, same machine, same run
part step-fast-path 150 bash -c 'for pb in "seed 16" "seed 4"; do set -- $pb; for fp in 1 0; do
  ANATOMY_FAST_PATH=$fp python3 bench/step.py --preset "$1" --batch "$2" --peer efficient --repeats 20 \
    --json "$R/step-$1-B$2-fastpath$fp.json" || exit 1; done; done'
# session 8 (issue 5): how reproducible a host-bound step is; pinned threads and gc off against neither, twice
part host-noise 150 bash -c 'for i in 1 2; do python3 scripts/probe_host_noise.py --out "$R/host_noise_$i.json" || exit 1; done'
# (issue 5) the same host-bound step before and after one torch.profiler session in one process
part host-noise-profiler 60 python3 scripts/probe_host_noise.py --profiler --blocks 4 --out "$R/host_noise_profiler.json"
# session 9 (issue 5): a host-bound row at its size and at a tiny batch, Liger's host cost per chunk, ops on a busy GPU
part host-parts 180 python3 scripts/probe_host_parts.py --out "$R/host_parts.json"
# (issue 5) each probe_timing process also times calibrate's tiny host step before and after its rows (~6 s),
# and (session 10) beside each row, with up to 24 unmarked steps a short row: ~0.5 s a row more
part calibrate 130 python3 -m anatomy.cli calibrate --out "$R/h200.json" --budget-s 90
# session 11 (issue 5): host time against depth and Liger's chunk count, tiny and seed-sized, in one process
part host-depth 120 python3 scripts/probe_host_depth.py --out "$R/host_depth.json"
# (issue 5) the baseline's S x S ops as calibrate times them, after GEMMs, and inside their chain
part sxs-conditions 60 python3 scripts/probe_sxs_conditions.py --out "$R/sxs_conditions.json"
# (issue 5) cuDNN SDPA and a GEMM in bursts (calibrate's way), sustained and after GEMMs, with clocks
part sdpa-power 60 python3 scripts/probe_sdpa_power.py --out "$R/sdpa_power.json"
# whether host-bound steps slow down mid-row by the host or by the GPU clock (issue 5, session 12)
part host-regime 240 python3 scripts/probe_host_regime.py --out "$R/host_regime.json"
part probe-timing 85 python3 scripts/probe_timing.py --out "$R/probe_timing.json"
part probe-timing-training 290 python3 scripts/probe_timing.py --skip-named --hypothesis 40 --seed "${DRAW_SEED:-2026}" \
  --strategy training --out "$R/probe_timing_training.json"
part probe-timing-hypothesis 85 python3 scripts/probe_timing.py --skip-named --hypothesis 32 --seed "${DRAW_SEED:-2026}" \
  --out "$R/probe_timing_hypothesis.json"
# recompute="mlp" (issue 3): the step against HF + Liger in one run, per-phase memory, the GPU claims
part step-recompute 240 bash -c 'for pb in "seed 16" "anchor-1b 4"; do set -- $pb
  for peer in efficient "efficient --recompute mlp" hf-liger; do n=${peer/ --recompute mlp/-recompute}
    python3 bench/step.py --preset "$1" --batch "$2" --peer $peer --json "$R/step-$1-$n.json" || exit 1; done; done'
part probe-memory-recompute 120 $SPLIT python3 scripts/probe_memory.py --recompute mlp --hypothesis 16 --seed 2026 \
  --out "$R/probe_memory_recompute.json"
# (issue 4) recompute="mlp" out of sample: other drawn configs (seed 7), small and training-sized (session6b's rows)
part probe-memory-recompute-oos 120 bash -c '$0 python3 scripts/probe_memory.py --recompute mlp --skip-named --hypothesis 24 \
  --seed 7 --out "$R/probe_memory_recompute_oos.json" && $0 python3 scripts/probe_memory.py --recompute mlp --skip-named \
  --hypothesis 8 --seed 7 --strategy training --out "$R/probe_memory_recompute_oos_training.json"' "$SPLIT"
part gpu-recompute 90 $SPLIT python3 -m pytest validations/test_recompute.py validations/test_efficient.py -m gpu -q \
  -p no:cacheprovider --claims-report "$R/claims-recompute-gpu.json"
# the whole GPU suite on the final tree, with its claims report (issues 3, 4, 5)
part gpu-suite 150 $SPLIT env ANATOMY_GPU_PROFILE="$R/h200.json" python3 -m pytest validations -m gpu -q \
  -p no:cacheprovider --claims-report "$R/claims-gpu.json" --durations=15
echo done
