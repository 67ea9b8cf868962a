"""Live weights and sleep of a loaded `LLM` (its `update_weights`, `sleep`,
`wake_up` and `reset_prefix_cache` call these), across every engine built
from it: the runners and schedulers it registered (`LLM.runner`,
`LLM.scheduler`), paused together through its `serving.control.Controls`.
What each keeps, frees and refuses: docs/research.md.
"""

from __future__ import annotations

import gc

import jax

from jaxinfer.serving import update as weights_update
from jaxinfer.serving.control import clear_prefix_cache, return_freed_memory


def update_weights(llm, params) -> None:
    """Serve new weights from memory: no reload, no new compile.

    Args:
      llm: the `LLM`.
      params: the layout the model was loaded from (`serving.update`):
        Hugging Face-named tensors (a safetensors or GGUF model), the
        `checkpoint.convert` params tree (stacked layers), a brought
        family's own params, or prepared params; numpy or jax arrays.
        They are cast to the model's dtype and prepared as loading
        prepares them (fused, packed, quantized to `llm.weights_format`).
        The arrays given are not kept (copies are), so the caller may
        change or donate them afterwards.
    Requests in flight finish on the old weights first (an internal
    `pause("wait")`, unless the LLM is paused already); then, paused, the
    old weights are dropped part by part as the new ones are prepared (a
    layer, the final norm, the embedding and head: each old part is freed
    before its new one is made, unless something else refers to it, so
    about one part's extra copy is alive; `serving.update.plan_update`
    has the layouts prepared whole instead); the prefix cache is
    invalidated. Allowed while asleep (after `sleep(level=2)` it is the
    way back to serving).

    Raises:
      ValueError: a tree, shape or dtype that does not match the serving
        params, naming the first bad leaf; nothing has changed.
      RuntimeError: preparing failed after the old weights were dropped
        (e.g. out of memory); the LLM then has no weights until an
        `update_weights` succeeds, as after `sleep(level=2)`.
    """
    with llm._admin:
        if llm.params is not None:      # (placed after construction: `parallel.load_llm`)
            llm._params_shape = weights_update.abstract(llm.params)
        # A tensor-parallel LLM lays params out per shard as loading does (its
        # `prepare_update`, set by `parallel.sharding.tensor_parallel_llm`).
        config = getattr(llm, "base_config", llm.config)
        swap = weights_update.plan_update(
            params, config, llm._params_shape, dtype=llm.cache_dtype,
            weights=llm.weights_format, activations=llm.activations,
            prepare=llm.prepare_update)
        with llm.controls.paused_for("update_weights"):
            # Only `box` refers to the old params now, so `swap` can free them part by part.
            box = [] if llm.params is None else [llm.params]
            llm.params = None
            for runner in list(llm._runners):
                runner.params = None
            try:
                new = swap(box)
            except Exception as e:
                raise RuntimeError("update_weights: preparing the new weights failed after the "
                                   f"old ones were dropped ({e!r}); the LLM has no weights until "
                                   "an update_weights succeeds") from e
            llm.params = new
            for runner in list(llm._runners):
                runner.params = new
            _clear_prefix_caches(llm)
        jax.block_until_ready(new)


def reset_prefix_cache(llm) -> int:
    """Forget every cached prompt page of every engine of `llm` (after
    in-flight requests finish). Returns the cached pages freed."""
    with llm._admin, llm.controls.paused_for("reset_prefix_cache"):
        return _clear_prefix_caches(llm)


def _clear_prefix_caches(llm) -> int:
    return sum(clear_prefix_cache(s.kv_pages) for s in list(llm._schedulers))


def sleep(llm, level: int = 1) -> None:
    """Free device memory while the LLM is not used (e.g. while a trainer
    runs): level 1 deletes the KV pools (their device arrays) and keeps
    the weights; level 2 also drops the weights (`update_weights` brings
    new ones back). Requests in flight finish first; the LLM stays
    paused until `wake_up`, and generating meanwhile raises RuntimeError.
    Compiled programs are kept. A second call with a higher level drops
    the weights too.

    Raises:
      ValueError: level not 1 or 2.
    """
    if level not in (1, 2):
        raise ValueError(f"sleep level must be 1 or 2, got {level!r}")
    with llm._admin:
        if not llm.controls.paused:
            llm.controls.pause("wait")
            llm._paused_by_sleep = True
        if not llm.controls.sleep_level:
            llm.controls.interrupt()        # a stream read later aborts: its pages are gone
            _clear_prefix_caches(llm)
            llm._scheduler = None           # the offline one is rebuilt on waking
            gc.collect()                    # its runner leaves the registry now
            for runner in list(llm._runners):
                runner.free_cache()
        if level == 2:
            llm.params = None
            for runner in list(llm._runners):
                runner.params = None
            gc.collect()
        return_freed_memory()
        llm.controls.sleep_level = max(level, llm.controls.sleep_level)


def wake_up(llm) -> None:
    """Allocate the KV pools `sleep` freed again (the same shapes: nothing
    compiles) and resume serving; after `sleep(level=2)` generating also
    needs `update_weights`. A no-op when awake."""
    with llm._admin:
        if not llm.controls.sleep_level:
            return
        for runner in list(llm._runners):
            runner.reset()
        llm.controls.sleep_level = 0
        if llm._paused_by_sleep:
            llm._paused_by_sleep = False
            llm.controls.resume()
