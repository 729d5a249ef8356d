"""The closed-form ridge maps of the removed blocks' residual update (the maths: :mod:`shift_lightning.maps.ridge`).

* ``lra``: the paper's Linear Residual Adapter ``y = x + x Wᵀ + b``, ``Wᵀ = (XcᵀXc + λI)⁻¹ XcᵀΔc``. Its knobs:
  low rank with ``--calibration.rank``; one map per removed block (merged per span) or, with ``granularity:
  span``, one per contiguous span fitted to the whole span's update ``h_end − x``; fitted on the original model
  (``mode: independent``), on the corrected pruned model's states (``sequential``), also to the ORIGINAL's state
  at the span's end (``anchored``), or each of those tried and the closest to the original on held-out windows kept
  (``auto``, :mod:`shift_lightning.calibration.auto`);
* ``nobias``: ``y = x + x Wᵀ`` (the closed-form ``I + M`` of Ghosted Layers, arXiv 2605.15491).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Solver, register

if TYPE_CHECKING:
    from ..ridge import Solution
    from ...calibration.collect import SiteStatistics


@register
class LRA(Solver):
    name, label = "lra", "+LRA"
    description = "closed-form Linear Residual Adapters (ridge least squares, y = x + x Wᵀ + b)"
    sequential = low_rank = True
    bias = True
    #: ``mode: auto``: (name, granularity, mode) of each fit tried, in tie-breaking order: the paper's per-block LRA
    #: first (the names are how reports and grids call each fit).
    fits = (("lra", "block", "independent"), ("lra_span", "span", "independent"),
            ("lra_sequential", "span", "sequential"), ("lra_anchored", "span", "anchored"))

    def fit(self, stats: SiteStatistics) -> Solution:
        from ..ridge import ridge_solve

        return ridge_solve(stats.io, self.cfg.damping, self.rank(stats.io.dim), "residual", bias=self.bias)


@register
class NoBias(LRA):
    name, label = "nobias", "+no bias"
    description = "closed-form residual maps without bias (y = x + x Wᵀ, Ghosted Layers)"
    bias = False
    fits = ()
