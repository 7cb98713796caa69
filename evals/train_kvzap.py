"""Train KVzap's surrogates (`kvpolicies.kvzap`) on our own KVzip scores, with optax.

    python -m evals.train_kvzap model=smollm2 kind=linear      # minutes on a CPU
    python -m evals.train_kvzap model=qwen kind=mlp contexts=24 steps=3000

Shapes: N tokens, L layers, d model width, K kv heads.

1. Data (cached under $KVP_DATA/kvzap/<model>/, one file per context, so an interrupted run
   resumes where it stopped): `contexts` windows of `length` tokens of the Paul Graham essays
   (`evals.data.paul_graham`, consecutive, starting at token `offset`); for each, every layer's
   normalised input hidden states (the surrogate's input, recorded by a dense prefill through
   `Recorder` layers) and the registered `kvzip` policy's reconstruction scores of every
   (token, kv head) (`Engine._reconstruct`, the pass `kvzip` itself runs), as log(score + eps).
2. Training: the last `holdout` contexts are held out; each layer's surrogate (linear, or the
   2-layer MLP of `kvzap.MLP_WIDTH`) is fitted to the log-scores by Adam (optax) on minibatches of
   `batch` tokens, all layers at once (vmapped), inputs standardised per feature (the
   standardisation is folded into the saved weights). A checkpoint every `save_every` steps
   ($KVP_DATA/kvzap/<model>/<kind>_ckpt.npz) makes the run resumable; `seed` fixes the
   initialisation and the minibatches.
3. Output: kvpolicies/kvzap_weights/<model>_<kind>.npz (float32; what `kvzap` loads) and
   <model>_<kind>.json: per layer, held-out R^2 and Spearman rank correlation (per kv head,
   averaged) against KVzip's log-scores, and the held-out loss before and after training.

A model with local layers (Gemma 3) records and trains its global layers only (the policy acts
there, `models.stacks.model_stack`); the local layers' weights are zero.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
from tqdm.auto import tqdm

from kvpolicies import get
from kvpolicies.kvzap import MLP_WIDTH, PARAM_NAMES, WEIGHTS_DIR, random_surrogate, surrogate
from kvpolicies.prompt import PromptPhase, PromptState

EPS = 1e-6  # log(score + EPS): kvzip's scores are probabilities, some underflow to 0
DEFAULTS = dict(model="smollm2", kind="linear", contexts=16, holdout=4, length=1024, offset=0, steps=1500,
                batch=1024, lr=3e-3, weight_decay=0.0, seed=0, save_every=250, progress=True)


@dataclasses.dataclass(frozen=True)
class Recorder(PromptPhase):
    """A dense prompt layer that records its normalised input hidden states, `extra["h"]` [B, M, d]."""

    reads_hidden = True
    obs_window: int = 0
    d_model: int = 0

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = super().init(batch, kv_heads, head_dim, dtype, max_len)
        return dataclasses.replace(st, extra={"h": jnp.zeros((batch, max_len, self.d_model), jnp.float16)})

    def hidden_weights(self, *_):
        return {}

    def read_hidden(self, state: PromptState, h, pos, w) -> PromptState:
        hs = jax.vmap(lambda z, x, p: jax.lax.dynamic_update_slice_in_dim(z, x, p, axis=0))(
            state.extra["h"], h.astype(jnp.float16), pos[:, 0])  # [B, M, d]
        return dataclasses.replace(state, extra={"h": hs})


def parse(argv: list[str]) -> dict:
    cfg = dict(DEFAULTS)
    for a in argv:
        if "=" not in a:
            raise SystemExit(f"train_kvzap: arguments are key=value, got {a!r}; keys: {sorted(DEFAULTS)}")
        k, v = a.split("=", 1)
        if k not in cfg:
            raise SystemExit(f"train_kvzap: unknown key {k!r}; keys: {sorted(DEFAULTS)}")
        d = DEFAULTS[k]
        cfg[k] = (v.lower() in ("1", "true", "yes")) if isinstance(d, bool) else type(d)(v)
    if cfg["kind"] not in PARAM_NAMES:
        raise SystemExit(f"train_kvzap: kind={cfg['kind']!r}: must be one of {sorted(PARAM_NAMES)}")
    if not 0 < cfg["holdout"] < cfg["contexts"]:
        raise SystemExit(f"train_kvzap: holdout={cfg['holdout']}: must be in [1, contexts - 1]")
    return cfg


def work_dir(model: str) -> Path:
    from evals.data import data_dir

    d = data_dir() / "kvzap" / model
    d.mkdir(parents=True, exist_ok=True)
    return d


def global_layers(model) -> np.ndarray:
    return ~np.asarray(model.cfg.local_layers, bool) if any(model.cfg.local_layers) else np.ones(model.cfg.n_layers, bool)


def collect(model, tok, cfg: dict, progress: bool = True) -> list[Path]:
    """Per context, (h [L, T, d] float16, y [L, T, K] float32 log-scores) in one .npz each (resumable)."""
    from evals.data import paul_graham
    from models.engine import Engine
    from models.reconstruct import repeat_prompts
    from models.stacks import model_stack

    mc = model.cfg
    n, t = cfg["contexts"], cfg["length"]
    d = work_dir(cfg["model"])
    paths = [d / f"ctx{cfg['offset'] + i * t}_{t}.npz" for i in range(n)]
    todo = [i for i, p in enumerate(paths) if not p.exists()]
    if not todo:
        return paths
    ids = np.asarray(tok.encode(paul_graham()), np.int32)
    need = cfg["offset"] + n * t
    if ids.size < need:
        raise SystemExit(f"train_kvzap: the essays hold {ids.size} tokens, {need} needed (contexts x length + offset)")
    kvzip = get("kvzip", budget=t, max_new=0)
    zip_eng = Engine(model, model_stack(mc, kvzip), max_len=t, repeat=repeat_prompts(tok))
    rec = Recorder(of=None, d_model=mc.d_model)
    rec_eng = Engine(model, model_stack(mc, rec), max_len=t)
    for i in tqdm(todo, desc=f"kvzip scores ({cfg['model']})", disable=not progress):
        x = ids[None, cfg["offset"] + i * t: cfg["offset"] + (i + 1) * t]  # [1, T]
        _, cache = rec_eng.prefill(x)
        hs = _gather(model, cache, rec_eng.policies, lambda st: st.extra["h"][:, 0])  # [L, T, d]
        st = zip_eng.prompt(x)
        zc = zip_eng._reconstruct(st.cache, x)
        ys = _gather(model, zc, zip_eng.prompt_policies, lambda st: st.extra["zip"][:, 0])  # [L, K, T]
        y = np.log(np.asarray(ys, np.float32) + EPS).transpose(0, 2, 1)  # [L, T, K]
        tmp = paths[i].with_suffix(".tmp.npz")
        np.savez(tmp, h=np.asarray(hs, np.float16), y=y)  # the global layers only (`_gather`)
        tmp.rename(paths[i])
    return paths


def _gather(model, cache, policies, take):
    """Stack `take(state)` over the global layers' runs, in layer order ([L_global, ...])."""
    from models.llama import policy_runs

    out = []
    for (a, b, pol), st in zip(policy_runs(policies, model.cfg.n_layers), cache):
        if isinstance(pol, PromptPhase):
            out.append(np.asarray(take(st)))  # [b - a, ...]
    return np.concatenate(out, axis=0)


def load(paths: list[Path]) -> tuple[np.ndarray, np.ndarray]:
    hs, ys = zip(*[(z["h"], z["y"]) for z in map(np.load, paths)])
    return np.concatenate(hs, axis=1), np.concatenate(ys, axis=1)  # [L, N, d] float16, [L, N, K]


def forward(params, x):
    """vmapped over layers: x [L, n, d] -> [L, n, K]."""
    return jax.vmap(lambda p, h: surrogate(p, h[None])[0])(params, x)


def loss_fn(params, x, y):
    return jnp.mean((forward(params, x) - y) ** 2, axis=(1, 2))  # [L] per-layer MSE


def fold(params: dict, mu: np.ndarray, sd: np.ndarray, kind: str) -> dict:
    """Weights on standardised inputs -> weights on raw inputs: x' = (x - mu) / sd."""
    first = "w" if kind == "linear" else "w1"
    bias = "b" if kind == "linear" else "b1"
    w = params[first] / sd[:, :, None]  # [L, d, O]
    b = params[bias] - np.einsum("ld,ldo->lo", mu, w)
    return {**params, first: w, bias: b}


def spearman(a: np.ndarray, b: np.ndarray) -> float:
    from scipy.stats import spearmanr

    return float(spearmanr(a, b).statistic)


def evaluate(params: dict, x: np.ndarray, y: np.ndarray) -> tuple[list[float], list[float], list[float]]:
    """Per layer: MSE, R^2 (over tokens and heads) and Spearman (per head, averaged)."""
    pred = np.asarray(jax.jit(forward)(params, jnp.asarray(x, jnp.float32)))  # [L, N, K]
    mse = ((pred - y) ** 2).mean(axis=(1, 2))
    r2 = 1 - ((pred - y) ** 2).sum(axis=(1, 2)) / ((y - y.mean(axis=(1, 2), keepdims=True)) ** 2).sum(axis=(1, 2))
    rho = [float(np.mean([spearman(pred[l, :, k], y[l, :, k]) for k in range(y.shape[2])])) for l in range(y.shape[0])]
    return mse.tolist(), r2.tolist(), rho


def train(cfg: dict, xtr, ytr, xte, yte, ckpt: Path, progress: bool = True) -> tuple[dict, dict]:
    """Adam on standardised inputs, all layers at once; resumable from `ckpt`."""
    L, _, dm = xtr.shape
    kh = ytr.shape[2]
    mu = xtr.astype(np.float32).mean(axis=1)  # [L, d]
    sd = xtr.astype(np.float32).std(axis=1) + 1e-3  # [L, d]
    std = lambda x: (x.astype(np.float32) - mu[:, None]) / sd[:, None]  # noqa: E731
    xtr_s, xte_s = std(xtr), std(xte)
    params = {k: jnp.asarray(v) for k, v in random_surrogate(cfg["kind"], dm, kh, L, seed=cfg["seed"]).items()}
    # start from the mean log-score (the bias), so training fits the token-to-token variation
    last = "b" if cfg["kind"] == "linear" else "b2"
    params[last] = jnp.asarray(ytr.mean(axis=1), jnp.float32)
    if cfg["kind"] == "linear":
        params["w"] = params["w"] * 0.0
    opt = optax.adamw(optax.cosine_decay_schedule(cfg["lr"], cfg["steps"], alpha=0.05), weight_decay=cfg["weight_decay"])
    state = opt.init(params)
    step0 = 0
    if ckpt.exists():
        z = np.load(ckpt, allow_pickle=False)
        leaves = [z[f"p{i}"] for i in range(len(jax.tree.leaves((params, state))))]
        params, state = jax.tree.unflatten(jax.tree.structure((params, state)), [jnp.asarray(x) for x in leaves])
        step0 = int(z["step"])
    loss0 = np.asarray(jax.jit(loss_fn)(params if step0 == 0 else _init_like(cfg, params, ytr), jnp.asarray(xte_s),
                                        jnp.asarray(yte)))

    @jax.jit
    def update(params, state, x, y):
        loss, g = jax.value_and_grad(lambda p: loss_fn(p, x, y).sum())(params)
        upd, state = opt.update(g, state, params)
        return optax.apply_updates(params, upd), state, loss / L

    rng = np.random.default_rng(cfg["seed"])
    n = xtr_s.shape[1]
    batches = [rng.integers(0, n, cfg["batch"]) for _ in range(cfg["steps"])]  # the same minibatches on resume
    bar = tqdm(range(step0, cfg["steps"]), desc=f"train {cfg['kind']} ({cfg['model']})", initial=step0,
               total=cfg["steps"], disable=not progress)
    for s in bar:
        idx = batches[s]
        params, state, loss = update(params, state, jnp.asarray(xtr_s[:, idx]), jnp.asarray(ytr[:, idx]))
        if s % 50 == 0:
            bar.set_postfix(loss=f"{float(loss):.3f}")
        if (s + 1) % cfg["save_every"] == 0 or s + 1 == cfg["steps"]:
            leaves = jax.tree.leaves((params, state))
            tmp = ckpt.with_suffix(".tmp.npz")
            np.savez(tmp, step=s + 1, **{f"p{i}": np.asarray(x) for i, x in enumerate(leaves)})
            tmp.rename(ckpt)
    loss1 = np.asarray(jax.jit(loss_fn)(params, jnp.asarray(xte_s), jnp.asarray(yte)))
    raw = fold({k: np.asarray(v, np.float32) for k, v in params.items()}, mu, sd, cfg["kind"])
    return raw, {"heldout_loss_init": loss0.tolist(), "heldout_loss": loss1.tolist()}


def _init_like(cfg, params, ytr):
    """The initial parameters (for the held-out loss before training, on a resumed run)."""
    L, dm = params["w" if cfg["kind"] == "linear" else "w1"].shape[:2]
    p = {k: jnp.asarray(v) for k, v in random_surrogate(cfg["kind"], dm, ytr.shape[2], L, seed=cfg["seed"]).items()}
    p["b" if cfg["kind"] == "linear" else "b2"] = jnp.asarray(ytr.mean(axis=1), jnp.float32)
    if cfg["kind"] == "linear":
        p["w"] = p["w"] * 0.0
    return p


def main(argv: list[str] | None = None) -> dict:
    cfg = parse(sys.argv[1:] if argv is None else argv)
    from evals import zoo

    t0 = time.perf_counter()
    model, tok = zoo.load_model({"name": cfg["model"], "dtype": "float32"})
    paths = collect(model, tok, cfg, cfg["progress"])
    t_data = time.perf_counter() - t0
    h, y = load(paths)  # [Lg, N, d], [Lg, N, K]
    n_te = cfg["holdout"] * cfg["length"]
    xtr, ytr, xte, yte = h[:, :-n_te], y[:, :-n_te], h[:, -n_te:], y[:, -n_te:]
    run = "_".join(f"{k}{cfg[k]}" for k in ("seed", "contexts", "holdout", "length", "offset", "steps", "batch", "lr",
                                             "weight_decay"))
    ckpt = work_dir(cfg["model"]) / f"{cfg['kind']}_ckpt_{run}.npz"  # one checkpoint per training config
    t1 = time.perf_counter()
    params, losses = train(cfg, xtr, ytr, xte, yte, ckpt, cfg["progress"])
    t_train = time.perf_counter() - t1
    mse, r2, rho = evaluate(params, xte.astype(np.float32), yte)
    # the policy's file: every layer (local ones zero), float32
    mc = model.cfg
    glob = global_layers(model)
    full = {}
    for k, v in params.items():
        z = np.zeros((mc.n_layers,) + v.shape[1:], np.float32)
        z[glob] = v
        full[k] = z
    WEIGHTS_DIR.mkdir(exist_ok=True)
    stem = f"{cfg['model']}_{cfg['kind']}"
    np.savez(WEIGHTS_DIR / f"{stem}.npz", kind=cfg["kind"], d_model=mc.d_model, kv_heads=mc.n_kv_heads,
             n_layers=mc.n_layers, **full)
    layers = np.flatnonzero(glob).tolist()
    report = {"model": cfg["model"], "kind": cfg["kind"], "config": cfg, "layers": layers,
              "train_tokens": int(xtr.shape[1]), "heldout_tokens": int(xte.shape[1]),
              "r2": r2, "spearman": rho, "heldout_mse": mse, **losses,
              "data_s": round(t_data, 1), "train_s": round(t_train, 1), "mlp_width": MLP_WIDTH,
              "command": "python -m evals.train_kvzap " + " ".join(f"{k}={cfg[k]}" for k in DEFAULTS if k != "progress")}
    (WEIGHTS_DIR / f"{stem}.json").write_text(json.dumps(report, indent=1) + "\n")
    print(f"train_kvzap: {stem}: {report['train_tokens']} train / {report['heldout_tokens']} held-out tokens; "
          f"data {t_data:.0f} s, training {t_train:.0f} s")
    print(" layer   R2    spearman  loss(init -> trained)")
    for i, l in enumerate(layers):
        print(f" {l:5d} {r2[i]:6.3f} {rho[i]:8.3f}   {losses['heldout_loss_init'][i]:.3f} -> {losses['heldout_loss'][i]:.3f}")
    print(f" mean  {np.mean(r2):6.3f} {np.mean(rho):8.3f}   wrote {WEIGHTS_DIR / (stem + '.npz')}")
    return report


if __name__ == "__main__":
    main()
