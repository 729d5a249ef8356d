"""Lightning orchestration of the data-driven layer-selection criteria.

The scoring maths lives in :mod:`shift_lightning.criteria` (framework-free scorers fed by hooks).
:class:`CriterionScorer` only runs one scorer over the calibration windows with
``trainer.predict``:

* windows are sharded with :class:`~shift_lightning.data.RankShard` (every window on exactly one
  rank; Lightning's validate/test samplers would repeat windows under DDP),
* each rank adds its batches into the scorer's float64 sums (``scorer.step``),
* ``on_predict_end`` sums ``scorer.state()`` across ranks with ONE packed all-reduce, and checks
  that every window was seen exactly once,

so every rank finalises the same scores, for any number of processes. The ``taylor`` scorer
needs gradients: it calls ``torch.enable_grad()`` inside ``predict_step``, which works because the
trainer is built with ``inference_mode=False`` (a plain ``no_grad`` context). ``predict`` never
wraps the model in ``DistributedDataParallel``; the per-weight ``w·grad`` sums are reduced by the
same single all-reduce.
"""

from __future__ import annotations

from typing import Callable

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader

from . import dist
from .criteria import CriterionError
from .data import RankShard, TokenWindows


class CriterionScorer(L.LightningModule):
    """Run ``scorer`` (a :mod:`~shift_lightning.criteria` scorer) over ``windows``.

    ``model``: the causal LM (a submodule, so Lightning places it on the device).
    ``windows``: ``{"input_ids": (T,), "attention_mask": (T,)}`` items; ``batch_size`` per step.
    """

    def __init__(self, model: nn.Module, scorer, windows: TokenWindows, batch_size: int = 4):
        super().__init__()
        self.model = model
        self.scorer = scorer  # plain object: its float64 sums stay out of the module's state
        self.windows = windows
        self.batch_size = batch_size

    def predict_dataloader(self) -> DataLoader:
        sampler = RankShard(len(self.windows), self.global_rank, self.trainer.world_size)
        return DataLoader(self.windows, batch_size=self.batch_size, sampler=sampler, num_workers=0)

    def on_predict_start(self) -> None:
        self.scorer.setup(self.model)
        self._windows_seen = torch.zeros(1, dtype=torch.float64, device=self.device)

    def predict_step(self, batch, batch_idx):
        self.scorer.step(self.model, batch)
        self._windows_seen += batch["input_ids"].shape[0]
        return batch["input_ids"].new_zeros(0)  # nothing to predict (None would make Lightning warn)

    def on_predict_end(self) -> None:
        dist.all_reduce_flat(self.scorer.state() + [self._windows_seen])
        seen = int(self._windows_seen.item())
        if seen != len(self.windows):
            raise CriterionError(
                f"The criterion pass saw {seen} windows instead of {len(self.windows)}: build the Trainer "
                "with use_distributed_sampler=False so each window is scored on exactly one rank.")


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
    if scorer.needs_grad and getattr(trainer.predict_loop, "inference_mode", False):
        raise CriterionError(f"Criterion {scorer.name!r} needs gradients: build the Trainer with inference_mode=False")
    module = CriterionScorer(model, scorer, windows, batch_size)
    trainer.predict(module, return_predictions=False)
    return scorer
