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
# The unit tests (not `slow`) are dominated by XLA compiling many small steps: its CPU backend at
# -O0 compiles them about 30 % faster (tests/test_policies.py: 107 s -> 74 s, same results), and
# a compile runs on one core, so two pytest-xdist workers (a test file per worker) use both. The
# `slow` tests run the real models, where -O0 code runs about 2x slower: they keep the default,
# in one process (their steps use every core).
rc=0
XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0" \
  "${PYTEST[@]}" -m "not slow" -n "${KVP_TEST_WORKERS:-2}" --dist loadfile --durations=10 || rc=$?
"${PYTEST[@]}" -m slow --durations=20 || rc=$?
exit "$rc"
