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


# -- models/ asks policies through capabilities; no import circle ------------------------------------
# The kvpolicies modules models/ may import: the library's root (attend, Rope, the registry) and the
# capability modules (the protocol, budgets and fitting, prompt compression and reconstruction, slot
# layouts, presets, attention, RoPE, memory, checks and limits). A policy's own module (kvzip, adakv,
# full...) is never named there: the engine asks a policy through a capability class.
CAPABILITY_MODULES = ("kvpolicies", "kvpolicies.base", "kvpolicies.budgets", "kvpolicies.prompt", "kvpolicies.slots",
                      "kvpolicies.presets", "kvpolicies.attend", "kvpolicies.attention", "kvpolicies.rope",
                      "kvpolicies.memory", "kvpolicies.checks", "kvpolicies.limits")
GRAPH_PACKAGES = PACKAGES + ("benchmarks",)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    return {module_name(p): p for pkg in GRAPH_PACKAGES for p in sorted((ROOT / pkg).rglob("*.py"))}


def imported(tree: ast.AST, name: str, is_package: bool, known: set[str] | dict) -> list[tuple[int, str]]:
    """(line, module) of every import of a project module in `tree` (module `name`): at module
    level, under `if TYPE_CHECKING:` and inside functions alike. `from pkg import x` is module
    pkg.x when that is a module, else pkg."""
    here = name if is_package else name.rpartition(".")[0]
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names if a.name in known]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = here.split(".")[:len(here.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            for a in node.names:
                sub = f"{base}.{a.name}"
                if sub in known:
                    out.append((node.lineno, sub))
                elif base in known:
                    out.append((node.lineno, base))
    return out


def concrete_policy_imports(path: Path, tree: ast.AST, known) -> list[str]:
    """Imports of a kvpolicies module that is not a capability module (`CAPABILITY_MODULES`)."""
    name = module_name(path)
    found = imported(tree, name, path.name == "__init__.py", known)
    return [f"{path.relative_to(ROOT)}:{line} imports {mod}" for line, mod in found
            if mod.split(".")[0] == "kvpolicies" and mod not in CAPABILITY_MODULES
            and not mod.startswith("kvpolicies.attention.")]  # attention's rooms


def test_models_import_no_concrete_policy_module():
    known = project_modules()
    bad = [b for path in sorted((ROOT / "models").rglob("*.py"))
           for b in concrete_policy_imports(path, ast.parse(path.read_text()), known)]
    assert not bad, ("models/ imports a policy's own module; ask the policy through a capability class "
                     "(kvpolicies.prompt, budgets, slots, presets...) instead:\n" + "\n".join(bad))


def test_the_concrete_import_check_can_fail():
    known = project_modules()
    src = "import jax\nfrom kvpolicies.prompt import after_prompt\nfrom kvpolicies import kvzip\n" \
          "def f():\n    from kvpolicies.adakv import fit_pool\n"
    bad = concrete_policy_imports(ROOT / "models" / "x.py", ast.parse(src), known)
    assert [b.split(" imports ")[1] for b in bad] == ["kvpolicies.kvzip", "kvpolicies.adakv"]


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycle():
    """No two modules of kvpolicies, models, evals, benchmarks import each other, directly or
    through others, counting imports under TYPE_CHECKING and inside functions (a deferred import
    is a circle that only waits)."""
    known = project_modules()
    graph = {name: {m for _, m in imported(ast.parse(path.read_text()), name, path.name == "__init__.py", known)}
             - {name} for name, path in known.items()}
    cycles = import_cycles(graph)
    assert not cycles, "import circles (break each: move the shared code down, or ask through a capability):\n" + \
        "\n".join(" <-> ".join(c) for c in cycles)
    assert import_cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]  # it can fail
