"""The KL guard's choice (solver ``guarded``; its candidates: :mod:`shift_lightning.maps.solvers.guard`), a selection layer composed
around a :class:`~shift_lightning.calibration.CalibrationModule` that has collected its statistics: every candidate
is fitted from them without the held-out windows (every ``heldout_every``-th), the pruned model is run on those
windows with each candidate in place (:class:`~.judge.GuardJudge`), and per span the closest to the original is
refitted on all windows and handed to the module (:meth:`~.module.CalibrationModule.adopt`)."""

from __future__ import annotations

from dataclasses import replace

from ..data import TokenWindows
from ..errors import ConfigError
from .judge import GuardJudge
from ..maps.fitted import SpanMap, adapter_from, chain
from ..maps.sites import Site, sites_in
from .solve import Job, solve_shared
from ..maps.solvers import Solver, get_solver
from ..maps.solvers.guard import Candidate


class GuardChoice:
    """Guard ``name`` of ``module``: :meth:`run` chooses and hands the maps over."""

    def __init__(self, module, name: str):
        self.module, self.name = module, name
        self.guard = module.solvers[name]

    def solver(self, c: Candidate) -> Solver:
        cfg = self.module.cfg
        return get_solver(c.solver, replace(cfg, damping=cfg.damping if c.damping is None else c.damping, rank=c.rank))

    def targets(self, c: Candidate, s: Solver, span: Site) -> list[Site]:
        """Where ``c`` is fitted in ``span``: the span, its sites, or nowhere (a span LRA at one site = the site fit)."""
        sites = sites_in(span, self.module.sites)
        if c.span:
            return [] if [t.key for t in sites] == [span.key] else [span]
        return [span] if s.per_span else sites

    def span_map(self, c: Candidate, span: Site, sols: dict) -> SpanMap | None:
        """Candidate ``c``'s map at ``span`` from the solutions ``sols`` (None: ``c`` does not apply there)."""
        if c.solver is None:
            return SpanMap(span, source=c.name)
        s = self.solver(c)
        if s.placement == "branch":
            sol = sols.get((c.name, span.key))
            return None if sol is None else SpanMap(span, branch=sol.W.T, source=c.name)
        targets = self.targets(c, s, span)
        if not targets:  # a span-level LRA at a one-site span
            return None
        m = self.module
        dtype = next(m.model.parameters()).dtype
        parts = [adapter_from(sols[(c.name, t.key)], s.bias, dtype, s.rank(m.dim)) for t in targets]
        branch = sols[(c.name, span.key)].T if s.per_span else None  # the joint map's half before the span
        return SpanMap(span, adapter=chain(parts, m.cfg.merge), branch=branch, source=c.name)

    def solve(self, choices: list[Candidate], fitting: bool) -> dict:
        """``(candidate, site) -> Solution`` for ``choices``, fitted without the held-out windows (``fitting``) or
        on all of them; the solves are shared out among ranks."""
        m, jobs = self.module, []
        for c in choices:
            if c.solver is None:
                continue
            s = self.solver(c)
            for span in m.spans:
                for t in self.targets(c, s, span):
                    if s.applies(t):
                        st = m.statistics[t.key]
                        jobs.append(Job(c.name, t, s, st.fitting() if fitting else st))
        return {(j.tag, j.site.key): sol for j, sol in zip(jobs, solve_shared(jobs, m.dim, m.stats_device))}

    def run(self, trainer, windows: TokenWindows, batch_size: int) -> None:
        m = self.module
        cands = self.guard.candidates(m.dim)
        sols = self.solve(cands, fitting=True)
        default_name = next(c.name for c in cands if c.solver == "lra")
        candidates, default = {}, {}
        for span in m.spans:
            maps = [self.span_map(c, span, sols) for c in cands]
            candidates[span.key] = [x for x in maps if x is not None]
            default[span.key] = next(x for x in candidates[span.key] if x.source == default_name)
        k = self.guard.cfg.heldout_every
        held_out = [i for i in range(len(windows)) if i % k == k - 1]
        if not held_out:
            raise ConfigError(f"--calibration.solver guarded holds out every {k}-th calibration window, but there are "
                              f"only {len(windows)}: raise --data.num_samples")
        judge = GuardJudge(m.model, m.removed, m.spans, candidates, default, self.guard.cfg.heldout_topk)
        judge.run(trainer, TokenWindows(windows.input_ids[held_out], windows.attention_mask[held_out]), batch_size)
        chosen = {key: judge.results[key]["chosen"] for key in judge.results}
        refit = self.solve([c for c in cands if c.name in set(chosen.values())], fitting=False)
        maps = {span.key: self.span_map(next(c for c in cands if c.name == chosen[span.key]), span, refit)
                for span in m.spans}
        m.adopt(self.name, maps, {key: {**judge.results[key], "held_out_windows": len(held_out)} for key in chosen})
