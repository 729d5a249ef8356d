"""Streaming least-squares statistics and the closed-form (reduced-rank) ridge solve.

For one pruning site with inputs ``x: (N, d)`` (the hidden state entering the removed block(s))
and targets ``Δ: (N, d)`` (the removed block(s)' residual update ``block(x) − x``), we keep::

    G  = [X, 1]ᵀ [X, 1]    (d+1, d+1)   float64     augmented Gram; G[d, d] = N tokens
    C  = [X, 1]ᵀ Δ         (d+1, d)     float64
    yy = Σ ‖Δ_t‖²          scalar       float64

Memory is independent of the number of tokens. The targets may have another width than the inputs
(``out_dim``): the joint map of :mod:`~shift_lightning.maps.solvers.joint` regresses ``Δ: (N, d)`` on
``[x, m]: (N, 2d)``, with ``C`` of shape ``(2d+1, d)``. Padding tokens are removed by the caller (only
rows of real tokens reach :meth:`RidgeStats.add_batch`). Sums over ranks are plain sums, so one
all-reduce of the flat buffer gives the global statistics.

Accumulation schemes (``accum``; the master sums are always float64). A batch's products are
``[X,1]ᵀ [X,1,Δ]: (d+1, 2d+1)``, ``G`` and ``C`` together (:func:`gram_products`: on CPU only the upper block
triangle of the symmetric ``G`` is multiplied, the rest mirrored; on CUDA one GEMM):

    float64    the whole batch cast to float64, products in float64 (the reference)
    float32    chunks of ``chunk_tokens`` tokens, float32 products added into the float64 master
    tf32       as float32, with TF32 tensor cores on CUDA (inputs rounded to a 10-bit mantissa)
    bfloat16   as float32, with bf16 inputs and float32 accumulation (CUDA ``mm(out_dtype=float32)``);
               lossless on the inputs when the model runs in bf16
    auto       per device (:func:`resolve_accum`): float64 on CPU; on CUDA bfloat16 for bf16
               activations, tf32 otherwise

On CPU, ``tf32`` and ``bfloat16`` round the inputs exactly as the GPU would and multiply in float32
(products of ≤ 11-bit mantissas are exact in float32), so their numbers, not their speed, can be
checked anywhere. The rounding error stays per chunk: it does not grow with the number of tokens.

The solve (:func:`ridge_solve`) centres the statistics so the bias is not shrunk, then::

    Wᵀ = (XcᵀXc + λI)⁻¹ XcᵀΔc      via Cholesky,  λ = damping · mean(diag(XcᵀXc))
    b  = mean(Δ) − W mean(x)

and for rank r < d it returns the optimal rank-r solution of the *same* ridge objective
(reduced-rank ridge regression): with H = XcᵀXc + λI and B = Wᵀ,
``f(B') = const + tr((B' − B)ᵀ H (B' − B))``, minimised over rank-r B' by ``B' = B P_r`` where
``P_r`` projects onto the top-r eigenvectors of ``Bᵀ H B = Bᵀ XcᵀΔc``.

With feature groups (``[x, m]``: the joint map) the rank applies to the first group's coefficients
``A`` only (the adapter; the other groups' ``B₂`` is folded into a weight, so it costs no parameters).
For a fixed ``A``, the best ``B₂ = H₂₂⁻¹ (S₂ − H₂₁ A)``; put back, the objective in ``A`` is again
``const + tr((A' − A)ᵀ H/H₂₂ (A' − A))`` with the Schur complement ``H/H₂₂ = H₁₁ − H₁₂ H₂₂⁻¹ H₂₁``
and ``A`` the first rows of the full solution. So the optimal rank-r ``A'`` is ``A P_r`` with ``P_r``
the top-r eigenvectors of ``Aᵀ (H/H₂₂) A``, and ``B₂`` is refitted given it: the exact optimum of the
ridge objective over rank(``A``) ≤ r, not a truncation of the joint solution.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field

import torch

from ..errors import ShiftError


class SolveError(ShiftError, RuntimeError):
    """Calibration statistics are unusable (non-finite, empty) or the system is not positive definite."""


#: Accumulation schemes of :class:`RidgeStats` (see the module doc); ``auto`` resolves to one of them.
ACCUM_SCHEMES = ("float64", "float32", "tf32", "bfloat16")


def resolve_accum(accum: str | torch.dtype, device: torch.device | str, act_dtype: torch.dtype) -> str:
    """The accumulation scheme for activations of ``act_dtype`` on ``device``.

    ``auto``: float64 on CPU (measured: the float64 products cost a few % of the forward pass there,
    ``benchmarks/calibration.py``); on CUDA, where float64 GEMMs run 15-60x slower than bf16 ones,
    ``bfloat16`` for bf16 activations (no input rounding at all) and ``tf32`` otherwise.
    A ``torch.dtype`` (float64 / float32 / bfloat16) names the scheme of the same name.
    """
    if isinstance(accum, torch.dtype):
        accum = {torch.float64: "float64", torch.float32: "float32", torch.bfloat16: "bfloat16"}[accum]
    if accum == "auto":
        if torch.device(device).type != "cuda":
            return "float64"
        return "bfloat16" if act_dtype == torch.bfloat16 else "tf32"
    if accum not in ACCUM_SCHEMES:
        raise ValueError(f"accumulation scheme must be auto or one of {ACCUM_SCHEMES}, got {accum!r}")
    return accum


def round_tf32(t: torch.Tensor) -> torch.Tensor:
    """float32 ``t`` rounded to TF32 (10-bit mantissa, round to nearest) as the tensor cores read it."""
    i = t.float().contiguous().view(torch.int32)
    return ((i + 0x1000) & ~0x1FFF).view(torch.float32)


@contextlib.contextmanager
def _cuda_tf32(enabled: bool):
    prev = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = enabled
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev


def chunk_products(A: torch.Tensor, R: torch.Tensor, scheme: str) -> torch.Tensor:
    """``Aᵀ R`` in float64 for ``A: (n, p)``, ``R: (n, q)`` under one accumulation ``scheme``
    (float64 tensors for ``float64``, bf16 or float32 for ``bfloat16``, float32 otherwise)."""
    if scheme == "float64":
        return A.T @ R
    cuda = A.is_cuda
    if scheme == "bfloat16":
        Ab, Rb = A.to(torch.bfloat16), R.to(torch.bfloat16)
        if cuda:
            try:
                return torch.mm(Ab.T, Rb, out_dtype=torch.float32).double()
            except (RuntimeError, TypeError):  # older torch: same numbers via float32 products
                pass
        A, R = Ab.float(), Rb.float()  # bf16 x bf16 products are exact in float32
    elif scheme == "tf32" and not cuda:
        A, R = round_tf32(A), round_tf32(R)
    if cuda:
        with _cuda_tf32(scheme == "tf32"):
            return (A.T @ R).double()
    return (A.T @ R).double()


#: Row-block width of :func:`gram_products` on CPU (``python benchmarks/gram.py``, one thread, 2,048 rows, float64;
#: ``results/bench/gram_cpu.md``): 0.91 / 0.98 / 0.90 of the one GEMM's time for ``[x, 1]`` at d = 576 / 640 / 2048,
#: 0.87 / 0.87 / 0.82 for the joint map's ``[x, m, 1]``; 128-wide blocks are slower than the one GEMM.
GRAM_BLOCK = 256


def gram_products(R: torch.Tensor, p: int, scheme: str, block: int = GRAM_BLOCK) -> torch.Tensor:
    """``R[:, :p]ᵀ R`` in float64, ``(p, q)``, for ``R: (n, q)``, ``p ≤ q``, under one accumulation ``scheme``.

    Its leading ``(p, p)`` block is a Gram matrix, hence symmetric: on CPU the columns ``[0, p)`` are cut into
    ``k ≈ p / block`` row blocks, each multiplied only against the columns from its own start on
    (``R[:, s:e]ᵀ R[:, s:]``), and the blocks below the diagonal are the transposes of those above:
    ``p²(k+1)/2k + p(q−p)`` products instead of ``pq`` (the joint map's ``[x, m, 1]ᵀ[x, m, 1, Δ]``, 6d² a token,
    falls to about 4.4d² at d = 640). The same sums up to float rounding, and ``G`` exactly symmetric between
    blocks. On CUDA (not measured there) and for ``k = 1``: the one GEMM.
    """
    k = max(1, round(p / block))
    if k == 1 or R.device.type != "cpu":
        return chunk_products(R[:, :p], R, scheme)
    edges = [round(i * p / k) for i in range(k + 1)]
    P = torch.empty(p, R.shape[1], dtype=torch.float64, device=R.device)
    for s, e in zip(edges[:-1], edges[1:]):
        P[s:e, s:] = chunk_products(R[:, s:e], R[:, s:], scheme)
    for s, e in zip(edges[:-1], edges[1:]):
        P[e:p, s:e] = P[s:e, e:p].T
    return P


def add_gram_products(R: torch.Tensor, p: int, scheme: str, G: torch.Tensor, C: torch.Tensor,
                      block: int = GRAM_BLOCK) -> bool:
    """``G += R[:, :p]ᵀ R[:, :p]`` and ``C += R[:, :p]ᵀ R[:, p:]``: the sums :func:`gram_products` gives, added as each
    row block is computed, so its ``(p, q)`` float64 temporary never exists (1 GB a batch at d = 8192; one
    ``(block, q)`` block instead). Each element gets the same one addition: bit for bit ``G += P[:, :p]``.
    Row ``p − 1`` of the products (column ``p − 1`` of ``R`` is the ones column: ``[Σx, N, ΣΔ]``) tells whether an
    input is not finite: then nothing is added and False returned (on CPU from ``R``'s column sums, before any
    block)."""
    k = max(1, round(p / block))
    if k == 1 or R.device.type != "cpu":
        P = chunk_products(R[:, :p], R, scheme)
        if not torch.isfinite(P[p - 1]).all():
            return False
        G += P[:, :p]
        C += P[:, p:]
        return True
    if not torch.isfinite(R.sum(0)).all():
        return False
    edges = [round(i * p / k) for i in range(k + 1)]
    for s, e in zip(edges[:-1], edges[1:]):
        B = chunk_products(R[:, s:e], R[:, s:], scheme)   # rows [s, e) of the products, columns [s, q)
        G[s:e, s:] += B[:, :p - s]
        G[e:p, s:e] += B[:, e - s:p - s].T                 # the blocks below the diagonal: transposes
        C[s:e] += B[:, p - s:]
    return True


class RidgeStats:
    """Streaming ``G = [X,1]ᵀ[X,1]``, ``C = [X,1]ᵀΔ`` and ``Σ‖Δ‖²`` for one site (see module doc).

    ``accum_dtype`` is the accumulation scheme (module doc): ``"float64"`` (default), ``"float32"``,
    ``"tf32"``, ``"bfloat16"``, ``"auto"`` (resolved per batch from the activations' device and
    dtype; the scheme used is kept in :attr:`scheme`), or the ``torch.dtype`` of the same name.
    Reduced-precision schemes work on chunks of at most ``chunk_tokens`` tokens.
    ``buffer`` (optional, 1-D float64 of length :meth:`numel`) lets many sites share one flat
    buffer so a single all-reduce syncs them all.
    """

    def __init__(self, dim: int, name: str = "site", device=None, accum_dtype: str | torch.dtype = torch.float64,
                 chunk_tokens: int = 4096, buffer: torch.Tensor | None = None, out_dim: int | None = None):
        out_dim = dim if out_dim is None else out_dim
        self.dim, self.out_dim, self.name = dim, out_dim, name
        self.accum_dtype, self.chunk_tokens = accum_dtype, chunk_tokens
        resolve_accum(accum_dtype, "cpu", torch.float32)  # validate early
        self.scheme: str | None = None
        """The scheme the last batch was accumulated with (``auto`` resolved)."""
        if buffer is None:
            buffer = torch.zeros(self.numel(dim, out_dim), dtype=torch.float64, device=device)
        assert buffer.dtype == torch.float64 and buffer.numel() == self.numel(dim, out_dim)
        self.buffer = buffer
        d1 = dim + 1
        self.G = buffer[: d1 * d1].view(d1, d1)
        self.C = buffer[d1 * d1: d1 * d1 + d1 * out_dim].view(d1, out_dim)
        self.yy = buffer[-1:]

    @staticmethod
    def numel(dim: int, out_dim: int | None = None) -> int:
        return (dim + 1) ** 2 + (dim + 1) * (dim if out_dim is None else out_dim) + 1

    @property
    def num_tokens(self) -> int:
        return int(round(self.G[-1, -1].item()))

    @torch.no_grad()
    def add_batch(self, x: torch.Tensor, delta: torch.Tensor) -> None:
        """Accumulate real tokens ``x, delta: (N, d)`` (any float dtype; padding already removed).

        Non-finite inputs raise :class:`SolveError`. They are detected from the products' row of the
        ones column, ``[Σx, N, ΣΔ]``, which is non-finite exactly when an input is (barring an
        overflow of the sums themselves), instead of a separate ``isfinite`` pass over ``(N, d)``
        (measured: as costly as the float64 GEMM itself on CPU).
        """
        if (x.ndim != 2 or delta.ndim != 2 or x.shape[0] != delta.shape[0] or x.shape[1] != self.dim
                or delta.shape[1] != self.out_dim):
            raise ValueError(f"{self.name}: expected x of shape (N, {self.dim}) and delta of shape (N, {self.out_dim}), "
                             f"got {tuple(x.shape)}, {tuple(delta.shape)}")
        if x.shape[0] == 0:
            return
        self.scheme = scheme = resolve_accum(self.accum_dtype, x.device, x.dtype)
        work = {"float64": torch.float64, "bfloat16": torch.bfloat16}.get(scheme, torch.float32)
        step = x.shape[0] if scheme == "float64" else self.chunk_tokens
        d1 = self.dim + 1
        for s in range(0, x.shape[0], step):
            xa = x[s: s + step]
            R = torch.cat([xa, xa.new_ones(xa.shape[0], 1), delta[s: s + step]], dim=1).to(work)  # [X, 1, Δ]
            if not add_gram_products(R, d1, scheme, self.G, self.C):  # [X, 1]ᵀ [X, 1, Δ]   (d+1, 2d+1)
                raise SolveError(
                    f"{self.name}: non-finite activations (inf/NaN) in the calibration pass. The model overflows "
                    "in its current dtype: load it in float32 (--model.dtype float32) or check the input data."
                )
        self.yy += torch.linalg.vector_norm(delta, dtype=torch.float64).square()

    def relative_error(self, W: torch.Tensor, b: torch.Tensor) -> float:
        """``‖Δ − Δ̂‖² / ‖Δ‖²`` of the map ``Δ̂ = x Wᵀ + b`` on the accumulated data, from the statistics alone:
        ``‖Δ‖² − 2 tr(BᵀC) + tr(BᵀGB)`` with ``B = [Wᵀ; bᵀ]``."""
        B = torch.cat([W.T, b[None]], dim=0).to(torch.float64)
        yy = self.yy.item()
        GB = self.G @ B
        sse = yy - 2 * (B * self.C).sum().item() + GB.mul_(B).sum().item()  # in place: one temporary fewer
        return max(sse, 0.0) / yy if yy > 0 else float("nan")


class ResidualMeter:
    """The held-out error of a map known before the pass, ``‖Δ − Δ̂‖² / ‖Δ‖²`` with ``Δ̂ = x Wᵀ + b``, accumulated
    directly: ``buffer = [Σ‖Δ − Δ̂‖², Σ‖Δ‖², N]`` (float64; three numbers a site instead of :class:`RidgeStats`'
    d² sums, and no cancellation). ``W: (d_out, d_in)``, ``b: (d_out,)``; the same ``add_batch`` as
    :class:`RidgeStats`."""

    def __init__(self, W: torch.Tensor, b: torch.Tensor, name: str = "site", buffer: torch.Tensor | None = None):
        self.W, self.b, self.name = W.to(torch.float64), b.to(torch.float64), name
        self.buffer = torch.zeros(3, dtype=torch.float64, device=W.device) if buffer is None else buffer

    @torch.no_grad()
    def add_batch(self, x: torch.Tensor, delta: torch.Tensor) -> None:
        """Real tokens ``x: (N, d_in)``, ``delta: (N, d_out)`` (padding already removed)."""
        d = delta.to(torch.float64)
        r = d - torch.addmm(self.b.to(d.device), x.to(torch.float64), self.W.to(d.device).T)
        self.buffer += torch.stack([r.square().sum(), d.square().sum(), d.new_tensor(float(d.shape[0]))])

    @property
    def num_tokens(self) -> int:
        return int(round(self.buffer[2].item()))

    def relative_error(self) -> float:
        sse, yy = self.buffer[0].item(), self.buffer[1].item()
        return sse / yy if yy > 0 else float("nan")


@dataclass
class Solution:
    """``Δ̂ = x Wᵀ + b`` with ``W = U Vᵀ`` when low rank. All float64."""

    W: torch.Tensor             # (d, d); (d, d_in) from a rectangular ridge_solve
    b: torch.Tensor             # (d,)
    U: torch.Tensor | None      # (d, r) or None for full rank
    V: torch.Tensor | None      # (d, r)
    lam: float                  # absolute damping added to the diagonal
    kind: str                   # "residual": W is the residual map; "affine": W is A in y = x Aᵀ + c
    info: dict = field(default_factory=dict)  # what the solver wants reported (e.g. a guard's choice)
    T: torch.Tensor | None = None  # (d, d): a map m ↦ m T on the MLP branch before the span that goes WITH the adapter

    def delta_map(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The fitted residual update as ``Δ̂ = x W_Δᵀ + b`` (``W_Δ = A − I`` for the affine kind)."""
        if self.kind == "affine":
            return self.W - torch.eye(self.W.shape[0], dtype=self.W.dtype, device=self.W.device), self.b
        return self.W, self.b


def ridge_solve(stats: RidgeStats, damping: float = 1e-4, rank: int | None = None, kind: str = "residual",
                bias: bool = True, dtype: torch.dtype = torch.float64, groups: tuple[int, ...] | None = None) -> Solution:
    """Closed-form ridge (optionally reduced-rank) fit of the site's statistics; see module doc.

    ``kind="residual"`` fits Δ ≈ x Wᵀ + b (adapter y = x + x Wᵀ + b, shrinks towards identity);
    ``kind="affine"`` fits the block output y = x + Δ ≈ x Aᵀ + c (ablation, shrinks A towards 0).
    ``bias=False`` fits without intercept (``b = 0``): the statistics are used uncentred,
    ``Wᵀ = (XᵀX + λI)⁻¹ XᵀΔ`` with ``λ = damping · mean(diag(XᵀX))``.
    ``dtype``: float64 (always, in the library); float32 exists to measure what float64 costs
    (``benchmarks/solve.py``). ``groups``: sizes of consecutive blocks of input features (summing to
    ``stats.dim``), each damped relative to its own mean variance (features of different scales, e.g.
    ``[x, m]``); the returned ``lam`` is the first block's. ``rank`` with groups constrains the first
    group's coefficients only (the others refitted given them; module doc); ``U Vᵀ`` is then that
    ``(d_out, groups[0])`` block of ``W``.
    """
    Sxx, Sxy, mx, my, n = _centred(stats, kind, bias, dtype)
    if not (math.isfinite(damping) and damping > 0):  # the configs refuse it first; a direct call too
        raise SolveError(f"{stats.name}: the relative damping must be a finite number > 0, got {damping}")
    d = stats.dim
    groups = groups or (d,)
    if sum(groups) != d or min(groups) < 1:
        raise ValueError(f"{stats.name}: feature groups {groups} do not partition {d} inputs")
    lams = [damping * part.mean().clamp_min(1e-12) for part in Sxx.diagonal().split(list(groups))]
    H = Sxx                                            # XcᵀXc + λI, in place (Sxx is not needed after)
    H.diagonal().add_(torch.cat([lv.expand(n_) for lv, n_ in zip(lams, groups)]))
    L, info = torch.linalg.cholesky_ex(H)
    if info.item() != 0:
        raise SolveError(
            f"{stats.name}: Cholesky failed (XᵀX + λI not positive definite with relative damping {damping:g}, "
            f"{int(n.item())} tokens). Increase --calibration.damping (e.g. {max(damping * 100, 1e-4):g}) or use "
            "more calibration tokens."
        )
    low_rank = rank is not None and rank < groups[0]   # the rank constrains B's first group's rows
    if not low_rank or groups[0] == d:                 # H is not read again: freed before the solve copies L and Sxy
        del H, Sxx
    B = torch.cholesky_solve(Sxy, L)                   # Wᵀ = (XᵀX + λI)⁻¹ XᵀΔ   (d, d_out)
    U = V = None
    if low_rank:
        B, U, V = _reduce_rank(B, H if groups[0] != d else None, Sxy, groups[0], rank)
    W = B.T.contiguous()
    b = my - W @ mx
    return Solution(W, b, U, V, float(lams[0]), kind)

def _centred(stats: RidgeStats, kind: str, bias: bool, dtype: torch.dtype):
    """``(Sxx, Sxy, mean x, mean target, tokens)``: the site's statistics checked and centred (uncentred without
    ``bias``), ``Sxx`` symmetrised; the target is Δ (``kind="residual"``) or ``x + Δ`` (``"affine"``)."""
    G, C, d = stats.G.to(dtype), stats.C.to(dtype), stats.dim
    if kind == "affine" and stats.out_dim != d:
        raise ValueError(f"{stats.name}: the affine kind needs targets as wide as the inputs")
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
    Sxx = Sxx.add_(Sxx.T.contiguous()).mul_(0.5)     # symmetric (in place: one d² temporary, not two)
    return Sxx, Sxy, mx, my, n


def _reduce_rank(B: torch.Tensor, H: torch.Tensor | None, Sxy: torch.Tensor, k: int, rank: int):
    """The reduced-rank fit (module doc): ``B``'s first ``k`` rows ``A`` replaced by their best rank-``rank``
    approximation in ``H``'s metric, ``A' = V Uᵀ``; the other rows refitted given ``A'`` (``H`` is read only when ``k`` is
    not all of them: None otherwise). Returns ``(B', U, V)``."""
    A, d = B[:k], B.shape[0]
    if k == d:
        M = A.T @ Sxy                                  # Aᵀ H A   (d_out, d_out), symmetric PSD
    else:                                              # Aᵀ (H/H₂₂) A with the Schur complement H/H₂₂
        L2 = torch.linalg.cholesky(H[k:, k:])
        M = A.T @ (H[:k, :k] - H[:k, k:] @ torch.cholesky_solve(H[k:, :k], L2)) @ A
    evals, evecs = torch.linalg.eigh(0.5 * (M + M.T))
    Pr = evecs[:, -rank:]                              # top-r eigenvectors
    U, V = Pr, A @ Pr                                  # A' = V Prᵀ (W's first block = U Vᵀ)
    A = V @ Pr.T
    # the other groups refitted given A': B₂ = H₂₂⁻¹ (S₂ − H₂₁ A')
    return (A if k == d else torch.cat([A, torch.cholesky_solve(Sxy[k:] - H[k:, :k] @ A, L2)])), U, V

