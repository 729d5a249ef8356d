"""The map: what replaces removed blocks, from its fit to the saved folder. Framework-free (no Lightning).

A *map* is the affine function fitted in closed form at a pruning *site* (a removed block or span) to stand in for
what the removed blocks did to the hidden state. Its whole life is here:

=================  ======================================================================================
``sites``          sites, spans and the pruned positions the maps go to
``ridge``          the statistics (``XᵀX``, ``XᵀΔ`` in float64) and the ridge solve,
                   ``W = (XᵀX + λI)⁻¹ XᵀΔ`` (:func:`~.ridge.ridge_solve`): a :class:`~.ridge.Solution`
``solvers/``       how each method fits its maps, one file a family, one registry (``--calibration.solver``):
                   ``lra``, ``nobias`` (ridge.py), ``replaceme`` (replaceme.py), ``lra_replaceme`` (joint.py),
                   ``linearpatch``, ``guarded`` (guard.py), ``stock`` (stock.py)
``fitted``         solutions → the maps of a run per span (:class:`~.fitted.SpanMap`) → :class:`~.fitted.FittedMaps`
``lra``            the map as a module on the residual stream: :class:`~.lra.LinearResidualAdapter`
``peers``          the map folded into existing weights the peers' way (ReplaceMe's ``down_proj`` fold,
                   LinearPatch's rotation)
``surgery``        blocks removed, maps put in place (adapters attached, branch maps and the stock repair
                   folded into ``down_proj`` or the embedding)
``keptfit``        the kept-block re-fit: the kept blocks after a site re-fitted to absorb the drift
``keptfit_knobs``  its knobs (``--calibration.refit.*``), apart so that the config imports no torch
``record``         how a folder records its maps (``shift_config.json``)
=================  ======================================================================================

The statistics are gathered and the solves shared out among ranks by :mod:`shift_lightning.calibration`.
"""

from importlib import import_module

#: Public name -> the submodule defining it, imported on first use (``import shift_lightning.maps`` imports no torch).
_EXPORTS = {
    "Site": "sites", "contiguous_spans": "sites", "pruned_positions": "sites",
    "Solution": "ridge", "RidgeStats": "ridge", "ridge_solve": "ridge",
    "SOLVERS": "solvers", "Solver": "solvers", "get_solver": "solvers", "register": "solvers",
    "FittedMaps": "fitted", "SpanMap": "fitted", "LinearResidualAdapter": "lra", "AdapterSpec": "lra",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
