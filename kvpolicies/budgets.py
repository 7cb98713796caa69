"""Token budgets: from a ratio of the prompt, and split across layers (uniform or PyramidKV).

A policy's budget is a number of tokens fixed at construction (so its state has a fixed shape
and one compiled step serves every step). Each budgeted policy declares one *budget field*
(`Policy.budget_field`): the tokens its eviction rule chooses; anything it always keeps on top
(h2o's `recent` window, snapkv's observation window and decode slots, sink's sinks) is a
separate field, kept the same in every layer, as PyramidKV keeps its observation window in
every layer. Today: h2o heavy, tova budget, snapkv budget, window window, sink window.

Per-layer budgets return a tuple of policies, one per layer, for `Llama`/`Engine`
(consecutive equal policies share one scanned run); their memory is
`kvpolicies.memory.stack_bytes(policies, ...)`.
"""

from __future__ import annotations

import math

from kvpolicies.base import Policy, check_int

def budgeted() -> dict[str, type[Policy]]:
    """Registered policies that declare a budget field."""
    from kvpolicies import POLICIES  # the registry imports this package's policies

    return {n: cls for n, cls in POLICIES.items() if cls.budget_field is not None}


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
    """One policy per layer with PyramidKV budgets (`pyramid_budgets`): more tokens in lower
    layers, fewer in upper ones, the same total budget as `uniform`. Other fields (`kw`,
    e.g. snapkv's obs_window) are the same in every layer. A policy whose budget field must
    be >= 1 (tova, window) raises ValueError if the top layers round to 0: lower beta."""
    return tuple(_build(name, b, codec, kw) for b in pyramid_budgets(total_tokens, n_layers, beta))
