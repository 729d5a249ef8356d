"""Streaming least-squares statistics and the closed-form (reduced-rank) ridge solve.

For one pruning site with inputs ``x: (N, d)`` (the hidden state entering the removed block(s))
and targets ``Δ: (N, d)`` (the removed block(s)' residual update ``block(x) − x``), we keep::

    G  = [X, 1]ᵀ [X, 1]    (d+1, d+1)   float64     augmented Gram; G[d, d] = N tokens
    C  = [X, 1]ᵀ Δ         (d+1, d)     float64
    yy = Σ ‖Δ_t‖²          scalar       float64

Memory is independent of the number of tokens. Padding tokens are removed by the caller (only
rows of real tokens reach :meth:`RidgeStats.add_batch`). Sums over ranks are plain sums, so one
all-reduce of the flat buffer gives the global statistics.

The solve (:func:`ridge_solve`) centres the statistics so the bias is not shrunk, then::

    Wᵀ = (XcᵀXc + λI)⁻¹ XcᵀΔc      via Cholesky,  λ = damping · mean(diag(XcᵀXc))
    b  = mean(Δ) − W mean(x)

and for rank r < d it returns the optimal rank-r solution of the *same* ridge objective
(reduced-rank ridge regression): with H = XcᵀXc + λI and B = Wᵀ,
``f(B') = const + tr((B' − B)ᵀ H (B' − B))``, minimised over rank-r B' by ``B' = B P_r`` where
``P_r`` projects onto the top-r eigenvectors of ``Bᵀ H B = Bᵀ XcᵀΔc``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .errors import ShiftError


class SolveError(ShiftError, RuntimeError):
    """Calibration statistics are unusable (non-finite, empty) or the system is not positive definite."""


class RidgeStats:
    """Streaming ``G = [X,1]ᵀ[X,1]``, ``C = [X,1]ᵀΔ`` and ``Σ‖Δ‖²`` for one site (see module doc).

    ``accum_dtype=float64`` (default) casts each batch to float64 before the products.
    ``accum_dtype=float32`` forms each batch's products in float32 over chunks of at most
    ``chunk_tokens`` tokens and adds them into the float64 master (faster on GPUs; the
    float32 rounding is bounded per chunk and does not grow with the number of tokens).
    ``buffer`` (optional, 1-D float64 of length :meth:`numel`) lets many sites share one flat
    buffer so a single all-reduce syncs them all.
    """

    def __init__(self, dim: int, name: str = "site", device=None, accum_dtype: torch.dtype = torch.float64,
                 chunk_tokens: int = 4096, buffer: torch.Tensor | None = None):
        self.dim, self.name = dim, name
        self.accum_dtype, self.chunk_tokens = accum_dtype, chunk_tokens
        if buffer is None:
            buffer = torch.zeros(self.numel(dim), dtype=torch.float64, device=device)
        assert buffer.dtype == torch.float64 and buffer.numel() == self.numel(dim)
        self.buffer = buffer
        d1 = dim + 1
        self.G = buffer[: d1 * d1].view(d1, d1)
        self.C = buffer[d1 * d1: d1 * d1 + d1 * dim].view(d1, dim)
        self.yy = buffer[-1:]

    @staticmethod
    def numel(dim: int) -> int:
        return (dim + 1) ** 2 + (dim + 1) * dim + 1

    @property
    def num_tokens(self) -> int:
        return int(round(self.G[-1, -1].item()))

    @torch.no_grad()
    def add_batch(self, x: torch.Tensor, delta: torch.Tensor) -> None:
        """Accumulate real tokens ``x, delta: (N, d)`` (any float dtype; padding already removed)."""
        if x.shape != delta.shape or x.ndim != 2 or x.shape[1] != self.dim:
            raise ValueError(f"{self.name}: expected x, delta of shape (N, {self.dim}), got {tuple(x.shape)}, {tuple(delta.shape)}")
        if x.shape[0] == 0:
            return
        if not (torch.isfinite(x).all() and torch.isfinite(delta).all()):
            raise SolveError(
                f"{self.name}: non-finite activations (inf/NaN) in the calibration pass. The model overflows "
                "in its current dtype: load it in float32 (--model.dtype float32) or check the input data."
            )
        step = x.shape[0] if self.accum_dtype == torch.float64 else self.chunk_tokens
        for s in range(0, x.shape[0], step):
            xa = x[s: s + step].to(self.accum_dtype)
            xa = torch.cat([xa, xa.new_ones(xa.shape[0], 1)], dim=1)  # [X, 1]
            dl = delta[s: s + step].to(self.accum_dtype)
            self.G += (xa.T @ xa).to(torch.float64)
            self.C += (xa.T @ dl).to(torch.float64)
            self.yy += dl.to(torch.float64).square().sum()

    def relative_error(self, W: torch.Tensor, b: torch.Tensor) -> float:
        """``‖Δ − Δ̂‖² / ‖Δ‖²`` of the map ``Δ̂ = x Wᵀ + b`` on the accumulated data, from the statistics alone:
        ``‖Δ‖² − 2 tr(BᵀC) + tr(BᵀGB)`` with ``B = [Wᵀ; bᵀ]``."""
        B = torch.cat([W.T, b[None]], dim=0).to(torch.float64)
        yy = self.yy.item()
        sse = yy - 2 * (B * self.C).sum().item() + (B * (self.G @ B)).sum().item()
        return max(sse, 0.0) / yy if yy > 0 else float("nan")


@dataclass
class Solution:
    """``Δ̂ = x Wᵀ + b`` with ``W = U Vᵀ`` when low rank. All float64."""

    W: torch.Tensor             # (d, d)
    b: torch.Tensor             # (d,)
    U: torch.Tensor | None      # (d, r) or None for full rank
    V: torch.Tensor | None      # (d, r)
    lam: float                  # absolute damping added to the diagonal
    kind: str                   # "residual": W is the residual map; "affine": W is A in y = x Aᵀ + c

    def delta_map(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fitted residual update as ``Δ̂ = x W_Δᵀ + b`` (``W_Δ = A − I`` for the affine kind)."""
        if self.kind == "affine":
            return self.W - torch.eye(self.W.shape[0], dtype=self.W.dtype, device=self.W.device), self.b
        return self.W, self.b


def ridge_solve(stats: RidgeStats, damping: float = 1e-4, rank: int | None = None, kind: str = "residual",
                bias: bool = True) -> Solution:
    """Closed-form ridge (optionally reduced-rank) fit of the site's statistics; see module doc.

    ``kind="residual"`` fits Δ ≈ x Wᵀ + b (adapter y = x + x Wᵀ + b, shrinks towards identity);
    ``kind="affine"`` fits the block output y = x + Δ ≈ x Aᵀ + c (ablation, shrinks A towards 0).
    ``bias=False`` fits without intercept (``b = 0``): the statistics are used uncentred,
    ``Wᵀ = (XᵀX + λI)⁻¹ XᵀΔ`` with ``λ = damping · mean(diag(XᵀX))``.
    """
    G, C, d = stats.G, stats.C, stats.dim
    n = G[d, d]
    if n < 1:
        raise SolveError(f"{stats.name}: no calibration tokens were accumulated")
    if not (torch.isfinite(G).all() and torch.isfinite(C).all()):
        raise SolveError(f"{stats.name}: calibration statistics are not finite; load the model in float32")
    if bias:
        mx, my = G[:d, d] / n, C[d] / n                # mean(x), mean(Δ)
    else:                                              # no intercept: uncentred statistics
        mx, my = torch.zeros_like(G[:d, d]), torch.zeros_like(C[d])
    Sxx = G[:d, :d] - n * torch.outer(mx, mx)          # Xcᵀ Xc   (XᵀX without bias)
    Sxy = C[:d] - n * torch.outer(mx, my)              # Xcᵀ Δc   (XᵀΔ without bias)
    if kind == "affine":                               # target y = x + Δ
        Sxy, my = Sxy + Sxx, my + mx
    elif kind != "residual":
        raise ValueError(f"kind must be 'residual' or 'affine', got {kind!r}")
    Sxx = 0.5 * (Sxx + Sxx.T)
    lam = damping * Sxx.diagonal().mean().clamp_min(1e-12)
    H = Sxx + lam * torch.eye(d, dtype=Sxx.dtype, device=Sxx.device)
    L, info = torch.linalg.cholesky_ex(H)
    if info.item() != 0:
        raise SolveError(
            f"{stats.name}: Cholesky failed (XᵀX + λI not positive definite with relative damping {damping:g}, "
            f"{int(n.item())} tokens). Increase --calibration.damping (e.g. {max(damping * 100, 1e-4):g}) or use "
            "more calibration tokens."
        )
    B = torch.cholesky_solve(Sxy, L)                   # Wᵀ = (XᵀX + λI)⁻¹ XᵀΔ   (d, d_out)
    U = V = None
    if rank is not None and rank < d:
        M = B.T @ Sxy                                  # Bᵀ H B   (d_out, d_out), symmetric PSD
        evals, evecs = torch.linalg.eigh(0.5 * (M + M.T))
        Pr = evecs[:, -rank:]                          # top-r eigenvectors
        U, V = Pr, B @ Pr                              # W = U Vᵀ = Pr (B Pr)ᵀ
        B = V @ Pr.T
    W = B.T.contiguous()
    b = my - W @ mx
    return Solution(W, b, U, V, float(lam), kind)


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
