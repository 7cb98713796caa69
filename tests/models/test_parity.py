"""Parity with a reference nobody here wrote: transformers' PyTorch Llama/Mistral/Qwen2 on the
same weights (tiny random configs saved with save_pretrained, and SmolLM2 from its GGUF file)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import kvpolicies
from models.engine import Engine, perplexity
from models.llama import Llama
from models.loading import load_hf

FULL = kvpolicies.get("full")


def ours_logits(model: Llama, ids: np.ndarray) -> np.ndarray:
    b, t = ids.shape
    cache = model.init_cache(FULL, b, t)
    out, _ = model(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), cache, FULL)
    return np.asarray(out)


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=256)
CONFIGS = {
    "llama3-untied": lambda: transformers.LlamaConfig(
        **TINY, rope_theta=500000.0, tie_word_embeddings=False,
        rope_scaling=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                          original_max_position_embeddings=32)),
    "llama-mha-tied": lambda: transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 4}, tie_word_embeddings=True),
    "llama-mqa": lambda: transformers.LlamaConfig(**{**TINY, "num_key_value_heads": 1}),
    "mistral": lambda: transformers.MistralConfig(**TINY, rope_theta=1e6, sliding_window=None),
    "qwen2": lambda: transformers.Qwen2Config(**TINY, tie_word_embeddings=True),
}
CLASSES = {"mistral": transformers.MistralForCausalLM, "qwen2": transformers.Qwen2ForCausalLM}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tiny_checkpoints_match_transformers(name, tmp_path):
    torch.manual_seed(0)
    cls = CLASSES.get(name, transformers.LlamaForCausalLM)
    ref = cls(CONFIGS[name]()).eval()
    with torch.no_grad():  # random init leaves biases at 0 and norms at 1: perturb them
        for n, p in ref.named_parameters():
            if n.endswith(".bias") or "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    ref.save_pretrained(tmp_path)
    cfg, params = load_hf(tmp_path)
    ids = np.random.default_rng(0).integers(0, 128, (2, 100))  # past llama3's original 32 positions
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    got = ours_logits(Llama(cfg, params), ids)
    assert np.abs(got - want).max() <= 1e-4


@pytest.fixture(scope="module")
def smollm2(hf_smollm2):
    from models.loading import load_default_model

    model, tok = load_default_model()
    return model, tok, hf_smollm2


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2):
    model, tok, ref = smollm2
    from evals.data import default_text

    ids = np.asarray([tok.encode(default_text()[:2000])[:128]])
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    got = ours_logits(model, ids)
    assert np.abs(got - want).max() <= 1e-3
    assert (got.argmax(-1) == want.argmax(-1)).mean() > 0.99


@pytest.mark.slow
def test_smollm2_perplexity_matches_transformers(smollm2):
    model, tok, ref = smollm2
    from evals.data import default_text

    ids = np.asarray(tok.encode(default_text()[:20000])[:1024])
    with torch.no_grad():
        logits = ref(torch.tensor(ids[None])).logits[0, :-1]
        want = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:])).exp().item()
    got = perplexity(Engine(model, FULL, max_len=1024).score(ids, chunk=256))
    assert abs(got - want) / want < 0.005
    assert 3 < got < 60  # a real language model on real prose
