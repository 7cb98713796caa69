"""The file order of scripts/test.sh's pytest-xdist workers (tests/conftest.py): files run longest
first by the durations recorded in tests/durations.json, per stage, never-recorded files first,
each file's tests in their own order."""

from __future__ import annotations

import subprocess
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests import conftest


def item(name: str, i: int, slow: bool = False):
    """A collected test as the ordering sees it: `name` is the file's path under tests/."""
    return SimpleNamespace(nodeid=f"tests/{name}::test_{i}", id=f"{name}::{i}",
                           get_closest_marker=lambda m, slow=slow: object() if (m == "slow" and slow) else None)


def test_files_run_longest_first_in_their_stage_new_files_before_all():
    items = [item("kvpolicies/test_a.py", 0), item("models/test_b.py", 0), item("test_new.py", 0),
             item("kvpolicies/test_a.py", 1), item("evals/test_a.py", 0), item("models/test_b.py", 1, slow=True)]
    durations = {"unit:kvpolicies/test_a.py": 10.0, "unit:models/test_b.py": 30.0, "unit:evals/test_a.py": 20.0,
                 "slow:models/test_b.py": 5.0}
    conftest.order_by_duration(items, durations)
    assert [x.id for x in items] == ["test_new.py::0", "models/test_b.py::0", "evals/test_a.py::0",
                                     "kvpolicies/test_a.py::0", "kvpolicies/test_a.py::1", "models/test_b.py::1"]


def test_recorded_durations_name_existing_test_files_of_a_stage():
    durations = conftest.recorded()
    assert durations, "tests/durations.json: run `KVP_RECORD_DURATIONS=1 bash scripts/test.sh` to record it"
    for key, seconds in durations.items():
        stage, name = key.split(":")
        assert stage in ("unit", "slow") and seconds >= 0
        assert (Path(conftest.__file__).parent / name).is_file(), f"tests/durations.json names a missing file: {key}"


PROBE = r"""
import os, sys, torch, transformers, kvpress
sys.path.insert(0, sys.argv[3])
import kvpress_worker
patched = kvpress.KnormPress.score is not kvpress.presses.knorm_press.KnormPress.__dict__["score"]
print(sys.argv[1:], sys.path[:2], os.getcwd(), __name__, "__file__" in globals(), os.environ["PYTHONPATH"],
      os.environ["OMP_NUM_THREADS"], torch.get_num_threads(), transformers.__version__, kvpress.__file__,
      kvpress_worker.__name__, kvpress_worker.__file__, repr(sys.stdin.read()), patched, sep="\n")
print(torch.initial_seed(), file=sys.stderr)  # the process's own (random) seed
kvpress.KnormPress.score = None  # a job's patch: the next job must not see it
torch.manual_seed(int(sys.argv[1]))
if sys.argv[2] == "fail":
    raise ValueError("the job failed")
"""


@pytest.mark.skipif(not (conftest.ROOT / ".venv" / "kvpress-ref" / "kvpress").is_dir(),
                    reason="kvpress not installed (bash scripts/setup.sh test)")
def test_kvpress_ref_runs_each_job_as_a_process_of_its_own(kvpress_ref, monkeypatch, capsys):
    """A job forked from the shared `--serve` worker sees what `python -c SCRIPT ARGV` in kvpress's
    environment sees (its arguments, path, working directory, versions, an empty stdin), nothing an
    earlier job changed (a patched kvpress class, torch's seed), and fails as a process would."""
    evals = conftest.ROOT / "evals"
    served = [kvpress_ref.run([7, "ok", evals], script=PROBE)]
    started = kvpress_ref.started
    served.append(kvpress_ref.run([7, "ok", evals], script=PROBE))
    seeds = capsys.readouterr().err.split()
    with pytest.raises(subprocess.CalledProcessError) as failed:
        kvpress_ref.run([9, "fail", evals], script=PROBE)
    assert kvpress_ref.started == started >= 1  # one worker served the three jobs
    monkeypatch.setenv("KVP_KVPRESS_SERVER", "0")  # the way before: a subprocess per job
    alone = kvpress_ref.run([7, "ok", evals], script=PROBE)
    assert served[0] == served[1] == alone
    assert alone.splitlines()[-1] == "False" and alone.splitlines()[3:5] == ["__main__", "False"]
    assert len(seeds) == 2 and seeds[0] == seeds[1] != "7"  # the server's seed, not the job before's
    assert failed.value.returncode == 1 and failed.value.output == alone.replace("['7', 'ok'", "['9', 'fail'")
    assert failed.value.stderr.endswith('Traceback (most recent call last):\n  File "<string>", line 13, in <module>\n'
                                        'ValueError: the job failed\n'), failed.value.stderr
