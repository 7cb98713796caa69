"""The file order of scripts/test.sh's pytest-xdist workers (tests/conftest.py): files run longest
first by the durations recorded in tests/durations.json, per stage, never-recorded files first,
each file's tests in their own order."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

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
