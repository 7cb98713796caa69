"""Budgets: one byte budget for every policy, token budgets from a ratio, per-layer schedules.

**One budget for every policy** (`sized`, `sized_bytes`, `sized_stack`). A budget is a number of
stored bytes per layer, the same for every policy of a comparison:

    budget n (int)      the bytes of n full-precision tokens: `full`'s state with n slots in the
                        run's dtype (keys, values and slot positions), per layer, batch 1;
    budget r (float)    r in (0, 1]: floor(r x the bytes of the `full` cache at max_len)
                        (kvpress's compression ratio is 1 - r).

**The capability** (`Budgeted`): a policy with a token budget inherits `Budgeted` and names its
budget field; `for_tokens(n)` builds the policy that keeps n tokens in all. Everything below
sizes such policies (`budget_field_of(policy)` is None for the others).

A policy is sized to the largest argument n of its `for_tokens(n, codec=..., **fields)` whose
stored state (`kvpolicies.memory.state_bytes(...).total`) fits the budget. Everything stored
counts: sinks, recent windows, observation windows and decode slots, codec codes *and* scales,
slot positions and bookkeeping (h2o/snapkv's accumulated attention), so an int4 cache buys
about 3x the tokens of bf16, and h2o (positions and scores per kv head) a few percent fewer
than window. The sized policy stores at most the budget and within one slot (one token in
every kv head, with its metadata) of it: one more token would not fit, unless the policy
already holds every token up to max_len. Policies without a token budget (not `Budgeted`: full,
quest, kivi, hier) cannot be sized and raise ValueError saying so.

`python -m kvpolicies.budgets --budget 0.25` prints what each registered policy keeps under
one budget (the table of docs/guide/budgets.md).

**Token budgets** (`from_ratio`, `uniform`, `pyramid`). The older interface: a number of tokens
written to the *budget field*. A policy's budget is fixed at construction (so its state has a
fixed shape and one compiled step serves every step). Each budgeted policy declares one
budget field (`Budgeted.budget_field`): the tokens its eviction rule chooses; anything it always
keeps on top (h2o's `recent` window, snapkv's observation window and decode slots, sink's sinks)
is a separate field, kept the same in every layer, as PyramidKV keeps its observation window
in every layer. Today: h2o heavy, tova budget, snapkv / pyramidkv / knorm / random / observed /
expected / kvzip budget (the last five count every kept token; their max_new decode slots come on top),
window window, sink window.

Per-layer budgets return a tuple of policies, one per layer, for `Llama`/`Engine`
(consecutive equal policies share one scanned run); their memory is
`kvpolicies.memory.stack_bytes(policies, ...)`.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Callable
from typing import Any, ClassVar

import jax.numpy as jnp

from kvpolicies.base import Policy
from kvpolicies.checks import check_choice, check_int


class Budgeted:
    """Capability: a token budget. `budget_field` names the field a number of tokens sets: the
    tokens the policy's eviction rule chooses (anything it always keeps on top, h2o's recent window,
    snapkv's observation window, sink's sinks, is a separate field). `for_tokens(n)` is the policy
    that keeps n tokens in all: by default the budget field set to n; a policy whose kept tokens
    include other fields overrides it to split n (h2o: recent = n // 2, heavy = the rest)."""

    budget_field: ClassVar[str]

    @classmethod
    def for_tokens(cls, n: int, **kw) -> Policy:
        """The policy that keeps n tokens in all (its budget field set to n)."""
        return cls(**{cls.budget_field: n}, **kw)


class Fits:
    """Capability: a policy whose layers keep numbers of tokens that depend on the content (kvzap's
    threshold), re-sized to what a prompt kept: `fit(n)` is the same policy with room for n tokens
    per kv head on average (and its free slots), which keeps the same tokens of that prompt, and
    `fit_state` stores a compressed state at that size. `models.engine.Engine.fitted` re-sizes each
    such layer, so that the stored bytes are what each layer kept, not the static capacity."""

    def fit(self, tokens_per_head: int) -> Policy:
        """This policy with room for `tokens_per_head` tokens per kv head on average."""
        raise NotImplementedError

    def fit_state(self, state: Any, max_len: int) -> Any:
        """One layer's compressed state (of the policy this one was fit from) stored at this
        policy's capacity at `max_len`: every kept token stays (the engine checked the counts)."""
        raise NotImplementedError


def budget_field_of(policy: Any) -> str | None:
    """The field a token budget sets on `policy` (a policy or its class); None without a budget."""
    cls = policy if isinstance(policy, type) else type(policy)
    return cls.budget_field if issubclass(cls, Budgeted) else None


def budgeted() -> dict[str, type[Policy]]:
    """Registered policies that have a token budget (`Budgeted`)."""
    from kvpolicies import POLICIES  # the registry imports this package's policies

    return {n: cls for n, cls in POLICIES.items() if issubclass(cls, Budgeted)}


def _policy_class(name: str) -> type[Policy]:
    choices = budgeted()
    if name not in choices:
        raise ValueError(f"policy={name!r}: budgets apply to one of {sorted(choices)}")
    return choices[name]


def _build(name: str, field: int, codec, kw: dict) -> Policy:
    from kvpolicies import get

    return get(name, codec=codec, **{_policy_class(name).budget_field: field}, **kw)


def tokens_from_ratio(ratio: float, prompt_len: int) -> int:
    """round(ratio x prompt_len), halves rounded up; ratio in (0, 1]."""
    if not isinstance(ratio, (int, float)) or not 0 < ratio <= 1:
        raise ValueError(f"ratio={ratio!r}: must be a number in (0, 1]")
    check_int("budgets", "prompt_len", prompt_len, 1)
    return int(math.floor(ratio * prompt_len + 0.5))


def from_ratio(name: str, ratio: float, prompt_len: int, codec="none", **kw) -> Policy:
    """A policy that keeps `ratio` of a `prompt_len`-token prompt after eviction.

    n = tokens_from_ratio(ratio, prompt_len) is the whole kept context, as the policy's
    `for_tokens(n)` splits it: h2o recent = n // 2 and heavy = n - recent (the paper's equal
    split); snapkv budget = n - obs_window plus its window (its `max_new` decode slots come on
    top); tova, window: n; sink: window = n - n_sink. The budget is fixed from then on (a
    longer text is still held in n tokens), which is what keeps one compiled step for every step.
    """
    from kvpolicies import check_fields
    from kvpolicies.codecs import get_codec

    cls = _policy_class(name)
    check_fields(name, kw)
    return cls.for_tokens(tokens_from_ratio(ratio, prompt_len), codec=get_codec(codec), **kw)


def uniform_budgets(total_tokens: int, n_layers: int) -> tuple[int, ...]:
    """total_tokens split as evenly as possible (the remainder goes to the lowest layers)."""
    check_int("budgets", "n_layers", n_layers, 1)
    check_int("budgets", "total_tokens", total_tokens, 0)
    q, r = divmod(total_tokens, n_layers)
    return tuple(q + (i < r) for i in range(n_layers))


def pyramid_budgets(total_tokens: int, n_layers: int, beta: float = 20.0) -> tuple[int, ...]:
    """PyramidKV's per-layer budgets (Cai et al. 2024, "PyramidKV: Dynamic KV Cache Compression
    based on Pyramidal Information Funneling"): an arithmetic sequence from the bottom layer
    2 k - k / beta down to the top layer k / beta, k = total_tokens / n_layers (the uniform
    budget), so the total is that of the uniform allocation. beta = 1 is uniform; the paper
    uses 20. Rounded to integers by largest remainders (ties to lower layers) so that the sum
    is exactly total_tokens and the budgets never increase with depth.
    """
    check_int("budgets", "n_layers", n_layers, 1)
    check_int("budgets", "total_tokens", total_tokens, 0)
    if not isinstance(beta, (int, float)) or not beta >= 1:
        raise ValueError(f"pyramid.beta={beta!r}: must be a number >= 1")
    k = total_tokens / n_layers
    top, bottom = k / beta, 2 * k - k / beta
    step = 0.0 if n_layers == 1 else (bottom - top) / (n_layers - 1)
    exact = [bottom - i * step for i in range(n_layers)]
    floors = [math.floor(x) for x in exact]
    extra = total_tokens - sum(floors)
    by_fraction = sorted(range(n_layers), key=lambda i: (-(exact[i] - floors[i]), i))
    for i in by_fraction[:extra]:
        floors[i] += 1
    return tuple(floors)


def uniform(name: str, total_tokens: int, n_layers: int, codec="none", **kw) -> tuple[Policy, ...]:
    """One policy per layer, the budget field split evenly: total_tokens = sum over layers."""
    return tuple(_build(name, b, codec, kw) for b in uniform_budgets(total_tokens, n_layers))


def pyramid(name: str, total_tokens: int, n_layers: int, beta: float = 20.0, codec="none", **kw) -> tuple[Policy, ...]:
    """One policy per layer with PyramidKV's pyramidal schedule (`pyramid_budgets`) over the
    budget field of `name`: more tokens in lower layers, fewer in upper ones, the same total
    as `uniform`. Other fields (`kw`, e.g. snapkv's obs_window) are the same in every layer.

    Only with "snapkv" (or "pyramidkv") is this PyramidKV (Cai et al. 2024: SnapKV's
    selection with that schedule); it is then exactly the registered `pyramidkv` preset's
    `stack(n_layers)` at budget total_tokens / n_layers. Any other policy gets the schedule
    but not the method (e.g. "h2o": H2O with pyramidal budgets, our combination). A policy
    whose budget field must be >= 1 (tova, window) raises ValueError if the top layers round
    to 0: lower beta."""
    if name == "pyramidkv":
        name = "snapkv"  # the preset's layers are SnapKV selections
    return tuple(_build(name, b, codec, kw) for b in pyramid_budgets(total_tokens, n_layers, beta))


# ------------------------------------------------------------------------------------------
# One budget for every policy: stored bytes, everything included
# ------------------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Dims:
    """The cache geometry a byte budget is measured in: one layer, batch 1."""

    max_len: int
    kv_heads: int
    head_dim: int
    dtype: jnp.dtype

    def stored(self, policy: Policy) -> int:
        """Exact stored bytes of one layer of `policy` (kv + positions + bookkeeping)."""
        from kvpolicies.memory import state_bytes

        return state_bytes(policy, kv_heads=self.kv_heads, head_dim=self.head_dim, max_len=self.max_len,
                           dtype=self.dtype).total


def _dims(max_len, kv_heads, head_dim, dtype) -> _Dims:
    check_int("budgets", "max_len", max_len, 1)
    check_int("budgets", "kv_heads", kv_heads, 1)
    check_int("budgets", "head_dim", head_dim, 1)
    return _Dims(max_len, kv_heads, head_dim, jnp.dtype(dtype))


def target_bytes(budget: int | float, *, max_len: int, kv_heads: int, head_dim: int, dtype) -> int:
    """The stored bytes per layer that `budget` allows (see the module docstring).

    An int n >= 1: the bytes of `full`'s state with n slots (keys, values, positions) in
    `dtype`. A float r in (0, 1]: floor(r x the bytes of the `full` cache at max_len). The
    type decides: 1 is one token, 1.0 the whole cache.
    """
    from kvpolicies.full import Full

    dims = _dims(max_len, kv_heads, head_dim, dtype)
    if isinstance(budget, bool) or not isinstance(budget, numbers.Real):
        raise ValueError(f"budget={budget!r}: must be an int (tokens) or a float in (0, 1] (a fraction of full)")
    if isinstance(budget, numbers.Integral):
        check_int("budgets", "budget", int(budget), 1)
        return _Dims(int(budget), dims.kv_heads, dims.head_dim, dims.dtype).stored(Full())
    if not 0 < budget <= 1:
        raise ValueError(f"budget={budget!r}: a float budget must be in (0, 1] (a fraction of the full "
                         f"cache's bytes); an int budget is tokens")
    return math.floor(float(budget) * dims.stored(Full()))


def _sizable(name: str, fields: dict, what: str) -> type[Policy]:
    """The class of `name` if a budget can size it; ValueError naming the reason otherwise."""
    from kvpolicies import check_fields

    cls = check_fields(name, fields)
    if not issubclass(cls, Budgeted):
        raise ValueError(f"policy {name!r} cannot be sized: it has no token budget (not Budgeted); "
                         f"{what} applies to one of {sorted(budgeted())}")
    if cls.budget_field in fields:
        raise ValueError(f"{name}.{cls.budget_field}={fields[cls.budget_field]!r} conflicts with {what}: "
                         f"the budget sets {cls.budget_field}; give one or the other")
    return cls


def _first_true(lo: int, hi: int, pred: Callable[[int], bool]) -> int:
    """Smallest x in [lo, hi] with pred(x), for pred false...false true...true and pred(hi)."""
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if pred(mid) else (mid + 1, hi)
    return lo


def _last_true(lo: int, hi: int, pred: Callable[[int], bool]) -> int:
    """Largest x in [lo, hi] with pred(x), for pred true...true false...false and pred(lo)."""
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if pred(mid) else (lo, mid - 1)
    return lo



class BudgetTooSmall(ValueError):
    """The budget cannot hold the policy's smallest sizing (its fixed part: sinks, windows, decode
    slots); other sizing errors (a bad field) are plain ValueErrors."""

def sized_bytes(name: str, nbytes: int, /, *, max_len: int, kv_heads: int, head_dim: int, dtype,
                codec="none", **fields) -> Policy:
    """The policy `name` whose stored bytes per layer are at most `nbytes`, and within one slot.

    Searches the argument n of `cls.for_tokens(n, codec=codec, **fields)` (n in [1, max_len]:
    no policy keeps more than max_len tokens) for the largest n whose exact stored state
    (`state_bytes(...).total`: keys and values as the codec stores them, with their scales,
    plus positions and bookkeeping) fits, then returns the smallest n storing those same bytes
    (so a policy already holding max_len slots gets no larger budget field than it uses).
    Stored bytes are non-decreasing in n for every policy (more tokens, more slots); a binary
    search then costs ~2 log2(max_len) `jax.eval_shape` calls, nothing allocated.

    ValueError: `name` is not `Budgeted` ("cannot be sized"), `fields` set the budget field
    (a conflicting size), or even the smallest valid policy does not fit.
    """
    from kvpolicies.codecs import get_codec

    check_int("budgets", "nbytes", nbytes, 0)
    cls = _sizable(name, fields, f"budget_bytes={nbytes}")
    dims, codec = _dims(max_len, kv_heads, head_dim, dtype), get_codec(codec)
    cls.for_tokens(max_len, codec=codec, **fields)  # invalid fields raise here, with their own message
    memo: dict[int, tuple[Policy, int] | None] = {}

    def at(n: int) -> tuple[Policy, int] | None:  # (policy, stored bytes), None if n is too small to build
        if n not in memo:
            try:
                pol = cls.for_tokens(n, codec=codec, **fields)
            except ValueError:
                memo[n] = None
            else:
                memo[n] = (pol, dims.stored(pol))
        return memo[n]

    lo = _first_true(1, max_len, lambda n: at(n) is not None)
    smallest, least = at(lo)
    if least > nbytes:
        raise BudgetTooSmall(f"budget of {nbytes} bytes is too small for {name}: its smallest sizing "
                         f"({smallest.capacity(max_len)} slots) stores {least} bytes")
    n = _last_true(lo, max_len, lambda m: at(m)[1] <= nbytes)
    n = _first_true(lo, n, lambda m: at(m)[1] >= at(n)[1])
    return at(n)[0]


def sized(name: str, budget: int | float, /, *, max_len: int, kv_heads: int, head_dim: int, dtype,
          codec="none", **fields) -> Policy:
    """The policy `name` sized to `budget` (an int: tokens per layer and kv head at full
    precision; a float in (0, 1]: the fraction of the full cache's bytes at max_len), with
    `codec` and any other `fields` (not the budget field: ValueError, a conflicting size).
    Its stored bytes per layer, everything included, are at most `target_bytes(budget, ...)`
    and within one slot of it. E.g. sized("sink", 0.25, max_len=4096, kv_heads=3, head_dim=64,
    dtype="bfloat16") is Sink(n_sink=4, window=1020).
    """
    _sizable(name, fields, f"budget={budget!r}")
    nbytes = target_bytes(budget, max_len=max_len, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    return sized_bytes(name, nbytes, max_len=max_len, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                       codec=codec, **fields)


def sized_stack(name: str, budget: int | float, n_layers: int, /, *, schedule: str = "uniform", beta: float = 20.0,
                max_len: int, kv_heads: int, head_dim: int, dtype, codec="none", **fields) -> tuple[Policy, ...]:
    """One policy per layer whose summed stored bytes are at most n_layers x the per-layer budget.

    "uniform": every layer is `sized(name, budget, ...)` (one scanned run; within one slot per
    layer of the total). "pyramid": PyramidKV's arithmetic schedule (`pyramid_budgets`) over
    the budget field, every other field (h2o's recent, snapkv's observation window and decode
    slots, sink's sinks) as the uniform sizing sets it, in every layer, as PyramidKV keeps
    its observation window in every layer; the schedule's total S is the largest (from the
    uniform total up to n_layers x max_len) whose stack fits, so the stack stores at least
    what the uniform one does and, below max_len, within one slot of the total. ValueError
    as `sized`, and when the schedule's top layers round below the budget field's minimum
    (lower beta or raise the budget).
    """
    check_int("budgets", "n_layers", n_layers, 1)
    check_choice("budgets", "schedule", schedule, ("uniform", "pyramid"))
    base = sized(name, budget, max_len=max_len, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype, codec=codec,
                 **fields)
    if schedule == "uniform":
        return (base,) * n_layers
    dims = _dims(max_len, kv_heads, head_dim, dtype)
    total = n_layers * target_bytes(budget, max_len=max_len, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    field = base.budget_field
    memo: dict[Policy, int] = {}

    def stack(s: int) -> tuple[Policy, ...]:
        return tuple(dataclasses.replace(base, **{field: b}) for b in pyramid_budgets(s, n_layers, beta))

    def fits(s: int) -> bool:
        try:
            pols = stack(s)
        except ValueError:
            return False
        return sum(memo.setdefault(p, dims.stored(p)) for p in pols) <= total

    s0 = getattr(base, field) * n_layers
    if not fits(s0):
        try:
            stack(s0)
        except ValueError as e:
            raise ValueError(f"pyramid(beta={beta}) of {name} at budget={budget!r}: {e} (lower beta or raise "
                             f"the budget)") from None
        raise ValueError(f"pyramid(beta={beta}) of {name} at budget={budget!r} does not fit the uniform total")
    return stack(_last_true(s0, max(s0, n_layers * max_len), fits))


def budget_table(budget: int | float, *, max_len: int, kv_heads: int, head_dim: int, dtype,
                 codecs=("none",)) -> list[dict]:
    """One row per registered policy and codec: what `sized` keeps under `budget`."""
    from kvpolicies import POLICIES

    nbytes = target_bytes(budget, max_len=max_len, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype)
    dims = _dims(max_len, kv_heads, head_dim, dtype)
    rows = []
    for codec in codecs:
        for name, cls in POLICIES.items():
            row = dict(policy=name, codec=codec, target=nbytes)
            if not issubclass(cls, Budgeted):
                rows.append(dict(row, fields="not sized", slots=None, bytes=None))
                continue
            pol = sized(name, budget, max_len=max_len, kv_heads=kv_heads, head_dim=head_dim, dtype=dtype,
                        codec=codec)
            shown = {f.name: getattr(pol, f.name) for f in dataclasses.fields(pol)
                     if f.name != "codec" and isinstance(getattr(pol, f.name), int)}
            rows.append(dict(row, fields=" ".join(f"{k}={v}" for k, v in shown.items()),
                             slots=pol.capacity(max_len), bytes=dims.stored(pol)))
    return rows


def main(argv=None) -> None:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m kvpolicies.budgets",
                                 description="What every registered policy keeps under one byte budget.")
    ap.add_argument("--budget", default="0.25", help="int: tokens per layer and kv head; float in (0, 1]: of full")
    ap.add_argument("--max-len", type=int, default=4096)
    ap.add_argument("--kv-heads", type=int, default=3)  # SmolLM2-135M
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--codecs", nargs="+", default=["none", "int4"])
    a = ap.parse_args(argv)
    budget = float(a.budget) if any(c in a.budget for c in ".eE") else int(a.budget)
    rows = budget_table(budget, max_len=a.max_len, kv_heads=a.kv_heads, head_dim=a.head_dim, dtype=a.dtype,
                        codecs=a.codecs)
    print(f"budget={budget!r}: {rows[0]['target']:,} bytes per layer (kv_heads={a.kv_heads}, "
          f"head_dim={a.head_dim}, {a.dtype}, max_len={a.max_len}, batch 1)\n")
    print("| policy | codec | sized fields | slots | stored bytes | of budget |\n|---|---|---|---:|---:|---:|")
    for r in rows:
        if r["slots"] is not None:
            print(f"| {r['policy']} | {r['codec']} | {r['fields']} | {r['slots']:,} | {r['bytes']:,} | "
                  f"{r['bytes'] / r['target']:.4f} |")
    unsized = sorted({r["policy"] for r in rows if r["slots"] is None})
    print(f"\nnot sized (no token budget): {', '.join(unsized)}")


if __name__ == "__main__":
    main()


def context_kept(policy: Policy, n: int) -> int:
    """Context tokens per kv head (on average, for head pools) a policy holds after an n-token
    prompt: a prompt compressor's `kept_for(n)` (ratio) or budget (window included), a streaming
    policy's slots, at most n."""
    if getattr(policy, "ratio", 0):
        return min(policy.kept_for(n), n)
    if hasattr(policy, "kept"):  # PromptScored: budget (+ snapkv's window)
        return min(policy.kept(), n)
    if budget_field_of(policy) == "budget" and hasattr(policy, "max_new"):  # adakv, kvzip
        return min(policy.capacity(n + policy.max_new) - policy.max_new, n)
    return min(policy.capacity(n), n)
