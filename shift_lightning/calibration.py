"""Closed-form calibration of Linear Residual Adapters, orchestrated by Lightning.

A *site* replaces the original blocks ``[start, end)`` by one adapter. With
``granularity="block"`` (the paper's default) every removed block is its own site and the adapters
of adjacent sites are merged exactly afterwards; ``granularity="span"`` fits one adapter per
contiguous run of removed blocks directly (ReplaceMe-style ablation).

Modes (``CalibrationConfig.mode``):

* ``independent`` (default): ONE gradient-free forward pass of the original model fills every
  site's statistics (input ``x`` = hidden state entering block ``start``, target
  ``Δ = h_end − x``). The pass stops after the last site's block.
* ``sequential``: site ``k`` sees the hidden states of the partially corrected pruned model: the
  blocks of sites ``< k`` are bypassed by their solved adapters. One (early-stopped) pass per site.

Distributed: windows are sharded with :class:`~shift_lightning.data.RankShard` (no sample counted
twice), each rank accumulates local sums, ONE all-reduce after the loop sums the flat statistics
buffer, site ``k`` is solved on rank ``k mod world`` and its solution is broadcast, so every
rank ends with identical adapters.
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
from .arch import Bypass, block_input, block_output, decoder_layers, swapped_blocks
from .data import TokenWindows
from .lra import AdapterSpec, LinearResidualAdapter, merge_adapters
from .passes import DataPass
from .stats import RidgeStats, Solution, SolveError, ridge_solve
from .surgery import contiguous_spans, pruned_positions

log = logging.getLogger(__name__)


@dataclass
class CalibrationConfig:
    """How adapters are fitted."""

    mode: Literal["independent", "sequential"] = "independent"
    """``independent`` (one pass of the original model) or ``sequential`` (each site sees the
    corrected pruned model's hidden states; one pass per site)."""
    granularity: Literal["block", "span"] = "block"
    """``block``: one adapter per removed block (merged afterwards); ``span``: one per contiguous run."""
    kind: Literal["residual", "affine"] = "residual"
    """``residual`` (y = x + xWᵀ + b) or ``affine`` (ablation: y = xAᵀ + c, no identity path)."""
    rank: int | None = None
    """Adapter rank r (W = UVᵀ, 2dr + d parameters, optimal reduced-rank fit); None = full rank."""
    damping: float = 1e-4
    """Relative ridge damping: λ = damping · mean(diag(XcᵀXc))."""
    merge: bool = True
    """Merge the adapters of adjacent removed blocks into one exact affine map."""
    accum_dtype: Literal["float64", "float32"] = "float64"
    """Products of a batch in ``float64``, or ``float32`` chunks added into the float64 master."""
    heldout: bool = True
    """Also measure every site's relative residual error on the held-out windows."""


@dataclass
class Site:
    """Original blocks ``[start, end)`` replaced by one adapter."""

    index: int
    start: int
    end: int
    stats: RidgeStats | None = None
    solution: Solution | None = None
    adapter: LinearResidualAdapter | None = None
    report: dict = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"site {self.index} (blocks {self.start}..{self.end - 1})"


class _StopForward(Exception):
    """Raised by a hook once every captured site of the pass has its data."""


def make_sites(removed: list[int], granularity: str) -> list[Site]:
    if granularity == "block":
        spans = [(i, i + 1) for i in sorted(removed)]
    elif granularity == "span":
        spans = contiguous_spans(removed)
    else:
        raise ValueError(f"granularity must be 'block' or 'span', got {granularity!r}")
    return [Site(k, s, e) for k, (s, e) in enumerate(spans)]


class CalibrationModule(DataPass):
    """Gradient-free statistics pass(es) + distributed closed-form solve.

    Receives a built model (dependency injection) and the original indices of the blocks to
    remove. Drive it with :meth:`calibrate`; afterwards ``module.sites`` hold solved adapters.
    The model itself is not pruned here (see :func:`~shift_lightning.surgery.remove_blocks`).
    """

    needs_grad_mode = True  # solved adapters must not be inference tensors
    stage = "calibration statistics"

    def __init__(self, model: nn.Module, removed: list[int], cfg: CalibrationConfig | None = None):
        super().__init__()
        self.model = model
        self.cfg = cfg or CalibrationConfig()
        self.removed = sorted(removed)
        self.sites = make_sites(self.removed, self.cfg.granularity)
        self.dim = model.config.hidden_size
        AdapterSpec(self.dim, self.cfg.kind, self.cfg.rank)  # validate early
        # what the current pass does (set by _run_pass)
        self._capture: list[Site] = []
        self._bypass: list[Site] = []
        self._mask: torch.Tensor | None = None
        self._inputs: dict[int, torch.Tensor] = {}

    # ---------------------------------------------------------------- hooks for one pass
    def _install(self):
        blocks = decoder_layers(self.model)
        handles = []
        last_end = max(s.end for s in self._capture)
        for site in self._capture:
            def pre(mod, args, kwargs, site=site):
                self._inputs[site.index] = block_input(args, kwargs)

            def post(mod, args, kwargs, output, site=site):
                x = self._inputs.pop(site.index)
                y = block_output(output)
                m = self._mask
                site.stats.add_batch(x[m], (y - x)[m])
                if site.end == last_end:
                    raise _StopForward

            handles.append(blocks[site.start].register_forward_pre_hook(pre, with_kwargs=True))
            handles.append(blocks[site.end - 1].register_forward_hook(post, with_kwargs=True))
        return handles

    def _bypasses(self) -> dict[int, nn.Module]:
        """Blocks of already solved sites, replaced by their adapters (sequential mode)."""
        return {j: Bypass(site.adapter.to(self.device) if j == site.start else None)
                for site in self._bypass for j in range(site.start, site.end)}

    def step(self, batch, batch_idx):
        self._mask = batch["attention_mask"].bool()
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
                self._inputs.clear()

    def begin(self):
        self._new_stats(self._capture, self.device)  # allocated here: the module is on its device now

    def state(self) -> list[torch.Tensor]:
        return [self._flat]  # ONE flat buffer holding every captured site's statistics

    # ---------------------------------------------------------------- passes and solve
    def _new_stats(self, sites: list[Site], device):
        acc = torch.float64 if self.cfg.accum_dtype == "float64" else torch.float32
        n = RidgeStats.numel(self.dim)
        self._flat = torch.zeros(n * len(sites), dtype=torch.float64, device=device)
        for i, s in enumerate(sites):
            s.stats = RidgeStats(self.dim, s.name, accum_dtype=acc, buffer=self._flat[i * n:(i + 1) * n])

    def _run_pass(self, trainer: L.Trainer, windows: TokenWindows, capture: list[Site], bypass: list[Site],
                  batch_size: int):
        self._capture, self._bypass = capture, bypass
        self.run(trainer, windows, batch_size)

    def _solve(self, sites: list[Site]):
        """Solve ``sites`` shared out among ranks (site k on rank k mod world), then broadcast."""
        world, me = dist.world_size(), dist.rank()
        d, dtype = self.dim, next(self.model.parameters()).dtype
        for s in sites:
            owner = s.index % world
            r = self.cfg.rank if (self.cfg.rank is not None and self.cfg.rank < d) else None
            f64 = dict(dtype=torch.float64, device=s.stats.G.device)  # where the statistics live
            W, b, lam = torch.zeros(d, d, **f64), torch.zeros(d, **f64), torch.zeros(1, **f64)
            U, V = torch.zeros(d, r or 1, **f64), torch.zeros(d, r or 1, **f64)
            err: Exception | None = None
            if me == owner:
                try:
                    sol = ridge_solve(s.stats, self.cfg.damping, r, self.cfg.kind)
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
            s.solution = Solution(W, b, U if r else None, V if r else None, float(lam.item()), self.cfg.kind)
            a = LinearResidualAdapter(AdapterSpec(d, self.cfg.kind, r), dtype=dtype, device=W.device)
            if r:
                a.set_low_rank(U, V, b)
            else:
                a.set_full(W, b)
            s.adapter = a
            Wd, bd = s.solution.delta_map()
            s.report.update(calib_rel_error=s.stats.relative_error(Wd, bd), calib_tokens=s.stats.num_tokens,
                            lam=s.solution.lam)

    def calibrate(self, trainer: L.Trainer, windows: TokenWindows, heldout: TokenWindows | None = None,
                  batch_size: int = 4) -> list[Site]:
        """Run the statistics pass(es) and the solve; returns the solved sites (every rank identical)."""
        t0 = time.time()
        if self.cfg.mode == "independent":
            self._run_pass(trainer, windows, self.sites, [], batch_size)
            self._solve(self.sites)
        else:
            for k, site in enumerate(self.sites):
                self._run_pass(trainer, windows, [site], self.sites[:k], batch_size)
                self._solve([site])
        self.solve_seconds = time.time() - t0
        if heldout is not None and len(heldout):
            self.measure(trainer, heldout, batch_size, key="heldout")
        return self.sites

    def measure(self, trainer: L.Trainer, windows: TokenWindows, batch_size: int = 4, key: str = "heldout"):
        """Relative residual error ``‖Δ − Δ̂‖² / ‖Δ‖²`` of the solved adapters on other windows."""
        solved = {s.index: s for s in self.sites}
        passes = [(self.sites, [])] if self.cfg.mode == "independent" else \
            [([s], self.sites[:k]) for k, s in enumerate(self.sites)]
        for capture, bypass in passes:
            fresh = [Site(s.index, s.start, s.end, adapter=s.adapter) for s in capture]
            byp = [Site(s.index, s.start, s.end, adapter=s.adapter) for s in bypass]
            self._run_pass(trainer, windows, fresh, byp, batch_size)
            for f in fresh:
                site = solved[f.index]
                Wd, bd = site.solution.delta_map()
                site.report[f"{key}_rel_error"] = f.stats.relative_error(Wd, bd)
                site.report[f"{key}_tokens"] = f.stats.num_tokens

    # ---------------------------------------------------------------- final adapters
    def adapters_by_position(self) -> dict[int, nn.Module]:
        """Adapters keyed by pruned position; adjacent ones merged exactly when ``cfg.merge``."""
        n = len(decoder_layers(self.model))
        pos = pruned_positions(n, self.removed)
        groups: dict[int, list[Site]] = {}
        for s in self.sites:
            groups.setdefault(pos[s.start], []).append(s)
        out: dict[int, nn.Module] = {}
        for p, group in groups.items():
            chain = [s.adapter for s in sorted(group, key=lambda s: s.start)]
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
