#!/usr/bin/env bash
# kvpress's leaderboard (python -m evals.leaderboard) for one of its models from a local HF folder,
# on one CUDA GPU: Qwen3-8B or Llama-3.1-8B-Instruct (any folder models/loading.load_hf reads).
# Every (task, mode) is an ordinary resumable evals.peer run, so a run cut short by a time limit
# continues where it stopped when started again; SHARD=i/n splits the tasks over n machines
# (then TABLE_ONLY=1 on the shared folder builds the tables).
#
#   bash scripts/setup.sh && bash scripts/gpu_leaderboard.sh /models/Qwen3-8B [SAMPLES] [evals.leaderboard keys...]
#   DRY_RUN=1 bash scripts/gpu_leaderboard.sh /tmp/tiny-hf 1 tasks=[niah_single_1] tokens=512 ...
#
# DRY_RUN=1: no GPU, no CUDA install, float32 (what tests/evals/test_leaderboard.py runs on a tiny
# HF folder). Expected time on one H100 (docs/guide/evals.md, "kvpress's leaderboard": measured by
# `python -m benchmarks.leaderboard_speed` on the models' shapes): see that page's table.
set -euo pipefail
cd "$(dirname "$0")/.."
folder=${1:?usage: bash scripts/gpu_leaderboard.sh HF_FOLDER [SAMPLES] [evals.leaderboard keys...]}
samples=${2:-50}
shift $(( $# < 2 ? $# : 2 ))
PY=${PY:-.venv/bin/python}
[[ -f $folder/config.json ]] || { echo "gpu_leaderboard: $folder has no config.json (an HF model folder)" >&2; exit 2; }
if [[ -z ${DRY_RUN:-} ]]; then
  if ! "$PY" -c "import jax, sys; sys.exit(jax.devices()[0].platform != 'gpu')" 2>/dev/null; then
    "$PY" -m pip install -q "jax[cuda12]==$("$PY" -c 'import jax; print(jax.__version__)')"
  fi
  "$PY" -c "import jax; print('devices:', jax.devices())"
  dtype=bfloat16
else
  dtype=float32
fi
keys=(model=hf "model_path=$folder" "dtype=$dtype" "samples=$samples" "out=${OUT:-results/leaderboard}")
[[ -n ${SHARD:-} ]] && keys+=("shard=$SHARD")
[[ -n ${TABLE_ONLY:-} ]] && keys+=(table_only=true)
exec "$PY" -m evals.leaderboard "${keys[@]}" "$@"
