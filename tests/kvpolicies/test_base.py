"""The protocol is what it says: `Policy` defines the core steps only, and every other member a
policy may have is a capability class beside the code that uses it, asked through a function that
gives the default to a policy without it."""

from __future__ import annotations

import inspect

import jax
import jax.numpy as jnp
import pytest

import kvpolicies
from kvpolicies.base import Policy, reads_values
from kvpolicies.budgets import Budgeted, budget_field_of
from kvpolicies.memory import decode_reads, meta_fields, tree_nbytes
from kvpolicies.presets import Preset, stack_of
from kvpolicies.prompt import PromptCompressor, after_prompt, prompt_policy_of, reconstructs
from kvpolicies.slots import PrefixSlots, has_prefix_slots

CORE = {"capacity", "init", "extend", "select", "compact", "defer"}


def own_members(cls: type) -> set[str]:
    """The public methods and properties a class defines itself (class attributes that are data,
    ClassVars and dataclass field defaults, are not members here)."""
    return {n for n, x in vars(cls).items() if not n.startswith("_")
            and (inspect.isfunction(x) or isinstance(x, (property, classmethod, staticmethod)))}


def test_policy_defines_the_core_protocol_only():
    assert own_members(Policy) == CORE
    assert len(own_members(Policy)) <= 6


# registry name -> (budget field, prompt compressor, reconstructs, prefix slots, preset, own decode_reads)
CAPABILITIES = {
    "full": (None, False, False, True, False, False),
    "window": ("window", False, False, False, False, False),
    "sink": ("window", False, False, False, False, False),
    "multires": (None, False, False, False, False, False),
    "quest": (None, True, False, False, True, True),
    "h2o": ("heavy", True, False, False, False, False),
    "tova": ("budget", True, False, False, False, False),
    "snapkv": ("budget", True, False, False, False, False),
    "finch": ("budget", True, False, False, False, False),
    "cur": ("budget", True, False, False, False, False),
    "compactor": ("budget", True, False, False, False, False),
    "pyramidkv": ("budget", True, False, False, True, False),
    "knorm": ("budget", True, False, False, True, False),
    "random": ("budget", True, False, False, False, False),
    "keydiff": ("budget", True, False, False, False, False),
    "simlayerkv": ("budget", True, False, False, False, False),
    "cap": ("budget", True, False, False, False, False),
    "think": (None, True, False, False, False, False),
    "qfilter": ("budget", True, False, False, True, False),
    "lagkv": ("budget", True, False, False, False, False),
    "observed": ("budget", True, False, False, False, False),
    "expected": ("budget", True, False, False, False, False),
    "adakv": ("budget", True, False, False, False, False),
    "critical": ("budget", True, False, False, False, False),
    "kvzip": ("budget", True, True, False, False, False),
    "kvgrad": ("budget", True, True, False, False, False),
    "kvzap": ("budget", True, False, False, False, False),
    "kvcompose": ("budget", True, True, False, False, False),
    "duo": (None, True, False, False, True, True),
    "kivi": (None, True, False, False, False, False),
    "paged": (None, False, False, False, False, True),
}


def test_every_registered_policy_declares_its_capabilities():
    assert set(CAPABILITIES) == set(kvpolicies.POLICIES)
    for name, cls in kvpolicies.POLICIES.items():
        got = (budget_field_of(cls), issubclass(cls, PromptCompressor), reconstructs(cls.__new__(cls)),
               issubclass(cls, PrefixSlots), issubclass(cls, Preset), hasattr(cls, "decode_reads"))
        assert got == CAPABILITIES[name], name


def test_a_policy_without_a_capability_gets_the_default():
    """Streaming defaults: its own prompt phase, the state unchanged after the prompt, itself in
    every layer, every filled slot read, no budget, no length buckets."""
    pol = kvpolicies.get("window", window=8)
    st = pol.init(1, 2, 8, jnp.float32, 32)
    assert prompt_policy_of(pol) is pol and after_prompt(pol, st) is st
    assert stack_of(pol, 3) == (pol,) * 3 and not reconstructs(pol) and not has_prefix_slots(pol)
    assert budget_field_of(kvpolicies.Full) is None and budget_field_of(pol) == "window"
    shape = jax.eval_shape(lambda: pol.init(1, 2, 8, jnp.float32, 32))
    kv, meta = tree_nbytes((shape.k, shape.v)), tree_nbytes(meta_fields(shape))
    assert decode_reads(pol, shape, 3) == (kv * 4 // 8, meta * 4 // 8)  # 4 of the 8 slots filled
    assert decode_reads(pol, shape, 100) == (kv, meta)


def test_a_capability_is_asked_through_its_function():
    quest = kvpolicies.get("quest", page=4, top_k=2)
    assert prompt_policy_of(quest) == quest.prompt_policy() != quest
    assert stack_of(quest, 4) == quest.stack(4) and type(stack_of(quest, 4)[0]) is kvpolicies.Full
    assert reconstructs(kvpolicies.get("kvzip")) and has_prefix_slots(kvpolicies.get("full"))
    assert has_prefix_slots(prompt_policy_of(kvpolicies.get("snapkv")))  # the dense prompt phase
    # the values and the layer's output projection, handed by the model (critical's prompt phase only)
    assert reads_values(prompt_policy_of(kvpolicies.get("critical"))) and not reads_values(kvpolicies.get("critical"))
    assert not reads_values(prompt_policy_of(kvpolicies.get("snapkv")))
    assert issubclass(kvpolicies.SnapKV, Budgeted) and kvpolicies.SnapKV.for_tokens(40).budget == 8
    shape = jax.eval_shape(lambda: quest.init(1, 2, 8, jnp.float32, 64))
    assert decode_reads(quest, shape, 63) == quest.decode_reads(shape, 63)


def test_without_a_budget_there_is_no_for_tokens():
    with pytest.raises(AttributeError):
        kvpolicies.Full.for_tokens(8)
