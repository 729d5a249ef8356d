"""Sequential calibration, as GPTQ's ``llama_sequential`` runs it: each site fitted on the hidden
states of the already corrected pruned model, every block run once.

One caching pass (:meth:`SequentialWalk.cache_batch`, per batch: :class:`~.pipeline.BlockCache`) runs
the embedding and keeps the hidden state entering block 0 plus every block's call arguments. Then
:meth:`SequentialWalk.walk` moves block after block over the cached batches, each block brought in once
by the model's placement: a kept block updates the states; a site accumulates its ``(x, Δ)`` statistics
(one all-reduce per site, each depending on the previous solution), is solved, and its adapter updates
the states. About one forward pass up to the last site in all, not one per site.

``anchored`` (``--calibration.mode anchored``) also carries the original model's states through the
same walk (every block, removed ones included) and fits each site to where the *original* is at the
site's end: ``Δ = h_end(original) − x(corrected pruned)``, not the removed blocks' update on the drifted
states. A site's map then also undoes the drift the earlier sites and the kept blocks between them
left. With one site (or before the first) it is the independent fit; it costs the kept blocks between
the first and the last site a second time, and a second cached state per batch.

``joint`` (the ``lra_replaceme`` solver): each site also needs ``m``, the MLP-branch output of the kept block
``start − 1`` on the corrected pruned model's states (kept from the caching pass for the first site, from
the walk for later ones), and its statistics are ``([x, m], Δ)``. Its solution moves the states on as the
corrected model will: ReplaceMe's half first (``x' = x + m (T − I)``), then the adapter. It keeps one more
cached state per batch (``m``, as wide as the hidden state).
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import nn

from ..arch import mlp_branch
from ..maps.ridge import RidgeStats
from .collect import SiteStatistics
from ..passes import BlockCache
from ..maps.sites import Site


class SequentialWalk:
    """Cached batches and the block-by-block walk over them (see the module doc)."""

    def __init__(self, model: nn.Module, sites: list[Site], dim: int, accum_dtype: str, anchored: bool = False,
                 joint: bool = False):
        self.model, self.sites, self.dim, self.accum = model, sorted(sites, key=lambda s: s.start), dim, accum_dtype
        self.anchored, self.joint = anchored, joint
        self.cache = BlockCache(model, max(s.end for s in self.sites) - 1)

    def _branch_tap(self, block: nn.Module, sink: dict):
        """Keep ``block``'s MLP-branch output in ``sink["m"]`` (the handle to remove)."""
        return mlp_branch(block).register_forward_hook(lambda mod, a, out: sink.__setitem__("m", out))

    def cache_batch(self, batch: dict, mask: torch.Tensor, device=None) -> None:
        e = self.cache.cache_batch(batch, mask, device)
        e["o"], e["m"] = e["h"], None  # o: the original's states (anchored); m: the branch before the next site (joint)

    @torch.no_grad()
    def _site_statistics(self, site: Site, device, bar) -> tuple[SiteStatistics, list[torch.Tensor]]:
        """Run the site's removed blocks (each brought in once) on every cached batch and sum its ``(x, Δ)`` (and
        ``([x, m], Δ)``) statistics; returns them and their buffers (to all-reduce)."""
        cached, run = self.cache.entries, self.cache.run
        flats = [torch.zeros(RidgeStats.numel(self.dim), dtype=torch.float64, device=device)]
        stats = SiteStatistics(site, io=RidgeStats(self.dim, site.name, accum_dtype=self.accum, buffer=flats[0]))
        joint = self.joint and site.start >= 1
        if joint:
            flats.append(torch.zeros(RidgeStats.numel(2 * self.dim, self.dim), dtype=torch.float64, device=device))
            stats.joint = RidgeStats(2 * self.dim, site.name + " [x, m]", accum_dtype=self.accum, buffer=flats[1],
                                     out_dim=self.dim)
        ys = [e["o"] if self.anchored else e["h"] for e in cached]
        for i in range(site.start, site.end):  # the removed blocks, each brought in once for every batch
            with self.cache.placement.block(self.model, i, device) as block:
                ys = [run(block, i, e, y) for e, y in zip(cached, ys)]
            if bar is not None:
                bar.step(extra=f"block {i}")
        for e, y in zip(cached, ys):
            x, m = e["h"], e["mask"]
            stats.io.add_batch(x[m], (y - x)[m])
            if joint:
                stats.joint.add_batch(torch.cat([x[m], e["m"][m]], dim=1), (y - x)[m])
            if self.anchored:
                e["o"] = y
        return stats, flats

    @torch.no_grad()
    def walk(self, device, on_site: Callable[[Site, SiteStatistics], tuple[nn.Module, torch.Tensor | None]],
             reduce: Callable[[list[torch.Tensor]], None], bar=None) -> None:
        """``on_site(site, statistics)`` gets each site's reduced statistics on the current states and
        returns the adapter and the branch map ``T`` (or None) that then move the states on (every rank).
        Each block is brought in once by the model's placement and run on every cached batch."""
        placement, cached, run = self.cache.placement, self.cache.entries, self.cache.run
        site_at = {s.start: s for s in self.sites}
        j, last = 0, max(s.end for s in self.sites)

        while j < last:
            site = site_at.get(j)
            if site is None:
                with placement.block(self.model, j, device) as block:
                    tapped: dict = {}  # block j's branch on the corrected states, before a joint site
                    tap = self._branch_tap(block, tapped) if self.joint and (j + 1) in site_at else None
                    try:
                        for e in cached:
                            e["h"] = run(block, j, e, e["h"])
                            if tap is not None:
                                e["m"] = tapped["m"]
                            if self.anchored:
                                e["o"] = run(block, j, e, e["o"])
                    finally:
                        if tap is not None:
                            tap.remove()
                if bar is not None:
                    bar.step(extra=f"block {j}")
                j += 1
                continue
            stats, flats = self._site_statistics(site, device, bar)
            reduce(flats)
            adapter, T = on_site(site, stats)
            adapter = adapter.to(device)
            shift = None if T is None else T - torch.eye(self.dim, dtype=T.dtype, device=T.device)
            for e in cached:
                h = e["h"]
                if shift is not None:  # ReplaceMe's half first: x' = x + m (T − I)
                    h = h + e["m"] @ shift.to(h)
                e["h"] = adapter(h)
            j = site.end
        self.cache.entries = []
