"""The guard's judge: which candidate map per span keeps the pruned model closest to the original.

One :class:`~shift_lightning.passes.DataPass` over the held-out calibration windows (sharded over
ranks). Per batch it runs the *original* model once and keeps (on its rank)

* the original's top-k next-token distributions at every real position (:class:`~shift_lightning.closeness.TopK`),
* the hidden state entering block ``b₀ = first span start − 1`` and every later block's call
  arguments (as GPTQ's sequential driver does), so candidates are run from there, not from the
  embeddings.

Then (:meth:`GuardJudge.finish`, every rank) span after span: the cached states are advanced to
the block before the span with the earlier spans' chosen maps, each candidate is put in place
(later spans at their default map) and the blocks from there to the LM head are run on the cached
batches; the per-candidate sums ``Σ KL, Σ top-1, #positions`` are all-reduced once per span and the
candidate with the lowest mean KL wins (the first one on a tie). Removed blocks are skipped, an
adapter transforms the state entering the first kept block after its span, a ReplaceMe map is a
forward hook ``m ↦ m T`` on block ``start − 1``'s MLP branch (the same function as folding it).

Cost: one original forward over the held-out windows plus, per span, one run per candidate from
the block before the span to the LM head.
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

from ..arch import block_input, block_output, decoder_layers, final_norm, mlp_branch
from ..closeness import kl_top1_from_hidden, lm_softcap, topk_from_hidden
from ..passes import DataPass, sum_across_ranks
from ..maps.fitted import SpanMap
from ..maps.sites import Site


@contextlib.contextmanager
def _branch_map(block: nn.Module, T: torch.Tensor | None):
    if T is None:
        yield
        return

    def hook(mod, args, out):
        return out @ T.to(device=out.device, dtype=out.dtype)

    h = mlp_branch(block).register_forward_hook(hook)
    try:
        yield
    finally:
        h.remove()


class GuardJudge(DataPass):
    """See the module doc. ``candidates[span.key]``: the span's candidate maps in tie-breaking order;
    ``default[span.key]``: the map a span has while an earlier span is judged."""

    stage = "guard: closeness to the original on held-out windows"

    def __init__(self, model: nn.Module, removed: list[int], spans: list[Site], candidates: dict, default: dict,
                 topk: int = 64):
        super().__init__()
        self.model = model
        self.removed, self.spans = set(removed), sorted(spans, key=lambda s: s.start)
        self.candidates, self.default, self.topk = candidates, default, topk
        self.b0 = max(self.spans[0].start - 1, 0)
        self.results: dict[tuple[int, int], dict] = {}
        self.choices: dict[tuple[int, int], SpanMap] = {}

    def _head(self):
        return self.model.get_output_embeddings()

    def begin(self) -> None:
        self._batches: list[dict] = []

    @torch.no_grad()
    def step(self, batch, batch_idx):
        blocks = decoder_layers(self.model)
        calls: dict[int, tuple] = {}
        state: dict[str, torch.Tensor] = {}

        def record(j):
            def pre(mod, args, kwargs):
                if j == self.b0:
                    state["h"] = block_input(args, kwargs).detach().clone()
                if j not in self.removed:
                    calls[j] = (tuple(args[1:]), {k: v for k, v in kwargs.items() if k != "hidden_states"})
            return pre

        handles = [blocks[j].register_forward_pre_hook(record(j), with_kwargs=True)
                   for j in range(self.b0, len(blocks)) if j not in self.removed or j == self.b0]
        try:
            out = self.model.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                                   use_cache=False)
        finally:
            for h in handles:
                h.remove()
        mask = batch["attention_mask"].bool()
        ref = topk_from_hidden(out.last_hidden_state[mask], self._head(), self.topk, lm_softcap(self.model))
        self._batches.append({"h": state["h"], "calls": calls, "mask": mask, "ref": ref})

    def _run(self, entry: dict, h: torch.Tensor, a: int, b: int, maps: dict) -> torch.Tensor:
        """Blocks ``[a, b)`` of the pruned, corrected model from the state ``h`` entering block ``a``
        (before the adapter of a span ending at ``a``)."""
        blocks = decoder_layers(self.model)
        ends = {sp.end: maps[sp.key] for sp in self.spans}
        branch = {sp.start - 1: maps[sp.key].branch for sp in self.spans if maps[sp.key].branch is not None}
        for j in range(a, b):
            m = ends.get(j)
            if m is not None and m.adapter is not None:
                h = m.adapter(h)
            if j in self.removed:
                continue
            args, kwargs = entry["calls"][j]
            with _branch_map(blocks[j], branch.get(j)):
                h = block_output(blocks[j](h, *args, **kwargs))
        if b == len(blocks) and b in ends and ends[b].adapter is not None:
            h = ends[b].adapter(h)
        return h

    def _score(self, states: list, a: int, maps: dict, row: torch.Tensor) -> None:
        """Add ``Σ KL, Σ top-1, #positions`` of the pruned model with ``maps``, run from block ``a`` on
        the cached batches' ``states`` to the LM head, into ``row``."""
        L = len(decoder_layers(self.model))
        norm, head, softcap = final_norm(self.model), self._head(), lm_softcap(self.model)
        for e, h in zip(self._batches, states):
            kl, agree = kl_top1_from_hidden(norm(self._run(e, h, a, L, maps))[e["mask"]], head, e["ref"], softcap)
            row[0] += kl.sum().to(row)
            row[1] += agree.sum().to(row)
            row[2] += kl.numel()

    @torch.no_grad()
    def finish(self) -> None:
        dev = self.device
        for cands in list(self.candidates.values()) + [list(self.default.values())]:
            for m in cands:
                if m.adapter is not None:
                    m.adapter.to(dev)
        maps = dict(self.default)
        states = [e["h"] for e in self._batches]
        at = self.b0
        bar = self.progress(f"{self.stage}, each candidate", sum(len(self.candidates[sp.key]) for sp in self.spans))
        for sp in self.spans:
            entry = max(sp.start - 1, 0)
            states = [self._run(e, h, at, entry, maps) for e, h in zip(self._batches, states)]
            at = entry
            cands = self.candidates[sp.key]
            sums = torch.zeros(len(cands), 3, dtype=torch.float64, device=dev)
            for ci, cand in enumerate(cands):
                maps[sp.key] = cand
                self._score(states, entry, maps, sums[ci])
                bar.step(extra=f"blocks {sp.start}..{sp.end - 1}: {cand.source}")
            sum_across_ranks([sums], self.trainer)
            n = sums[:, 2].clamp_min(1)
            kl_mean, top1 = (sums[:, 0] / n).tolist(), (sums[:, 1] / n).tolist()
            best = min(range(len(cands)), key=lambda i: (kl_mean[i], i))
            maps[sp.key] = cands[best]
            self.choices[sp.key] = cands[best]
            self.results[sp.key] = {"chosen": cands[best].source, "positions": int(sums[0, 2].item()),
                                    "kl": {c.source: v for c, v in zip(cands, kl_mean)},
                                    "top1": {c.source: v for c, v in zip(cands, top1)}}
        bar.close()
        self._batches = []
