"""The do-no-harm guard (``guarded``): per span, the map that keeps the model closest to the original.

A map fitted to the removed blocks' update on calibration text can still move the model away from
the original elsewhere (a shifted yes/no prior, another domain). Reconstruction error cannot see
that (``lra_guard`` chooses by it and does not remove a single negative gain in the paper grid), so
this guard judges by what a user cares about: the next-token KL to the original model.

Every ``heldout_every``-th calibration window is held out. On the others the guard fits, per span,
the candidates

    none (plain pruning) · the LRA at each relative damping of ``--calibration.guard_path``
    (its ridge path, shrinking towards none) · the LRA at each rank of ``--calibration.guard_ranks``
    (opt-in; the optimal reduced-rank fit, another shrinkage) · the LRA without bias · ReplaceMe
    (least squares) · with ``--calibration.guard_extra '[span_lra]'``, at a span of two or more blocks:
    ``lra@span``, ONE LRA
    fitted to the whole span's update ``h_end − x`` at once (what ``granularity: span`` fits; the
    merged per-block LRAs are fitted block by block on the original's inputs, so their product is not
    the least-squares map of the span; one more ``(d+1)²`` float64 statistic per such span) · with
    ``guard_extra: [lra_replaceme]``, ``lra+replaceme``: the span LRA and ReplaceMe's map fitted together
    (:mod:`.joint`; two more ``(2d+1)(3d+1)`` float64 statistics per span, all windows and held-out)

and, span after span (earlier spans at their chosen map, later spans at the plain LRA), runs the
pruned model on the held-out windows with each candidate in place and keeps the one with the
lowest mean ``KL(original ‖ model)`` (the original's top-``guard_topk`` distributions,
:mod:`shift_lightning.closeness`; ties go to the earlier candidate). The chosen map is then refitted
on all windows. The held-out windows are calibration text, never the evaluated data.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

from .base import Solver, register

if TYPE_CHECKING:
    from ..ridge import Solution
    from ...calibration.collect import SiteStatistics


class Candidate(NamedTuple):
    """One map the guard may choose for a span: ``solver`` None is plain pruning; ``damping``
    replaces ``--calibration.damping`` for this fit (None: keep it); ``rank`` None is full rank;
    ``span``: one map fitted per span instead of one per site, merged."""

    name: str
    solver: str | None
    damping: float | None = None
    rank: int | None = None
    span: bool = False


@register
class Guarded(Solver):
    name, label = "guarded", "+guarded"
    description = "the do-no-harm guard: per span, the map closest to the original on held-out calibration windows"
    span_only = True
    holdout = True
    needs = frozenset()

    @property
    def wraps(self) -> tuple[str, ...]:
        return ("lra", "nobias", "replaceme") + (("lra_replaceme",) if "lra_replaceme" in self.cfg.guard_extra else ())

    def candidates(self, dim: int) -> list[Candidate]:
        """The candidates in tie-breaking order (ranks ``≥ dim`` are the full-rank LRA: left out)."""
        out = [Candidate("none", None)]
        out += [Candidate(f"lra@{lam:g}", "lra", damping=lam) for lam in self.cfg.ridge_path()]
        out += [Candidate(f"lra@r{r}", "lra", rank=r) for r in self.cfg.guard_ranks or [] if r < dim]
        out += [Candidate("nobias", "nobias"), Candidate("replaceme", "replaceme")]
        out += [Candidate("lra@span", "lra", span=True)] if "span_lra" in self.cfg.guard_extra else []
        out += [Candidate("lra+replaceme", "lra_replaceme")] if "lra_replaceme" in self.cfg.guard_extra else []
        return out

    def fit(self, stats: SiteStatistics) -> Solution:  # pragma: no cover - orchestrated by the module
        raise NotImplementedError("the guard chooses among fitted maps with a judge pass; see CalibrationModule")
