"""The held-out closeness report, block-major: :class:`HeldoutCloseness`.

On the held-out windows: the perplexity of the original, the pruned (no maps) and the repaired model, and the
latter two's next-token KL to the original and top-1 agreement (:mod:`shift_lightning.closeness`), with every block
brought in once by the model's placement. It is what an onloaded run (``--model.placement onload``) reports in place
of ``--evaluate.*``, which runs the whole model.

Three streams of hidden states walk the original blocks together (:class:`~shift_lightning.passes.BlockCache`):

* ``o``: the original, every block;
* ``p``: the pruned model, the kept blocks only;
* ``r``: the repaired model, the kept blocks with what surgery folds into them (ReplaceMe's map, the stock repair)
  applied to a copy of the block, and the adapters in front of the kept blocks they belong to (and of the final
  norm). The calls' masks and position embeddings depend on positions only, so every stream reuses block ``j``'s.

After the last block the final norm and the LM head are brought in once; per window, the original's next-token NLL
and top-k reference (:class:`~shift_lightning.closeness.TopK`) are computed and the other streams compared with it at
once (KL over every real position, NLL over every predicted one). Sums in float64, all-reduced once.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from ..arch import decoder_layers
from ..closeness import DEFAULT_TOPK, kl_top1_from_hidden, lm_softcap, topk_from_hidden
from ..nll import lm_nll_sum
from ..passes import BlockCache, DataPass, sum_across_ranks
from ..placement import placement_of
from ..maps.surgery import fold_down, fold_replaceme

#: The streams and what the report calls them.
STREAMS = {"o": "original", "p": "pruned", "r": "repaired"}
#: Positions of logits at a time (``CHUNK × V`` floats: 64 MB at Llama-3's vocabulary).
CHUNK = 128


class HeldoutCloseness(DataPass):
    """The report of the module doc for ``model`` (the original, before surgery), the original indices of the
    ``removed`` blocks and the calibration's ``correction`` (:class:`~shift_lightning.maps.fitted.FittedMaps`).
    After :meth:`run`, :attr:`results` ``{"original": {"ppl"}, "pruned": {"ppl", "kl", "top1"}, "repaired": …}``."""

    stage = "held-out closeness (original, pruned, repaired)"

    def __init__(self, model: nn.Module, removed: list[int], correction, topk: int = DEFAULT_TOPK):
        super().__init__()
        if placement_of(model).onloaded:  # a skeleton: its placement brings each block to the device
            self.__dict__["model"] = model
        else:
            self.model = model
        self.removed, self.correction, self.topk = set(removed), correction, topk
        self.results: dict | None = None
        self._cache: BlockCache | None = None

    def begin(self) -> None:
        self._cache = BlockCache(self.model, len(decoder_layers(self.model)) - 1)

    def step(self, batch, batch_idx):
        e = self._cache.cache_batch(batch, batch["attention_mask"].bool(), self.device,
                                    taps={"ids": batch["input_ids"], "am": batch["attention_mask"]})
        e["o"] = e["p"] = e.pop("h")
        e["r"] = self._embedding_fold(e["o"])

    def _embedding_fold(self, h: torch.Tensor) -> torch.Tensor:
        """The stock repair of a span at block 0 changes the embedding table: ``h + h Wᵀ + b`` of its output."""
        if self.correction.embedding is None:
            return h
        W, b = (t.to(h.device, torch.float64) for t in self.correction.embedding)
        return (h.double() + h.double() @ W.T + b).to(h.dtype)

    def _repaired_block(self, block: nn.Module, j: int, in_place: bool = False) -> nn.Module:
        """Block ``j`` as the repaired model has it: a copy with its folds, or the block itself (``in_place``: the block
        itself, folded: an onloaded block's weights are read again from the files the next time, so that the fold
        changes nothing beyond this pass and no second copy of the block is held beside it)."""
        T, down = self.correction.branch_maps.get(j), self.correction.down_maps.get(j)
        if T is None and down is None:
            return block
        out = block if in_place else copy.deepcopy(block)
        if T is not None:
            fold_replaceme(out, T)
        if down is not None:
            fold_down(self.model, out, *down)
        return out

    def _adapter(self, position: int):
        a = self.correction.adapters.get(position)
        return None if a is None else a.to(self.device)

    @torch.no_grad()
    def finish(self) -> None:
        cache, self._cache = self._cache, None
        placement, run, entries = cache.placement, cache.run, cache.entries
        bar = self.progress(f"{self.stage}, block by block", cache.last + 2)
        position = 0  # the pruned position of the next kept block
        for j in range(cache.last + 1):
            with placement.block(self.model, j, self.device) as block:
                for e in entries:
                    e["o"] = run(block, j, e, e["o"])
                if j not in self.removed:
                    for e in entries:
                        e["p"] = run(block, j, e, e["p"])
                    # onloaded, a fold into down_proj changes the block's weights in place (read again next time); a
                    # map around Gemma3's post-MLP norm changes the module (the skeleton's): on a copy
                    in_place = placement.onloaded and not hasattr(block, "post_feedforward_layernorm")
                    repaired, adapter = self._repaired_block(block, j, in_place), self._adapter(position)
                    for e in entries:
                        r = e["r"] if adapter is None else adapter(e["r"])
                        e["r"] = run(repaired, j, e, r)
                    del repaired
                    position += 1
            bar.step(extra=f"block {j}")
        adapter = self._adapter(position)  # in front of the final norm
        if adapter is not None:
            for e in entries:
                e["r"] = adapter(e["r"])
        sums = torch.zeros(9, dtype=torch.float64, device=self.device)  # NLL o/p/r, tokens, KL p/r, top-1 p/r, pos.
        inner = self.model.model
        head_module = self.model.get_output_embeddings()
        with placement.piece(inner.norm, "model.norm.", self.device) as norm, \
                placement.piece(head_module, "lm_head.", self.device) as head:
            cap = lm_softcap(self.model)
            for e in entries:
                hid = {s: norm(e[s]) for s in STREAMS}
                for b in range(e["mask"].shape[0]):
                    real = e["mask"][b]
                    rows = (e["ids"][b:b + 1], e["am"][b:b + 1])
                    for i, s in enumerate(STREAMS):
                        nll, n = lm_nll_sum(hid[s][b:b + 1], head, *rows, chunk_tokens=CHUNK, softcap=cap)
                        sums[i] += nll.double()
                    sums[3] += n
                    ref = topk_from_hidden(hid["o"][b][real], head, self.topk, cap, chunk=CHUNK)
                    for i, s in enumerate(("p", "r")):
                        kl, top1 = kl_top1_from_hidden(hid[s][b][real], head, ref, cap, chunk=CHUNK)
                        sums[4 + i] += kl.double().sum().to(sums.device)
                        sums[6 + i] += top1.double().sum().to(sums.device)
                    sums[8] += float(real.sum())
        bar.step(extra="final norm and head")
        bar.close()
        sum_across_ranks([sums], self.trainer)
        tokens, positions = sums[3].item(), sums[8].item()
        self.results = {"windows": len(self.data), "tokens": int(tokens), "positions": int(positions), "topk": self.topk}
        for i, (s, name) in enumerate(STREAMS.items()):
            self.results[name] = {"ppl": math.exp(min(sums[i].item() / max(tokens, 1), 700.0))}
            if s != "o":
                self.results[name].update(kl=sums[3 + i].item() / max(positions, 1),
                                          top1=sums[5 + i].item() / max(positions, 1))
