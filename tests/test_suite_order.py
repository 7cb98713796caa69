"""The file order of scripts/test.sh's pytest-xdist workers (tests/conftest.py LONGEST_FIRST): the
listed files exist, and collection puts them first, in the list's order, each file's tests in
their own order and every other file after them as collected."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import conftest


def test_longest_first_names_each_test_file_once():
    names = conftest.LONGEST_FIRST
    assert len(set(names)) == len(names)
    missing = [n for n in names if not (Path(__file__).parent / n).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names files that do not exist: {missing}"


def test_collection_puts_the_longest_files_first_keeping_each_files_order():
    order = [("test_a.py", 0), ("test_policies.py", 0), ("test_b.py", 0), ("test_a.py", 1), ("test_sharding.py", 0),
             ("test_policies.py", 1)]
    items = [SimpleNamespace(path=Path("/tests") / f, id=f"{f}::{i}") for f, i in order]
    conftest.pytest_collection_modifyitems(None, items)
    assert [x.id for x in items] == ["test_sharding.py::0", "test_policies.py::0", "test_policies.py::1",
                                     "test_a.py::0", "test_b.py::0", "test_a.py::1"]
