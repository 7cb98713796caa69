"""The registry matrix of the prompt protocol (issue 35, item 4): every registered prompt compressor
(a policy whose prompt phase is another policy) runs prompt -> compress -> decode through `Engine`
on the tiny Qwen2 (`tiny_qwen`: transformers' eager Qwen2 and our port of its weights), at its
registry defaults but a budget that compresses the 48-token prompt, and is checked against
tests/refs/prompt_protocol.py:

(a) the prompt's last logits equal transformers' (the prompt phase attends densely);
(b) `kept_positions` after `compress` equal, per (layer, kv head), the method's rule re-simulated in
    numpy on transformers' tensors (attention weights, cached keys / values, layer inputs):
    h2o: FMInference/H2O `H2OKVCache_LayerWise`; tova: TOVA `TOVACache.reduce`; snapkv: SnapKV
    `snapkv_utils.py`; pyramidkv: SnapKV at PyramidKV's per-layer schedule; knorm: l2compress /
    kvpress KnormPress; random: the documented seeded hash (tests/refs/prompt_scored.np_hash, the
    policy's own draw: checks the protocol, not a rule); observed: kvpress ObservedAttentionPress;
    expected: kvpress ExpectedAttentionPress (tests/refs/prompt_scored.expected_scores, queries
    from transformers' hidden states); adakv: kvpress AdaKVPress over SnapKV scores
    (tests/refs/headwise.adakv_allocate); kvzip: KVzip's scores from transformers' attention over
    the one-chunk reconstruction sequence, head-wise choice (tests/refs/kvzip.choose); kvzap: the
    policy's surrogate weights (random: no trained file fits this model) applied in numpy to
    transformers' normalised layer inputs, the head-wise choice with its window
    (tests/refs/kvzap.choose); duo: the authors' trim of streaming heads; critical: CriticalKV's two
    stages over SnapKV's window attention in kvpress's units, the second by ||v W_o||_1 from transformers'
    values and output projection (`kept_critical` below); quest and kivi keep every token;
(c) the decode: a 3-token question then greedy tokens through `continue_generate` equal a float64
    numpy forward of transformers' weights over transformers' cached keys / values restricted to
    the kept sets (logits after the question to 1e-4, the ids exactly), decoding by the method's
    rule: append-only for the kvpress-style compressors, h2o's and tova's per-token eviction,
    duo's streaming mask, Quest's page selection (its kernels' rule, the same read as
    tests/refs/multires_quest.quest_oracle: checked here on one layer), KIVI's quantized cache.

tests/kvpolicies/test_kvpress_parity.py checks the `kvpolicies.compat.kvpress` forms against
kvpress itself; this matrix checks the registry defaults.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import kvpolicies
from kvpolicies.prompt import prompt_policy_of
from models.engine import Engine
from tests.refs.multires_quest import INV, quest_oracle
from tests.refs.oracle import rope_complex
from tests.refs.prompt_protocol import Decode, Entry, NpQwen, QuestDecode, decode, entries, hf_tensors

T = 48  # prompt tokens
MAX_LEN = 64
N_NEW = 4  # greedy tokens after the question


def kept_critical(pol, t, m):
    """CriticalKV (Feng et al. 2025, "Identify Critical KV Cache in LLM Inference from an Output Perturbation
    Perspective", arXiv:2502.03805; kvpress `CriticalKVPress.score` over `SnapKVPress.score`) re-simulated on
    transformers' tensors of the prompt, per layer and kv head h:
      s_j   SnapKV's score in kvpress's units: the attention of the last w queries (softmax over each query's
            whole causal row) to the n - w older tokens, summed over the window and h's G query heads, pooled
            over the kernel (max: the authors' max_pool1d, -inf padding, over the G heads' sum as the matrix's
            snapkv reference; avg: kvpress's avg_pool1d, zero padding, which commutes with the sum), divided by
            G w (and the kernel, avg: kvpress's means); the w window tokens at the layer's largest score + 1
            (kvpress pads them so);
      vo_j  ||v_j W_o^(g)||_1 averaged over h's G query heads (W_o^(g): query head g's rows of o_proj);
    stage 1 keeps the top max(1, int((1 - r) n first_stage_ratio)) by s (ties: the larger window mass, then
    the newer token), stage 2 the best by (s + epsilon) vo of the rest (ties: the newer token), kvpress's
    n_kept = max(1, int(n (1 - r))) in all."""
    snap = pol.press
    n = t["atts"][0].shape[-1]
    w, r = snap.obs_window, snap.kernel // 2
    cand = n - w
    n_kept = max(1, int(n * (1 - pol.ratio)))
    first = max(1, int((1 - pol.ratio) * n * pol.first_stage_ratio)) if pol.first_stage_ratio else 0
    out = []
    for layer, att in enumerate(t["atts"]):
        mass = att[:, -w:, :cand].reshape(m.k, m.g * w, cand).sum(axis=1)  # [K, n - w]
        if snap.pooling == "max":
            score = np.stack([mass[:, max(j - r, 0):j + r + 1].max(-1) for j in range(cand)], axis=-1) / (m.g * w)
        else:
            padded = np.pad(mass, ((0, 0), (r, r)))
            score = np.stack([padded[:, j:j + snap.kernel].sum(-1) for j in range(cand)], axis=-1) / (
                m.g * w * snap.kernel)  # [K, n - w]
        score = np.concatenate([score, np.full((m.k, w), score.max() + 1)], axis=1)  # [K, n]
        wo = m.lw(layer, "self_attn.o_proj.weight").T.reshape(m.h, m.d, -1)  # [H, D, d]
        v = t["values"][layer]  # [K, n, D]
        vo = np.stack([np.mean([np.abs(v[h] @ wo[h * m.g + g]).sum(-1) for g in range(m.g)], axis=0)
                       for h in range(m.k)])  # [K, n]
        raw = np.concatenate([mass, np.full((m.k, w), -np.inf)], axis=1)  # [K, n]
        heads = []
        for h in range(m.k):
            one = set(sorted(range(n), key=lambda j: (-score[h, j], -raw[h, j], -j))[:first])
            two = (score[h] + pol.epsilon) * vo[h]
            rest = sorted((j for j in range(n) if j not in one), key=lambda j: (-two[j], -j))
            heads.append(sorted(one | set(rest[:n_kept - first])))
        out.append(heads)
    return out


def _critical_entry():
    """critical at ratio 0.75 over the registry's snapkv (max pooling, kernel 7) with obs_window 4: 12 tokens kept
    per kv head, stage 1's 6 the window and 2 older ones (at snapkv's default window 32 of the 48-token prompt,
    stage 1 would hold window tokens only, tied at the layer's max + 1); here stage 1 changes what a head keeps
    (checked: the rule without it, or with stage 1 only, keeps other sets). At ratio 0.625 layer 1's tokens 0 and
    1 nearly tie in stage 2 (their (s + epsilon) vo differ by 1e-9 relative, below float32's resolution)."""
    pol = kvpolicies.get("critical", ratio=0.75, press=kvpolicies.get("snapkv", obs_window=4))
    return Entry(pol, lambda pol, t, m, ctx: kept_critical(pol, t, m))


ENTRIES = {**entries(), "critical": _critical_entry()}


def prompt_compressors() -> list[str]:
    """Registered policies whose prompt phase (at their defaults) is another policy."""
    return sorted(n for n, p in ((n, kvpolicies.get(n)) for n in kvpolicies.POLICIES) if prompt_policy_of(p) is not p)


# Prompt compressors whose prompt rule is checked beside kvpress itself instead (its values through the
# layer's W_o have no re-simulation here yet): the file that does it
BESIDE_KVPRESS = {"kvgrad": "tests/kvpolicies/test_kvpress_parity_kvgrad.py"}


def test_every_prompt_compressor_has_an_entry():
    from pathlib import Path

    assert prompt_compressors() == sorted([*ENTRIES, *BESIDE_KVPRESS])
    root = Path(__file__).resolve().parents[2]
    for name, path in BESIDE_KVPRESS.items():
        assert f'"{name}"' in (root / path).read_text() or name in (root / path).read_text(), (name, path)
    for name, entry in ENTRIES.items():
        assert type(entry.policy) is kvpolicies.POLICIES[name]


@pytest.fixture(scope="module")
def run(tiny_qwen):
    """(our model, ids [1, T], question [Q], transformers' tensors of the prompt, the numpy model, ctx;
    ctx["full"]: the reference decode over every prompt token)."""
    ref, ours = tiny_qwen
    rng = np.random.default_rng(11)
    ids = rng.integers(0, ref.config.vocab_size, (1, T))
    question = rng.integers(0, ref.config.vocab_size, 3).tolist()
    t, m = hf_tensors(ref, ids), NpQwen(ref)
    every = [[list(range(T))] * m.k for _ in range(m.n_layers)]
    return ours, ids, question, t, m, {"ref": ref, "ids": ids, "full": decode(m, t, every, Decode(), question, N_NEW)}


def test_numpy_decoder_equals_transformers(run, tiny_qwen):
    """The reference decoder over every prompt token is transformers' forward over the whole sequence."""
    ref, _ = tiny_qwen
    _, ids, question, t, m, ctx = run
    logits, out = ctx["full"]
    whole = hf_tensors(ref, np.concatenate([ids, [question + out[:-1]]], axis=1))["logits"][T:]
    np.testing.assert_allclose(logits, whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", sorted(ENTRIES))
def test_prompt_protocol_matches_the_authors_rule(run, name):
    model, ids, question, t, m, ctx = run
    entry = ENTRIES[name]
    pol = entry.policy
    kw = {}
    if name == "kvzip":
        from tests.refs.kvzip import REPEAT

        kw["repeat"] = REPEAT
    eng = Engine(model, entry.engine_policies(m.n_layers), max_len=MAX_LEN, **kw)
    st = eng.prompt(ids)
    # (a) the prompt is dense
    np.testing.assert_allclose(np.asarray(st.logits)[0], t["logits"][-1], atol=1e-4, rtol=0)
    comp = eng.compress(st)
    # (b) the kept sets
    want = entry.kept(pol, t, m, ctx)
    got = [[h.tolist() for h in layer] for layer in eng.kept_positions(comp)]
    for layer in range(m.n_layers):
        for h in range(m.k):
            assert got[layer][h] == want[layer][h], f"{name}: layer {layer} kv head {h}"
    if name not in ("quest", "kivi", "think"):  # the budget compresses (quest, kivi and think keep every token)
        assert min(len(x) for layer in want for x in layer) < T
    # (c) the decode: the question's last logits and the greedy ids
    ref_logits, ref_ids = decode(m, t, want, entry.rule(pol), question, N_NEW)
    q = len(question)
    assert np.abs(ref_logits[:q] - ctx["full"][0][:q]).max() > 1e-3  # the method's cache changes the decode
    logits, _ = eng.step(jax.tree.map(jnp.copy, comp.cache), np.array([question]), T)
    np.testing.assert_allclose(np.asarray(logits)[0], ref_logits[q - 1], atol=1e-4, rtol=0)
    assert eng.continue_generate(comp, np.array([question]), N_NEW)[0].tolist() == ref_ids


def test_quest_decode_reads_what_quest_oracle_reads():
    """The matrix's Quest read (QuestDecode) is tests/refs/multires_quest.quest_oracle's rule: one
    attention layer of random q, k, v after a dense prompt, the same outputs."""
    pol = kvpolicies.get("quest", page=4, top_k=3)
    rng = np.random.default_rng(5)
    t, prompt, kh, g, d = 30, 12, 2, 2, 16
    q, k, v = (rng.standard_normal((1, t, h, d)) for h in (kh * g, kh, kh))
    want, _ = quest_oracle(q, k, v, pol, prompt=prompt)
    at = np.arange(t)[:, None]
    qr, kr = (rope_complex(x[0], np.broadcast_to(at, x.shape[1:3]), INV) for x in (q, k))  # [T, ., D]
    rule, sparse = QuestDecode(pol), False
    for p in range(prompt, t):
        for h in range(kh):
            js = rule.visible(0, h, p, qr[p, h * g:(h + 1) * g], kr[:p + 1, h])
            sparse |= len(js) < p + 1
            for j in range(g):
                lg = kr[js, h] @ qr[p, h * g + j] / np.sqrt(d)
                w = np.exp(lg - lg.max())
                np.testing.assert_allclose((w / w.sum()) @ v[0, js, h], want[0, p, h * g + j], atol=1e-12)
    assert sparse  # some queries read fewer pages than they could
