"""`Decoding`: kvpress's compression while decoding (`DecodingPress`, `CompressionRatioDecodingPress`,
`PrefillDecodingPress`), counted in model steps as kvpress counts them.

Shapes: B batch, K kv heads, S slots, T new tokens of a step, V = S + T view slots, D head dim.

kvpress 0.5.5 (NVIDIA/kvpress `presses/decoding_press.py`) compresses in a forward hook after each
decoding step's attention: every layer counts its forward steps since the end of the prefill (a
T-token question is one step, each generated token one more), and at the `compression_interval`-th
(or on a step of T >= target tokens) the whole cache (context, question, answer so far) goes back to
`target_size` tokens per kv head, the base press's n_kept = int(k_len (1 - ratio)) with the ratio
found for exactly `target_size` (`_find_target_compression_ratio`); a cache of at most `target_size`
tokens is left as it is, and the count restarts either way. `CompressionRatioDecodingPress` sets the
target at every step to max(1, int(n_seen (1 - target_compression_ratio))) of the n_seen = newest
position + 1 tokens seen. `PrefillDecodingPress` compresses the context once with its prefilling
press (any prompt scorer here), then decodes under the decoding press.

Here a step is an engine step: `Decoding` is not `per_token`, so a chunk (the question that
`Engine.continue_generate` feeds whole, or one generated token) attends over the cache and its own
tokens and is compressed after it, as kvpress's hook does. The decode-time ranking is the base
press's `rank` over the whole view; it must read only the cache (kvpress's DecodingPress re-scores on
the hidden states buffered since the last compression, which a scorer of the keys alone ignores):
knorm (the keys' norms), keydiff (their cosine with the head's mean unit key, after RoPE) and qfilter (-<f, k>
after RoPE, f the layer's filter; a preset: `stack` gives each layer its own).
kvpress ranks the cache in the order its last top-k left it, by score; ranks of an order-free score
are the same up to float rounding of the sums. Ties keep the newer token (kvpress: torch.topk's).

Memory: the state has min(max_len, max(P + max_new, target + interval - 1)) slots per kv head, P the
prompt tokens the prefilling press keeps (without one: the whole prompt, every slot of max_len), the
target at max_len for a ratio; each compression packs the kept tokens. A step that finds no free slot
before its turn (max_new too small for the question and the tokens before the first compression)
keeps the S best early, where kvpress's cache would grow: not kvpress's rule, never reached when
max_new covers the question and interval - 1 tokens.

`dms_from_kvpress`: kvpress's `DMSPress` over KVzapPress (dense prefill, decoding=False), which is the registered
`kvzap` with rule="threshold" (a head pool of each head's window and the tokens scoring above the threshold).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import jax
import jax.numpy as jnp
import numpy as np
from jaxtyping import Array, Int

from kvpolicies.base import Policy, SlotState
from kvpolicies.checks import check_int
from kvpolicies.codecs import Codec, Identity
from kvpolicies.full import Full
from kvpolicies.keydiff import KeyDiff
from kvpolicies.knorm import Knorm
from kvpolicies.presets import Preset, stack_of
from kvpolicies.qfilter import QFilter
from kvpolicies.prompt import PromptPhase
from kvpolicies.prompt_scored import PromptScored
from kvpolicies.scored import pack, top_mask
from kvpolicies.slots import concat

SEEN_TABLE = 1 << 16  # CompressionRatioDecodingPress's targets tabled exactly up to this many tokens seen


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodingState(SlotState):
    """Slots plus each batch row's forward steps since the last decoding compression.

    steps: [B] int32 (not per slot).
    """

    steps: Int[Array, "B"]


@dataclasses.dataclass(frozen=True)
class Decoding(Preset, PromptScored):
    """kvpress's `DecodingPress(base_press=press, compression_interval=interval, target_size=target)`
    (`target_ratio` > 0: `CompressionRatioDecodingPress(target_compression_ratio=target_ratio)`;
    `prefill` set: `PrefillDecodingPress(prefilling_press=prefill, decoding_press=...)`): every
    `interval` steps after the prompt, the cache back to `target` tokens per kv head by `press`'s ranking."""

    label = "decoding"
    per_token: ClassVar[bool] = False  # a chunk is one step: attended whole, then compressed (kvpress's hook)
    takes: ClassVar[tuple[type, ...]] = (Knorm, KeyDiff, QFilter)  # rankings of the cache alone (module docstring)

    press: PromptScored = None  # the base press: its `rank` at each decoding compression
    prefill: PromptScored | None = None  # the prefilling press (None: the prompt kept whole)
    interval: int = 512  # compression_interval (steps)
    target: int = 2048  # target_size (tokens per kv head); unused when target_ratio > 0
    target_ratio: float = 0.0  # CompressionRatioDecodingPress's target_compression_ratio (0: a fixed target)
    budget: int = 0
    max_new: int = 256  # slots for the tokens appended before the first compression (the question, ...)
    codec: Codec = Identity()

    def __post_init__(self):
        check_int(self.label, "budget", self.budget, 0)
        check_int(self.label, "max_new", self.max_new, 0)
        check_int(self.label, "interval", self.interval, 1)
        check_int(self.label, "target", self.target, 1)
        check_int(self.label, "slots", self.slots, 0)
        if self.slots or self.spare or self.ratio:
            raise ValueError(f"{self.label}: slots, spare and ratio are not decoding's (the prefill press has a ratio)")
        r = self.target_ratio
        if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
            raise ValueError(f"{self.label}.target_ratio={r!r}: must be a number in [0, 1) (0: the fixed target)")
        if type(self.press) not in self.takes:
            raise ValueError(f"{self.label}.press={self.press!r}: must be one of {[c.__name__ for c in self.takes]} "
                             "(a ranking of the cache alone: kvpress re-scores on buffered hidden states otherwise)")
        if self.prefill is not None and (not isinstance(self.prefill, PromptScored)
                                         or type(self.prefill).after_prompt is not PromptScored.after_prompt):
            raise ValueError(f"{self.label}.prefill={self.prefill!r}: must be a prompt scorer that keeps its "
                             "kept_for(n) best of the prompt (a kvpress(...) result: snapkv, knorm, keydiff, ...)")
        if self.prefill is not None and self.prefill.codec != self.codec:
            raise ValueError(f"{self.label}: the prefill press's codec {self.prefill.codec!r} is not {self.codec!r}")

    @property
    def observes(self):
        return self.press.observes

    def stack(self, n_layers):
        """One policy per layer: each with its layer's base press and prefilling press (presets: qfilter's
        filters, pyramidkv's budgets; knorm's dense_layers become `full` layers)."""
        presses = stack_of(self.press, n_layers)
        prefills = stack_of(self.prefill, n_layers) if self.prefill is not None else (None,) * n_layers
        return tuple(p if type(p) is Full else dataclasses.replace(self, press=p, prefill=f)
                     for p, f in zip(presses, prefills))

    # -- sizes -----------------------------------------------------------------------------------
    def target_for(self, n_seen: int) -> int:
        """Tokens per kv head a decoding compression keeps after n_seen tokens (kvpress's `_resolve_target_size`)."""
        return max(1, int(n_seen * (1 - self.target_ratio))) if self.target_ratio else self.target

    def prompt_kept(self, max_len: int) -> int:
        return max_len if self.prefill is None else self.prefill.kept_for(max_len)

    def capacity(self, max_len):
        steady = self.target_for(max_len) + self.interval - 1
        return min(max_len, max(self.prompt_kept(max_len) + self.max_new, steady))

    def kept_table(self, max_len):
        return None  # compressions while decoding: no shape class

    @property
    def appends_only(self):
        return False

    # -- the state -------------------------------------------------------------------------------
    def init(self, batch, kv_heads, head_dim, dtype, max_len):
        st = super().init(batch, kv_heads, head_dim, dtype, max_len)
        return self.join(st, jnp.zeros((batch,), jnp.int32))

    def split(self, state):
        return SlotState(state.k, state.v, state.pos), state.steps

    def join(self, slots, stats):
        return DecodingState(slots.k, slots.v, slots.pos, steps=stats)

    def rank(self, slots, keys, stats, seen):
        return self.press.rank(slots, keys, None, seen)

    # -- the prompt ------------------------------------------------------------------------------
    def prompt_policy(self):
        if self.prefill is None:
            return PromptPhase(codec=self.codec, of=self, obs_window=0)
        return dataclasses.replace(self.prefill.prompt_policy(), of=self)

    def after_prompt(self, state, table=None):
        """The prefilling press's compression (`PromptScored.after_prompt` of `prefill`, its kept_for(n)
        best), or the whole prompt; the step count at 0."""
        s = self.capacity(state.slots)
        keys = self.codec.decode(state.k, jnp.float32)  # [B, K, max_len, D]
        pos = jnp.broadcast_to(state.pos, keys.shape[:3])  # [B, K, max_len]
        filled = pos >= 0
        kept = filled
        if self.prefill is not None:
            p = self.prefill
            pslots, pstats = p.from_prompt(state, pos)
            count = filled.sum(axis=-1)  # [B, K] prompt tokens
            table = np.asarray([p.kept_for(n) for n in range(state.slots + 1)], np.int32)  # static
            n = jnp.minimum(jnp.asarray(table)[count], s)[..., None]  # [B, K, 1]
            prio, tie = p.prompt_rank(state, pslots, keys, pstats)
            kept = jnp.where(count[..., None] > n, top_mask(prio, tie, n) & filled, filled)
        slots = pack(SlotState(state.k, state.v, pos), kept, s)  # [B, K, S]
        return self.join(slots, jnp.zeros(pos.shape[:1], jnp.int32))

    # -- a decoding step -------------------------------------------------------------------------
    def compact(self, view, seen):
        (old, new), steps = view.carry
        slots = concat(old, new)  # [B, K, V, ...]: the stored slots, then the step's T tokens
        s, t = old.slots, new.pos.shape[-1]
        filled = slots.pos >= 0  # [B, K, V]
        count = filled.sum(axis=-1)  # [B, K] tokens in the view
        steps = steps + 1  # [B]: this step counted (kvpress: layer_step_counts)
        n_seen = new.pos.max(axis=(1, 2)) + 1  # [B]: kvpress's position_ids.max() + 1
        target = self._target(n_seen)  # [B]
        due = (steps >= self.interval) | (t >= target)  # [B]: kvpress's compression step
        n = jnp.minimum(jnp.where(due[:, None], target[:, None], s), s)  # [B, 1]: tokens a compression keeps
        over = (due[:, None] & (count > target[:, None])) | (count > s)  # [B, K]
        prio, tie = self.rank(slots, view.k, None, seen)  # [B, K, V]
        kept = jnp.where(over[..., None], top_mask(prio, tie, n[..., None]) & filled, filled)
        return self.join(pack(slots, kept, s), jnp.where(due, 0, steps))

    def _target(self, n_seen: Int[Array, "B"]) -> Int[Array, "B"]:
        """kvpress's target at n_seen tokens: Python's int(n_seen * (1 - r)) in float64, from a table for
        n_seen < SEEN_TABLE (a float32 product beyond, which may round across an integer)."""
        if not self.target_ratio:
            return jnp.full(n_seen.shape, self.target, jnp.int32)
        table = np.maximum(1, np.floor(np.arange(SEEN_TABLE) * (1 - self.target_ratio))).astype(np.int32)  # static
        far = jnp.maximum(1, jnp.floor(n_seen.astype(jnp.float32) * (1 - self.target_ratio))).astype(jnp.int32)
        return jnp.where(n_seen < SEEN_TABLE, jnp.asarray(table)[jnp.minimum(n_seen, SEEN_TABLE - 1)], far)


PRESSES = ("DecodingPress", "CompressionRatioDecodingPress", "PrefillDecodingPress", "DMSPress")


def from_kvpress(name: str, r: float, max_new: int, fields: dict, kvpress: Callable[..., Any]) -> Policy:
    """`kvpolicies.compat.kvpress(name, r, **fields)` for kvpress's decoding presses (kvpress's field names):
    DecodingPress(base_press, compression_interval=512, target_size=2048, hidden_states_buffer_size=256),
    CompressionRatioDecodingPress(base_press, target_compression_ratio=0.5, compression_interval=512, ...),
    PrefillDecodingPress(prefilling_press=None, decoding_press=None). A press is a class name (its fields
    among `fields`) or a `kvpress(...)` result; base_press: KnormPress, KeyDiffPress or QFilterPress. `r`: DecodingPress
    has none (0); CompressionRatioDecodingPress's is target_compression_ratio; PrefillDecodingPress's is
    its prefilling press's (0: the one given). `kvpress`: compat's front door, which builds a press given
    by name (handed over by compat: this module does not import it)."""

    if isinstance(r, bool) or not isinstance(r, (int, float)) or not 0 <= r < 1:
        raise ValueError(f"compression_ratio={r!r}: must be a number in [0, 1)")
    if name == "DMSPress":
        return dms_from_kvpress(r, max_new, fields)
    if "press" in fields:
        raise ValueError(f"kvpress({name!r}): its inner press is base_press= (kvpress's field), not press=")
    if name == "PrefillDecodingPress":
        pre, dec = fields.pop("prefilling_press", None), fields.pop("decoding_press", None)
        if isinstance(pre, str):
            pre = kvpress(pre, r, max_new=max_new, **{k: fields.pop(k) for k in list(fields)})
        elif pre is not None and r not in (0, getattr(pre, "ratio", None)):
            raise ValueError(f"kvpress('PrefillDecodingPress', {r}): the prefilling press has compression_ratio "
                             f"{getattr(pre, 'ratio', None)} (give the same, or 0)")
        if fields:
            raise ValueError(f"kvpress('PrefillDecodingPress'): unknown field(s) {sorted(fields)}")
        if isinstance(pre, Full):  # kvpress(name, 0): no prefill compression
            pre = None
        if dec is None:
            return Full() if pre is None else pre
        if not isinstance(dec, Decoding) or dec.prefill is not None:
            raise ValueError(f"kvpress('PrefillDecodingPress'): decoding_press={dec!r} must be a "
                             "kvpress('DecodingPress' or 'CompressionRatioDecodingPress', ...) result")
        return dataclasses.replace(dec, prefill=pre, max_new=max_new)
    own = {"interval": fields.pop("compression_interval", 512)}
    if name == "DecodingPress":
        if r != 0:
            raise ValueError(f"kvpress('DecodingPress', {r}): DecodingPress has no compression_ratio (target_size sets "
                             "each compression's): give 0")
        own["target"] = fields.pop("target_size", 2048)
    else:
        if "target_size" in fields:
            raise ValueError("kvpress('CompressionRatioDecodingPress'): target_size is not a field (init=False in "
                             "kvpress: the target is target_compression_ratio of the tokens seen)")
        tr = fields.pop("target_compression_ratio", r if r else 0.5)
        if r not in (0, tr):
            raise ValueError(f"kvpress('CompressionRatioDecodingPress', {r}): compression_ratio is its "
                             f"target_compression_ratio ({tr!r}): give that, or 0")
        own["target_ratio"] = tr
    check_int(name, "compression_interval", own["interval"], 1)
    if "target" in own:
        check_int(name, "target_size", own["target"], 1)
    buffer = fields.pop("hidden_states_buffer_size", 256)
    check_int("DecodingPress", "hidden_states_buffer_size", buffer, 0)  # read by scorers of hidden states only
    base = fields.pop("base_press", None)
    if base is None:
        raise ValueError(f"kvpress({name!r}): give base_press= (KnormPress, KeyDiffPress or QFilterPress: a class "
                         "name or a kvpress(...) result)")
    if isinstance(base, str):
        if base not in ("KnormPress", "KeyDiffPress", "QFilterPress"):
            raise NotImplementedError(
                f"kvpolicies.compat.kvpress: {name} over {base!r} (only KnormPress, KeyDiffPress and QFilterPress, "
                "whose score reads the cache alone: kvpress re-scores the others on the hidden states buffered since "
                "the last compression, which SnapKVPress refuses below its window)")
        base = kvpress(base, 0.5, max_new=max_new, **{k: fields.pop(k) for k in list(fields)})  # its ratio unused
    if fields:
        raise ValueError(f"kvpress({name!r}): unknown field(s) {sorted(fields)}")
    return Decoding(press=dataclasses.replace(base, ratio=0.0), max_new=max_new, **own)


def dms_from_kvpress(r: float, max_new: int, fields: dict) -> Policy:
    """`kvpolicies.compat.kvpress("DMSPress", 0, press="KVzapPress", threshold=t, sliding_window_size=128)`:
    kvpress's DMSPress (dense prefill, after DMS, Lancucki et al. 2025, arXiv:2506.05345) over KVzapPress, the
    KVzap paper's method, is the registered `kvzap` with rule="threshold": after the prompt each kv head keeps
    its newest `sliding_window_size` tokens and every older one whose surrogate log-score is >= threshold
    (kvpress masks the others, every head still storing n tokens; ours drops them from a head pool). The
    pool is sized for every token (`budget` unbounded): `Engine(fit=n)` stores each layer at what it kept.
    kvpress's compression_ratio is read-only (measured after the prefill): give 0. Refused: another scorer
    (kvpress scores each step's new tokens alone with it) and decoding=True (the surrogate's scores of
    decoded tokens: kvzap's decoding adds none)."""
    from kvpolicies.kvzap import KVzap
    from kvpolicies.kvzap_scored import ZapScored

    if r != 0:
        raise ValueError(f"kvpress('DMSPress', {r}): DMSPress's compression_ratio is read-only (what its threshold "
                         "kept, after the prefill): give 0 and threshold=")
    inner = fields.pop("press", None)
    if isinstance(inner, ZapScored):
        zap = {"model_type": inner.kind, "kvzap_model_name": inner.surrogate}
    elif inner == "KVzapPress":
        zap = {k: fields.pop(k) for k in ("model_type", "kvzap_model_name") if k in fields}
    else:
        raise NotImplementedError(f"kvpolicies.compat.kvpress: DMSPress over {inner!r} (only KVzapPress, given by "
                                  "name or as a kvpress('KVzapPress', ...) result: the KVzap paper's method)")
    if fields.pop("decoding", False):
        raise NotImplementedError("kvpolicies.compat.kvpress: DMSPress(decoding=True) (the surrogate's scores of "
                                  "decoded tokens: kvzap's decoding adds none)")
    threshold = fields.pop("threshold", None)
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
        raise ValueError(f"kvpress('DMSPress'): threshold={threshold!r}: give a number (a surrogate log-score; "
                         "kvpress's default None compares nothing)")
    window = fields.pop("sliding_window_size", 128)
    if fields:
        raise ValueError(f"kvpress('DMSPress'): unknown field(s) {sorted(fields)}")
    return KVzap(rule="threshold", threshold=float(threshold), window=window, budget=1 << 30, max_new=max_new,
                 kind=zap.get("model_type", "mlp"), surrogate=str(zap.get("kvzap_model_name", "auto")))
