"""The do-no-harm guard (``guarded``): per span, the map that keeps the model closest to the original.

A map fitted to the removed blocks' update on calibration text can still move the model away from
the original elsewhere (a shifted yes/no prior, another domain). Reconstruction error cannot see
that (``lra_guard`` chooses by it and does not remove a single negative gain in the paper grid), so
this guard judges by what a user cares about: the next-token KL to the original model.

Every ``heldout_every``-th calibration window is held out. On the others the guard fits, per span,
the candidates

    none (plain pruning) · the LRA at each relative damping of ``--calibration.guarded.path``
    (its ridge path, shrinking towards none) · the LRA at each rank of ``--calibration.guarded.ranks``
    (opt-in; the optimal reduced-rank fit, another shrinkage) · the LRA without bias · ReplaceMe
    (least squares) · with ``--calibration.guarded.extra '[span_lra]'``, at a span of two or more blocks:
    ``lra@span``, ONE LRA
    fitted to the whole span's update ``h_end − x`` at once (what ``granularity: span`` fits; the
    merged per-block LRAs are fitted block by block on the original's inputs, so their product is not
    the least-squares map of the span; one more ``(d+1)²`` float64 statistic per such span) · with
    ``guarded: {extra: [lra_replaceme]}``, ``lra+replaceme``: the span LRA and ReplaceMe's map fitted together
    (:mod:`.joint`; two more ``(2d+1)(3d+1)`` float64 statistics per span, all windows and held-out)

and, span after span (earlier spans at their chosen map, later spans at the plain LRA), runs the
pruned model on the held-out windows with each candidate in place and keeps the one with the
lowest mean ``KL(original ‖ model)`` (the original's top-``heldout_topk`` distributions,
:mod:`shift_lightning.closeness`; ties go to the earlier candidate). The chosen map is then refitted
on all windows. The held-out windows are calibration text, never the evaluated data.

The guard's own knobs are :class:`GuardKnobs` (``--calibration.guarded.*``).
"""

from __future__ import annotations

import math
import typing
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from ...errors import ConfigError
from .base import Solver, register

# No imports for type checking only in this module: jsonargparse runs them when it reads the knobs' dataclass for
# ``--help``, which must not import torch (the solver's signatures are the base class's).


#: Extra candidates the guard may choose (``--calibration.guarded.extra``).
GuardExtra = Literal["span_lra", "lra_replaceme"]


@dataclass
class GuardKnobs:
    """The ``guarded`` solver's candidates besides none / no bias / ReplaceMe (``--calibration.guarded.*``)."""

    extra: list[GuardExtra] = field(default_factory=list)
    """More candidates per span of two or more blocks: ``span_lra`` (one LRA for the whole span), ``lra_replaceme``
    (the joint map)."""
    path: list[float] | None = None
    """The LRA's ridge path: the relative dampings tried (``null``: ``[damping, 1e-2, 1, 100]``)."""
    ranks: list[int] | None = None
    """Adapter ranks tried besides the ridge path, each at ``damping`` (e.g. ``[128, 256]``; ``null``: none)."""

    def ridge_path(self, damping: float) -> list[float]:
        """The relative dampings of the LRA candidates (``damping``: the run's ``--calibration.damping``)."""
        return list(self.path) if self.path is not None else [damping, 1e-2, 1.0, 100.0]

    def validate(self) -> None:
        """Cheap checks (before any model is loaded)."""
        bad = [x for x in self.extra if x not in typing.get_args(GuardExtra)]
        if bad:
            raise ConfigError(f"--calibration.guarded.extra {bad}: choose from {list(typing.get_args(GuardExtra))}")
        if self.path is not None and (not self.path or any(not (math.isfinite(x) and x > 0) for x in self.path)):
            raise ConfigError(f"--calibration.guarded.path must be finite relative dampings > 0, got {self.path}")
        if self.ranks is not None and any(isinstance(r, bool) or not isinstance(r, int) or r < 1 for r in self.ranks):
            raise ConfigError(f"--calibration.guarded.ranks must be whole ranks >= 1 (or null), got {self.ranks}")

    def check_dim(self, dim: int) -> None:
        """A rank above the model's hidden size ``d`` is refused (once the model is loaded)."""
        bad = [r for r in self.ranks or [] if r > dim]
        if bad:
            raise ConfigError(f"--calibration.guarded.ranks {bad} exceed the model's hidden size d = {dim}; ranks "
                              f"must be at most {dim} (a rank of {dim} is the full-rank LRA, already a candidate)")


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
        return ("lra", "nobias", "replaceme") + (("lra_replaceme",) if "lra_replaceme" in self.knobs.extra else ())

    @property
    def knobs(self) -> GuardKnobs:
        """``--calibration.guarded.*``."""
        return self.cfg.guarded

    def candidates(self, dim: int) -> list[Candidate]:
        """The candidates in tie-breaking order (ranks ``≥ dim`` are the full-rank LRA: left out)."""
        k = self.knobs
        out = [Candidate("none", None)]
        out += [Candidate(f"lra@{lam:g}", "lra", damping=lam) for lam in k.ridge_path(self.cfg.damping)]
        out += [Candidate(f"lra@r{r}", "lra", rank=r) for r in k.ranks or [] if r < dim]
        out += [Candidate("nobias", "nobias"), Candidate("replaceme", "replaceme")]
        out += [Candidate("lra@span", "lra", span=True)] if "span_lra" in k.extra else []
        out += [Candidate("lra+replaceme", "lra_replaceme")] if "lra_replaceme" in k.extra else []
        return out

    def fit(self, stats):  # pragma: no cover - orchestrated by the module
        raise NotImplementedError("the guard chooses among fitted maps with a judge pass; see CalibrationModule")
