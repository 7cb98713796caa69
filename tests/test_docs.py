"""The documentation: the site builds with warnings as errors, README stays a short user's guide,
and every command in README.md and docs/guide/*.md is either run by a test or checked here.

A command is found in a fenced shell block, an indented block or an inline code span that starts
with `python -m`, `.venv/bin/python`, `bash scripts/` or `mkdocs`. "Checked" means: its module
exists and its arguments parse without running the work:
- `evals.run`: every job of the command line is composed and validated (`evals.run.preflight`:
  config keys, policy fields, model and data files, lengths, memory, results location);
- `evals.compare`: every job is sized and validated (`evals.compare.plans`), `evals.suite` every
  task's comparison;
- any other module: its own argparse parser accepts the arguments (its `parse_args` is stopped
  right after parsing, so nothing is computed);
- `bash scripts/X.sh`: the script exists and takes the arguments given.
`RUN_BY` lists the commands a test runs as written, and which test; `NOT_CHECKED` the fragments
that are not whole commands (with the reason). `python -m pytest tests/test_docs.py -s -k list`
prints which command is covered how.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import runpy
import shlex
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md"] + sorted((ROOT / "docs" / "guide").glob("*.md"))

# commands a test (or CI itself) runs exactly as written -> where
RUN_BY = {
    "bash scripts/test.sh": ".ci/run",
    "bash scripts/setup.sh": ".ci/run (scripts/test.sh runs `bash scripts/setup.sh test`)",
    "bash scripts/setup.sh test": ".ci/run (scripts/test.sh)",
    "python -m kvpolicies.budgets --budget 0.25": "tests/kvpolicies/test_budgets.py::test_the_readme_table_command",
    "python examples/flax_nnx_attention.py": "tests/examples/test_flax_nnx_attention.py::test_example_main_runs",
    "mkdocs build --strict": "tests/test_docs.py::test_site_builds_with_warnings_as_errors",
    "mkdocs serve": "tests/test_docs.py::test_site_builds_with_warnings_as_errors (the same site, served)",
    "python -m evals.run --help": "tests/test_docs.py::test_help_and_cfg_job_commands",
    "python -m evals.run policy=h2o budget=0.25 --cfg job": "tests/test_docs.py::test_help_and_cfg_job_commands",
    "python -m evals.run --cfg job policy=sink window=1024": "tests/test_docs.py::test_help_and_cfg_job_commands",
    "python -m evals.run tokens=100000 policy=sink window=4096 results=/tmp/evals_demo.jsonl --cfg job":
        "tests/test_docs.py::test_help_and_cfg_job_commands",
    "python -m evals.run policy=window budget=0.5 window=4096": "tests/test_docs.py::test_the_guide_s_error_example_"
                                                                 "is_refused (docs/guide/evals.md shows it as an error)",
    "python -m tests.refs.sharding_check all": "tests/models/test_sharding.py::test_every_policy_on_a_data_x_model_mesh_equals_one_device "
                                               "(in a subprocess with 8 CPU devices)",
    "python -m evals.planner --model llama-3-8b --context 32K --gpu-gb 80 --overhead-gb 12 --policy full "
    "sink:window=4096 window:window=8192 full:codec=int8": "tests/test_docs.py::test_planner_command_prints_the_guide_s_table",
}
# inline fragments of prose, not whole commands -> why they are not checked
NOT_CHECKED = {
    "python -m evals.run ... mesh=[2,4]": "a fragment (any run + mesh=); a 2 x 4 mesh needs 8 devices: "
                                          "tests/models/test_sharding.py runs meshes on 8 CPU devices",
    "bash scripts/test.sh ARGS": "ARGS stands for pytest's arguments",
    "python -m evals.run policy=valuenorm budget=0.25": "docs/guide/writing-a-policy.md: valuenorm is registered "
                                                         "by the reader in its step 1 (its class is run by a test)",
    "python -m evals.compare task=perplexity tokens=4096 policies=[sink,h2o,valuenorm]": "the same (step 1 first)",
    "python -m evals.run policy=h2o policy.prompt=stream ...": "a fragment: how a field is set (any run + "
                                                               "policy.prompt=stream)",
    "bash scripts/gpu_check.sh OUT": "OUT stands for a folder; tests/benchmarks/test_benchmarks.py dry-runs benchmarks.gpu",
}

_START = r"(?:\.venv/bin/)?(?:python|mkdocs)\b|bash scripts/|taskset "


def _logical_lines(body: str) -> list[str]:
    body = body.replace("\\\n", " ")
    return [ln.strip() for ln in body.splitlines() if re.match(_START, ln.strip())]


def doc_commands(path: Path) -> list[str]:
    """Every command of one Markdown file, in order, as written (whitespace normalised)."""
    text = path.read_text()
    found = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M):
        if m.group(1) in ("bash", "sh", "console", ""):
            found += _logical_lines(m.group(2))
    for m in re.finditer(r"(?:^\n)((?:^    .*\n?)+)", text, flags=re.M):
        found += _logical_lines("\n".join(x[4:] for x in m.group(1).splitlines()))
    for m in re.finditer(r"`((?:\.venv/bin/)?python\s+(?:-m\s|examples/)[^`]+|bash scripts/[^`]+|(?:\.venv/bin/)?mkdocs [^`]+)`",
                         text):
        found.append(m.group(1))  # inline: `python -m evals.plots` alone names the module (checked: it exists)
    return [" ".join(c.split()) for c in found]


def simple_commands(command: str) -> list[str]:
    """`a && b  # comment` -> ["a", "b"], the venv's prefix dropped (`.venv/bin/python` -> `python`)."""
    command = re.sub(r"\s+#.*$", "", command)
    parts = [p.strip() for p in command.split("&&")]
    return [re.sub(r"^\.venv/bin/", "", re.sub(r"^taskset -c \d+ ", "", p)) for p in parts if p.strip()]


def all_commands() -> list[tuple[str, str]]:
    return [(str(p.relative_to(ROOT)), c) for p in DOCS for cmd in doc_commands(p) for c in simple_commands(cmd)]


class _Parsed(Exception):
    """Raised from a patched ArgumentParser.parse_args: the arguments parsed, stop before the work."""


def check_argparse(module: str, args: list[str]) -> None:
    """Run `python -m module args` in this process up to its argparse parse, which must accept args."""
    real = argparse.ArgumentParser.parse_args

    def parse_only(self, a=None, namespace=None):
        real(self, a, namespace)  # exits 2 (SystemExit) on an unknown option or a bad value
        raise _Parsed

    saved = sys.argv
    sys.argv = [module] + args
    argparse.ArgumentParser.parse_args = parse_only
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # runpy: the module was imported before
            runpy.run_module(module, run_name="__main__", alter_sys=False)
    except _Parsed:
        return
    except SystemExit as e:
        if e.code not in (0, None):
            raise AssertionError(f"python -m {module} {' '.join(args)}: exit {e.code}\n{out.getvalue()[-2000:]}")
        return  # --help
    finally:
        argparse.ArgumentParser.parse_args = real
        sys.argv = saved
    raise AssertionError(f"python -m {module}: never parsed its arguments with argparse")


def check(command: str) -> str:
    """Check one simple command without running its work; returns how it was checked."""
    if command in RUN_BY:
        return "run by " + RUN_BY[command]
    if command in NOT_CHECKED:
        return "not checked: " + NOT_CHECKED[command]
    tokens = shlex.split(command)
    if tokens[0] == "bash":
        script = ROOT / tokens[1]
        assert script.is_file(), f"{command}: no {tokens[1]}"
        if tokens[1] == "scripts/setup.sh":
            assert tokens[2:] in ([], ["test"], ["long"]), f"{command}: setup.sh takes nothing, `test` or `long`"
        return "script exists"
    assert tokens[:2] == ["python", "-m"], f"{command}: neither `python -m`, `bash scripts/` nor listed in RUN_BY"
    module, args = tokens[2], tokens[3:]
    if module == "pytest":  # a test selection: the suite runs it; its files must exist (never run here)
        files = [a.split("::")[0] for a in args if a.startswith("tests/")]
        assert files and all((ROOT / f).is_file() for f in files), f"{command}: names no existing test file"
        return "a test selection the suite runs (its files exist)"
    if not args:  # the module named in prose (its use is shown elsewhere): it must exist
        assert importlib.util.find_spec(module) is not None, f"{command}: no module {module}"
        return "module exists"
    if module == "evals.run":
        from evals.run import job_overrides, preflight

        assert not any(a.startswith("--") for a in args), f"{command}: flags of evals.run belong in RUN_BY"
        n_jobs, _ = preflight(args)
        assert n_jobs == len(job_overrides(args))
        return f"evals.run.preflight: {n_jobs} job(s) validated"
    if module == "evals.compare":
        from evals.compare import plans

        return f"evals.compare.plans: {sum(len(p.jobs) for p in plans(args))} jobs sized and validated"
    if module == "evals.suite":
        from evals import compare, suite

        a = suite.parse_args(args)
        n = sum(len(compare.plan(suite.task_argv(a, t)).jobs) for t in a.tasks)
        return f"evals.suite: {len(a.tasks)} tasks, {n} jobs sized and validated"
    if module == "evals.peer":
        from evals import peer

        if args == ["--help"]:
            return "run by tests/evals/test_peer.py::test_help"
        plan = peer.prepare(peer.parse(args))
        return f"evals.peer.parse + prepare: {len(plan.cells)} rows x {plan.samples} samples built"
    if module == "evals.leaderboard":  # key=value: its parser and the first task's prompts (main would run them)
        from evals import leaderboard, peer

        b = leaderboard.parse(args)  # every key, task and press; the first run's prompts built (tokenizer only)
        peer.prepare(b.plans[0])
        return f"evals.leaderboard.parse: {len(b.plans)} evals.peer runs checked, the first one's prompts built"
    if module == "benchmarks.first_call":  # key=value (main would load the model in subprocesses)
        from kvpolicies.compat import PRESSES

        kw = dict(a.split("=", 1) for a in args)
        assert set(kw) <= {"presses", "tokens", "out"}, f"{command}: unknown key"
        assert set(kw.get("presses", "SnapKVPress").split(",")) <= set(PRESSES), f"{command}: unknown press"
        return "benchmarks.first_call: keys and presses checked"
    if module == "benchmarks.peer_speed":  # key=value: its parser (main would run both sides)
        from benchmarks import peer_speed

        redraw = [a.split("=", 1)[1] for a in args if a.startswith("redraw=")]
        if redraw:
            runs = [ROOT / x.split(":", 1)[1] for x in redraw[0].split(",")]
            assert all(r.is_file() for r in runs), f"{command}: a saved run is missing"
            return "redraws saved runs (their files exist)"
        plan, side, _, _, _ = peer_speed.parse(args)
        return f"benchmarks.peer_speed.parse: {len(plan.cells)} rows x {plan.samples} samples, side={side}"
    if module == "evals.train_kvzap":  # key=value, not argparse: its parser only (main would train)
        from evals import train_kvzap

        cfg = train_kvzap.parse(args)
        return f"evals.train_kvzap.parse: kind={cfg['kind']}, {cfg['steps']} steps"
    check_argparse(module, args)
    return "its argparse parser accepts the arguments"


def test_readme_is_a_short_guide():
    text = (ROOT / "README.md").read_text()
    assert len(text.splitlines()) <= 350
    for command in ("bash scripts/setup.sh && .venv/bin/python -m evals.run policy=sink window=4096",
                    "bash scripts/test.sh"):
        assert f"```bash\n{command}\n```" in text  # the two commands, exactly


def test_site_builds_with_warnings_as_errors(tmp_path):
    """`mkdocs build --strict`: broken links and anchors, missing pages and API objects fail."""
    proc = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-q", "-d", str(tmp_path / "site")],
                          cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env={**__import__("os").environ, "NO_MKDOCS_2_WARNING": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "policies" / "index.html").read_text()
    assert "kvpolicies.sink" in api and "StreamingLLM" in api  # the docstrings are in the reference


@pytest.mark.slow  # loads the real models' tokenizers (SmolLM2, Qwen, Gemma 3) to check the texts' lengths
def test_every_command_in_readme_and_guide_is_run_or_checked():
    commands = all_commands()
    assert len(commands) > 30  # the extraction finds them (README alone has ~20)
    failures = []
    for where, command in dict.fromkeys(commands):
        try:
            check(command)
        except BaseException as e:  # SystemExit from a parser, ConfigError, AssertionError
            failures.append(f"{where}: {command}\n    {type(e).__name__}: {str(e)[:400]}")
    assert not failures, "\n".join(failures)


def test_the_checks_can_fail():
    """A wrong option, a wrong key and a missing script are caught."""
    from evals.config import ConfigError

    with pytest.raises(AssertionError, match="exit 2"):
        check("python -m evals.table results/results.jsonl --no-such-option")
    with pytest.raises(ConfigError):
        check("python -m evals.run policy=sink no_such_key=1")
    with pytest.raises(ConfigError):
        check("python -m evals.compare task=perplexity tokens=1024 policies=[nope]")
    with pytest.raises(AssertionError, match="no scripts"):
        check("bash scripts/no_such.sh")
    assert simple_commands(".venv/bin/python -m a x=1 && bash scripts/b.sh  # c") == ["python -m a x=1",
                                                                                      "bash scripts/b.sh"]


def test_listed_commands_are_in_the_docs():
    """RUN_BY and NOT_CHECKED name commands the docs still hold (no stale entries)."""
    found = {c for _, c in all_commands()}
    stale = [c for c in list(RUN_BY) + list(NOT_CHECKED) if c not in found and c != "mkdocs serve"]
    assert not stale, stale


@pytest.mark.slow  # two processes that import JAX and Hydra
def test_help_and_cfg_job_commands():
    """README's `--help` lists the groups and `--cfg job` prints the composed, sized job."""
    env = {**__import__("os").environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-m", "evals.run", "--help"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env=env).stdout
    assert "policy: adakv" in out and "task:" in out and "window: 4096" in out
    proc = subprocess.run([sys.executable, "-m", "evals.run", "policy=h2o", "budget=0.25", "--cfg", "job"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "name: h2o" in proc.stdout and "budget: 0.25" in proc.stdout
    for args, says in ((["--cfg", "job", "policy=sink", "window=1024"], "window: 1024"),
                       (["tokens=100000", "policy=sink", "window=4096", "results=/tmp/evals_demo.jsonl", "--cfg", "job"],
                        "tokens: 100000")):  # docs/guide/evals.md's two (the config only: nothing runs)
        proc = subprocess.run([sys.executable, "-m", "evals.run", *args], cwd=ROOT, capture_output=True, text=True,
                              timeout=300, env=env)
        assert proc.returncode == 0 and says in proc.stdout and "name: sink" in proc.stdout, proc.stderr[-2000:]


def test_the_guide_s_error_example_is_refused():
    """docs/guide/evals.md: `policy=window budget=0.5 window=4096` is an error (both size the cache)."""
    from evals.config import ConfigError
    from evals.run import preflight

    with pytest.raises(ConfigError, match="both size the cache"):
        preflight(["policy=window", "budget=0.5", "window=4096"])


def test_planner_command_prints_the_guide_s_table(capsys):
    """docs/guide/budgets.md's planner command prints the table shown under it."""
    from evals import planner

    page = (ROOT / "docs" / "guide" / "budgets.md").read_text()
    command = next(c for c in doc_commands(ROOT / "docs" / "guide" / "budgets.md") if "--gpu-gb 80" in c)
    planner.main(shlex.split(command)[3:])
    out = capsys.readouterr().out
    shown = re.search(r"```\n(policy .*?)```", page, flags=re.S).group(1)
    printed = [ln.split() for ln in out.strip().splitlines() if not ln.startswith("---")]
    assert [ln.split() for ln in shown.splitlines()] == printed[-5:]


def test_list_how_each_command_is_covered():
    """`-s` prints one line per command: where, the command, how it is run or checked."""
    for where, command in dict.fromkeys(all_commands()):
        how = "run by " + RUN_BY[command] if command in RUN_BY else (
            "not checked: " + NOT_CHECKED[command] if command in NOT_CHECKED else "checked (test above)")
        print(f"{where}: {command}  ->  {how}")


def test_python_blocks_parse_and_their_imports_resolve():
    """README's ```python blocks compile, and every name they import exists (the API they show)."""
    import ast
    import importlib

    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "README.md").read_text(), flags=re.S | re.M)
    assert len(blocks) >= 3
    for block in blocks:
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for a in node.names:
                    importlib.import_module(a.name)
            elif isinstance(node, ast.ImportFrom):
                mod = importlib.import_module(node.module)
                missing = [a.name for a in node.names if not hasattr(mod, a.name)]
                assert not missing, f"from {node.module} import {missing}: not there"
    import kvpolicies
    from kvpolicies import budgets, memory

    assert "sink" in kvpolicies.POLICIES and callable(budgets.sized) and callable(memory.state_bytes)


def test_writing_a_policy_scorer_runs_and_keeps_the_largest_value_norms():
    """docs/guide/writing-a-policy.md's scorer, run through `kvpolicies.attend` on one chunk (a scan
    of one-token steps): the kept tokens are each KV head's `budget` largest value norms (numpy)."""
    import types

    import jax
    import jax.numpy as jnp
    import numpy as np

    import kvpolicies

    page = (ROOT / "docs" / "guide" / "writing-a-policy.md").read_text()
    block = re.findall(r"^```python\n(.*?)^```", page, flags=re.S | re.M)[0]
    mod = types.ModuleType("docs_valuenorm")
    sys.modules[mod.__name__] = mod  # dataclasses look their module up
    exec(compile(block, "writing-a-policy.md", "exec"), mod.__dict__)
    B, T, N, K, D, budget = 1, 24, 4, 2, 8, 6
    pol = mod.ValueNorm(budget=budget)
    q, k, v = (jax.random.normal(key, (B, T, h, D)) for key, h in zip(jax.random.split(jax.random.PRNGKey(0), 3),
                                                                        (N, K, K)))
    pos = jnp.arange(T, dtype=jnp.int32)[None]  # [B, T]
    state = pol.init(B, K, D, jnp.float32, 64)
    out, state = kvpolicies.attend(pol, state, q, k, v, pos, kvpolicies.Rope(D))
    kept = np.sort(np.asarray(state.pos)[0], axis=-1)  # [K, budget]
    norms = np.linalg.norm(np.asarray(v, np.float64)[0], axis=-1)  # [T, K]
    want = np.sort(np.argsort(-norms, axis=0)[:budget].T, axis=-1)  # [K, budget]
    assert out.shape == (B, T, N, D) and kept.shape == (K, budget)
    np.testing.assert_array_equal(kept, want)
    assert not np.array_equal(kept[0], np.arange(T - budget, T))  # not merely the newest tokens


def layout_modules(text: str) -> set[str]:
    """The module paths the tree of docs/design/layout.md names: a `name/` line opens a folder (its
    indent says its parent), a line's leading `x.py` words are files of the folder it sits in."""
    block = re.search(r"^```\n(.*?)^```", text, flags=re.S | re.M).group(1)
    folders: list[tuple[int, str]] = []  # (indent, name) of the open folders
    named = set()
    for line in block.splitlines():
        words, indent = line.split(), len(line) - len(line.lstrip())
        if not words:
            continue
        while folders and folders[-1][0] >= indent:
            folders.pop()
        if words[0].endswith("/"):
            folders.append((indent, words[0].rstrip("/")))
            continue
        for w in words:
            if not re.fullmatch(r"\w+\.py", w.rstrip(",:")):
                break
            named.add("/".join([f for _, f in folders] + [w.rstrip(",:")]))
    return named


def test_layout_names_every_module():
    """docs/design/layout.md names every .py module of kvpolicies/, models/ and evals/ (and only
    modules that exist), each under its folder."""
    named = layout_modules((ROOT / "docs" / "design" / "layout.md").read_text())
    packages = ("kvpolicies", "models", "evals")
    have = {str(p.relative_to(ROOT)) for pkg in packages for p in (ROOT / pkg).rglob("*.py")}
    missing = sorted(have - named)
    stale = sorted(n for n in named if n.split("/")[0] in packages and n not in have)
    assert not missing, ("docs/design/layout.md does not name these modules; give each a line in the tree, "
                         "under its folder, saying what it holds:\n" + "\n".join(missing))
    assert not stale, "docs/design/layout.md names modules that do not exist:\n" + "\n".join(stale)
    assert layout_modules("```\na/\n  b.py c.py: x\n  d/\n    e.py  y\nf.py\n```\n") == {"a/b.py", "a/c.py", "a/d/e.py",
                                                                                          "f.py"}


def test_run_index_lists_every_run_file():
    """docs/results/runs/index.md has a row for every saved run in its folder and its subfolders (by relative
    path), and names no missing file."""
    runs = ROOT / "docs" / "results" / "runs"
    listed = set(re.findall(r"^\| `([^`]+)` \|", (runs / "index.md").read_text(), flags=re.M))
    have = {p.relative_to(runs).as_posix() for p in runs.rglob("*") if p.is_file() and p.name != "index.md"}
    assert not have - listed, f"runs without a row in docs/results/runs/index.md: {sorted(have - listed)}"
    assert not listed - have, f"rows of docs/results/runs/index.md without their file: {sorted(listed - have)}"


def run_page_code(page: str) -> dict:
    """Every ```python block of docs/guide/<page>, in order, in one fresh module (registered while
    it runs, as dataclasses and the task registry look a module up); returns its namespace."""
    import types

    blocks = re.findall(r"^```python\n(.*?)^```", (ROOT / "docs" / "guide" / page).read_text(), flags=re.S | re.M)
    assert blocks, f"docs/guide/{page} has no python block"
    mod = types.ModuleType("docs_" + page.removesuffix(".md").replace("-", "_"))
    sys.modules[mod.__name__] = mod
    try:
        for i, block in enumerate(blocks):
            exec(compile(block, f"docs/guide/{page} (python block {i + 1})", "exec"), mod.__dict__)
    finally:
        del sys.modules[mod.__name__]
    return mod.__dict__


def test_model_family_guide_runs():
    """docs/guide/model-family.md: its tiny family satisfies the model protocol, and the engine
    streaming it under `full` equals its one forward pass (the page's own checks); Llama
    satisfies the protocol too."""
    from models.config import LlamaConfig
    from models.llama import Llama
    from models.protocol import LanguageModel

    page = run_page_code("model-family.md")
    assert isinstance(page["model"], LanguageModel) and page["ours"].shape == (2, 8)
    cfg = LlamaConfig(vocab_size=32, d_model=16, n_layers=1, n_heads=2, n_kv_heads=1, head_dim=8, d_ff=16)
    assert isinstance(Llama(cfg), LanguageModel)
    assert not isinstance(object(), LanguageModel)  # the check can fail


def test_eval_task_guide_runs():
    """docs/guide/eval-task.md: its tiny task, registered in code with no config file, runs through
    evals.run under full (agreement 1.0) and window (the page's own checks); the registration is
    undone after."""
    from evals.config import TASKS, ConfigError, compose, validate

    try:
        page = run_page_code("eval-task.md")
        assert page["window_row"]["task"] == "agree"
        with pytest.raises(ConfigError, match="task.gen=0: must be an int >= 1"):  # its check, before any job
            validate(compose(["model=tiny_random", "task=agree", "task.gen=0"]))
    finally:
        TASKS.pop("agree", None)


def test_changelog_is_short_by_version_without_numbers():
    """CHANGELOG.md: at most 100 lines, sections by version, no measured numbers (those live in
    docs/results): no decimal figure, no count of seconds, bytes, percent or speed-up."""
    text = (ROOT / "CHANGELOG.md").read_text()
    assert len(text.splitlines()) <= 100
    assert re.search(r"^## \d+\.\d+\.\d+", text, flags=re.M), "no `## <version>` section"
    numbers = re.findall(r"(?<![\w.])\d+\.\d+(?![\d.])|\b\d+(?:\.\d+)?\s?(?:s|ms|min|h|MB|GB|MiB|KB|%|x|×)(?!\w)", text)
    assert not numbers, f"measured numbers in CHANGELOG.md (they belong in docs/results): {numbers}"
