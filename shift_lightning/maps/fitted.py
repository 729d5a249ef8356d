"""From solved maps to what the pruned model carries: adapters per span, ReplaceMe's branch maps.

* :func:`adapter_from` turns a :class:`~shift_lightning.maps.ridge.Solution` into a
  :class:`~shift_lightning.maps.lra.LinearResidualAdapter` (full or low rank, with or without bias);
* :class:`SpanMap` is what one span ends up with (an adapter, a branch map, or nothing);
* :class:`FittedMaps` is what a solver does to the whole pruned model (adapters by pruned position,
  branch maps by original block), applied by :func:`shift_lightning.maps.surgery.apply_maps`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .lra import AdapterSpec, LinearResidualAdapter, merge_adapters
from .ridge import Solution
from .sites import Site, pruned_positions


def adapter_from(sol: Solution, bias: bool, dtype: torch.dtype, rank: int | None = None) -> LinearResidualAdapter:
    """The adapter ``y = x + x Wᵀ + b`` (residual) or ``y = x Wᵀ + b`` (affine) of ``sol``."""
    d = sol.W.shape[0]
    r = rank if sol.U is not None else None
    a = LinearResidualAdapter(AdapterSpec(d, "affine" if sol.kind == "affine" else "residual", r, bias), dtype=dtype,
                              device=sol.W.device)
    if r:
        a.set_low_rank(sol.U, sol.V, sol.b if bias else None)
    else:
        a.set_full(sol.W, sol.b if bias else None)
    return a


def chain(adapters: list[nn.Module], merge: bool) -> nn.Module:
    """One module applying ``adapters`` in order: merged exactly into one adapter, or a chain."""
    if len(adapters) == 1:
        return adapters[0]
    if not merge:
        return nn.Sequential(*adapters)
    out = adapters[0]
    for a in adapters[1:]:
        out = merge_adapters(out, a)
    return out


def as_affine(adapter: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    """``(M, c)`` float64 with ``y = M x + c`` for an adapter or a chain of them."""
    mods = list(adapter) if isinstance(adapter, nn.Sequential) else [adapter]
    M, c = mods[0].affine()
    for a in mods[1:]:
        M2, c2 = a.affine()
        M, c = M2 @ M, M2 @ c + c2
    return M, c


@dataclass
class SpanMap:
    """What span ``span`` ends up with: an ``adapter`` on the hidden state entering the first kept
    block after it, ReplaceMe's ``branch`` map ``T: (d, d)`` on block ``span.start − 1``'s MLP
    branch, or neither (plain pruning). ``source``: the solver (or a guard's candidate) behind it."""

    span: Site
    adapter: nn.Module | None = None
    branch: torch.Tensor | None = None
    source: str = ""
    note: str | None = None
    down: tuple[torch.Tensor, torch.Tensor] | None = None
    """``(W (d, d_ff), b (d,))``: added to block ``span.start − 1``'s ``down_proj`` weight and bias (stock)."""
    embedding: tuple[torch.Tensor, torch.Tensor] | None = None
    """``(W (d, d), b (d,))``: a span at block 0's map ``x ↦ x + x Wᵀ + b`` folded into the embedding table."""


@dataclass
class FittedMaps:
    """What one solver does to the pruned model (see :func:`shift_lightning.maps.surgery.apply_maps`)."""

    solver: str
    adapters: dict[int, nn.Module] = field(default_factory=dict)
    """Pruned position -> adapter applied to the hidden state entering that block (or the final norm)."""
    branch_maps: dict[int, torch.Tensor] = field(default_factory=dict)
    """Original index of a kept block -> ReplaceMe's ``T`` ``(d, d)`` for its MLP branch."""
    notes: list[str] = field(default_factory=list)
    spans: list[SpanMap] = field(default_factory=list)
    down_maps: dict[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    """Original index of a kept block -> ``(W, b)`` added to its ``down_proj`` (the stock repair)."""
    embedding: tuple[torch.Tensor, torch.Tensor] | None = None
    """``(W, b)`` folded into the embedding table (the stock repair of a span at block 0)."""


def assemble(solver: str, maps: list[SpanMap], num_layers: int, removed: list[int]) -> FittedMaps:
    """The :class:`FittedMaps` of per-span maps."""
    pos = pruned_positions(num_layers, removed)
    c = FittedMaps(solver, spans=list(maps))
    for m in maps:
        if m.adapter is not None:
            c.adapters[pos[m.span.start]] = m.adapter
        if m.branch is not None:
            c.branch_maps[m.span.start - 1] = m.branch
        if m.down is not None:
            c.down_maps[m.span.start - 1] = m.down
        if m.embedding is not None:
            c.embedding = m.embedding
        if m.note:
            c.notes.append(m.note)
    return c
