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
# -O0 compiles them about 30 % faster (tests/test_policies.py: 107 s -> 74 s, same results). The
# `slow` tests run the real models, where -O0 code runs about 2x slower: they keep the default.
rc=0
XLA_FLAGS="${XLA_FLAGS:-} --xla_backend_optimization_level=0" "${PYTEST[@]}" -m "not slow" || rc=$?
"${PYTEST[@]}" -m slow || rc=$?
exit "$rc"
