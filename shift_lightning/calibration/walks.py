"""The walks (``--calibration.mode``): one registry, :data:`WALKS`; :meth:`CalibrationModule.calibrate` picks one
by name. Each is a block-major pipeline (:mod:`.pipeline`): the windows cached once, then one block at a time,
brought in by the model's placement.

=============  ====================================================================================================
``independent``  every site's statistics from the original model's states in one walk, ONE all-reduce, then the
                 solves shared out among ranks (:meth:`~.module.CalibrationModule.solve`); a guard then chooses per
                 span on held-out windows (:mod:`.guarding`). Held-out errors: one walk of
                 :class:`~shift_lightning.stats.ResidualMeter` s.
``sequential``   each site fitted on the corrected pruned model's states as the walk reaches it
                 (:class:`~.sequential.SequentialWalk`: one all-reduce and one shared solve per site).
``anchored``     ``sequential``, each site fitted to the original model's state at its end.
``auto``         each fit of the solver made by the walks above on part of the windows, judged on the others by
                 the pruned model's closeness to the original, the closest refitted on all (:mod:`.auto`).
=============  ====================================================================================================

A new walk is a subclass of :class:`Walk` registered with :func:`register_walk`; the config's ``mode`` choices
name the registry's entries.
"""

from __future__ import annotations

from ..data import TokenWindows
from .auto import choose_fit
from .guarding import GuardChoice
from .solve import Job, solve_shared

#: mode name -> walk class; filled by :func:`register_walk`.
WALKS: dict[str, type["Walk"]] = {}


def register_walk(name: str):
    def deco(cls):
        cls.name = name
        WALKS[name] = cls
        return cls

    return deco


class Walk:
    """What one ``--calibration.mode`` does with a :class:`~.module.CalibrationModule` ``m``: :meth:`fit` its maps,
    :meth:`measure` their held-out errors (when :attr:`measures`)."""

    name = ""
    measures = True
    """False: the walk measures its own fit (``auto``: the refit on all windows)."""

    def __init__(self, module):
        self.m = module

    def fit(self, trainer, windows: TokenWindows, heldout: TokenWindows | None, batch_size: int) -> None:
        raise NotImplementedError

    def measure(self, trainer, windows: TokenWindows, batch_size: int, key: str) -> None:
        raise NotImplementedError


@register_walk("independent")
class Independent(Walk):
    def fit(self, trainer, windows, heldout, batch_size):
        m = self.m
        plan = [(t, set(s.needs)) for s in m._fittable() for t in (m.spans if s.per_span else m.sites)]
        if any(c.span for g in m.guards for c in m.solvers[g].candidates(m.dim)):
            plan += [(t, {"io"}) for t in m.spans]  # the span-level LRA candidate's statistics
        holdout = any(s.holdout for s in m.solvers.values())
        m.statistics = m._collect(trainer, windows, batch_size, plan, "calibration statistics", holdout)
        m.solve(free=not m.keep_statistics and not m.guards)
        for name in m.guards:
            GuardChoice(m, name).run(trainer, windows, batch_size)

    def measure(self, trainer, windows, batch_size, key):
        self.m.measure_maps(trainer, windows, batch_size, key)


@register_walk("sequential")
class Sequential(Walk):
    """Each site solved as the walk reaches it, on the states the maps before it produce."""

    anchored = False

    def fit(self, trainer, windows, heldout, batch_size):
        m = self.m
        solver = m.solvers[m.primary]

        def fit_site(site, stats):
            if m.keep_statistics:
                m.statistics[site.key] = stats
            sol = solve_shared([Job(solver.key, site, solver, stats)], m.dim, stats.io.buffer.device)[0]
            m._store(solver, site, sol, stats)
            return m.adapter(solver.key, site), sol.T

        m._sequential(trainer, windows, batch_size, fit_site, f"calibration statistics ({m.cfg.mode})", self.anchored)

    def measure(self, trainer, windows, batch_size, key):
        m = self.m
        name = m.primary

        def measure_site(site, stats):
            sol = m.solutions[name][site.key]
            st, (Wd, bd) = m.solvers[name].fitted_on(sol, stats)
            m._record(site, name, key, st.relative_error(Wd, bd), st.num_tokens)
            return m.adapter(name, site), sol.T

        m._sequential(trainer, windows, batch_size, measure_site, f"held-out errors ({m.cfg.mode})", self.anchored)


@register_walk("anchored")
class Anchored(Sequential):
    """``sequential``, each site's target the original model's state at its end (the walk carries both)."""

    anchored = True


@register_walk("auto")
class Auto(Sequential):
    """Each fit of the solver tried on part of the windows, the closest on the others refitted (:mod:`.auto`)."""

    measures = False

    def fit(self, trainer, windows, heldout, batch_size):
        choose_fit(self.m, trainer, windows, heldout, batch_size)
