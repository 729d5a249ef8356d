"""Closed-form calibration of Linear Residual Adapters (and the peers' maps), orchestrated by Lightning.

A *site* replaces the original blocks ``[start, end)`` by one map. With ``granularity="block"``
(the paper's default) every removed block is its own site and the adapters of adjacent sites are
merged exactly afterwards; ``granularity="span"`` fits one adapter per contiguous run of removed
blocks directly (ReplaceMe-style ablation). A *span* is a maximal contiguous run of removed blocks.

Kinds (``CalibrationConfig.kind``; :class:`CalibrationModule` can fit several from ONE pass):

* ``residual`` (the LRA, ``y = x + x Wᵀ + b``), ``nobias`` (``y = x + x Wᵀ``, "Ghosted Layers"),
  ``affine`` (``y = x Aᵀ + c``, no identity path): per site, from the statistics of
  ``(x entering block start, Δ = h_end − x)``;
* ``replaceme`` and ``linearpatch`` (see :mod:`shift_lightning.peers`): per span, always from the
  original model, from statistics of block ``start−1``'s MLP branch and of the span's input/output.

Modes (``CalibrationConfig.mode``):

* ``independent`` (default): ONE gradient-free forward pass of the original model fills every
  site's statistics. The pass stops after the last site's block.
* ``sequential``: site ``k`` sees the hidden states of the partially corrected pruned model (the
  blocks of sites ``< k`` bypassed by their solved adapters). As in GPTQ's sequential driver, one
  pass caches the hidden state entering the first site (and every block's call arguments); then
  the blocks are run once each over the cached batches, block after block: a kept block updates
  the states, a site accumulates its statistics, is solved, and its adapter updates the states.
  The whole costs about one forward pass up to the last site, not one pass per site.

Distributed: windows are sharded with :class:`~shift_lightning.data.RankShard` (no sample counted
twice), each rank accumulates local sums, ONE all-reduce after the loop sums the flat statistics
buffer (sequential mode: one per site, each site depending on the previous solution), solve ``n``
of the list of (site, kind) jobs runs on rank ``n mod world`` and is broadcast, so every rank ends
with identical maps.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Literal

import lightning as L
import torch
from torch import nn

from . import dist
from .arch import block_input, block_output, decoder_layers, mlp_branch, swapped_blocks
from .data import TokenWindows, check_seq_len
from .errors import ConfigError
from .lra import AdapterSpec, LinearResidualAdapter, merge_adapters
from .passes import DataPass, sum_across_ranks
from .peers import ChannelScaleStats, linearpatch_matrix
from .stats import RidgeStats, Solution, SolveError, guarded_solve, ridge_solve
from .surgery import contiguous_spans, pruned_positions

log = logging.getLogger(__name__)


def check_windows(model: nn.Module, windows: TokenWindows, option: str = "--data", fitting: bool = True) -> None:
    """Before any pass: refuse windows longer than the model's maximum positions, and warn when
    ``fitting`` windows give a site fewer tokens than the ``d + 1`` unknowns of each output of its
    map (the fit is then underdetermined: only the damping makes it unique)."""
    longest = int(windows.attention_mask.sum(1).max()) if len(windows) else 0  # padding has no position
    check_seq_len(model, longest, f"{option}.seq_len")
    d = model.config.hidden_size
    if fitting and windows.num_tokens < d + 1:
        log.warning("Calibration gives each site %d tokens, fewer than the d + 1 = %d unknowns per output of its "
                    "map: the fit is underdetermined (only the damping makes it unique). Raise %s.num_samples / "
                    "%s.seq_len to at least %d tokens (ideally many times more).", windows.num_tokens, d + 1,
                    option, option, d + 1)


KINDS = ("residual", "nobias", "affine", "replaceme", "linearpatch")
SITE_KINDS = ("residual", "nobias", "affine")
SPAN_KINDS = ("replaceme", "linearpatch")


@dataclass
class CalibrationConfig:
    """How adapters are fitted."""

    mode: Literal["independent", "sequential"] = "independent"
    """``independent`` (one pass of the original model) or ``sequential`` (each site sees the
    corrected pruned model's hidden states; about one pass in all, block by block)."""
    granularity: Literal["block", "span"] = "block"
    """``block``: one adapter per removed block (merged afterwards); ``span``: one per contiguous run."""
    kind: Literal["residual", "nobias", "affine", "replaceme", "linearpatch"] = "residual"
    """``residual``: the LRA y = x + xWᵀ + b; ``nobias``: y = x + xWᵀ (Ghosted Layers); ``affine``:
    y = xAᵀ + c, no identity path (ablation); ``replaceme``: ReplaceMe's least-squares map folded into
    the last kept block's down_proj; ``linearpatch``: LinearPatch's P = H D Hᵀ (training-free)."""
    rank: int | None = None
    """Adapter rank r (W = UVᵀ, 2dr + d parameters, optimal reduced-rank fit); None = full rank."""
    damping: float = 1e-4
    """Relative ridge damping: λ = damping · mean(diag(XcᵀXc))."""
    merge: bool = True
    """Merge the adapters of adjacent removed blocks into one exact affine map."""
    accum_dtype: Literal["auto", "float64", "float32", "tf32", "bfloat16"] = "auto"
    """How a batch's products are formed before they are added into the float64 master sums:
    ``float64``; ``float32`` / ``tf32`` / ``bfloat16`` chunks (the GEMM's input precision, float32
    accumulation); ``auto``: float64 on CPU, on CUDA bfloat16 for bf16 models and tf32 otherwise
    (see :mod:`shift_lightning.stats`; errors and speed: ``benchmarks/calibration.py --accum``)."""
    heldout: bool = True
    """Also measure every site's relative residual error on the held-out windows."""
    guard: bool = False
    """Do-no-harm guard (residual / nobias / affine): every ``guard_every``-th calibration window is
    held out; per site the ridge strength is chosen along λ·10^k by the error on those windows, and
    a site whose map does not beat the identity there gets the identity (plain pruning)."""
    guard_every: int = 4
    """With ``guard``: which share of the windows is held out (every k-th window)."""


@dataclass(eq=False)
class Site:
    """Original blocks ``[start, end)`` replaced by one map."""

    index: int
    start: int
    end: int
    stats: RidgeStats | None = None
    """``(x entering block start, Δ = h_end − x)``."""
    guard_stats: RidgeStats | None = None
    """The same over the guard windows only (do-no-harm guard)."""
    mlp_stats: RidgeStats | None = None
    """``(MLP-branch output of block start−1, Δ)`` (ReplaceMe)."""
    scale: ChannelScaleStats | None = None
    """LinearPatch's channel scaling."""
    solutions: dict[str, Solution] = field(default_factory=dict)
    adapters: dict[str, nn.Module] = field(default_factory=dict)
    report: dict = field(default_factory=dict)
    primary: str = "residual"

    @property
    def name(self) -> str:
        return f"site {self.index} (blocks {self.start}..{self.end - 1})"

    @property
    def solution(self) -> Solution | None:
        return self.solutions.get(self.primary)

    @property
    def adapter(self) -> nn.Module | None:
        return self.adapters.get(self.primary)


@dataclass
class Correction:
    """What one kind does to the pruned model (see :func:`shift_lightning.surgery.apply_correction`)."""

    kind: str
    adapters: dict[int, nn.Module] = field(default_factory=dict)
    """Pruned position -> adapter applied to the hidden state entering that block (or the final norm)."""
    branch_maps: dict[int, torch.Tensor] = field(default_factory=dict)
    """Original index of a kept block -> ReplaceMe's ``T`` ``(d, d)`` for its MLP branch."""
    notes: list[str] = field(default_factory=list)


class _StopForward(Exception):
    """Raised by a hook once every captured site of the pass has its data."""


def make_sites(removed: list[int], granularity: str, primary: str = "residual") -> list[Site]:
    if granularity == "block":
        spans = [(i, i + 1) for i in sorted(removed)]
    elif granularity == "span":
        spans = contiguous_spans(removed)
    else:
        raise ConfigError(f"granularity must be 'block' or 'span', got {granularity!r}")
    return [Site(k, s, e, primary=primary) for k, (s, e) in enumerate(spans)]


class _Recorder(nn.Module):
    """Stands in for block ``j`` during the caching pass of sequential mode: records the call."""

    def __init__(self, j: int, sink: dict, last: int):
        super().__init__()
        self.j, self.sink, self.last = j, sink, last

    def forward(self, hidden_states, *args, **kwargs):
        if self.j not in self.sink:
            self.sink["h"] = hidden_states
        self.sink[self.j] = (args, kwargs)
        if self.j == self.last:
            raise _StopForward
        return hidden_states


class CalibrationModule(DataPass):
    """Gradient-free statistics pass(es) + distributed closed-form solve.

    Receives a built model (dependency injection) and the original indices of the blocks to
    remove. Drive it with :meth:`calibrate`; afterwards ``module.sites`` (and ``module.spans``) hold
    solved maps and :meth:`correction` gives what each kind does to the pruned model. The model
    itself is not pruned here (see :func:`~shift_lightning.surgery.remove_blocks`).
    ``kinds`` (default ``[cfg.kind]``) fits several kinds from the same pass(es).
    """

    needs_grad_mode = True  # solved adapters must not be inference tensors
    stage = "calibration statistics"

    def __init__(self, model: nn.Module, removed: list[int], cfg: CalibrationConfig | None = None,
                 kinds: list[str] | None = None):
        super().__init__()
        self.model = model
        self.cfg = cfg = cfg or CalibrationConfig()
        requested = list(dict.fromkeys(kinds or [cfg.kind + ("+guard" if cfg.guard else "")]))
        self.guarded = [k[: -len("+guard")] for k in requested if k.endswith("+guard")]
        self.kinds = list(dict.fromkeys(k.removesuffix("+guard") for k in requested))
        bad = [k for k in self.kinds if k not in KINDS] + [k for k in self.guarded if k not in SITE_KINDS]
        if bad:
            raise ConfigError(f"Unknown calibration kind(s) {bad}; choose from {', '.join(KINDS)}")
        site_kinds = [k for k in self.kinds if k in SITE_KINDS]
        if cfg.mode == "sequential" and (len(self.kinds) > 1 or not site_kinds):
            raise ConfigError("--calibration.mode sequential fits one kind of the LRA family (residual, nobias, "
                              "affine); ReplaceMe and LinearPatch are fitted on the original model (independent)")
        if self.guarded and (cfg.mode == "sequential" or cfg.guard_every < 2):
            raise ConfigError("The do-no-harm guard needs --calibration.mode independent and guard_every >= 2")
        if cfg.rank is not None and any(k in ("affine", "replaceme", "linearpatch") for k in self.kinds):
            raise ConfigError("--calibration.rank applies to residual / nobias adapters only")
        self.removed = sorted(removed)
        self.num_layers = len(decoder_layers(model))  # the original depth (the model may be pruned later)
        self.dim = model.config.hidden_size
        AdapterSpec(self.dim, "residual", cfg.rank)  # validate the rank early
        span_primary = next((k for k in self.kinds if k in SPAN_KINDS), "residual")
        if site_kinds:
            self.sites = make_sites(self.removed, cfg.granularity, site_kinds[0])
            same = cfg.granularity == "span"
            self.spans = self.sites if same else [Site(k, s, e, primary=span_primary) for k, (s, e)
                                                  in enumerate(contiguous_spans(self.removed))]
        else:
            self.spans = self.sites = [Site(k, s, e, primary=span_primary) for k, (s, e)
                                       in enumerate(contiguous_spans(self.removed))]
        # what the current pass does (set by _run_pass)
        self._capture: list[Site] = []
        self._capture_spans: list[Site] = []
        self._bypass: list[Site] = []
        self._mask: torch.Tensor | None = None
        self._mode = "stats"

    # ---------------------------------------------------------------- what each pass collects
    def _wants(self, site: Site, is_span: bool) -> tuple[bool, bool, bool]:
        """(x/Δ stats, ReplaceMe's MLP-branch stats, LinearPatch scale) for ``site`` in this pass."""
        site_level = not is_span or site in self.sites
        need_stats = (site_level and any(k in SITE_KINDS for k in self.kinds)) or (
            is_span and ("linearpatch" in self.kinds or len(self.kinds) > 1))
        need_mlp = is_span and "replaceme" in self.kinds and site.start >= 1
        need_scale = is_span and "linearpatch" in self.kinds and self._fitting
        return need_stats, need_mlp, need_scale

    def _alloc(self, device) -> None:
        acc = self.cfg.accum_dtype
        nr, ns = RidgeStats.numel(self.dim), ChannelScaleStats.numel(self.dim)
        plan = []
        for site in self._capture:
            plan.append((site, self._wants(site, False)))
        for span in self._capture_spans:
            if span not in self._capture:
                plan.append((span, self._wants(span, True)))
            else:  # a span that is also a site: add its span-only needs
                _, mlp, scale = self._wants(span, True)
                plan.append((span, (False, mlp, scale)))
        guard = [site for site in self._capture if self.guarded and self._fitting]
        total = sum(nr * a + nr * b + ns * c for _, (a, b, c) in plan) + nr * len(guard)
        self._flat = torch.zeros(total, dtype=torch.float64, device=device)
        off = 0
        for site in guard:
            site.guard_stats = RidgeStats(self.dim, site.name + " [guard windows]", accum_dtype=acc,
                                          buffer=self._flat[off:off + nr])
            off += nr
        for site, (a, b, c) in plan:
            if a:
                site.stats = RidgeStats(self.dim, site.name, accum_dtype=acc, buffer=self._flat[off:off + nr])
                off += nr
            if b:
                site.mlp_stats = RidgeStats(self.dim, site.name + " [MLP branch]", accum_dtype=acc,
                                            buffer=self._flat[off:off + nr])
                off += nr
            if c:
                site.scale = ChannelScaleStats(self.dim, site.name, buffer=self._flat[off:off + ns])
                off += ns

    # ---------------------------------------------------------------- hooks for one pass
    def _install(self):
        blocks = decoder_layers(self.model)
        handles = []
        inputs: dict[int, torch.Tensor] = {}
        branch: dict[int, torch.Tensor] = {}
        groups: dict[int, list[Site]] = {}
        for s in self._capture + [t for t in self._capture_spans if t not in self._capture]:
            groups.setdefault(s.end, []).append(s)
        spans = set(id(s) for s in self._capture_spans)
        last_end = max(groups)

        for start in sorted({s.start for g in groups.values() for s in g}):
            def pre(mod, args, kwargs, start=start):
                inputs[start] = block_input(args, kwargs)

            handles.append(blocks[start].register_forward_pre_hook(pre, with_kwargs=True))
        for j in sorted({s.start - 1 for s in self._capture_spans if s.mlp_stats is not None}):
            def on_branch(mod, args, output, j=j):
                branch[j] = block_output(output)

            handles.append(mlp_branch(blocks[j]).register_forward_hook(on_branch))

        for end, group in groups.items():
            def post(mod, args, kwargs, output, group=group, end=end):
                y = block_output(output)
                m = self._mask
                for s in group:
                    x = inputs[s.start]
                    if s.stats is not None and (s in self._capture or id(s) in spans):
                        s.stats.add_batch(x[m], (y - x)[m])
                    if s.guard_stats is not None and s in self._capture:
                        g = m & self._guard_rows[:, None]
                        s.guard_stats.add_batch(x[g], (y - x)[g])
                    if id(s) in spans and s.mlp_stats is not None:
                        s.mlp_stats.add_batch(branch[s.start - 1][m], (y - x)[m])
                    if id(s) in spans and s.scale is not None:
                        s.scale.add_batch(x, y, m)
                if end == last_end:
                    raise _StopForward

            handles.append(blocks[end - 1].register_forward_hook(post, with_kwargs=True))
        return handles

    def _bypasses(self) -> dict[int, nn.Module]:
        from .arch import Bypass

        return {j: Bypass(site.adapter.to(self.device) if j == site.start else None)
                for site in self._bypass for j in range(site.start, site.end)}

    def step(self, batch, batch_idx):
        self._mask = batch["attention_mask"].bool()
        if self.guarded:
            self._guard_rows = (batch["index"] % self.cfg.guard_every) == self.cfg.guard_every - 1
        if self._mode == "cache":
            return self._cache_batch(batch)
        with swapped_blocks(self.model, self._bypasses()):
            handles = self._install()
            try:
                with torch.no_grad():
                    self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
            except _StopForward:
                pass
            finally:
                for h in handles:
                    h.remove()

    def begin(self):
        if self._mode == "cache":
            self._cached: list[dict] = []
            self._flat = torch.zeros(0, dtype=torch.float64, device=self.device)
        else:
            self._alloc(self.device)  # allocated here: the module is on its device now

    def state(self) -> list[torch.Tensor]:
        return [self._flat]  # ONE flat buffer holding every captured site's statistics

    def finish(self):
        if self._mode == "cache":
            self._walk()  # still inside the predict loop: model on its device, process group alive

    def _run_pass(self, trainer: L.Trainer, windows: TokenWindows, capture: list[Site], bypass: list[Site],
                  batch_size: int, spans: list[Site] | None = None, fitting: bool = True):
        self._capture, self._bypass = capture, bypass
        self._capture_spans = spans or []
        self._fitting = fitting
        self.stage = ("calibration statistics" if fitting else "held-out errors") \
            + (" (sequential)" if self._mode == "cache" else "")
        self.run(trainer, windows, batch_size)

    # ---------------------------------------------------------------- sequential mode (GPTQ-style)
    def _cache_batch(self, batch):
        """Run the model up to the first site; keep its hidden state and every block's call arguments."""
        blocks = decoder_layers(self.model)
        first, last = self.sites[0].start, max(s.end for s in self.sites) - 1
        sink: dict = {}
        stubs = {j: _Recorder(j, sink, last) for j in range(first, last + 1)}
        with swapped_blocks(self.model, stubs), torch.no_grad():
            try:
                self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
            except _StopForward:
                pass
        del blocks
        self._cached.append({"h": sink.pop("h"), "calls": sink, "mask": self._mask})

    @torch.no_grad()
    def _walk(self):
        """Block after block over the cached batches: kept blocks update the states, each site is
        accumulated, (when fitting) reduced and solved, then bypassed by its adapter."""
        blocks = decoder_layers(self.model)
        site_at = {s.start: s for s in self.sites}
        j, last = self.sites[0].start, max(s.end for s in self.sites)

        def run_block(i, entry, h):
            args, kwargs = entry["calls"][i]
            return block_output(blocks[i](h, *args, **kwargs))

        while j < last:
            site = site_at.get(j)
            if site is None:
                for e in self._cached:
                    e["h"] = run_block(j, e, e["h"])
                j += 1
                continue
            target = site if self._fitting else Site(site.index, site.start, site.end)
            flat = torch.zeros(RidgeStats.numel(self.dim), dtype=torch.float64, device=self.device)
            target.stats = RidgeStats(self.dim, site.name, accum_dtype=self.cfg.accum_dtype, buffer=flat)
            for e in self._cached:
                x, y = e["h"], e["h"]
                for i in range(site.start, site.end):
                    y = run_block(i, e, y)
                m = e["mask"]
                target.stats.add_batch(x[m], (y - x)[m])
            sum_across_ranks([flat], self.trainer)
            if self._fitting:
                self._solve([(site, site.primary)])
            else:
                self._measured.append(target)
            adapter = site.adapter.to(self.device)
            for e in self._cached:
                e["h"] = adapter(e["h"])
            j = site.end
        self._cached = []

    # ---------------------------------------------------------------- solve
    def _jobs(self) -> list[tuple[Site, str]]:
        jobs = []
        for kind in self.kinds:
            if kind in SITE_KINDS:
                jobs += [(s, kind) for s in self.sites]
                if kind in self.guarded:
                    jobs += [(s, kind + "+guard") for s in self.sites]
            elif kind == "replaceme":
                jobs += [(s, kind) for s in self.spans if s.start >= 1]
        return jobs

    def _solve(self, jobs: list[tuple[Site, str]]):
        """Solve ``jobs`` shared out among ranks (job n on rank n mod world), then broadcast."""
        world, me = dist.world_size(), dist.rank()
        d, dtype = self.dim, next(self.model.parameters()).dtype
        for n, (s, name) in enumerate(jobs):
            owner = n % world
            kind, guarded = name.removesuffix("+guard"), name.endswith("+guard")
            low_rank = kind in ("residual", "nobias") and self.cfg.rank is not None and self.cfg.rank < d
            r = self.cfg.rank if low_rank else None
            stats = s.mlp_stats if kind == "replaceme" else s.stats
            solve_kind = "affine" if kind in ("affine", "replaceme") else "residual"
            bias = kind in ("residual", "affine")
            f64 = dict(dtype=torch.float64, device=stats.G.device)  # where the statistics live
            W, b, lam = torch.zeros(d, d, **f64), torch.zeros(d, **f64), torch.zeros(1, **f64)
            U, V = torch.zeros(d, r or 1, **f64), torch.zeros(d, r or 1, **f64)
            err: Exception | None = None
            if me == owner:
                try:
                    if guarded:
                        sol, rep = guarded_solve(stats, s.guard_stats, self.cfg.damping, r, solve_kind, bias)
                        s.report.setdefault("guard", {})[kind] = rep
                    else:
                        sol = ridge_solve(stats, self.cfg.damping, r, solve_kind, bias=bias)
                    W.copy_(sol.W), b.copy_(sol.b), lam.fill_(sol.lam)
                    if r:
                        U.copy_(sol.U), V.copy_(sol.V)
                except SolveError as e:
                    err, W[0, 0] = e, float("nan")
            dist.broadcast_tensors([W, b, U, V, lam], src=owner)
            if err is not None:
                raise err
            if not torch.isfinite(W).all():
                raise SolveError(f"{s.name}: the solve failed on rank {owner}; increase --calibration.damping")
            if guarded and world > 1:  # the path report lives on the owner; the choice follows from λ
                s.report.setdefault("guard", {}).setdefault(kind, {"chosen": "identity" if lam.item() == float("inf")
                                                                    else float(lam.item())})
            sol = Solution(W, b, U if r else None, V if r else None, float(lam.item()), solve_kind)
            s.solutions[name] = sol
            if kind != "replaceme":
                a = LinearResidualAdapter(AdapterSpec(d, solve_kind, r, bias), dtype=dtype, device=W.device)
                if r:
                    a.set_low_rank(U, V, b if bias else None)
                else:
                    a.set_full(W, b if bias else None)
                s.adapters[name] = a
            self._record(s, name, stats, sol)

    def _solve_linearpatch(self):
        d, dtype = self.dim, next(self.model.parameters()).dtype
        for s in self.spans:
            P = linearpatch_matrix(s.scale.scale())  # identical on every rank after the reduce
            sol = Solution(P, torch.zeros(d, dtype=torch.float64, device=P.device), None, None, 0.0, "affine")
            s.solutions["linearpatch"] = sol
            a = LinearResidualAdapter(AdapterSpec(d, "affine", None, False), dtype=dtype, device=P.device)
            a.set_full(P.T, None)  # y = x P = x Aᵀ with A = Pᵀ
            s.adapters["linearpatch"] = a
            s.report.setdefault("kinds", {})["linearpatch"] = {"scale_mean": float(s.scale.scale().mean())}
            if s.stats is not None:
                self._record(s, "linearpatch", s.stats, Solution(P.T, sol.b, None, None, 0.0, "affine"))

    def _record(self, s: Site, kind: str, stats: RidgeStats, sol: Solution) -> None:
        Wd, bd = sol.delta_map()
        entry = {"calib_rel_error": stats.relative_error(Wd, bd), "calib_tokens": stats.num_tokens, "lam": sol.lam,
                 "accum": stats.scheme}
        if kind == s.primary or (self.cfg.guard and kind == s.primary + "+guard"):
            s.report.update(entry)
        if len(self.kinds) > 1 or kind in SPAN_KINDS or kind.endswith("+guard"):
            s.report.setdefault("kinds", {}).setdefault(kind, {}).update(entry)

    def solve(self) -> list[Site]:
        """(Re)solve every site from the statistics its sites hold now, e.g. statistics summed over
        several passes (:meth:`add_statistics`) or reused with another damping or rank."""
        self._solve(self._jobs())
        if "linearpatch" in self.kinds:
            self._solve_linearpatch()
        return self.sites

    def add_statistics(self, other: "CalibrationModule") -> None:
        """Add the sites' statistics of ``other`` (same sites, e.g. a pass over more windows) to ours:
        sums of ``[X,1]ᵀ[X,1]``, ``[X,1]ᵀΔ``, ``Σ‖Δ‖²`` are additive over disjoint windows."""
        for mine, theirs in zip(self.sites, other.sites):
            if (mine.start, mine.end) != (theirs.start, theirs.end):
                raise ConfigError("add_statistics needs the same sites in both modules")
            if mine.stats is None:
                mine.stats = RidgeStats(self.dim, mine.name, device=theirs.stats.buffer.device)
            mine.stats.buffer += theirs.stats.buffer

    def calibrate(self, trainer: L.Trainer, windows: TokenWindows, heldout: TokenWindows | None = None,
                  batch_size: int = 4, check: bool = True) -> list[Site]:
        """Run the statistics pass(es) and the solves; returns the solved sites (every rank identical).

        ``check``: :func:`check_windows` first (a caller that checked before its own passes skips it)."""
        if check:
            check_windows(self.model, windows)
            if heldout is not None:
                check_windows(self.model, heldout, "--heldout", fitting=False)
        t0 = time.time()
        if self.cfg.mode == "independent":
            self._run_pass(trainer, windows, self.sites if any(k in SITE_KINDS for k in self.kinds) else [], [],
                           batch_size, spans=self.spans)
            self._solve(self._jobs())
            if "linearpatch" in self.kinds:
                self._solve_linearpatch()
        else:
            self._mode = "cache"
            try:
                self._run_pass(trainer, windows, [], [], batch_size)
            finally:
                self._mode = "stats"
        self.solve_seconds = time.time() - t0
        if heldout is not None and len(heldout):
            self.measure(trainer, heldout, batch_size, key="heldout")
        return self.sites

    def measure(self, trainer: L.Trainer, windows: TokenWindows, batch_size: int = 4, key: str = "heldout"):
        """Relative residual error ``‖Δ − Δ̂‖² / ‖Δ‖²`` of the solved maps on other windows."""
        if self.cfg.mode == "sequential":
            self._measured = []
            self._mode = "cache"
            try:
                self._run_pass(trainer, windows, [], [], batch_size, fitting=False)
            finally:
                self._mode = "stats"
            for f, site in zip(self._measured, self.sites):
                Wd, bd = site.solution.delta_map()
                site.report[f"{key}_rel_error"] = f.stats.relative_error(Wd, bd)
                site.report[f"{key}_tokens"] = f.stats.num_tokens
            return
        fresh = [Site(s.index, s.start, s.end, primary=s.primary) for s in self.sites]
        same = self.spans is self.sites
        fresh_spans = fresh if same else [Site(s.index, s.start, s.end, primary=s.primary) for s in self.spans]
        self._run_pass(trainer, windows, fresh if any(k in SITE_KINDS for k in self.kinds) else [], [], batch_size,
                       spans=fresh_spans, fitting=False)
        for f, site in zip(fresh, self.sites):
            for kind, sol in site.solutions.items():
                stats = f.mlp_stats if kind == "replaceme" else f.stats
                if stats is None:
                    continue
                Wd, bd = sol.delta_map() if kind != "linearpatch" else (sol.W - torch.eye(self.dim).to(sol.W), sol.b)
                err = stats.relative_error(Wd, bd)
                if kind == site.primary:
                    site.report[f"{key}_rel_error"], site.report[f"{key}_tokens"] = err, stats.num_tokens
                if "kinds" in site.report and kind in site.report["kinds"]:
                    site.report["kinds"][kind][f"{key}_rel_error"] = err
        if not same:
            self._span_errors(fresh_spans, key)

    def _span_errors(self, fresh_spans: list[Site], key: str) -> None:
        """Errors of every kind's whole-span map (merged adapters, ReplaceMe, LinearPatch) per span."""
        pos = pruned_positions(self.num_layers, self.removed)
        eye = torch.eye(self.dim, dtype=torch.float64)
        for f, span in zip(fresh_spans, self.spans):
            out = span.report.setdefault("span_errors", {})
            for kind in self.kinds + [k + "+guard" for k in self.guarded]:
                if kind == "replaceme":
                    sol = span.solutions.get(kind)
                    if sol is None or f.mlp_stats is None:
                        continue
                    Wd, bd = sol.delta_map()
                    out[kind] = {f"{key}_rel_error": f.mlp_stats.relative_error(Wd, bd)}
                    continue
                adapter = span.adapters.get(kind) if kind == "linearpatch" else \
                    self.correction(kind).adapters.get(pos[span.start])
                if adapter is None or f.stats is None:
                    continue
                M, c = _as_affine(adapter)
                out[kind] = {f"{key}_rel_error": f.stats.relative_error(M - eye.to(M), c)}

    # ---------------------------------------------------------------- results
    def adapters_by_position(self, kind: str | None = None) -> dict[int, nn.Module]:
        """Adapters keyed by pruned position; adjacent ones merged exactly when ``cfg.merge``."""
        kind = kind or (self.sites[0].primary + ("+guard" if self.cfg.guard else ""))
        pos = pruned_positions(self.num_layers, self.removed)
        if kind == "linearpatch":
            return {pos[s.start]: s.adapters[kind] for s in self.spans}
        groups: dict[int, list[Site]] = {}
        for s in self.sites:
            groups.setdefault(pos[s.start], []).append(s)
        out: dict[int, nn.Module] = {}
        for p, group in groups.items():
            chain = [s.adapters[kind] for s in sorted(group, key=lambda s: s.start)]
            if len(chain) == 1:
                out[p] = chain[0]
            elif self.cfg.merge:
                merged = chain[0]
                for a in chain[1:]:
                    merged = merge_adapters(merged, a)
                out[p] = merged
            else:
                out[p] = nn.Sequential(*chain)
        return out

    def correction(self, kind: str | None = None) -> Correction:
        """What ``kind`` (default: the configured one) does to the pruned model."""
        kind = kind or (self.cfg.kind + ("+guard" if self.cfg.guard else ""))
        if kind == "replaceme":
            c = Correction(kind, branch_maps={s.start - 1: s.solutions[kind].W.T for s in self.spans
                                              if kind in s.solutions})
            c.notes += [f"span {s.start}..{s.end - 1} starts at block 0: no block to fold ReplaceMe's map into; "
                        "left uncorrected" for s in self.spans if s.start == 0]
            return c
        return Correction(kind, adapters=self.adapters_by_position(kind))


def _as_affine(adapter: nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    chain = list(adapter) if isinstance(adapter, nn.Sequential) else [adapter]
    M, c = chain[0].affine()
    for a in chain[1:]:
        M2, c2 = a.affine()
        M, c = M2 @ M, M2 @ c + c2
    return M, c
