"""Layering: kvpolicies imports neither models nor evals, and no module of kvpolicies, models or
evals imports another module's private (`_name`) names, nor reads them off an imported module."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kvpolicies", "models", "evals")


def modules():
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def private_imports(path: Path, tree: ast.AST) -> list[str]:
    """`from ours import _x`, and `mod._x` where `mod` is one of our modules imported by name."""
    where = path.relative_to(ROOT)
    bad, mods = [], set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in PACKAGES:
            bad += [f"{where}:{node.lineno} from {node.module} import {a.name}" for a in node.names
                    if a.name.startswith("_")]
            mods.update(a.asname or a.name for a in node.names)  # maybe modules (`from kvpolicies import budgets`)
        elif isinstance(node, ast.Import):
            mods.update((a.asname or a.name).split(".")[0] for a in node.names if a.name.split(".")[0] in PACKAGES)
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and isinstance(node.value, ast.Name) and node.value.id in mods):
            bad.append(f"{where}:{node.lineno} {node.value.id}.{node.attr}")
    return bad


def test_no_module_imports_a_private_name_of_another():
    bad = [b for path, tree in modules() for b in private_imports(path, tree)]
    assert not bad, "\n".join(bad)


def test_kvpolicies_imports_neither_models_nor_evals():
    bad = []
    for path, tree in modules():
        if path.relative_to(ROOT).parts[0] != "kvpolicies":
            continue
        for node in ast.walk(tree):
            names = ([node.module or ""] if isinstance(node, ast.ImportFrom)
                     else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
            bad += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in ("models", "evals")]
    assert not bad, "\n".join(bad)
