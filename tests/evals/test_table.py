"""Issue 38, item 3: paper-ready tables. Rows full first, then by policy and stored bytes; a budget
and a KV / full column; human headers with units; LaTeX as complete booktabs tables (checked by
structure, and compiled by pdflatex when it is installed); foreign or mistyped rows skipped with
one warning line each."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from evals import compare, table


def _row(key, name, state, budget=None, metrics=None, **extra):
    return {"key": key, "task": "perplexity", "policy": {"name": name, "codec": {"name": "none"}}, "params": "",
            "model": {"name": "smollm2", "layers": 30, "kv_heads": 3, "head_dim": 64, "dtype": "float32"},
            "config": {"data": {"name": "austen"}}, "metrics": metrics or {"ppl": 20.0, "tokens_per_s": 100.0},
            "memory": {"state_bytes": state, "max_len": 1024, "dtype": "float32", "layers": 30},
            "budget": budget, **extra}


FULL = 30 * 1024 * (2 * 3 * 64 * 4 + 4)  # full cache of SmolLM2 at 1024 tokens, float32: k, v and a position per slot


def rows():
    return [_row("w2", "window", FULL // 2, {"budget": 0.5, "sized": True}),
            _row("s1", "sink", FULL // 4, {"budget": 0.25, "sized": True}),
            _row("f", "full", FULL),
            _row("w1", "window", FULL // 4, {"budget": 0.25, "sized": True}),
            _row("q", "quest", FULL + 10, {"budget": 0.25, "sized": False, "why": "no token budget"})]


def test_rows_full_first_then_policy_then_budget_with_budget_and_ratio_columns():
    header, body = table.grid(table.by_task(rows())["perplexity"])
    assert header[:9] == ["model", "data", "policy", "params", "codec", "budget", "KV / full", "perplexity", "tok/s"]
    assert header[-1] == "KV cache (MB, 10^6 B)"
    assert [(c[2], c[5], c[6]) for c in body] == [("full", "-", "1.000"), ("quest", "0.25 (not sized)", "1.000"),
                                                   ("sink", "0.25", "0.250"), ("window", "0.25", "0.250"),
                                                   ("window", "0.5", "0.500")]


def _check_complete_tables(tex: str) -> int:
    """Every table environment complete and balanced; every tabular row has as many cells as columns."""
    envs = re.findall(r"\\(begin|end)\{(table|tabular)\}", tex)
    depth = []
    for kind, env in envs:
        if kind == "begin":
            depth.append(env)
        else:
            assert depth and depth.pop() == env
    assert not depth
    n = 0
    for block in re.findall(r"\\begin\{table\}.*?\\end\{table\}", tex, flags=re.S):
        assert "\\caption{" in block and "\\label{tab:" in block and "\\toprule" in block and "\\bottomrule" in block
        spec = re.search(r"\\begin\{tabular\}\{([lrc]+)\}", block).group(1)
        body = block.split("\\toprule", 1)[1].split("\\bottomrule", 1)[0]
        for line in body.splitlines():
            if line.endswith("\\\\"):
                assert len(re.split(r"(?<!\\)&", line)) == len(spec), line
        n += 1
    return n


def _pdflatex(tex: str, tmp_path) -> None:
    if shutil.which("pdflatex") is None:
        return
    doc = tmp_path / "t.tex"
    doc.write_text("\\documentclass{article}\\usepackage{booktabs,graphicx}\\begin{document}\n" + tex
                   + "\n\\end{document}\n")
    run = subprocess.run(["pdflatex", "-interaction=nonstopmode", "-halt-on-error", doc.name], cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:]
    assert (tmp_path / "t.pdf").stat().st_size > 0


def test_table_latex_is_complete_and_compiles(tmp_path):
    tex = table.latex(rows())
    assert _check_complete_tables(tex) == 1
    assert "$10^{6}$" in tex
    _pdflatex(tex, tmp_path)


def test_compare_latex_is_complete_and_compiles(tmp_path):
    recs = [{"policy": "full", "budget": None, "compression": 0.0, "score": 18.2, "lower": True, "metric": "ppl",
             "state_bytes": FULL, "ci_low": None, "ci_high": None}]
    recs += [{"policy": p, "budget": b, "compression": 1 - b, "score": 19.0 + b, "lower": True, "metric": "ppl",
              "state_bytes": int(FULL * b), "ci_low": None, "ci_high": None}
             for p in ("sink", "h2o") for b in (0.25, 0.5)]
    tex = compare.latex(recs, "perplexity: smollm2 on austen, 1024 tokens", "tab:perplexity-smollm2-1024")
    assert _check_complete_tables(tex) == 1 and tex.count("\\midrule") == 2  # header rule + after the full row
    _pdflatex(tex, tmp_path)


def test_foreign_and_mistyped_rows_are_one_warning_line_each(tmp_path, capsys):
    import json

    res = tmp_path / "r.jsonl"
    good = _row("f", "full", FULL)
    bad = [{"hello": "world"}, {**_row("x", "sink", 5), "metrics": {"ppl": "high"}}, {**_row("y", "sink", 5), "memory": "big"}]
    res.write_text("\n".join(json.dumps(r) for r in [good, *bad]) + "\n")
    table.main([str(res)])
    cap = capsys.readouterr()
    warned = [line for line in cap.err.splitlines() if "not a results row" in line]
    assert len(warned) == 3 and all(line.startswith("evals.table: warning:") for line in warned)
    assert ", line 2: not a results row (its 'key' is missing)" in warned[0]
    assert "| smollm2 | austen | full |" in cap.out and "Traceback" not in cap.err
