"""Sequential calibration, as GPTQ's ``llama_sequential`` runs it: each site fitted on the hidden
states of the already corrected pruned model, every block run once.

One caching pass (:meth:`SequentialWalk.cache_batch`, per batch) runs the model up to the first
site and keeps the hidden state entering it plus every later block's call arguments (the blocks are
stood in for by :class:`_Recorder`, which stops the forward after the last site). Then
:meth:`SequentialWalk.walk` moves block after block over the cached batches: a kept block updates
the states; a site accumulates its ``(x, Δ)`` statistics (one all-reduce per site, each depending on
the previous solution), is solved, and its adapter updates the states. About one forward pass up to
the last site in all, not one per site.

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

from ..arch import block_output, decoder_layers, mlp_branch, swapped_blocks
from ..stats import RidgeStats
from .collect import SiteStatistics, StopForward
from .sites import Site


class _Recorder(nn.Module):
    """Stands in for block ``j`` during the caching pass: records the call."""

    def __init__(self, j: int, sink: dict, last: int):
        super().__init__()
        self.j, self.sink, self.last = j, sink, last

    def forward(self, hidden_states, *args, **kwargs):
        if "h" not in self.sink:
            self.sink["h"] = hidden_states
        self.sink[self.j] = (args, kwargs)
        if self.j == self.last:
            raise StopForward
        return hidden_states


class SequentialWalk:
    """Cached batches and the block-by-block walk over them (see the module doc)."""

    def __init__(self, model: nn.Module, sites: list[Site], dim: int, accum_dtype: str, anchored: bool = False,
                 joint: bool = False):
        self.model, self.sites, self.dim, self.accum = model, sorted(sites, key=lambda s: s.start), dim, accum_dtype
        self.anchored, self.joint = anchored, joint
        self.cached: list[dict] = []

    def _branch_tap(self, j: int, sink: dict):
        """Keep block ``j``'s MLP-branch output in ``sink["m"]`` (the handle to remove)."""
        return mlp_branch(decoder_layers(self.model)[j]).register_forward_hook(
            lambda mod, a, out: sink.__setitem__("m", out))

    @torch.no_grad()
    def cache_batch(self, batch: dict, mask: torch.Tensor) -> None:
        first, last = self.sites[0].start, max(s.end for s in self.sites) - 1
        sink: dict = {}
        stubs = {j: _Recorder(j, sink, last) for j in range(first, last + 1)}
        tapped: dict = {}
        tap = self._branch_tap(first - 1, tapped) if self.joint and first >= 1 else None
        with swapped_blocks(self.model, stubs):
            try:
                self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
            except StopForward:
                pass
            finally:
                if tap is not None:
                    tap.remove()
        h = sink.pop("h")
        # o: the original's states (anchored); m: the branch before the next site (joint)
        self.cached.append({"h": h, "o": h, "calls": sink, "mask": mask, "m": tapped.get("m")})

    @torch.no_grad()
    def walk(self, device, on_site: Callable[[Site, SiteStatistics], tuple[nn.Module, torch.Tensor | None]],
             reduce: Callable[[list[torch.Tensor]], None]) -> None:
        """``on_site(site, statistics)`` gets each site's reduced statistics on the current states and
        returns the adapter and the branch map ``T`` (or None) that then move the states on (every rank)."""
        blocks = decoder_layers(self.model)
        site_at = {s.start: s for s in self.sites}
        j, last = self.sites[0].start, max(s.end for s in self.sites)

        def run_block(i, entry, h):
            args, kwargs = entry["calls"][i]
            return block_output(blocks[i](h, *args, **kwargs))

        while j < last:
            site = site_at.get(j)
            if site is None:
                tapped: dict = {}  # block j's branch on the corrected states, before a joint site
                tap = self._branch_tap(j, tapped) if self.joint and (j + 1) in site_at else None
                try:
                    for e in self.cached:
                        e["h"] = run_block(j, e, e["h"])
                        if tap is not None:
                            e["m"] = tapped["m"]
                        if self.anchored:
                            e["o"] = run_block(j, e, e["o"])
                finally:
                    if tap is not None:
                        tap.remove()
                j += 1
                continue
            flats = [torch.zeros(RidgeStats.numel(self.dim), dtype=torch.float64, device=device)]
            stats = SiteStatistics(site, io=RidgeStats(self.dim, site.name, accum_dtype=self.accum, buffer=flats[0]))
            joint = self.joint and site.start >= 1
            if joint:
                flats.append(torch.zeros(RidgeStats.numel(2 * self.dim, self.dim), dtype=torch.float64, device=device))
                stats.joint = RidgeStats(2 * self.dim, site.name + " [x, m]", accum_dtype=self.accum, buffer=flats[1],
                                         out_dim=self.dim)
            for e in self.cached:
                x, y = e["h"], e["o"] if self.anchored else e["h"]
                for i in range(site.start, site.end):
                    y = run_block(i, e, y)
                m = e["mask"]
                stats.io.add_batch(x[m], (y - x)[m])
                if joint:
                    stats.joint.add_batch(torch.cat([x[m], e["m"][m]], dim=1), (y - x)[m])
                if self.anchored:
                    e["o"] = y
            reduce(flats)
            adapter, T = on_site(site, stats)
            adapter = adapter.to(device)
            shift = None if T is None else T - torch.eye(self.dim, dtype=T.dtype, device=T.device)
            for e in self.cached:
                h = e["h"]
                if shift is not None:  # ReplaceMe's half first: x' = x + m (T − I)
                    h = h + e["m"] @ shift.to(h)
                e["h"] = adapter(h)
            j = site.end
        self.cached = []
