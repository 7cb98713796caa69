"""Wall time of one evals.compare grid in this process and on a local Ray cluster of 1 and 2 workers.

    python -m benchmarks.scale_out --workers 1 2 --out results/scale_out.json

The grid (default: SmolLM2 perplexity over 512 tokens, full + window and sink at budgets 0.25 and
0.5: 5 jobs) runs once per setting, each into a fresh results file, with the persistent compilation
cache off (KVP_COMPILE_CACHE=none), so every setting compiles what it runs: `local` is
`executor=local` (one process, shared prefill), `ray:N` is `executor=ray ray.address=local
ray.workers=N` (a Ray cluster started for the run: its start, N worker processes importing JAX and
loading the model, each compiling its own steps, and the merge are all in the wall time). Writes a
JSON record (times, jobs, the machine's cores) for docs/guide/scale.md's "Scale out" section.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

GRID = ["task=perplexity", "tokens=512", "chunk=128", "policies=[window,sink]", "budgets=[0.25,0.5]",
        "progress=false"]


def timed(argv: list[str]) -> tuple[float, int]:
    """(seconds, jobs) of one evals.compare command line into a fresh results file."""
    from evals import compare
    from evals import results as R

    with tempfile.TemporaryDirectory() as d:
        t0 = time.perf_counter()
        compare.main(argv + [f"results={d}/r.jsonl", f"out={d}/out"])
        return time.perf_counter() - t0, len(R.read(f"{d}/r.jsonl"))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.scale_out", description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2], help="Ray worker counts to time")
    ap.add_argument("--no-local", action="store_true", help="skip the in-process run")
    ap.add_argument("--out", default="results/scale_out.json")
    ap.add_argument("grid", nargs="*", default=GRID, help="evals.compare's arguments (default: %(default)s)")
    args = ap.parse_args(argv)
    os.environ["KVP_COMPILE_CACHE"] = "none"  # every setting compiles its own programs (workers inherit it)
    runs = []
    for setting in ([] if args.no_local else ["local"]) + [f"ray:{n}" for n in args.workers]:
        extra = [] if setting == "local" else ["executor=ray", "ray.address=local", f"ray.workers={setting[4:]}"]
        seconds, jobs = timed(list(args.grid) + extra)
        runs.append({"setting": setting, "seconds": round(seconds, 1), "jobs": jobs})
        print(f"[scale_out] {setting}: {jobs} jobs in {seconds:.1f} s")
    record = {"grid": list(args.grid), "runs": runs, "cores": os.cpu_count(), "host": platform.node(),
              "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {args.out}")
    return record


if __name__ == "__main__":
    main()
