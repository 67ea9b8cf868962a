"""The compiled phases: pure functions over a KV cache and per-row state.

  `step`     the serving step: one ragged forward over a token budget on the
             paged cache (decoding rows, speculative blocks and prompt chunks
             together), sampling in the same program; `decode_loop` scans it
  `draft`    the draft-model proposer inside the step
  `ragged`   ragged attention over pages, and the attention backend (XLA or
             the C++ kernels) chosen once per loaded model
  `forward`  the one model forward (RoPE, embed, layers, logits) and
             `paged_forward`, which the step and the phases run
  `phases`   the library's extend / prefill / decode_step / token_logprobs
             on a dense cache (one slot of pages per row), one segment a row
  `differentiable`  token_logprobs / logits: that forward as a pure function of
             the params, jax.grad-able, for a trainer (no cache in or out)
"""
