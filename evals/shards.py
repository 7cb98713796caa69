"""Results written by many processes on many hosts: one shard per process, merged into the results file.

A grid spread over machines (`evals.compare executor=ray`, `evals.run -m shards=true` under
Hydra's joblib or submitit launcher) cannot rely on `evals.results`' file lock: a network
filesystem may not honour `flock`. In the sharded mode each worker process appends only to its
own shard, so no two writers ever share a file and no lock is taken:

    <results>.shards/<host>-<pid>.jsonl            rows, the schema of the results file
    <results>.shards/<host>-<pid>.jsonl.arrays/    its content-addressed arrays (evals.results)

`merge(results)` builds the results file from the shards:
- every complete row of every shard is appended once: a row already in the results file (the same
  contents, its arrays named by their content hash) is not appended again, so a merge is
  idempotent;
- of the successful rows of one key (in the results file and every shard) only the newest counts
  (`newest`: the latest `time`, then the greatest content hash: the same choice whatever the
  order the files are read in): it is appended unless the results file holds it already, and the
  others are left out, so no key gains a second row unless a newer one was run (`force=true`,
  below). Readers take a key's last row, so the appended newest row is the one they see;
- a half-written line (a worker killed mid-row) is not JSON: it is skipped with a warning, never merged;
- arrays are copied into `<results>.arrays/` under the same names (temp then rename) and the
  row's paths rewritten to them; a row never points at a missing array;
- the new results file is the old one's bytes plus the new rows, written to a temp file and
  renamed over it (atomic; no lock). The merge is the only writer of the results file in this mode.

A re-run of a grid skips every key that any shard or the results file already holds (`done_keys`),
so a killed worker's items are run again by the rerun (or by Ray's task retries) and no other.
`force=true` in this mode redoes every job the worker is given, whatever the shards hold: its new row
goes to the worker's shard, and the merge appends it as the key's newest row (the old rows stay
above it, as `force=true` leaves them in one results file).
`evals.results.read` reads a shards folder like a results file (every shard's rows), so tables
and figures read shards or merged files alike.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import warnings
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from evals import results as R

SUFFIX = ".shards"


def shard_dir(results: str | os.PathLike) -> Path:
    """`<results>.shards/`: the shards of one results file."""
    p = Path(results)
    return p.with_name(p.name + SUFFIX)


def shard_path(results: str | os.PathLike, worker: str | None = None) -> Path:
    """This process's shard of `results` (`<results>.shards/<host>-<pid>.jsonl`), or `worker`'s."""
    return shard_dir(results) / f"{worker or f'{socket.gethostname()}-{os.getpid()}'}.jsonl"


def shard_files(results: str | os.PathLike) -> list[Path]:
    """Every shard of `results`, sorted by name."""
    return sorted(shard_dir(results).glob("*.jsonl"))


def _rows(path: Path) -> list[dict[str, Any]]:
    return R.read(path) if path.is_file() else []


def done_keys(results: str | os.PathLike) -> set[str]:
    """Keys with a finished row (`results.finished`: a run's fields, not `failed`) in the results file
    or in any of its shards."""
    rows = _rows(Path(results)) + [r for s in shard_files(results) for r in _rows(s)]
    return {r["key"] for r in rows if "key" in r and R.finished(r)}


def find(results: str | os.PathLike, key: str) -> dict[str, Any] | None:
    """The newest successful row of `key` in the results file or its shards (`newest`), or None.
    Called by workers while others write: a shard's last line may be half-written for now (skipped
    without a warning; the merge, after the grid, warns of a line a dead worker left)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        rows = _rows(Path(results)) + [r for s in shard_files(results) for r in _rows(s)]
    return newest([r for r in rows if r.get("key") == key])


def identity(row: dict[str, Any]) -> str:
    """A row's contents, its arrays by file name (content hashed), without where it was read from."""
    body = {k: v for k, v in row.items() if k not in ("_file", "_line", "arrays")}
    body["arrays"] = {n: Path(p).name for n, p in (row.get("arrays") or {}).items()}
    return hashlib.sha256(json.dumps(body, sort_keys=True, default=str).encode()).hexdigest()


def _rank(row: dict[str, Any]) -> tuple[str, str]:
    return str(row.get("time") or ""), identity(row)


def newest(rows: Iterable[dict[str, Any]]) -> dict[str, Any] | None:
    """The newest of `rows`' successful rows: the latest `time` (UTC, ISO 8601), ties (and rows without
    a time) to the greatest content hash (`identity`), so that every reader and every merge picks the
    same row whatever the order of the files; None without a successful row."""
    ok = [r for r in rows if R.finished(r)]
    return max(ok, key=_rank) if ok else None


@dataclass
class Merged:
    """What a merge did: rows appended, rows already there, older (or duplicate) successful rows of a
    key left out, shards read."""

    added: int = 0
    present: int = 0
    duplicates: int = 0
    shards: int = 0

    def line(self, results: str | os.PathLike) -> str:
        return (f"merged {self.shards} shard(s) into {results}: {self.added} row(s) added, {self.present} already "
                f"there" + (f", {self.duplicates} older or duplicate row(s) of a key left out" if self.duplicates
                            else ""))


def _copy_array(src: Path, dst: Path) -> None:
    if dst.is_file():  # the same name is the same contents (key, name, content hash)
        return
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        shutil.copyfile(src, tmp)
        os.chmod(tmp, R.FILE_MODE & ~_umask())
        os.replace(tmp, dst)
    finally:
        tmp.unlink(missing_ok=True)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def merge(results: str | os.PathLike, shards: Iterable[str | os.PathLike] | None = None) -> Merged:
    """Append every shard row not yet in `results` to it (see the module docstring); idempotent."""
    results = Path(results)
    paths = [Path(s) for s in shards] if shards is not None else shard_files(results)
    existing = _rows(results)
    seen = {identity(r) for r in existing}
    read = [(shard, row) for shard in paths for row in _rows(shard)]
    best: dict[Any, tuple[str, str]] = {}  # key -> rank of its newest successful row, anywhere
    for row in existing + [row for _, row in read]:
        if R.finished(row):
            best[row["key"]] = max(best.get(row["key"], ("", "")), _rank(row))
    out = Merged(shards=len(paths))
    lines: list[bytes] = []
    arrays = R.array_dir(results)
    for shard, row in read:
        ident = identity(row)
        if ident in seen:
            out.present += 1
            continue
        if R.finished(row) and best[row["key"]][1] != ident:  # an older row of the key (or a tie lost)
            out.duplicates += 1
            continue
        moved = {}
        for name, rel in (row.get("arrays") or {}).items():
            _copy_array(shard.parent / rel, arrays / Path(rel).name)
            moved[name] = f"{arrays.name}/{Path(rel).name}"
        clean = {k: v for k, v in row.items() if k not in ("_file", "_line")} | {"arrays": moved}
        lines.append((json.dumps(R.json_safe(clean), allow_nan=False, separators=(",", ":")) + "\n").encode())
        seen.add(ident)
        out.added += 1
    if lines:
        _replace(results, lines)
    return out


def _replace(results: Path, lines: list[bytes]) -> None:
    """`results` := its bytes (a last line without its newline ended by one) + `lines`, atomically."""
    results.parent.mkdir(parents=True, exist_ok=True)
    old = results.read_bytes() if results.is_file() else b""
    if old and not old.endswith(b"\n"):
        warnings.warn(f"{results}: its last line has no newline (a writer died mid-row); it stays, skipped when read",
                      stacklevel=3)
        old += b"\n"
    tmp = results.with_name(f".{results.name}.{os.getpid()}.{os.urandom(4).hex()}.tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, R.FILE_MODE)
        with os.fdopen(fd, "wb") as f:
            f.write(old + b"".join(lines))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, results)
    finally:
        tmp.unlink(missing_ok=True)


def run_in_shard(conf: dict[str, Any], key: str, run_config, worker: str | None = None) -> tuple[dict[str, Any], bool]:
    """`run_config` (evals.run's) in the sharded mode: a `key` that the results file or any shard holds
    is skipped (its newest row returned, ran=False) unless conf["force"]; else the run goes to this
    process's shard (no lock, neither the key's nor the file's: a shard has one writer), a forced
    run's row after any row of its key there (the merge takes the newest). Returns (row, ran)."""
    row = None if conf.get("force") else find(conf["results"], key)
    if row is not None:
        return row, False
    return run_config({**conf, "results": str(shard_path(conf["results"], worker))})


# -- evals.run -m under Hydra's joblib or submitit launcher ---------------------------------------


def launcher_of(argv: list[str]) -> str | None:
    """The Hydra launcher a sweep's command line names (`hydra/launcher=joblib`, `submitit_slurm`...),
    None for a single run or Hydra's basic launcher (every job in this process)."""
    if "-m" not in argv and "--multirun" not in argv:
        return None
    named = [a.split("=", 1)[1] for a in argv if a.split("=", 1)[0].lstrip("+~") == "hydra/launcher"]
    return named[-1] if named and named[-1] != "basic" else None


def launched_elsewhere() -> bool:
    """Inside a Hydra job: whether its launcher runs jobs outside the command's process (then the job
    writes its own shard)."""
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return False
    return HydraConfig.get().runtime.choices.get("hydra/launcher") not in (None, "basic")


def check_sweep(confs: list[dict[str, Any]], launcher: str) -> None:
    """ConfigError for what a launcher's sweep refuses: `distributed` (a launcher's job is one process;
    a model over several processes is one evals.run per process, docs/guide/scale.md)."""
    from evals.config import ConfigError

    for c in confs:
        if c.get("distributed", "off") != "off":
            raise ConfigError(f"distributed={c['distributed']}: under hydra/launcher={launcher} each job is one "
                              "process; run a model over several processes with one evals.run per process")


def merge_sweep(confs: list[dict[str, Any]], keys: list[str], say=print) -> list[dict[str, Any]]:
    """After a launcher's sweep of `confs` (run keys `keys`): merge each results file's shards into it;
    the row of every job (its newest successful one, else its last), in the order of the jobs."""
    for res in dict.fromkeys(c["results"] for c in confs):
        say(f"[evals.run] {merge(res).line(res)}")
    rows = []
    for c, key in zip(confs, keys, strict=True):
        mine = [r for r in _rows(Path(c["results"])) if r.get("key") == key]
        if mine:
            rows.append(newest(mine) or mine[-1])
    return rows


def main(argv: list[str] | None = None) -> None:
    """`python -m evals.shards RESULTS ...`: merge each results file's shards into it."""
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m evals.shards", description=main.__doc__)
    ap.add_argument("results", nargs="+", help="results .jsonl files (their shards: <results>.shards/)")
    args = ap.parse_args(sys.argv[1:] if argv is None else argv)
    for res in args.results:
        print(merge(res).line(res))


if __name__ == "__main__":
    main()
