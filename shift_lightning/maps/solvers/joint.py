"""``lra_replaceme``: the LRA and ReplaceMe's branch map fitted together, one closed-form ridge per span.

The LRA sees only the state entering the span, ``x``; ReplaceMe only the MLP-branch output of the
block before it, ``m`` (a nonlinear function of that block's input, so not a linear function of
``x``). One ridge regression on both::

    Δ̂ = x A + m B + b          [A; B] = ([x, m]ᶜᵀ[x, m]ᶜ + Λ)⁻¹ [x, m]ᶜᵀ Δᶜ

(row vectors, centred statistics ``ᶜ``; ``Λ`` damps each half relative to its own mean variance, so
``A`` shrinks to 0 and ``B`` to 0 — towards the plain LRA and plain pruning, not towards each other's
scale). Up to the damping, its in-sample error is never above either map's: it contains both (the LRA is
``B = 0``, ReplaceMe ``A = 0`` without bias).

**Placement, exactly.** A map on ``m`` is applied where ReplaceMe applies it: ``m ↦ m T`` on block
``start − 1``'s branch (folded into ``down_proj``, or after Gemma3's post-MLP norm), which moves the
state entering the span to ``x' = x + m (T − I)``. The adapter after the span then sees ``x'``, not
``x``. With the adapter ``y = x' (I + A) + b`` and ``T = I + B (I + A)⁻¹``::

    y = x (I + A) + m (T − I)(I + A) + b = x + x A + m B + b

the fitted map, exactly. ``(I + A)⁻¹`` is applied with a linear solve (LU), never an explicit
inverse, and refused when ``I + A`` is ill-conditioned (condition number over ``1e8``). The
corrected model is again an LRA plus a ReplaceMe map: saved, loaded and exported as those are.

A span starting at block 0 has no branch before it: it gets the span LRA alone (noted).

**Modes.** ``--calibration.mode sequential`` / ``anchored`` fit each span on the corrected pruned model's
``[x, m]`` (``m`` of the kept block before the span, run on the corrected states), to the span's update or to
the original's state at its end (:mod:`~shift_lightning.calibration.sequential`); ``auto`` fits it each of those
ways without the held-out windows and keeps the closest to the original there (:mod:`~shift_lightning.calibration.auto`;
anchoring brings SmolLM2 closer where the first blocks are kept and further where block 0 or 1 is removed, so it is
a choice per run, made on calibration text).

**Low rank** (``--calibration.rank r``): the adapter's ``A`` is constrained to rank r, ``B`` (folded into
``down_proj``, no parameters) stays full and is refitted given ``A``: the exact optimum of the same ridge
objective over rank(``A``) ≤ r (:func:`~shift_lightning.maps.ridge.ridge_solve`, via the Schur complement of the
``m`` block). The adapter is then ``y = x' + x' V Uᵀ + b``, ``2dr + d`` parameters, and ``T`` is computed from
``I + A`` as above.

Statistics: ``[x, m, 1]ᵀ[x, m, 1, Δ]``, ``(2d+1)(3d+1)`` float64 per span (16 MB at d = 576, SmolLM2;
20 MB at d = 640, Gemma3-270M; 805 MB at d = 4096), beside the span's ``(x, Δ)``, which is copied out of it
after the pass rather than accumulated again (``Collector.derive``); twice that under ``guarded_joint``
(held-out copies). Per token and span about ``6d²`` products against the LRA's ``2d²`` as one GEMM each;
on CPU, where only the upper block triangle of the symmetric Gram block is multiplied
(:func:`~shift_lightning.maps.ridge.gram_products`), about ``4.4d²`` against ``1.7d²`` at d = 640.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .base import Solver, register

if TYPE_CHECKING:
    import torch

    from ..ridge import Solution
    from ...calibration.collect import SiteStatistics

#: Largest condition number of ``I + A`` the fold accepts.
MAX_COND = 1e8


def span_delta_map(M: torch.Tensor, c: torch.Tensor, T: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The update ``Δ̂ = [x, m] W_jᵀ + c`` that an adapter ``y = M x' + c`` (columns; ``M = I + W``) after a
    branch map ``T`` applies: ``x' = x + m (T − I)``, so ``W_j = [M − I, M (T − I)ᵀ]``, ``(d, 2d)``."""
    import torch

    eye = torch.eye(M.shape[0], dtype=torch.float64, device=M.device)
    M, T = M.to(torch.float64), T.to(torch.float64)
    return torch.cat([M - eye, M @ (T - eye).T], dim=1), c.to(torch.float64)


@register
class LRAReplaceMe(Solver):
    name, label = "lra_replaceme", "+LRA & ReplaceMe (joint)"
    description = ("one closed-form Linear Residual Adapter per removed span and ReplaceMe's map on the MLP branch "
                   "of the block before it, fitted together (one ridge regression)")
    span_only = low_rank = sequential = True
    needs = frozenset({"io", "joint"})
    #: ``mode: auto``: (name, granularity, mode) of each fit tried, in tie-breaking order: the default first.
    fits = (("lra_replaceme", "span", "independent"), ("lra_replaceme_sequential", "span", "sequential"),
            ("lra_replaceme_anchored", "span", "anchored"))

    def fitted_on(self, sol: Solution, stats: SiteStatistics):
        import torch

        if sol.T is None or stats.joint is None:
            return stats.io, sol.delta_map()
        eye = torch.eye(sol.W.shape[0], dtype=sol.W.dtype, device=sol.W.device)
        return stats.joint, span_delta_map(eye + sol.W, sol.b, sol.T)

    def fit(self, stats: SiteStatistics) -> Solution:
        import torch

        from ..ridge import Solution, SolveError, ridge_solve

        if stats.joint is None:  # span at block 0: no branch before it
            sol = ridge_solve(stats.io, self.cfg.damping, self.rank(stats.io.dim))
            sol.info = {"joint": False, "note": "no block before the span: the span LRA alone"}
            return sol
        d = stats.io.dim
        sol = ridge_solve(stats.joint, self.cfg.damping, self.rank(d), groups=(d, d))
        A, B = sol.W[:, :d].T, sol.W[:, d:].T              # Δ̂ = x A + m B + b
        eye = torch.eye(d, dtype=A.dtype, device=A.device)
        IA = eye + A
        cond = float(torch.linalg.cond(IA))
        if not cond < MAX_COND:
            raise SolveError(f"{stats.site.name}: I + A of the joint map is ill-conditioned (condition number "
                             f"{cond:.3g}), so ReplaceMe's half cannot be moved before the adapter exactly; increase "
                             "--calibration.damping or use --calibration.solver lra --calibration.granularity span")
        T = eye + torch.linalg.solve(IA.T, B.T).T          # T − I = B (I + A)⁻¹
        return Solution(A.T.contiguous(), sol.b, sol.U, sol.V, sol.lam, "residual", T=T.contiguous(),
                        info={"joint": True, "cond_I_plus_A": cond})
