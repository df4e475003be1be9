#!/usr/bin/env bash
# The H200 records the calculator's claims are checked against, in one run of under 10 minutes: this machine's
# profile (`anatomy calibrate`), the memory and timing probes, and the GPU suite with its claims report. Each
# part has its own time limit, capped by what is left of the run's budget (BUDGET_S, default 570 s); results
# land in $OUT/r and in $OUT/results.tar.gz, re-packed after every part, so a run cut short keeps what it made.
#   OUT=/some/dir bash scripts/gpu_records.sh            # every part
#   ONLY="calibrate probe-timing" bash scripts/gpu_records.sh   # just those parts
# DRAW_SEED picks the drawn configs of the timing probes (the committed rows: 113). Where each output is
# committed: llm_anatomy/records.py (the profile at llm_anatomy/calculator/profiles/h200.json, the rows under reports/h200/).
set -uo pipefail
OUT=${OUT:-.anatomy/gpu-records}
R=$OUT/r; mkdir -p "$R"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
END=$((SECONDS + ${BUDGET_S:-570}))
SEED=${DRAW_SEED:-113}
pack() { tar -czf "$OUT/results.tar.gz" -C "$OUT" r; }
part() {  # part NAME SECONDS CMD...
  local name=$1 limit=$2; shift 2; local t0=$SECONDS left=$((END - SECONDS))
  if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return; fi
  [ "$left" -lt "$limit" ] && limit=$left
  if [ "$limit" -le 5 ]; then echo "== $name skipped: the run's budget is spent"; return; fi
  echo "== $name (limit ${limit}s)"
  timeout "$limit" "$@" > "$R/$name.log" 2>&1
  echo "   rc=$? $name $((SECONDS - t0)) s" | tee -a "$R/walltimes.txt"; tail -2 "$R/$name.log"; pack
}
if ! python3 -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "gpu_records: error: needs a CUDA GPU; this machine has none" >&2
  exit 2
fi
python3 -m scripts.env_json > "$R/env.json"; cat "$R/env.json"
SPLIT="env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True"  # the memory claims' allocator setting
# phase memory, named and drawn configs, under expandable segments and under the default allocator
part probe-memory 90 $SPLIT python3 -m scripts.probe_memory --out "$R/probe_memory.json"
part probe-memory-hypothesis 90 $SPLIT python3 -m scripts.probe_memory --skip-named --hypothesis 32 --seed 2026 \
  --out "$R/probe_memory_hypothesis.json"
part probe-memory-default 70 python3 -m scripts.probe_memory --out "$R/probe_memory_default.json"
part probe-memory-default-hypothesis 70 python3 -m scripts.probe_memory --skip-named --hypothesis 32 --seed 2026 \
  --out "$R/probe_memory_default_hypothesis.json"
# phase memory under Run.recompute="mlp": named and drawn, and two out-of-sample draws
part probe-memory-recompute 120 $SPLIT python3 -m scripts.probe_memory --recompute mlp --hypothesis 16 --seed 2026 \
  --out "$R/probe_memory_recompute.json"
part probe-memory-recompute-oos 120 bash -c '$0 python3 -m scripts.probe_memory --recompute mlp --skip-named --hypothesis 24 \
  --seed 7 --out "$1/probe_memory_recompute_oos.json" && $0 python3 -m scripts.probe_memory --recompute mlp --skip-named \
  --hypothesis 8 --seed 7 --strategy training --out "$1/probe_memory_recompute_oos_training.json"' "$SPLIT" "$R"
# this machine's profile, then the timing probes against it (same process order as the committed rows)
part calibrate 130 python3 -m llm_anatomy.cli calibrate --out "$R/h200.json" --budget-s 90
part probe-timing 85 python3 -m scripts.probe_timing --out "$R/probe_timing.json"
part probe-timing-training 290 python3 -m scripts.probe_timing --skip-named --hypothesis 40 --seed "$SEED" \
  --strategy training --out "$R/probe_timing_training.json"
part probe-timing-hypothesis 85 python3 -m scripts.probe_timing --skip-named --hypothesis 32 --seed "$SEED" \
  --out "$R/probe_timing_hypothesis.json"
# the whole GPU suite against this run's profile, with its claims report (reports/h200/claims-gpu.json)
part gpu-suite 300 $SPLIT env ANATOMY_GPU_PROFILE="$R/h200.json" python3 -m pytest validations -m gpu -q \
  -p no:cacheprovider --claims-report "$R/claims-gpu.json" --durations=15
# the open issues' records, each run on its own (ONLY=...): the plan's boundary on real configs (issue 23), the
# new loss's memory (issue 26), the user's loop at real depth, drawn with a new seed (issue 24), and the peers
# (issue 26); each lands where llm_anatomy/records.py names it
PLAN_MODELS=${PLAN_MODELS:-Llama-3.1-8B,Qwen2.5-0.5B,Qwen2.5-7B,Llama-3.2-1B,Mistral-7B-v0.1,Qwen2.5-1.5B,SmolLM2-1.7B,Llama-3.2-3B,TinyLlama-1.1B-intermediate-step-1431k-3T}
if [ -n "${ONLY:-}" ]; then
  part plan-check 560 $SPLIT python3 -m scripts.check_plan --out "$R/plan-check.json" --only "$PLAN_MODELS"
  part loss-memory 150 python3 -m bench.loss_memory --out "$R/loss-memory"
  # REAL_DEPTH_SEED: a new seed, chosen after the timing model's last change (the draw is out of sample)
  part real-depth 420 bash -c '[ -n "$1" ] || { echo "set REAL_DEPTH_SEED" >&2; exit 2; }
    ANATOMY_DRAW_SEED=$1 python3 -m scripts.probe_timing --user-loop --real-depth 30 --presets --calibrate \
      --out "$0/real-depth.json"' "$R" "${REAL_DEPTH_SEED:-}"
  part peers 540 bash -c 'for c in "seed 16 4096" "tinyllama-1.1b 8 2048" "llama3.2-1b 4 4096"; do set -- $c
    for peer in "efficient" "efficient --lean" "hf-liger" "hf-compile"; do
      python3 -m bench.step --peer $peer --preset $1 --batch $2 --seq $3 \
        --json "$0/step-$1-$(echo $peer | tr -d " " | sed "s/--/-/").json" || true
    done; done' "$R"
  # where the efficient step's GPU time goes, and where the GPU idles, at the seed and the two real configs,
  # plain and lean (issue 26's speed goals; the seed lean step's known miss)
  part profile-real 330 bash -c 'for c in "seed 16 4096" "tinyllama-1.1b 8 2048" "llama3.2-1b 4 4096"; do set -- $c
    for lean in "" "--lean"; do
      python3 -m bench.profile_step --peer efficient $lean --preset $1 --batch $2 --seq $3 \
        --json "$0/profile-$1-efficient${lean:+-lean}.json" || true
    done; done' "$R"
  # the lean block's phase memory (its CUDA backward differs from the CPU one: lean.fp32_grad), named and drawn
  # training-sized configs, efficient only (validations/test_memory_model.py; records.MEMORY_PROBE_LEAN)
  part probe-memory-lean 150 $SPLIT bash -c 'python3 -m scripts.probe_memory --lean --out "$0/lean-named.json" &&
    python3 -m scripts.probe_memory --lean --skip-named --hypothesis 8 --seed 7 --strategy training \
      --out "$0/lean-drawn-training.json"' "$R"
  # the lean step and HF + Liger's, profiled by kernel family at the two real configs (docs/peers.md: where the
  # time goes in each)
  part profile-peers 200 bash -c 'for c in "tinyllama-1.1b 8 2048" "llama3.2-1b 4 4096"; do set -- $c
    python3 -m bench.profile_step --peer efficient --lean --preset $1 --batch $2 --seq $3 \
      --json "$0/profile-$1-efficient-lean.json" || true
    python3 -m bench.profile_step --peer hf-liger --preset $1 --batch $2 --seq $3 \
      --json "$0/profile-$1-hf-liger.json" || true; done' "$R"
  # the lean step and HF + Liger's run back to back at the two real configs: sustained step time, SM clock, board
  # power and energy per step (README "power-peers"; docs/peers.md: the lead at the power limit is in energy)
  part power-peers 200 bash -c 'for c in "tinyllama-1.1b 8 2048" "llama3.2-1b 4 4096"; do set -- $c
    python3 -m bench.step_power --peer efficient --lean --preset $1 --batch $2 --seq $3 \
      --json "$0/power-$1-efficient-lean.json" || true
    python3 -m bench.step_power --peer hf-liger --preset $1 --batch $2 --seq $3 \
      --json "$0/power-$1-hf-liger.json" || true; done' "$R"
  # the compiled AdEMAMix step: how long the GPU waits for its call (issue 25's one failed claim; docs/timing.md)
  part optimizer-host 200 python3 -m scripts.probe_optimizer_host --json "$R/optimizer-host.json"
  # the fused CE's parts, with backward's scale kernel and the row kernel at each block width, and 8,192-row
  # chunks beside the rule's 4,096 (half the grad_w accumulation passes for 1 GiB more logits; issue 26)
  part linear-ce 300 python3 -m bench.linear_ce --chunks 0,8192 --breakdown --row-blocks 0,4096,8192,16384,32768 \
    --json "$R/linear-ce.json"
  # the CE over vocabularies that are not a multiple of 8 (GPT-2's; the live real-depth case's), as is and with
  # the vocabulary padded (align 8, 64): the misaligned GEMM rates against the aligned ones (docs/peers.md)
  part linear-ce-align 150 python3 -m bench.linear_ce --shapes 16384x2048x50257,16384x3072x108812 --aligns 1,8,64 \
    --json "$R/linear-ce-align.json"
  # each kernel class's own sustained load, its settled SM clock and board power (the sustained regime's
  # miss on real-depth steps: power, not length, sets the clock; docs/timing.md)
  part power 60 python3 -m scripts.probe_power --out "$R/power.json"
fi
echo done
