"""Layer selection with a Lightning pass: :func:`select_blocks` and :class:`CriterionScorer`.

The scoring maths lives in :mod:`shift_lightning.criteria` (framework-free scorers fed by hooks).
:class:`CriterionScorer` runs one scorer over the calibration windows as a
:class:`~shift_lightning.passes.DataPass`: windows sharded over ranks (each seen once), each rank
adds its batches into the scorer's float64 sums (``scorer.step``), ONE packed all-reduce sums
``scorer.state()`` at the end, so every rank finalises the same scores for any number of
processes. The ``taylor`` scorer needs gradients: it calls ``torch.enable_grad()`` inside the step,
which works because the Trainer is built with ``inference_mode=False`` (a plain ``no_grad``
context); ``predict`` never wraps the model in ``DistributedDataParallel``, and the per-weight
``w·grad`` sums are reduced by the same single all-reduce.
"""

from __future__ import annotations

from typing import Callable

import lightning as L
import torch
from torch import nn

from . import criteria as C
from .arch import decoder_layers
from .criteria import CriterionError
from .data import TokenWindows
from .passes import BlockCache, DataPass, sum_across_ranks
from .placement import placement_of


class CriterionScorer(DataPass):
    """Run ``scorer`` (a :mod:`~shift_lightning.criteria` scorer) over windows.

    ``model``: the causal LM (a submodule, so Lightning places it on the device; an onloaded skeleton is not: its
    placement brings each block in). A scorer of hidden states only (``on_block``: block influence, angular) runs
    block-major, as calibration does (:class:`~shift_lightning.passes.BlockCache`): the windows cached
    once, then each block on every batch, its sums all-reduced once after the walk; the others run a forward per
    batch and need the whole model.
    """

    stage = "criterion scores"

    def __init__(self, model: nn.Module, scorer):
        super().__init__()
        if placement_of(model).onloaded:
            if not hasattr(scorer, "on_block"):
                raise CriterionError(f"the {scorer.name} criterion runs the whole model per batch; onloaded "
                                     "(--model.placement onload) the criteria are " + ", ".join(ONLOAD_CRITERIA))
            self.__dict__["model"] = model
        else:
            self.model = model
        self.scorer = scorer  # plain object: its float64 sums stay out of the module's state
        self.needs_grad_mode = bool(scorer.needs_grad)
        self._cache: BlockCache | None = None

    def begin(self) -> None:
        self.scorer.setup(self.model, self.device) if hasattr(self.scorer, "on_block") else self.scorer.setup(self.model)
        if hasattr(self.scorer, "on_block"):
            last = getattr(self.scorer, "last_block", len(decoder_layers(self.model)) - 1)
            self._cache = BlockCache(self.model, last)

    def step(self, batch, batch_idx):
        if self._cache is not None:
            self._cache.cache_batch(batch, batch["attention_mask"].bool(), self.device)
        else:
            self.scorer.step(self.model, batch)

    def state(self) -> list[torch.Tensor]:
        return [] if self._cache is not None else self.scorer.state()

    @torch.no_grad()
    def finish(self) -> None:
        if self._cache is None:
            return
        cache, self._cache = self._cache, None
        streams = getattr(self.scorer, "streams", False)  # the scorer runs states of its own through each block
        bar = self.progress(f"{self.stage}, block by block", cache.last + 1 + streams)
        for j in range(cache.last + 1):
            with cache.placement.block(self.model, j, self.device) as block:
                for k, e in enumerate(cache.entries):
                    x_out = cache.run(block, j, e, e["h"])
                    if streams:
                        self.scorer.on_block(j, e["h"], x_out, e["mask"], k,
                                             run=lambda h, e=e: cache.run(block, j, e, h))
                    else:
                        self.scorer.on_block(j, e["h"], x_out, e["mask"], k)
                    e["h"] = x_out
            bar.step(extra=f"block {j}")
        if streams:  # then the final norm and the head, brought in once
            inner, head = self.model.model, self.model.get_output_embeddings()
            with cache.placement.piece(inner.norm, "model.norm.", self.device) as norm, \
                    cache.placement.piece(head, "lm_head.", self.device) as head:
                for k, e in enumerate(cache.entries):
                    self.scorer.on_final(e["h"], norm, head, e["mask"], k)
            bar.step(extra="final norm and head")
        bar.close()
        sum_across_ranks(self.scorer.state(), self.trainer)


#: Criteria an onloaded run (``--model.placement onload``) can select with: no pass, the weights block by block,
#: or hidden states block by block.
ONLOAD_CRITERIA = ("reverse_star", "reverse", "random", "magnitude_l1", "magnitude_l2", "angular", "block_influence",
                   "linear_fit", "linear_fit_kl")


def default_trainer(model: nn.Module) -> L.Trainer:
    """One process on the model's device, quiet, ``inference_mode=False`` (Taylor needs grads)."""
    dev = next(model.parameters()).device
    acc, devices = ("gpu", [dev.index or 0]) if dev.type == "cuda" else ("cpu", 1)
    return L.Trainer(accelerator=acc, devices=devices, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, inference_mode=False,
                     use_distributed_sampler=False)


def run_scorer(scorer, model: nn.Module, windows: TokenWindows, batch_size: int,
               make_trainer: Callable[[], L.Trainer] | None = None):
    """Fill ``scorer``'s sums over ``windows`` (all ranks) with one ``trainer.predict`` pass."""
    trainer = make_trainer() if make_trainer is not None else default_trainer(model)
    CriterionScorer(model, scorer).run(trainer, windows, batch_size)
    return scorer


def select_blocks(cfg: C.PruneConfig, model: nn.Module, windows: TokenWindows | None = None,
                  make_trainer: Callable[[], L.Trainer] | None = None) -> C.Selection:
    """Decide which original blocks of ``model`` to remove.

    ``windows`` (may be padded) and ``make_trainer`` (a callable returning a Lightning ``Trainer``
    with ``inference_mode=False`` and ``use_distributed_sampler=False``; default: one process on the
    model's device) are needed only by the data-driven criteria (``criteria.DATA_DRIVEN``). Every
    rank returns the same selection.
    """
    static = C.select_static(cfg, model)
    if static is not None:
        return static
    num_layers = len(decoder_layers(model))
    plan = C.plan_removal(cfg, num_layers)
    C.check_data_request(cfg, 0 if windows is None else len(windows))
    if plan.k == 0:
        return C.Selection([], cfg.criterion, None, {**plan.guards, "note": "ratio removes no block; nothing scored"})
    scorer = C.make_scorer(cfg.criterion, num_layers, plan.k, cfg, plan.allowed)
    if isinstance(scorer, C.LinearFit):  # fit on some windows (one pass per group of blocks), judge on the rest
        fit, judge = scorer.split(len(windows))
        scorer.plan(model.config.hidden_size)
        while scorer.phase == 0:
            run_scorer(scorer, model, windows.subset(fit), cfg.batch_size, make_trainer)
            scorer.next_phase()
        while not scorer.done:  # linear_fit: the spans' costs; linear_fit_kl: then the whole candidates
            run_scorer(scorer, model, windows.subset(judge), cfg.batch_size, make_trainer)
            scorer.judged()
    else:
        run_scorer(scorer, model, windows, cfg.batch_size, make_trainer)
    scores, details = scorer.finalize()
    return C.choose(cfg, plan, scores, {"windows": len(windows), **details})
