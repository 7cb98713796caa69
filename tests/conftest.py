import json
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
