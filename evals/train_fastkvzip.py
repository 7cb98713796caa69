"""Train FastKVzip's gates (`kvpolicies.fastkvzip`) on our own KVzip scores, with optax, offline.

    python -m evals.train_fastkvzip model=smollm2            # $KVP_DATA/fastkvzip/smollm2.npz
    python -m evals.train_fastkvzip model=qwen contexts=16 steps=5000

Shapes: N tokens, L layers, d model width, K kv heads, G query heads per kv head, E = 16, S = 16.

The authors' recipe (Janghyun1230/FastKVzip `optim.py`, `utils.py`): per layer a gate (q_proj d -> K G E
with bias, k_proj d -> K E, RMSNorm of both with a learned weight, S = 16 learned sink keys, a bias b
[K, G]; initialised as torch's nn.Linear, the sink keys and b at 0) fitted to KVzip's score of every
(token, kv head) by binary cross-entropy (mean over tokens, summed over heads and layers), SGD with
momentum 0.9 at lr 0.2 (x 0.01 t over the first 1 % of the steps, then 1, 0.5 from half-way, 0.25 from
three quarters), 5,000 steps of 1,000 tokens. Ours: the same on the (hidden states, KVzip scores) data
`evals.train_kvzap` collects and caches (`$KVP_DATA/kvzap/<model>/`, our kvzip's reconstruction scores of
`contexts` windows of the Paul Graham essays; the last `holdout` held out), the initialisation drawn with
numpy (`seed`). Deviation: the authors' training forward adds b twice to the logit, kvpress's gate (which
the saved gates serve) once; we train the form kvpress runs. Output: `$KVP_DATA/fastkvzip/<model>.npz`
(`kvpolicies.fastkvzip.GATE_NAMES`, [L, ...] float32) and a `.json` with the held-out loss before and after
training and the agreement of `score >= 0.05` with the target's (the authors' "acc").
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jaxtyping import Array, Float

from evals.qfilter import out_path, parse
from kvpolicies.fastkvzip import gate_scores

DEFAULTS = dict(model="smollm2", contexts=16, holdout=4, length=1024, offset=0, steps=5000, batch=1000, lr=0.2,
                seed=0, out="")
E, S = 16, 16  # the gate's width and sink keys (the authors' released gates: q{G}_dim16_sink16)


def init_gates(d: int, kv_heads: int, groups: int, n_layers: int, seed: int = 0) -> dict[str, np.ndarray]:
    """The authors' initialisation (torch's nn.Linear: uniform within 1/sqrt(d); RMSNorm weights 1; sink keys
    and b 0), drawn with numpy: {name: [L, ...]} float32."""
    rng = np.random.default_rng(seed)
    u = lambda *s: rng.uniform(-d ** -0.5, d ** -0.5, (n_layers,) + s).astype(np.float32)  # noqa: E731
    z = lambda *s: np.zeros((n_layers,) + s, np.float32)  # noqa: E731
    return {"q_w": u(d, kv_heads * groups * E), "q_b": u(kv_heads * groups * E), "k_w": u(d, kv_heads * E),
            "q_norm": z(E) + 1, "k_norm": z(E) + 1, "k_base": z(kv_heads, S, E), "b": z(kv_heads, groups)}


@jax.jit
def bce(params: dict, x: Float[Array, "L N d"], y: Float[Array, "L N K"]) -> Float[Array, "L"]:
    """Per layer: binary cross-entropy of the gates' scores against the targets, mean over tokens, summed
    over kv heads (log clamped at -100, as torch's)."""
    pred = jax.vmap(lambda p, h: gate_scores(p, h[None])[0])(params, x)  # [L, K, N]
    t = jnp.swapaxes(y, 1, 2)  # [L, K, N]
    ll = t * jnp.maximum(jnp.log(pred), -100.0) + (1 - t) * jnp.maximum(jnp.log1p(-pred), -100.0)
    return -ll.mean(axis=-1).sum(axis=-1)


@jax.jit
def agreement(params: dict, x: Float[Array, "L N d"], y: Float[Array, "L N K"]) -> Float[Array, "L"]:
    """Per layer: the share of (token, kv head) pairs where score >= 0.05 agrees with target >= 0.05 (the
    authors' `acc_fn`)."""
    thres = 0.05
    pred = jax.vmap(lambda p, h: gate_scores(p, h[None])[0])(params, x)  # [L, K, N]
    return ((pred >= thres) == (jnp.swapaxes(y, 1, 2) >= thres)).mean(axis=(1, 2))


def schedule(step: Array, steps: int) -> Array:
    """The authors' `lr_schedule` factor: 0.01 t over the first 1 %, then 1, 0.5 from half-way, 0.25 from 3/4."""
    return jnp.where(step < 0.01 * steps, 0.01 * step, jnp.where(step < 0.5 * steps, 1.0,
                                                                 jnp.where(step < 0.75 * steps, 0.5, 0.25)))


def train(x: np.ndarray, y: np.ndarray, kv_heads: int, groups: int, steps: int, batch: int, lr: float,
          seed: int, progress: bool = False) -> dict[str, np.ndarray]:
    """Gates fitted to targets y [L, N, K] in [0, 1] from hidden states x [L, N, d] (SGD, momentum 0.9);
    `progress`: a bar over the steps."""
    from tqdm.auto import tqdm

    n_layers, n, d = x.shape
    params = {k: jnp.asarray(v) for k, v in init_gates(d, kv_heads, groups, n_layers, seed).items()}
    opt = optax.sgd(lambda s: lr * schedule(s, steps), momentum=0.9)
    state = opt.init(params)

    @jax.jit
    def update(params, state, xb, yb):
        loss, g = jax.value_and_grad(lambda p: bce(p, xb, yb).sum())(params)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), state, loss

    rng = np.random.default_rng(seed + 1)
    order = np.concatenate([rng.permutation(n) for _ in range(-(-steps * batch // n) + 1)])  # reshuffled epochs
    for s in tqdm(range(steps), desc="train fastkvzip gates", disable=not progress):
        idx = order[s * batch:(s + 1) * batch]
        params, state, _ = update(params, state, jnp.asarray(x[:, idx], jnp.float32), jnp.asarray(y[:, idx]))
    return {k: np.asarray(v, np.float32) for k, v in params.items()}


def main(argv: list[str] | None = None) -> Path:
    cfg = parse(sys.argv[1:] if argv is None else argv, DEFAULTS, "train_fastkvzip", __doc__)
    from evals import zoo
    from evals.train_kvzap import EPS, collect, load

    model, tok = zoo.load_model({"name": cfg["model"], "dtype": "float32"})
    mc = model.cfg
    if any(mc.local_layers):
        raise SystemExit("train_fastkvzip: a model with local layers (Gemma 3): kvpress's gates cover every layer")
    h, ylog = load(collect(model, tok, {**cfg, "progress": True}))  # [L, N, d] float16, [L, N, K] log(score + EPS)
    y = np.clip(np.exp(ylog) - EPS, 0.0, 1.0).astype(np.float32)
    n_te = cfg["holdout"] * cfg["length"]
    xtr, ytr, xte, yte = h[:, :-n_te], y[:, :-n_te], h[:, -n_te:].astype(np.float32), y[:, -n_te:]
    g = mc.n_heads // mc.n_kv_heads
    init = {k: jnp.asarray(v) for k, v in init_gates(mc.d_model, mc.n_kv_heads, g, mc.n_layers, cfg["seed"]).items()}
    gates = train(xtr, ytr, mc.n_kv_heads, g, cfg["steps"], cfg["batch"], cfg["lr"], cfg["seed"], progress=True)
    params = {k: jnp.asarray(v) for k, v in gates.items()}
    report = {"model": cfg["model"], "config": cfg, "train_tokens": int(xtr.shape[1]), "heldout_tokens": int(n_te),
              "heldout_bce_init": np.asarray(bce(init, xte, yte)).tolist(),
              "heldout_bce": np.asarray(bce(params, xte, yte)).tolist(),
              "heldout_agreement": np.asarray(agreement(params, xte, yte)).tolist(),
              "command": "python -m evals.train_fastkvzip " + " ".join(f"{k}={v}" for k, v in cfg.items()
                                                                    if k != "out")}
    path = out_path(cfg, "fastkvzip")
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **gates)
    path.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"train_fastkvzip: {cfg['model']}: held-out BCE {np.mean(report['heldout_bce_init']):.3f} -> "
          f"{np.mean(report['heldout_bce']):.3f} (per layer, summed over kv heads), agreement at 0.05 "
          f"{np.mean(report['heldout_agreement']):.3f}; wrote {path}")
    return path


if __name__ == "__main__":
    main()
