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

from importlib import import_module

#: Public name -> the submodule defining it, imported on first use (``from .calibration.config import
#: CalibrationConfig`` stays free of torch and Lightning, so ``--help`` answers fast).
_EXPORTS = {
    "CalibrationConfig": "config", "SolverName": "config", "Correction": "maps", "SpanMap": "maps",
    "CalibrationModule": "module", "check_windows": "module", "Site": "sites", "contiguous_spans": "sites",
    "pruned_positions": "sites", "SOLVERS": "solvers", "Solver": "solvers", "get_solver": "solvers", "register": "solvers",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
