#!/usr/bin/env bash
# The long-context tables of issues 10 and 11 that 2 CPU cores cannot afford, for a machine with
# a CUDA GPU (written for one H200; NOT RUN yet: no GPU was lent to the sessions that wrote it).
# Every job is an ordinary resumable evals.run row of $RESULTS, so a run cut short by a time limit
# continues where it stopped when started again.
#
#   bash scripts/setup.sh test && bash scripts/gpu_long_context.sh [4k|32k|all]
#
# Expected cost on CPU, for comparison: one 4K Qwen2.5-0.5B prompt is ~50 s of prefill on 2 cores,
# one 8K ~100 s, one 32K ~10+ min per policy.
set -euo pipefail
cd "$(dirname "$0")/.."
what=${1:-all}
RESULTS=${RESULTS:-results/gpu_long_context.jsonl}
PY=.venv/bin/python
"$PY" -m pip install -q "jax[cuda12]==$("$PY" -c 'import jax; print(jax.__version__)')"
"$PY" -c "import jax; print('devices:', jax.devices())"

common=(model=qwen results="$RESULTS" progress=true)
if [[ $what == 4k || $what == all ]]; then
  # issue 10: full cache, NIAH single at 4K and 8K over depths; the depth x length heatmap
  "$PY" -m evals.run task=ruler_niah_heatmap policy=full "${common[@]}"
  "$PY" -m evals.run task=ruler_niah_heatmap policy=snapkv budget=0.25 "${common[@]}"
  # issue 10: perplexity of 16K tokens of the essays (past SmolLM2's 8K) stays flat
  "$PY" -m evals.run task=perplexity data=pg tokens=16384 policy=full "${common[@]}"
  # issues 10 and 11: the RULER-style average at 4K, both protocols, 10 trials per cell
  for protocol in query_aware query_agnostic; do
    "$PY" -m evals.suite tasks=ruler "task.lengths=[4096]" task.trials=10 task.protocol=$protocol \
      "policies=[sink,snapkv,h2o,adakv,pyramidkv,kvzip,knorm,random,observed,expected]" "budgets=[0.25,0.5]" \
      "extra=[quest,kivi]" "${common[@]}"
  done
fi
if [[ $what == 32k || $what == all ]]; then
  "$PY" -m evals.suite tasks=ruler_32k task.trials=10 "policies=[sink,snapkv]" "budgets=[0.25]" "${common[@]}"
fi
