import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))

# The test files that take longest, longest first: a file's tests summed, in either stage of
# scripts/test.sh (unit stage on the loaded 2-core machine, 2026-12-02: test_sharding 116 s,
# test_policies 115, test_blocked 84, test_train 68, test_model 61, test_benchmarks 61,
# test_rotated 59, test_paged 58, test_buckets 48, test_appending 47; slow stage: test_long_models
# 196, test_codecs 86, test_hier_quest 60, test_scored 58, test_parity 57). They run before every
# other file, so that the two pytest-xdist workers (`--dist loadfile --no-loadscope-reorder`: a
# file per worker, taken in this order) finish together. By default xdist hands out the files with
# the most tests first, which left files with few but slow tests (the 8-device sharding checks,
# the recall model's training) to the end of the unit stage.
LONGEST_FIRST = ("test_long_models.py", "test_sharding.py", "test_policies.py", "test_codecs.py", "test_blocked.py",
                 "test_train.py", "test_model.py", "test_benchmarks.py", "test_hier_quest.py", "test_rotated.py",
                 "test_scored.py", "test_paged.py", "test_parity.py", "test_buckets.py", "test_appending.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file's tests keep their order


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
