"""Collection: what one forward pass of the original model gathers for every site. Framework-free.

Each solver declares the statistics it needs (:attr:`~shift_lightning.maps.solvers.Solver.needs`);
for every site or span :class:`Collector` allocates them in one float64 buffer per site (summed across N
ranks in ONE packed all-reduce; a site's buffer is freed once it is solved) and installs forward hooks that
fill them:

=========  =============================================================================================
``io``     :class:`~shift_lightning.maps.ridge.RidgeStats` of ``(x, Δ)``: ``x`` the hidden state entering block
           ``start``, ``Δ = h_end − x`` what the removed blocks add to the residual stream
``branch`` ``RidgeStats`` of ``(m, Δ)``: ``m`` the MLP-branch output of block ``start − 1`` (ReplaceMe)
``joint``  ``RidgeStats`` of ``([x, m], Δ)`` (inputs ``2d`` wide, targets ``d``): the LRA and ReplaceMe's
           branch map fitted together (:mod:`~shift_lightning.maps.solvers.joint`); spans with a block before them only
``down``   ``RidgeStats`` of ``(u, Δ)`` (inputs ``d_ff`` wide, targets ``d``): ``u`` the input of block ``start − 1``'s
           ``mlp.down_proj`` (the stock repair, :mod:`~shift_lightning.maps.solvers.stock`); spans with a block before them only
``scale``  :class:`~shift_lightning.maps.peers.ChannelScaleStats` of the span's input and output (LinearPatch)
``rows``   the rows ``(m, m + Δ)`` themselves, cached on the CPU per window (iterative solvers:
           ReplaceMe's cosine objective); gathered from every rank in window order, not summed
=========  =============================================================================================

With ``heldout_every = k`` every k-th window (``index % k == k − 1``) is *also* added into held-out
copies of ``io`` and ``branch`` (``held_io``, ``held_branch``): the guards fit on the rest
(:meth:`SiteStatistics.fitting`) and judge on those. Padding tokens never reach a sum. The hook at
the last site's block raises :class:`StopForward`: the pass never runs further than it needs.

Where a site has ``joint``, its ``io`` is not accumulated a second time: ``[x, 1]ᵀ[x, 1, Δ]`` is a block of
``[x, m, 1]ᵀ[x, m, 1, Δ]``, copied out by :meth:`Collector.derive` after the pass (``2d²`` of the ``8d²``
products per token and span the two would take, about a quarter of the joint map's extra statistics).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from .. import dist
from ..arch import StopForward, block_input, block_output, decoder_layers, mlp_branch
from ..maps.peers import ChannelScaleStats
from ..maps.ridge import RidgeStats
from ..maps.sites import Site

#: Statistics a solver may ask for (see the module doc).
NEEDS = ("io", "branch", "joint", "down", "scale", "rows")


class ActivationRows:
    """Rows ``(m, target)`` of one span, float32 on the CPU, kept per calibration window so that
    1 and N ranks see them in the same order; at most ``max_tokens`` rows are used (window order)."""

    def __init__(self, dim: int, max_tokens: int):
        self.dim, self.max_tokens = dim, max_tokens
        self.parts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @torch.no_grad()
    def add(self, windows: torch.Tensor, m: torch.Tensor, target: torch.Tensor, mask: torch.Tensor) -> None:
        """``windows: (B,)`` window indices; ``m, target: (B, T, d)``; ``mask: (B, T)`` real tokens."""
        for b, w in enumerate(windows.tolist()):
            keep = mask[b]
            self.parts[int(w)] = (m[b][keep].float().cpu(), target[b][keep].float().cpu())

    def gather(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Every rank's rows, in window order, capped at ``max_tokens``: ``(M, Y)``, each ``(N, d)``.
        A collective under ``torch.distributed``: every rank calls it (the first call; later calls
        return the same rows)."""
        if getattr(self, "_gathered", None) is not None:
            return self._gathered
        parts = dict(self.parts)
        if dist.world_size() > 1:
            import torch.distributed as tdist

            gathered: list = [None] * dist.world_size()
            tdist.all_gather_object(gathered, self.parts)
            parts = {k: v for g in gathered for k, v in g.items()}
        ms, ys, n = [], [], 0
        for w in sorted(parts):
            m, y = parts[w]
            take = min(m.shape[0], self.max_tokens - n)
            if take <= 0:
                break
            ms.append(m[:take]), ys.append(y[:take])
            n += take
        if not ms:
            z = torch.zeros(0, self.dim)
            self._gathered = (z, z.clone())
        else:
            self._gathered = (torch.cat(ms), torch.cat(ys))
        self.parts = {}
        return self._gathered


@dataclass(eq=False)
class SiteStatistics:
    """What the pass gathered for one site or span (fields ``None`` when nobody asked for them)."""

    site: Site
    io: RidgeStats | None = None
    branch: RidgeStats | None = None
    scale: ChannelScaleStats | None = None
    rows: ActivationRows | None = None
    held_io: RidgeStats | None = None
    held_branch: RidgeStats | None = None
    extra: dict = field(default_factory=dict)
    joint: RidgeStats | None = None
    held_joint: RidgeStats | None = None
    down: RidgeStats | None = None
    held_down: RidgeStats | None = None
    meters: list = field(default_factory=list)  # (input: io / branch / joint / down, ResidualMeter): held-out errors

    def fitting(self) -> "SiteStatistics":
        """The statistics without the held-out windows (sums are additive: all − held)."""

        def minus(a: RidgeStats | None, h: RidgeStats | None) -> RidgeStats | None:
            if a is None or h is None:
                return a
            out = RidgeStats(a.dim, a.name + " [fitting windows]", device=a.buffer.device, out_dim=a.out_dim)
            out.buffer.copy_(a.buffer - h.buffer)
            return out

        return SiteStatistics(self.site, minus(self.io, self.held_io), minus(self.branch, self.held_branch),
                              self.scale, self.rows, joint=minus(self.joint, self.held_joint),
                              down=minus(self.down, self.held_down))


class Collector:
    """One pass's statistics for ``plan`` (``(site, needs)`` pairs, needs from :data:`NEEDS`; pairs
    of the same blocks ``[start, end)`` share one :class:`SiteStatistics`), see the module doc."""

    def __init__(self, dim: int, plan: list[tuple[Site, set[str]]], accum_dtype: str = "float64",
                 heldout_every: int | None = None, max_rows: int = 262144, ffn_dim: int | None = None,
                 meters: list[tuple[Site, str, object]] | None = None):
        merged: dict[tuple[int, int], tuple[Site, set[str]]] = {}
        for site, needs in plan:
            merged.setdefault(site.key, (site, set()))[1].update(needs)
        for site, _, _ in meters or []:
            merged.setdefault(site.key, (site, set()))
        self.plan = {site: needs for site, needs in merged.values()}
        self.meters = meters or []  # (site, input, ResidualMeter): filled by the same hooks (held-out errors)
        self.dim, self.accum, self.ffn_dim = dim, accum_dtype, ffn_dim
        if ffn_dim is None and any("down" in needs for needs in self.plan.values()):
            raise ValueError("the down_proj statistics need the model's MLP width (ffn_dim)")
        self.heldout_every, self.max_rows = heldout_every, max_rows
        self.stats: dict[tuple[int, int], SiteStatistics] = {}
        self.buffers: dict[tuple[int, int], torch.Tensor] = {}
        self._mask: torch.Tensor | None = None
        self._windows: torch.Tensor | None = None
        self._entry = 0

    def site_numel(self, site: Site, needs: set[str]) -> int:
        """float64 elements of one site's sums (see :meth:`allocate`)."""
        nr, ns = RidgeStats.numel(self.dim), ChannelScaleStats.numel(self.dim)
        copies = 2 if self.heldout_every else 1
        total = nr * ("io" in needs) * copies + nr * ("branch" in needs and site.start >= 1) * copies
        total += ns * ("scale" in needs)
        total += RidgeStats.numel(2 * self.dim, self.dim) * ("joint" in needs and site.start >= 1) * copies
        if "down" in needs and site.start >= 1:
            total += RidgeStats.numel(self.ffn_dim, self.dim) * copies
        return total

    def numel(self) -> int:
        return sum(self.site_numel(site, needs) for site, needs in self.plan.items())

    def allocate(self, device, keys: set[tuple[int, int]] | None = None) -> dict[tuple[int, int], SiteStatistics]:
        """One float64 buffer per site (on ``device``; :attr:`buffers`, summed across ranks in ONE packed all-reduce)
        and one :class:`SiteStatistics` per site, views into it: a site's sums are freed with it once it is solved.
        ``keys``: (re)allocate these sites only (a walk that opens each site at its first block allocates every
        site on the meta device first, for :meth:`install` to see what each one gathers)."""
        if keys is None:
            self.stats, self.buffers = {}, {}
        for site, needs in self.plan.items():
            if keys is not None and site.key not in keys:
                continue
            buf = self.buffers[site.key] = torch.zeros(self.site_numel(site, needs), dtype=torch.float64, device=device)
            off = 0

            def take(n):
                nonlocal off
                off += n
                return buf[off - n:off]

            def ridge(name, dim=self.dim, out_dim=None):
                return RidgeStats(dim, name, accum_dtype=self.accum, buffer=take(RidgeStats.numel(dim, out_dim)),
                                  out_dim=out_dim)

            st = SiteStatistics(site)
            if "io" in needs:
                st.io = ridge(site.name)
                if self.heldout_every:
                    st.held_io = ridge(site.name + " [held-out windows]")
            if "branch" in needs and site.start >= 1:
                st.branch = ridge(site.name + " [MLP branch]")
                if self.heldout_every:
                    st.held_branch = ridge(site.name + " [MLP branch, held-out windows]")
            if "joint" in needs and site.start >= 1:
                copies = [("joint", "")] + ([("held_joint", ", held-out windows")] if self.heldout_every else [])
                for attr, tag in copies:
                    setattr(st, attr, ridge(f"{site.name} [input and MLP branch{tag}]", 2 * self.dim, self.dim))
            if "down" in needs and site.start >= 1:
                copies = [("down", "")] + ([("held_down", ", held-out windows")] if self.heldout_every else [])
                for attr, tag in copies:
                    setattr(st, attr, ridge(f"{site.name} [down_proj input{tag}]", self.ffn_dim, self.dim))
            if "scale" in needs:
                st.scale = ChannelScaleStats(self.dim, site.name, buffer=take(ChannelScaleStats.numel(self.dim)))
            if "rows" in needs and site.start >= 1:
                st.rows = ActivationRows(self.dim, self.max_rows)
            self.stats[site.key] = st
        if self.meters and keys is None:  # three sums a meter, in one buffer of their own (packed into the same all-reduce)
            buf = self.buffers["meters"] = torch.zeros(3 * len(self.meters), dtype=torch.float64, device=device)
            for n, (site, inp, meter) in enumerate(self.meters):
                meter.buffer = buf[3 * n:3 * n + 3]
                self.stats[site.key].meters.append((inp, meter))
        return self.stats

    def release(self, key: tuple[int, int]) -> None:
        """Forget site ``key``'s sums (its buffer is freed once nothing else holds its statistics)."""
        self.stats.pop(key, None)
        self.buffers.pop(key, None)

    def derive(self, keys: list[tuple[int, int]] | None = None) -> None:
        """After the pass (and its all-reduce): each site's ``io`` (and ``held_io``) copied out of its ``joint``
        (``held_joint``) where it has one: the rows and columns of ``x`` and of the ones column. The same sums
        as accumulating ``io`` itself, up to float64 rounding. ``keys``: these sites only."""
        d = self.dim
        idx = torch.cat([torch.arange(d), torch.tensor([2 * d])])
        for key, st in self.stats.items():
            if keys is not None and key not in keys:
                continue
            for io, joint in ((st.io, st.joint), (st.held_io, st.held_joint)):
                if io is None or joint is None:
                    continue
                i = idx.to(joint.G.device)
                io.G.copy_(joint.G[i][:, i])
                io.C.copy_(joint.C[i])
                io.yy.copy_(joint.yy)
                io.scheme = joint.scheme

    def batch(self, mask: torch.Tensor, windows: torch.Tensor | None, entry: int = 0) -> None:
        """The current batch's real-token mask ``(B, T)``, window indices ``(B,)`` and its place in the walk's cache
        (a block-major walk runs block ``j`` on every batch before block ``j + 1``: what a hook keeps for a later
        block is kept per batch)."""
        self._mask, self._windows, self._entry = mask, windows, entry

    def _add(self, st: SiteStatistics, x, y, b, u, m, held) -> None:
        """One batch into site ``st``: ``x`` the state entering it, ``y`` the state after it, ``b`` the MLP branch of
        the block before it, ``u`` that block's down_proj input (None where nobody asked); ``m`` / ``held``: the real
        tokens / those of held-out windows."""
        delta = y - x
        take = {"io": lambda k: x[k], "branch": lambda k: b[k], "joint": lambda k: torch.cat([x[k], b[k]], dim=1),
                "down": lambda k: u[k]}
        for name in ("io", "branch", "joint", "down"):
            stats, held_stats = getattr(st, name), getattr(st, "held_" + name)
            if stats is None or (name == "io" and st.joint is not None):  # with joint, io is a block of it (derive())
                continue
            stats.add_batch(take[name](m), delta[m])
            if held_stats is not None:
                held_stats.add_batch(take[name](held), delta[held])
        if st.scale is not None:
            st.scale.add_batch(x, y, m)
        if st.rows is not None:
            st.rows.add(self._windows, b, b + delta, m)
        for inp, meter in st.meters:
            meter.add_batch(take[inp](m), delta[m])

    def install(self, model: nn.Module) -> list:
        """Forward hooks that fill the statistics while blocks run; remove them after. What a hook keeps for a
        later block (a site's input, block ``start − 1``'s branch) is keyed by the batch (:meth:`batch`) and
        dropped once the last site that needs it has its data."""
        blocks = decoder_layers(model)
        inputs: dict[tuple[int, int], torch.Tensor] = {}
        branch: dict[tuple[int, int], torch.Tensor] = {}
        down_in: dict[tuple[int, int], torch.Tensor] = {}
        by_end: dict[int, list[tuple[int, int]]] = {}  # keys: a site's statistics may be allocated after install
        for key, st in self.stats.items():
            by_end.setdefault(st.site.end, []).append(key)
        last_end = max(by_end)
        done_at: dict[int, int] = {}  # site start -> the last end of the sites starting there
        for st in self.stats.values():
            done_at[st.site.start] = max(done_at.get(st.site.start, 0), st.site.end)
        handles = []
        for start in sorted({st.site.start for st in self.stats.values()}):
            def pre(mod, args, kwargs, start=start):
                inputs[self._entry, start] = block_input(args, kwargs)

            handles.append(blocks[start].register_forward_pre_hook(pre, with_kwargs=True))
        for j in sorted({st.site.start - 1 for st in self.stats.values()
                         if st.branch is not None or st.rows is not None or st.joint is not None
                         or any(inp in ("branch", "joint") for inp, _ in st.meters)}):
            def on_branch(mod, args, output, j=j):
                branch[self._entry, j] = block_output(output)

            handles.append(mlp_branch(blocks[j]).register_forward_hook(on_branch))
        for j in sorted({st.site.start - 1 for st in self.stats.values()
                         if st.down is not None or any(inp == "down" for inp, _ in st.meters)}):
            def on_down(mod, args, j=j):
                down_in[self._entry, j] = args[0]

            handles.append(blocks[j].mlp.down_proj.register_forward_pre_hook(on_down))

        for end, group in by_end.items():
            def post(mod, args, kwargs, output, group=group, end=end):
                y = block_output(output)
                m, e = self._mask, self._entry
                held_mask = None
                if self.heldout_every and self._windows is not None:
                    k = self.heldout_every
                    held_mask = m & ((self._windows % k) == k - 1).to(m.device)[:, None]
                group = [self.stats[key] for key in group]
                for st in group:
                    j = st.site.start - 1
                    self._add(st, inputs[e, j + 1], y, branch.get((e, j)), down_in.get((e, j)), m, held_mask)
                for st in group:  # what no later site of this batch needs
                    if done_at[st.site.start] == end:
                        for kept in (inputs, branch, down_in):
                            kept.pop((e, st.site.start - (kept is not inputs)), None)
                if end == last_end:
                    raise StopForward

            handles.append(blocks[end - 1].register_forward_hook(post, with_kwargs=True))
        return handles
