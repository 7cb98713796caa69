"""`kvpolicies.attend`: one attention step through a cache policy. The code lives in the
package `kvpolicies.attention` (docs/design/attention.md); this module keeps the names it always
exported importable from here.

The policy decides which slots exist and how they are seen (`extend` returns a `View`: slots,
positions, RoPE positions, its own visibility mask and logit bias), optionally narrows each
query's slots (`select`), and folds the step into its state (`compact`). Attention applies
causality and empty-slot masking, RoPE and the softmax. Prefill and decode are the same call
with T >= 1; for a policy that evicts after every token (`per_token`), a chunk is a scan of
T single-token steps, so the chunk size never changes its result. Pure JAX: any Flax (NNX or
linen) or plain-JAX model can call it.
"""

from __future__ import annotations

from kvpolicies.attention import Block, Gather, Tuning, attend, attend_step, causal, record_visible, recording
from kvpolicies.attention.tuning import DEFAULT
from kvpolicies.base import Deferred, Policy, Seen, SlotState, View, check_codec
from kvpolicies.slots import take_slots, write_deferred

__all__ = ["DEFAULT", "Block", "Deferred", "Gather", "Policy", "Seen", "SlotState", "Tuning", "View", "attend",
           "attend_step", "causal", "check_codec", "record_visible", "recording", "take_slots", "write_deferred"]
