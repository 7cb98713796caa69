"""Train RestoreKV's restore embeddings and LoRA (`kvpolicies.restorekv`) by self-distillation, with optax, offline.

    python -m evals.train_restorekv model=smollm2              # $KVP_DATA/restorekv/smollm2.npz
    python -m evals.train_restorekv model=qwen contexts=32 steps=2000

Shapes: n restore tokens, t context tokens, m target tokens, V vocab, d model width, L layers, K kv heads,
G query heads per kv head, D head dim, r LoRA rank, I / O a projection's input / output width.

The paper's recipe (arXiv:2608.01247; the authors' cvsp-lab/RestoreKV `experiments/train_learnable_restore.py`,
`model/learnable_restore.py`): the base model frozen; trained are n = 8 restore embeddings (init N(0, 0.02))
and a rank-8 LoRA with alpha 16 on every q, k, v, o, gate, up and down projection (A kaiming-uniform,
U(+-1/sqrt(I)); B zero; dropout 0). A window of text is cut into a context (t tokens) and the m tokens that
follow it. The teacher is the frozen model with the full cache: its logits over the m target tokens. The
student: KVzip scores the context, the restore tokens go through the LoRA-adapted model at positions
t..t+n-1 over the full context cache, then KVzip evicts the context's lowest-scored pairs at the
budget-matched ratio r + n / t, and the target tokens (from position t + n, LoRA off) read what is left plus
the restore slots. The loss is the symmetric KL, KL(teacher || student) + KL(student || teacher), of the
next-token distributions at every target token; AdamW (lr 1e-4, weight decay 0.01), gradients clipped to
norm 1, 50 linear warm-up steps then a cosine decay, the ratio drawn per step (the authors' kept fraction
0.1..0.5 for their released 8-token adapters: kvpress's compression ratio 0.5..0.9).

Ours, on CPU: windows of the Paul Graham essays (the authors: FineWeb-Edu, contexts of 512..8192 tokens
log-uniform, 512 target tokens), a fixed context length `length` and `target` tokens (one compiled step),
the KL averaged over the target tokens (the authors sum them: the same direction, another scale), KVzip as
kvpress's `KVzipPress` (one choice over all layers, its repeat prompts; the authors' own KVzip in training).
The student and teacher run a dense float32 forward of the same weights here (`forward`; tested against
`models.llama`), through which the gradient reaches the restore tokens' keys and values. Output:
`$KVP_DATA/restorekv/<model>.npz` (`kvpolicies.restorekv.save_restore`'s format) and a `.json` with the loss
on held-out windows before and after training.
"""

from __future__ import annotations

import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Bool, Float, Int

from evals.qfilter import out_path, parse
from kvpolicies.restorekv import LORA_MODULES, save_restore
from models.llama import ACT, Llama, rms_norm
from models.lora import merge_jax

DEFAULTS = dict(model="smollm2", contexts=8, holdout=2, length=512, target=64, n=8, rank=8, alpha=16.0, steps=1000,
                warmup=50, lr=1e-4, weight_decay=0.01, clip=1.0, ratio_min=0.5, ratio_max=0.9, seed=0, out="")


def lora_shapes(model: Llama) -> dict[str, tuple[int, int]]:
    """(I, O) of every adapted projection of `model` (`LORA_MODULES`)."""
    return {k: tuple(model.layers[k][...].shape[1:]) for k in LORA_MODULES}


def init_arrays(model: Llama, n: int, rank: int, seed: int = 0) -> dict:
    """The authors' initialisation, drawn with numpy: {"emb": [n, d] N(0, 0.02), "A": {name: [L, r, I]}
    U(+-1/sqrt(I)) (torch's kaiming_uniform with a = sqrt(5)), "B": {name: [L, O, r]} zeros}."""
    rng = np.random.default_rng(seed)
    nl = model.cfg.n_layers
    shapes = lora_shapes(model)
    return {"emb": (0.02 * rng.standard_normal((n, model.cfg.d_model))).astype(np.float32),
            "A": {k: rng.uniform(-i ** -0.5, i ** -0.5, (nl, rank, i)).astype(np.float32)
                  for k, (i, o) in shapes.items()},
            "B": {k: np.zeros((nl, o, rank), np.float32) for k, (i, o) in shapes.items()}}


def base_weights(model: Llama) -> dict:
    """The frozen weights the forward reads: {"layers": {name: [L, ...]}, "embed", "final_norm", "head" [d, V]}."""
    head = model.lm_head[...] if model.lm_head is not None else model.embed[...].T
    return {"layers": {k: v[...].astype(jnp.float32) for k, v in model.layers.items()},
            "embed": model.embed[...].astype(jnp.float32), "final_norm": model.final_norm[...].astype(jnp.float32),
            "head": head.astype(jnp.float32)}


def forward(model: Llama, layers: dict, final_norm: Array, x: Float[Array, "T d"], pos: Int[Array, "T"],
            ck: Float[Array, "L K S D"], cv: Float[Array, "L K S D"], vis: Bool[Array, "L K S"]
            ) -> tuple[Float[Array, "T d"], Float[Array, "L K T D"], Float[Array, "L K T D"]]:
    """T tokens' inputs x at positions pos after S cached slots (keys after RoPE), each slot visible to every new
    query where `vis`, the new tokens causal among themselves; dense float32 attention, `models.llama.block`'s
    layer (no local layers). Returns the final-normed hidden states and the new tokens' keys (rotated), values."""
    cfg = model.cfg
    k_, n_, d_ = cfg.n_kv_heads, cfg.n_heads, cfg.head_dim
    g_, t_ = n_ // k_, x.shape[0]
    scale = d_ ** -0.5 if cfg.attn_scale is None else cfg.attn_scale
    causal = jnp.tril(jnp.ones((t_, t_), bool))

    def layer(x, inp):  # one layer (a lax.scan over the stacked weights: one compiled body, whatever L)
        w, ck_l, cv_l, vis_l = inp
        h = rms_norm(x, w["attn_norm"], cfg.norm_eps)
        q, k, v = h @ w["wq"], h @ w["wk"], h @ w["wv"]
        if cfg.qkv_bias:
            q, k, v = q + w["bq"], k + w["bk"], v + w["bv"]
        q = q.reshape(t_, n_, d_).transpose(1, 0, 2)  # [N, T, D]
        k = k.reshape(t_, k_, d_).transpose(1, 0, 2)  # [K, T, D]
        v = v.reshape(t_, k_, d_).transpose(1, 0, 2)  # [K, T, D]
        if cfg.qk_norm:
            q, k = rms_norm(q, w["q_norm"], cfg.norm_eps), rms_norm(k, w["k_norm"], cfg.norm_eps)
        q, k = model.rope.apply(q, pos[None]), model.rope.apply(k, pos[None])
        keys, vals = jnp.concatenate([ck_l, k], axis=1), jnp.concatenate([cv_l, v], axis=1)  # [K, S + T, D]
        mask = jnp.concatenate([jnp.broadcast_to(vis_l[:, None, :], (k_, t_, vis_l.shape[-1])),
                                jnp.broadcast_to(causal, (k_, t_, t_))], axis=-1)  # [K, T, S + T]
        lg = jnp.einsum("KGTD,KSD->KGTS", q.reshape(k_, g_, t_, d_), keys) * scale
        p = jax.nn.softmax(jnp.where(mask[:, None], lg, -jnp.inf), axis=-1)
        o = jnp.einsum("KGTS,KSD->KGTD", p, vals).reshape(n_, t_, d_).transpose(1, 0, 2).reshape(t_, n_ * d_) @ w["wo"]
        if cfg.post_norms:
            o = rms_norm(o, w["post_attn_norm"], cfg.norm_eps)
        x = x + o
        h = rms_norm(x, w["mlp_norm"], cfg.norm_eps)
        m = (ACT[cfg.act](h @ w["w_gate"]) * (h @ w["w_up"])) @ w["w_down"]
        if cfg.post_norms:
            m = rms_norm(m, w["post_mlp_norm"], cfg.norm_eps)
        return x + m, (k, v)

    x, (ks, vs) = jax.lax.scan(layer, x, (layers, ck, cv, vis))
    return rms_norm(x, final_norm, cfg.norm_eps), ks, vs


def empty(model: Llama) -> tuple[Array, Array, Array]:
    """A cache of no slots for `forward`."""
    cfg = model.cfg
    z = jnp.zeros((cfg.n_layers, cfg.n_kv_heads, 0, cfg.head_dim), jnp.float32)
    return z, z, jnp.zeros(z.shape[:3], bool)


def teacher(model: Llama, base: dict, ctx: Int[np.ndarray, "t"], target: Int[np.ndarray, "m"]) -> dict:
    """The full-cache pass over context + target: the context's keys and values [L, K, t, D] and the logits
    [m, V] at the target tokens."""
    ids = jnp.asarray(np.concatenate([ctx, target]))
    x = base["embed"][ids] * model.cfg.embed_scale
    h, k, v = forward(model, base["layers"], base["final_norm"], x, jnp.arange(ids.size), *empty(model))
    t = ctx.size
    return {"k": k[:, :, :t], "v": v[:, :, :t], "logits": h[t:] @ base["head"]}


def student_logits(model: Llama, base: dict, params: dict, alpha: float, win: dict, kept: Bool[Array, "L K t"],
                   target: Int[Array, "m"]) -> Float[Array, "m V"]:
    """The student's logits at the target tokens: the restore tokens through the LoRA-merged weights over the
    whole context (positions t..t+n-1), then the target from t + n over the kept context pairs and the restore
    slots, with the base weights."""
    t, n = win["k"].shape[2], params["emb"].shape[0]
    vis = jnp.ones(win["k"].shape[:3], bool)
    adapted = merge_jax(base["layers"], params["A"], params["B"], alpha)
    _, rk, rv = forward(model, adapted, base["final_norm"], params["emb"], t + jnp.arange(n), win["k"], win["v"], vis)
    ck, cv = jnp.concatenate([win["k"], rk], axis=2), jnp.concatenate([win["v"], rv], axis=2)
    seen = jnp.concatenate([kept, jnp.ones(rk.shape[:3], bool)], axis=2)
    x = base["embed"][target] * model.cfg.embed_scale
    h, _, _ = forward(model, base["layers"], base["final_norm"], x, t + n + jnp.arange(target.size), ck, cv, seen)
    return h @ base["head"]


def symmetric_kl(teacher_logits: Float[Array, "m V"], student: Float[Array, "m V"]) -> Array:
    """KL(teacher || student) + KL(student || teacher), summed over the vocabulary, averaged over positions."""
    lt, ls = jax.nn.log_softmax(teacher_logits, -1), jax.nn.log_softmax(student, -1)
    return ((jnp.exp(lt) - jnp.exp(ls)) * (lt - ls)).sum(-1).mean()


def kept_context(scores: Float[np.ndarray, "L K t"], ratio: float, n: int, n_sink: int = 4) -> np.ndarray:
    """kvpress's KVzipPress choice over all layers at the budget-matched ratio min(1, ratio + n / t) (as
    `kvpolicies.restorekv.RestoreKV`): [L, K, t] kept context pairs."""
    from kvpolicies.kvzip import model_scope_keep

    t = scores.shape[-1]
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (scores.shape[0], 1, 1, t))
    return np.asarray(model_scope_keep(jnp.asarray(scores)[:, None], pos, min(1.0, ratio + n / t), n_sink))[:, 0]


def scorer(model: Llama, tok, length: int):
    """An engine that scores contexts of `length` tokens as kvpress's KVzipPress (our `kvzip` with its prompts)."""
    from kvpolicies.compat import kvpress
    from models.engine import Engine

    return Engine(model, kvpress("KVzipPress", 0.5, max_new=0), max_len=length, repeat=tok)


def kvzip_scores(engine, ctx: Int[np.ndarray, "t"]) -> np.ndarray:
    """The KVzip reconstruction scores of a context, [L, K, t] (`scorer`'s engine)."""
    state = engine.reconstruct(engine.prompt(ctx[None]))
    return np.concatenate([np.asarray(st.extra["zip"])[:, 0] for st in state.cache])


def make_windows(model: Llama, tok, base: dict, texts: list[np.ndarray], length: int) -> list[dict]:
    """Per window of length + m ids: the teacher's pass and the context's KVzip scores."""
    out, engine = [], scorer(model, tok, length)
    for ids in texts:
        ctx, target = ids[:length], ids[length:]
        out.append({**teacher(model, base, ctx, target), "scores": kvzip_scores(engine, ctx),
                    "target": jnp.asarray(target)})
    return out


def schedule(cfg: dict):
    """The authors' lr: linear warm-up over `warmup` steps, then a cosine decay to 0 at `steps`."""
    def lr(count):
        s = count + 1
        warm = s / max(cfg["warmup"], 1)
        progress = jnp.clip((s - cfg["warmup"]) / max(1, cfg["steps"] - cfg["warmup"]), 0.0, 1.0)
        return cfg["lr"] * jnp.where(s <= cfg["warmup"], warm, 0.5 * (1 + jnp.cos(jnp.pi * progress)))
    return lr


def train(model: Llama, base: dict, windows: list[dict], cfg: dict, progress: bool = False) -> tuple[dict, list]:
    """(trained params, the training loss per step): AdamW on the symmetric KL, one window a step (cycled), the
    ratio drawn uniformly in [ratio_min, ratio_max] (kvpress's compression ratio; budget-matched)."""
    params = jax.tree.map(jnp.asarray, init_arrays(model, cfg["n"], cfg["rank"], cfg["seed"]))
    opt = optax.chain(optax.clip_by_global_norm(cfg["clip"]),
                      optax.adamw(schedule(cfg), b1=0.9, b2=0.999, eps=1e-8, weight_decay=cfg["weight_decay"]))
    state = opt.init(params)
    alpha = float(cfg["alpha"])

    @jax.jit
    def step(params, state, win, kept, target):
        def loss(p):
            return symmetric_kl(win["logits"], student_logits(model, base, p, alpha, win, kept, target))
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = opt.update(grads, state, params)
        return optax.apply_updates(params, updates), state, value

    rng = np.random.default_rng(cfg["seed"] + 1)
    history = []
    for i in range(cfg["steps"]):
        win = windows[i % len(windows)]
        ratio = float(rng.uniform(cfg["ratio_min"], cfg["ratio_max"]))
        kept = jnp.asarray(kept_context(win["scores"], ratio, cfg["n"]))
        sub = {k: win[k] for k in ("k", "v", "logits")}
        params, state, value = step(params, state, sub, kept, win["target"])
        history.append(float(value))
        if progress and (i + 1) % 50 == 0:
            print(f"train_restorekv: step {i + 1}/{cfg['steps']} loss {np.mean(history[-50:]):.4f}", flush=True)
    return params, history


def evaluate(model: Llama, base: dict, params: dict, windows: list[dict], cfg: dict, ratio: float) -> float:
    """The mean symmetric KL over `windows` at `ratio`."""
    f = jax.jit(lambda p, win, kept, target: symmetric_kl(
        win["logits"], student_logits(model, base, p, float(cfg["alpha"]), win, kept, target)))
    return float(np.mean([f(params, {k: w[k] for k in ("k", "v", "logits")},
                            jnp.asarray(kept_context(w["scores"], ratio, cfg["n"])), w["target"]) for w in windows]))


def to_file(params: dict, cfg: dict, path) -> None:
    save_restore(path, np.asarray(params["emb"]), {k: np.asarray(v) for k, v in params["A"].items()},
                 {k: np.asarray(v) for k, v in params["B"].items()}, cfg["alpha"],
                 meta={k: v for k, v in cfg.items() if k != "out"})


def main(argv: list[str] | None = None):
    cfg = parse(sys.argv[1:] if argv is None else argv, DEFAULTS, "train_restorekv", __doc__)
    from evals import zoo
    from evals.qfilter import windows_of

    model, tok = zoo.load_model({"name": cfg["model"], "dtype": "float32"})
    if any(model.cfg.local_layers):
        raise SystemExit("train_restorekv: a model with local layers (Gemma 3): kvpress refuses KVzip there")
    if not 0 < cfg["ratio_min"] <= cfg["ratio_max"] < 1 or cfg["holdout"] >= cfg["contexts"]:
        raise SystemExit("train_restorekv: needs 0 < ratio_min <= ratio_max < 1 and holdout < contexts")
    base = base_weights(model)
    texts = windows_of(tok, cfg["contexts"], cfg["length"] + cfg["target"])
    windows = make_windows(model, tok, base, texts, cfg["length"])
    train_w, held = windows[:-cfg["holdout"]], windows[-cfg["holdout"]:]
    mid = (cfg["ratio_min"] + cfg["ratio_max"]) / 2
    init = jax.tree.map(jnp.asarray, init_arrays(model, cfg["n"], cfg["rank"], cfg["seed"]))
    before = evaluate(model, base, init, held, cfg, mid)
    params, history = train(model, base, train_w, cfg, progress=True)
    after = evaluate(model, base, params, held, cfg, mid)
    path = out_path(cfg, "restorekv")
    to_file(params, cfg, path)
    report = {"model": cfg["model"], "config": cfg, "heldout_ratio": mid, "heldout_kl_init": before,
              "heldout_kl": after, "train_loss_first": history[:10], "train_loss_last": history[-10:],
              "command": "python -m evals.train_restorekv " + " ".join(f"{k}={v}" for k, v in cfg.items()
                                                                       if k != "out")}
    path.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"train_restorekv: {cfg['model']}: held-out symmetric KL at ratio {mid:.2f} {before:.4f} -> {after:.4f}; "
          f"wrote {path}")
    return path


if __name__ == "__main__":
    main()
