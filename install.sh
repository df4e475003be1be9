#!/usr/bin/env bash
# Installs efficient-llm-anatomy into the current Python environment from the lock (requirements.lock).
#   bash install.sh            the locked set: what the CPU suite is tested on (default)
#   bash install.sh --latest   the newest releases pyproject.toml's bounds allow (torch kept as installed)
#   bash install.sh --relock   rewrite requirements.lock from pyproject.toml and this environment's versions
# torch and triton come first and are not in the lock: a machine that has torch keeps its build (a GPU user's
# CUDA torch and the triton it was built with stay); one with none gets torch==2.13.0, which on CPU machines
# resolves to the local CPU wheel rather than the multi-GB CUDA build a bare `torch` requirement pulls.
set -euo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python3}
MODE=${1:-locked}
case "$MODE" in locked|--latest|--relock) ;; *) echo "install.sh: unknown option $MODE (--latest, --relock)" >&2; exit 2;; esac
PIP=("$PY" -m pip install -q --disable-pip-version-check)
if ! "$PY" -c "import torch" 2>/dev/null; then
  echo "install.sh: no torch found; installing torch==2.13.0 and triton==3.9.0" >&2
  "${PIP[@]}" "torch==2.13.0" "triton==3.9.0"
fi
TORCH=$("$PY" -c "import torch; print(torch.__version__.split('+')[0])" 2>/dev/null)
case "$MODE" in
  locked)
    "${PIP[@]}" --no-deps --require-hashes -r requirements.lock
    "${PIP[@]}" --no-deps --no-build-isolation -e .
    ;;
  --latest)
    # torch pinned to the installed release: its newer builds are CUDA ones of several GB
    "${PIP[@]}" --upgrade --upgrade-strategy eager -e ".[hf,train]" "torch==$TORCH"
    ;;
  --relock)
    "${PIP[@]}" "uv>=0.9"
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    "$PY" -m pip list --format=freeze | grep -viE '^(torch|triton|efficient-llm-anatomy|uv|nvidia-|cuda-)' > "$tmp/c.txt"
    echo "torch==$TORCH" >> "$tmp/c.txt"
    "$PY" -m uv pip compile pyproject.toml --extra hf --extra train --universal --python-version 3.11 \
      --generate-hashes --no-header -c "$tmp/c.txt" -o "$tmp/full.txt" -q
    "$PY" -m scripts.relock "$tmp/full.txt" requirements.lock
    ;;
esac
"$PY" -m pip check >&2 || echo "install.sh: pip check found the inconsistencies above" >&2
