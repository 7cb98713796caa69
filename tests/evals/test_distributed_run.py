"""`python -m evals.run distributed=I/N@HOST:PORT`: the command joins its processes itself
(jax.distributed, gloo CPU collectives), one model over a data=1 x model=2 mesh whose two devices
belong to two processes. A sweep of the same job twice: the first runs in both processes and only
process 0 appends its row; the second is skipped by both (process 0's decision, broadcast). The row
equals one process's run on one device (NLL per token to 1e-5: float32 sums reduced across the
processes in another order)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from evals import results as R
from evals import run as evrun
from evals.config import compose, validate

ROOT = Path(__file__).resolve().parents[2]
TOL = 1e-5


def _args(text_file, results):
    return ["model=tiny_random", "data=path", f"data.path={text_file}", "tokens=32", "chunk=16", "policy=window",
            "window=8", f"results={results}", "progress=false"]


@pytest.mark.slow  # two processes start JAX and join (about 15 s each, at once)
def test_two_processes_joined_by_the_command_write_one_process_s_row_once(tmp_path, text_file):
    with socket.socket() as sock:  # a free port for the coordinator
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=1").strip()
    res = tmp_path / "r.jsonl"
    procs, logs = [], [(tmp_path / f"{i}.out", tmp_path / f"{i}.err") for i in range(2)]
    for i, (out, err) in enumerate(logs):  # into files: a full pipe would stall a process the other waits for
        with open(out, "w") as o, open(err, "w") as e:
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "evals.run", "-m", *_args(text_file, res), "mesh=[1,2]", "window=8,8",
                 f"distributed={i}/2@localhost:{port}", f"hydra.sweep.dir={tmp_path / f'sweep{i}'}"],
                cwd=ROOT, env=env, stdout=o, stderr=e))
    evrun.run_config(validate(compose(_args(text_file, tmp_path / "one.jsonl"))))  # meanwhile: one process
    (one,) = R.read(tmp_path / "one.jsonl")
    for p, (out, err) in zip(procs, logs):
        p.wait(timeout=600)
        assert p.returncode == 0, err.read_text()[-4000:]
        text = out.read_text() + err.read_text()
        assert text.count("[evals.run] skip") == 1, text[-3000:]  # the sweep's second job, in both processes
    rows = R.read(res)
    assert len(rows) == 1 and rows[0]["key"] == one["key"]  # process 0 wrote it, once; process 1 nothing
    assert rows[0]["config"]["mesh"] == [1, 2] and rows[0]["device"]["count"] == 2
    nll = R.load_array(rows[0], "nll")
    print(f"max |nll - one process's| = {np.max(np.abs(nll - R.load_array(one, 'nll'))):.2e}")
    np.testing.assert_allclose(nll, R.load_array(one, "nll"), atol=TOL, rtol=0)
    assert rows[0]["metrics"]["ppl"] == pytest.approx(one["metrics"]["ppl"], rel=TOL)
