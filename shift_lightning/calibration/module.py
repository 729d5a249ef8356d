""":class:`CalibrationModule`: the Lightning glue around collection, the solvers and the guard.

    pass(es) of the original model ──> statistics (one flat buffer, ONE all-reduce)
        ──> solves shared out among ranks, broadcast ──> (guarded: judge pass) ──> maps per span

It receives a built model and the original indices of the blocks to remove (it never prunes:
:func:`~shift_lightning.maps.surgery.remove_blocks` does); ``solvers`` (default ``[cfg.solver]``) are
fitted from the same pass: solver names, or ``{key: {knob: value}}`` to fit several configurations of the
solvers side by side from one pass (a grid's variants, e.g. ``{"lra": {}, "lra_span": {"solver": "lra",
"granularity": "span"}}``; the knobs replace ``cfg``'s fields, a group's as a mapping such as
``{"guarded": {"extra": ["span_lra"]}}`` (:meth:`~.config.CalibrationConfig.with_knobs`), ``solver`` defaults to the
key; all share ``cfg``'s ``mode``). Afterwards :meth:`correction` gives what a solver does to the pruned
model, :attr:`solutions` the fitted maps, :attr:`reports` the per-site errors.
"""

from __future__ import annotations

import time

import lightning as L
import torch
from torch import nn

from ..arch import decoder_layers
from ..data import TokenWindows, check_windows
from ..errors import ConfigError
from ..passes import DataPass, sum_across_ranks
from ..placement import placement_of
from ..maps.ridge import Solution
from .collect import Collector, SiteStatistics
from .config import CalibrationConfig
from ..maps.fitted import FittedMaps, SpanMap, adapter_from, assemble, chain
from .pipeline import IndependentPass
from .sequential import SequentialWalk
from .walks import WALKS
from ..maps.sites import Site, make_sites, sites_in, span_sites
from .solve import Job, solve_shared
from ..maps.solvers import SOLVERS, Solver, get_solver
from ..maps.solvers.guard import Guarded


class CalibrationModule(DataPass):
    """Gradient-free statistics pass(es) + distributed closed-form solve (see the module doc)."""

    needs_grad_mode = True  # solved adapters must not be inference tensors
    stage = "calibration statistics"

    def __init__(self, model: nn.Module, removed: list[int], cfg: CalibrationConfig | None = None,
                 solvers: list[str] | dict[str, dict] | None = None, keep_statistics: bool = True):
        super().__init__()
        self.keep_statistics = keep_statistics  # False: each site's sums are freed once it is solved
        if placement_of(model).onloaded:  # a skeleton: its placement brings each block to the device, not Lightning
            self.__dict__["model"] = model
        else:
            self.model = model
        self.cfg = cfg = cfg or CalibrationConfig()
        cfg.validate()
        self.solvers: dict[str, Solver] = self._configured(solvers if isinstance(solvers, dict)
                                                           else {n: {} for n in solvers or [cfg.solver]})
        self.requested = list(self.solvers)
        for name in self.requested:
            for inner in self.solvers[name].wraps:
                self.solvers.setdefault(inner, get_solver(inner, cfg))
        if cfg.mode != "independent" and (len(self.requested) > 1 or not self.solvers[self.requested[0]].sequential):
            able = ", ".join(n for n, c in SOLVERS.items() if c.sequential)
            raise ConfigError(f"--calibration.mode {cfg.mode} fits one solver of {able} (others fit the original model), got "
                              f"{', '.join(self.requested)}: set --calibration.solver lra_replaceme (the default) or lra")
        self.removed = sorted(removed)
        self.num_layers = len(decoder_layers(model))  # the original depth (the model may be pruned later)
        self.dim = model.config.hidden_size
        cfg.check_dim(self.dim)
        for s in self.solvers.values():
            s.check_model(model)
        self.ffn_dim = getattr(model.config, "intermediate_size", None)
        self.spans = span_sites(self.removed)
        per_span_only = all(s.per_span for s in self.solvers.values())  # peers only: their sites are the spans
        self.sites = self.spans if cfg.granularity == "span" or per_span_only else make_sites(self.removed, "block")
        self.statistics: dict[tuple[int, int], SiteStatistics] = {}
        self.solutions: dict[str, dict[tuple[int, int], Solution]] = {n: {} for n in self.solvers}
        self.reports: dict[tuple[int, int], dict] = {s.key: {} for s in self.sites + self.spans}
        self._chosen: dict[str, dict[tuple[int, int], SpanMap]] = {}
        self._adapters: dict[tuple[str, tuple[int, int]], nn.Module] = {}
        self._collector: Collector | None = None
        self._walk: SequentialWalk | None = None
        self._pipe: IndependentPass | SequentialWalk | None = None
        self._on_site = self._eager = None
        self._solved = 0
        self.solve_seconds = 0.0
        self.fit_choice: dict | None = None  # mode auto: the held-out judgement of its fits

    def _configured(self, variants: dict[str, dict]) -> dict[str, Solver]:
        """``key -> solver``, each configured by ``cfg`` with its own knobs (see the module doc)."""
        out = {}
        for key, knobs in variants.items():
            cfg = self.cfg.with_knobs(knobs) if knobs else self.cfg
            if cfg.mode != self.cfg.mode:
                raise ConfigError(f"{key!r} is fitted in --calibration.mode {cfg.mode}, this pass in {self.cfg.mode}: "
                                  "fit it in a calibration of its own")
            cfg.validate()
            out[key] = get_solver(knobs.get("solver", key), cfg, key)
        return out

    @property
    def primary(self) -> str:
        return self.requested[0]

    @property
    def guards(self) -> list[str]:
        """The requested KL guards (solvers that choose per span by a judge pass)."""
        return [n for n in self.requested if isinstance(self.solvers[n], Guarded)]

    # ---------------------------------------------------------------- the pass (DataPass hooks)
    def step(self, batch, batch_idx):
        self._pipe.cache_batch(batch, batch["attention_mask"].bool(), self.device)

    def state(self) -> list[torch.Tensor]:
        return []  # the walk runs after the loop and all-reduces its own sums

    def finish(self):  # still inside the predict loop: process group alive, batches cached
        reduce = lambda t: sum_across_ranks(t, self.trainer)  # noqa: E731
        bar = self.progress(f"{self.stage}, block by block", self._pipe.cache.last + 1)
        try:
            if self._walk is not None:
                self._walk.walk(self.device, self._on_site, reduce, bar)
            else:  # the sums are allocated once the windows are cached (an onloaded embedding is released then)
                if self._eager is None:
                    self._collector.allocate(self.device)
                self._pipe.walk(self.device, reduce, bar, self._eager)
        finally:
            bar.close()

    def _collect(self, trainer, windows, batch_size, plan, stage, holdout=False, solve=False):
        """The statistics of ``plan`` in one block-major pass. ``solve``: each site solved (and its sums freed) as
        soon as the walk has passed its last block (the same sums and solves as :meth:`solve` after the pass)."""
        self._collector = Collector(self.dim, plan, self.cfg.accum_dtype, self.cfg.heldout_every if holdout else None,
                                    self.cfg.replaceme_cosine.max_tokens, self.ffn_dim)
        self._pipe, self.stage = IndependentPass(self.model, self._collector), stage
        if solve:
            self._eager, self._solved = self._solve_sites, 0
        try:
            self.run(trainer, windows, batch_size)
        finally:
            self._pipe = self._eager = None
        if not solve:
            self._collector.derive()
        return self._collector.stats

    def _solve_sites(self, keys: list[tuple[int, int]]) -> None:
        """Inside the walk: sites ``keys`` have all their (all-reduced) sums: solve them, free the sums."""
        self._collector.derive(keys)
        self.statistics = {key: self._collector.stats[key] for key in keys}
        self._solved = self.solve(free=True, keys=set(keys), first=self._solved)
        for key in keys:  # a site no solver fits (e.g. ReplaceMe's cosine fit has nothing before block 0)
            self.statistics.pop(key, None)
            self._collector.release(key)

    def _sequential(self, trainer, windows, batch_size, on_site, stage, anchored=False):
        self._walk = self._pipe = SequentialWalk(self.model, self.sites, self.dim, self.cfg.accum_dtype,
                                                 anchored, "joint" in self.solvers[self.primary].needs)
        self._on_site, self.stage = on_site, stage
        try:
            self.run(trainer, windows, batch_size)
        finally:
            self._walk = self._pipe = self._on_site = None

    # ---------------------------------------------------------------- fitting
    def _targets(self, solver: Solver) -> list[Site]:
        return [t for t in (self.spans if solver.per_span else self.sites) if solver.applies(t)]

    def _fittable(self) -> list[Solver]:
        return [s for s in self.solvers.values() if not s.wraps]

    def calibrate(self, trainer: L.Trainer, windows: TokenWindows, heldout: TokenWindows | None = None,
                  batch_size: int = 4, check: bool = True) -> list[Site]:
        """Run the statistics pass(es) and the solves of the walk ``cfg.mode`` names (:data:`~.walks.WALKS`);
        returns the sites (every rank identical).

        ``check``: :func:`check_windows` first (a caller that checked before its own passes skips it)."""
        if check:
            check_windows(self.model, windows)
            if heldout is not None:
                check_windows(self.model, heldout, "--heldout", fitting=False)
        t0 = time.time()
        walk = WALKS[self.cfg.mode](self)
        walk.fit(trainer, windows, heldout, batch_size)
        self.solve_seconds = time.time() - t0
        if heldout is not None and len(heldout) and walk.measures:
            walk.measure(trainer, heldout, batch_size, "heldout")
        return self.sites

    def solve(self, free: bool = False, keys: set[tuple[int, int]] | None = None, first: int = 0):
        """(Re)solve every solver from the statistics held now, e.g. statistics summed over several
        passes (:meth:`add_statistics`) or reused with another damping or rank. ``free``: drop each site's
        statistics once its last solve is stored (the d² sums of all sites are then never held beside all the
        solutions). ``keys``: these sites only; ``first``: the number of jobs solved before (the ranks take turns
        across calls). Returns ``first`` plus the number of jobs solved."""
        jobs = [Job(s.key, t, s, self.statistics[t.key]) for s in self._fittable() for t in self._targets(s)
                if keys is None or t.key in keys]
        for job in jobs:  # collectives first, on every rank: a solve then runs on its owner alone
            if job.stats.rows is not None:
                job.stats.rows.gather()
        last = {job.site.key: n for n, job in enumerate(jobs)}
        device = self.stats_device

        def store(n, job, sol):
            self._store(job.solver, job.site, sol, job.stats)
            if free and last[job.site.key] == n:
                self.statistics.pop(job.site.key, None)
                if self._collector is not None:
                    self._collector.release(job.site.key)
                job.stats = None

        solve_shared(jobs, self.dim, device, store, first)
        return first + len(jobs)

    def drop_statistics(self) -> None:
        """Free the statistics (d² float64 sums per site) once the maps are fitted and measured."""
        self.statistics, self._collector = {}, None

    def _store(self, solver: Solver, site: Site, sol: Solution, stats: SiteStatistics) -> None:
        self.solutions[solver.key][site.key] = sol
        self._adapters.pop((solver.key, site.key), None)
        st, (Wd, bd) = solver.fitted_on(sol, stats)
        entry = {"lam": sol.lam, **sol.info}
        if st is not None:
            entry.update(calib_rel_error=st.relative_error(Wd, bd), calib_tokens=st.num_tokens, accum=st.scheme)
        rep = self.reports[site.key]
        rep.setdefault("solvers", {}).setdefault(solver.key, {}).update(entry)
        if solver.key == self.primary:
            rep.update({k: v for k, v in entry.items() if k in ("calib_rel_error", "calib_tokens", "lam", "accum")})

    def add_statistics(self, other: "CalibrationModule") -> None:
        """Add ``other``'s statistics (same sites, e.g. a pass over more windows) to ours: the sums
        ``[X,1]ᵀ[X,1]``, ``[X,1]ᵀΔ``, ``Σ‖Δ‖²`` are additive over disjoint windows."""
        from ..maps.ridge import RidgeStats

        for key, theirs in other.statistics.items():
            mine = self.statistics.setdefault(key, SiteStatistics(theirs.site))
            for field_ in ("io", "branch", "held_io", "held_branch", "joint", "down"):
                t = getattr(theirs, field_)
                if t is None:
                    continue
                if getattr(mine, field_) is None:
                    setattr(mine, field_, RidgeStats(t.dim, t.name, device=t.buffer.device, out_dim=t.out_dim))
                getattr(mine, field_).buffer += t.buffer

    def adopt(self, name: str, maps: dict[tuple[int, int], SpanMap], judgements: dict[tuple[int, int], dict],
              fitted: "CalibrationModule | None" = None, choice: dict | None = None) -> None:
        """Take maps chosen outside this module by a selection layer (the guard, :mod:`.guarding`; ``mode: auto``,
        :mod:`.auto`): ``maps[span.key]`` become solver ``name``'s maps, ``judgements[span.key]`` is filed under the
        span's ``guards``; ``fitted``: the calibration that fitted them (its sites and errors are taken too);
        ``choice``: one judgement for the whole run (:attr:`fit_choice`)."""
        self._chosen[name] = maps
        if fitted is not None:
            self.sites = fitted.sites
            self.reports.update({key: dict(rep) for key, rep in fitted.reports.items()})
        for sp in self.spans:
            self.reports[sp.key].setdefault("guards", {})[name] = judgements[sp.key]
        if choice is not None:
            self.fit_choice = choice

    @property
    def stats_device(self) -> torch.device:
        """Where the statistics are held (and solved)."""
        return next((part.buffer.device for st in self.statistics.values()
                     for part in (st.io, st.branch, st.joint, st.down, st.scale) if part is not None), self.device)

    # ---------------------------------------------------------------- held-out errors
    def measure(self, trainer: L.Trainer, windows: TokenWindows, batch_size: int = 4, key: str = "heldout") -> None:
        """Relative residual error ``‖Δ − Δ̂‖² / ‖Δ‖²`` of the solved maps on other windows, per site
        and (several solvers or per-span ones) of each solver's whole-span map per span (the walk's way)."""
        WALKS[self.cfg.mode](self).measure(trainer, windows, batch_size, key)

    def _meter_pass(self, trainer: L.Trainer, windows: TokenWindows, batch_size: int, meters: list) -> None:
        """One block-major pass filling ``meters`` (``(site, input, ResidualMeter)``) on the original model."""
        self._collector = Collector(self.dim, [], self.cfg.accum_dtype, ffn_dim=self.ffn_dim, meters=meters)
        self._pipe, self.stage = IndependentPass(self.model, self._collector), "held-out errors"
        try:
            self.run(trainer, windows, batch_size)
        finally:
            self._pipe, self._collector = None, None

    def _record(self, site: Site, name: str, key: str, err: float, tokens: int) -> None:
        rep = self.reports[site.key]
        rep.setdefault("solvers", {}).setdefault(name, {})[f"{key}_rel_error"] = err
        if name == self.primary:
            rep[f"{key}_rel_error"], rep[f"{key}_tokens"] = err, tokens

    # ---------------------------------------------------------------- results
    def solution(self, site: Site, name: str | None = None) -> Solution:
        return self.solutions[name or self.primary][site.key]

    def adapter(self, name: str, site: Site) -> nn.Module:
        """The adapter of ``site`` fitted by solver ``name`` (cached)."""
        key = (name, site.key)
        if key not in self._adapters:
            s = self.solvers[name]
            dtype = next(self.model.parameters()).dtype
            self._adapters[key] = adapter_from(self.solutions[name][site.key], s.bias, dtype, s.rank(self.dim))
        return self._adapters[key]

    def span_map(self, name: str, span: Site) -> SpanMap:
        """What solver ``name`` puts at ``span``."""
        if name in self._chosen:
            return self._chosen[name][span.key]
        s = self.solvers[name]
        if s.placement == "down":
            sol = self.solutions[name][span.key]
            fold = (sol.W, sol.b)
            return SpanMap(span, down=fold, source=name) if span.start >= 1 else SpanMap(
                span, embedding=fold, source=name, note=f"span {span.start}..{span.end - 1} starts at block 0: its "
                                                        "LRA is folded into the embedding table")
        if s.placement == "branch":
            sol = self.solutions[name].get(span.key)
            if sol is None:
                return SpanMap(span, source=name, note=f"span {span.start}..{span.end - 1} starts at block 0: no block to "
                                                       f"fold {s.label.lstrip('+')}'s map into; left uncorrected")
            return SpanMap(span, branch=sol.W.T, source=name)
        if s.per_span:
            sol = self.solutions[name][span.key]
            return SpanMap(span, adapter=self.adapter(name, span), branch=sol.T, source=name,
                           note=sol.info.get("note") and f"span {span.start}..{span.end - 1}: {sol.info['note']}")
        return SpanMap(span, adapter=chain([self.adapter(name, t) for t in sites_in(span, self.sites)], self.cfg.merge),
                       source=name)

    def fitted_maps(self, name: str | None = None) -> FittedMaps:
        """What solver ``name`` (default: the first requested) does to the pruned model."""
        name = name or self.primary
        if name not in self.requested:
            raise ConfigError(f"solver {name!r} was not fitted here (fitted: {', '.join(self.requested)})")
        return assemble(name, [self.span_map(name, sp) for sp in self.spans], self.num_layers, self.removed)

    def adapters_by_position(self, name: str | None = None) -> dict[int, nn.Module]:
        """Adapters keyed by pruned position; adjacent ones merged exactly when ``cfg.merge``."""
        return self.fitted_maps(name).adapters

    def span_reports(self) -> list[dict]:
        """Per span: blocks, what each solver put there, held-out span errors, the guard's judgement."""
        out = []
        for sp in self.spans:
            rep = self.reports[sp.key]
            guards = rep.get("guards", {})
            extra = {"guard": guards[next(g for g in self.requested if g in guards)]} if guards else {}
            if len(guards) > 1:
                extra["guards"] = guards
            out.append({"index": sp.index, "blocks": sp.blocks,
                        "maps": {n: self.span_map(n, sp).source for n in self.requested},
                        **{k: rep[k] for k in ("span_errors",) if k in rep}, **extra})
        return out

    def site_reports(self) -> list[dict]:
        """Per site: blocks and its report (what ``calibration_report.json`` lists)."""
        return [{"index": s.index, "blocks": s.blocks, **self.reports[s.key]} for s in self.sites]
