"""Attention through a cache policy, in rooms (docs/design/attention.md):

    step.py      `attend`: prepare the step (view, RoPE, parts, selection), pick a path, compact
    logits.py    what the paths share: `Step`, visibility, masked logits, softmax, `Seen` (`observe`)
    dense.py     the one-piece softmax
    blocked.py   the blocked online softmax (`Block`, `Layout`, `Tile`; top-level functions)
    gathered.py  the gathered path (`Gather`: a sparse decode read)
    record.py    the visibility recorder (`record_visible`)
    tuning.py    `Tuning`: how a step runs (static config, part of the compile key)
"""

from kvpolicies.attention.blocked import Block
from kvpolicies.attention.gathered import Gather
from kvpolicies.attention.logits import causal
from kvpolicies.attention.record import record_visible, recording
from kvpolicies.attention.step import attend, attend_step
from kvpolicies.attention.tuning import DEFAULT, Tuning

__all__ = ["DEFAULT", "Block", "Gather", "Tuning", "attend", "attend_step", "causal", "record_visible", "recording"]
