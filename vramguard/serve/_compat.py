"""The places the serving engine touches transformers' continuous batching beyond its public calls.

Tested with transformers 5.17 and 5.24: ``ContinuousBatchingConfig`` renamed ``block_size`` to ``page_size`` in 5.17
(5.17's field is ``block_size``); a block of 5.17's ``PagedAttentionCache`` holds one group of layers, not every layer
(:func:`blocks_per_pool_block`); and the manager's ``_generation_step`` / ``_generation_loop_body`` are the hooks
where a step's requests are known and where an exception inside a step can be caught before the engine's
``_handle_critical_error`` fails every request (what happens to it instead: :mod:`vramguard.serve.recovery`); and
``_create_batch_processor``, after which the batch processor's ``model_runner._sample(scores, output_ids)`` (the same
in 5.17 and 5.24) is the engine's own token choice (:mod:`vramguard.serve.sampler`).
"""

from __future__ import annotations

import dataclasses
from functools import lru_cache

from vramguard.runtime.device import is_oom
from vramguard.serve import recovery
from vramguard.serve.faults import device_fault


def cb_config(page_size: int, **kw):
    """A ``ContinuousBatchingConfig`` with the fields this transformers knows (``page_size`` or ``block_size``);
    a keyword this version has no field for is left out."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    size_field = "page_size" if "page_size" in names else "block_size"
    kw[size_field] = page_size
    return ContinuousBatchingConfig(**{k: v for k, v in kw.items() if k in names})


def blocks_per_pool_block(config) -> int:
    """How many of this transformers' KV blocks make one vramguard pool block (``page_size`` tokens of every layer,
    :func:`vramguard.memory.kv.paged_block_bytes`): 1 where ``PagedAttentionCache`` counts blocks of every layer
    (5.24: ``bytes_per_block = num_hidden_layers x FullAttentionCacheAllocator.get_bytes_per_page(...)``), else the
    number of layer groups of ``group_layers_by_attn_type(config)`` (5.17: each group of ``gcd`` layers of one
    attention type takes its own block for a page of a request, so ``num_blocks`` blocks hold ``num_blocks / groups``
    pages of the whole model; Gemma-2's 2 sliding + 2 full layers are 2 groups).

    Args:
        config: the model's (text) config, as transformers' continuous batching reads it.
    Returns:
        the factor (>= 1): give transformers ``num_blocks x factor``, read its counts back divided by it.
    """
    from transformers.generation.continuous_batching import cache
    alloc = getattr(cache, "FullAttentionCacheAllocator", None)
    if alloc is not None and hasattr(alloc, "get_bytes_per_page"):
        return 1
    layer_groups, _ = cache.group_layers_by_attn_type(config)
    return max(len(layer_groups), 1)


@lru_cache(maxsize=1)
def guarded_manager_class():
    """The ``ContinuousBatchingManager`` subclass whose loop survives an OOM inside a step (see engine.py)."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    class GuardedManager(ContinuousBatchingManager):
        """transformers' manager whose steps are reported to ``vg_engine`` (:class:`~vramguard.serve.engine.Engine`),
        whose batch processor chooses tokens with the engine's :class:`~vramguard.serve.sampler.RowSampler` (argmax
        for greedy requests, per-request seeds), whose decode-only steps run from the engine's CUDA graphs where it
        has them, and whose loop hands an
        exception inside an iteration to :mod:`vramguard.serve.recovery` instead of failing every request; only a
        device fault (or a loop that keeps failing) goes on to the engine's handler."""

        vg_engine = None

        def _create_batch_processor(self):
            bp = super()._create_batch_processor()
            self.vg_engine.install_sampler(bp)  # before the warm-up or any capture of a step
            return bp

        def _generation_step(self):
            bp = self.batch_processor
            ids = [fs.state.request_id for fs in getattr(bp.inputs_and_outputs, "requests_in_batch", [])]
            self.vg_engine._on_step(self.current_batch, ids, bp)
            self.vg_engine._fill_rows(bp)
            graphs = self.vg_engine.decode_graphs(bp)
            if graphs is not None and graphs.accepts(bp):
                return graphs.step(bp, self.model)  # a decode-only step: replayed (vramguard.serve.decode_graphs)
            return super()._generation_step()

        def _generation_loop_body(self, batch_processor, bootstrapping):
            engine = self.vg_engine
            try:
                more = super()._generation_loop_body(batch_processor, bootstrapping)
            except Exception as e:  # noqa: BLE001 - sorted below; a device fault goes on to the engine's handler
                try:
                    if device_fault(e) is not None:
                        raise
                    if is_oom(e):
                        recovery.on_oom(engine, self, batch_processor, e)
                    else:
                        recovery.on_step_failure(engine, self, batch_processor, e)
                except Exception as fatal:  # noqa: BLE001 - the device fault, or a failure of the recovery itself
                    engine.fatal_error = fatal
                    raise
                return True
            recovery.after_step(engine, batch_processor)
            return more

    return GuardedManager
