"""`duo`: a DuoAttention-style head split (Xiao et al., ICLR 2025, "DuoAttention: Efficient
Long-Context LLM Inference with Retrieval and Streaming Heads"; repo mit-han-lab/duo-attention)
— retrieval kv heads keep the full cache, streaming kv heads keep `sink` + `recent` tokens.

Shapes: B batch, K kv heads = Kr retrieval + Ks streaming, T new tokens, M = max_len,
W = min(sink + recent, M) streaming slots, Sv view slots, L layers, D head dim.

Storage (real, per layer): the retrieval heads' keys and values [B, Kr, M, D] with positions
[B, 1, M] (as `full`), and the streaming heads' [B, Ks, W, D] with positions [B, 1, W] (a ring
as `sink`): 2 x D x bytes x (Kr x M + Ks x W) plus 4 x (M + W) position bytes; a group without
heads stores nothing. `extend` builds the transient view of all K heads (streaming heads padded
to the retrieval width and masked), so attention is one call; memory, not compute, is saved.

The head pattern (which kv heads of which layer are retrieval heads) is per layer: a model runs
`Duo(pattern=...).stack(n_layers)`, one policy per layer whose `heads` field is that layer's 0/1
tuple. `pattern` is a file — the authors' `full_attention_heads.tsv` (L rows, K tab-separated
gate values in [0, 1]), a .json (a list of L lists, or {"scores": ...}), or a .npy [L, K] — or
a tuple of L tuples; `threshold` / `sparsity` binarize it as the authors'
`sparsify_attention_heads`. DuoAttention *learns* its gates by optimization on synthetic
passkey data; we ship none. `evals.duo_calibrate.calibrate_duo` writes a pattern from the
attention mass each head puts beyond sink + recent on a calibration text — OUR approximation,
not the authors' learned gates.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from kvpolicies.base import EMPTY, Policy, RopePositions, SlotState, View, empty_slots, held_sorted, keys_rotated
from kvpolicies.checks import check_choice, check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.full import Full
from kvpolicies.limits import Bounded
from kvpolicies.memory import tree_nbytes
from kvpolicies.presets import Preset
from kvpolicies.prompt import PromptCompressor
from kvpolicies.sink import Sink
from kvpolicies.slots import flat, scatter


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DuoState(SlotState):
    """Two groups of kv heads with their own slots.

    k, v:       (retrieval, streaming) codec trees, leaves [B, Kr, M, ...] and [B, Ks, W, ...]
                (a group without heads: 0 heads and 0 slots, no bytes).
    pos:        [B, 1, M] int32 positions of the retrieval slots (slot i holds token i).
    stream_pos: [B, 1, W] int32 positions of the streaming ring (-1 empty).
    """

    stream_pos: Int[Array, "B 1 W"]

    def held(self, row, kv_heads, policy):
        """The retrieval slots for retrieval heads (`policy.heads`), the streaming ring for the others."""
        full, stream = held_sorted(np.asarray(self.pos[row])), held_sorted(np.asarray(self.stream_pos[row]))
        return [full if h else stream for h in policy.heads]


def load_pattern(pattern: str | tuple) -> np.ndarray:
    """[L, K] float64 head scores (or 0/1) from a file (.tsv/.txt, .json, .npy) or a tuple of L tuples."""
    if isinstance(pattern, (tuple, list)):
        arr = np.asarray(pattern, dtype=np.float64)
    else:
        path = pathlib.Path(pattern)
        if not path.is_file():
            raise ValueError(f"duo.pattern={pattern!r}: " + ("a folder, not a file" if path.is_dir() else "no such file"))
        try:
            if path.suffix == ".npy":
                arr = np.load(path).astype(np.float64)
            elif path.suffix == ".json":
                data = json.loads(path.read_text())
                arr = np.asarray(data["scores"] if isinstance(data, dict) else data, dtype=np.float64)
            else:  # the authors' full_attention_heads.tsv
                arr = np.loadtxt(path, dtype=np.float64, delimiter="\t", ndmin=2)
        except (ValueError, TypeError, KeyError, OSError) as e:  # malformed, ragged rows, not numbers
            raise ValueError(f"duo.pattern={pattern!r}: cannot be read as [layers, kv_heads] head scores "
                             f"({type(e).__name__}: {e})") from None
    if arr.ndim != 2 or arr.size == 0:
        raise ValueError(f"duo.pattern: expected [layers, kv_heads] scores, got shape {arr.shape}")
    return arr


def heads_from_scores(scores: np.ndarray, threshold: float = 0.5, sparsity: float | None = None) -> np.ndarray:
    """[L, K] 0/1 retrieval heads, as the authors' `sparsify_attention_heads` (duo_attn/utils.py):
    scores are clipped to [0, 1]; with `sparsity` the threshold is the `sparsity` quantile of all
    scores (sparsity >= 1: every head streams, <= 0: none); a head is retrieval iff its score >=
    threshold. Deviation: the authors add uniform noise in [0, 1e-6) to break ties; we do not."""
    s = np.clip(np.asarray(scores, np.float64), 0, 1)
    if sparsity is not None:
        threshold = 2.0 if sparsity >= 1 else -1.0 if sparsity <= 0 else float(np.quantile(s, sparsity))
    return (s >= threshold).astype(np.int32)


@dataclasses.dataclass(frozen=True)
class Duo(Preset, PromptCompressor, Bounded, Policy):
    """Retrieval kv heads (heads[h] = 1) see every token; streaming heads (0) see the first `sink`
    tokens and the newest `recent` (the query itself included: key j visible to query p iff
    j < sink or j > p - recent, the authors' streaming mask), at their text positions (the
    authors cache keys after RoPE). The same rule holds in prefill and decode, per query.

    The prompt (`prompt="dense"`, the default: the authors' evaluation path, duo_attn/patch/
    llama.py, whose first prefill is `flash_attn_func(..., causal=True)` over every head): a fresh
    prompt is attended densely by every head (its logits are `full`'s), then the streaming heads
    are trimmed once to the first `sink` and the last `recent` tokens; decoding and streams
    (`Engine.score`) apply the streaming mask per query as above. `prompt="stream"`: the
    streaming mask applies during the prompt too (what this library did before; the authors'
    training-time rule).

    `appended` (kvpress's protocol, `kvpolicies.compat.kvpress("DuoAttentionPress", ...)`; 0 = off):
    after the dense prompt's trim the streaming heads keep the next `appended` tokens (the question
    and the answer) beside their sink + recent, without sliding (their ring holds sink + recent +
    appended slots); kvpress trims once after the context and appends.

    Defaults: sink 64, recent 256 (what the authors' evaluation scripts deploy: scripts/niah.sh
    and scripts/longbench.sh pass --sink_size 64 --recent_size 256; their training script and
    released patterns use sink 128), threshold 0.5 (their default), sparsity None.

    Deviations: (1) no learned gates: the pattern comes from a file or from our calibration
    (`evals.duo_calibrate`); (2) the streaming mask is exact per query, the authors' prefill
    kernels apply it in blocks; (3) the transient attention view pads streaming heads to the
    retrieval width, so compute is that of `full` (stored bytes are the method's); (4) no
    tie-breaking noise when binarizing (see `heads_from_scores`); (5) at decode a streaming
    head's query sees the sinks and the newest `recent` tokens, itself included; the authors'
    decode step appends the new token to the sink + recent cached ones before trimming (one
    token more).
    """

    sink: int = 64
    recent: int = 256
    heads: tuple[int, ...] | None = None
    pattern: str | tuple = ""
    threshold: float = 0.5
    sparsity: float | None = None
    prompt: Literal["dense", "stream"] = "dense"
    appended: int = 0
    codec: Codec = Identity()

    def __post_init__(self):
        check_int("duo", "sink", self.sink, 0)
        check_choice("duo", "prompt", self.prompt, ("dense", "stream"))
        check_int("duo", "recent", self.recent, 1)
        check_int("duo", "appended", self.appended, 0)
        if self.appended and self.prompt != "dense":
            raise ValueError("duo.appended: tokens are appended after the dense prompt's trim; it needs prompt='dense'")
        if isinstance(self.heads, list):
            object.__setattr__(self, "heads", tuple(self.heads))
        if self.heads is not None:
            if not self.heads or any(h not in (0, 1) or isinstance(h, bool) for h in self.heads):
                raise ValueError(f"duo.heads={self.heads!r}: must be a non-empty tuple of 0 (streaming) / 1 "
                                 f"(retrieval), one per kv head")
            object.__setattr__(self, "heads", tuple(int(h) for h in self.heads))
        if isinstance(self.pattern, list):
            object.__setattr__(self, "pattern", tuple(tuple(r) if isinstance(r, list) else r for r in self.pattern))
        if not isinstance(self.pattern, (str, tuple)):
            raise ValueError(f"duo.pattern={self.pattern!r}: must be a file path or a tuple of per-layer tuples")
        for name in ("threshold", "sparsity"):
            x = getattr(self, name)
            if x is not None and (isinstance(x, bool) or not isinstance(x, (int, float))):
                raise ValueError(f"duo.{name}={x!r}: must be a number")

    @property
    def rotated_keys(self):
        # Both groups see text positions (`full`; `sink` with positions="original") and only
        # attention reads the keys: stored rotated, as `full` and `sink` (a codec: only after RoPE).
        return keys_rotated(self.codec)

    # -- the per-layer stack ---------------------------------------------------------------------
    def layer_heads(self, n_layers: int) -> np.ndarray:
        """[L, K] 0/1 retrieval heads of every layer (from `pattern`, or `heads` in every layer)."""
        if self.pattern != "":
            pat = heads_from_scores(load_pattern(self.pattern), self.threshold, self.sparsity)
            if pat.shape[0] != n_layers:
                raise ValueError(f"duo.pattern has {pat.shape[0]} layers, the model has {n_layers}")
            return pat
        if self.heads is None:
            raise ValueError("duo needs a head pattern: pattern=<file or per-layer tuples> (e.g. written by "
                             "evals.duo_calibrate) or heads=(1, 0, ...) for every layer")
        return np.asarray([self.heads] * n_layers, np.int32)

    def stack(self, n_layers):
        rows = self.layer_heads(n_layers)
        return tuple(dataclasses.replace(self, heads=tuple(int(h) for h in r), pattern="") for r in rows)

    def _groups(self, kv_heads: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(retrieval heads, streaming heads) of this layer, as static index tuples."""
        if self.heads is None:
            raise ValueError("duo: this policy has no per-layer head mask; run Duo(pattern=...).stack(n_layers) "
                             "(evals.run does) or give heads=(1, 0, ...)")
        if len(self.heads) != kv_heads:
            raise ValueError(f"duo.heads has {len(self.heads)} entries, the layer has {kv_heads} kv heads")
        ret = tuple(h for h in range(kv_heads) if self.heads[h])
        return ret, tuple(h for h in range(kv_heads) if h not in ret)

    def _full(self) -> Full:
        return Full(codec=self.codec)

    def _sink(self) -> Sink:
        return Sink(n_sink=self.sink, window=self.recent + self.appended, positions="original", codec=self.codec)

    # -- sizes -----------------------------------------------------------------------------------
    def capacity(self, max_len):
        """Slots of the widest head: max_len with any retrieval head (or heads unknown)."""
        if self.heads is not None and not any(self.heads):
            return self._sink().capacity(max_len)
        return max_len

    def limit(self, state):
        """Retrieval heads hold token i in slot i (`Bounded`); without any, duo is a ring."""
        return int(state.pos.shape[-1]) or None

    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        ret, st = self._groups(kv_heads)
        r = empty_slots(self.codec, batch, len(ret), head_dim, dtype, max_len if ret else 0)
        s = empty_slots(self.codec, batch, len(st), head_dim, dtype, self._sink().capacity(max_len) if st else 0)
        return DuoState(k=(r.k, s.k), v=(r.v, s.v), pos=r.pos, stream_pos=s.pos)

    # -- one step --------------------------------------------------------------------------------
    def extend(self, state, k, v, pos):
        b, kh, t, _ = k.shape
        ret, st = self._groups(kh)
        views = []
        if ret:
            idx = np.asarray(ret)
            views.append(flat(self._full().extend(SlotState(state.k[0], state.v[0], state.pos), k[:, idx], v[:, idx],
                                                  pos)))
        if st:
            idx = np.asarray(st)
            views.append(flat(self._sink().extend(SlotState(state.k[1], state.v[1], state.stream_pos), k[:, idx],
                                                  v[:, idx], pos)))
        width = max(x.pos.shape[-1] for x in views)

        def pad(x, fill, axis=2):  # the slot axis (2 for k, v, pos; 3 for a mask) to Sv
            widths = [(0, 0)] * x.ndim
            widths[axis] = (0, width - x.shape[axis])
            return jnp.pad(x, widths, constant_values=fill)

        order = np.argsort(np.asarray(ret + st))  # view row h <- group row order[h]

        def cat(xs):  # groups -> kv heads in model order (one group: as is, no copy)
            x = xs[0] if len(xs) == 1 else jnp.concatenate(xs, axis=1)
            return x if (order == np.arange(kh)).all() else jnp.take(x, order, axis=1)

        heads_of = [len(ret), len(st)] if ret and st else [kh]
        vk = cat([pad(x.k, 0) for x in views])  # [B, K, Sv, D]
        vv = cat([pad(x.v, 0) for x in views])
        vpos = cat([jnp.broadcast_to(pad(x.pos, -1), (b, n, width)) for x, n in zip(views, heads_of)])  # [B, K, Sv]
        masks = [x.mask if x.mask is not None else jnp.ones((b, 1, t, x.pos.shape[-1]), bool) for x in views]
        vmask = cat([jnp.broadcast_to(pad(m, False, axis=3), (b, n, t, width))
                     for m, n in zip(masks, heads_of)])  # [B, K, T, Sv]
        carry = (views[0].carry if ret else None, views[-1].carry if st else None, state)
        return View(k=vk, v=vv, pos=vpos, rope=RopePositions(q=pos[..., None], k=vpos), mask=vmask, carry=carry,
                    basis=views[0].basis)  # both groups decode with the one codec

    def compact(self, view, seen):
        c_ret, c_st, old = view.carry  # a group without heads keeps its empty arrays
        r = (self._full().compact(dataclasses.replace(view, carry=c_ret), seen) if c_ret is not None
             else SlotState(old.k[0], old.v[0], old.pos))
        s = (self._sink().compact(dataclasses.replace(view, carry=c_st), seen) if c_st is not None
             else SlotState(old.k[1], old.v[1], old.stream_pos))
        return DuoState(k=(r.k, s.k), v=(r.v, s.v), pos=r.pos, stream_pos=s.pos)

    # -- the authors' prefill (prompt="dense") -----------------------------------------------------
    def prompt_policy(self):
        if self.prompt == "stream":
            return self
        # `full` over every head (keys stored as duo stores them): one prompt state whatever the head
        # pattern, so the layers prefill as one run (`Engine.decode_runs` cuts it into the head
        # groups' runs) and engines of other patterns or ratios share it (`Engine.shares_prompt`)
        return self._full()

    def after_prompt(self, state):
        """The dense prompt state (`full`'s slots, every head) split into the two groups: the
        retrieval heads keep every slot, the streaming heads the first `sink` and the last
        `recent` tokens, in `sink`'s ring layout."""
        if self.prompt == "stream":
            return state
        kh = jax.tree.leaves(state.k)[0].shape[1]
        ret, st = self._groups(kh)
        pick = lambda tree, idx: jax.tree.map(lambda x: x[:, np.asarray(idx, np.int32)] if idx else x[:, :0, :0],  # noqa: E731
                                              tree)
        r_pos = state.pos if ret else state.pos[:, :, :0]
        sink = self._sink()
        w = sink.capacity(state.slots) if st else 0
        ks, vs = pick(state.k, st), pick(state.v, st)  # [B, Ks, M, ...]
        ring = SlotState(k=jax.tree.map(lambda x: jnp.zeros(x.shape[:2] + (w,) + x.shape[3:], x.dtype), ks),
                         v=jax.tree.map(lambda x: jnp.zeros(x.shape[:2] + (w,) + x.shape[3:], x.dtype), vs),
                         pos=jnp.full(state.pos.shape[:2] + (w,), EMPTY, jnp.int32))
        if st:
            pos = state.pos[:, 0]  # [B, M]
            last = pos.max(axis=-1, keepdims=True)  # [B, 1]
            keep = (pos >= 0) & ((pos < self.sink) | (pos > last - self.recent))
            ring = scatter(ring, SlotState(ks, vs, state.pos), jnp.where(keep, sink._slot(pos, w), w))
        return DuoState(k=(pick(state.k, ret), ring.k), v=(pick(state.v, ret), ring.v), pos=r_pos, stream_pos=ring.pos)

    # -- accounting ------------------------------------------------------------------------------
    def decode_reads(self, state, context):
        """Retrieval heads read min(M, context + 1) slots, streaming heads min(W, context + 1)."""
        out = [0, 0]
        for k, v, p in ((state.k[0], state.v[0], state.pos), (state.k[1], state.v[1], state.stream_pos)):
            s = p.shape[-1]
            if s:
                filled = min(s, context + 1)
                out[0] += tree_nbytes((k, v)) * filled // s
                out[1] += tree_nbytes(p) * filled // s
        return out[0], out[1]

