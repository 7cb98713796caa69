"""`evals.train_restorekv` on a tiny random Llama: its dense forward is `models.llama`'s (the teacher re-computed by
the model itself), a few AdamW steps lower the symmetric KL to that teacher on the windows trained on, and the
trained file run through inference (`kvpolicies.compat.kvpress("RestoreKVPress", ...)`, `Engine.compress`, whose
restore pass is the engine's, or `models.lora.restore` by hand, `Engine.feed`) gives the student's logits: what
training optimises is what inference runs."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from evals import train_restorekv as T
from kvpolicies.compat import kvpress
from kvpolicies.full import Full
from models import lora
from models.config import LlamaConfig
from models.engine import Engine
from models.llama import Llama
from models.tokenizer import ByteTokenizer

CFG = LlamaConfig(vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=48)
T_CTX, M, N, RATIO = 48, 12, 4, 0.5
SETTINGS = dict(T.DEFAULTS, n=N, rank=4, alpha=8.0, steps=40, warmup=5, lr=3e-2, ratio_min=RATIO, ratio_max=RATIO)


def model_logits(model: Llama, ids: np.ndarray) -> np.ndarray:
    """The model's own logits [T, V] over `ids` through a full cache (the teacher, re-computed)."""
    cache = model.init_cache(Full(), 1, ids.size)
    pos = jnp.arange(ids.size)[None]
    return np.asarray(model(jnp.asarray(ids)[None], pos, cache, Full())[0][0])


def test_training_lowers_the_kl_to_the_model_s_own_teacher(tmp_path):
    model = Llama(CFG)
    rng = np.random.default_rng(0)
    texts = [rng.integers(0, 128, T_CTX + M) for _ in range(2)]
    base = T.base_weights(model)
    windows = T.make_windows(model, ByteTokenizer(), base, texts, T_CTX)
    teachers = [model_logits(model, ids)[T_CTX:] for ids in texts]  # the model's own, not train_restorekv's forward
    for w, want in zip(windows, teachers):
        np.testing.assert_allclose(np.asarray(w["logits"]), want, rtol=1e-4, atol=1e-4)

    one = jax.jit(lambda params, w, kept, want: T.symmetric_kl(want, T.student_logits(model, base, params, 8.0, w,
                                                                                     kept, w["target"])))

    def kl(params):
        return np.mean([float(one(params, {k: w[k] for k in ("k", "v", "target")},
                                  jnp.asarray(T.kept_context(w["scores"], RATIO, N)), jnp.asarray(want)))
                        for w, want in zip(windows, teachers)])

    init = jax.tree.map(jnp.asarray, T.init_arrays(model, N, 4, 0))
    params, history = T.train(model, base, windows, SETTINGS)
    assert len(history) == 40 and np.isfinite(history).all()
    before, after = kl(init), kl(params)
    assert after < 0.7 * before, (before, after)
    assert np.abs(np.asarray(params["B"]["wv"])).max() > 0  # the LoRA trained, not only the embeddings

    # the file through inference: the last target token's logits are the student's
    path = tmp_path / "restore.npz"
    T.to_file(params, SETTINGS, path)
    eng = Engine(model, kvpress("RestoreKVPress", RATIO, max_new=M, restore_model_name=str(path)),
                 max_len=T_CTX + N + M, repeat=ByteTokenizer())
    ctx, target = texts[0][:T_CTX], texts[0][T_CTX:]
    prompt = eng.prompt(ctx[None])
    kept = jnp.asarray(T.kept_context(windows[0]["scores"], RATIO, N))
    want = np.asarray(T.student_logits(model, base, params, 8.0, windows[0], kept, windows[0]["target"])[-1])
    # the engine's own restore pass (compress alone) and the one by hand (models.lora.restore, then compress)
    for state in (eng.compress(prompt), eng.compress(lora.restore(eng, prompt))):
        assert state.length == T_CTX + N
        got = np.asarray(eng.feed(state, target[None]).logits[0])
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)
