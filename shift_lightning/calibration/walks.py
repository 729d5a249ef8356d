"""The walks (``--calibration.mode``): one registry, :data:`WALKS`; :meth:`CalibrationModule.calibrate` picks one
by name. Each is a block-major pipeline (:mod:`.pipeline`): the windows cached once, then one block at a time,
brought in by the model's placement.

=============  ====================================================================================================
``independent``  every site's statistics from the original model's states in one walk, ONE all-reduce, then the
                 solves shared out among ranks (:meth:`~.module.CalibrationModule.solve`); a guard then chooses per
                 span on held-out windows (:mod:`.guarding`). Held-out errors: one walk of
                 :class:`~shift_lightning.maps.ridge.ResidualMeter` s.
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

import torch

from ..data import TokenWindows
from ..maps.ridge import ResidualMeter
from .auto import choose_fit
from .collect import SiteStatistics
from .guarding import GuardChoice
from ..maps.fitted import as_affine
from .solve import Job, solve_shared
from ..maps.solvers.joint import span_delta_map

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
        eager = not m.keep_statistics and not m.guards  # each site solved as the walk passes it, its sums freed
        m.statistics = m._collect(trainer, windows, batch_size, plan, "calibration statistics", holdout, eager)
        if not eager:
            m.solve()
        for name in m.guards:
            GuardChoice(m, name).run(trainer, windows, batch_size)

    def measure(self, trainer, windows, batch_size, key):
        """Every map's held-out error from one block-major pass of meters (the maps are known now)."""
        m = self.m
        meters = _error_meters(m)
        m._meter_pass(trainer, windows, batch_size,
                         [(site, inp, meter) for (_, _, site), (inp, meter) in meters.items()])
        for (kind, name, t), (_, meter) in meters.items():
            if kind == "site":
                m._record(t, name, key, meter.relative_error(), meter.num_tokens)
        if len(m.requested) > 1 or any(m.solvers[n].per_span for n in m.requested):
            for span in m.spans:
                out = m.reports[span.key].setdefault("span_errors", {})
                for name in m.requested:
                    if ("span", name, span) in meters:
                        out[name] = {f"{key}_rel_error": meters["span", name, span][1].relative_error()}
                    elif _span_error_map(m, name, span) == "none":  # no map: the update is dropped, Δ̂ = 0
                        out[name] = {f"{key}_rel_error": 1.0}


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


def _error_meters(m) -> dict:
    """What the held-out pass measures, each a :class:`~shift_lightning.maps.ridge.ResidualMeter` of a map known now:
    every solver's map at each of its sites (``("site", solver, site)``, on the inputs it was fitted on) and,
    with several solvers or per-span ones, each requested solver's whole-span map (``("span", name, span)``)."""
    branch = any(s.placement == "branch" for s in m.solvers.values())
    joint = any("joint" in s.needs for s in m.solvers.values())
    down = any("down" in s.needs for s in m.solvers.values())
    span_level = len(m.requested) > 1 or any(m.solvers[n].per_span for n in m.requested)
    measured = {t.key for t in m.sites} if any(not s.per_span for s in m._fittable()) else set()
    inputs: dict[tuple[int, int], set[str]] = {k: {"io"} for k in measured}
    if span_level:
        for t in m.spans:
            inputs.setdefault(t.key, set()).update({"io"} | ({"branch"} if branch else set())
                                                   | ({"joint"} if joint else set()) | ({"down"} if down else set()))
    meters = {}
    for s in m._fittable():
        for t in m._targets(s):
            if t.key not in inputs or t.key not in m.solutions[s.key]:
                continue
            have = {f: f for f in inputs[t.key] if f == "io" or t.start >= 1}
            probe = SiteStatistics(t, io=have.get("io"), branch=have.get("branch"), joint=have.get("joint"),
                                   down=have.get("down"))
            inp, (Wd, bd) = s.fitted_on(m.solutions[s.key][t.key], probe)
            if inp is not None:
                meters["site", s.key, t] = (inp, ResidualMeter(Wd, bd, t.name))
    if span_level:
        for span in m.spans:
            have = {f for f in inputs[span.key] if f == "io" or span.start >= 1}
            for name in m.requested:
                got = _span_error_map(m, name, span, have)
                if isinstance(got, tuple):
                    meters["span", name, span] = (got[0], ResidualMeter(*got[1], span.name))
    return meters

def _span_error_map(m, name: str, span, have: set[str] = frozenset({"io"})):
    """The input and ``(W_Δ, b)`` of solver ``name``'s whole map at ``span`` (``have``: the inputs measured
    there); ``"none"`` when it puts no map there, None when it cannot be measured on these inputs."""
    sm = m.span_map(name, span)
    eye = torch.eye(m.dim, dtype=torch.float64)
    if sm.down is not None and "down" in have:
        return "down", sm.down
    if sm.embedding is not None:
        return "io", sm.embedding
    if sm.branch is not None and sm.adapter is not None and "joint" in have:
        return "joint", span_delta_map(*as_affine(sm.adapter), sm.branch)
    if sm.branch is not None and "branch" in have:
        T = sm.branch.to(torch.float64)
        return "branch", (T.T - eye.to(T), T.new_zeros(m.dim))
    if sm.adapter is not None:
        M, c = as_affine(sm.adapter)
        return "io", (M - eye.to(M), c)
    return "none" if sm.branch is None else None
