#!/usr/bin/env bash
# Installs efficient-llm-anatomy into the current Python environment.
# A machine that already has torch keeps it (a GPU user's CUDA build stays). A machine with none
# gets torch==2.13.0, which on CPU machines resolves to the local CPU wheel rather than a
# multi-GB CUDA build that a bare `torch` requirement would pull.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "install.sh: no torch found; installing torch==2.13.0" >&2
  "$PY" -m pip install -q "torch==2.13.0"
fi
"$PY" -m pip install -q -e ".[hf,train]"
