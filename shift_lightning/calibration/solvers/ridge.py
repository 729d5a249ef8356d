"""The closed-form ridge maps of the removed blocks' residual update (the maths: :mod:`shift_lightning.stats`).

* ``lra``: the paper's Linear Residual Adapter ``y = x + x Wᵀ + b``, ``Wᵀ = (XcᵀXc + λI)⁻¹ XcᵀΔc``;
  low rank with ``--calibration.rank``;
* ``lra_span``: the same LRA fitted once per contiguous span, to the whole span's update ``h_end − x``
  (what ``--calibration.granularity span`` gives the ``lra`` solver; a solver of its own so that one
  calibration pass fits it beside the per-block LRAs, at the same cost);
* ``lra_anchored``: the span LRA fitted in ``--calibration.mode anchored``: on the corrected pruned
  model's state entering the span, to the ORIGINAL's state at its end (= ``lra`` with ``granularity:
  span`` and ``mode: anchored``; a name of its own so that a grid can run it as a row);
* ``lra_auto``: the LRA fitted each way of :attr:`LRAAuto.fits` (per block; per span independent,
  sequential, anchored) without the held-out calibration windows, the one whose corrected model is
  closest to the original there (next-token KL) refitted on all windows (``--calibration.mode auto``,
  :mod:`shift_lightning.calibration.auto`);
* ``nobias``: ``y = x + x Wᵀ`` (the closed-form ``I + M`` of Ghosted Layers, arXiv 2605.15491);
* ``affine``: ``y = x Aᵀ + c`` fitted to the block output, no identity path (the paper's ablation);
* ``lra_guard``: the LRA with its ridge strength chosen per site along ``λ·10^k`` by the relative
  error on the held-out calibration windows, or the identity when no λ beats it
  (:func:`~shift_lightning.stats.guarded_solve`).
"""

from __future__ import annotations

from ...stats import Solution, guarded_solve, ridge_solve
from ..collect import SiteStatistics
from .base import Solver, register


@register
class LRA(Solver):
    name, label = "lra", "+LRA"
    sequential = low_rank = True
    bias = True

    def fit(self, stats: SiteStatistics) -> Solution:
        return ridge_solve(stats.io, self.cfg.damping, self.rank(stats.io.dim), "residual", bias=self.bias)


@register
class LRASpan(LRA):
    name, label = "lra_span", "+LRA (one per span)"
    per_span = True
    sequential = False


@register
class LRAAnchored(LRA):
    name, label = "lra_anchored", "+LRA per span, anchored"
    per_span = True
    mode = "anchored"


@register
class LRAAuto(LRA):
    name, label = "lra_auto", "+LRA, fit chosen on held-out KL"
    per_span = True
    mode, fit_solver = "auto", "lra"
    #: (name, granularity, mode) of each fit tried, in tie-breaking order: the paper's per-block LRA first.
    fits = (("lra", "block", "independent"), ("lra_span", "span", "independent"),
            ("lra_sequential", "span", "sequential"), ("lra_anchored", "span", "anchored"))


@register
class NoBias(LRA):
    name, label = "nobias", "+no bias"
    bias = False


@register
class Affine(Solver):
    name, label = "affine", "+affine"
    sequential = True

    def fit(self, stats: SiteStatistics) -> Solution:
        return ridge_solve(stats.io, self.cfg.damping, None, "affine", bias=True)


@register
class LRAGuard(LRA):
    name, label = "lra_guard", "+LRA, guarded (recon.)"
    sequential = False
    holdout = True

    def fit(self, stats: SiteStatistics) -> Solution:
        sol, report = guarded_solve(stats.io, stats.held_io, self.cfg.damping, self.rank(stats.io.dim), "residual",
                                    bias=True)
        sol.info = {"guard": {k: v for k, v in report.items()}}
        return sol
