"""Shared fixtures of the test suite, and the file order of its two pytest-xdist workers (below).

`kvpress_ref` (session): kvpress 0.5.5 in its own environment (.venv/kvpress-ref), as ONE long-lived
`evals/kvpress_worker.py --serve` process per pytest process (per xdist worker), which imports torch,
transformers and kvpress once (about 4 s of CPU a process) and forks a child per job: each job runs
exactly as in a process of its own (nothing of one job is seen by the next), its stdout and stderr
replayed into the test's captured output. A kvpress parity file takes it as an argument of its fixture:

    @pytest.fixture(scope="module")
    def tiny_run(tmp_path_factory, kvpress_ref):
        tmp = tmp_path_factory.mktemp("llama")
        ref = kvpress_ref.job(job, tmp)                  # = python evals/kvpress_worker.py job.json out.json
        ref = kvpress_ref.job(job, tmp, script=WORKER)   # = python -c WORKER job.json out.json evals/

`job` writes tmp/job.json, runs it, and returns the parsed tmp/out.json (`out=` names another file
under tmp, e.g. "out.jsonl" for the multi-sample form, returned as its path); `timeout=` (seconds,
600 by default) kills the worker and raises subprocess.TimeoutExpired; a job that exits non-zero raises
subprocess.CalledProcessError with its output. `kvpress_ref.run(argv, script=None)` is the same for
any arguments and returns the job's stdout. The environment is KVPRESS_ENV below (and OMP_NUM_THREADS,
1 unless set), the working directory the repository. KVP_KVPRESS_SERVER=0 runs every job in a
subprocess of its own instead (the way before: the same results, about 4 s more each).
"""

import json
import os
import select
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest

# Test files run longest first, by the durations recorded in tests/durations.json (a file's tests
# summed, per stage of scripts/test.sh: "unit" or "slow"; keyed "stage:path under tests/"), so that the two pytest-xdist workers
# (`--dist loadfile --no-loadscope-reorder`: a file per worker, taken in this order) finish
# together. A file with no recorded duration (a new one) goes first, as if it were the longest.
# `KVP_RECORD_DURATIONS=1 bash scripts/test.sh` (pytest's `--record-durations`) rewrites the
# entries of the files it ran. By default xdist hands out the files with the most tests first, which left
# files with few but slow tests (the 8-device sharding checks, kvpress's subprocess) to the end.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_addoption(parser):
    parser.addoption("--record-durations", action="store_true",
                     help="write each test file's summed duration in this run to tests/durations.json")


def stage_of(item) -> str:
    return "slow" if item.get_closest_marker("slow") is not None else "unit"


def file_key(nodeid: str) -> str:
    """A test file's name in tests/durations.json: its path under tests/ (`kvpolicies/test_paged.py`),
    from a node id (relative to the repository, where pyproject.toml puts pytest's rootdir)."""
    path = nodeid.split("::")[0]
    return path.removeprefix("tests/")


def recorded() -> dict[str, float]:
    return json.loads(DURATIONS.read_text()) if DURATIONS.is_file() else {}


def order_by_duration(items, durations: dict[str, float]) -> None:
    """Sort `items` in place: files with the longest recorded duration in their stage first, files
    never recorded before them all; stable, so each file's tests keep their order."""
    items.sort(key=lambda item: -durations.get(f"{stage_of(item)}:{file_key(item.nodeid)}", float("inf")))


def pytest_collection_modifyitems(config, items):
    order_by_duration(items, recorded())


_SPENT: dict[str, float] = {}


def pytest_runtest_logreport(report):
    """Sum each file's setup + call + teardown time (on the xdist controller, from the workers' reports)."""
    stage = "slow" if "slow" in report.keywords else "unit"
    key = f"{stage}:{file_key(report.nodeid)}"
    _SPENT[key] = _SPENT.get(key, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    if not session.config.getoption("--record-durations") or hasattr(session.config, "workerinput"):
        return
    merged = {**recorded(), **{k: round(v, 1) for k, v in _SPENT.items()}}
    DURATIONS.write_text(json.dumps(dict(sorted(merged.items())), indent=1) + "\n")


@pytest.fixture(scope="session")
def hf_smollm2():
    """transformers' own import of the SmolLM2 GGUF file (float32), loaded once per session (~40 s)."""
    import torch
    import transformers

    from models.loading import smollm2_gguf_path

    path = smollm2_gguf_path()
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    ).eval()


@pytest.fixture(scope="session")
def text_file(tmp_path_factory):
    """A small UTF-8 text of 200 common words (for evals runs on the tiny random model)."""
    rng = np.random.default_rng(0)
    words = "the of and to a in that it was her she he not be his as with had for you".split()
    path = tmp_path_factory.mktemp("text") / "tiny.txt"
    path.write_text(" ".join(rng.choice(words, 200)), encoding="utf-8")
    return path


@pytest.fixture(scope="session")
def tiny_qwen(tmp_path_factory):
    """(transformers Qwen2ForCausalLM, our Llama) on one tiny random checkpoint: peaked,
    head-dependent attention (q/k weights x8, biases and norms perturbed), eager attention."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from models.llama import Llama
    from models.loading import load_hf

    torch.manual_seed(0)
    cfg = transformers.Qwen2Config(vocab_size=64, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                   tie_word_embeddings=True, attn_implementation="eager")
    ref = transformers.Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # larger weights: peaked, head-dependent attention
        for name, p in ref.named_parameters():
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(8.0)
            if name.endswith(".bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    path = tmp_path_factory.mktemp("qwen")
    ref.save_pretrained(path)
    return ref, Llama(*load_hf(path))


ROOT = Path(__file__).resolve().parents[1]
KVPRESS_ENV = {"PYTHONPATH": str(ROOT / ".venv" / "kvpress-ref"), "CUDA_VISIBLE_DEVICES": "",
               "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


class KvpressRef:
    """kvpress's worker (`evals/kvpress_worker.py`) in kvpress's environment: one `--serve` process,
    started at the first job, forking a child per job (see the top of this file)."""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.started = 0  # `--serve` processes started (one, unless a job timed out or the worker died)

    def env(self) -> dict[str, str]:
        return {**os.environ, **KVPRESS_ENV, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}

    def run(self, argv: list, script: str | None = None, timeout: float = 600) -> str:
        """`python evals/kvpress_worker.py ARGV` (script None) or `python -c SCRIPT ARGV`, in kvpress's
        environment with the repository as the working directory: its stdout (also replayed, with its
        stderr, into the test's captured output)."""
        argv = [str(a) for a in argv]
        worker = str(ROOT / "evals" / "kvpress_worker.py")
        cmd = [sys.executable, *(["-c", "<script>"] if script is not None else [worker]), *argv]
        logs = {}
        for name in ("stdout", "stderr"):
            fd, logs[name] = tempfile.mkstemp(prefix=f"kvpress-{name}-", suffix=".log")
            os.close(fd)
        try:
            if os.environ.get("KVP_KVPRESS_SERVER", "1") == "0":
                with open(logs["stdout"], "w") as out, open(logs["stderr"], "w") as err:
                    rc = subprocess.run([*cmd[:2], script, *argv] if script is not None else cmd, env=self.env(),
                                        cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=err,
                                        timeout=timeout).returncode
            else:
                rc = self._served({"argv": argv, "script": script, **logs}, cmd, timeout)
            out, err = (Path(logs[name]).read_text(errors="replace") for name in ("stdout", "stderr"))
            sys.stdout.write(out)
            sys.stderr.write(err)
            if rc != 0:
                raise subprocess.CalledProcessError(rc, cmd, output=out, stderr=err)
            return out
        finally:
            for path in logs.values():
                os.unlink(path)

    def job(self, job: dict, tmp: Path, script: str | None = None, out: str = "out.json", timeout: float = 600):
        """Writes tmp/job.json, runs it (the script given `ROOT/evals` as a third argument, where the
        parity files' scripts import kvpress_worker from) and returns tmp/OUT parsed (a .json file)
        or its path."""
        (tmp / "job.json").write_text(json.dumps(job))
        self.run([tmp / "job.json", tmp / out, *([ROOT / "evals"] if script is not None else [])], script, timeout)
        return json.loads((tmp / out).read_text()) if out.endswith(".json") else tmp / out

    def _served(self, request: dict, cmd: list[str], timeout: float) -> int:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen([sys.executable, str(ROOT / "evals" / "kvpress_worker.py"), "--serve"],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=self.env(), cwd=ROOT,
                                         text=True, start_new_session=True)
            self.started += 1
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:  # the job's child and the server: the same process group
            self.close()
            raise subprocess.TimeoutExpired(cmd, timeout)
        line = self.proc.stdout.readline()
        if not line:
            self.close()
            raise RuntimeError("kvpress's worker (evals/kvpress_worker.py --serve) ended without answering")
        return json.loads(line)["rc"]

    def close(self) -> None:
        """Ends the worker and a job's child, if one runs (they are one process group)."""
        if self.proc is None:
            return
        proc, self.proc = self.proc, None
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()
        proc.stdin.close()
        proc.stdout.close()


@pytest.fixture(scope="session")
def kvpress_ref():
    """kvpress's worker shared by every test of this pytest process (see the top of this file)."""
    ref = KvpressRef()
    yield ref
    ref.close()
