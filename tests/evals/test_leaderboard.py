"""`python -m evals.leaderboard`: the command line's plans and errors (before any compute), and the
tables built from saved answer lines, their averages recomputed by hand; end to end on the tiny
model in the slow tests."""

from __future__ import annotations

import csv
import json

import pytest

from evals import leaderboard as L
from evals import peer, ruler, zoo
from evals.config import ConfigError

ARGS = ["model=tiny", "tokens=512", "samples=1", "tasks=[niah_single_1,niah_multikey_2]", "presses=[SnapKVPress]",
        "ratios=[0.5]", "query_aware=[SnapKVPress]", "progress=false"]


def test_plans_one_peer_run_per_task_and_mode(tmp_path):
    b = L.parse(ARGS + [f"out={tmp_path}"])
    assert [(p.task["name"], p.query_aware, p.presses, p.stem) for p in b.plans] == [
        ("niah_single_1", False, ["SnapKVPress"], "niah_single_1"),
        ("niah_single_1", True, ["SnapKVPress"], "niah_single_1_query_aware"),
        ("niah_multikey_2", False, ["SnapKVPress"], "niah_multikey_2"),
        ("niah_multikey_2", True, ["SnapKVPress"], "niah_multikey_2_query_aware")]
    assert all(p.out == tmp_path / "tiny_512" and not p.kvpress and p.ratios == [0.5] for p in b.plans)
    assert b.plans[0].gen == ruler.leaderboard_task("niah_single_1")["gen"] == 128  # RULER's tokens_to_generate
    assert [p.stem for p in L.parse(ARGS + [f"out={tmp_path}", "shard=1/2"]).mine()] == [
        "niah_single_1_query_aware", "niah_multikey_2_query_aware"]
    whole = L.parse(["progress=false"])
    assert whole.tasks == list(ruler.AVAILABLE) and len(whole.tasks) == 11
    assert whole.plans[0].ratios == [0.25, 0.5, 0.75, 0.875] and whole.plans[0].tokens == 4096
    assert {p.samples for p in whole.plans} == {1}  # the leaderboard's default, not evals.peer's 20
    assert {p.samples for p in L.parse(["progress=false", "samples=3"]).plans} == {3}
    assert "DuoAttentionPress" not in whole.presses and "RandomPress" in whole.presses
    assert whole.aware == [p for p in L.QUERY_AWARE if p in peer.PEER_PRESSES + peer.EXTRA_PRESSES]


def test_kvpress_true_runs_our_side_of_every_task_first(tmp_path, monkeypatch):
    """kvpress=true: a kvpress=false run of every task whose our side is pending, then each task's run with both
    sides (by then only kvpress's is left), so the two sides' peaks never meet; a task whose our side is done
    goes straight to the second pass; eos_stop (kvpress's pipeline's stop at EOS) is on by default."""
    b = L.parse(ARGS + [f"out={tmp_path}", "kvpress=true"])
    assert all(p.kvpress and p.eos_stop for p in b.plans) and not L.parse(ARGS + ["eos_stop=false"]).plans[0].eos_stop
    done = b.plans[1].stem  # its our side finished before
    calls = []
    monkeypatch.setattr(L.peer, "pending", lambda p, side: [] if (p.stem, side) == (done, "ours") else [(0, "x", 0.5)])
    monkeypatch.setattr(L.peer, "run", lambda p, model: calls.append((p.stem, p.kvpress, p.eos_stop)))
    monkeypatch.setattr(L.peer, "use_compile_cache", lambda p: None)
    from evals import compiles

    monkeypatch.setattr(compiles, "release_memory", lambda: calls.append("released") or 0)
    L.run(b)
    ours = [(p.stem, False, True) for p in b.plans if p.stem != done]
    assert calls == ours + ["released"] + [(p.stem, True, True) for p in b.plans]  # our heap back before kvpress's side
    calls.clear()
    L.run(L.parse(ARGS + [f"out={tmp_path}"]))  # kvpress=false: one pass, the tasks whose our side is pending
    assert calls == ours


def test_allocator_tunables_only_without_kvpress_beside():
    assert L.keeps_peak(["samples=2"]) and L.keeps_peak(["kvpress=false"])
    assert not L.keeps_peak(["samples=2", "kvpress=true"]) and not L.keeps_peak(["kvpress=True"])


@pytest.mark.parametrize("bad, says", [
    ("tasks=[qa_1]", "no package on the registries ships SQuAD"),
    ("tasks=[niah_single]", "not a task evals.ruler generates"),
    ("presses=[SnapKV]", "not a press evals.peer runs"),
    ("query_aware=[Nope]", "query_aware: 'Nope'"),
    ("shard=2/2", "0 <= i < n"),
    ("shard=x", "expected i/n"),
    ("ratio=0.5", "unknown key"),
    ("model=hf", "needs model_path="),
])
def test_errors_before_compute(bad, says, tmp_path):
    with pytest.raises(ConfigError, match=says):
        L.parse([a for a in ARGS if not a.startswith(bad.split("=")[0] + "=")] + [bad, f"out={tmp_path}"])


def _answer(tok, text: str) -> list[int]:
    return [int(x) for x in tok.encode(text)]


def _hand_lines(out):
    """A two-task board whose our-side lines are written by hand (right: the reference's ids)."""
    b = L.prepare(L.parse(ARGS + [f"out={out}"]))
    tok = zoo.load_tokenizer(b.plans[0].mconf)
    right = {("niah_single_1", False): {"full": True, "SnapKVPress": True},
             ("niah_single_1", True): {"SnapKVPress": False},
             ("niah_multikey_2", False): {"full": True, "SnapKVPress": False},
             ("niah_multikey_2", True): {"SnapKVPress": True, "full": False}}
    for p in b.plans:
        p.out.mkdir(parents=True, exist_ok=True)
        with open(p.path(".ours.jsonl"), "w") as f:
            for press, ok in right[(p.task["name"], p.query_aware)].items():
                ids = _answer(tok, " " + p.refs[0][0] if ok else " no idea")
                f.write(json.dumps({"sample": p.sample_id(0), "press": press, "ratio": 0.5 if press != "full" else 0.0,
                                    "n": len(p.contexts[0]), "answer": ids, "kept": [], "seconds": 1.0}) + "\n")
    return b


def test_a_folder_of_task_csvs_without_lines_gives_the_same_tables(tmp_path):
    """Each task's `<stem>.csv` (what its run wrote) stands in for lines that were not kept (a page's committed
    runs): the same average rows and page; a csv of another configuration is refused before any table."""
    b = _hand_lines(tmp_path)
    tok = zoo.load_tokenizer(b.plans[0].mconf)
    want = L.write(b)
    page = (tmp_path / "leaderboard_tiny_512.md").read_text()
    for p in b.plans:
        peer.write(p, tok)  # the run's own table files, as `peer.run` leaves them
        p.path(".ours.jsonl").unlink()
        p.path(".jsonl").unlink()
    b = L.prepare(L.parse(ARGS + [f"out={tmp_path}", "table_only=true"]))
    got = L.write(b)
    assert [(r["press"], r["ratio"], r["tasks"], r["ours"]) for r in got] == \
        [(r["press"], r["ratio"], r["tasks"], r["ours"]) for r in want] and len(got) == 3
    assert (tmp_path / "leaderboard_tiny_512.md").read_text().split("\n", 1)[1] == page.split("\n", 1)[1]  # but its command
    csv_file = b.plans[0].path(".csv")
    csv_file.write_text(csv_file.read_text().replace(b.plans[0].config, "0123456789abcdef"))
    with pytest.raises(ConfigError, match="another configuration"):
        L.prepare(L.parse(ARGS + [f"out={tmp_path}", "table_only=true"]))


def test_tables_average_the_tasks(tmp_path):
    """Answer lines written by hand (right: the reference's ids; wrong: other words): each cell's
    score, the average over the two tasks (x 100), a cell short of a task without an average, the
    full cache once (the query-agnostic run's), and the CSV, markdown and figure files."""
    b = _hand_lines(tmp_path)
    avg = {(r["press"], r["ratio"]): r for r in L.write(b)}
    assert avg[("full", 0.0)]["ours"] == 100.0 and avg[("full", 0.0)]["tasks"] == 2  # the aware run's full: not counted
    assert avg[("SnapKVPress", 0.5)]["ours"] == 50.0
    assert avg[("SnapKVPress (query-aware)", 0.5)]["ours"] == 50.0
    assert all(r["kvpress"] != r["kvpress"] for r in avg.values())  # kvpress=false: no kvpress column
    with open(tmp_path / "leaderboard_tiny_512.csv") as f:
        rows = list(csv.DictReader(f))
    assert [(r["press"], float(r["ours"])) for r in rows] == [("full", 100.0), ("SnapKVPress", 50.0),
                                                           ("SnapKVPress (query-aware)", 50.0)]
    md = (tmp_path / "leaderboard_tiny_512.md").read_text()
    assert md.startswith("`python -m evals.leaderboard model=tiny") and "| SnapKVPress | 0.5 | 100.0 | 0.0 | 50.0 |" in md
    assert (tmp_path / "leaderboard_tiny_512.png").stat().st_size > 1000
    # one task's query-aware cell missing: that row has no average
    p = b.plans[3]
    p.path(".ours.jsonl").write_text("")
    avg = {(r["press"], r["ratio"]): r for r in L.write(b)}
    assert avg[("SnapKVPress (query-aware)", 0.5)]["ours"] != avg[("SnapKVPress (query-aware)", 0.5)]["ours"]
    assert avg[("SnapKVPress (query-aware)", 0.5)]["tasks"] == 1


def test_agreement_sums_items_over_tasks_and_leaves_drawn_presses_out_of_the_deterministic_line(tmp_path):
    """The agreement table of a kvpress=true page, from collected rows written by hand: per press the items both
    sides answered, same ids and same score summed over tasks and ratios, the Jaccard weighted by items; the full
    cache is no press; RandomPress (a draw) counts in "all presses" only; a cell kvpress raised on (no items) adds
    nothing; without kvpress, no table."""
    def row(task, press, ratio, n, ids, score, jac):
        return {"task": task, "press": press, "ratio": ratio, "samples": n, "ours": 1.0, "kvpress": 1.0,
                "same_ids": ids, "same_score": score, "both": n, "jaccard": jac}

    rows = [row("a", "full", 0.0, 2, 2, 2, float("nan")),
            row("a", "SnapKVPress", 0.5, 2, 2, 2, 1.0), row("b", "SnapKVPress", 0.5, 2, 1, 2, 0.9),
            row("a", "SnapKVPress (query-aware)", 0.5, 1, 1, 1, 0.97),
            row("a", "RandomPress", 0.5, 2, 0, 1, 0.3), row("b", "RandomPress", 0.5, 0, 0, 0, float("nan"))]
    got = {a["press"]: a for a in L.agreement(rows)}
    assert list(got) == ["SnapKVPress", "SnapKVPress (query-aware)", "RandomPress", "deterministic presses",
                         "all presses"]
    assert (got["SnapKVPress"]["items"], got["SnapKVPress"]["same_ids"], got["SnapKVPress"]["same_score"]) == (4, 3, 4)
    assert got["SnapKVPress"]["jaccard"] == pytest.approx((2 * 1.0 + 2 * 0.9) / 4)
    assert (got["deterministic presses"]["items"], got["deterministic presses"]["same_ids"]) == (5, 4)
    assert got["deterministic presses"]["jaccard"] == pytest.approx((2 * 1.0 + 2 * 0.9 + 0.97) / 5)
    assert (got["all presses"]["items"], got["all presses"]["same_ids"], got["all presses"]["same_score"]) == (7, 4, 6)
    assert got["all presses"]["jaccard"] == pytest.approx((2 * 1.0 + 2 * 0.9 + 0.97 + 2 * 0.3) / 7)
    avg = L.average(L.parse(ARGS + [f"out={tmp_path}"]), rows)
    md = L.markdown(L.parse(ARGS + [f"out={tmp_path}", "kvpress=true"]), rows, avg)
    assert "**Agreement with kvpress**" in md and "| SnapKVPress | 4 | 3 | 4 | 0.9500 |" in md
    assert "| **deterministic presses** | 5 | 4 | 5 | 0.9540 |" in md and "| **all presses** | 7 | 4 | 6 |" in md
    assert "Agreement" not in L.markdown(L.parse(ARGS + [f"out={tmp_path}"]), rows, avg)


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A tiny random Llama saved by transformers (no hub) with SmolLM2's tokenizer: an HF folder."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from models.loading import smollm2_gguf_path

    folder = tmp_path_factory.mktemp("tiny-hf")
    gguf = smollm2_gguf_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name, local_files_only=True)
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                                   bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.slow
def test_gpu_script_dry_run_end_to_end(tiny_hf, tmp_path):
    """scripts/gpu_leaderboard.sh with DRY_RUN=1 (no GPU, float32) on a tiny HF folder: the whole
    command, one task (query-agnostic: the query-aware split is test_peer's); every item saved, each cell's score RULER's metric of its
    saved answer (resuming is evals.peer's, tested there)."""
    import os
    import subprocess
    import sys

    keys = ["tasks=[niah_single_1]", "tokens=512", "presses=[SnapKVPress]", "ratios=[0.5]",
            "query_aware=[]", "gen=4", "progress=false", "compile_cache=none"]
    env = {**os.environ, "DRY_RUN": "1", "OUT": str(tmp_path), "PY": sys.executable}

    def script():
        return subprocess.run(["bash", "scripts/gpu_leaderboard.sh", str(tiny_hf), "1", *keys], env=env,
                              capture_output=True, text=True, timeout=900, cwd=peer.ROOT)

    r = script()
    assert r.returncode == 0, r.stderr[-3000:]
    b = L.prepare(L.parse(["model=hf", f"model_path={tiny_hf}", "samples=1", f"out={tmp_path}", *keys]))
    assert b.stem == f"leaderboard_{tiny_hf.name}_512" and (tmp_path / f"{b.stem}.png").is_file()
    with open(tmp_path / f"{b.stem}.csv") as f:
        avg = {(r["press"], float(r["ratio"])): float(r["ours"]) for r in csv.DictReader(f)}
    tok = zoo.load_tokenizer(b.plans[0].mconf)
    for p in b.plans:
        lines = peer.read_lines(p.path(".ours.jsonl"))
        assert sorted((x["press"], x["ratio"]) for x in lines) == [("SnapKVPress", 0.5), ("full", 0.0)]
        for x in lines:
            if not (p.query_aware and x["press"] == "full"):
                want = 100 * ruler.score(p.task, ruler.ids_text(tok, x["answer"]), p.refs[0])
                assert avg[(L.label(x["press"], p.query_aware), x["ratio"])] == want and len(x["answer"]) == 4


def test_gpu_script_refuses_a_folder_without_config(tmp_path):
    import subprocess

    r = subprocess.run(["bash", "scripts/gpu_leaderboard.sh", str(tmp_path)], capture_output=True, text=True,
                       cwd=peer.ROOT, env={"DRY_RUN": "1", "PATH": "/usr/bin:/bin"})
    assert r.returncode == 2 and "has no config.json" in r.stderr


def test_qa_dir_adds_qa_from_ruler_s_files(tmp_path):
    """qa_dir= with RULER's squad.json / hotpotqa.json: qa_1 and qa_2 join the tasks (scored by
    string_match_part); a folder without them is refused; without it they say why they are missing."""
    from tests.evals.test_ruler13 import _qa_files

    data = tmp_path / "qa"
    data.mkdir()
    _qa_files(data)
    b = L.parse(["model=tiny", "tokens=1024", "presses=[SnapKVPress]", "query_aware=[]", f"qa_dir={data}",
                 f"out={tmp_path}"])
    assert b.tasks == list(ruler.AVAILABLE) + ["qa_1", "qa_2"]
    qa = [p for p in b.plans if p.task["name"].startswith("qa_")]
    assert [p.task["metric"] for p in qa] == ["string_match_part"] * 2
    assert qa[0].task["qa_file"] == str(data / "squad.json")
    with pytest.raises(ConfigError, match="holds neither"):
        L.parse(["model=tiny", f"qa_dir={tmp_path / 'nothing'}"])


def test_evals_run_takes_ruler_s_names():
    """`evals.run task=<RULER's name>`: RULER's defaults (4,096 tokens, its tokens_to_generate and
    metric, kvpress's query-agnostic protocol), validated before any weights load; qa_1 without
    task.qa_file says why it is missing."""
    from evals.config import compose, load_task
    from evals.run import preflight

    conf = compose(["task=vt", "policy=snapkv", "budget=0.25"])
    assert {k: conf["task"][k] for k in ("lengths", "gen", "protocol", "metric")} == {
        "lengths": [4096], "gen": 30, "protocol": "query_agnostic", "metric": "string_match_all"}
    assert load_task("qa_2").defaults["metric"] == "string_match_part"
    assert preflight(["task=niah_multikey_3", "policy=snapkv", "budget=0.25"])[0] == 1
    with pytest.raises(ConfigError, match="task.qa_file=<path to its squad.json>"):
        preflight(["task=qa_1", "policy=full"])


def test_executor_ray_reaches_every_task_s_run_without_importing_ray(tmp_path):
    """executor=ray (and ray.workers=) go to each task's evals.peer run (its presses on Ray actors,
    evals.peer_grid); parsing imports no Ray."""
    import sys

    had = "ray" in sys.modules
    b = L.parse(ARGS + [f"out={tmp_path}", "executor=ray", "ray.workers=3"])
    assert all((p.ray.address, p.ray.workers) == ("local", 3) for p in b.plans)
    assert all(p.ray is None for p in L.parse(ARGS + [f"out={tmp_path}"]).plans)
    assert had or "ray" not in sys.modules
    with pytest.raises(ConfigError, match="give executor=ray"):
        L.parse(ARGS + [f"out={tmp_path}", "ray.workers=3"])
