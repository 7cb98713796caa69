"""The 32K-context models (Qwen2.5-Coder-0.5B, Gemma 3 270M) against transformers' PyTorch
implementation: tiny random Qwen2 / Gemma 3 written as GGUF files in llama.cpp's layout (fast),
the real files from their packages (slow), the hybrid stack's policies and its memory."""

from __future__ import annotations

import math

import gguf
import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers

import kvpolicies
from kvpolicies.memory import closed_form_bytes, stack_bytes
from models.config import LlamaConfig, gemma3_layer_types
from models.llama import Llama
from models.loading import GGUFFile, expected_shapes, load_gguf
from models.stacks import model_stack

FULL = kvpolicies.get("full")


def ours_logits(model: Llama, ids: np.ndarray, policies=None) -> np.ndarray:
    b, t = ids.shape
    pols = model_stack(model.cfg, FULL) if policies is None else policies
    cache = model.init_cache(pols, b, t)
    out, _ = model(jnp.asarray(ids), jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (b, t)), cache, pols)
    return np.asarray(out)


# ----------------------------------------------------------------------------------------------
# Tiny random models written as GGUF the way llama.cpp's converter writes them


TINY = dict(vocab_size=128, hidden_size=64, intermediate_size=96, num_attention_heads=4, max_position_embeddings=256)


def tiny_qwen2():
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(
        **TINY, num_hidden_layers=3, num_key_value_heads=2, rope_theta=1e6, tie_word_embeddings=False))


def tiny_gemma3(window: int = 16):
    # 7 layers: local x5, global, local; head_dim 16 = query_pre_attn_scalar (as in every Gemma 3 but 27B)
    cfg = transformers.Gemma3TextConfig(
        **TINY, num_hidden_layers=7, num_key_value_heads=1, head_dim=16, query_pre_attn_scalar=16,
        sliding_window=window, attn_implementation="eager")
    return transformers.Gemma3ForCausalLM(cfg)


def randomized(model):
    torch.manual_seed(0)
    model.eval()
    with torch.no_grad():  # random init leaves biases at 0 and norms at 0 / 1: perturb them
        for n, p in model.named_parameters():
            if n.endswith(".bias") or "norm" in n:
                p.add_(0.1 * torch.randn_like(p))
    return model


# GGUF name -> HF name (per layer), as llama.cpp's convert_hf_to_gguf maps them
QWEN2_LAYER = {"attn_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
GEMMA3_LAYER = {
    "attn_norm.weight": "input_layernorm.weight", "post_attention_norm.weight": "post_attention_layernorm.weight",
    "ffn_norm.weight": "pre_feedforward_layernorm.weight", "post_ffw_norm.weight": "post_feedforward_layernorm.weight",
    "attn_q_norm.weight": "self_attn.q_norm.weight", "attn_k_norm.weight": "self_attn.k_norm.weight",
}
COMMON_LAYER = {
    "attn_q.weight": "self_attn.q_proj.weight", "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight", "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight", "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def write_gguf(path, model, arch: str):
    """llama.cpp's layout for qwen2 / gemma3: Q/K rows NOT permuted (both run NEOX RoPE), Gemma's
    norm weights stored as 1 + w, Gemma's embedding tied."""
    c = model.config
    state = {k: v.numpy() for k, v in model.state_dict().items()}
    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    names = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight"}
    if arch == "qwen2":
        w.add_rope_freq_base(c.rope_parameters["rope_theta"])
        names["output.weight"] = "lm_head.weight"
        layer = {**COMMON_LAYER, **QWEN2_LAYER, **{f"attn_{x}.bias": f"self_attn.{x}_proj.bias" for x in "qkv"}}
    else:
        w.add_rope_freq_base(c.rope_parameters["full_attention"]["rope_theta"])
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_sliding_window(c.sliding_window)
        layer = {**COMMON_LAYER, **GEMMA3_LAYER}
    for i in range(c.num_hidden_layers):
        names.update({f"blk.{i}.{g}": f"model.layers.{i}.{h}" for g, h in layer.items()})
    for name, hf_name in names.items():
        t = state[hf_name]
        if arch == "gemma3" and name.endswith("norm.weight"):
            t = t + 1.0  # Gemma3RMSNorm multiplies by (1 + w); llama.cpp stores 1 + w
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.mark.parametrize("arch", ["qwen2", "gemma3"])
def test_tiny_gguf_matches_transformers(arch, tmp_path):
    ref = randomized(tiny_qwen2() if arch == "qwen2" else tiny_gemma3())
    write_gguf(tmp_path / "tiny.gguf", ref, arch)
    cfg, params = load_gguf(tmp_path / "tiny.gguf")
    assert {k: np.shape(v) for k, v in params["layers"].items()} == expected_shapes(cfg)["layers"]
    if arch == "gemma3":
        assert cfg.layer_types == ("local",) * 5 + ("global", "local") and cfg.sliding_window == 16
        assert (cfg.qk_norm, cfg.post_norms, cfg.act, cfg.tie_embeddings) == (True, True, "gelu_tanh", True)
        assert cfg.embed_scale == pytest.approx(8.0) and cfg.rope_theta_local == 10000.0
    ids = np.random.default_rng(0).integers(0, 128, (2, 100))  # 100 tokens: past the 16-token window
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    model = Llama(cfg, params)
    assert np.abs(ours_logits(model, ids) - want).max() <= 1e-4
    if arch == "gemma3":  # the window is the local layers' policy: `full` there would be another model
        assert np.abs(ours_logits(model, ids, FULL) - want).max() > 1e-2


def test_tiny_gemma3_one_policy_over_both_layer_types(tmp_path):
    """Within the window, `full` on every layer (one scanned run over local and global layers,
    each layer picking its RoPE base) is Gemma 3 exactly."""
    ref = randomized(tiny_gemma3(window=32))
    write_gguf(tmp_path / "tiny.gguf", ref, "gemma3")
    model = Llama(*load_gguf(tmp_path / "tiny.gguf"))
    ids = np.random.default_rng(1).integers(0, 128, (1, 32))
    with torch.no_grad():
        want = ref(torch.tensor(ids)).logits.numpy()
    assert np.abs(ours_logits(model, ids, FULL) - want).max() <= 1e-4
    # and both RoPE bases matter: with the global base on local layers it is another model
    other = Llama(LlamaConfig(**{**vars(model.cfg), "rope_theta_local": None}), load_gguf(tmp_path / "tiny.gguf")[1])
    assert np.abs(ours_logits(other, ids, FULL) - want).max() > 1e-3


# ----------------------------------------------------------------------------------------------
# The hybrid stack and its memory (closed form)


def gemma3_270m_shape() -> LlamaConfig:
    return LlamaConfig(vocab_size=262144, d_model=640, n_layers=18, n_heads=4, n_kv_heads=1, head_dim=256,
                       d_ff=2048, layer_types=gemma3_layer_types(18), sliding_window=512, max_position=32768)


def test_model_stack_puts_the_policy_on_global_layers_only():
    cfg = gemma3_270m_shape()
    assert [i for i, t in enumerate(cfg.layer_types) if t == "global"] == [5, 11, 17]
    snap = kvpolicies.get("snapkv", budget=1024)
    stack = model_stack(cfg, snap)
    assert [p for i, p in enumerate(stack) if i in (5, 11, 17)] == [snap] * 3
    assert all(p == kvpolicies.get("window", window=512) for i, p in enumerate(stack) if i not in (5, 11, 17))
    assert stack[0].capacity(32768) == 512  # local layers really store 512 slots
    sink = kvpolicies.get("sink", n_sink=4, window=256)
    assert model_stack(cfg, FULL, local_policy=sink)[0] == sink and model_stack(cfg, FULL, sink)[5] == FULL
    quest = kvpolicies.get("quest")  # presets are indexed by depth: quest's dense layers 0-1 are local here
    assert [type(p).__name__ for p in model_stack(cfg, quest)[5::6]] == [type(quest.stack(18)[5]).__name__] * 3
    llama = LlamaConfig(vocab_size=8, d_model=8, n_layers=4, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8)
    assert model_stack(llama, quest) == quest.stack(4)
    with pytest.raises(ValueError, match="no local layers"):
        model_stack(llama, FULL, local_policy=sink)


@pytest.mark.parametrize("context", [8192, 32768])
def test_gemma3_hybrid_cache_bytes(context):
    cfg = gemma3_270m_shape()
    kw = dict(kv_heads=cfg.n_kv_heads, head_dim=cfg.head_dim, max_len=context, dtype=jnp.bfloat16)
    hybrid = stack_bytes(model_stack(cfg, FULL), **kw)
    dense = stack_bytes((FULL,) * cfg.n_layers, **kw)
    one = dict(kv_heads=1, head_dim=256, bytes_per_elem=2)
    assert hybrid.kv == closed_form_bytes(n_layers=15, slots=512, **one) + closed_form_bytes(
        n_layers=3, slots=context, **one)
    assert dense.kv == closed_form_bytes(n_layers=18, slots=context, **one)
    assert hybrid.kv / dense.kv == pytest.approx((15 * 512 + 3 * context) / (18 * context))


def test_config_rejects_bad_hybrid_fields():
    base = dict(vocab_size=8, d_model=8, n_layers=2, n_heads=2, n_kv_heads=1, head_dim=4, d_ff=8)
    with pytest.raises(ValueError, match="sliding_window must be set"):
        LlamaConfig(**base, layer_types=("local", "global"))
    with pytest.raises(ValueError, match="layer_types: 1 entries"):
        LlamaConfig(**base, layer_types=("global",), sliding_window=4)
    with pytest.raises(ValueError, match="'sliding'"):
        LlamaConfig(**base, layer_types=("sliding", "global"), sliding_window=4)
    with pytest.raises(ValueError, match="act='relu'"):
        LlamaConfig(**base, act="relu")


def test_missing_packages_are_one_clear_error(monkeypatch, tmp_path):
    import importlib.util

    from evals import zoo
    from models import packages

    monkeypatch.setenv("KVP_DATA", str(tmp_path))  # no assembled file there
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name.startswith(("pandas_sns", "gemma3_270m")) else real(name, *a))
    for name in ("qwen", "gemma3"):
        with pytest.raises(ValueError, match=rf"model={name}: .*not installed.*bash scripts/setup.sh long"):
            zoo.describe({"name": name})
    assert packages.INSTALL_HINT == "bash scripts/setup.sh long"


def test_fast_gguf_reader_matches_gguf_package(tmp_path):
    write_gguf(tmp_path / "tiny.gguf", randomized(tiny_gemma3()), "gemma3")
    ours, theirs = GGUFFile(tmp_path / "tiny.gguf"), gguf.GGUFReader(str(tmp_path / "tiny.gguf"))
    assert {k: ours.field(k) for k in theirs.fields if not k.startswith("GGUF.")} == {
        k: f.contents() for k, f in theirs.fields.items() if not k.startswith("GGUF.")}
    a, b = load_gguf(ours), load_gguf(theirs)
    assert a[0] == b[0]
    assert all(np.array_equal(a[1]["layers"][k], b[1]["layers"][k]) for k in a[1]["layers"])


# ----------------------------------------------------------------------------------------------
# The real files (slow): transformers' PyTorch model, float32, on the same dequantized weights.
# transformers' own GGUF import of these files (from_pretrained(..., gguf_file=...)) takes 4-5
# minutes on 2 shared cores, so the reference is built from a config the test maps from the file's
# metadata, with our dequantized weights copied in; the layout our loader reads from llama.cpp's
# files is checked against transformers' import above (tiny GGUFs), and the full import was checked
# once by hand (README: logits max |diff| 3.9e-05 for qwen on 128 tokens).


def hf_reference(cfg: LlamaConfig, params: dict, meta: GGUFFile):
    """transformers' Qwen2 / Gemma3 model from the GGUF metadata, with our float32 weights."""
    arch = meta.field("general.architecture")
    g = lambda k: meta.field(f"{arch}.{k}")  # noqa: E731
    common = dict(vocab_size=cfg.vocab_size, hidden_size=g("embedding_length"), intermediate_size=g("feed_forward_length"),
                  num_hidden_layers=g("block_count"), num_attention_heads=g("attention.head_count"),
                  num_key_value_heads=g("attention.head_count_kv"), rms_norm_eps=g("attention.layer_norm_rms_epsilon"),
                  max_position_embeddings=g("context_length"))
    sd = {"model.embed_tokens.weight": params["embed"], "model.norm.weight": params["final_norm"]}
    names = {"wq": "self_attn.q_proj.weight", "wk": "self_attn.k_proj.weight", "wv": "self_attn.v_proj.weight",
             "wo": "self_attn.o_proj.weight", "w_gate": "mlp.gate_proj.weight", "w_up": "mlp.up_proj.weight",
             "w_down": "mlp.down_proj.weight", "attn_norm": "input_layernorm.weight"}
    if arch == "qwen2":
        hc = transformers.Qwen2Config(**common, rope_theta=g("rope.freq_base"), tie_word_embeddings=False)
        cls = transformers.Qwen2ForCausalLM
        names.update(mlp_norm="post_attention_layernorm.weight", bq="self_attn.q_proj.bias",
                     bk="self_attn.k_proj.bias", bv="self_attn.v_proj.bias")
        sd["lm_head.weight"] = params["lm_head"].T
    else:
        hc = transformers.Gemma3TextConfig(**common, head_dim=g("attention.key_length"), query_pre_attn_scalar=256,
                                           sliding_window=g("attention.sliding_window"), tie_word_embeddings=True)
        assert hc.rope_parameters["full_attention"]["rope_theta"] == g("rope.freq_base") == 1e6
        assert hc.rope_parameters["sliding_attention"]["rope_theta"] == 10000.0
        cls = transformers.Gemma3ForCausalLM
        names.update(post_attn_norm="post_attention_layernorm.weight", mlp_norm="pre_feedforward_layernorm.weight",
                     post_mlp_norm="post_feedforward_layernorm.weight", q_norm="self_attn.q_norm.weight",
                     k_norm="self_attn.k_norm.weight")
        sd = {k: v - 1.0 if k.endswith("norm.weight") else v for k, v in sd.items()}  # HF norms: (1 + w)
    for key, hf in names.items():
        for i, w in enumerate(params["layers"][key]):
            w = w.T if w.ndim == 2 else w
            sd[f"model.layers.{i}.{hf}"] = w - 1.0 if (arch == "gemma3" and hf.endswith("norm.weight")) else w
    if arch == "gemma3":
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]  # tied
    from transformers.initialization import no_init_weights

    with no_init_weights():  # every weight is loaded below: skip the random init (tens of seconds)
        ref = cls(hc)
    ref = ref.float().eval()
    ref.load_state_dict({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()}, strict=True)
    return ref


def _ref_run(ref, ids: np.ndarray) -> tuple[np.ndarray, float]:
    """transformers' logits of the first 128 tokens and perplexity of all, from ONE forward pass
    (causal: the first 128 positions do not see the rest; the head runs in chunks to save memory)."""
    with torch.no_grad():
        h = ref.model(torch.tensor(ids[None])).last_hidden_state[0]  # [T, d]
        logits128 = ref.lm_head(h[:128]).numpy()[None]
        t = len(ids) - 1  # predictions
        nll = torch.cat([torch.nn.functional.cross_entropy(ref.lm_head(h[a:min(a + 256, t)]),
                                                           torch.tensor(ids[a + 1:min(a + 257, t + 1)]), reduction="none")
                         for a in range(0, t, 256)])
    return logits128, math.exp(nll.mean().item())


def _real(name: str, clock=None) -> dict:
    import time

    from evals import zoo
    from evals.data import default_text
    from models.tokenizer import Tokenizer

    clock = {} if clock is None else clock
    t = time.perf_counter()

    def lap(what):
        nonlocal t
        clock[what] = time.perf_counter() - t
        t = time.perf_counter()

    path = zoo._gguf_path({"name": name})
    meta = GGUFFile(path)
    cfg, params = load_gguf(meta)
    tok = Tokenizer.from_gguf(meta)
    lap("load")
    ids = np.asarray(tok.encode(default_text()[:20000], add_special_tokens=True)[:1024])
    ref = hf_reference(cfg, params, meta)
    lap("hf_build")
    want128, ppl_ref = _ref_run(ref, ids)
    lap("hf_run")
    del ref
    model = Llama(cfg, params)
    del params
    # ours: ONE forward pass of the 1,024 tokens through the hybrid stack (global: full, local:
    # window(512): its second half attends past the window); the first 128 positions' logits, and the
    # NLL with the head run in chunks (2,048 tokens until 2026-12-07: the same logits, 48 s more of the stage)
    pols = model_stack(cfg, FULL)
    t_ = len(ids)
    h, _ = model.hidden(
        jnp.asarray(ids[None]), jnp.arange(t_, dtype=jnp.int32)[None], model.init_cache(pols, 1, t_), pols)
    got128 = np.asarray(model.logits(h[:, :128]))
    nll = []
    for a in range(0, t_ - 1, 256):
        lg = model.logits(h[:, a:min(a + 256, t_ - 1)])[0]  # [C, V]
        nll.append(np.asarray(jax.nn.logsumexp(lg, -1) - jnp.take_along_axis(
            lg, jnp.asarray(ids[a + 1:min(a + 257, t_)])[:, None], -1)[:, 0]))
    ppl = math.exp(float(np.concatenate(nll).mean()))
    lap("ours_ppl")
    return {"ids": ids, "cfg": cfg, "got128": got128, "want128": want128, "ppl": ppl, "ppl_ref": ppl_ref}


@pytest.fixture(scope="module")
def qwen():
    return _real("qwen")


@pytest.fixture(scope="module")
def gemma3():
    return _real("gemma3")


@pytest.mark.slow
def test_qwen_matches_transformers(qwen):
    cfg = qwen["cfg"]
    assert (cfg.n_layers, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.rope_theta, cfg.qkv_bias) == (
        24, 14, 2, 64, 1e6, True)
    assert cfg.max_position == 32768 and not cfg.tie_embeddings
    from benchmarks.gpu import SHAPE_TWINS  # benchmarks.gpu's random-weight twin, for a device without the file

    assert {k: getattr(cfg, k) for k in SHAPE_TWINS["qwen"]} == SHAPE_TWINS["qwen"]
    got, want = qwen["got128"], qwen["want128"]
    assert np.abs(got - want).max() <= 1e-3
    assert abs(qwen["ppl"] - qwen["ppl_ref"]) / qwen["ppl_ref"] < 0.005
    assert 1.5 < qwen["ppl"] < 40  # a real language model on real prose


@pytest.mark.slow
def test_gemma3_matches_transformers(gemma3):
    cfg = gemma3["cfg"]
    assert cfg.layer_types == gemma3_layer_types(18) and cfg.sliding_window == 512
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.max_position) == (4, 1, 256, 32768)
    assert gemma3["ids"][0] == 2  # <bos>: Gemma is trained with it
    got, want = gemma3["got128"], gemma3["want128"]
    assert np.abs(got - want).max() <= 1e-3
    assert abs(gemma3["ppl"] - gemma3["ppl_ref"]) / gemma3["ppl_ref"] < 0.005
    assert 1.5 < gemma3["ppl"] < 60


# ----------------------------------------------------------------------------------------------
# Gemma's SentencePiece tokenizer: a GGUF holding the first 8,000 tokens of Gemma 3's vocabulary
# (control and user-defined tokens, the 256 byte-fallback tokens, the most frequent pieces)


def test_sentencepiece_tokenizer_matches_transformers(tmp_path):
    from models.packages import gemma3_gguf_path
    from models.tokenizer import Tokenizer

    src = GGUFFile(gemma3_gguf_path())
    n = 8000
    w = gguf.GGUFWriter(str(tmp_path / "tok.gguf"), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_token_list(src.field("tokenizer.ggml.tokens")[:n])
    w.add_token_scores(src.field("tokenizer.ggml.scores")[:n])
    w.add_token_types(src.field("tokenizer.ggml.token_type")[:n])
    for key in ("bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id"):
        w.add_uint32(f"tokenizer.ggml.{key}", src.field(f"tokenizer.ggml.{key}"))
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_bool("tokenizer.ggml.add_space_prefix", False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.close()
    ours = Tokenizer.from_gguf(tmp_path / "tok.gguf")
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="tok.gguf", local_files_only=True)
    from evals.data import default_text
    from tests.refs.texts import TEXTS

    texts = TEXTS + [default_text()[:5000], "<start_of_turn>user\nhi<end_of_turn>\n", "  x   y    z\t\t", "ÿ 🦀 ∑"]
    for text in texts:
        for special in (False, True):
            assert ours.encode(text, add_special_tokens=special) == ref(text, add_special_tokens=special).input_ids
        ids = ours.encode(text)
        assert ours.decode(ids) == ref.decode(ids)
    assert ours.encode("hi", add_special_tokens=True)[0] == ours.bos_id == 2
    assert any(t.startswith("<0x") for t in map(ours.id_to_token, ours.encode("🦀")))  # byte fallback
