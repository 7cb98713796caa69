"""Issue 38, items 3 and 4: figures and outputs. Pareto labels nudged apart (no two overlap), log
byte axes with a tick at each point, a warning when every line has a single point; compare and
plots refuse to overwrite outputs of another comparison / other results without being told."""

from __future__ import annotations

import json
import warnings

import matplotlib.pyplot as plt
import pytest

from evals import compare, plots
from evals.common import wilson
from evals.config import ConfigError


def _row(key, name, params, state, ppl, curve=None):
    return {"key": key, "task": "perplexity", "policy": {"name": name, "codec": {"name": "none"}}, "params": params,
            "model": {"name": "smollm2"}, "config": {"data": {"name": "austen"}, "task": {"segment": 1024}},
            "metrics": {"ppl": ppl}, "memory": {"state_bytes": state}, "curves": curve or {}}


def test_pareto_labels_do_not_overlap_and_ticks_sit_at_the_points():
    # eight runs at nearly the same size and quality: their labels would sit on one another
    pts = [(_row(str(i), "sink", f"n_sink=4 window={1000 + i}", 5_900_000 + 1000 * i, 19.0 + 0.01 * i),
            ("ppl", 19.0 + 0.01 * i, True)) for i in range(8)]
    pts.append((_row("f", "full", "", 47_300_000, 18.15), ("ppl", 18.15, True)))
    fig, texts = plots.pareto_figure("perplexity", pts, "ppl", True)
    fig.canvas.draw()
    r = fig.canvas.get_renderer()
    from matplotlib.text import Text

    boxes = [Text.get_window_extent(t, r) for t in texts]
    assert all(not a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:])
    ax = fig.axes[0]
    assert ax.get_xscale() == "log"
    ticks = [float(t) for t in ax.get_xticks()]
    assert ticks[0] == pytest.approx(5.9) and ticks[-1] == pytest.approx(47.3) and len(ticks) == 2  # 5.9..5.907 share one
    plt.close(fig)


def test_a_plot_with_one_point_per_line_warns(tmp_path):
    rows = [_row("a", "sink", "window=64", 1, 20.0, {"position": [1024], "ppl": [20.0]}),
            _row("b", "full", "", 2, 18.0, {"position": [1024], "ppl": [18.0]})]
    with pytest.warns(UserWarning, match=r"perplexity_vs_position: a single point per line .*task.segment="):
        plots.plot_perplexity(rows, tmp_path)
    rows[0]["curves"] = {"position": [512, 1024], "ppl": [21.0, 20.0]}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plots.plot_perplexity(rows, tmp_path)


def test_compare_refuses_to_overwrite_another_comparison(tmp_path):
    (tmp_path / "s.csv").write_text("policy,key\nfull,aaa\nsink,bbb\n")
    compare.check_outputs(tmp_path, "s", ["aaa", "bbb"], overwrite=False)  # the same comparison: rewritten
    compare.check_outputs(tmp_path, "other", ["ccc"], overwrite=False)  # another name: nothing there
    with pytest.raises(ConfigError, match=r"holds another comparison .*overwrite=true"):
        compare.check_outputs(tmp_path, "s", ["aaa", "ccc"], overwrite=False)
    compare.check_outputs(tmp_path, "s", ["aaa", "ccc"], overwrite=True)


def test_compare_refuses_before_any_job_runs(tmp_path, text_file):
    out = tmp_path / "out"
    out.mkdir()
    (out / "s.png").write_bytes(b"an earlier figure")
    argv = ["model=tiny_random", "data=path", f"data.path={text_file}", "tokens=64", f"results={tmp_path / 'r.jsonl'}",
            "policies=[sink]", "budgets=[0.5]", f"out={out}", "name=s", "progress=false"]
    with pytest.raises(ConfigError, match="holds another comparison"):
        compare.plan(argv)
    assert not (tmp_path / "r.jsonl").exists()
    assert compare.plan(argv + ["overwrite=true"]).stem == "s"


def test_plots_refuse_figures_of_other_results_without_force(tmp_path, capsys):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    curve = {"position": [512, 1024], "ppl": [21.0, 20.0]}
    a.write_text(json.dumps(_row("k1", "sink", "window=64", 1, 20.0, curve)) + "\n")
    b.write_text(json.dumps(_row("k2", "full", "", 2, 18.0, curve)) + "\n")
    out = tmp_path / "figs"
    plots.main([str(a), "--out", str(out)])
    plots.main([str(a), "--out", str(out)])  # the same results again: fine
    with pytest.raises(SystemExit):
        plots.main([str(b), "--out", str(out)])
    assert "pass --force" in capsys.readouterr().err
    plots.main([str(b), "--out", str(out), "--force"])


def test_multiturn_rows_draw_accuracy_per_turn_with_their_intervals(tmp_path):
    def turns(key, name, acc):
        m = {"accuracy": sum(acc) / len(acc)}
        for i, a in enumerate(acc):
            lo, hi = wilson(4 * a, 4)
            m |= {f"accuracy_t{i}": a, f"ci_low_t{i}": lo, f"ci_high_t{i}": hi}
        return {"key": key, "task": "multiturn", "policy": {"name": name, "codec": {"name": "none"}}, "params": "",
                "model": {"name": "smollm2"}, "config": {"task": {"name": "multiturn", "mode": "once"}},
                "metrics": m, "memory": {"state_bytes": 1000}}

    rows = [turns("a", "full", [1.0, 1.0, 0.75]), turns("b", "snapkv", [1.0, 0.5, 0.25])]
    got = plots.turn_series(rows[1])
    assert got[0] == [0, 1, 2]
    m = rows[1]["metrics"]
    assert got[1].tolist() == [[1.0, 0.5, 0.25], [m[f"ci_low_t{i}"] for i in range(3)],
                               [m[f"ci_high_t{i}"] for i in range(3)]]
    assert plots.turn_series(_row("c", "sink", "", 10, 19.0)) is None  # a perplexity row: no turns
    assert plots.turn_label(rows[1]) == "snapkv, 0.0 MB (once)"
    fitted = dict(rows[1], memory={"state_bytes": 4_000_000, "fitted_bytes": 2_500_000.0})
    assert plots.turn_label(fitted) == "snapkv, 2.5 MB (once)"  # what the run stored, per prompt
    paths = plots.plot_all(rows, tmp_path)
    assert {p.name for p in paths} >= {"accuracy_per_turn_multiturn.png", "accuracy_per_turn_multiturn.pdf"}
    assert all(p.stat().st_size > 0 for p in paths)
