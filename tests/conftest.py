import os
import sys

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
