"""Reading and checking checkpoint and tokenizer files without loading them: text and JSON files,
GGUF headers and tensor tables (`GGUFFile`, `check_gguf`), HF safetensors folders (`check_hf_dir`).
Every error is one ValueError naming the file. Both `models.loading` (weights) and
`models.tokenizer` (vocabularies) read files through this module, which imports neither.
"""

from __future__ import annotations

import json
import math
import os
import pathlib
import struct
from typing import Any

import numpy as np




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
    with bulk reads: `gguf.GGUFReader` builds a numpy view per string, which is slow on a
    150k-262k-token vocabulary (docs/results/speed.md, "Numbers behind comments in the code").
    `field(key, default)` reads a key."""

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


def hf_weight_files(folder: pathlib.Path) -> list[pathlib.Path]:
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
    for f in hf_weight_files(folder):
        _check_safetensors(f)
    if tokenizer:
        if not (folder / "tokenizer.json").exists():
            raise ValueError(f"{folder} has no tokenizer.json")
        for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
            if name == "tokenizer.json" or (folder / name).exists():
                (read_json if name.endswith(".json") else read_text)(folder / name)
    return cfg
