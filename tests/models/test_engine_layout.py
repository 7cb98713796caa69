"""`models/engine/` asks policies, not names: no module of the package imports a concrete policy
class (or any class) from kvpolicies, only the protocol's base class and capability functions; the
package is split by job, each module a readable size."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import kvpolicies
from kvpolicies.base import Policy

PACKAGE = Path(__file__).resolve().parents[2] / "models" / "engine"


def _kvpolicies_imports() -> dict[str, list[str]]:
    out = {}
    for path in sorted(PACKAGE.glob("*.py")):
        names = []
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kvpolicies"):
                names += [f"{node.module}.{a.name}" for a in node.names]
        out[path.name] = names
    return out


def test_the_engine_imports_no_concrete_policy():
    concrete = {type(kvpolicies.get(n)).__name__ for n in kvpolicies.POLICIES if n != "duo"} | {"Duo"}
    imported = _kvpolicies_imports()
    assert any(imported.values())  # the scan sees the imports
    for module, names in imported.items():
        for full in names:
            mod, name = full.rsplit(".", 1)
            obj = getattr(__import__(mod, fromlist=[name]), name)
            assert name not in concrete, f"models/engine/{module} imports the policy {full}"
            if inspect.isclass(obj) and issubclass(obj, Policy):
                assert obj is Policy, f"models/engine/{module} imports the policy class {full}"


def test_the_package_is_split_by_job():
    sizes = {p.name: len(p.read_text().splitlines()) for p in PACKAGE.glob("*.py")}
    assert {"core.py", "checks.py", "steps.py", "staged.py", "generation.py"} <= set(sizes)
    assert max(sizes.values()) <= 300, sizes
