"""The leaderboard's model families, Qwen3 and Llama 3.1 / 3.2, against transformers.

transformers builds tiny random Qwen3ForCausalLM and LlamaForCausalLM checkpoints here (fixed seed,
saved with save_pretrained, no hub): Qwen3 with QK-norm and a head_dim that is not d / heads,
Llama 3.1 with the llama3 rope_scaling (untied) and Llama 3.2 (tied embeddings, factor 32), each
with an original context of 64 tokens and read at 96 positions. Our load of each folder gives
transformers' logits to float32 rounding and the same greedy ids through `models.engine` (the
greedy paths' top-2 logit gaps are at least 4.6e-3, against differences of 3e-6). The same weights
written as llama.cpp GGUF files (qwen3 arch with attn_q_norm / attn_k_norm; llama arch with Q/K
rows permuted and the `rope_freqs` divisors computed as llama.cpp's converter does) load to the HF
load's config and bit-identical weights. `shape_config` is checked against the published
config.json of each model (written below) and its published parameter count, `device_params`
against the shapes and the distribution it draws, and `evals.run`'s preflight takes a Qwen3 folder.
"""

from __future__ import annotations

import dataclasses
import math

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import kvpolicies
from models.config import SHAPES, shape_config
from models.engine import Engine
from models.llama import Llama
from models.loading import expected_shapes, hf_config, llama3_from_rope_freqs, load_gguf, load_hf

FULL = kvpolicies.get("full")
T = 96  # positions read: past the original 64-token context of the llama3 scaling below
TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, max_position_embeddings=256, initializer_range=0.1)


def llama3(factor):
    return dict(rope_type="llama3", factor=factor, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=64, rope_theta=10000.0)


FAMILIES = {
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        **TINY, rope_parameters=dict(rope_type="default", rope_theta=1e6), tie_word_embeddings=False)),
    "llama3.1": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **TINY, rope_parameters=llama3(8.0), tie_word_embeddings=False)),
    "llama3.2": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(
        **TINY, rope_parameters=llama3(32.0), tie_word_embeddings=True)),
}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, transformers model, its folder, our config and params loaded from it)."""
    torch.manual_seed(0)
    ref = FAMILIES[request.param]().eval()
    with torch.no_grad():  # norms (q_norm / k_norm included) start at 1: make them matter
        for n, p in ref.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
    folder = tmp_path_factory.mktemp(request.param)
    ref.save_pretrained(folder)
    cfg, params = load_hf(folder)
    return request.param, ref, folder, cfg, params


@pytest.fixture(scope="module")
def ids():
    return np.random.default_rng(0).integers(0, 128, (2, T))


def ours_logits(model: Llama, ids: np.ndarray) -> np.ndarray:
    b, t = ids.shape
    cache = model.init_cache(FULL, b, t)
    out, _ = model(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), cache, FULL)
    return np.asarray(out)


def test_hf_config_of_each_family(family):
    name, ref, _, cfg, params = family
    assert cfg.qk_norm == (name == "qwen3") and not cfg.qkv_bias
    assert cfg.head_dim == 32 != cfg.d_model // cfg.n_heads  # the explicit head_dim is read
    assert cfg.tie_embeddings == (name == "llama3.2") and ("lm_head" in params) == (name != "llama3.2")
    assert {k: v.shape for k, v in params["layers"].items()} == expected_shapes(cfg)["layers"]
    if name == "qwen3":
        assert cfg.rope_scaling is None and cfg.rope_theta == 1e6
        state = ref.state_dict()
        for i in range(cfg.n_layers):
            assert np.array_equal(params["layers"]["q_norm"][i], state[f"model.layers.{i}.self_attn.q_norm.weight"])
            assert np.array_equal(params["layers"]["k_norm"][i], state[f"model.layers.{i}.self_attn.k_norm.weight"])
    else:
        want = {k: v for k, v in llama3(32.0 if name == "llama3.2" else 8.0).items() if k != "rope_theta"}
        assert cfg.rope_scaling_dict == want and cfg.rope_theta == 10000.0


def test_logits_and_greedy_ids_match_transformers(family, ids):
    """Logits of 96 positions within 1e-5 of transformers' (float32 rounding: the logits reach about
    3.5, measured differences 2.3e-6 to 3.0e-6), and 8 greedy ids through the engine equal
    transformers' greedy ids (its forward pass re-run on the growing sequence)."""
    name, ref, _, cfg, params = family
    model = Llama(cfg, params)
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    got = ours_logits(model, ids)
    assert np.abs(want).max() > 1.0  # logits of some size, not a model that says nothing
    assert np.abs(got - want).max() <= 1e-5, name
    prompt, n = ids[0, :T - 8], 8
    seq = torch.tensor(prompt[None])
    with torch.no_grad():
        for _ in range(n):
            seq = torch.cat([seq, ref(seq).logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    theirs = seq[0, -n:].numpy()
    ours = Engine(model, FULL, max_len=T).generate(prompt, n)
    assert ours.tolist() == theirs.tolist(), name


# ----------------------------------------------------------------------------------------------
# GGUF, written here in llama.cpp's layout


def llama_cpp_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """The `rope_freqs` tensor of llama.cpp's converter for a llama3 rope_scaling, re-simulated
    in torch float32: a divisor per frequency, 1 / factor / the ramp's 1 / ((1 - s) / factor + s)."""
    freqs = 1.0 / (rope["rope_theta"] ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))
    old, lo, hi, factor = (rope[k] for k in ("original_max_position_embeddings", "low_freq_factor",
                                             "high_freq_factor", "factor"))
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < old / hi:
            out.append(1.0)
        elif wavelen > old / lo:
            out.append(factor)
        else:
            smooth = (old / wavelen - lo) / (hi - lo)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return torch.tensor(out, dtype=torch.float32).numpy()


def permute_rows(w, n_heads):
    """llama.cpp's Q/K row order for its "llama" arch (interleaved RoPE pairs)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(path, ref, arch):
    c = ref.config
    state = {k: v.numpy() for k, v in ref.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_key_length(c.head_dim)
    w.add_value_length(c.head_dim)
    w.add_rope_dimension_count(c.head_dim)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if not c.tie_word_embeddings:
        names["output.weight"] = "lm_head.weight"
    layer = {"attn_norm": "input_layernorm", "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
             "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj", "ffn_norm": "post_attention_layernorm",
             "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
    if arch == "qwen3":
        layer.update(attn_q_norm="self_attn.q_norm", attn_k_norm="self_attn.k_norm")
    for i in range(c.num_hidden_layers):
        names.update({f"blk.{i}.{g}.weight": f"model.layers.{i}.{h}.weight" for g, h in layer.items()})
    for name, hf_name in names.items():
        t = state[hf_name]
        if arch == "llama" and ".attn_q." in name:
            t = permute_rows(t, c.num_attention_heads)
        elif arch == "llama" and ".attn_k." in name:
            t = permute_rows(t, c.num_key_value_heads)
        w.add_tensor(name, np.ascontiguousarray(t))
    if c.rope_parameters.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama_cpp_rope_freqs(c.rope_parameters, c.head_dim))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def test_gguf_loads_as_the_hf_folder(family, tmp_path):
    name, ref, _, cfg, params = family
    arch = "qwen3" if name == "qwen3" else "llama"
    write_gguf(tmp_path / "tiny.gguf", ref, arch)
    got_cfg, got = load_gguf(tmp_path / "tiny.gguf")
    # the same config: rope_freqs mapped back to the llama3 scaling, qk_norm from the qwen3 arch
    assert dataclasses.replace(got_cfg, name=cfg.name, bos_id=cfg.bos_id, eos_id=cfg.eos_id) == cfg
    assert set(got) == set(params) and set(got["layers"]) == set(params["layers"])
    for k in set(params) - {"layers"}:
        assert np.array_equal(got[k], params[k]), k
    for k, v in params["layers"].items():
        assert np.array_equal(got["layers"][k], v), k


def test_rope_freqs_of_the_published_llama_3_models_map_back():
    """llama.cpp's divisors for Llama 3.1-8B (factor 8, head_dim 128) and 3.2-1B (factor 32, head_dim
    64) give back their config.json rope_scaling; all-ones divisors are no scaling; others are refused."""
    for name in ("llama-3.1-8b", "llama-3.2-1b"):
        c = SHAPES[name]
        freqs = llama_cpp_rope_freqs({**c["rope_scaling"], "rope_theta": c["rope_theta"]}, c["head_dim"])
        assert 1 < len(set(freqs.tolist())) < len(freqs)  # kept, ramp and scaled frequencies
        assert llama3_from_rope_freqs(freqs, c["head_dim"], c["rope_theta"]) == c["rope_scaling"]
    assert llama3_from_rope_freqs(np.ones(64, np.float32), 128, 5e5) is None
    bumpy = np.linspace(1, 8, 64, dtype=np.float32)[::-1].copy()  # decreasing: not a llama3 ramp
    with pytest.raises(ValueError, match="no llama3 rope_scaling"):
        llama3_from_rope_freqs(bumpy, 128, 5e5)
    with pytest.raises(ValueError, match="head_dim / 2 = 64"):
        llama3_from_rope_freqs(np.ones(32, np.float32), 128, 5e5)


# ----------------------------------------------------------------------------------------------
# The published shapes

# config.json of meta-llama/Llama-3.1-8B-Instruct, meta-llama/Llama-3.2-1B-Instruct, Qwen/Qwen3-8B and
# Qwen/Qwen3-0.6B (the fields that set the shape), and each model's published parameter count
LLAMA3 = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192,
          "rope_type": "llama3"}
PUBLISHED = {
    "llama-3.1-8b": ({"model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256, "rms_norm_eps": 1e-05,
                      "rope_theta": 500000.0, "rope_scaling": LLAMA3, "max_position_embeddings": 131072,
                      "tie_word_embeddings": False, "attention_bias": False, "mlp_bias": False, "hidden_act": "silu",
                      "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009]}, 8_030_261_248),
    "llama-3.2-1b": ({"model_type": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                      "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "vocab_size": 128256,
                      "rms_norm_eps": 1e-05, "rope_theta": 500000.0, "rope_scaling": {**LLAMA3, "factor": 32.0},
                      "max_position_embeddings": 131072, "tie_word_embeddings": True, "attention_bias": False,
                      "mlp_bias": False, "hidden_act": "silu", "bos_token_id": 128000,
                      "eos_token_id": [128001, 128008, 128009]}, 1_235_814_400),
    "qwen3-8b": ({"model_type": "qwen3", "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                  "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                  "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": None, "max_position_embeddings": 40960,
                  "tie_word_embeddings": False, "attention_bias": False, "hidden_act": "silu", "sliding_window": None,
                  "use_sliding_window": False, "max_window_layers": 36, "bos_token_id": 151643,
                  "eos_token_id": 151645}, 8_190_735_360),
    "qwen3-0.6b": ({"model_type": "qwen3", "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                    "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 151936,
                    "rms_norm_eps": 1e-06, "rope_theta": 1000000, "rope_scaling": None,
                    "max_position_embeddings": 40960, "tie_word_embeddings": True, "attention_bias": False,
                    "hidden_act": "silu", "sliding_window": None, "use_sliding_window": False, "max_window_layers": 28,
                    "bos_token_id": 151643, "eos_token_id": 151645}, 596_049_920),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_shape_config_is_the_published_config(name):
    published, n_params = PUBLISHED[name]
    cfg = shape_config(name)
    assert hf_config(published, cfg.name, has_lm_head=not published["tie_word_embeddings"]) == cfg
    # transformers' own reading of the same config.json
    cls = transformers.Qwen3Config if published["model_type"] == "qwen3" else transformers.LlamaConfig
    hf = cls(**{k: v for k, v in published.items() if k != "model_type"})
    assert (hf.num_hidden_layers, hf.num_attention_heads, hf.num_key_value_heads, hf.hidden_size,
            hf.intermediate_size, hf.vocab_size) == (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.d_model,
                                                     cfg.d_ff, cfg.vocab_size)
    assert getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads == cfg.head_dim
    rope = dict(hf.rope_parameters)
    assert rope.pop("rope_theta") == cfg.rope_theta
    assert (rope if rope.get("rope_type") == "llama3" else None) == cfg.rope_scaling_dict
    shapes = expected_shapes(cfg)
    count = sum(math.prod(s) for s in [shapes[k] for k in shapes if k != "layers"] + list(shapes["layers"].values()))
    assert count == n_params
    with pytest.raises(ValueError, match="known shapes"):
        shape_config("llama-4")


def test_what_qwen3_configs_cannot_run_is_refused():
    """Qwen3's attention_bias also biases o_proj (no slot in the layout); its sliding window is
    ignored with a warning, as Qwen2's."""
    published, _ = PUBLISHED["qwen3-0.6b"]
    with pytest.raises(ValueError, match=r"attention_bias=true \(qwen3\)"):
        hf_config({**published, "attention_bias": True}, "x", has_lm_head=False)
    with pytest.warns(UserWarning, match="qwen3 sliding_window=4096 is ignored"):
        hf_config({**published, "use_sliding_window": True, "sliding_window": 4096}, "x", has_lm_head=False)


def test_the_cli_takes_a_qwen3_folder(tmp_path):
    """`evals.run model=hf model.path=FOLDER` validates a Qwen3 folder (config, tensors, tokenizer)
    before loading it, as docs/guide/models.md tells."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from evals.run import preflight

    torch.manual_seed(0)
    transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**{**TINY, "vocab_size": 256})).save_pretrained(tmp_path)
    byte_ids = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tok = Tokenizer(models.BPE(vocab=byte_ids, merges=[]))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.save(str(tmp_path / "tokenizer.json"))  # bytes as tokens: 256 ids
    args = ["model=hf", f"model.path={tmp_path}", "policy=sink", "window=64", "tokens=128"]
    assert preflight(args) == (1, True)


def test_device_params_give_a_real_shape_in_bfloat16():
    """`device_params` draws the canonical tree of any shape on the device: Qwen3-8B's shapes (traced,
    nothing allocated) with its published count, all bfloat16; a small draw has norms 1 + N(0, std)
    and weights N(0, std), and is the same for a seed and not for another."""
    from models.llama import device_params

    cfg = shape_config("qwen3-8b")
    traced = jax.eval_shape(lambda: device_params(cfg))
    shapes = {k: v.shape for k, v in traced.items() if k != "layers"}
    shapes["layers"] = {k: v.shape for k, v in traced["layers"].items()}
    assert shapes == expected_shapes(cfg)
    assert {a.dtype for a in jax.tree.leaves(traced)} == {jnp.dtype(jnp.bfloat16)}
    assert sum(math.prod(a.shape) for a in jax.tree.leaves(traced)) == PUBLISHED["qwen3-8b"][1]

    small = dataclasses.replace(shape_config("qwen3-0.6b"), vocab_size=512, d_model=128, n_layers=2, d_ff=256)
    params = device_params(small, seed=1, std=0.05, dtype=jnp.float32)
    wq, q_norm = np.asarray(params["layers"]["wq"]), np.asarray(params["layers"]["q_norm"])
    assert abs(wq.std() / 0.05 - 1) < 0.02 and abs(wq.mean()) < 1e-3  # 2 x 128 x 2048 draws
    assert abs((q_norm - 1).std() / 0.05 - 1) < 0.1 and abs(q_norm.mean() - 1) < 0.01  # 2 x 128 draws
    assert np.array_equal(np.asarray(device_params(small, seed=1, std=0.05, dtype=jnp.float32)["embed"]),
                          np.asarray(params["embed"]))
    assert not np.array_equal(np.asarray(device_params(small, seed=2, dtype=jnp.float32)["embed"]),
                              np.asarray(params["embed"]))
    assert {k: v.shape for k, v in params["layers"].items()} == expected_shapes(small)["layers"]
