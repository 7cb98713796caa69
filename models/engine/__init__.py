"""Jitted prefill/decode steps, greedy generation and streaming log-likelihood through a policy.

Shapes: B batch, T tokens in a step, C chunk length, V vocab, n generated tokens.

A prompt can also be run in stages, for protocols that compress a context before the question
is known (`Prompted`, a functional state: a fork is the same value used twice):
    s = engine.prompt(context)            # one prefill, through the policies' prompt phase
    s = engine.compress(s)                # after_prompt (a prompt compressor compresses here)
    ids = engine.continue_generate(s, question, n)   # question through the decode policies
`engine.extend_prompt(s, question)` instead keeps the question in the prompt phase (query-aware
compression after a shared context prefill). Every method that takes a `Prompted` leaves it
usable (the donated buffers are copies), so N questions can fork one state. Another engine
whose prompt phase stores the same state (`shares_prompt`: e.g. snapkv at any budget, and
`full`) can `compress` it: one dense prefill serves several prompt compressors. Counters:
`prefills` (fresh prompts prefilled), `prefill_tokens`, `prompts_compressed`, `prefills_shared`
(states prefilled by another engine and compressed here; `evals.prefills` keeps the count).

The model is split once into (graphdef, params); every step is a pure jitted function of
(params, cache, tokens, pos) with the cache donated, so the compiled step is reused for every
step of the same shape. `traces` counts how often each step kind was traced (compiled).

Generation (`generate`, `continue_generate`) decodes layer by layer by default
(`decode_loop="layers"`, `_decode_layers`): per step one jitted call per layer over that layer's
own weight and state arrays (`layer_weights`: one copy of the layer weights per model), then one
call writing every layer's new slots. On XLA:CPU that reads weights and keys/values in place,
where the layer scan materialises each layer's slices; `decode_loop="scan"` (and any engine on a
mesh) runs the fused `lax.scan` instead. `step`, `prefill` and `score` always use the scan.

Length buckets: where a policy stores token i in slot i (`kvpolicies.slots.PrefixSlots`: full), a step
whose positions all lie below n needs only the cache's first n slots. Each step is given the
smallest bucket of 1024 x 2^k x {1, 1.25, 1.5, 1.75} slots (decode) or 1024 x 2^k x {1, 1.5}
(chunks) that holds its positions (`reach_of`; static, so one trace per bucket reached), and
reads and writes only those slots: a 1K context in a 16K-slot cache costs a 1,280-slot step, and
a long prompt's chunks attend over the filled part, not max_len. An engine of at most 1,024
slots, or without such a policy, has one bucket.

Every public method checks its arguments on the host, with numpy, before anything is traced:
token ids must be whole numbers in [0, vocab) (an integer array, or a float array whose values are
all whole numbers), batches rectangular, counts and chunk sizes ints in range, and the sequence
within `max_len`; each violation is one ValueError naming the argument, the bad value and where.

A cache knows where it ends and which engine made it (`extent`: `EngineCache`, what `init_cache`,
`prefill`, `step` and `score(return_cache=True)` return, and `Prompted` carry the next position
and the engine's `Maker`): every entry point continues a state at its end, and refuses one another
engine made (another policy, max_len or model) with one error, on the host.

The package, by job: `checks` (argument checks), `extent` (a cache's length and maker), `steps` (the jitted steps, length buckets,
kvzip's pass), `layers` (layer-by-layer decoding and a fitted engine's feeds), `staged` (`Prompted`: prompt, compress, forks),
`generation` (prefill, generate, score), `core` (`Engine`, which joins them).
"""

from models.engine.checks import MAX_LEN, check_policies, check_token_ids
from models.engine.core import Engine, grid_slots
from models.engine.extent import EngineCache, Maker
from models.engine.generation import perplexity
from models.engine.staged import Prompted
from models.engine.layers import layer_weights, split_layers
from models.engine.steps import REACH_MIN, reach_of

__all__ = ["MAX_LEN", "REACH_MIN", "Engine", "EngineCache", "Maker", "grid_slots", "Prompted", "check_policies", "check_token_ids", "layer_weights",
           "perplexity", "reach_of", "split_layers"]
