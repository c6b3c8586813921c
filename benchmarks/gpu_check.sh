#!/usr/bin/env bash
# GPU check (< 5 min on one GPU): ResNet-18 (CIFAR-sized) and ResNet-50 (128 px) in bf16-mixed
# through Lightning with a plain DataLoader (best workers; 2 workers) vs the device and chunked
# strategies; the chunked source's bandwidth against the pinned copy; the demo. One JSON:
# benchmarks/results/gpu_check_<gpu>.json, and a printed table with the issue's targets.
# Usage: benchmarks/gpu_check.sh [--quick] [--device cpu] [--sections training,bandwidth,demo] [--json PATH]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# A guard, not the budget: the script reports its own total time against the 5 minutes.
exec timeout 900 "$PY" benchmarks/gpu_check.py "$@"
