"""Block-major calibration: every walk is a pipeline over cached windows, one registry (:data:`~.walks.WALKS`).

All walks run in one order (llm-compressor's sequential pipeline, GPTQ's ``llama_sequential``):

1. **caching**, per batch inside the Lightning predict loop (:class:`~shift_lightning.passes.BlockCache`): the embedding runs
   once per window, every block is stood in for by a recorder, so each batch keeps the hidden state
   entering block 0 and every block's call arguments (position embeddings, masks): a rank holds
   ``windows × T × d`` hidden states (plus what a walk keeps beside them: a site's input while its span is
   walked, the joint map's branch output, the anchored walk's original states);
2. **the walk**, after the loop: block 0, then 1, …, up to the last removed block; each block is brought in
   once by the model's placement (:mod:`shift_lightning.placement`: a no-op in memory, read from the
   safetensors files when onloaded), run on all of this rank's windows, released.

What a walk does at a block is its own (:data:`~.walks.WALKS`, chosen by ``--calibration.mode``):

``independent``  forward hooks (:class:`~.collect.Collector`) fill every site's statistics from the original
                 model's states; ONE all-reduce after the walk; the solves (:meth:`CalibrationModule.solve`).
``sequential``   each site fitted on the corrected pruned model's states as the walk reaches it
                 (:class:`~.sequential.SequentialWalk`: one all-reduce and one shared solve per site).
``anchored``     ``sequential``, each site fitted to the original's state at its end.
``auto``         each fit of the solver made by the walks above on part of the windows, judged on the rest
                 (:mod:`.auto`).

The per-site sums of a window batch are the same products, added in the same order, as a batch-major
forward pass would make: the maps do not depend on the placement or on this order, bit for bit.
"""

from __future__ import annotations

import torch
from torch import nn

from ..arch import StopForward
from ..passes import BlockCache
from .collect import Collector


class IndependentPass:
    """``independent`` statistics, block-major: :class:`~.collect.Collector`'s hooks on the original blocks while
    the walk runs each block on every cached batch (the sums are those of a batch-major forward)."""

    def __init__(self, model: nn.Module, collector: Collector):
        self.model, self.collector = model, collector
        self.last = max(site.end for site in collector.plan) - 1
        self.cache = BlockCache(model, self.last)

    def cache_batch(self, batch: dict, mask: torch.Tensor, device=None) -> None:
        self.cache.cache_batch(batch, mask, device)

    @torch.no_grad()
    def walk(self, device, reduce, bar=None, done=None) -> None:
        """Blocks ``0..last`` over every entry, then ONE all-reduce of every site's sums (``reduce``).

        ``done(keys)`` given: each site's sums are allocated when the walk reaches its first block and, once its
        last block has run on every entry, all-reduced (each sum still once) and handed to ``done`` (which solves
        and frees them): a rank then holds the sums of the sites being walked, not of all sites."""
        placement, col = self.cache.placement, self.collector
        if done is not None:
            col.allocate("meta")
        handles = col.install(self.model)
        try:
            for j in range(self.last + 1):
                if done is not None:
                    col.allocate(device, {site.key for site in col.plan if site.start == j})
                with placement.block(self.model, j, device) as block:
                    for k, e in enumerate(self.cache.entries):
                        col.batch(e["mask"], e["index"], k)
                        try:
                            e["h"] = self.cache.run(block, j, e, e["h"])
                        except StopForward:
                            pass
                if done is not None and (keys := [site.key for site in col.plan if site.end == j + 1]):
                    reduce([col.buffers[key] for key in keys])
                    done(keys)
                if bar is not None:
                    bar.step(extra=f"block {j}")
        finally:
            for h in handles:
                h.remove()
        self.cache.entries = []
        if done is None:
            reduce(list(col.buffers.values()))
