"""LinearPatch, training-free (arXiv 2505.24680): ``y = x P`` at the pruning interface, ``P = H D Hᵀ``
with ``H`` a normalised Hadamard matrix and ``D`` the per-channel scaling of the span's output over
its input in the Hadamard basis (:mod:`shift_lightning.maps.peers`). No bias; an affine adapter with
``A = Pᵀ``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Solver, register

if TYPE_CHECKING:
    from ..ridge import Solution
    from ...calibration.collect import SiteStatistics


@register
class LinearPatch(Solver):
    name, label = "linearpatch", "+LinearPatch"
    description = "LinearPatch (Hadamard channel scaling, y = x P)"
    span_only = True
    bias = False
    needs = frozenset({"scale"})

    def fit(self, stats: SiteStatistics) -> Solution:
        import torch

        from ..peers import linearpatch_matrix
        from ..ridge import Solution

        scale = stats.scale.scale()
        P = linearpatch_matrix(scale)
        zero = torch.zeros(P.shape[0], dtype=torch.float64, device=P.device)
        return Solution(P.T.contiguous(), zero, None, None, 0.0, "affine", info={"scale_mean": float(scale.mean())})
