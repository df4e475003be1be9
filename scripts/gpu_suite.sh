#!/usr/bin/env bash
# One batched GPU session: environment facts, then the gpu-marked claims, each report under $OUT.
# Usage (on the GPU machine, from the repo root): OUT=/some/dir bash scripts/gpu_suite.sh [extra pytest args]
set -uo pipefail
OUT=${OUT:-.anatomy/gpu}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
python3 - > "$OUT/env.json" <<'PY'
import json, subprocess, time, torch, triton
print(json.dumps(dict(date=time.strftime("%Y-%m-%d %H:%M:%S %Z"), gpu=torch.cuda.get_device_name(0),
    torch=torch.__version__, cuda=torch.version.cuda, triton=triton.__version__,
    cudnn=torch.backends.cudnn.version(),
    driver=subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                          capture_output=True, text=True).stdout.strip()), indent=1))
PY
cat "$OUT/env.json"
python3 -m pytest validations -m gpu -q -p no:cacheprovider --claims-report "$OUT/claims-gpu.json" "$@" 2>&1 | tee "$OUT/pytest-gpu.log"
