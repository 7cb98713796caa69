"""The model of the `recall` task: a tiny Llama trained on synthetic associative recall, so that
cache policies can be scored on a model whose every answer depends on one token far back
(`model=tiny_recall task=recall` in `python -m evals.run`; the task is `evals.retrieval.recall`).

Shapes: B batch, T sequence length, N pairs, M queries, V vocab.

Each key->value pair is one token (`pair_id(k, v)`), so a training sequence is

    BOS p(k1,v1) p(k2,v2) ... p(kn,vn)  q a  q a  ...        (fixed length T = 1 + N + 2M)

with n <= N distinct keys, then query slots: a query-key token q followed by the answer token
a, the value paired with q. The loss is on the answers only. One pair per token makes recall a
one-hop lookup a single attention layer can learn (query key matches the key part of a pair
token, the value part is copied): it trains in a few hundred steps, where the classic two-token
`k v` format needs an induction circuit that did not form in 1,500 steps here. n is drawn
per sequence from [min_pairs, N]: short rows with many queries speed learning up (Zoology's
multi-query recall, Arora et al. 2023). An eval prompt `BOS p1 .. pN q` asks for a value 1..N
tokens back, so a window shorter than that distance cannot answer, while the full cache can.

Training runs inside jit (data sampled with jax.random, `scan_steps` optimizer steps per call)
through `Llama` with the `full` policy. `load_or_train` caches the weights as .npz, keyed by a
hash of the whole `TrainConfig`.

    python -m evals.recall_model [--steps 400] [--seed 0] [--force]
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import hashlib
import json
import os
import time
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jaxtyping import Array, Int

import kvpolicies
from models.config import LlamaConfig
from models.llama import Llama, init_params

BOS = 0
FORMAT = 1  # bump when the task or training code changes what a config trains (it is in the cache key)
# XLA options for the training step. Compiling it dominates a one-minute training on a small,
# shared CPU: LLVM at -O1 without its expensive passes compiles much faster and runs the step a
# little slower (docs/results/speed.md, "Numbers behind comments in the code").
COMPILER_OPTIONS = {"xla_backend_optimization_level": 1, "xla_llvm_disable_expensive_passes": True}


@dataclasses.dataclass(frozen=True)
class RecallTask:
    """The vocabulary layout and sequence shape of the associative-recall task.

    Ids: 0 = BOS; 1..K = query keys; K+1..K+V = answer values; then one id per (key, value)
    pair, `pair_id(k, v) = 1 + K + V + k*V + v` (k, v zero-based). n_pairs is the most pairs in
    a training sequence (and the default for eval prompts).
    """

    n_keys: int = 32
    n_values: int = 16
    n_pairs: int = 32
    n_queries: int = 8
    min_pairs: int = 1

    def __post_init__(self):
        for f in ("n_keys", "n_values", "n_pairs", "n_queries", "min_pairs"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"RecallTask.{f}={v!r}: must be a positive int")
        if self.n_pairs > self.n_keys:
            raise ValueError(f"RecallTask.n_pairs={self.n_pairs}: must be <= n_keys={self.n_keys}")
        if self.min_pairs > self.n_pairs:
            raise ValueError(f"RecallTask.min_pairs={self.min_pairs}: must be <= n_pairs={self.n_pairs}")

    @property
    def vocab_size(self) -> int:
        return 1 + self.n_keys + self.n_values + self.n_keys * self.n_values

    @property
    def seq_len(self) -> int:
        """Training sequence length T = 1 + N + 2M."""
        return 1 + self.n_pairs + 2 * self.n_queries

    def query_id(self, k):
        return 1 + k

    def value_id(self, v):
        return 1 + self.n_keys + v

    def pair_id(self, k, v):
        return 1 + self.n_keys + self.n_values + k * self.n_values + v

    def sample(self, key: Array, batch: int) -> tuple[Int[Array, "B T"], Int[Array, "B T"], Array]:
        """Training sequences [B, T], next-token targets [B, T] and the loss mask [B, T].

        Row b holds n_b ~ U[min_pairs, n_pairs] pairs (distinct keys), then `q a` query slots
        (keys drawn with replacement from its pairs) up to the fixed length T; the loss is on every
        answer. Rows with few pairs are easy and hold many queries, which speeds up learning.
        """
        t_len = self.seq_len
        kn, kk, kv, kq = jax.random.split(key, 4)
        n = jax.random.randint(kn, (batch, 1), self.min_pairs, self.n_pairs + 1)  # [B, 1]
        keys = jnp.argsort(jax.random.uniform(kk, (batch, self.n_keys)), axis=1)[:, :self.n_pairs]  # [B, N]
        vals = jax.random.randint(kv, (batch, self.n_pairs), 0, self.n_values)  # [B, N]
        t = jnp.arange(1, t_len)[None, :]  # [1, T-1] positions after BOS
        in_pairs = t <= n  # [B, T-1]
        j = jnp.maximum(t - n - 1, 0)  # [B, T-1] offset into the query region
        pick = jnp.floor(jax.random.uniform(kq, (batch, t_len)) * n).astype(jnp.int32)  # [B, T] in [0, n_b)
        src = jnp.where(in_pairs, jnp.minimum(t - 1, self.n_pairs - 1),
                        jnp.take_along_axis(pick, j // 2, axis=1))  # [B, T-1] which pair
        k, v = jnp.take_along_axis(keys, src, 1), jnp.take_along_axis(vals, src, 1)  # [B, T-1]
        is_query = ~in_pairs & (j % 2 == 0)  # [B, T-1]
        body = jnp.where(in_pairs, self.pair_id(k, v), jnp.where(is_query, self.query_id(k), self.value_id(v)))
        seq = jnp.concatenate([jnp.full((batch, 1), BOS), body], axis=1).astype(jnp.int32)  # [B, T]
        targets = jnp.concatenate([seq[:, 1:], jnp.zeros((batch, 1), jnp.int32)], axis=1)  # [B, T]
        mask = jnp.concatenate([jnp.zeros((batch, 1), bool), is_query], axis=1)  # [B, T]
        mask = mask & (jnp.arange(t_len) < t_len - 1)[None]  # a final query has no answer
        return seq, targets, mask

    def prompts(self, seed: int, batch: int, n_pairs: int | None = None
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Eval prompts `BOS p1 .. pN q` [B, N+2], their answer ids [B] and the queried pair index
        [B] (0 = first pair, N+1-i tokens before the query); deterministic given seed."""
        n = self.n_pairs if n_pairs is None else n_pairs
        if not 1 <= n <= self.n_keys:
            raise ValueError(f"n_pairs={n}: must be in [1, n_keys={self.n_keys}]")
        rng = np.random.default_rng(seed)
        keys = np.argsort(rng.random((batch, self.n_keys)), axis=1)[:, :n]  # [B, N]
        vals = rng.integers(0, self.n_values, (batch, n))  # [B, N]
        which = rng.integers(0, n, batch)  # [B]
        rows = np.arange(batch)
        tokens = np.concatenate([np.full((batch, 1), BOS), self.pair_id(keys, vals),
                                 self.query_id(keys[rows, which])[:, None]], axis=1)  # [B, N+2]
        return tokens.astype(np.int32), self.value_id(vals[rows, which]).astype(np.int32), which.astype(np.int32)


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the trained weights (the cache key hashes all of it)."""

    task: RecallTask = RecallTask()
    d_model: int = 64
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    head_dim: int = 16
    d_ff: int = 128
    steps: int = 400
    batch: int = 32
    lr: float = 3e-3
    warmup: int = 50
    weight_decay: float = 0.01
    scan_steps: int = 50  # optimizer steps per jitted call
    init_std: float = 0.02
    seed: int = 0

    def __post_init__(self):
        if not 0 < self.warmup < self.steps:
            raise ValueError(f"TrainConfig.warmup={self.warmup}: must be in (0, steps={self.steps})")
        if self.steps % self.scan_steps:
            raise ValueError(f"TrainConfig.steps={self.steps}: must be a multiple of scan_steps={self.scan_steps}")

    def model_config(self) -> LlamaConfig:
        return LlamaConfig(
            vocab_size=self.task.vocab_size, d_model=self.d_model, n_layers=self.n_layers,
            n_heads=self.n_heads, n_kv_heads=self.n_kv_heads, head_dim=self.head_dim, d_ff=self.d_ff,
            max_position=self.task.seq_len, bos_id=BOS, name="tiny-recall",
        )

    def key(self) -> str:
        """A short hash of the config: the cache file name."""
        blob = json.dumps({"format": FORMAT, **dataclasses.asdict(self)}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]


def params_of(model: Llama) -> dict[str, Any]:
    """The model's weights as numpy arrays in the canonical layout (models/config.py)."""
    out = {"embed": np.asarray(model.embed[...]), "final_norm": np.asarray(model.final_norm[...]),
           "layers": {k: np.asarray(v[...]) for k, v in model.layers.items()}}
    if model.lm_head is not None:
        out["lm_head"] = np.asarray(model.lm_head[...])
    return out


def recall_accuracy(model: Llama, policies, task: RecallTask, trials: int = 512, seed: int = 1,
                    n_pairs: int | None = None) -> tuple[float, np.ndarray, np.ndarray]:
    """Accuracy of the greedy answer to `trials` eval prompts through `policies` (one batch
    through the Engine's prefill), the per-trial correctness [trials] and queried pair [trials]."""
    from models.engine import Engine

    tokens, answers, which = task.prompts(seed, trials, n_pairs)
    logits, _ = Engine(model, policies, tokens.shape[1]).prefill(tokens)  # [B, V]
    correct = np.asarray(jnp.argmax(logits, axis=-1)) == answers  # [B]
    return float(correct.mean()), correct, which


def lr_schedule(lr, warmup, total_steps):
    """Linear warmup to `lr` over `warmup` steps, then cosine decay to 5% of it at `total_steps`.
    All three may be traced, so one compiled step serves every length and learning rate."""
    def schedule(count):
        warm = jnp.minimum(1.0, (count + 1) / warmup)
        frac = jnp.clip((count - warmup) / jnp.maximum(total_steps - warmup, 1), 0.0, 1.0)
        return lr * warm * (0.05 + 0.95 * 0.5 * (1.0 + jnp.cos(jnp.pi * frac)))
    return schedule


def _optimizer(hyper: dict, weight_decay: float) -> optax.GradientTransformation:
    """AdamW with global-norm clipping; hyper = {lr, warmup, steps} (numbers or traced)."""
    sched = lr_schedule(hyper["lr"], hyper["warmup"], hyper["steps"])
    return optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(sched, weight_decay=weight_decay))


def _hyper(cfg: TrainConfig) -> dict:
    return {"lr": jnp.float32(cfg.lr), "warmup": jnp.int32(cfg.warmup), "steps": jnp.int32(cfg.steps)}


@functools.lru_cache(maxsize=4)
def _trainer(cfg: TrainConfig):
    """The model's graphdef and the jitted `run(params, opt_state, start, hyper, key) ->
    ((params, opt_state), (loss, acc) [scan_steps])` doing `scan_steps` optimizer steps. Built for
    a config whose traced fields (seed, steps, warmup, lr) are normalized away, so training again
    with another seed, length or learning rate reuses the compiled step."""
    task, full = cfg.task, kvpolicies.get("full")
    mcfg = cfg.model_config()
    graphdef, _ = nnx.split(Llama(mcfg, init_params(mcfg, std=cfg.init_std)))
    t = task.seq_len
    pos = jnp.broadcast_to(jnp.arange(t, dtype=jnp.int32), (cfg.batch, t))  # [B, T]

    def loss_fn(params, seq, targets, mask):
        m = nnx.merge(graphdef, params)
        logits, _ = m(seq, pos, m.init_cache(full, cfg.batch, t), full)  # [B, T, V]
        nll = optax.softmax_cross_entropy_with_integer_labels(logits, targets)  # [B, T]
        acc = jnp.argmax(logits, -1) == targets  # [B, T]
        return jnp.sum(nll * mask) / jnp.sum(mask), jnp.sum(acc * mask) / jnp.sum(mask)

    def run(params, opt_state, start, hyper, key):
        opt = _optimizer(hyper, cfg.weight_decay)

        def one_step(carry, step):
            params, opt_state = carry
            seq, targets, mask = task.sample(jax.random.fold_in(key, step), cfg.batch)
            (loss, acc), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, seq, targets, mask)
            updates, opt_state = opt.update(grads, opt_state, params)
            return (optax.apply_updates(params, updates), opt_state), (loss, acc)

        return jax.lax.scan(one_step, (params, opt_state), start + jnp.arange(cfg.scan_steps))

    return graphdef, jax.jit(run, compiler_options=dict(COMPILER_OPTIONS))


def train(cfg: TrainConfig = TrainConfig(), log: bool = False, evaluate: bool = True
          ) -> tuple[Llama, dict[str, Any]]:
    """Train from scratch; returns the model and meta (config, final loss and train accuracy,
    seconds, and with `evaluate` the full-cache accuracy on 512 held-out prompts)."""
    t0 = time.perf_counter()
    static = dataclasses.replace(cfg, seed=0, steps=2 * cfg.scan_steps, warmup=1, lr=1.0)
    graphdef, run = _trainer(static)
    mcfg = cfg.model_config()
    params = nnx.state(Llama(mcfg, init_params(mcfg, seed=cfg.seed, std=cfg.init_std)))
    hyper = _hyper(cfg)
    opt_state = _optimizer(hyper, cfg.weight_decay).init(params)
    key = jax.random.key(cfg.seed)
    for start in range(0, cfg.steps, cfg.scan_steps):
        (params, opt_state), (loss, acc) = run(params, opt_state, start, hyper, key)
        if log:
            print(f"step {start + cfg.scan_steps:5d}  loss {float(loss.mean()):.3f}  "
                  f"train acc {float(acc.mean()):.3f}  {time.perf_counter() - t0:.1f}s", flush=True)
    seconds = time.perf_counter() - t0
    model = nnx.merge(graphdef, params)
    accuracy = recall_accuracy(model, kvpolicies.get("full"), cfg.task)[0] if evaluate else None
    meta = {"config": dataclasses.asdict(cfg), "key": cfg.key(), "final_loss": float(loss[-1]),
            "final_train_accuracy": float(acc[-1]), "accuracy": accuracy, "train_seconds": seconds}
    return model, meta


def default_cache_dir() -> Path:
    """`$KVP_CACHE`, else `<repo>/.cache/kvpolicies` (git-ignored)."""
    env = os.environ.get("KVP_CACHE")
    return Path(env) if env else Path(__file__).resolve().parent.parent / ".cache" / "kvpolicies"


def save(path: Path, model: Llama, meta: dict[str, Any]) -> None:
    """Weights (canonical layout, "layers/<name>" for stacked layer weights) and meta as JSON."""
    p = params_of(model)
    flat = {f"layers/{k}": v for k, v in p.pop("layers").items()} | p
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npz")  # then an atomic rename
    np.savez(tmp, __meta__=np.array(json.dumps(meta)), **flat)
    os.replace(tmp, path)


def load(path: Path, cfg: TrainConfig) -> tuple[Llama, dict[str, Any]]:
    """A model saved by `save`, with the architecture of `cfg`."""
    with np.load(path) as z:
        meta = json.loads(str(z["__meta__"]))
        params: dict[str, Any] = {"layers": {}}
        for name in z.files:
            if name.startswith("layers/"):
                params["layers"][name[len("layers/"):]] = z[name]
            elif name != "__meta__":
                params[name] = z[name]
    return Llama(cfg.model_config(), params), meta


def load_or_train(cache_dir: str | os.PathLike | None = None, seed: int = 0, steps: int = 400,
                  force: bool = False, log: bool = False, **fields) -> tuple[Llama, dict[str, Any]]:
    """The trained recall model for this config, from `<cache_dir>/recall-<hash>.npz` if present,
    else trained (~1 minute on 2 CPU cores) and saved. Extra `fields` go to TrainConfig
    (`task=RecallTask(...)`, `d_model`, `lr`, ...). meta["cached"] says which happened."""
    task = fields.pop("task", RecallTask())
    if isinstance(task, dict):
        task = RecallTask(**task)
    cfg = TrainConfig(task=task, seed=seed, steps=steps, **fields)
    path = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = path / f"recall-{cfg.key()}.npz"
    if path.exists() and not force:
        model, meta = load(path, cfg)
        return model, meta | {"cached": True, "path": str(path)}
    model, meta = train(cfg, log=log)
    save(path, model, meta)
    return model, meta | {"cached": False, "path": str(path)}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description="Train (or load) the tiny associative-recall Llama.")
    ap.add_argument("--steps", type=int, default=TrainConfig.steps)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--cache-dir", default=None)
    ap.add_argument("--force", action="store_true", help="retrain even if cached")
    args = ap.parse_args(argv)
    model, meta = load_or_train(args.cache_dir, seed=args.seed, steps=args.steps, force=args.force, log=True)
    task = RecallTask(**meta["config"]["task"])
    print(f"{'loaded' if meta['cached'] else 'trained'} {meta['path']}"
          + ("" if meta["cached"] else f" in {meta['train_seconds']:.1f}s"))
    for name, pol in [("full", kvpolicies.get("full")), ("window=4", kvpolicies.get("window", window=4)),
                      ("window=16", kvpolicies.get("window", window=16)),
                      ("sink 4+4", kvpolicies.get("sink", n_sink=4, window=4))]:
        acc, _, _ = recall_accuracy(model, pol, task)
        print(f"recall accuracy ({task.n_pairs} pairs, 512 prompts) {name:10s} {acc:.3f}")
    print(f"chance {1 / task.n_values:.3f}")


if __name__ == "__main__":
    main()
