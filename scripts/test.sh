#!/usr/bin/env bash
# Set up (with test extras) and run the whole test suite.
#   bash scripts/test.sh            the whole suite, in two pytest runs (below)
#   bash scripts/test.sh ARGS...    one pytest run with your arguments (e.g. -m "not slow", -k kvzip)
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
PYTEST=(.venv/bin/python -m pytest -q -p no:cacheprovider)
if [ "$#" -gt 0 ]; then
  exec "${PYTEST[@]}" "$@"
fi
# The unit tests (not `slow`) are dominated by XLA compiling many small steps (about 70 % of a
# tests/kvpolicies/test_policies.py case is XLA's backend compile). Its CPU backend compiles them faster at
# -O0 (tests/kvpolicies/test_policies.py: 107 s -> 74 s, same results) and faster again with the older loop
# emitters instead of the fusion emitters and without LLVM's expensive passes (three score
# steps of a 2-layer model: 2.5 s -> 0.9 s of compile; the whole unit stage on the 2 idle cores: 673 s -> 418 s, the
# same tests passing). A compile runs on one core, so two pytest-xdist workers (a test file per
# worker, the longest files first: tests/conftest.py, by tests/durations.json) use both. The `slow` tests run
# the real models, where -O0 code runs about 2x slower: they keep the default optimisation, in two
# workers too (their model steps use both cores, but much of their time is single-threaded:
# compiles, transformers' model builds, GGUF parsing; 406 s in one process, 323 s in two, back to back).
# LLVM's code generation in one piece instead of split over threads (xla_cpu_parallel_codegen_split_count=1):
# two workers already fill both cores, and the split only adds work (four files' unit tests, two pairs
# back to back: 114 s / 111 s against 135 s / 122 s of wall time, user time 12 % lower).
UNIT_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false --xla_llvm_disable_expensive_passes=true --xla_cpu_parallel_codegen_split_count=1"
# XLA aborts on a flag it does not know: should a future jaxlib drop one of these, keep -O0 only
if ! XLA_FLAGS="${XLA_FLAGS:-} $UNIT_FLAGS" .venv/bin/python -c "import jax; jax.jit(lambda x: x + 1)(1)" >/dev/null 2>&1; then
  echo "[test] this jaxlib refuses '$UNIT_FLAGS': the unit tests run at -O0 only"
  UNIT_FLAGS="--xla_backend_optimization_level=0"
fi
# One fresh persistent compilation cache for this run, shared by the workers of both stages and
# the subprocesses tests start: a program compiled a second time is read back (engines of equal
# policies compile equal steps). No size limit: a limit turns on JAX's file lock and a scan of the
# folder at every write. KVP_TEST_CACHE=0 turns it off. docs/guide/testing.md has the numbers.
if [ "${KVP_TEST_CACHE:-1}" != 0 ]; then
  JAX_COMPILATION_CACHE_DIR=$(mktemp -d -t kvp-xla-cache.XXXXXX)
  trap 'rm -rf "$JAX_COMPILATION_CACHE_DIR"' EXIT
  export JAX_COMPILATION_CACHE_DIR JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0 \
    JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES=-1
fi
# One OpenMP thread per process (torch, numpy's BLAS; not XLA's own pool): two workers already fill
# both cores, and torch's threads, one per core, fight the other worker's for them (the kvpress
# worker's SmolLM2 run in the slow stage: 77 s -> 44 s; tests/models/test_long_models.py's slow
# tests 174 s -> 157 s, both beside another job on the 2 cores). OMP_NUM_THREADS set outside wins.
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
XDIST=(-n "${KVP_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder)
# KVP_RECORD_DURATIONS=1: rewrite tests/durations.json from this run (the file order of the workers)
[ -n "${KVP_RECORD_DURATIONS:-}" ] && XDIST+=(--record-durations)
rc=0
XLA_FLAGS="${XLA_FLAGS:-} $UNIT_FLAGS" \
  "${PYTEST[@]}" -m "not slow" "${XDIST[@]}" --durations=10 || rc=$?
"${PYTEST[@]}" -m slow "${XDIST[@]}" --durations=20 || rc=$?
exit "$rc"
