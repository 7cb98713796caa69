"""Issue 38, item 6 (preflight): an HF checkpoint whose config.json disagrees with its tensors'
shapes, and a tokenizer larger than the model's vocabulary, are errors before any weights load
(they used to fail while loading or while scoring, after the work)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import tokenizers
from safetensors.numpy import save_file

from evals import config as C
from evals import run as evrun
from evals import zoo

CFG = {"model_type": "llama", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 4,
       "num_key_value_heads": 2, "intermediate_size": 32, "max_position_embeddings": 256, "tie_word_embeddings": True}


def write_hf(folder, cfg=CFG, vocab=8, kv_rows=None):
    d, F, D = cfg["hidden_size"], cfg["intermediate_size"], cfg["hidden_size"] // cfg["num_attention_heads"]
    t = {"model.embed_tokens.weight": np.zeros((8, d), np.float32), "model.norm.weight": np.ones(d, np.float32)}
    for i in range(2):
        p = f"model.layers.{i}."
        t.update({p + "input_layernorm.weight": np.ones(d, np.float32),
                  p + "post_attention_layernorm.weight": np.ones(d, np.float32),
                  p + "self_attn.q_proj.weight": np.zeros((4 * D, d), np.float32),
                  p + "self_attn.k_proj.weight": np.zeros((kv_rows or 2 * D, d), np.float32),
                  p + "self_attn.v_proj.weight": np.zeros((2 * D, d), np.float32),
                  p + "self_attn.o_proj.weight": np.zeros((d, 4 * D), np.float32),
                  p + "mlp.gate_proj.weight": np.zeros((F, d), np.float32),
                  p + "mlp.up_proj.weight": np.zeros((F, d), np.float32),
                  p + "mlp.down_proj.weight": np.zeros((d, F), np.float32)})
    folder.mkdir(exist_ok=True)
    save_file(t, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(cfg))
    tok = tokenizers.Tokenizer(tokenizers.models.WordLevel({chr(97 + i): i for i in range(vocab)}, unk_token="a"))
    (folder / "tokenizer.json").write_text(tok.to_str())
    return folder


def test_a_consistent_hf_folder_passes(tmp_path):
    folder = write_hf(tmp_path / "ok")
    mc = zoo.describe({"name": "hf", "path": str(folder)})
    assert (mc.n_layers, mc.n_kv_heads, mc.vocab_size) == (2, 2, 8)


def test_hf_config_against_tensor_shapes(tmp_path):
    folder = write_hf(tmp_path / "kv", kv_rows=4 * 4)  # k_proj stored for 4 kv heads, config says 2
    with pytest.raises(ValueError, match=r"disagrees with the tensors: model.layers.0.self_attn.k_proj.weight has "
                                         r"shape \[16, 16\], the config implies \[8, 16\]"):
        zoo.describe({"name": "hf", "path": str(folder)})
    folder = write_hf(tmp_path / "layers", cfg={**CFG, "num_hidden_layers": 3})
    with pytest.raises(ValueError, match="num_hidden_layers=3, but the tensors hold 2 layers"):
        zoo.describe({"name": "hf", "path": str(folder)})
    with pytest.raises(C.ConfigError, match="disagrees with the tensors"):  # evals.run: before any weights load
        C.validate(C.compose(["model=hf", f"model.path={tmp_path / 'kv'}", "tokens=4", "results=/tmp/unused.jsonl"]))


def test_tokenizer_larger_than_the_vocabulary(tmp_path, capsys):
    folder = write_hf(tmp_path / "tok", vocab=12)  # 12 ids, an embedding of 8
    with pytest.raises(ValueError, match=r"its tokenizer has 12 ids, more than the model's vocabulary of 8"):
        zoo.check_vocab({"name": "hf", "path": str(folder)}, zoo.load_tokenizer({"name": "hf", "path": str(folder)}))
    text = tmp_path / "t.txt"
    text.write_text("a b c " * 50)
    with pytest.raises(SystemExit) as e:
        evrun.main(["model=hf", f"model.path={folder}", "data=path", f"data.path={text}", "tokens=8",
                    f"results={tmp_path / 'r.jsonl'}"])
    assert e.value.code == 2 and "more than the model's vocabulary" in capsys.readouterr().err


def test_gguf_vocabulary_from_its_embedding_header(monkeypatch):
    """A GGUF whose metadata has no vocab_size (Qwen's): the rows of token_embd.weight, read from the
    header the tokenizer came from, bound the tokenizer's ids."""
    import types

    m = {"name": "qwen"}
    if zoo.describe(m).vocab_size > 1:
        pytest.skip("this qwen GGUF states its vocab_size")
    fake = types.SimpleNamespace(tensors=[types.SimpleNamespace(name="token_embd.weight", shape=(896, 100))])
    monkeypatch.setattr(zoo, "_gguf_reader", lambda path: fake)
    with pytest.raises(ValueError, match="its tokenizer has 151936 ids, more than the model's vocabulary of 100"):
        zoo.check_vocab(m, types.SimpleNamespace(vocab_size=151936))
    fake.tensors[0].shape = (896, 151936)
    zoo.check_vocab(m, types.SimpleNamespace(vocab_size=151936))
