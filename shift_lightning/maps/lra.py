"""Linear Residual Adapters (LRA).

An LRA replaces one or more removed blocks by an affine map of the hidden state::

    residual (default):  y = x + x Wᵀ + b          W: (d, d) or low rank W = U Vᵀ, U, V: (d, r)
    affine (ablation):   y = x Aᵀ + c              no identity path; fitted to the block output
    bias=False:          b (or c) is absent        "Ghosted Layers"-style I + M (residual, no bias),
                                                   or LinearPatch's P = H D Hᵀ (affine, no bias)

Parameters: full rank d² + d, low rank 2dr + d. Any LRA is the affine map ``y = M x + c`` with
``M = I + W`` (residual) or ``M = A`` (affine), so consecutive adapters merge exactly::

    (M₂, c₂) ∘ (M₁, c₁) = (M₂ M₁, M₂ c₁ + c₂)
    residual: W = (I + W₂)(I + W₁) − I,  b = (I + W₂) b₁ + b₂

and two low-rank residual adapters merge into one of rank r₁ + r₂ without forming W::

    (I + U₂V₂ᵀ)(I + U₁V₁ᵀ) − I = [U₁ + U₂(V₂ᵀU₁), U₂] [V₁, V₂]ᵀ
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn

from ..errors import ConfigError


@dataclass(frozen=True)
class AdapterSpec:
    """Shape of one adapter: ``kind`` in {"residual", "affine"}; ``rank`` None = full rank;
    ``bias`` False: no bias term."""

    dim: int
    kind: Literal["residual", "affine"] = "residual"
    rank: int | None = None
    bias: bool = True

    def __post_init__(self):
        if not isinstance(self.dim, int) or self.dim < 1:
            raise ConfigError(f"adapter dim must be a positive integer, got {self.dim!r}")
        if self.kind not in ("residual", "affine"):
            raise ConfigError(f"adapter kind must be 'residual' or 'affine', got {self.kind!r}")
        if self.rank is not None and not (1 <= self.rank <= self.dim):
            raise ConfigError(f"adapter rank must be in [1, {self.dim}] or None (full), got {self.rank}")
        if self.kind == "affine" and self.rank is not None:
            raise ConfigError("the affine ablation is full rank only (rank must be None)")

    @property
    def low_rank(self) -> bool:
        return self.rank is not None and self.rank < self.dim

    def to_dict(self) -> dict:
        return {"dim": self.dim, "kind": self.kind, "rank": self.rank, "bias": self.bias}


class LinearResidualAdapter(nn.Module):
    """``y = x + x Wᵀ + b`` (residual) or ``y = x Aᵀ + c`` (affine); shapes ``x, y: (..., d)``.

    Full rank keeps one ``nn.Linear(d, d)`` (``self.linear``: weight W or A, bias b or c).
    Low rank keeps ``self.down = nn.Linear(d, r, bias=False)`` (weight Vᵀ) and
    ``self.up = nn.Linear(r, d)`` (weight U, bias b): ``W = U Vᵀ``.
    A fresh adapter is the identity map (W = 0, b = 0 or A = I, c = 0).
    """

    def __init__(self, spec: AdapterSpec, dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.spec = spec
        d, kw = spec.dim, dict(dtype=dtype, device=device)
        if spec.low_rank:
            self.down = nn.Linear(d, spec.rank, bias=False, **kw)
            self.up = nn.Linear(spec.rank, d, bias=spec.bias, **kw)
            nn.init.zeros_(self.up.weight)
        else:
            self.linear = nn.Linear(d, d, bias=spec.bias, **kw)
            if spec.kind == "affine":
                with torch.no_grad():
                    self.linear.weight.copy_(torch.eye(d))
            else:
                nn.init.zeros_(self.linear.weight)
        if self.bias is not None:
            nn.init.zeros_(self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to(self.param_dtype)
        y = self.up(self.down(h)) if self.spec.low_rank else self.linear(h)
        if self.spec.kind == "residual":
            y = h + y
        return y.to(dtype)

    # -- parameters as matrices --------------------------------------------------------------
    @property
    def bias(self) -> torch.Tensor | None:
        return self.up.bias if self.spec.low_rank else self.linear.bias

    @property
    def param_dtype(self) -> torch.dtype:
        return (self.up if self.spec.low_rank else self.linear).weight.dtype

    def weight_matrix(self) -> torch.Tensor:
        """W (residual) or A (affine) as a dense ``(d, d)`` matrix."""
        return self.up.weight @ self.down.weight if self.spec.low_rank else self.linear.weight

    def affine(self, dtype=torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
        """The map as ``(M, c)`` with ``y = M x + c`` (M: (d, d), c: (d,)), in ``dtype``."""
        M = self.weight_matrix().detach().to(dtype)
        if self.spec.kind == "residual":
            M = M + torch.eye(M.shape[0], dtype=dtype, device=M.device)
        c = self.bias.detach().to(dtype) if self.bias is not None else torch.zeros(M.shape[0], dtype=dtype,
                                                                                     device=M.device)
        return M, c

    @torch.no_grad()
    def set_full(self, W: torch.Tensor, b: torch.Tensor | None) -> None:
        """Load a dense ``W`` (or A) ``(d, d)`` and ``b`` ``(d,)`` into a full-rank adapter
        (``b`` must be None or zero for an adapter without bias)."""
        assert not self.spec.low_rank
        self.linear.weight.copy_(W)
        self._set_bias(b)

    def _set_bias(self, b: torch.Tensor | None) -> None:
        if self.bias is not None:
            self.bias.copy_(b if b is not None else torch.zeros_like(self.bias))
        elif b is not None and bool(b.abs().max() > 0):
            raise ValueError("this adapter has no bias term; got a non-zero bias")

    @torch.no_grad()
    def set_low_rank(self, U: torch.Tensor, V: torch.Tensor, b: torch.Tensor) -> None:
        """Load ``W = U Vᵀ`` with ``U, V: (d, r)`` and ``b: (d,)``."""
        assert self.spec.low_rank and U.shape[1] == self.spec.rank == V.shape[1]
        self.up.weight.copy_(U)
        self.down.weight.copy_(V.T)
        self._set_bias(b)

    def extra_repr(self) -> str:
        return f"dim={self.spec.dim}, kind={self.spec.kind}, rank={self.spec.rank or 'full'}, bias={self.spec.bias}"


def merge_adapters(first: LinearResidualAdapter, second: LinearResidualAdapter) -> LinearResidualAdapter:
    """One adapter equal to ``second(first(x))`` exactly (computed in float64).

    residual∘residual stays residual (low rank if both are, rank r₁ + r₂, capped at d);
    anything involving an affine adapter gives an affine adapter.
    """
    s1, s2 = first.spec, second.spec
    d = s1.dim
    assert s2.dim == d
    ref = (first.up if s1.low_rank else first.linear).weight
    f64 = dict(dtype=torch.float64, device=ref.device)
    bias = s1.bias or s2.bias
    if s1.kind == s2.kind == "residual" and s1.low_rank and s2.low_rank and s1.rank + s2.rank < d:
        U1, V1 = first.up.weight.detach().to(**f64), first.down.weight.detach().T.to(**f64)
        U2, V2 = second.up.weight.detach().to(**f64), second.down.weight.detach().T.to(**f64)
        b1, b2 = first.affine()[1], second.affine()[1]
        U = torch.cat([U1 + U2 @ (V2.T @ U1), U2], dim=1)
        V = torch.cat([V1, V2], dim=1)
        b = b1 + U2 @ (V2.T @ b1) + b2
        out = LinearResidualAdapter(AdapterSpec(d, "residual", s1.rank + s2.rank, bias), dtype=ref.dtype,
                                    device=ref.device)
        out.set_low_rank(U, V, b if bias else None)
        return out
    M1, c1 = first.affine()
    M2, c2 = second.affine()
    M, c = M2 @ M1, M2 @ c1 + c2
    kind = "residual" if s1.kind == s2.kind == "residual" else "affine"
    if kind == "residual":
        M = M - torch.eye(d, **f64)
    out = LinearResidualAdapter(AdapterSpec(d, kind, None, bias), dtype=ref.dtype, device=ref.device)
    out.set_full(M, c if bias else None)
    return out
