"""One budget for every policy (kvpolicies.budgets.sized / sized_stack), against closed forms.

The expected numbers are recomputed here from the storage layout, not read from the library:
bytes per slot = 2 x kv_heads x (bytes of one head's key or value under the codec) + metadata
(int32 positions, shared by the kv heads or one per head, and h2o/snapkv's float32 accumulated
attention per head). Every budgeted policy stores slots x that, nothing else, so the sized
policy must hold min(floor(target / slot bytes), max_len) slots whatever its structure.
"""

from __future__ import annotations

import dataclasses

import pytest

import kvpolicies
from kvpolicies.budgets import BudgetTooSmall, budget_field_of, main, pyramid_budgets, sized, sized_bytes, sized_stack, target_bytes
from kvpolicies.memory import state_bytes

K, D, MAX_LEN = 2, 64, 8192
DTYPES = {"bfloat16": 2, "float32": 4}
CODECS = ("none", "int8", "int4")
BUDGETS = (600, 0.05)  # an int (tokens) and a float (fraction of full); snapkv needs >= 32 + 256 slots
BUDGETED = sorted(n for n, c in kvpolicies.POLICIES.items() if budget_field_of(c) is not None)
UNSIZED = sorted(set(kvpolicies.POLICIES) - set(BUDGETED))

# metadata bytes per slot: int32 positions shared by the kv heads (1) or per head (K), plus a
# float32 accumulated attention per head for the policies that accumulate
META_PER_SLOT = {"window": 4, "sink": 4, "tova": 4, "h2o": 4 * K + 4 * K, "snapkv": 4 * K + 4 * K}
META_PER_SLOT |= {"adakv": 8 * K, "kvzip": 8 * K, "kvgrad": 8 * K, "kvzap": 8 * K, "pyramidkv": 8 * K, "observed": 8 * K, "knorm": 4 * K, "random": 4 * K, "expected": 4 * K}
META_PER_SLOT |= {"qfilter": 4 * K}
META_PER_SLOT |= {"keydiff": 4 * K, "lagkv": 4 * K, "finch": 8 * K, "cur": 4 * K, "compactor": 8 * K}
META_PER_SLOT |= {"simlayerkv": 4 * K, "cap": 4 * K}
META_PER_SLOT |= {"kvcompose": 8 * K}  # a position and a float32 mass per slot and head
META_PER_SLOT |= {"critical": 8 * K}  # its default inner press, snapkv: a float32 mass per slot and head
# bytes stored once per layer, not per slot: expected's running query sums (D + D^2 float32 per kv head, a count)
FIXED = {"expected": 4 * (K * (D + D * D) + 1)}
FIXED |= {"cap": 4 * (K * D + 1)}  # cap's running query sum (D float32 per kv head) and count


def head_bytes(codec: str, itemsize: int) -> int:
    """Bytes of one token's key (or value) in one kv head, float32 scales."""
    return {"none": D * itemsize, "int8": D + 4, "int4": D // 2 + (D // 32) * 4}[codec]


def slot_bytes(name: str, codec: str, itemsize: int) -> int:
    return 2 * K * head_bytes(codec, itemsize) + META_PER_SLOT[name]


def target(budget, itemsize: int) -> int:
    """Independent: full's slot is 2 K D itemsize + one shared int32 position."""
    full_slot = 2 * K * D * itemsize + 4
    return budget * full_slot if isinstance(budget, int) else int(budget * MAX_LEN * full_slot)


def stored(pol, dtype) -> int:
    return state_bytes(pol, kv_heads=K, head_dim=D, max_len=MAX_LEN, dtype=dtype).total


def size(name, budget, dtype="bfloat16", codec="none", **kw):
    return sized(name, budget, max_len=MAX_LEN, kv_heads=K, head_dim=D, dtype=dtype, codec=codec, **kw)


def test_closed_forms_cover_every_budgeted_policy():
    assert set(META_PER_SLOT) == set(BUDGETED), "give a new budgeted policy its metadata per slot here"
    assert UNSIZED and "full" in UNSIZED


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("budget", BUDGETS)
def test_target_bytes_is_full_precision_tokens_or_a_fraction_of_full(budget, dtype):
    assert target_bytes(budget, max_len=MAX_LEN, kv_heads=K, head_dim=D, dtype=dtype) == target(budget, DTYPES[dtype])
    full = stored(kvpolicies.get("full"), dtype)
    assert target_bytes(1.0, max_len=MAX_LEN, kv_heads=K, head_dim=D, dtype=dtype) == full == target(MAX_LEN, DTYPES[dtype])


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("budget", BUDGETS)
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("name", BUDGETED)
def test_sized_policy_fills_the_budget_to_one_slot(name, codec, budget, dtype):
    pol = size(name, budget, dtype, codec)
    tgt, per = target(budget, DTYPES[dtype]), slot_bytes(name, codec, DTYPES[dtype])
    slots, fixed = pol.capacity(MAX_LEN), FIXED.get(name, 0)
    assert slots == min((tgt - fixed) // per, MAX_LEN)  # the most slots the budget pays for
    got = stored(pol, dtype)
    assert slots < MAX_LEN  # (the budgets here are below the cap; see test_a_budget_above_the_cache)
    assert got == slots * per + fixed  # everything stored is counted, by the closed form
    assert got <= tgt and tgt - got < per
    # one more token (the budget field + 1) no longer fits
    more = dataclasses.replace(pol, **{pol.budget_field: getattr(pol, pol.budget_field) + 1})
    assert more.capacity(MAX_LEN) == slots + 1 and stored(more, dtype) > tgt
    assert pol.codec == kvpolicies.get_codec(codec)


@pytest.mark.parametrize("budget", BUDGETS + (100, 0.2))
@pytest.mark.parametrize("codec", CODECS)
def test_every_policy_holds_the_same_bytes(codec, budget):
    tgt = target(budget, 2)
    got = {}
    for name in BUDGETED:
        try:
            got[name] = stored(size(name, budget, codec=codec), "bfloat16")
        except ValueError as e:  # the prompt compressors' decode slots (max_new=256) do not fit 100 tokens
            assert budget == 100 and "max_new" in {f.name for f in dataclasses.fields(kvpolicies.POLICIES[name])}
            assert isinstance(e, BudgetTooSmall) and "too small" in str(e)  # not a bad field: evals.compare leaves it out
    widest = max(slot_bytes(n, codec, 2) for n in BUDGETED)
    assert all(b <= tgt for b in got.values())
    assert max(got.values()) - min(got.values()) < widest and tgt - min(got.values()) < widest


def test_known_sizes_bf16():
    """Hand-computed: bf16 K=2 D=64, full slot 2*2*128 + 4 = 516 bytes; 600 tokens = 309,600."""
    assert size("window", 600).window == 600  # window, sink, tova: 516 bytes a slot, as full
    assert size("sink", 600) == kvpolicies.get("sink", n_sink=4, window=596)
    assert size("tova", 600).budget == 600
    # h2o, snapkv: 512 + 2*4 (positions per head) + 2*4 (scores) = 528 bytes a slot: 586 slots
    assert size("h2o", 600) == kvpolicies.get("h2o", heavy=293, recent=293)
    assert size("snapkv", 600) == kvpolicies.get("snapkv", budget=586 - 32 - 256)
    # a float budget of 1.0 is the full cache: window holds every token
    assert size("window", 1.0).window == MAX_LEN
    # fields that are not the budget's are kept and the budget field takes what is left
    assert size("sink", 600, n_sink=8) == kvpolicies.get("sink", n_sink=8, window=592)
    assert size("h2o", 600, recent=64) == kvpolicies.get("h2o", heavy=586 - 64, recent=64)
    assert size("snapkv", 600, max_new=16) == kvpolicies.get("snapkv", budget=586 - 32 - 16, max_new=16)


@pytest.mark.parametrize("name", BUDGETED)
def test_a_budget_above_the_cache(name):
    """A budget that pays for more than max_len slots: every policy holds max_len slots (as much as
    full), through the smallest budget field that reaches them."""
    for budget, codec in [(0.5, "int4"), (3 * MAX_LEN, "none")]:
        pol = size(name, budget, codec=codec)
        assert pol.capacity(MAX_LEN) == MAX_LEN
        assert stored(pol, "bfloat16") == MAX_LEN * slot_bytes(name, codec, 2) + FIXED.get(name, 0) <= target(budget, 2)
        less = getattr(pol, pol.budget_field) - 1
        assert dataclasses.replace(pol, **{pol.budget_field: less}).capacity(MAX_LEN) == MAX_LEN - 1


@pytest.mark.parametrize("head_dim", [64, 128])
def test_int4_at_the_same_bytes_keeps_about_three_times_the_tokens(head_dim):
    kw = dict(max_len=1 << 16, kv_heads=K, head_dim=head_dim, dtype="bfloat16")
    plain = sized("window", 0.25, **kw).window
    int4 = sized("window", 0.25, codec="int4", **kw).window
    int8 = sized("window", 0.25, codec="int8", **kw).window
    assert plain == 1 << 14 and int4 >= 2.5 * plain and 1.8 * plain <= int8 < int4


@pytest.mark.parametrize("name", UNSIZED)
def test_policies_without_a_budget_cannot_be_sized(name):
    with pytest.raises(ValueError, match="cannot be sized"):
        size(name, 0.5)
    with pytest.raises(ValueError, match="cannot be sized"):
        sized_bytes(name, 10_000, max_len=MAX_LEN, kv_heads=K, head_dim=D, dtype="bfloat16")


@pytest.mark.parametrize("name", BUDGETED)
def test_a_conflicting_size_is_an_error(name):
    field = kvpolicies.POLICIES[name].budget_field
    with pytest.raises(ValueError, match=rf"{name}\.{field}=100 conflicts with budget=0.5"):
        sized(name, 0.5, max_len=MAX_LEN, kv_heads=K, head_dim=D, dtype="bfloat16", **{field: 100})


def test_bad_budgets_are_errors():
    for bad in (0, -3, 0.0, 1.5, True, "0.5"):
        with pytest.raises(ValueError, match="budget"):
            size("window", bad)
    with pytest.raises(ValueError, match="too small for snapkv"):
        size("snapkv", 100)  # 32 + 256 slots at least
    with pytest.raises(ValueError, match="too small for sink"):
        size("sink", 3)  # 4 sinks + 1 slot
    with pytest.raises(ValueError, match="no field"):
        size("sink", 0.5, widow=3)
    with pytest.raises(ValueError, match="h2o.recent"):
        size("h2o", 0.5, recent=-1)


@pytest.mark.parametrize("codec", ["none", "int4"])
@pytest.mark.parametrize("name", BUDGETED)
def test_stacks_keep_the_total(name, codec):
    L, beta, budget = 8, 4.0, 700
    tgt, per = target(budget, 2), slot_bytes(name, codec, 2)
    kw = dict(max_len=MAX_LEN, kv_heads=K, head_dim=D, dtype="bfloat16", codec=codec)
    if name == "kvzap":  # its budget must cover its 128-token window: the pyramid's top layer gets less
        kw["window"] = 16
    uni = sized_stack(name, budget, L, **kw)
    assert uni == (size(name, budget, codec=codec, **({"window": 16} if name == "kvzap" else {})),) * L
    pyr = sized_stack(name, budget, L, schedule="pyramid", beta=beta, **kw)
    field = pyr[0].budget_field
    got = [getattr(p, field) for p in pyr]
    s = sum(got)
    # PyramidKV's arithmetic schedule over the budget field; every other field as uniform's
    assert tuple(got) == pyramid_budgets(s, L, beta) and got[0] > got[-1]
    others = lambda p: {f.name: getattr(p, f.name) for f in dataclasses.fields(p) if f.name != field}  # noqa: E731
    assert all(others(p) == others(uni[0]) for p in pyr)
    # bytes: the closed form, within the total and within one slot of it
    total = sum(stored(p, "bfloat16") for p in pyr)
    assert total == sum(p.capacity(MAX_LEN) for p in pyr) * per + L * FIXED.get(name, 0)
    assert s >= getattr(uni[0], field) * L and total <= L * tgt and L * tgt - total < per


def test_pyramid_whose_top_layers_round_to_nothing_is_an_error():
    with pytest.raises(ValueError, match="lower beta"):
        sized_stack("window", 10, 30, schedule="pyramid", max_len=MAX_LEN, kv_heads=K, head_dim=D, dtype="bfloat16")
    with pytest.raises(ValueError, match="schedule"):
        sized_stack("window", 10, 3, schedule="cone", max_len=MAX_LEN, kv_heads=K, head_dim=D, dtype="bfloat16")


def test_the_readme_table_command(capsys):
    """docs/guide/budgets.md's table is `python -m kvpolicies.budgets --budget 0.25` (SmolLM2 dims, bf16, 4,096)."""
    main(["--budget", "0.25"])
    out = capsys.readouterr().out
    assert "budget=0.25: 790,528 bytes per layer" in out
    assert "| sink | none | n_sink=4 window=1020 | 1,024 | 790,528 | 1.0000 |" in out
    assert "| window | int4 | window=3239 | 3,239 | 790,316 | 0.9997 |" in out
    assert f"not sized (no token budget): {', '.join(UNSIZED)}" in out
