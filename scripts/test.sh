#!/usr/bin/env bash
# Set up (with test extras) and run the whole test suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh test
exec .venv/bin/python -m pytest -q -p no:cacheprovider "$@"
