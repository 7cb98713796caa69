import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))


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
