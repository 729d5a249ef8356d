"""Closed-form calibration of the maps that replace removed blocks, orchestrated by Lightning: the statistics
gathered block by block, the solves shared out among ranks. What a map is, how each solver fits it and where it
goes: :mod:`shift_lightning.maps`.

=================  ======================================================================================
``config``         :class:`CalibrationConfig`: every ``--calibration.*`` knob
``collect``        what one pass gathers per site (hooks, ONE flat float64 buffer, held-out copies)
``solve``          solves shared out among ranks, broadcast
``sequential``     the GPTQ-style sequential pass (and ``anchored``)
``auto``           ``mode: auto``: each way of fitting the LRA / the joint map judged on held-out windows,
                   the closest kept
``judge``          which candidate map per span keeps the pruned model closest to the original (``guarded``)
``guarding``       the guard's choice, composed around a module that has collected its statistics
``pipeline``       block-major calibration: the windows cached once, then one block at a time
``walks``          the walks (``--calibration.mode``), one registry of pipelines
``module``         :class:`CalibrationModule`, the Lightning glue
=================  ======================================================================================
"""

from importlib import import_module

#: Public name -> the submodule defining it, imported on first use (``from .calibration.config import
#: CalibrationConfig`` stays free of torch and Lightning, so ``--help`` answers fast).
_EXPORTS = {
    "CalibrationConfig": "config", "SolverName": "config", "CalibrationModule": "module", "check_windows": "module",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f".{_EXPORTS[name]}", __name__), name)
