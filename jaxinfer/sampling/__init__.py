"""Token sampling on the device: pure, model-free and jit-friendly.

Every sampling parameter is a per-row array (`SamplingArrays`, shape [B]), so
changing a request's parameters never recompiles, and every row is computed
from its own logits, parameters and key only: a row's token does not depend
on the other rows or on its position in the batch.

Order of operations, matching Hugging Face `generate` and vLLM:

    logits (any float dtype) -> float32
      -> penalties.apply_penalties (repetition, presence, frequency)
      -> greedy rows (temperature == 0, or top_k == 1): argmax
      -> sampled rows: / temperature -> top-k -> top-p -> min-p (filters.keep_mask)
         -> draw from the renormalised kept probabilities (draw.inverse_cdf)

Modules: `arrays` (per-row parameters and PRNG keys), `penalties`, `filters`
(the threshold filters and their tie rules), `draw` (greedy and sampled
draws, the processed distribution, log-probs), `rows` (the per-row state
and the per-token pipeline every step and speculative acceptance run). `SamplingParams`, the
host-side settings, lives in `jaxinfer.config` and is re-exported here.
"""

from jaxinfer.config.sampling import MAX_SEED, TEMPERATURE_FLOOR, SamplingParams, resolve_seeds
from jaxinfer.sampling.arrays import SamplingArrays, row_keys, stack_params, step_keys, to_device
from jaxinfer.sampling.draw import (argmax_first, distribution, inverse_cdf, log_softmax_topn,
                                    sample)
from jaxinfer.sampling.filters import CANDIDATES, keep_mask
from jaxinfer.sampling.penalties import apply_penalties, init_history, update_history

__all__ = ["CANDIDATES", "MAX_SEED", "TEMPERATURE_FLOOR", "SamplingArrays", "SamplingParams",
           "apply_penalties", "argmax_first", "distribution", "init_history", "inverse_cdf",
           "keep_mask", "log_softmax_topn", "resolve_seeds", "row_keys", "sample", "stack_params",
           "step_keys", "to_device", "update_history"]
