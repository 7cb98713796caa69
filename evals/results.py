"""The results file: one JSON object per line, one line per finished run.

A row holds the run's resolved config and its stable `key`, the environment (git revision,
library versions, device), the task's metrics / grid / curves, the cache memory and timings;
arrays (e.g. per-token NLL) are saved as `.npy` files in `<results>.arrays/` and referenced
by relative path.

Guarantees (tested in tests/evals/test_hostile.py):
- A row is appended with ONE `os.write` on an O_APPEND descriptor, under an exclusive `flock`
  on `<results>.lock`: rows never interleave, and a process killed at any byte leaves the
  complete rows before it intact. Rewriting the whole file through temp-then-rename would also
  be atomic, but costs O(file) per row and loses rows when two writers race.
- Repair before append: if the file does not end in a newline (a writer died mid-row, or the
  file was copied while growing), the partial last line is moved to `<results>.corrupt` (a
  warning says so) and cut off, so the new row starts on its own line; a last line that is a
  whole JSON object lacking only its newline is kept and completed.
- Reading skips any bad line (undecodable bytes, invalid JSON, JSON that is not an object) with
  a warning naming the file and the line number; nothing else is lost.
- One run per key: `key_lock` is an exclusive `flock` on `<results>.locks/<key>`, which
  evals.run holds around "is the key in the file? run it or skip it; append its row". A second
  process on the same key waits, then finds the row and skips; runs of different keys still go
  in parallel. Locks are advisory (every writer here takes them) and the kernel drops them when
  a process dies, so a killed run leaves no stale lock.
- Arrays, written whole once, use temp-then-rename before their row: a row never points at a
  missing or partial file. Rows, arrays, the lock and the side files are all created with mode
  0o666 minus the umask, so they share permissions.
- `check_writable` probes the results location (file, folder, lock, key locks and arrays
  folders; FIFOs and devices refused) without leaving anything behind; evals.run calls it
  before any model is loaded.
- An array belongs to its row: `<results>.arrays/<key>.<name>.<content hash>.npy`, so a forced
  re-run never changes an earlier row's array and two results files never share one.
- Many writers on many hosts (a grid on Ray, a SLURM sweep) use no lock: each process appends to its
  own shard, `<results>.shards/<host>-<pid>.jsonl` (a shard's appends and key locks take none), and
  `evals.shards.merge` builds the results file from them; `read` reads a shards folder as a file.

Resuming: a row's `key` hashes the configuration that determines its numbers (model, data,
policy as built, task, tokens, chunk, seed, and for a user's own data or checkpoint path its
`file_digest`; not the results path or progress flag), so a re-run sweep skips the rows
already present and an interrupted sweep loses only the run in flight. A row whose metrics are
NaN or missing is recorded with `failed` (the reason) and does not count as done: a re-run redoes it;
nor does a line without the fields every run writes (`finished`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
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
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from kvpolicies.base import Policy
from kvpolicies.codecs import Codec
from kvpolicies.prompt import prompt_policy_of

REPO = Path(__file__).resolve().parent.parent
ARRAY_DIR = "arrays"
FILE_MODE = 0o666  # minus the umask, for every file written here (rows, arrays, locks, side files)


# -- keys and rows ------------------------------------------------------------------------------


def config_key(config: dict[str, Any]) -> str:
    """A stable 16-hex-digit hash of a JSON-able config (key order does not matter)."""
    blob = json.dumps(config, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


DIGEST_EDGE = 1 << 20  # bytes hashed at the head and at the tail of a file


def file_digest(path: str | os.PathLike) -> str:
    """A 16-hex-digit digest of a file's identity and contents: its size, mtime (ns) and a SHA-256
    of its first and last DIGEST_EDGE bytes; for a folder (an HF checkpoint), of every file in it
    (names sorted). Cheap on a 10 GB checkpoint; a rewritten or replaced file changes it."""
    p = Path(path)
    h = hashlib.sha256()
    files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
    for f in files:
        st = f.stat()
        h.update(f"{f.relative_to(p) if p.is_dir() else f.name}:{st.st_size}:{st.st_mtime_ns}:".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(DIGEST_EDGE))
            if st.st_size > DIGEST_EDGE:
                fh.seek(max(DIGEST_EDGE, st.st_size - DIGEST_EDGE))
                h.update(fh.read(DIGEST_EDGE))
    return h.hexdigest()[:16]


def json_safe(x: Any) -> Any:
    """JSON-safe: numpy scalars/arrays to Python, non-finite floats to None (strict JSON)."""
    if isinstance(x, dict):
        return {str(k): json_safe(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [json_safe(v) for v in x]
    if isinstance(x, np.ndarray):
        return json_safe(x.tolist())
    if isinstance(x, np.generic):
        x = x.item()
    if isinstance(x, float) and not math.isfinite(x):
        return None
    return x


# -- the file: locks, repair, append, read ------------------------------------------------------


def _side(path: Path, suffix: str) -> Path:
    return path.with_name(path.name + suffix)


def lock_path(results: str | os.PathLike) -> Path:
    """`<results>.lock`: the lock file of appends (exclusive) and reads (shared)."""
    return _side(Path(results), ".lock")


def corrupt_path(results: str | os.PathLike) -> Path:
    """`<results>.corrupt`: where damaged tails cut off the results file are kept."""
    return _side(Path(results), ".corrupt")


@contextlib.contextmanager
def _flock(path: Path, kind: int, create: bool = True) -> Iterator[bool]:
    """Hold `flock(kind)` on `path`, created if `create`; without `create`, a lock file that does
    not exist or cannot be opened (a read-only copy of the results) is not waited for: yields
    whether the lock is held."""
    try:
        fd = os.open(path, (os.O_RDWR | os.O_CREAT) if create else os.O_RDONLY, FILE_MODE)
    except OSError:
        if create:
            raise
        fd = None
    try:
        if fd is not None:
            fcntl.flock(fd, kind)
        yield fd is not None
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


@contextlib.contextmanager
def key_lock(results: str | os.PathLike, key: str, on_wait=None) -> Iterator[None]:
    """Exclusive lock of one run key of a results file (`<results>.locks/<key>`): held around
    check-run-append, so two processes never run one key twice. `on_wait()` is called once if
    another process holds it (then this one waits). A shard (evals.shards) has one writer: no lock."""
    if _is_shard(Path(results)):
        yield
        return
    folder = _side(Path(results), ".locks")
    folder.mkdir(parents=True, exist_ok=True)
    fd = os.open(folder / key, os.O_RDWR | os.O_CREAT, FILE_MODE)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            if on_wait is not None:
                on_wait()
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def _tail(fd: int, size: int) -> tuple[int, bytes]:
    """(offset just after the last newline, bytes after it) of an open file of `size` bytes."""
    block, end = 1 << 16, size
    while end > 0:
        start = max(0, end - block)
        chunk = os.pread(fd, end - start, start)
        i = chunk.rfind(b"\n")
        if i >= 0:
            cut = start + i + 1
            return cut, os.pread(fd, size - cut, cut)
        end = start
    return 0, os.pread(fd, size, 0)


def _is_object(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line.decode("utf-8")), dict)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return False


def _repair(fd: int, path: Path) -> None:
    """Make an open results file end in a newline (see the module docstring): a partial last
    line goes to `<results>.corrupt`, a whole object lacking only its newline is completed."""
    size = os.fstat(fd).st_size
    if size == 0 or os.pread(fd, 1, size - 1) == b"\n":
        return
    cut, tail = _tail(fd, size)
    if _is_object(tail):
        os.write(fd, b"\n")
        return
    side = corrupt_path(path)
    cfd = os.open(side, os.O_WRONLY | os.O_APPEND | os.O_CREAT, FILE_MODE)
    try:
        os.write(cfd, tail + b"\n")
        os.fsync(cfd)
    finally:
        os.close(cfd)
    os.ftruncate(fd, cut)
    line = os.pread(fd, cut, 0).count(b"\n") + 1
    warnings.warn(f"{path}, line {line}: a partial last line ({len(tail)} bytes, no newline: a writer died "
                  f"mid-row) was moved to {side}", stacklevel=3)


def append(path: str | os.PathLike, row: dict[str, Any]) -> None:
    """Append `row` as one JSON line: under the exclusive lock, repair a partial last line, then
    one write on an O_APPEND descriptor (see the module docstring)."""
    path = Path(path)
    data = (json.dumps(json_safe(row), allow_nan=False, separators=(",", ":")) + "\n").encode()
    try:
        _append(path, data)
    except OSError as e:  # a full disk, a file gone read-only: name the path
        if str(path) in str(e):
            raise
        raise OSError(e.errno, f"results file {path}: the row could not be written ({e.strerror or e})") from None


def _is_shard(path: Path) -> bool:
    """A shard of evals.shards (`<results>.shards/<worker>.jsonl`): one writer, no lock."""
    return path.parent.name.endswith(".shards")


def _append(path: Path, data: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with contextlib.nullcontext() if _is_shard(path) else _flock(lock_path(path), fcntl.LOCK_EX):
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT, FILE_MODE)
        try:
            _repair(fd, path)
            written = os.write(fd, data)
            if written != len(data):
                raise OSError(f"{path}: short write ({written} of {len(data)} bytes); the row is incomplete")
            os.fsync(fd)
        finally:
            os.close(fd)


def _parse(p: Path, number: int, line: bytes, last: bool) -> dict[str, Any] | None:
    """The row on one line, or None with a warning saying why it is skipped."""
    where = f"{p}, line {number}"
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        warnings.warn(f"{where}: not UTF-8 (byte {e.start} of the line is {line[e.start]:#04x}), skipped", stacklevel=3)
        return None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        cut = " (the last line, cut short: a writer died mid-row)" if last else ""
        warnings.warn(f"{where}: not valid JSON ({e.msg}, column {e.colno}){cut}, skipped", stacklevel=3)
        return None
    if not isinstance(row, dict):
        warnings.warn(f"{where}: valid JSON but not an object ({type(row).__name__}), skipped", stacklevel=3)
        return None
    return row


def read(paths: str | os.PathLike | Iterable[str | os.PathLike]) -> list[dict[str, Any]]:
    """All rows of one or more results files, in file order (each row gets `_file`, its path, and `_line`).

    A bad line (undecodable bytes, invalid JSON, JSON that is not an object) is skipped with a
    warning naming the file and line; a missing file raises FileNotFoundError. Reads hold the
    shared lock, when the lock file exists, so a row being appended is never seen half-written.
    A folder of shards (`<results>.shards/`, evals.shards) reads as the rows of its shards."""
    if isinstance(paths, (str, os.PathLike)):
        paths = [paths]
    files = []
    for p in map(Path, paths):
        files += sorted(p.glob("*.jsonl")) if p.is_dir() and p.name.endswith(".shards") else [p]
    rows = []
    for p in files:
        if not p.is_file():
            raise FileNotFoundError(f"results file {p} does not exist")
        with _flock(lock_path(p), fcntl.LOCK_SH, create=False):
            blob = p.read_bytes()
        lines = blob.split(b"\n")
        for number, line in enumerate(lines, start=1):
            if not line.strip():
                continue
            row = _parse(p, number, line, last=number == len(lines))
            if row is not None:
                row["_file"], row["_line"] = str(p), number
                rows.append(row)
    return rows


FINISHED = ("key", "task", "policy", "metrics")  # fields every run's row holds (evals.run writes them)


def finished(row: dict[str, Any]) -> bool:
    """Whether a row records a finished run: the `FINISHED` fields, metrics a non-empty mapping,
    and no `failed` (a line holding only a matching key is not a run: a re-run redoes it)."""
    return (all(f in row for f in FINISHED) and isinstance(row["metrics"], dict) and bool(row["metrics"])
            and not row.get("failed"))


def done_keys(path: str | os.PathLike) -> set[str]:
    """Keys of the finished rows already in a results file (empty if it does not exist yet)."""
    return {r["key"] for r in read(path) if finished(r)} if Path(path).is_file() else set()


def _nearest_dir(path: Path) -> Path:
    """`path` if it is a folder, else its nearest existing ancestor (what mkdir would write into)."""
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def _probe_dir(folder: Path, what: str) -> None:
    target = _nearest_dir(folder)
    if not target.is_dir():
        raise OSError(f"{what} {folder}: {target} is not a folder")
    try:
        with tempfile.TemporaryFile(dir=target):  # O_TMPFILE where supported: nothing is left behind
            pass
    except OSError as e:
        raise OSError(f"{what} {folder}: cannot create files in {target} ({e.strerror or e})") from None


def _probe_file(path: Path, what: str) -> None:
    """An existing `path` must be a regular file open for appending (a FIFO or a device is refused
    before it is opened: opening a FIFO for writing would wait for a reader)."""
    if not path.exists():
        return
    if path.is_dir():
        raise OSError(f"{what} {path}: is a folder")
    if not path.is_file():
        raise OSError(f"{what} {path}: not a regular file (a FIFO, socket or device)")
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_NONBLOCK))
    except OSError as e:
        raise OSError(f"{what} {path}: cannot be appended to ({e.strerror or e})") from None


def check_writable(results: str | os.PathLike) -> None:
    """Raise OSError naming the path unless every file the results need can be written: the results
    file (appended to, or created; a regular file), its lock `<results>.lock`, its key locks folder
    `<results>.locks/` and its arrays folder `<results>.arrays/`. Called before any compute;
    creates and leaves nothing."""
    path = Path(results)
    _probe_dir(path.parent, "results folder")
    _probe_file(path, "results file")
    _probe_file(lock_path(path), "lock file")
    for folder, what in ((_side(path, ".locks"), "key locks folder"), (array_dir(path), "arrays folder")):
        if folder.exists() and not folder.is_dir():
            raise OSError(f"{what} {folder}: is not a folder")
        if folder.exists():
            _probe_dir(folder, what)


def latest(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per key, the last written (a `force=true` re-run replaces the earlier one)."""
    by_key: dict[str, dict[str, Any]] = {}
    for r in rows:
        by_key.pop(r.get("key"), None)
        by_key[r.get("key")] = r
    return list(by_key.values())


# -- arrays -------------------------------------------------------------------------------------


def array_dir(results: str | os.PathLike) -> Path:
    """`<results>.arrays/`: the arrays of one results file (two results files never share one)."""
    return _side(Path(results), ".arrays")


def save_array(results: str | os.PathLike, key: str, name: str, array: np.ndarray) -> str:
    """Save `array` as `<results>.arrays/<key>.<name>.<hash>.npy`, hash a SHA-256 of its contents
    (temp file, then rename; mode 0o666 minus the umask, like the results file); returns that path
    relative to the results file's folder. The name follows the contents, so a `force=true` re-run
    never changes the array an earlier row points at. (Rows written before this scheme point at
    `arrays/<key>.<name>.npy`, still read as recorded.)"""
    folder = array_dir(results)
    a = np.ascontiguousarray(array)
    digest = hashlib.sha256(f"{a.dtype.str}{a.shape}".encode() + a.tobytes()).hexdigest()[:12]
    rel = f"{folder.name}/{key}.{name}.{digest}.npy"
    tmp = folder / f".{key}.{name}.{os.getpid()}.{os.urandom(4).hex()}.tmp"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            np.save(f, a)
        os.replace(tmp, folder.parent / rel)
    except OSError as e:
        tmp.unlink(missing_ok=True)
        raise OSError(e.errno, f"array {folder.parent / rel}: {e.strerror or e}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
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

    stats = jax.local_devices()[0].memory_stats()  # (a process of a distributed run: its own)
    return None if not stats else stats.get("peak_bytes_in_use")


def memory(policies: Sequence[Policy], *, kv_heads: int, head_dim: int, max_len: int, dtype) -> dict[str, Any]:
    """Cache memory of a per-layer policy stack, computed the same way for every policy.

    state_bytes = kv_bytes + meta_bytes: exact bytes of the cache state (kvpolicies.memory).
    closed_form_bytes: 2 x layers x kv_heads x head_dim x slots x bytes, summed over layers,
        when every layer stores plain slots (identity codec), else None; equals kv_bytes.
    read_bytes_per_step: bytes the decode step at position max_len - 1 reads (each policy's
        `decode_reads`), when the stack reads less than it stores (e.g. quest), else None.
    prompt_phase_bytes: the state bytes while a fresh prompt is held, before `after_prompt`
        (prompt compressors hold it densely, e.g. snapkv: max_len slots + the observation rows),
        when any layer has a prompt phase, else None. Budgets count the state after the prompt.
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
    prompt = tuple(prompt_policy_of(p) for p in policies)
    prompt_bytes = km.stack_bytes(prompt, **kw).total if prompt != tuple(policies) else None
    return {
        "max_len": max_len, "dtype": dtype.name, "layers": len(policies),
        "kv_bytes": sb.kv, "meta_bytes": sb.meta, "state_bytes": sb.total,
        "closed_form_bytes": closed, "read_bytes_per_step": read, "prompt_phase_bytes": prompt_bytes,
        "peak_device_bytes": peak_device_bytes(),
    }


def policy_record(policy: Policy) -> dict[str, Any]:
    """A policy as plain data: its registry name, its fields, the codec as {name, fields}. A field
    added after rows were keyed (`metadata={"later": True}`) is left out at its default, so those
    rows keep their keys."""
    from kvpolicies import POLICIES

    name = next((n for n, cls in POLICIES.items() if type(policy) is cls), type(policy).__name__.lower())
    out: dict[str, Any] = {"name": name}
    for f in dataclasses.fields(policy):
        v = getattr(policy, f.name)
        if f.metadata.get("later") and v == f.default:
            continue
        out[f.name] = v.record() if isinstance(v, Codec) else dataclasses.asdict(v) if dataclasses.is_dataclass(v) else v
    return out
