"""The peer methods' maps, fitted on the same calibration windows as the LRA. Framework-free.

Every map below replaces a contiguous span of removed blocks ``[s, e)``; ``x`` is the hidden state
entering block ``s`` and ``Δ = h_e − x`` what the span added to the residual stream (row vectors,
``(N, d)``; the statistics are :class:`~shift_lightning.maps.ridge.RidgeStats` or :class:`ChannelScaleStats`):

* **no bias** (the closed-form ``I + M`` of "Ghosted Layers", arXiv 2605.15491): ``y = x + x Wᵀ``,
  ``Wᵀ = (XᵀX + λI)⁻¹ XᵀΔ`` uncentred — an LRA without ``b`` (``ridge_solve(bias=False)``).
* **generic affine** (the paper's ablation): ``y = x Aᵀ + c`` fitted to the block output, no
  identity path (``ridge_solve(kind="affine")``).
* **ReplaceMe**, least-squares variant (arXiv 2505.02819; mts-ai/ReplaceMe ``lstsq.py``): with
  ``m`` the MLP branch output of block ``s−1`` (what that block adds to the residual after its
  attention), ReplaceMe solves ``r + m T ≈ h_e`` with ``r = x − m``, i.e. ``m T ≈ m + Δ``,
  ``T = (mᵀm + λI)⁻¹ mᵀ(m + Δ)``, no bias, and folds ``T`` into block ``s−1``:
  ``down_proj.weight ← Tᵀ · down_proj.weight`` (nn.Linear stores ``(out, in)``), so the corrected
  model is a stock HF model. Here it is ``ridge_solve(kind="affine", bias=False)`` on statistics
  of ``(m, Δ)`` (``A = Tᵀ``). Differences from the reference code, on purpose: padding tokens are
  masked out of ``mᵀm`` (the reference includes them), and the solve is Cholesky with relative
  damping (the reference uses ``inv`` with α = 0). A span starting at block 0 has no block to fold
  into and stays uncorrected. Families with a norm after the MLP (Gemma3's
  ``post_feedforward_layernorm``) cannot fold ``T`` into ``down_proj``; there ``T`` is applied to
  the normed branch output (:class:`BranchMap`), the same function, saved and reloaded by
  :mod:`~shift_lightning.maps.surgery`.
* **LinearPatch**, training-free (arXiv 2505.24680; chenxinrui-tsinghua/LinearPatch): at the
  pruning interface ``y = x P`` with ``P = H D Hᵀ``, ``H`` a normalised Hadamard matrix and ``D``
  the per-channel scaling ``s_k = mean over windows of [mean_t |(y H)_k| / mean_t |(x H)_k|]``
  (``y = x + Δ``; the mean of per-window ratios, as the reference computes it). No bias, not fused
  into a weight (``d²`` parameters, an affine adapter without bias, ``A = Pᵀ = P``). Our Hadamard
  matrices come from Sylvester and Paley constructions (:func:`hadamard`); the reference uses
  QuIP#'s stored matrices — any normalised Hadamard matrix is a valid ``H``, but ``D`` and hence
  ``P`` depend on which one, so numbers are close to, not identical with, the reference's. Every
  entry of ``H`` is ``±1/√d``, so on a residual stream whose energy sits in a few massive channels a
  non-uniform ``D`` writes a share of those channels into every other one
  (``experiments/checks/linearpatch_check.py`` measures it on the grid's spans).
"""

from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import nn

from ..errors import ConfigError


# --------------------------------------------------------------------------------------------
# Hadamard matrices
# --------------------------------------------------------------------------------------------
def _is_prime(q: int) -> bool:
    return q > 1 and all(q % p for p in range(2, int(math.isqrt(q)) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """``Q[i, j] = χ(j − i)`` with χ the quadratic character of GF(q), q prime."""
    squares = {(i * i) % q for i in range(1, q)}
    chi = torch.tensor([0] + [1 if a in squares else -1 for a in range(1, q)], dtype=torch.float64)
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def _paley(order: int) -> torch.Tensor | None:
    """A ±1 Hadamard matrix of ``order`` from Paley's constructions over a prime field, or None."""
    q = order - 1
    if _is_prime(q) and q % 4 == 3:  # Paley I: order q + 1
        Q = _jacobsthal(q)
        H = torch.ones(order, order, dtype=torch.float64)
        H[1:, 0] = -1
        H[1:, 1:] = Q + torch.eye(q, dtype=torch.float64)
        return H
    q = order // 2 - 1
    if order % 2 == 0 and _is_prime(q) and q % 4 == 1:  # Paley II: order 2(q + 1)
        Q = _jacobsthal(q)
        C = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        C[0, 1:] = 1
        C[1:, 0] = 1
        C[1:, 1:] = Q
        A = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
        B = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
        I = torch.eye(q + 1, dtype=torch.float64)
        return torch.kron(C, A) + torch.kron(I, B)
    return None


@lru_cache(maxsize=8)
def hadamard(d: int) -> torch.Tensor:
    """Normalised Hadamard matrix ``(d, d)`` float64, ``H Hᵀ = I``, entries ``±1/√d``.

    ``d = K · 2^m`` with a Paley matrix of order ``K`` (e.g. 576 = 36·16, 640 = 20·32,
    896 = 28·32, 960 = 60·16) and Sylvester doubling; raises :class:`ConfigError` otherwise.
    """
    m = 0
    while d % (2 ** (m + 1)) == 0:
        m += 1
    for j in range(m, -1, -1):  # try the largest power of two first
        K = d // (2 ** j)
        base = torch.ones(1, 1, dtype=torch.float64) if K == 1 else (
            torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64) if K == 2 else _paley(K))
        if base is not None:
            H = base
            for _ in range(j):
                H = torch.kron(H, torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64))
            return H / math.sqrt(d)
    raise ConfigError(f"No Hadamard matrix of order {d} is known here (need d = K·2^m with a Paley order K); "
                      "LinearPatch cannot be used at this hidden size")


# --------------------------------------------------------------------------------------------
# LinearPatch
# --------------------------------------------------------------------------------------------
class ChannelScaleStats:
    """LinearPatch's channel scaling in the Hadamard basis, as streaming sums.

    Per window ``b`` (its real tokens ``t``): ``r_b[k] = mean_t |(y_t H)_k| / mean_t |(x_t H)_k|``;
    we keep ``Σ_b r_b`` ``(d,)`` and the number of windows, float64 (plain sums: one all-reduce
    syncs ranks). ``scale()`` is their mean, ``s``.
    """

    def __init__(self, dim: int, name: str = "site", device=None, buffer: torch.Tensor | None = None):
        self.dim, self.name = dim, name
        if buffer is None:
            buffer = torch.zeros(self.numel(dim), dtype=torch.float64, device=device)
        assert buffer.dtype == torch.float64 and buffer.numel() == self.numel(dim)
        self.buffer = buffer
        self.ratio_sum, self.windows = buffer[:dim], buffer[dim:]
        self._H: torch.Tensor | None = None

    @staticmethod
    def numel(dim: int) -> int:
        return dim + 1

    @torch.no_grad()
    def add_batch(self, x: torch.Tensor, y: torch.Tensor, mask: torch.Tensor) -> None:
        """``x, y: (B, T, d)`` span input and output; ``mask: (B, T)`` real tokens."""
        if self._H is None or self._H.device != x.device:
            self._H = hadamard(self.dim).to(x.device)
        m = mask.to(torch.float64)[..., None]
        ax = ((x.double() @ self._H).abs() * m).sum(1)  # (B, d)
        ay = ((y.double() @ self._H).abs() * m).sum(1)
        ok = mask.any(1)
        ratio = torch.where(ax > 0, ay / ax.clamp_min(1e-300), torch.ones_like(ay))
        self.ratio_sum += ratio[ok].sum(0)
        self.windows += ok.sum()

    def scale(self) -> torch.Tensor:
        n = float(self.windows.item())
        if n < 1:
            raise ConfigError(f"{self.name}: no calibration windows reached LinearPatch's statistics")
        return self.ratio_sum / n


def linearpatch_matrix(scale: torch.Tensor) -> torch.Tensor:
    """``P = H diag(s) Hᵀ`` ``(d, d)`` float64 (symmetric): the patch ``y = x P``."""
    H = hadamard(scale.shape[0]).to(scale.device)
    return (H * scale[None, :]) @ H.T


# --------------------------------------------------------------------------------------------
# ReplaceMe: the map on block s−1's MLP branch
# --------------------------------------------------------------------------------------------
class BranchMap(nn.Module):
    """``norm`` followed by ``x ↦ x Tᵀ`` (nn.Linear without bias): ReplaceMe's map on a normed MLP
    branch (Gemma3's ``post_feedforward_layernorm``), where it cannot be folded into a weight."""

    def __init__(self, norm: nn.Module, T: torch.Tensor):
        super().__init__()
        self.norm = norm
        p = next(norm.parameters())
        dev = T.device if p.is_meta else p.device  # an onloaded skeleton's norm is meta until read: the map is not
        self.map = nn.Linear(T.shape[0], T.shape[0], bias=False, dtype=p.dtype, device=dev)
        with torch.no_grad():
            self.map.weight.copy_(T.T)

    def forward(self, x):
        return self.map(self.norm(x))


def fold_replaceme(block: nn.Module, T: torch.Tensor) -> None:
    """Apply ReplaceMe's ``T`` ``(d, d)`` (``m ↦ m T``) to ``block``'s MLP branch, in place.

    Folded into ``mlp.down_proj`` (``W ← Tᵀ W``, computed in float64) when the MLP output goes
    straight into the residual stream; wrapped around the post-MLP norm otherwise.
    """
    if hasattr(block, "post_feedforward_layernorm"):
        block.post_feedforward_layernorm = BranchMap(block.post_feedforward_layernorm, T)
        return
    lin = block.mlp.down_proj
    with torch.no_grad():
        W = lin.weight.detach().double()
        lin.weight.copy_((T.to(W).T @ W).to(lin.weight.dtype))
        if lin.bias is not None:
            lin.bias.copy_((lin.bias.double() @ T.to(W)).to(lin.bias.dtype))
