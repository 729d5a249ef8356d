"""``linear_fit``: remove the blocks whose removal the closed-form map repairs best.

The data-driven criteria above ask how little a block changes the hidden state (angular, block
influence) or how little its removal hurts (PPL, Taylor): they judge plain pruning, not the
repaired model. This one judges what calibration will actually build. Windows are split: every
``heldout_every``-th window judges, the others fit.

**Fit** (one pass over the fitting windows, all candidate blocks at once): per candidate block ``i``
the streaming statistics of ``(x_i, Δ_i = block_i(x_i) − x_i)`` (:class:`~shift_lightning.maps.ridge.RidgeStats`),
then the LRA ``x ↦ x + x W_iᵀ + b_i`` of each block (:func:`~shift_lightning.maps.ridge.ridge_solve`,
relative damping ``PruneConfig.damping``): exactly the per-block maps that independent calibration
fits, whose chain over a span is what the pruned model gets (merged exactly).

**Judge** (one pass over the held-out windows): for every candidate span ``[a, b)`` of at most ``k``
blocks, the span's merged map is applied to the state entering it and compared with the state the
original leaves it with::

    cost(a, b) = Σ_t ‖h_b,t − M_ab(x_a,t)‖² / Σ_t ‖h_b,t‖²          M_ab = LRA_{b−1} ∘ … ∘ LRA_a

the residual energy the repaired span leaves unexplained, relative to the residual stream's energy
there (the identity map's version of this is what the angular criterion measures). It is computed
incrementally: entering block ``j`` a new chain starts from ``x_j``; after block ``j`` every open
chain ``a`` (``j − a < k``) is moved on by ``LRA_j`` and scored against ``h_{j+1}``: ``k`` maps a
block, float32 on the masked tokens.

**Select**: the set of ``k`` blocks whose spans (maximal runs, scored as one merged map each,
never as a sum of single-block scores) have the smallest total cost, by dynamic programming over
``(block, blocks removed)`` (separate spans are kept apart by at least one kept block).

Memory: the fit keeps ``(d+1)² + (d+1)d + 1`` float64 values per candidate block: 5.3 MB at
d = 576 (SmolLM2: 160 MB for 30 blocks), 6.6 MB at d = 640 (Gemma3-270M: 118 MB for 18 blocks),
268 MB at d = 4096 (Llama-3-8B: 8.6 GB for 32 blocks). Candidates beyond ``max_stats_gb`` are
fitted in further passes over the fitting windows (groups of blocks); the judge pass needs ``k``
states of each batch and the float32 maps of the candidate blocks (2.1 GB at d = 4096, 32 blocks). Every pass is
block-major (:class:`~shift_lightning.selection.CriterionScorer`): it runs onloaded, each block read once a pass.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from ..closeness import kl_top1_from_hidden, lm_softcap, topk_from_hidden
from ..maps.lra import AdapterSpec, LinearResidualAdapter
from ..maps.ridge import RidgeStats, ridge_solve
from .base import CriterionError


def _best_sets(cost: dict[tuple[int, int], float], allowed: list[int], num_layers: int, k: int
               ) -> dict[int, tuple[float, tuple[int, ...]]]:
    """Number of spans ``s`` → the least ``(Σ cost, blocks)`` over sets of ``k`` blocks of ``allowed`` made of
    ``s`` maximal runs (dynamic programming over ``(block, blocks removed, runs)``; separate runs are kept
    apart by at least one kept block)."""
    ok = set(allowed)
    INF = math.inf
    # f[(i, j, s)]: best (cost, blocks) with blocks < i decided, block i−1 kept (or i == 0), j removed in s runs
    f: dict[tuple[int, int, int], tuple[float, tuple[int, ...]]] = {(0, 0, 0): (0.0, ())}
    best: dict[int, tuple[float, tuple[int, ...]]] = {}

    def offer(table, key, cand):
        cur = table.get(key)
        if cur is None or cand < cur:
            table[key] = cand

    for i in range(num_layers + 1):
        for j in range(k + 1):
            for s in range(j + 1):
                cur = f.get((i, j, s))
                if cur is None:
                    continue
                if j == k:
                    offer(best, s, cur)
                    continue
                if i == num_layers:
                    continue
                offer(f, (i + 1, j, s), cur)  # keep block i
                for b in range(i + 1, min(i + k - j, num_layers) + 1):  # remove the run [i, b), keep block b
                    if b - 1 not in ok:
                        break
                    c = cost.get((i, b), INF)
                    if c == INF:
                        continue
                    cand = (cur[0] + c, cur[1] + tuple(range(i, b)))
                    jj = j + b - i
                    if b == num_layers:
                        if jj == k:
                            offer(best, s + 1, cand)
                    else:
                        offer(f, (b + 1, jj, s + 1), cand)
    if not best:
        raise CriterionError(f"linear_fit: no set of {k} blocks fits the guards (allowed blocks {allowed})")
    return dict(sorted(best.items()))


def select_spans(cost: dict[tuple[int, int], float], allowed: list[int], num_layers: int, k: int) -> list[int]:
    """The ``k`` blocks of ``allowed`` whose maximal runs ``[a, b)`` minimise ``Σ cost(a, b)``
    (ties: the lexicographically smallest block list). ``cost`` holds every allowed run of at most
    ``k`` blocks."""
    return sorted(min(_best_sets(cost, allowed, num_layers, k).values())[1])


def best_per_span_count(cost: dict[tuple[int, int], float], allowed: list[int], num_layers: int, k: int
                        ) -> dict[int, list[int]]:
    """For every number of spans ``s``, the ``k`` blocks of ``allowed`` made of exactly ``s`` maximal runs
    that minimise ``Σ cost(a, b)`` (ties: the lexicographically smallest block list); counts that no set
    fits are absent. The least of them is :func:`select_spans`'s choice."""
    return {s: sorted(v[1]) for s, v in _best_sets(cost, allowed, num_layers, k).items()}


class LinearFit:
    """The scorer (see the module doc): ``phase`` 0 fits (possibly several passes, one per group of
    blocks), phase 1 judges. :func:`~shift_lightning.selection.select_blocks` drives the phases."""

    name = "linear_fit"
    needs_grad = False

    def __init__(self, num_layers: int, k: int, allowed: list[int], damping: float = 1e-4, heldout_every: int = 4,
                 max_stats_gb: float = 16.0):
        self.L, self.k, self.allowed = num_layers, k, sorted(allowed)
        self.damping, self.heldout_every = damping, heldout_every
        self.max_stats_gb = max_stats_gb
        self.groups: list[list[int]] = []
        self.phase, self.group = 0, 0
        self.maps: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.fit_tokens = 0

    # ---------------------------------------------------------------- phases
    def plan(self, dim: int) -> None:
        per = RidgeStats.numel(dim) * 8
        n = max(1, int(self.max_stats_gb * 2 ** 30 // per))
        self.groups = [self.allowed[i:i + n] for i in range(0, len(self.allowed), n)]

    def split(self, n_windows: int) -> tuple[list[int], list[int]]:
        """Window indices ``(fitting, judging)``."""
        k = self.heldout_every
        return [i for i in range(n_windows) if i % k != k - 1], [i for i in range(n_windows) if i % k == k - 1]

    def passes(self) -> int:
        return len(self.groups) + 1

    @property
    def last_block(self) -> int:
        """The last block this phase's walk needs."""
        return max(self.stats) if self.phase == 0 else max(self.maps)

    def setup(self, model: nn.Module, device=None) -> None:
        d, dev = model.config.hidden_size, device or next(model.parameters()).device
        if not self.groups:
            self.plan(d)
        if self.phase == 0:
            blocks = self.groups[self.group]
            nr = RidgeStats.numel(d)
            self.flat = torch.zeros(len(blocks) * nr, dtype=torch.float64, device=dev)
            self.stats = {i: RidgeStats(d, f"block {i}", buffer=self.flat[n * nr:(n + 1) * nr])
                          for n, i in enumerate(blocks)}
        else:
            self.err = torch.zeros(self.L, self.k + 1, dtype=torch.float64, device=dev)
            self.den = torch.zeros(self.L, self.k + 1, dtype=torch.float64, device=dev)
            self._chains: dict[int, dict[int, torch.Tensor]] = {}  # per batch: the chains still open

    @torch.no_grad()
    def on_block(self, j: int, x_in: torch.Tensor, x_out: torch.Tensor, mask: torch.Tensor, entry: int = 0) -> None:
        """Block ``j`` ran on batch ``entry`` (the walk is block-major: every batch, then the next block). Fitting:
        block ``j``'s statistics. Judging: the open chains of that batch moved on by ``LRA_j`` and scored."""
        if self.phase == 0:
            if j in self.stats:
                self.stats[j].add_batch(x_in[mask], (x_out - x_in)[mask])
            return
        chains = self._chains.setdefault(entry, {})
        if j not in self.maps:
            chains.clear()  # no chain runs through a block that may not be removed
            return
        W, b = self.maps[j]
        chains[j] = x_in[mask].float()
        h = x_out[mask].float()
        energy = h.double().square().sum()
        for a in sorted(chains):
            if j - a >= self.k:
                del chains[a]
                continue
            y = chains[a] + chains[a] @ W.T + b
            chains[a] = y
            self.err[a, j + 1 - a] += (h - y).double().square().sum()
            self.den[a, j + 1 - a] += energy

    def state(self) -> list[torch.Tensor]:
        return [self.flat] if self.phase == 0 else [self.err, self.den]

    def next_phase(self) -> None:
        """After a fitting pass (sums reduced): solve its blocks' maps, free their statistics."""
        for i, st in self.stats.items():
            sol = ridge_solve(st, self.damping)
            self.maps[i] = (sol.W.float(), sol.b.float())
            self.fit_tokens = st.num_tokens
        self.stats, self.flat = {}, None
        self.group += 1
        if self.group == len(self.groups):
            self.phase = 1

    def judged(self) -> None:
        """After a judging pass (sums reduced)."""
        self.phase += 1

    @property
    def done(self) -> bool:
        """No judging pass left."""
        return self.phase >= 2

    def span_costs(self) -> dict[tuple[int, int], float]:
        """``cost(a, b)`` of every judged run ``[a, b)`` (after the judging pass)."""
        err, den = self.err.cpu(), self.den.cpu()
        return {(a, a + n): float(err[a, n] / den[a, n]) for a in range(self.L) for n in range(1, self.k + 1)
                if den[a, n] > 0}

    def finalize(self):
        cost = self.span_costs()
        selected = select_spans(cost, self.allowed, self.L, self.k)
        scores = {i: cost.get((i, i + 1), float("nan")) for i in range(self.L)}
        from ..maps.sites import contiguous_spans

        return scores, {
            "selected": selected, "fit_tokens": self.fit_tokens, "judge_windows_every": self.heldout_every,
            "damping": self.damping, "stat_passes": len(self.groups),
            "span_costs": {f"{a}-{b - 1}": c for (a, b), c in sorted(cost.items())},
            "selected_span_costs": {f"{a}-{b - 1}": cost[(a, b)] for a, b in contiguous_spans(selected)},
            "scores_are": "unexplained residual energy of the block's repaired map on held-out windows, relative to "
                          "the residual stream's energy (spans: span_costs)",
        }


class LinearFitKL(LinearFit):
    """``linear_fit_kl``: :class:`LinearFit`'s maps and span costs, then the repaired model judged whole.

    The span costs add up the error each span leaves where it ends, relative to the residual stream
    there; how much a span's error grows on its way to the LM head, and how the errors of several
    spans compound, they do not see (at 12 of SmolLM2's 30 blocks linear_fit's selection is further
    from the original than block influence's). So a third pass judges whole repaired models: the
    candidates are, for every number of spans ``s``, the set of ``k`` blocks made of ``s`` runs with the
    smallest total cost (:func:`best_per_span_count`: at most ``k`` sets), and on the held-out windows
    each candidate runs as the pruned model with every removed block replaced by its LRA (consecutive
    maps chained, the merged map calibration builds), scored by the mean next-token
    KL(original ‖ repaired) against the original's top-``topk`` distribution (:mod:`~shift_lightning.closeness`,
    the grid's closeness measure). The closest candidate is removed (ties: fewer spans).

    The third pass is block-major like the others: each block brought in once, run on the original's and every
    candidate's state of every batch (at most ``k`` candidates: ``(k + 1) × windows × T × d`` states held), then the
    final norm and the head once; memory beside the states: the original's top-k of one batch (12 bytes per entry).
    """

    name = "linear_fit_kl"

    def __init__(self, *args, topk: int = 256, **kwargs):
        super().__init__(*args, **kwargs)
        self.topk = topk
        self.cost: dict[tuple[int, int], float] = {}
        self.cands: dict[int, list[int]] = {}
        self.adapters: dict[int, LinearResidualAdapter] = {}

    @property
    def done(self) -> bool:
        return self.phase >= 3

    @property
    def last_block(self) -> int:
        return super().last_block if self.phase < 2 else self.L - 1

    @property
    def streams(self) -> bool:
        """Judging whole candidates: the walk hands :meth:`on_block` the block to run their states through, and
        :meth:`on_final` the final norm and the head."""
        return self.phase >= 2

    def setup(self, model: nn.Module, device=None) -> None:
        if self.phase < 2:
            return super().setup(model, device)
        dev = device or next(model.parameters()).device
        self.sums = torch.zeros(len(self.cands), 3, dtype=torch.float64, device=dev)  # Σ KL, Σ top-1, positions
        self.softcap = lm_softcap(model)
        self._states: dict[int, list[torch.Tensor]] = {}  # per batch: each candidate's hidden state

    @torch.no_grad()
    def on_block(self, j: int, x_in: torch.Tensor, x_out: torch.Tensor, mask: torch.Tensor, entry: int = 0,
                 run=None) -> None:
        """Judging: block ``j`` moves each candidate's state of batch ``entry`` on (``run``: the block on another
        state), or the candidate's LRA stands in for it where the candidate removes it (what
        :class:`~shift_lightning.arch.Bypass` does in the repaired model)."""
        if self.phase < 2:
            return super().on_block(j, x_in, x_out, mask, entry)
        states = self._states.setdefault(entry, [x_in] * len(self.cands))
        for n, blocks in enumerate(self.cands.values()):
            states[n] = self.adapters[j](states[n]) if j in blocks else run(states[n])

    @torch.no_grad()
    def on_final(self, h: torch.Tensor, norm: nn.Module, head: nn.Module, mask: torch.Tensor, entry: int) -> None:
        """After the last block: the original's state ``h`` of batch ``entry``; each candidate's next-token KL and
        top-1 against the original's top-k."""
        ref = topk_from_hidden(norm(h)[mask], head, self.topk, self.softcap)
        for n, state in enumerate(self._states.pop(entry)):
            kl, agree = kl_top1_from_hidden(norm(state)[mask], head, ref, self.softcap)
            self.sums[n, 0] += kl.sum().to(self.sums)
            self.sums[n, 1] += agree.sum().to(self.sums)
            self.sums[n, 2] += kl.numel()

    def state(self) -> list[torch.Tensor]:
        return [self.sums] if self.phase >= 2 else super().state()

    def judged(self) -> None:
        if self.phase == 1:  # the span costs are in: the candidates of the whole-model judge
            self.cost = self.span_costs()
            self.cands = best_per_span_count(self.cost, self.allowed, self.L, self.k)
            self.adapters = {j: self._adapter(*self.maps[j]) for j in sorted({j for c in self.cands.values() for j in c})}
        self.phase += 1

    @staticmethod
    def _adapter(W: torch.Tensor, b: torch.Tensor) -> LinearResidualAdapter:
        """Block ``j``'s LRA ``x ↦ x + x Wᵀ + b`` as the module calibration builds."""
        a = LinearResidualAdapter(AdapterSpec(W.shape[0]), dtype=W.dtype, device=W.device)
        a.set_full(W, b)
        return a

    def finalize(self):
        from ..maps.sites import contiguous_spans

        sums = self.sums.cpu()
        n = sums[:, 2].clamp_min(1)
        kl, top1 = (sums[:, 0] / n).tolist(), (sums[:, 1] / n).tolist()
        spans = list(self.cands)
        selected = self.cands[spans[min(range(len(spans)), key=lambda i: (kl[i], i))]]
        cost = self.cost
        scores = {i: cost.get((i, i + 1), float("nan")) for i in range(self.L)}
        return scores, {
            "selected": selected, "fit_tokens": self.fit_tokens, "judge_windows_every": self.heldout_every,
            "damping": self.damping, "stat_passes": len(self.groups), "topk": self.topk,
            "judge_positions": int(sums[0, 2].item()),
            "span_costs": {f"{a}-{b - 1}": c for (a, b), c in sorted(cost.items())},
            "selected_span_costs": {f"{a}-{b - 1}": cost[(a, b)] for a, b in contiguous_spans(selected)},
            "residual_choice": select_spans(cost, self.allowed, self.L, self.k),
            "candidates": [{"spans": s, "blocks": self.cands[s], "cost": sum(cost[r] for r in contiguous_spans(self.cands[s])),
                            "kl": kl[i], "top1": top1[i]} for i, s in enumerate(spans)],
            "scores_are": "unexplained residual energy of the block's repaired map on held-out windows (spans: "
                          "span_costs); the selection is the candidate (best set per number of spans) whose "
                          "repaired model has the lowest held-out KL to the original (candidates)",
        }
