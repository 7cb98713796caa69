#!/usr/bin/env bash
# The H200 check of the performance issue (benchmarks.gpu) on a machine that installs nothing: its
# own python3 with JAX for CUDA, this checkout on PYTHONPATH. Where the model packages are missing
# (nothing can be fetched there, and a run carries at most 64 MiB), benchmarks.gpu measures the
# models' shapes with random weights and says so in its rows. NOT RUN yet: no GPU was lent.
#
#   bash scripts/gpu_check.sh [OUT_DIR [benchmarks.gpu options]]   rows in OUT_DIR/gpu.jsonl as
#                                                                   measured, the log beside
#
# BUDGET_S (default 420) bounds benchmarks.gpu (--budget-s): a 10-minute command limit leaves room
# for the machine's start and JAX's first CUDA initialisation.
set -uo pipefail
cd "$(dirname "$0")/.."
out=${1:-${OUT:-results}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PY:-python3}
"$PY" -c "import jax, jaxlib; print('jax', jax.__version__, 'jaxlib', jaxlib.__version__, jax.devices())" 2>&1 \
  | tee "$out/gpu.log"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv 2>&1 | tee -a "$out/gpu.log" || true
"$PY" -m benchmarks.gpu --out "$out/gpu.jsonl" --budget-s "${BUDGET_S:-420}" "${@:2}" 2>&1 | tee -a "$out/gpu.log"
