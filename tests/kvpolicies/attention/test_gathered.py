"""Quest's gathered decode read (attend's sparse path) against the masked path it replaces, and
the host tier (kvpolicies.offload): same outputs, states and NLL; the bytes a step reads and moves
in closed form; benchmarks.quest_gather --dry-run."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from tests.refs.helpers import run_policy
from kvpolicies import Rope, attend, offload, record_visible
from kvpolicies.attend import Gather
from kvpolicies.quest import Quest, quest_stack
from models.config import LlamaConfig
from models.engine import Engine
from models.llama import Llama

B, K, D, T, PROMPT = 2, 2, 16, 40, 12
ROPE = Rope(D)


@dataclasses.dataclass(frozen=True)
class MaskedQuest(Quest):
    """The same policy through attention's masked path at decode (logits over every slot)."""

    gathers = False


def masked(pol: Quest) -> MaskedQuest:
    return MaskedQuest(**{f.name: getattr(pol, f.name) for f in dataclasses.fields(pol)})


# (policy, query heads, max_len): GQA and MHA, our window extension, top_k = 1 (own page only),
# top_k covering every page, a page size that does not divide max_len (partial last page, read
# through attention's clamped block), pages longer than a tiny cache (slot by slot).
CASES = {
    "gqa_window": (Quest(page=4, top_k=3, window=5), 4, 64),
    "mha_partial_page": (Quest(page=3, top_k=3), 2, 41),
    "own_page_only": (Quest(page=4, top_k=1), 4, 64),
    "all_pages": (Quest(page=4, top_k=11), 4, 40),
}
ROWS = (Quest(page=5, top_k=4, window=1), 6, 42)  # GQA, 3 query heads per kv head


@functools.cache
def qkv(n, seed=0):
    rng = np.random.default_rng(seed)
    return tuple(rng.standard_normal((B, T, h, D)).astype(np.float32) for h in (n, K, K))


@functools.cache
def decode(name, gathered):
    """PROMPT tokens in one chunk (the masked path), then T - PROMPT decode steps one by one."""
    pol, n, max_len = CASES[name]
    pol = pol if gathered else masked(pol)
    q, k, v = qkv(n)
    _, st = run_policy(pol, q[:, :PROMPT], k[:, :PROMPT], v[:, :PROMPT], [PROMPT], ROPE, max_len=max_len)
    with record_visible() as rec:  # a fresh jit: steps traced here (not cached from another test) record
        out, st = run_policy(pol, q[:, PROMPT:], k[:, PROMPT:], v[:, PROMPT:], [1], ROPE, state=st, start=PROMPT,
                             max_len=max_len, step=jax.jit(attend, static_argnums=(0, 6)))
    return out, jax.tree.map(np.asarray, st), rec["max_visible"]


@pytest.mark.parametrize("name", list(CASES))
def test_gathered_decode_equals_the_masked_path(name):
    """Same pages, same softmax over the same slots: outputs to float tolerance, the stored state
    (tokens, positions, page bounds) bit for bit, and the same count of attended keys."""
    out_g, st_g, vis_g = decode(name, True)
    out_m, st_m, vis_m = decode(name, False)
    np.testing.assert_allclose(out_g, out_m, atol=2e-6, rtol=0)
    for f in ("k", "v", "pos", "kmin", "kmax"):
        np.testing.assert_array_equal(getattr(st_g, f), getattr(st_m, f), err_msg=f)
    assert vis_g == vis_m > 0
    pol = CASES[name][0]
    assert vis_g == max(pol.reads(p)[0] for p in range(PROMPT, T))  # the closed form of what a query reads


def test_the_gather_reads_top_k_pages_and_rows_at_their_own_positions():
    """A decode query's Gather: top_k pages (window <= 1) of `page` slots, its own page last; rows
    of a batch at different positions each read their own pages (and equal the masked path)."""
    pol, n, max_len = ROWS
    q, k, v = qkv(n, 1)
    _, st = run_policy(pol, q[:, :36], k[:, :36], v[:, :36], [36], ROPE, max_len=max_len)
    pos = jnp.asarray([[35], [22]], jnp.int32)  # row 0 rewrites token 35, row 1 token 22 (same inputs both ways)
    args = (q[:, 36:37], k[:, 36:37], v[:, 36:37], pos, ROPE)
    out_g, st_g = jax.jit(attend, static_argnums=(0, 6))(pol, st, *args)
    out_m, st_m = jax.jit(attend, static_argnums=(0, 6))(masked(pol), st, *args)
    np.testing.assert_allclose(np.asarray(out_g), np.asarray(out_m), atol=2e-6, rtol=0)
    np.testing.assert_array_equal(np.asarray(st_g.kmax), np.asarray(st_m.kmax))
    assert pol.gather_slots(max_len) == pol.top_k * pol.page == 20

    kt, vt = (jnp.swapaxes(jnp.asarray(x[:, 36:37]), 1, 2) for x in (k, v))  # [B, K, 1, D]
    view = pol.extend(st, kt, vt, pos)
    qr = ROPE.apply(jnp.asarray(q[:, 36:37]).reshape(B, 1, K, n // K, D).transpose(0, 2, 3, 1, 4), pos[:, None, None])
    g = pol.select(view, qr, None)
    assert isinstance(g, Gather) and g.size == 5 and g.start.shape == (B, K, 4)
    start, ok = np.asarray(g.start), np.asarray(g.ok)
    assert (start[0, :, -1] == 35) .all() and (start[1, :, -1] == 20).all()  # the query's own page last
    assert ok[0].all() and ok[1].all()  # row 1: pages 0-3 are candidates, 3 chosen
    assert (start % 5 == 0).all()
    assert all(len(set(r)) == 4 for r in start.reshape(-1, 4))  # distinct pages


# ---------------------------------------------------------------------------------------------
# the engine: the same NLL and tokens through the gathered and the masked path
# ---------------------------------------------------------------------------------------------

CFG = LlamaConfig(vocab_size=97, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, head_dim=8, d_ff=64)


@functools.cache
def model():
    return Llama(CFG)


def test_engine_nll_is_unchanged():
    """Through the engine (layers scanned, a full layer then two quest layers): a stream scored
    token by token, every token a decode step, gives the masked path's NLL."""
    toks = np.random.default_rng(2).integers(0, 97, (1, 40)).astype(np.int32)
    pols = quest_stack(3, dense_layers=1, page=4, top_k=2)  # a full layer, then two quest layers
    gath, mask = Engine(model(), pols, max_len=48), Engine(model(), pols[:1] + (masked(pols[1]),) * 2, max_len=48)
    nll_g, nll_m = gath.score(toks[0], chunk=1), mask.score(toks[0], chunk=1)
    np.testing.assert_allclose(nll_g, nll_m, atol=1e-5, rtol=0)


def test_a_gathered_step_reads_m_slots_not_the_cache():
    """The compiled decode step's own cost: XLA's count of its flops is a fraction of the masked
    step's at 4,096 slots (it does not rotate or score every key), its bytes below them. Both
    defer their writes, as in a model's layer loop (a step that writes into the state it reads
    from also pays XLA's copies of that state, `full`'s as well)."""
    pol, s = Quest(page=16, top_k=8), 4096
    st = pol.init(1, K, 64, jnp.float32, s)
    q, kv = jnp.ones((1, 1, 4, 64)), jnp.ones((1, 1, K, 64))
    pos = jnp.full((1, 1), s - 40, jnp.int32)
    rope = Rope(64).table(s)
    cost = {}
    for name, p in (("gathered", pol), ("masked", masked(pol))):
        f = jax.jit(lambda st, p=p: attend(p, st, q, kv, kv, pos, rope, defer=True), donate_argnums=0)
        ca = f.lower(st).compile().cost_analysis()
        ca = ca[0] if isinstance(ca, (list, tuple)) else ca
        cost[name] = ca["flops"], ca["bytes accessed"]
    # the masked step rotates and scores every key (4,096 x 4 query heads x 64 x 2 flops per key, and
    # more); the gathered one its 128 slots and the bounds of 256 pages (2 x 256 x 64 x 4 x 2)
    assert cost["gathered"][0] < cost["masked"][0] / 4, cost
    # XLA counts a gather as touching its whole operand (the 4 MB of keys and values), so its bytes
    # are not M slots' here; still below the masked step's, which also reads them all for its logits
    assert cost["gathered"][1] < cost["masked"][1] / 1.5, cost


# ---------------------------------------------------------------------------------------------
# the host tier
# ---------------------------------------------------------------------------------------------


def test_host_tier_attention_equals_device_and_moves_the_gathered_pages():
    pol, n, max_len = CASES["gqa_window"]
    q, k, v = qkv(n)
    _, st = run_policy(pol, q[:, :PROMPT], k[:, :PROMPT], v[:, :PROMPT], [PROMPT], ROPE, max_len=max_len)
    host = offload.to_host(st)
    assert host.k.sharding.memory_kind == offload.host_kind() == "pinned_host"
    assert host.pos.sharding.memory_kind == host.kmin.sharding.memory_kind == "device"
    steps = T - PROMPT
    with offload.record_moves() as rec:
        out_h, st_h = run_policy(pol, q[:, PROMPT:], k[:, PROMPT:], v[:, PROMPT:], [1], ROPE, state=host,
                                 start=PROMPT, max_len=max_len)
    out_d, st_d = decode("gqa_window", True)[:2]
    np.testing.assert_allclose(out_h, out_d, atol=1e-6, rtol=0)
    assert st_h.k.sharding.memory_kind == "pinned_host" and st_h.v.sharding.memory_kind == "pinned_host"
    np.testing.assert_array_equal(np.asarray(offload.to_device(st_h).k), st_d.k)
    # per step: M = gather_slots = (top_k - 1 + 2 local pages) x page = 16 slots of k and v, per row and kv head
    per_step = offload.gathered_bytes(pol, kv_heads=K, head_dim=D, max_len=max_len, batch=B, dtype=jnp.float32)
    assert per_step == 16 * B * K * D * 2 * 4
    assert rec == {"bytes": steps * per_step, "moves": steps}
    assert offload.host_bytes(st_h) == 2 * B * K * max_len * D * 4  # what the tier stores: all of k and v
    with offload.record_moves() as rec:  # a chunk (masked path) moves the whole view
        run_policy(pol, q[:, PROMPT:], k[:, PROMPT:], v[:, PROMPT:], [steps], ROPE, state=host, start=PROMPT,
                   max_len=max_len)
    assert rec == {"bytes": 2 * B * K * max_len * D * 4, "moves": 2}


def test_host_tier_engine_nll_equals_device_and_bytes_moved_per_step_are_the_closed_form():
    """Quest in every layer with its keys/values in host memory through the Engine: a prompt chunk,
    then decode steps; the logits (so the NLL) equal the device cache's, the cache stays in host
    memory, and each decode step moves top_k pages x page x K x D x 2 x 4 bytes per layer."""
    pol = Quest(page=4, top_k=3)
    eng = Engine(model(), (pol,) * CFG.n_layers, max_len=48)  # every layer (a bare Quest: its dense-layer preset)
    toks = np.random.default_rng(3).integers(0, 97, (1, 40)).astype(np.int32)
    caches = {"device": eng.init_cache(1), "host": offload.to_host(eng.init_cache(1))}
    nll = {}
    for where, cache in caches.items():
        lg, cache = eng.step(cache, toks[:, :16], 0)
        out = []
        with offload.record_moves() as rec:
            for t in range(16, 39):
                out.append(-jax.nn.log_softmax(lg, axis=-1)[0, toks[0, t]])
                lg, cache = eng.step(cache, toks[:, t:t + 1], t)
        nll[where] = np.asarray(out)
        caches[where] = cache
    np.testing.assert_allclose(nll["host"], nll["device"], atol=1e-5, rtol=0)
    assert caches["host"][0].k.sharding.memory_kind == "pinned_host"
    per_layer = pol.top_k * pol.page * CFG.n_kv_heads * CFG.head_dim * 2 * 4
    closed = offload.gathered_bytes(pol, kv_heads=2, head_dim=8, max_len=48, n_layers=3, dtype=jnp.float32)
    assert closed == 3 * per_layer
    # the decode step was traced inside the recorder of the host run only (the device run compiled it first:
    # its cache is in device memory, a different input type, so the host cache compiled its own step)
    assert rec["bytes"] == 23 * CFG.n_layers * per_layer and rec["moves"] == 23 * CFG.n_layers


def test_to_host_needs_a_host_memory_kind():
    assert offload.host_kind() in ("pinned_host", "unpinned_host")
    assert offload.on_host(offload.to_host(Quest(page=4).init(1, 1, 4, jnp.float32, 8)).k)


# ---------------------------------------------------------------------------------------------
# the benchmark
# ---------------------------------------------------------------------------------------------


def test_quest_gather_benchmark_dry_run(tmp_path):
    from benchmarks import quest_gather

    res = quest_gather.main(["--dry-run", "--out", str(tmp_path / "qg.json")])
    rows = {(r["level"], r["variant"]): r for r in res["rows"]}
    assert set(rows) == {("attention", v) for v in ("quest", "quest_masked", "quest_host", "full_budget", "full")} | {
        ("model", v) for v in ("quest", "full_budget", "full")}
    assert all(r["ms"] > 0 for r in rows.values())
    host = rows["attention", "quest_host"]
    assert host["host_bytes_moved_per_step"] == host["host_closed_form"] == 4 * 4 * 3 * 64 * 2 * 4  # top_k pages
    assert rows["attention", "quest"]["gathered_slots"] == 16
    assert set(res["ratios"]["attention"]) >= {"quest/full_budget", "quest_masked/quest"}
    assert (tmp_path / "qg.json").exists()
