"""The solver interface: fitted statistics in, a map out.

A solver is a *method*, registered under its name (the value of ``--calibration.solver``); how it is fitted —
per block or per span (``granularity``), on the original or the corrected model (``mode``), at which rank — are
knobs of :class:`~shift_lightning.calibration.config.CalibrationConfig`, read from ``self.cfg``. Knobs that serve
one solver only are a small dataclass defined beside it, a field of the config named after the solver
(``--calibration.guarded.*``, ``--calibration.replaceme_cosine.*``). A new map is one file here with an
``@register`` class and one import line in ``__init__.py``::

    @register
    class NoBias(Solver):
        name, label = "nobias", "+no bias"
        description = "closed-form residual maps without bias (y = x + x Wᵀ)"
        needs = frozenset({"io"})                    # statistics the pass must collect (collect.NEEDS)
        def fit(self, stats: SiteStatistics) -> Solution:
            return ridge_solve(stats.io, self.cfg.damping, bias=False)

(``experiments/`` registers its own solvers the same way.) Every map is affine, so every solver returns a
:class:`~shift_lightning.maps.ridge.Solution` (``W, b`` float64, optionally low rank ``U, V``): one fixed set of
tensors, which is what lets the module share the solves out among ranks and broadcast them without knowing the
solver. Where the map goes is the solver's :attr:`Solver.placement`:

* ``adapter``: ``y = x + x Wᵀ + b`` (``kind="residual"``) or ``y = x Wᵀ + b`` (``kind="affine"``) on the
  hidden state entering the first kept block after the site;
* ``branch``: ReplaceMe's ``T = Wᵀ`` on the MLP branch of block ``start − 1`` (folded into
  ``down_proj``);
* ``down``: an update ``Δ̂ = u Wᵀ + b`` of block ``start − 1``'s ``down_proj`` (``u`` its input, ``W`` is
  ``(d, d_ff)``), added to its weight and bias; a span at block 0: an adapter folded into the embedding table
  (:mod:`.stock`).

Per-block solvers (:attr:`Solver.per_span` false) are fitted per *site* (a block, or a span with
``granularity: span``) and their adapters merged per span; per-span solvers are fitted per span. A solver that
chooses among others (the guard) lists them in :attr:`Solver.wraps`. This module imports no torch: the
registry's names are the config's choices (``--help`` reads them without loading a model).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol

from ...errors import ConfigError

if TYPE_CHECKING:
    from ..ridge import RidgeStats, Solution
    from ...calibration.collect import SiteStatistics
    from ..sites import Site


class SolverSettings(Protocol):
    """What a solver reads of the run's calibration settings (a
    :class:`~shift_lightning.calibration.config.CalibrationConfig`; the solvers do not import the config, whose
    ``--calibration.solver`` choices are read from their registry)."""

    mode: str
    granularity: str
    rank: int | None
    damping: float
    guarded: Any
    """The guard's knobs (:class:`~.guard.GuardKnobs`, ``--calibration.guarded.*``)."""
    replaceme_cosine: Any
    """``replaceme_cosine``'s knobs (:class:`~.replaceme.CosineKnobs`, ``--calibration.replaceme_cosine.*``)."""


class Solver:
    """Base class of every map (see the module doc). Subclasses set the class attributes and
    implement :meth:`fit`; ``self.cfg`` is the run's settings (:class:`SolverSettings`)."""

    name: ClassVar[str] = ""
    """Registry name (``--calibration.solver``)."""
    label: ClassVar[str] = ""
    """How tables call the model with its maps ("+LRA")."""
    description: ClassVar[str] = ""
    """One line for model cards and ``--help`` ("closed-form Linear Residual Adapters …")."""
    span_only: ClassVar[bool] = False
    """Always fitted once per contiguous span (peers, guards, the joint map), whatever ``granularity`` says."""
    placement: ClassVar[Literal["adapter", "branch", "down"]] = "adapter"
    bias: ClassVar[bool] = True
    """The adapter has a bias term (``b`` or ``c``)."""
    needs: ClassVar[frozenset[str]] = frozenset({"io"})
    holdout: ClassVar[bool] = False
    """Needs held-out copies of its statistics (every ``heldout_every``-th window)."""
    sequential: ClassVar[bool] = False
    """Can be fitted in ``--calibration.mode sequential`` / ``anchored`` (on the corrected pruned model)."""
    low_rank: ClassVar[bool] = False
    """Honours ``--calibration.rank``."""
    fits: ClassVar[tuple[tuple[str, str, str], ...]] = ()
    """``--calibration.mode auto``: ``(name, granularity, mode)`` of each fit tried, in tie-breaking order (empty: the
    solver has no auto mode)."""

    def __init__(self, cfg: SolverSettings, key: str | None = None):
        self.cfg = cfg
        self.key = key or self.name
        """Where this fit's maps and reports are filed: the solver's name, or a grid's variant name."""
        self.device = None  # where iterative solvers run (set by the module)
        if cfg.rank is not None and not self.low_rank:
            raise ConfigError(f"--calibration.rank applies to the {' / '.join(low_rank_solvers())} solvers, not to "
                              f"{self.name!r}: set --calibration.solver lra_replaceme (the default) or lra for a "
                              "low-rank adapter, or drop --calibration.rank")
        if cfg.mode == "auto" and not self.fits:
            able = " / ".join(n for n, c in SOLVERS.items() if c.fits)
            raise ConfigError(f"--calibration.mode auto chooses a map's fit on held-out windows; it fits the "
                              f"{able} solvers, not {self.name!r}: set --calibration.solver lra_replaceme (the "
                              "default) or lra, or another --calibration.mode")

    @property
    def per_span(self) -> bool:
        """Fitted once per contiguous span (:attr:`span_only`, or ``granularity: span``) instead of per site."""
        return self.span_only or self.cfg.granularity == "span"

    @property
    def wraps(self) -> tuple[str, ...]:
        """Solvers whose maps this one chooses among (their statistics are collected too)."""
        return ()

    def rank(self, dim: int) -> int | None:
        """The rank of a low-rank fit (None: full rank)."""
        r = self.cfg.rank if self.low_rank else None
        return r if r is not None and r < dim else None

    def applies(self, site: Site) -> bool:
        """Whether this solver can correct ``site`` (ReplaceMe needs a block before the span)."""
        return True

    def check_model(self, model) -> None:
        """Refuse, with one line, a model this solver cannot correct (before any pass)."""

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


def get_solver(name: str, cfg: SolverSettings, key: str | None = None) -> Solver:
    """The solver registered as ``name``, configured by ``cfg`` (filed under ``key``, default its name)."""
    try:
        cls = SOLVERS[name]
    except KeyError:
        raise ConfigError(f"Unknown solver {name!r}; choose from {', '.join(SOLVERS)}") from None
    return cls(cfg, key)
