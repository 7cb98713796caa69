"""The results file: one JSON object per line, one line per finished run.

A row holds the run's resolved config and its stable `key`, the environment (git revision,
library versions, device), the task's metrics / grid / curves, the cache memory and timings;
arrays (e.g. per-token NLL) are saved as `.npy` files beside the results file and referenced
by relative path.

Writes are atomic per row. `append` writes the whole line with ONE `os.write` on a file
descriptor opened with O_APPEND: the kernel moves the offset to the end and writes in one
step, so concurrent writers (parallel sweep jobs) never interleave or overwrite each other
and a crash leaves either the whole line or nothing of it (a short write, e.g. a full disk,
raises; `read` skips an unparseable last line). Rewriting the whole file through
temp-then-rename would also be atomic, but costs O(file) per row and loses rows when two
writers race (the second rename drops the first's row). Arrays, which are written whole
once, use temp-then-rename, before their row: a row never points at a missing or partial file.

Resuming: a row's `key` hashes the configuration that determines its numbers (model, data,
policy as built, task, tokens, chunk, seed; not the results path or progress flag), so a
re-run sweep skips the rows already present and an interrupted sweep loses only the run in
flight.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvpolicies.base import Policy

REPO = Path(__file__).resolve().parent.parent
ARRAY_DIR = "arrays"


# -- keys and rows ------------------------------------------------------------------------------


def config_key(config: dict[str, Any]) -> str:
    """A stable 16-hex-digit hash of a JSON-able config (key order does not matter)."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def _clean(x: Any) -> Any:
    """JSON-safe: numpy scalars/arrays to Python, non-finite floats to None (strict JSON)."""
    if isinstance(x, dict):
        return {str(k): _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    if isinstance(x, np.ndarray):
        return _clean(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


def append(path: str | os.PathLike, row: dict[str, Any]) -> None:
    """Append `row` as one JSON line with a single write on an O_APPEND descriptor."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    data = (json.dumps(_clean(row), allow_nan=False, separators=(",", ":")) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        written = os.write(fd, data)
        if written != len(data):
            raise OSError(f"{path}: short write ({written} of {len(data)} bytes); the row is incomplete")
        os.fsync(fd)
    finally:
        os.close(fd)


def read(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """All rows of one or more results files, in file order (each row gets `_file`, its path).

    A line that is not valid JSON (a run killed mid-write on a filesystem without atomic
    appends) is skipped with a warning; a missing file raises FileNotFoundError."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    rows = []
    for p in map(Path, paths):
        if not p.is_file():
            raise FileNotFoundError(f"results file {p} does not exist")
        with open(p, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError:
                    warnings.warn(f"{p}, line {number}: not valid JSON, skipped", stacklevel=2)
                    continue
                row["_file"] = str(p)
                rows.append(row)
    return rows


def done_keys(path: str | os.PathLike) -> set[str]:
    """Keys of the rows already in a results file (empty if it does not exist yet)."""
    return {r["key"] for r in read(path) if "key" in r} if Path(path).is_file() else set()


def latest(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per key, the last written (a `force=true` re-run replaces the earlier one)."""
    by_key: dict[str, dict[str, Any]] = {}
    for r in rows:
        by_key.pop(r.get("key"), None)
        by_key[r.get("key")] = r
    return list(by_key.values())


# -- arrays -------------------------------------------------------------------------------------


def save_array(results: str | os.PathLike, key: str, name: str, array: np.ndarray) -> str:
    """Save `array` as `<results dir>/arrays/<key>.<name>.npy` (temp file, then rename); returns
    that path relative to the results file's folder."""
    folder = Path(results).parent / ARRAY_DIR
    folder.mkdir(parents=True, exist_ok=True)
    rel = f"{ARRAY_DIR}/{key}.{name}.npy"
    fd, tmp = tempfile.mkstemp(dir=folder, suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            np.save(f, np.asarray(array))
        os.replace(tmp, folder.parent / rel)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return rel


def load_array(row: dict[str, Any], name: str) -> np.ndarray:
    """Array `name` of a row read by `read` (resolved beside the row's results file)."""
    rel = row.get("arrays", {}).get(name)
    if rel is None:
        raise KeyError(f"row {row.get('key')} has no array {name!r}; it has {sorted(row.get('arrays', {}))}")
    return np.load(Path(row["_file"]).parent / rel)


# -- environment ----------------------------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def git_revision() -> dict[str, Any] | None:
    """{"rev": commit hash, "dirty": uncommitted changes?} of the checkout, or None."""
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        if rev.returncode:
            return None
        status = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                                capture_output=True, text=True, timeout=10)
        return {"rev": rev.stdout.strip(), "dirty": bool(status.stdout.strip())}
    except (OSError, subprocess.SubprocessError):
        return None


def versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in ("jax", "jaxlib", "flax", "numpy", "kvpolicies"):
        try:
            out[name] = version(name)
        except PackageNotFoundError:
            out[name] = None
    return out


def device() -> dict[str, Any]:
    import jax

    d = jax.devices()[0]
    return {"platform": d.platform, "kind": d.device_kind, "count": jax.device_count(), "host": platform.node()}


def environment() -> dict[str, Any]:
    return {"git": git_revision(), "versions": versions(), "device": device(), "argv": sys.argv[1:]}


# -- memory ---------------------------------------------------------------------------------------


def _stores_plain_slots(policy: Policy, **kw) -> bool:
    """Keys and values stored as plain [B, K, S, D] arrays in the cache dtype: the closed form applies."""
    import jax

    shape = jax.eval_shape(lambda: policy.init(1, kw["kv_heads"], kw["head_dim"], kw["dtype"], kw["max_len"]))
    return isinstance(shape.k, jax.ShapeDtypeStruct) and shape.k.dtype == kw["dtype"]


def peak_device_bytes() -> int | None:
    """Peak memory in use on the first device since the process started (None on CPU)."""
    import jax

    stats = jax.devices()[0].memory_stats()
    return None if not stats else stats.get("peak_bytes_in_use")


def memory(policies: Sequence[Policy], *, kv_heads: int, head_dim: int, max_len: int, dtype) -> dict[str, Any]:
    """Cache memory of a per-layer policy stack, computed the same way for every policy.

    state_bytes = kv_bytes + meta_bytes: exact bytes of the cache state (kvpolicies.memory).
    closed_form_bytes: 2 x layers x kv_heads x head_dim x slots x bytes, summed over layers,
        when every layer stores plain slots (identity codec), else None; equals kv_bytes.
    read_bytes_per_step: bytes the decode step at position max_len - 1 reads (each policy's
        `decode_reads`), when the stack reads less than it stores (e.g. quest), else None.
    peak_device_bytes: the device's peak memory (process-wide; None on CPU).
    """
    import jax.numpy as jnp

    from kvpolicies import memory as km

    dtype = jnp.dtype(dtype)
    kw = dict(kv_heads=kv_heads, head_dim=head_dim, max_len=max_len, dtype=dtype)
    sb = km.stack_bytes(policies, **kw)
    closed = None
    if all(_stores_plain_slots(p, **kw) for p in policies):
        closed = int(sum(
            km.closed_form_bytes(n_layers=1, kv_heads=kv_heads, head_dim=head_dim, slots=p.capacity(max_len),
                                 bytes_per_elem=dtype.itemsize)
            for p in policies))
    read = int(sum(km.bytes_read_per_step(p, context=max_len - 1, **kw).read.total for p in policies))
    read = read if read < sb.total else None
    return {
        "max_len": max_len, "dtype": dtype.name, "layers": len(policies),
        "kv_bytes": sb.kv, "meta_bytes": sb.meta, "state_bytes": sb.total,
        "closed_form_bytes": closed, "read_bytes_per_step": read, "peak_device_bytes": peak_device_bytes(),
    }


def policy_record(policy: Policy) -> dict[str, Any]:
    """A policy as plain data: its registry name, its fields, the codec as {name, fields}."""
    from kvpolicies import POLICIES

    name = next((n for n, cls in POLICIES.items() if type(policy) is cls), type(policy).__name__.lower())
    out: dict[str, Any] = {"name": name}
    for f in dataclasses.fields(policy):
        v = getattr(policy, f.name)
        out[f.name] = dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
    return out
