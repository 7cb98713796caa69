"""Attention's speed choices against the path they replaced, in one process, interleaved
(SmolLM2-135M float32, `full`, a cache of N slots).

    python -m benchmarks.attention_ab --slots 4160 16448

- keys stored rotated (`Policy.rotated_keys`) vs stored un-rotated and rotated at every read: ms
  per decode step at position N - 40 (host loop of jitted steps; an empty cache: a decode step
  reads every slot of its length bucket whatever it holds);
- a chunk attended block by block (`Tuning.block` = 512 slots, online softmax) vs in
  one piece: seconds of one 512-token chunk step ending at N - 64 over a cache filled with random
  keys and values at every earlier position, and XLA's temporaries of the compiled step
  (`memory_analysis().temp_size_in_bytes`);
- the same chunk with its blocks checked against what the queries see (`Tuning.skip_blocks`:
  unseen blocks skipped, wholly seen ones unmasked) vs every block masked;
- with `--prefill`, the same two ways for `Engine.prefill` of N - 64 random ids in chunks of 512
  (tokens/s, medians of 2 rounds): there the stored part past the filled length is skipped;
- with `--sink TOKENS`, the same two ways for `Engine.score` of TOKENS random ids through `sink`
  (4 sinks + 4,096, RoPE by cache rank: its blocks without sinks compute one RoPE segment), and
  sink's slot layout (the ring first, the sinks last: no block holds a sink) against its layout
  before (the sinks first: the first block of every chunk holds them, and computes both
  segments' logits); a steady-state sink chunk (512 tokens at a full window, timed alone, 2 x
  `--rounds` rounds) with its blocks' softmax over flat rows (`Tuning.flat_rows`) vs over
  [B, K, G, T, S]; and a `sink` 4 + 1,020 decode step, keys stored rotated vs un-rotated;
- with `--prompt`, snapkv's prompt phase (blocks, its newest 32 rows in one piece) vs one piece:
  seconds of `Engine.prompt` over N - 64 random ids in chunks of 512 (medians of 2 rounds).

Each row: the measure, the slots, the medians of `--rounds` alternated rounds for the new and the
old path, and their ratio. Wall-clock on a shared machine: read the ratio. `--dry-run`: a tiny
random model at 96 slots (what the tests run).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

import kvpolicies
from models.engine import Engine

from kvpolicies.attention import DEFAULT, Tuning
from models.llama import with_tuning


def tuned(model, **kw):
    """The model with its attention tuning changed in the fields kw (its weights shared): an engine
    over it compiles its own steps (the tuning is part of the model's static config)."""
    return with_tuning(model, dataclasses.replace(model.cfg.attention or DEFAULT, **kw))


def unrotated(pol: kvpolicies.Policy) -> kvpolicies.Policy:
    """`pol` with `rotated_keys` off: its keys stored before RoPE and rotated at every read."""
    cls = type(pol)
    twin = dataclasses.make_dataclass(f"Unrotated{cls.__name__}", [], bases=(cls,), frozen=True,
                                      namespace={"rotated_keys": property(lambda self: False)})
    return twin(**{f.name: getattr(pol, f.name) for f in dataclasses.fields(pol)})


def sinks_first(pol: kvpolicies.Policy) -> kvpolicies.Policy:
    """`pol` (a `sink`) with its slot layout before the ring-first one: the sinks in slots
    0 .. n_sink - 1, window token p in slot n_sink + (p - n_sink) mod ring."""

    def _slot(self, pos, capacity):
        ring = capacity - self.n_sink
        return jnp.where(pos < self.n_sink, pos, self.n_sink + (pos - self.n_sink) % max(ring, 1))

    cls = type(pol)
    twin = dataclasses.make_dataclass(f"SinksFirst{cls.__name__}", [], bases=(cls,), frozen=True,
                                      namespace={"_slot": _slot})
    return twin(**{f.name: getattr(pol, f.name) for f in dataclasses.fields(pol)})


def _alternate(fns: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each no-argument callable over `rounds` alternated calls (after one warm call)."""
    for f in fns.values():
        f()
    times = {k: [] for k in fns}
    for _ in range(rounds):
        for k, f in fns.items():
            t0 = time.perf_counter()
            f()
            times[k].append(time.perf_counter() - t0)
    return {k: float(np.median(v)) for k, v in times.items()}


def decode_rotation(model, slots: int, steps: int, rounds: int, pol: kvpolicies.Policy | None = None,
                    what: str = "") -> dict:
    """ms per decode step at position slots - 40 of `pol` (default `full`), keys stored rotated vs
    un-rotated; `what`: appended to the measure's name."""
    pos = slots - 40
    tok = np.zeros((1, 1), np.int32)
    pol = pol or kvpolicies.get("full")
    runs = {}
    for label, pol in (("rotated", pol), ("unrotated", unrotated(pol))):
        eng, box = Engine(model, pol, max_len=slots), {}
        box["cache"] = eng.init_cache(1)

        def run(eng=eng, box=box):
            for i in range(steps):
                logits, box["cache"] = eng.step(box["cache"], tok, pos + i)
            jax.block_until_ready(logits)

        runs[label] = run
    t = _alternate(runs, rounds)
    return {"measure": f"decode step ms{what}", "slots": slots, "new": t["rotated"] / steps * 1e3,
            "old": t["unrotated"] / steps * 1e3, "old_over_new": t["unrotated"] / t["rotated"]}


def filled(cache, upto: int, seed: int = 0):
    """`full`'s cache with every slot below `upto` holding its position and random keys/values."""
    rng = np.random.default_rng(seed)

    def fill(st):
        k = np.asarray(st.k).copy()
        k[..., :upto, :] = rng.standard_normal(k[..., :upto, :].shape)
        v = np.asarray(st.v).copy()
        v[..., :upto, :] = rng.standard_normal(v[..., :upto, :].shape)
        pos = np.asarray(st.pos).copy()
        pos[..., :upto] = np.arange(upto)
        return dataclasses.replace(st, k=jnp.asarray(k, st.k.dtype), v=jnp.asarray(v, st.v.dtype), pos=jnp.asarray(pos))

    return tuple(fill(st) for st in cache)


def chunk_blocks(model, slots: int, chunk: int, rounds: int) -> list[dict]:
    start = slots - 64 - chunk
    ids = np.random.default_rng(0).integers(0, model.cfg.vocab_size, (1, chunk)).astype(np.int32)
    pos = jnp.broadcast_to(jnp.arange(start, start + chunk, dtype=jnp.int32), (1, chunk))
    runs, temps = {}, {}
    block = (model.cfg.attention or DEFAULT).block
    for label, blk, skip in (("blocked", block, True), ("whole", 1 << 40, True), ("every block masked", block, False)):
        eng, box = Engine(tuned(model, block=blk, skip_blocks=skip), kvpolicies.get("full"), max_len=slots), {}
        box["cache"] = filled(eng.init_cache(1), start)
        reach = eng._reach(start + chunk, chunk)
        temps[label] = eng._logits_step.lower(eng.params, box["cache"], jnp.asarray(ids), pos, reach=reach) \
            .compile().memory_analysis().temp_size_in_bytes

        def run(eng=eng, box=box):
            logits, box["cache"] = eng._step(box["cache"], ids, start)
            jax.block_until_ready(logits)

        run()  # trace with this tuning
        runs[label] = run
    t = _alternate(runs, rounds)
    m = "every block masked"
    return [{"measure": f"{chunk}-token chunk s", "slots": slots, "new": t["blocked"], "old": t["whole"],
             "old_over_new": t["whole"] / t["blocked"]},
            {"measure": "chunk step XLA temporaries MB", "slots": slots, "new": temps["blocked"] / 1e6,
             "old": temps["whole"] / 1e6, "old_over_new": temps["whole"] / temps["blocked"]},
            {"measure": f"{chunk}-token chunk s, blocks by visibility", "slots": slots, "new": t["blocked"],
             "old": t[m], "old_over_new": t[m] / t["blocked"]}]


def prefill_skip(model, slots: int, chunk: int, rounds: int) -> dict:
    """`Engine.prefill` of slots - 64 random ids in chunks of `chunk`, blocks checked against what
    the queries see (unseen ones skipped) vs every block masked: tokens/s."""
    ids = np.random.default_rng(2).integers(0, model.cfg.vocab_size, (1, slots - 64)).astype(np.int32)
    runs = {}
    for label, skip in (("new", True), ("old", False)):
        eng = Engine(tuned(model, skip_blocks=skip), kvpolicies.get("full"), max_len=slots)

        def run(eng=eng):
            jax.block_until_ready(eng.prefill(ids, chunk=chunk)[0])

        run()  # trace every bucket with this setting
        runs[label] = run
    t = _alternate(runs, rounds)
    n = ids.shape[1]
    return {"measure": "prefill tok/s, blocks by visibility", "slots": slots, "new": n / t["new"],
            "old": n / t["old"], "old_over_new": t["old"] / t["new"]}


def prompt_blocks(model, slots: int, chunk: int, rounds: int) -> dict:
    """snapkv's prompt phase (blocks, plus its newest rows in one piece) vs one piece: seconds of
    `Engine.prompt` over slots - 64 random ids in chunks of `chunk`."""
    ids = np.random.default_rng(1).integers(0, model.cfg.vocab_size, (1, slots - 64)).astype(np.int32)
    runs = {}
    for label, block in (("blocked", (model.cfg.attention or DEFAULT).block), ("whole", 1 << 40)):
        eng = Engine(tuned(model, block=block), kvpolicies.get("snapkv", budget=min(1024, slots // 4)), max_len=slots)

        def run(eng=eng):
            jax.block_until_ready(eng.prompt(ids, chunk=chunk).logits)

        run()  # trace every bucket with this block
        runs[label] = run
    t = _alternate(runs, rounds)
    return {"measure": "snapkv prompt s", "slots": slots, "new": t["blocked"], "old": t["whole"],
            "old_over_new": t["whole"] / t["blocked"]}


def sink_score(model, tokens: int, chunk: int, rounds: int, window: int = 4096) -> list[dict]:
    """`Engine.score` of `tokens` random ids through `sink` (4 sinks, RoPE by cache rank: two
    segments) in chunks of `chunk`, tokens/s (the default command's policy), three ways
    alternated: blocks by visibility and segment (the new path), every block masked with every
    segment, and the sinks stored first (`sinks_first`)."""
    ids = np.random.default_rng(3).integers(0, model.cfg.vocab_size, tokens).astype(np.int32)
    pol = kvpolicies.get("sink", n_sink=4, window=window)
    runs = {}
    for label, skip, p in (("new", True, pol), ("old", False, pol), ("sinks first", True, sinks_first(pol))):
        eng = Engine(tuned(model, skip_blocks=skip), p, max_len=tokens)

        def run(eng=eng):
            eng.score(ids, chunk=chunk)

        run()  # trace with this setting
        runs[label] = run
    t = _alternate(runs, rounds)
    first = "sinks first"
    return [{"measure": "sink score tok/s, blocks by visibility and segment", "slots": window + 4,
             "new": tokens / t["new"], "old": tokens / t["old"], "old_over_new": t["old"] / t["new"]},
            {"measure": "sink score tok/s, ring first vs sinks first", "slots": window + 4,
             "new": tokens / t["new"], "old": tokens / t[first], "old_over_new": t[first] / t["new"]}]


def softmax_rows(model, window: int, chunk: int, rounds: int) -> dict:
    """Seconds of one steady-state `sink` chunk (4 sinks + `window`, the default command's policy):
    `chunk` random ids at position window + chunk, after a prefill of that many, its blocks' softmax
    over [(B K G tq), s] rows (`Tuning.flat_rows`) vs over [B, K, G, tq, s]. Each round times the
    step alone, on a fresh copy of the same cache; `max_logit_diff`: the two steps' logits."""
    start = window + chunk
    ids = np.random.default_rng(4).integers(0, model.cfg.vocab_size, (1, start + chunk)).astype(np.int32)
    pol = kvpolicies.get("sink", n_sink=4, window=window)
    runs, logits = {}, {}
    for label, flat in (("new", True), ("old", False)):
        eng = Engine(tuned(model, flat_rows=flat), pol, max_len=start + chunk)
        _, cache = eng.prefill(ids[:, :start], chunk=chunk, cache=eng.init_cache(1))
        logits[label], _ = eng.step(jax.tree.map(jnp.copy, cache), ids[:, start:], start)  # traced here

        def run(eng=eng, cache=cache):
            fresh = jax.block_until_ready(jax.tree.map(jnp.copy, cache))  # copied outside the timed step
            t0 = time.perf_counter()
            jax.block_until_ready(eng.step(fresh, ids[:, start:], start)[0])
            return time.perf_counter() - t0

        runs[label] = run
    times = {k: [] for k in runs}
    for _ in range(rounds):
        for k, f in runs.items():
            times[k].append(f())
    t = {k: float(np.median(v)) for k, v in times.items()}
    return {"measure": "sink chunk s at a full window, softmax over flat rows vs [B, K, G, T, S]",
            "slots": window + 4, "new": t["new"], "old": t["old"], "old_over_new": t["old"] / t["new"],
            "max_logit_diff": float(jnp.abs(logits["new"] - logits["old"]).max())}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--slots", type=int, nargs="*", default=[4160, 16448], help="(none: only --sink)")
    ap.add_argument("--steps", type=int, default=15, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--prompt", action="store_true", help="also snapkv's prompt phase, blocked vs one piece")
    ap.add_argument("--prefill", action="store_true", help="also a prefill, blocks by visibility vs all masked")
    ap.add_argument("--sink", type=int, default=0, metavar="TOKENS",
                    help="also sink (4 + 4,096, cache mode) scoring TOKENS random ids, blocks by visibility vs not")
    ap.add_argument("--dry-run", action="store_true", help="a tiny random model at 96 slots")
    args = ap.parse_args(argv)
    if args.dry_run:
        from models.config import LlamaConfig
        from models.llama import Llama

        model = Llama(LlamaConfig(vocab_size=97, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8,
                                  d_ff=32))
        slots, chunk, steps, rounds = [96], 16, 2, 1
        model = with_tuning(model, Tuning(block=8))
    else:
        from models.loading import load_default_model

        model, _ = load_default_model()
        slots, chunk, steps, rounds = args.slots, 512, args.steps, args.rounds
    rows = []
    if args.sink:
        window = 24 if args.dry_run else 4096
        sink_rows = sink_score(model, args.sink, chunk, min(rounds, 2), window)
        sink_rows.append(softmax_rows(model, window, chunk, 2 * rounds))
        sink_slots = 64 if args.dry_run else 1024
        decode = decode_rotation(model, 4 * sink_slots, steps, rounds,  # max_len: 4 x its slots
                                 kvpolicies.get("sink", n_sink=4, window=sink_slots - 4),
                                 f", sink 4+{sink_slots - 4} at position {4 * sink_slots - 40}")
        sink_rows.append(decode | {"slots": sink_slots})
        for row in sink_rows:
            print(json.dumps(row), flush=True)
            rows.append(row)
    for n in slots:
        rows_n = [decode_rotation(model, n, steps, rounds)] + chunk_blocks(model, n, chunk, rounds)
        if args.prompt:
            rows_n.append(prompt_blocks(model, n, chunk, min(rounds, 2)))
        if args.prefill:
            rows_n.append(prefill_skip(model, n, chunk, min(rounds, 2)))
        for row in rows_n:
            print(json.dumps(row), flush=True)
            rows.append(row)
    return rows


if __name__ == "__main__":
    main()
