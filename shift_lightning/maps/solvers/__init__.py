"""Solvers: one file per map family, one registry (see :mod:`.base`). Adding a map is a new file here
with an ``@register`` class and one import line below."""

from .base import SOLVERS, Solver, get_solver, register  # noqa: F401
from . import ridge, replaceme, linearpatch, guard, joint, stock  # noqa: F401,E402  (registers the solvers)
