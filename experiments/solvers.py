"""Solvers the grids run that the product does not offer, registered through the product's registry (importing this
module makes them available to :class:`~shift_lightning.calibration.CalibrationModule` under their names):

* ``affine``: ``y = x Aᵀ + c`` fitted to the block output, no identity path (the paper's ablation);
* ``lra_guard``: the LRA with its ridge strength chosen per site along ``λ·10^k`` by the relative error on the
  held-out calibration windows, or the identity when no λ beats it (:func:`guarded_solve`). Reconstruction error
  cannot see a shifted yes/no prior or another domain: it removed none of the negative gains in the paper grid, and
  the KL guard (``guarded``) replaced it.
"""

from __future__ import annotations

import torch

from shift_lightning.calibration.collect import SiteStatistics
from shift_lightning.maps.solvers import Solver, register
from shift_lightning.maps.solvers.ridge import LRA
from shift_lightning.maps.ridge import RidgeStats, Solution, SolveError, ridge_solve


@register
class Affine(Solver):
    name, label = "affine", "+affine"
    description = "closed-form affine maps (y = x Aᵀ + c, no identity path)"
    sequential = True

    def fit(self, stats: SiteStatistics) -> Solution:
        return ridge_solve(stats.io, self.cfg.damping, None, "affine", bias=True)


@register
class LRAGuard(LRA):
    name, label = "lra_guard", "+LRA, guarded (recon.)"
    description = "closed-form LRAs with a reconstruction guard"
    sequential = False
    holdout = True
    fits = ()

    def fit(self, stats: SiteStatistics) -> Solution:
        sol, report = guarded_solve(stats.io, stats.held_io, self.cfg.damping, self.rank(stats.io.dim), "residual",
                                    bias=True)
        sol.info = {"guard": dict(report)}
        return sol


def guarded_solve(stats: RidgeStats, guard: RidgeStats, damping: float = 1e-4, rank: int | None = None,
                  kind: str = "residual", bias: bool = True, path: int = 7) -> tuple[Solution, dict]:
    """Do-no-harm fit: keep a map only where it helps on data it was not fitted on.

    ``stats`` holds every calibration window, ``guard`` the held-out part of them (``stats − guard``
    is the fitting part). Along the ridge path ``λ_k = damping · 10^k`` (k < ``path``) the map fitted on
    the fitting part is scored by its relative error on the guard windows; the λ with the lowest
    error is refitted on all windows. If no λ beats the identity (error 1: the block's update
    dropped, as plain pruning does), the map *is* the identity (``W = 0, b = 0``; ``A = I`` for the
    affine kind). Returns the solution and a report (errors along the path, the choice).
    """
    d = stats.dim
    fit = RidgeStats(d, stats.name + " [fit part]", device=stats.buffer.device)
    fit.buffer.copy_(stats.buffer - guard.buffer)
    errors = {}
    for k in range(path):
        lam = damping * 10 ** k
        try:
            Wd, bd = ridge_solve(fit, lam, rank, kind, bias).delta_map()
        except SolveError:
            continue
        errors[lam] = guard.relative_error(Wd, bd)
    best = min(errors, key=errors.get) if errors else None
    if best is None or not errors[best] < 1.0:
        f64 = dict(dtype=torch.float64, device=stats.buffer.device)
        W = torch.eye(d, **f64) if kind == "affine" else torch.zeros(d, d, **f64)
        U = V = torch.zeros(d, rank, **f64) if rank is not None and rank < d else None
        return Solution(W, torch.zeros(d, **f64), U, V, float("inf"), kind), {
            "errors": {f"{k:g}": v for k, v in errors.items()}, "chosen": "identity", "fired": True}
    sol = ridge_solve(stats, best, rank, kind, bias)
    return sol, {"errors": {f"{k:g}": v for k, v in errors.items()}, "chosen": best, "fired": best != damping}
