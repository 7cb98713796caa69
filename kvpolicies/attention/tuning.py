"""How attention runs a step (never what it computes): a frozen, hashable config passed to the
step, so a jitted step that takes it as a static argument (or closes over a model config that
holds it) compiles once per setting; nothing here is read from a module global at trace time."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class Tuning:
    """block: a chunk (T > 1) over more than `block` slots attends in blocks of `block` slots with
    an online softmax, and a chunk of more than `block` tokens in query tiles of `block`
    (docs/design/attention.md). skip_blocks: decide for all blocks at once which are skipped, read
    whole or masked (False: every block masked, every RoPE segment computed). flat_rows: a block's
    softmax over [(B K G tq), s] rows (False: over [B, K, G, tq, s]). Every setting gives the same
    numbers up to the order of the softmax's sums; the defaults are the fastest measured on CPU.
    checked: inside a jit, a query at a position the state cannot take gets NaN outputs
    (`kvpolicies.limits.poison`); False computes it from the step's view as any other (kvzip's
    reconstruction pass runs every other layer past its capacity, its writes discarded)."""

    block: int = 512
    skip_blocks: bool = True
    flat_rows: bool = True
    checked: bool = True

    def __post_init__(self):
        if not isinstance(self.block, int) or isinstance(self.block, bool) or self.block < 1:
            raise ValueError(f"Tuning.block={self.block!r}: must be an int >= 1")


DEFAULT = Tuning()
