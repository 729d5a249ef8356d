"""The calibration knobs (``--calibration.*``): one typed dataclass; the knobs that serve one solver or one step are a
small dataclass of their own, defined and validated beside that solver (``--calibration.guarded.*``,
``--calibration.replaceme_cosine.*``) or step (``--calibration.refit.*``), nested here."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace
from typing import Literal

from ..errors import ConfigError
from ..maps.keptfit_knobs import RefitKnobs
from ..maps.solvers import SOLVERS
from ..maps.solvers.guard import GuardKnobs
from ..maps.solvers.replaceme import CosineKnobs

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
    "guarded_span": "--calibration.solver guarded --calibration.guarded.extra '[span_lra]'",
    "guarded_joint": "--calibration.solver guarded --calibration.guarded.extra '[span_lra, lra_replaceme]'",
}

#: Flat knobs that moved into a solver's (or the re-fit's) own group, or were renamed: old -> new dotted name under
#: ``calibration`` (a command line or config file that still uses one is told).
RENAMED_KNOBS = {
    "guard_extra": "guarded.extra", "guard_path": "guarded.path", "guard_ranks": "guarded.ranks",
    "guard_topk": "heldout_topk",
    "cosine_epochs": "replaceme_cosine.epochs", "cosine_lr": "replaceme_cosine.lr",
    "cosine_batch_tokens": "replaceme_cosine.batch_tokens", "cosine_max_tokens": "replaceme_cosine.max_tokens",
    "seed": "replaceme_cosine.seed",
    "refit_kept": "refit.kept", "refit_damping": "refit.damping",
}

#: The knob groups nested in :class:`CalibrationConfig`: field -> its dataclass, owned (and validated) by the solver or
#: step it serves.
GROUPS = {"guarded": GuardKnobs, "replaceme_cosine": CosineKnobs, "refit": RefitKnobs}


def yaml_spelling(name: str) -> str:
    """A dotted knob name under ``calibration`` as a YAML config spells it: ``refit.kept`` -> ``calibration: {refit:
    {kept: ...}}``."""
    parts = ["calibration", *name.split(".")]
    return "".join(f"{p}: {{" for p in parts[:-1]) + f"{parts[-1]}: ..." + "}" * (len(parts) - 1)


def renamed_knob_message(old: str, where: str | None = None) -> str:
    """What a command line (``where`` None) or config file (``where``: its path) that still spells a renamed knob is
    told."""
    new = RENAMED_KNOBS[old]
    if where is None:
        return f"--calibration.{old} is now --calibration.{new}"
    return (f"Config file {where}: calibration.{old} is now calibration.{new} (in YAML '{yaml_spelling(new)}'; on "
            f"the command line --calibration.{new})")


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
    """``guarded``, ``mode: auto`` and ``refit``: every k-th calibration window is held out of the fit and judges
    the candidates; the chosen map is then refitted on all windows."""
    heldout_topk: int = 64
    """``guarded``, ``mode: auto`` and ``refit``: the original's top-k next-token probabilities kept per held-out
    position (KL)."""
    guarded: GuardKnobs = field(default_factory=GuardKnobs)
    """``--calibration.solver guarded``: the candidates it tries per span besides none, no bias and ReplaceMe."""
    replaceme_cosine: CosineKnobs = field(default_factory=CosineKnobs)
    """``--calibration.solver replaceme_cosine``: its Adam fit on cached activations (defaults: ReplaceMe's)."""
    refit: RefitKnobs = field(default_factory=RefitKnobs)
    """The kept-block re-fit after the maps (Llama layout; what it gains: ``docs/results.md#the-kept-block-re-fit``)."""

    def __post_init__(self):
        for name, cls in GROUPS.items():  # a group given as a mapping ({"kept": 2}): its dataclass
            if isinstance(getattr(self, name), dict):
                setattr(self, name, cls(**getattr(self, name)))

    def with_knobs(self, knobs: dict) -> CalibrationConfig:
        """A copy with ``knobs`` (``{field: value}``) set; a group's given as a mapping sets only the knobs it names
        (``{"guarded": {"extra": ["span_lra"]}}`` keeps the config's ``guarded.path``)."""
        out = {}
        for key, value in knobs.items():
            if key in RENAMED_KNOBS:
                raise ConfigError(f"calibration knob {key!r} is now {RENAMED_KNOBS[key]!r} "
                                  f"({yaml_spelling(RENAMED_KNOBS[key])})")
            if key in GROUPS and isinstance(value, dict):
                value = replace(getattr(self, key), **value)
            out[key] = value
        return replace(self, **out)

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
        self.guarded.check_dim(dim)

    def validate(self) -> None:
        """Cheap checks (before any model is loaded), each group's by the group; the solver checks the combination."""
        if not (isinstance(self.damping, (int, float)) and math.isfinite(self.damping) and self.damping > 0):
            raise ConfigError(f"--calibration.damping must be a finite number > 0, got {self.damping}")
        if self.rank is not None and self.rank < 1:
            raise ConfigError(f"--calibration.rank must be >= 1 or null (full rank), got {self.rank}")
        if self.heldout_every < 2:
            raise ConfigError(f"--calibration.heldout_every must be >= 2 (every k-th window held out), got "
                              f"{self.heldout_every}")
        if self.heldout_topk < 1:
            raise ConfigError(f"--calibration.heldout_topk must be >= 1, got {self.heldout_topk}")
        for group in GROUPS:
            getattr(self, group).validate()
