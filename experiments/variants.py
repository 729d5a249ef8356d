"""The grids' row variants: a solver and its knobs, under the name a grid's rows and result files carry.

A variant is ``{CalibrationConfig field: value}`` (a knob group's as a mapping of its knobs; ``solver`` defaults to
the variant's name), what :class:`~shift_lightning.calibration.CalibrationModule` fits side by side from one pass
(variants of one ``mode`` share it). The names ``lra_span`` … ``guarded_joint`` were solvers of their own before
they became knob combinations; their maps under this spelling are the old ones exactly
(``experiments/tests/test_variants.py``).
"""

from __future__ import annotations

from shift_lightning.maps import SOLVERS

from . import solvers  # noqa: F401  (registers the grids' own solvers: affine, lra_guard)

#: variant -> the knobs that spell it (besides the grid's shared ones: damping, held-out split, ...).
VARIANTS: dict[str, dict] = {
    **{name: {} for name in SOLVERS},
    "lra_span": {"solver": "lra", "granularity": "span"},
    "lra_anchored": {"solver": "lra", "granularity": "span", "mode": "anchored"},
    "lra_auto": {"solver": "lra", "mode": "auto"},
    "lra_replaceme_anchored": {"solver": "lra_replaceme", "mode": "anchored"},
    "lra_replaceme_auto": {"solver": "lra_replaceme", "mode": "auto"},
    "guarded_span": {"solver": "guarded", "guarded": {"extra": ["span_lra"]}},
    "guarded_joint": {"solver": "guarded", "guarded": {"extra": ["span_lra", "lra_replaceme"]}},
}

#: How tables call each variant's model.
LABELS: dict[str, str] = {
    **{name: cls.label for name, cls in SOLVERS.items()},
    "lra_span": "+LRA (one per span)",
    "lra_anchored": "+LRA per span, anchored",
    "lra_auto": "+LRA, fit chosen on held-out KL",
    "lra_replaceme_anchored": "+LRA & ReplaceMe (joint), anchored",
    "lra_replaceme_auto": "+LRA & ReplaceMe (joint), fit chosen on held-out KL",
    "guarded_span": "+guarded (span LRA)",
    "guarded_joint": "+guarded (span LRA, LRA & ReplaceMe)",
}


def solver_of(variant: str) -> str:
    """The registered solver behind ``variant``."""
    return VARIANTS[variant].get("solver", variant)


def mode_of(variant: str) -> str:
    """The calibration mode ``variant`` is fitted in (one calibration pass per mode)."""
    return VARIANTS[variant].get("mode", "independent")


def knobs(names) -> dict[str, dict]:
    """``CalibrationModule(solvers=…)`` for these variants."""
    return {n: dict(VARIANTS[n]) for n in names}
