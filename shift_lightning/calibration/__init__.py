"""Closed-form calibration of the maps that replace removed blocks, orchestrated by Lightning.

=================  ======================================================================================
``config``         :class:`CalibrationConfig`: every ``--calibration.*`` knob
``sites``          sites, spans, pruned positions (framework-free)
``collect``        what one pass gathers per site (hooks, ONE flat float64 buffer, held-out copies)
``solvers/``       the methods, one file a family, one registry: ``lra``, ``nobias`` (ridge.py), ``replaceme``,
                   ``replaceme_cosine`` (replaceme.py), ``lra_replaceme`` (joint.py), ``linearpatch``,
                   ``guarded`` (guard.py, judged by :mod:`.judge`); how each is fitted are knobs (config)
``solve``          solves shared out among ranks, broadcast
``sequential``     the GPTQ-style sequential pass (and ``anchored``)
``auto``           ``mode: auto``: each way of fitting the LRA / the joint map judged on held-out windows,
                   the closest kept
``maps``           solutions → adapters / branch maps per span → :class:`Correction`
``module``         :class:`CalibrationModule`, the Lightning glue
=================  ======================================================================================
"""

from .config import CalibrationConfig, SolverName  # noqa: F401
from .maps import Correction, SpanMap  # noqa: F401
from .module import CalibrationModule, check_windows  # noqa: F401
from .sites import Site, contiguous_spans, pruned_positions  # noqa: F401
from .solvers import SOLVERS, Solver, get_solver, register  # noqa: F401
