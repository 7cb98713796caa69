"""References for the prompt protocol of every registered prompt compressor (prompt -> compress ->
decode; tests/kvpolicies/test_prompt_matrix.py): the method's rule re-simulated on transformers'
tensors of the tiny Qwen2 (`tiny_qwen`), and a float64 numpy forward of the same weights that
decodes over the kept positions of each (layer, kv head).

Shapes: T prompt tokens, H query heads, K kv heads, G = H / K, D head dim, L layers, d model width.

`hf_tensors` runs transformers' eager Qwen2 once over a prompt (attention weights, cached keys
after RoPE and values, hidden states); each `kept_*` function reads those and returns the kept
positions [layer][kv head] (sorted lists), written from the method's paper / authors' code as the
policy's docstring describes it, not from the library. `decode` continues from the prompt's
cached keys and values restricted to those sets, token by token, in float64 numpy (its weights
are transformers'), with a `Decode` rule for what each query reads and what it evicts.
"""

from __future__ import annotations

import math

import numpy as np

from tests.refs.headwise import adakv_allocate
from tests.refs.kvzap import choose as kvzap_choose
from tests.refs.hub import kept_qfilter
from tests.refs.kvzip import choose as kvzip_choose
from tests.refs.oracle import default_inv_freq, rope_complex
from tests.refs.prompt_scored import (compactor_scores, cur_scores, expected_scores, keydiff_scores, lagkv_scores,
                                      np_hash)
from tests.refs.scorers2 import kept_cap, kept_simlayerkv


def _best(score: dict, n: int) -> set:
    """The n keys of `score` with the largest value (ties keep the newer token)."""
    return set(sorted(score, key=lambda j: (-score[j], -j))[:n])


# ------------------------------------------------------------------------------------------
# transformers' tensors and a float64 numpy Qwen2 on the same weights
# ------------------------------------------------------------------------------------------


class NpQwen:
    """transformers' Qwen2ForCausalLM weights in float64 numpy (eager attention, tied head)."""

    def __init__(self, ref):
        c = ref.config
        self.n_layers, self.h, self.k = c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads
        self.d = c.hidden_size // c.num_attention_heads
        self.g = self.h // self.k
        self.eps = c.rms_norm_eps
        self.inv = default_inv_freq(self.d, getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"])
        w = {n: p.detach().double().numpy() for n, p in ref.state_dict().items()}
        self.w = w
        self.emb = w["model.embed_tokens.weight"]  # [V, d]
        self.head = w.get("lm_head.weight", self.emb)

    def lw(self, layer, name):
        return self.w[f"model.layers.{layer}.{name}"]

    def norm(self, x, weight):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + self.eps) * weight

    def qkv(self, layer, x, pos):
        """x [T, d] (the layer's input) at positions [T] -> q pre-RoPE [T, H, D], q and k after RoPE, v."""
        hn = self.norm(x, self.lw(layer, "input_layernorm.weight"))  # [T, d]
        q, k, v = (hn @ self.lw(layer, f"self_attn.{n}_proj.weight").T + self.lw(layer, f"self_attn.{n}_proj.bias")
                   for n in "qkv")
        q = q.reshape(len(x), self.h, self.d)  # [T, H, D]
        k, v = (a.reshape(len(x), self.k, self.d) for a in (k, v))  # [T, K, D]
        at = np.asarray(pos)[:, None]
        return q, rope_complex(q, np.broadcast_to(at, q.shape[:2]), self.inv), \
            rope_complex(k, np.broadcast_to(at, k.shape[:2]), self.inv), v

    def finish_layer(self, layer, x, att):
        """x [d] + o_proj(att [H * D]), then the MLP."""
        x = x + att @ self.lw(layer, "self_attn.o_proj.weight").T
        h = self.norm(x, self.lw(layer, "post_attention_layernorm.weight"))
        gate = h @ self.lw(layer, "mlp.gate_proj.weight").T
        up = h @ self.lw(layer, "mlp.up_proj.weight").T
        return x + (gate / (1 + np.exp(-gate)) * up) @ self.lw(layer, "mlp.down_proj.weight").T

    def logits(self, x):
        return self.norm(x, self.w["model.norm.weight"]) @ self.head.T


def hf_tensors(ref, ids):
    """transformers' eager forward over ids [1, T]: logits [T, V], attentions [L][H, T, T], cached
    keys (after RoPE) and values [L][K, T, D], layer inputs [L][T, d] (all float64)."""
    import torch

    with torch.no_grad():
        out = ref(torch.tensor(ids), output_attentions=True, output_hidden_states=True, use_cache=True)
    f = lambda x: x.double().numpy()[0]  # noqa: E731
    layers = out.past_key_values.layers
    return dict(logits=f(out.logits), atts=[f(a) for a in out.attentions], keys=[f(lay.keys) for lay in layers],
                values=[f(lay.values) for lay in layers], hidden=[f(h) for h in out.hidden_states[:-1]])


# ------------------------------------------------------------------------------------------
# the kept sets after the prompt, per method (t: hf_tensors of the prompt, m: NpQwen)
# ------------------------------------------------------------------------------------------


def _by_kv_head(att, m):
    """[H, T, T] -> [K, G, T, T] (query head h serves kv head h // G, as transformers' repeat_kv)."""
    return att.reshape(m.k, m.g, *att.shape[1:])


def kept_h2o(pol, t, m):
    """FMInference/H2O `H2OKVCache_LayerWise` after a dense prompt: per kv head the `recent` newest
    tokens and the `heavy` older ones with the most attention summed over all prompt queries (and
    the kv head's query heads)."""
    n = t["atts"][0].shape[-1]
    out = []
    for att in t["atts"]:
        hh = _by_kv_head(att, m).sum(axis=(1, 2))  # [K, T]
        recent = set(range(max(n - pol.recent, 0), n))
        out.append([sorted(recent | _best({j: hh[h, j] for j in range(n) if j not in recent}, pol.heavy))
                    for h in range(m.k)])
    return out


def kept_tova(pol, t, m):
    """schwartz-lab-NLP/TOVA `TOVACache.reduce`: the `budget` tokens with the most attention from
    the prompt's last query, averaged over all query heads (scope "layer", the default)."""
    assert pol.scope == "layer"
    out = []
    for att in t["atts"]:
        last = att[:, -1].mean(0)  # [T]
        out.append([sorted(_best(dict(enumerate(last)), pol.budget))] * m.k)
    return out


def _window_mass(att, m, w):
    """[K][T] the attention of the last w prompt queries summed over them and each kv head's G heads."""
    return _by_kv_head(att, m)[:, :, -w:].sum(axis=(1, 2))


def snapkv_layer(att, m, w, kernel, b):
    """SnapKV (FasterDecoding/SnapKV `snapkv_utils.py`): the last w queries' attention to the older
    prompt tokens (summed over the window and, GQA as the library's docstring, over the kv head's
    G query heads), max-pooled over `kernel` neighbours (max_pool1d, padding kernel // 2: -inf
    outside), the top b of them (ties: larger raw mass, then the newer token) plus the window."""
    n = att.shape[-1]
    if n <= b + w:
        return [list(range(n))] * m.k
    mass = _window_mass(att, m, w)  # [K, T]
    r, cand = kernel // 2, n - w
    out = []
    for h in range(m.k):
        pooled = [max(mass[h, max(j - r, 0):min(j + r + 1, cand)]) for j in range(cand)]
        top = sorted(range(cand), key=lambda j: (-pooled[j], -mass[h, j], -j))[:b]
        out.append(sorted(top + list(range(cand, n))))
    return out


def kept_snapkv(pol, t, m):
    n = t["atts"][0].shape[-1]
    b = int(n * (1 - pol.ratio)) - pol.obs_window if pol.ratio else pol.budget  # kvpress's n_kept, window included
    return [snapkv_layer(att, m, pol.obs_window, pol.kernel, b) for att in t["atts"]]


def kept_finch(pol, t, m):
    """FINCH (kvpress FinchPress, the authors' code): SnapKV's window mass without pooling, the row of
    the query at position p weighted by p (normalize_scores), the top of the older tokens plus the window."""
    n, w = t["atts"][0].shape[-1], pol.obs_window
    b = int(n * (1 - pol.ratio)) - w if pol.ratio else pol.budget
    out = []
    for att in t["atts"]:
        mass = (_by_kv_head(att, m)[:, :, -w:] * np.arange(n - w, n)[:, None]).sum(axis=(1, 2))  # [K, T]
        out.append([sorted(sorted(range(n - w), key=lambda j: (-mass[h, j], -j))[:b] + list(range(n - w, n)))
                    for h in range(m.k)])
    return out


def pyramid_schedule(budget, n_layers, beta):
    """PyramidKV's per-layer budgets (Cai et al. 2024; KVCache-Factory `pyramidkv_utils.py`): an
    arithmetic sequence from 2 k - k / beta at the bottom to k / beta at the top, k the uniform
    budget, rounded to integers by largest remainders so that the total is L k."""
    exact = np.linspace(2 * budget - budget / beta, budget / beta, n_layers)
    floors = np.floor(exact).astype(int)
    order = sorted(range(n_layers), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in order[: budget * n_layers - floors.sum()]:
        floors[i] += 1
    return floors.tolist()


def kept_pyramidkv(pol, t, m):
    budgets = pyramid_schedule(pol.budget, m.n_layers, pol.beta)
    return [snapkv_layer(att, m, pol.obs_window, pol.kernel, b) for att, b in zip(t["atts"], budgets)]


def _scored(t, m, n_keep, dense_layers, score):
    """Per kv head the n_keep best of score(layer, h) {pos: score} (kvpress's ScorerPress top-k);
    the first dense_layers layers keep everything."""
    n = t["atts"][0].shape[-1]
    return [[list(range(n)) if layer < dense_layers else sorted(_best(score(layer, h), n_keep))
             for h in range(m.k)] for layer in range(m.n_layers)]


def _n_keep(pol, n):
    return max(1, int(n * (1 - pol.ratio))) if pol.ratio else pol.budget


def kept_knorm(pol, t, m):
    """alessiodevoto/l2compress `l2_compress`, kvpress KnormPress: the lowest key L2 norms (keys
    after RoPE, as both cache them), the authors' dense first layers kept whole."""
    n = t["atts"][0].shape[-1]
    return _scored(t, m, _n_keep(pol, n), pol.dense_layers,
                   lambda layer, h: {j: -np.linalg.norm(t["keys"][layer][h, j]) for j in range(n)})


def kept_random(pol, t, m):
    """The documented seeded draw per (seed, kv head, position) (tests/refs/prompt_scored.np_hash)."""
    n = t["atts"][0].shape[-1]
    return _scored(t, m, _n_keep(pol, n), 0, lambda layer, h: {j: np_hash(pol.seed, h, j) for j in range(n)})


def kept_observed(pol, t, m):
    """kvpress ObservedAttentionPress: attention summed over all prompt queries / the n - j queries
    that see token j, averaged over the kv head's query heads."""
    n = t["atts"][0].shape[-1]
    col = [_by_kv_head(att, m).sum(axis=2).mean(1) / np.arange(n, 0, -1) for att in t["atts"]]  # [K, T]
    return _scored(t, m, _n_keep(pol, n), 0, lambda layer, h: dict(enumerate(col[layer][h])))


def kept_expected(pol, t, m):
    """kvpress ExpectedAttentionPress (tests/refs/prompt_scored.expected_scores) on transformers'
    keys and values and the pre-RoPE queries of its hidden states (one Gaussian per query head)."""
    n = t["atts"][0].shape[-1]
    qs = [m.qkv(layer, t["hidden"][layer], np.arange(n))[0] for layer in range(m.n_layers)]  # [T, H, D]

    def score(layer, h):
        heads = [qs[layer][pol.n_sink:, h * m.g + g] for g in range(m.g)]
        return expected_scores(pol, heads, t["keys"][layer][h], t["values"][layer][h], list(range(n)), n, m.inv)

    return _scored(t, m, _n_keep(pol, n), 0, score)


def kept_keydiff(pol, t, m):
    """kvpress KeyDiffPress: the keys (after RoPE, as transformers caches them) least similar to the
    mean unit key of their head (tests/refs/prompt_scored.keydiff_scores)."""
    n = t["atts"][0].shape[-1]
    return _scored(t, m, _n_keep(pol, n), 0, lambda layer, h: dict(enumerate(keydiff_scores(t["keys"][layer][h]))))


def kept_cur(pol, t, m):
    """kvpress CURPress on transformers' cached keys and values (tests/refs/prompt_scored.cur_scores)."""
    n = t["atts"][0].shape[-1]
    return _scored(t, m, _n_keep(pol, n), 0, lambda layer, h: dict(enumerate(
        cur_scores(pol, t["keys"][layer][h], t["values"][layer][h], np.arange(n)))))


def kept_compactor(pol, t, m):
    """kvpress CompactorPress with our sketch (tests/refs/prompt_scored.compactor_scores) on transformers'
    keys (un-rotated), values and the pre-RoPE queries of its hidden states."""
    from kvpolicies.compactor import sketch

    n = t["atts"][0].shape[-1]
    phi = np.asarray(sketch(pol.seed, m.k, m.d, pol.sketch_dim), np.float64)

    def scores(layer):
        q = m.qkv(layer, t["hidden"][layer], np.arange(n))[0].transpose(1, 0, 2)  # [H, T, D]
        k = rope_complex(t["keys"][layer], -np.arange(n)[None], m.inv)  # [K, T, D] before RoPE
        return compactor_scores(pol, q, k, t["values"][layer], phi, m.inv)

    sc = [scores(layer) for layer in range(m.n_layers)]
    return _scored(t, m, _n_keep(pol, n), 0, lambda layer, h: dict(enumerate(sc[layer][h])))


def kept_lagkv(pol, t, m):
    """kvpress LagKVPress on transformers' cached keys and values (tests/refs/prompt_scored.lagkv_scores)."""
    n = t["atts"][0].shape[-1]
    return _scored(t, m, _n_keep(pol, n), 0, lambda layer, h: dict(enumerate(
        lagkv_scores(pol, t["keys"][layer][h], t["values"][layer][h]))))


def kept_adakv(pol, t, m):
    """kvpress AdaKVPress over SnapKV scores (tests/refs/headwise.adakv_allocate) on transformers'
    window attention: the window kept by every head, K x b candidates of the layer chosen together."""
    n = t["atts"][0].shape[-1]
    w = pol.obs_window
    b = (max(1, int(n * (1 - pol.ratio))) if pol.ratio else pol.budget + w) - w
    out = []
    for att in t["atts"]:
        mass = _window_mass(att, m, w)
        win = [dict(enumerate(mass[h])) for h in range(m.k)]
        cand = [set(range(n - w))] * m.k
        chosen = adakv_allocate(win, cand, b, pol.alpha_safeguard, pol.kernel // 2)
        out.append([sorted(chosen[h] | set(range(n - w, n))) for h in range(m.k)])
    return out


def kvzip_repeat_input(ids, prompts):
    """The authors' first repeat input after a one-chunk context: prompt, chat suffix, context."""
    return np.concatenate([ids, [list(prompts.first) + list(prompts.suffix)], ids], axis=1)


def kept_kvzip(pol, t, m, recon):
    """snu-mllab/KVzip: score each context token by the most attention any repeat query (of the
    one-chunk reconstruction [context, repeat prompt, suffix, context]) of the kv head's query
    heads gives it (recon: hf_tensors of that sequence), then per layer K n - int(K n ratio) tokens
    chosen head-wise, every head keeping the n_sink first and the last context token
    (tests/refs/kvzip.choose)."""
    n = t["atts"][0].shape[-1]
    total = m.k * n - int(m.k * n * pol.ratio)
    out = []
    for att in recon["atts"]:
        sc = _by_kv_head(att, m)[:, :, n:, :n].max(axis=(1, 2))  # [K, n]
        kept = kvzip_choose([dict(enumerate(sc[h])) for h in range(m.k)], [set(range(n))] * m.k,
                            pol.n_sink, n - 1, total)
        out.append([sorted(x) for x in kept])
    return out


def kept_kvcompose(pol, t, m, recon):
    """kvpress KVComposePress (structured, its defaults): each query head's most attention from the
    context's second copy (recon: hf_tensors of [context, context]), mean over the kv head's query
    heads, plus the layer's mean over kv heads; a layer's composite at rank r is the mean over its
    kv heads of their r-th best score, layer 0's the maximum over layers; the max(1, int(L n (1 -
    ratio))) best composites of all layers (ties: the earlier layer) count each layer's tokens,
    which every kv head takes from its own best (ties: the newer token)."""
    n, n_layers = t["atts"][0].shape[-1], len(recon["atts"])
    scores = np.stack([_by_kv_head(att, m)[:, :, n:, :n].max(axis=2).mean(axis=1)
                       for att in recon["atts"]])  # [L, K, n]: max over the second copy's queries, mean over G
    scores = scores + scores.mean(axis=1, keepdims=True)
    comp = -np.sort(-scores, axis=-1).mean(axis=1)  # [L, n]
    comp[0] = comp.max(axis=0)
    flat = sorted(range(n_layers * n), key=lambda i: (-comp.flat[i], i))[:max(1, int(n_layers * n * (1 - pol.ratio)))]
    counts = np.maximum(np.bincount([i // n for i in flat], minlength=n_layers), 1)
    return [[sorted(_best(dict(enumerate(scores[layer, h])), int(counts[layer]))) for h in range(m.k)]
            for layer in range(n_layers)]


def kept_kvzap(pol, t, m, params):
    """KVzap (kvpress KVzapPress, rule "budget"): the surrogate (params: the policy's weights,
    stacked on L) on transformers' normalised layer inputs gives a log-score per (token, kv head);
    every head keeps its last `window` tokens, the layer K x budget in all (tests/refs/kvzap.choose)."""
    n = t["atts"][0].shape[-1]
    out = []
    for layer in range(m.n_layers):
        x = m.norm(t["hidden"][layer], m.lw(layer, "input_layernorm.weight"))
        sc = x @ params["w"][layer] + params["b"][layer]  # [T, K]
        kept = kvzap_choose([dict(enumerate(sc[:, h])) for h in range(m.k)], [set(range(n))] * m.k,
                            pol.window, n - 1, m.k * pol.budget)
        out.append([sorted(x) for x in kept])
    return out


def kept_duo(pol, t, m):
    """mit-han-lab/duo-attention: retrieval heads keep every token, streaming heads keys[:sink]
    and keys[-recent:] after the dense prefill."""
    n = t["atts"][0].shape[-1]
    stream = sorted(set(range(min(pol.sink, n))) | set(range(max(n - pol.recent, 0), n)))
    return [[list(range(n)) if pol.heads[h] else stream for h in range(m.k)] for _ in range(m.n_layers)]


def kept_all(pol, t, m):
    """Quest and KIVI keep every token (what they restrict is the read, or its precision)."""
    n = t["atts"][0].shape[-1]
    return [[list(range(n))] * m.k for _ in range(m.n_layers)]


# ------------------------------------------------------------------------------------------
# decoding over the kept sets
# ------------------------------------------------------------------------------------------


class Decode:
    """Append-only decoding: every new token joins each head's kept set, a query reads the set."""

    def __init__(self, pol=None):
        self.pol = pol

    def start(self, kept, t, m):
        self.kept = [[set(x) for x in layer] for layer in kept]

    def visible(self, layer, h, p, qr, kr):
        """Positions query p (its G rotated queries qr [G, D]) of kv head h reads; kr [P, D]."""
        return sorted(self.kept[layer][h])

    def kv(self, layer, h, js, p, kr, v):
        return kr[js], v[js]

    def after(self, layer, p, probs):
        """probs {h: (positions, [G, J] attention)} of query p in this layer."""


class RerotatedDecode(Decode):
    """Append-only decoding with the keys re-rotated (FINCH's rerotate_keys): the visible keys at their
    ranks 0..J-1 and the query at J-1 (each of transformers' keys turned by its rank minus its position,
    the query kept at p: the same distances)."""

    def kv(self, layer, h, js, p, kr, v):
        shift = p - len(js) + 1 + np.arange(len(js)) - np.asarray(js)  # [J]: the rank's position minus the text's
        return rope_complex(kr[js][None], shift[None], self.inv)[0], v[js]

    def start(self, kept, t, m):
        super().start(kept, t, m)
        self.inv = m.inv


class H2ODecode(Decode):
    """H2O's per-step eviction: scores (the prompt's column sums) grow by each query's attention,
    the new token's own included; keep the `recent` newest and the `heavy` best others."""

    def start(self, kept, t, m):
        super().start(kept, t, m)
        self.score = [[dict(enumerate(_by_kv_head(att, m).sum(axis=(1, 2))[h])) for h in range(m.k)]
                      for att in t["atts"]]

    def after(self, layer, p, probs):
        for h, (js, w) in probs.items():
            sc = self.score[layer][h]
            for j, x in zip(js, w.sum(0)):
                sc[j] = sc.get(j, 0.0) + x
            recent = set(sorted(js)[-self.pol.recent:]) if self.pol.recent else set()
            self.kept[layer][h] = recent | _best({j: sc[j] for j in js if j not in recent}, self.pol.heavy)


class TOVADecode(Decode):
    """TOVA's per-step rule (scope "layer"): over budget, drop the token the new query attends to
    least, its attention averaged over all query heads."""

    def after(self, layer, p, probs):
        js = probs[0][0]
        mean = np.mean([w for _, (_, ws) in probs.items() for w in ws], axis=0)  # [J]
        keep = sorted(_best(dict(zip(js, mean)), self.pol.budget))
        self.kept[layer] = [set(keep) for _ in probs]


class DuoDecode(Decode):
    """Streaming heads read j < sink or j > p - recent (the authors' streaming mask), retrieval heads all."""

    def start(self, kept, t, m):
        super().start(kept_all(self.pol, t, m), t, m)

    def visible(self, layer, h, p, qr, kr):
        js = sorted(self.kept[layer][h])
        return js if self.pol.heads[h] else [j for j in js if j < self.pol.sink or j > p - self.pol.recent]


class QuestDecode(Decode):
    """Quest's decode read (mit-han-lab/Quest kernels): the query's own page and the top_k - 1
    earlier pages by U = sum_d max(q_d min_d, q_d max_d) over the page's rotated keys, max over
    the kv head's query heads (ties: the lower page)."""

    def visible(self, layer, h, p, qr, kr):
        pg = self.pol.page
        own = p // pg
        if own + 1 <= self.pol.top_k:
            return list(range(p + 1))
        u = [max(np.maximum(q * kr[c * pg:(c + 1) * pg].min(0), q * kr[c * pg:(c + 1) * pg].max(0)).sum()
                 for q in qr) for c in range(own)]
        pages = set(sorted(range(own), key=lambda c: (-u[c], c))[: self.pol.top_k - 1]) | {own}
        return [j for j in range(p + 1) if j // pg in pages]


def kivi_quantize(x, n, bits, group, residual, axis):
    """KIVI (jy-yuan/KIVI `models/llama_kivi.py`) after n tokens, dequantized: keys (x [P, D], after
    RoPE) j < n - n mod R per channel over groups of G tokens, values j < n - R per token over
    groups of G channels; the rest in full precision."""
    top = 2**bits - 1
    out = x.copy()

    def q(blk, ax):
        lo, hi = blk.min(ax, keepdims=True), blk.max(ax, keepdims=True)
        s = (hi - lo) / top
        return np.clip(np.round((blk - lo) / np.where(s > 0, s, 1)), 0, top) * s + lo

    if axis == "keys":
        for a in range(0, n - n % residual, group):
            out[a:a + group] = q(x[a:a + group], 0)
    else:
        for j in range(max(n - residual, 0)):
            out[j] = q(x[j].reshape(-1, group), 1).reshape(-1)
    return out


class KiviDecode(Decode):
    """A query reads the cache as it stood after the tokens before it (kivi_quantize) and itself."""

    def kv(self, layer, h, js, p, kr, v):
        a = self.pol
        k = kivi_quantize(kr[:p], p, a.bits, a.group, a.residual, "keys")
        vv = kivi_quantize(v[:p], p, a.bits, a.group, a.residual, "values")
        return np.concatenate([k, kr[p:p + 1]])[js], np.concatenate([vv, v[p:p + 1]])[js]


class ThinKDecode(Decode):
    """ThinK (kvpress ThinKPress): each kv head's int(D r) key channels of lowest (mean square of the last
    `window` prompt queries after RoPE, over the head's G queries) x (mean square of its prompt keys after
    RoPE) are zeroed in the prompt's keys; the tokens after the prompt keep every channel."""

    def start(self, kept, t, m):
        super().start(kept, t, m)
        self.n = n = t["atts"][0].shape[-1]
        w = min(self.pol.window, n)
        self.pruned = []
        for layer in range(m.n_layers):
            _, qr, _, _ = m.qkv(layer, t["hidden"][layer][n - w:], np.arange(n - w, n))  # [w, H, D] after RoPE
            q_sq = (qr ** 2).mean(0).reshape(m.k, m.g, m.d).mean(1)  # [K, D]
            k_sq = (t["keys"][layer] ** 2).mean(1)  # [K, D]
            self.pruned.append([np.argsort(q_sq[h] * k_sq[h], kind="stable")[:int(m.d * self.pol.ratio)]
                                for h in range(m.k)])

    def kv(self, layer, h, js, p, kr, v):
        kr = kr.copy()
        kr[:self.n, self.pruned[layer][h]] = 0.0
        return kr[js], v[js]


def decode(m, t, kept, rule, tokens, n):
    """Feed tokens [Q] after the T prompt tokens (transformers' cache restricted to `kept`
    [layer][kv head]), then n - 1 greedy tokens: (logits [Q + n - 1, V] after each fed token, the n
    greedy ids), float64, token by token."""
    rule.start(kept, t, m)
    keys = [np.array(k.transpose(1, 0, 2)) for k in t["keys"]]  # [L][T, K, D]
    vals = [np.array(v.transpose(1, 0, 2)) for v in t["values"]]
    p = t["atts"][0].shape[-1]
    feed, logits, ids = list(tokens), [], []
    while len(ids) < n:
        tok = feed.pop(0) if feed else ids[-1]
        x = m.emb[tok][None]  # [1, d]
        for layer in range(m.n_layers):
            _, qr, kr, v = m.qkv(layer, x, [p])  # [1, H, D], [1, K, D]
            keys[layer] = np.concatenate([keys[layer], kr])
            vals[layer] = np.concatenate([vals[layer], v])
            att, probs = np.zeros((m.h, m.d)), {}
            for h in range(m.k):
                rule.kept[layer][h].add(p)
                qg = qr[0, h * m.g:(h + 1) * m.g]  # [G, D]
                js = rule.visible(layer, h, p, qg, keys[layer][:, h])
                kk, vv = rule.kv(layer, h, js, p, keys[layer][:, h], vals[layer][:, h])
                lg = qg @ kk.T / math.sqrt(m.d)  # [G, J]
                w = np.exp(lg - lg.max(-1, keepdims=True))
                w /= w.sum(-1, keepdims=True)
                att[h * m.g:(h + 1) * m.g] = w @ vv
                probs[h] = (js, w)
            rule.after(layer, p, probs)
            x = m.finish_layer(layer, x[0], att.reshape(-1))[None]
        logits.append(m.logits(x[0]))
        if not feed:
            ids.append(int(np.argmax(logits[-1])))
        p += 1
    return np.stack(logits), ids


# ------------------------------------------------------------------------------------------
# the matrix (tests/kvpolicies/test_prompt_matrix.py)
# ------------------------------------------------------------------------------------------


class Entry:
    """A prompt compressor's matrix entry: `policy`, what the engine runs (the policy, or a tuple per
    layer), the kept-set reference kept(pol, t, m, ctx) (ctx: {"ref", "ids"}), the decode rule."""

    def __init__(self, policy, kept, rule=Decode, engine=None):
        self.policy, self.kept, self.rule, self.engine = policy, kept, rule, engine

    def engine_policies(self, n_layers):
        return (self.policy,) * n_layers if self.engine == "every_layer" else self.policy


def _plain(fn):
    return lambda pol, t, m, ctx: fn(pol, t, m)


def _kvzip(pol, t, m, ctx):
    from tests.refs.kvzip import REPEAT

    return kept_kvzip(pol, t, m, hf_tensors(ctx["ref"], kvzip_repeat_input(ctx["ids"], REPEAT)))


def _kvzap(pol, t, m, ctx):
    return kept_kvzap(pol, t, m, pol.surrogate_params(ctx["ref"].config.hidden_size, m.k, m.n_layers))


def _kvcompose(pol, t, m, ctx):
    return kept_kvcompose(pol, t, m, hf_tensors(ctx["ref"], np.concatenate([ctx["ids"], ctx["ids"]], axis=1)))


def entries():
    """registry name -> Entry: the registry defaults but a budget that compresses a 48-token prompt
    (a ratio where the policy has one), and the fields the 2-layer tiny Qwen2 needs (named)."""
    import kvpolicies

    get = kvpolicies.get
    return {
        "h2o": Entry(get("h2o", heavy=8, recent=8), _plain(kept_h2o), H2ODecode),
        "tova": Entry(get("tova", budget=16), _plain(kept_tova), TOVADecode),
        # obs_window 32 of 48 tokens: ratio 0.25 keeps the window and 4 of the 16 older tokens
        "snapkv": Entry(get("snapkv", ratio=0.25), _plain(kept_snapkv)),
        "pyramidkv": Entry(get("pyramidkv", budget=4), _plain(kept_pyramidkv)),  # budgets (8, 0) + the window
        # dense_layers=1 (default 2: both layers of the tiny model would be dense)
        "knorm": Entry(get("knorm", ratio=0.5, dense_layers=1), _plain(kept_knorm)),
        "random": Entry(get("random", ratio=0.5), _plain(kept_random)),
        "observed": Entry(get("observed", ratio=0.5), _plain(kept_observed)),
        "expected": Entry(get("expected", ratio=0.5), _plain(kept_expected)),
        "keydiff": Entry(get("keydiff", ratio=0.5), _plain(kept_keydiff)),
        "qfilter": Entry(get("qfilter", ratio=0.5, filters="random"), _plain(kept_qfilter)),  # tests/refs/hub.py
        "cur": Entry(get("cur", ratio=0.5), _plain(kept_cur)),
        "compactor": Entry(get("compactor", ratio=0.5), _plain(kept_compactor)),  # one chunk, padded
        # obs_window 8 (the question's tokens; default 32): ratio 0.5 keeps the window and 16 of the 40 older tokens
        "finch": Entry(get("finch", ratio=0.5, obs_window=8), _plain(kept_finch), RerotatedDecode),
        # lag_size 8 (default 128 > the prompt): 4 scored partitions, 2 kept of each beside the 16 sinks and tail
        "lagkv": Entry(get("lagkv", ratio=0.5, lag_size=8), _plain(kept_lagkv)),
        # n_recent 16, n_last 2 (defaults 1024, 1 > the prompt): the tiny Qwen2's layer 1 is lazy, layer 0 not
        "simlayerkv": Entry(get("simlayerkv", lazy_threshold=0.4, n_recent=16, n_last=2), _plain(kept_simlayerkv)),
        "cap": Entry(get("cap", ratio=0.5), _plain(kept_cap)),
        "adakv": Entry(get("adakv", ratio=0.2), _plain(kept_adakv)),  # 6 of 16 older tokens per head on average
        "kvzip": Entry(get("kvzip", ratio=0.5), _kvzip),
        "kvcompose": Entry(get("kvcompose", ratio=0.5), _kvcompose),
        # window 8 (default 128 > the prompt: nothing to choose); surrogate="random" (no weights for this model)
        "kvzap": Entry(get("kvzap", budget=16, window=8, surrogate="random"), _kvzap),
        # sink 4 + recent 8 (defaults 64 + 256 > the prompt); heads: kv head 0 retrieval, 1 streaming
        "duo": Entry(get("duo", sink=4, recent=8, heads=(1, 0)), _plain(kept_duo), DuoDecode),
        # top_k 2 pages of 16 (default 64 pages: every page read); in every layer (the preset keeps layers 0-1 dense)
        "quest": Entry(get("quest", top_k=2), _plain(kept_all), QuestDecode, engine="every_layer"),
        # group 4, residual 8 (default group 32 does not divide head_dim 16; residual 128 > the prompt)
        "kivi": Entry(get("kivi", group=4, residual=8), _plain(kept_all), KiviDecode),
        # window 8 (default 32 holds 32 of the 48 prompt queries); every token kept, 8 of 16 key channels pruned
        "think": Entry(get("think", window=8), _plain(kept_all), ThinKDecode),
    }
