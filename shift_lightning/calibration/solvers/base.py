"""The solver interface: fitted statistics in, a map out.

A solver is a small class registered under its name (the value of ``--calibration.solver``)::

    @register
    class NoBias(Solver):
        name, label = "nobias", "+no bias"
        needs = frozenset({"io"})                    # statistics the pass must collect (collect.NEEDS)
        def fit(self, stats: SiteStatistics) -> Solution:
            return ridge_solve(stats.io, self.cfg.damping, bias=False)

Every map is affine, so every solver returns a :class:`~shift_lightning.stats.Solution`
(``W, b`` float64, optionally low rank ``U, V``): one fixed set of tensors, which is what lets the
module share the solves out among ranks and broadcast them without knowing the solver. Where the
map goes is the solver's :attr:`Solver.placement`:

* ``adapter``: ``y = x + x Wᵀ + b`` (``kind="residual"``) or ``y = x Wᵀ + b`` (``kind="affine"``) on the
  hidden state entering the first kept block after the site;
* ``branch``: ReplaceMe's ``T = Wᵀ`` on the MLP branch of block ``start − 1`` (folded into
  ``down_proj``).

Per-block solvers (``per_span = False``) are fitted per *site* (a block, or a span with
``granularity: span``) and their adapters merged per span; per-span solvers are fitted per span. A
solver that chooses among others (the guards) lists them in :attr:`Solver.wraps`.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from ...errors import ConfigError
from ...stats import RidgeStats, Solution
from ..collect import SiteStatistics
from ..config import CalibrationConfig
from ..sites import Site


class Solver:
    """Base class of every map (see the module doc). Subclasses set the class attributes and
    implement :meth:`fit`; ``self.cfg`` is the run's :class:`CalibrationConfig`."""

    name: ClassVar[str] = ""
    """Registry name (``--calibration.solver``)."""
    label: ClassVar[str] = ""
    """How tables call the corrected model ("+LRA")."""
    per_span: ClassVar[bool] = False
    """Fitted once per contiguous span (peers, guards) instead of per site."""
    placement: ClassVar[Literal["adapter", "branch"]] = "adapter"
    bias: ClassVar[bool] = True
    """The adapter has a bias term (``b`` or ``c``)."""
    needs: ClassVar[frozenset[str]] = frozenset({"io"})
    holdout: ClassVar[bool] = False
    """Needs held-out copies of its statistics (every ``guard_every``-th window)."""
    sequential: ClassVar[bool] = False
    """Can be fitted in ``--calibration.mode sequential`` (and ``anchored``)."""
    mode: ClassVar[str | None] = None
    """The ``--calibration.mode`` this solver is defined by (None: any it supports)."""
    low_rank: ClassVar[bool] = False
    """Honours ``--calibration.rank``."""
    fits: ClassVar[tuple[tuple[str, str, str], ...]] = ()
    """``mode: auto`` solvers: ``(name, granularity, mode)`` of each fit tried, in tie-breaking order."""
    fit_solver: ClassVar[str] = ""
    """``mode: auto`` solvers: the solver each of :attr:`fits` is made with."""
    wraps: ClassVar[tuple[str, ...]] = ()
    """Solvers whose maps this one chooses among (their statistics are collected too)."""

    def __init__(self, cfg: CalibrationConfig):
        self.cfg = cfg
        self.device = None  # where iterative solvers run (set by the module)
        if cfg.rank is not None and not self.low_rank:
            raise ConfigError(f"--calibration.rank applies to the {' / '.join(low_rank_solvers())} solvers, not to "
                              f"{self.name!r}: set --calibration.solver lra_replaceme (the default) or lra for a "
                              "low-rank adapter, or drop --calibration.rank")
        if cfg.mode == "auto" and self.mode != "auto":
            able = " / ".join(n for n, c in SOLVERS.items() if c.mode == "auto")
            raise ConfigError(f"--calibration.mode auto chooses a map's fit on held-out windows; it fits the "
                              f"{able} solvers, not {self.name!r}: set --calibration.solver lra_replaceme_auto "
                              "(the joint map) or lra_auto (the LRA)")
        if self.mode is not None and cfg.mode != self.mode:
            raise ConfigError(f"solver {self.name!r} is fitted in --calibration.mode {self.mode}, got {cfg.mode!r}: "
                              f"set --calibration.mode {self.mode}")

    def rank(self, dim: int) -> int | None:
        """The rank of a low-rank fit (None: full rank)."""
        r = self.cfg.rank if self.low_rank else None
        return r if r is not None and r < dim else None

    def applies(self, site: Site) -> bool:
        """Whether this solver can correct ``site`` (ReplaceMe needs a block before the span)."""
        return True

    def fit(self, stats: SiteStatistics) -> Solution:
        raise NotImplementedError

    def fitted_on(self, sol: Solution, stats: SiteStatistics) -> tuple[RidgeStats | None, tuple]:
        """The statistics of ``stats`` that ``sol`` was fitted on, and its update ``(W_Δ, b)`` in their inputs
        (what the calibration and held-out relative errors are computed from)."""
        return (stats.branch if self.placement == "branch" else stats.io), sol.delta_map()


#: name -> solver class; filled by :func:`register`.
SOLVERS: dict[str, type[Solver]] = {}


def low_rank_solvers() -> list[str]:
    """The solvers that honour ``--calibration.rank``."""
    return [n for n, c in SOLVERS.items() if c.low_rank]


def register(cls: type[Solver]) -> type[Solver]:
    """Class decorator: make ``cls`` available as ``--calibration.solver <cls.name>``."""
    if not cls.name or cls.name in SOLVERS:
        raise ValueError(f"solver name {cls.name!r} is empty or taken")
    SOLVERS[cls.name] = cls
    return cls


def get_solver(name: str, cfg: CalibrationConfig) -> Solver:
    """The solver registered as ``name``, configured by ``cfg``."""
    try:
        cls = SOLVERS[name]
    except KeyError:
        raise ConfigError(f"Unknown solver {name!r}; choose from {', '.join(SOLVERS)}") from None
    return cls(cfg)
