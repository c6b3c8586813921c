#!/usr/bin/env bash
# GPU placement check (< 5 min on one GPU): full preload vs chunked vs a plain DataLoader.
# Usage: benchmarks/gpu_check.sh [--device cpu] [--json out.json] [...]  (see gpu_check.py --help)
# On a machine without CUDA it runs on the CPU and skips the CUDA-only measurements.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec timeout 290 "$PY" benchmarks/gpu_check.py "$@"
