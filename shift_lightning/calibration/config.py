"""The calibration knobs (``--calibration.*``): one typed dataclass, validated in one place."""

from __future__ import annotations

import logging
import math
import typing
from dataclasses import dataclass, field
from typing import Literal

from ..errors import ConfigError
from ..maps.solvers import SOLVERS

log = logging.getLogger(__name__)

#: The config's choices of ``--calibration.solver``: the registry's names (:mod:`shift_lightning.maps.solvers`,
#: where each solver's one-line description is), read when this module is imported.
SolverName = Literal[tuple(SOLVERS)]  # type: ignore[valid-type]

#: Solver names that became knob combinations, and how to spell them now (a config or command line that still uses
#: one is told).
RETIRED_SOLVERS = {
    "lra_span": "--calibration.solver lra --calibration.granularity span",
    "lra_anchored": "--calibration.solver lra --calibration.granularity span --calibration.mode anchored",
    "lra_auto": "--calibration.solver lra --calibration.mode auto",
    "lra_replaceme_anchored": "--calibration.solver lra_replaceme --calibration.mode anchored",
    "lra_replaceme_auto": "--calibration.solver lra_replaceme --calibration.mode auto",
    "guarded_span": "--calibration.solver guarded --calibration.guard_extra '[span_lra]'",
    "guarded_joint": "--calibration.solver guarded --calibration.guard_extra '[span_lra, lra_replaceme]'",
}

#: Extra candidates the guard may choose (``--calibration.guard_extra``).
GuardExtra = Literal["span_lra", "lra_replaceme"]


@dataclass
class CalibrationConfig:
    """How the maps that replace removed blocks are fitted."""

    solver: SolverName = "lra_replaceme"
    """The method that fits the maps: ``lra``, ``lra_replaceme`` (default), ``nobias``, ``replaceme``,
    ``replaceme_cosine``, ``linearpatch``, ``guarded`` or ``stock`` (what each fits: ``docs/configuration.md``; why
    the default: ``docs/results.md``; retired names such as ``lra_span`` are spelled there with the knobs below)."""
    mode: Literal["independent", "sequential", "anchored", "auto"] = "independent"
    """``independent`` (one pass of the original model), ``sequential`` (each site sees the corrected
    pruned model's hidden states; about one pass in all, block by block) or ``anchored`` (sequential, and
    each site fitted to the original model's state at its end, so that it also undoes earlier drift);
    ``auto`` (solvers ``lra`` and ``lra_replaceme``): each of those fits tried, the closest to the original on the
    held-out calibration windows (every ``heldout_every``-th) kept."""
    granularity: Literal["block", "span"] = "block"
    """``block``: one map per removed block (merged afterwards); ``span``: one per contiguous run."""
    rank: int | None = None
    """Adapter rank r (W = UVᵀ, 2dr + d parameters, optimal reduced-rank fit; ``lra_replaceme``: the adapter's
    half rank r, the branch map folded full); None (or r = d) = full
    rank. r > d is refused once the model is loaded; r ≥ d/2 warns (no fewer parameters than full rank)."""
    damping: float = 1e-4
    """Relative ridge damping: λ = damping · mean(diag(XcᵀXc))."""
    merge: bool = True
    """Merge the adapters of adjacent removed blocks into one exact affine map."""
    accum_dtype: Literal["auto", "float64", "float32", "tf32", "bfloat16"] = "auto"
    """How a batch's products are formed before they are added into the float64 master sums:
    ``float64``; ``float32`` / ``tf32`` / ``bfloat16`` chunks (the GEMM's input precision, float32
    accumulation); ``auto``: float64 on CPU, on CUDA bfloat16 for bf16 models and tf32 otherwise
    (see :mod:`shift_lightning.maps.ridge`; errors and speed: ``benchmarks/calibration.py --accum``)."""
    heldout: bool = True
    """Also measure every site's relative residual error on the held-out windows."""
    heldout_every: int = 4
    """``guarded``, ``mode: auto`` and ``refit_kept``: every k-th calibration window is held out of the fit and judges
    the candidates; the chosen map is then refitted on all windows."""
    guard_extra: list[GuardExtra] = field(default_factory=list)
    """``guarded``: more candidates per span of two or more blocks: ``span_lra`` (one LRA fitted to the whole span)
    and ``lra_replaceme`` (the joint map)."""
    guard_path: list[float] | None = None
    """``guarded``: the LRA's ridge path, relative dampings tried besides none / no bias / ReplaceMe
    (``null``: ``[damping, 1e-2, 1, 100]``)."""
    guard_ranks: list[int] | None = None
    """``guarded``: adapter ranks tried besides the full-rank ridge path, each at ``damping`` (the
    optimal reduced-rank fit, e.g. ``[128, 256]``); ``null``: none."""
    guard_topk: int = 64
    """``guarded``: the original's top-k next-token probabilities kept per held-out position (KL)."""
    cosine_epochs: int = 10
    """``replaceme_cosine``: passes of Adam over the cached activations (ReplaceMe's default: 10)."""
    cosine_lr: float = 1e-4
    """``replaceme_cosine``: Adam's learning rate (ReplaceMe's default: 1e-4)."""
    cosine_batch_tokens: int = 1024
    """``replaceme_cosine``: tokens per Adam step (ReplaceMe's default: 1024)."""
    cosine_max_tokens: int = 262144
    """``replaceme_cosine``: at most this many calibration tokens are cached per span (two float32
    rows of d each: 2·4·d bytes a token, 1.2 GB at d = 576, 8.6 GB at d = 4096)."""
    seed: int = 0
    """Seed of the iterative solvers (``replaceme_cosine``'s data order)."""
    refit_kept: int | Literal["all"] = 0
    """Re-fit the first k kept blocks after each removed span (``all``: every one) in closed form once the maps are in
    place, each kept only if the held-out calibration windows get closer to the original (0: off; Llama layout only;
    what it does: ``docs/method.md#the-kept-block-re-fit``; what it gains: ``docs/results.md#the-kept-block-re-fit``)."""
    refit_damping: float = 0.1
    """The re-fit's relative damping δ towards each layer's own weights (λ = δ · mean diag(XᵀX))."""

    def ridge_path(self) -> list[float]:
        """``guarded``: the relative dampings of the LRA candidates."""
        return list(self.guard_path) if self.guard_path is not None else [self.damping, 1e-2, 1.0, 100.0]

    def check_dim(self, dim: int, warn: bool = True) -> None:
        """Checks that need the model's hidden size ``d`` (once it is loaded, before any pass):
        ``rank > d`` is refused (no rank-r factorisation of a d × d map exists); ``d/2 ≤ rank < d`` is
        allowed with a warning, since the factors ``U, V`` then hold 2dr ≥ d² parameters, as many as or
        more than the full-rank W (``warn``); ``rank = d`` is the full-rank fit."""
        if self.rank is not None and self.rank > dim:
            raise ConfigError(f"--calibration.rank {self.rank} exceeds the model's hidden size d = {dim}; "
                              f"use a rank below {dim} for a low-rank adapter, or null for full rank")
        if warn and self.rank is not None and 2 * self.rank >= dim and self.rank < dim:
            log.warning("--calibration.rank %d is at least half the hidden size d = %d: the low-rank adapter "
                        "(2dr + d = %d parameters) is no smaller than the full-rank one (d² + d = %d); use "
                        "r < %d to save parameters, or null for full rank", self.rank, dim,
                        2 * dim * self.rank + dim, dim * dim + dim, (dim + 1) // 2)
        bad = [r for r in self.guard_ranks or [] if r > dim]
        if bad:
            raise ConfigError(f"--calibration.guard_ranks {bad} exceed the model's hidden size d = {dim}; "
                              f"ranks must be at most {dim} (a rank of {dim} is the full-rank LRA, already a candidate)")

    def validate(self) -> None:
        """Cheap checks (before any model is loaded); the solver checks its own options."""
        if not (isinstance(self.damping, (int, float)) and math.isfinite(self.damping) and self.damping > 0):
            raise ConfigError(f"--calibration.damping must be a finite number > 0, got {self.damping}")
        if self.rank is not None and self.rank < 1:
            raise ConfigError(f"--calibration.rank must be >= 1 or null (full rank), got {self.rank}")
        if self.heldout_every < 2:
            raise ConfigError(f"--calibration.heldout_every must be >= 2 (every k-th window held out), got "
                              f"{self.heldout_every}")
        bad = [x for x in self.guard_extra if x not in typing.get_args(GuardExtra)]
        if bad:
            raise ConfigError(f"--calibration.guard_extra {bad}: choose from {list(typing.get_args(GuardExtra))}")
        if not self.ridge_path() or any(not (math.isfinite(x) and x > 0) for x in self.ridge_path()):
            raise ConfigError(f"--calibration.guard_path must be finite relative dampings > 0, got {self.guard_path}")
        if self.guard_ranks is not None and any(isinstance(r, bool) or not isinstance(r, int) or r < 1
                                                for r in self.guard_ranks):
            raise ConfigError(f"--calibration.guard_ranks must be whole ranks >= 1 (or null), got {self.guard_ranks}")
        if self.guard_topk < 1:
            raise ConfigError(f"--calibration.guard_topk must be >= 1, got {self.guard_topk}")
        for name in ("cosine_epochs", "cosine_batch_tokens", "cosine_max_tokens"):
            if getattr(self, name) < 1:
                raise ConfigError(f"--calibration.{name} must be >= 1, got {getattr(self, name)}")
        if self.refit_kept != "all" and (isinstance(self.refit_kept, bool) or not isinstance(self.refit_kept, int)
                                         or self.refit_kept < 0):
            raise ConfigError(f"--calibration.refit_kept must be a whole number of blocks >= 0 (0: off) or 'all', "
                              f"got {self.refit_kept!r}")
        if not (isinstance(self.refit_damping, (int, float)) and math.isfinite(self.refit_damping)
                and self.refit_damping > 0):
            raise ConfigError(f"--calibration.refit_damping must be a finite number > 0, got {self.refit_damping}")
        if not (math.isfinite(self.cosine_lr) and self.cosine_lr > 0):
            raise ConfigError(f"--calibration.cosine_lr must be a finite number > 0, got {self.cosine_lr}")
