"""One way to run a gradient-free pass over data with Lightning: :class:`DataPass`.

``CalibrationModule`` (statistics for the closed-form solve), ``CriterionScorer`` (block scores for
selection) and ``EvalModule`` (zero-shot accuracy, perplexity) are all the same thing: visit every
item of a dataset exactly once, spread over the ranks, add into float64 sums, and sum those sums
across ranks once at the end. This base owns that:

* the loader: items ``rank, rank + world, …`` (:class:`~shift_lightning.data.RankShard`); Lightning's
  ``validate``/``test`` samplers pad by repeating items, which would count them twice;
* the sum-reduce: subclasses return their float64 sums from :meth:`DataPass.state`; they are packed
  with an item counter into ONE flat buffer and summed with ONE all-reduce through the Lightning
  strategy (``trainer.strategy.reduce``; a no-op on one process);
* the check that every item was seen exactly once (a Trainer built with
  ``use_distributed_sampler=True`` would break it);
* the inference-mode guard: a pass that makes tensors which must stay trainable (solved adapters)
  or that needs gradients (Taylor scores) sets ``needs_grad_mode = True`` and refuses a Trainer with
  ``inference_mode=True``;
* no autocast: a pass runs in the model's own dtype even on a Trainer built for mixed-precision
  training (``train.py`` calibrates and trains on one Trainer).

Drive it with :meth:`DataPass.run` (``trainer.predict`` under the hood).

:class:`BlockCache` is the block-major order such a pass may take instead of a forward per batch (calibration's
walks, the hidden-state criteria): the embedding runs once per window (blocks recorded, not run), then each block
is brought in once by the model's placement (:mod:`~shift_lightning.placement`) and run on every cached batch.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Dataset

from torch import nn

from .arch import StopForward, block_output, swapped_blocks
from .data import RankShard
from .errors import ShiftError
from .placement import placement_of


class PassError(ShiftError, RuntimeError):
    """A pass was run with a Trainer it cannot work with, or did not see its data exactly once."""


#: The largest packed buffer one all-reduce sends (the pack is a copy: bounded, so d² sums of many sites of a large
#: model are reduced in a few packs instead of doubling the memory they take).
MAX_PACK_BYTES = 1 << 30


def sum_across_ranks(tensors: list[torch.Tensor], trainer: L.Trainer | None = None) -> None:
    """Sum float64 ``tensors`` across ranks in place with ONE all-reduce of a packed flat buffer (a few, of at
    most :data:`MAX_PACK_BYTES` each, when they are larger).

    Through ``trainer.strategy.reduce`` when a Trainer is given, else through ``torch.distributed``
    (both no-ops on a single process).
    """
    if not tensors:
        return
    packs, size = [[]], 0
    for t in tensors:
        if packs[-1] and size + t.numel() * 8 > MAX_PACK_BYTES:
            packs.append([])
            size = 0
        packs[-1].append(t)
        size += t.numel() * 8
    if trainer is not None and trainer.world_size > 1:
        for pack in packs:
            flat = torch.cat([t.reshape(-1).to(torch.float64) for t in pack])
            flat = trainer.strategy.reduce(flat, reduce_op="sum")
            off = 0
            for t in pack:
                n = t.numel()
                t.copy_(flat[off: off + n].view_as(t))
                off += n
        return
    from . import dist

    for pack in packs:
        dist.all_reduce_flat(pack)


class DataPass(L.LightningModule):
    """Base of every gradient-free pass (see the module docstring).

    Subclasses implement :meth:`begin` (allocate float64 sums on ``self.device``), :meth:`step`
    (consume one batch) and :meth:`state` (the sums); :meth:`finish` runs after the reduce on
    every rank. ``self.data`` is the dataset of the current pass, ``self.batch_size`` its batch
    size (``None``: items are already batches, e.g. evaluation work units).
    """

    needs_grad_mode: bool = False
    """True: refuse ``Trainer(inference_mode=True)`` (results must stay trainable / need autograd)."""
    stage: str = "pass"
    """What the progress bar calls this pass."""

    def __init__(self):
        super().__init__()
        self.data: Dataset | None = None
        self.batch_size: int | None = 1

    # ---------------------------------------------------------------- to implement
    def begin(self) -> None:
        """Allocate this pass's sums (called on the module's device, every rank)."""

    def step(self, batch, batch_idx: int) -> None:
        raise NotImplementedError

    def state(self) -> list[torch.Tensor]:
        """float64 tensors to sum across ranks."""
        return []

    def finish(self) -> None:
        """Called after the reduce (every rank sees the global sums)."""

    def progress(self, name: str, total: int):
        """A progress for long work in :meth:`finish` (``step()`` per item, ``close()``): rank 0's stage
        progress when the trainer shows one, else nothing."""
        from .progress import NullBar, StageProgress

        pb = getattr(self.trainer, "progress_bar_callback", None)
        return pb.bar(name, total) if isinstance(pb, StageProgress) else NullBar()

    # ---------------------------------------------------------------- driver
    def run(self, trainer: L.Trainer, data: Dataset, batch_size: int | None = 1) -> "DataPass":
        """Visit every item of ``data`` once over all ranks, then reduce and :meth:`finish`."""
        if self.needs_grad_mode and getattr(trainer.predict_loop, "inference_mode", False):
            raise PassError(f"The {self.stage} pass needs Trainer(inference_mode=False) "
                            "(--trainer.inference_mode false): its results must stay trainable or need gradients.")
        self.data, self.batch_size = data, batch_size
        try:
            device = next(self.parameters()).device
        except StopIteration:
            device = None
        trainer.predict(self, return_predictions=False)
        if device is not None and next(self.parameters()).device != device:
            self.to(device)  # Lightning's teardown moves the module to the CPU: give it back where it was
        return self

    def predict_dataloader(self) -> DataLoader:
        sampler = RankShard(len(self.data), self.trainer.global_rank, self.trainer.world_size)
        if self.batch_size is None:  # items are batches already
            return DataLoader(self.data, sampler=sampler, batch_size=None, collate_fn=lambda x: x)
        return DataLoader(self.data, sampler=sampler, batch_size=self.batch_size, num_workers=0)

    def transfer_batch_to_device(self, batch, device, dataloader_idx):
        if self.batch_size is None:
            return batch  # work units build their tensors on the model's device
        return super().transfer_batch_to_device(batch, device, dataloader_idx)

    def on_predict_start(self) -> None:
        self._items_seen = torch.zeros(1, dtype=torch.float64, device=self.device)
        self.begin()

    def predict_step(self, batch, batch_idx):
        # Statistics and scores are computed in the model's own dtype: a Trainer with
        # precision="bf16-mixed" (set for training) must not autocast the calibration pass.
        with torch.autocast(self.device.type, enabled=False):
            self.step(batch, batch_idx)
        self._items_seen += _count(batch)
        return self._items_seen.new_zeros(0)  # nothing to return (None would make Lightning warn)

    def on_predict_end(self) -> None:
        sum_across_ranks(self.state() + [self._items_seen], self.trainer)
        seen = int(round(self._items_seen.item()))
        if seen != len(self.data):
            raise PassError(
                f"The {self.stage} pass saw {seen} items instead of {len(self.data)}: build the Trainer with "
                "use_distributed_sampler=False so each item is visited on exactly one rank.")
        self.finish()


def _count(batch) -> int:
    if isinstance(batch, dict) and "input_ids" in batch:
        return int(batch["input_ids"].shape[0])
    return 1


# --------------------------------------------------------------------------------------------
# The block-major order (calibration's walks, the hidden-state criteria)
# --------------------------------------------------------------------------------------------
class _Recorder(nn.Module):
    """Stands in for block ``j`` during the caching pass: records the call (the first one also the state)."""

    def __init__(self, j: int, sink: dict, last: int):
        super().__init__()
        self.j, self.sink, self.last = j, sink, last

    def forward(self, hidden_states, *args, **kwargs):
        if "h" not in self.sink:
            self.sink["h"] = hidden_states
        self.sink[self.j] = (args, kwargs)
        if self.j == self.last:
            raise StopForward
        return hidden_states


class BlockCache:
    """One rank's cached windows: ``entries[k] = {"h": (B, T, d), "calls": {j: (args, kwargs)}, "mask": (B, T),
    "index": (B,) window indices}``, and block ``j`` run on one of them (:meth:`run`)."""

    def __init__(self, model: nn.Module, last: int):
        self.model, self.last = model, last
        self.placement = placement_of(model)
        self.entries: list[dict] = []

    @torch.no_grad()
    def cache_batch(self, batch: dict, mask: torch.Tensor, device=None, taps: dict | None = None) -> dict:
        """Run the embedding on ``batch`` with blocks ``0..last`` recorded, not run; returns the entry.
        ``taps``: extra values to keep in the entry."""
        sink: dict = {}
        stubs = {j: _Recorder(j, sink, self.last) for j in range(self.last + 1)}
        inner = self.model.model
        with self.placement.lookup(inner.embed_tokens, "model.embed_tokens.", device), \
                swapped_blocks(self.model, stubs):
            if self.placement.onloaded:
                self._buffers_to(device)
            try:
                self.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)
            except StopForward:
                pass
        h = sink.pop("h")
        entry = {"h": h, "calls": sink, "mask": mask, "index": batch.get("index"), **(taps or {})}
        self.entries.append(entry)
        return entry

    def _buffers_to(self, device) -> None:
        """The skeleton's real buffers (rotary frequencies) on the walk's device."""
        if device is None:
            return
        for mod in self.model.modules():
            for name, b in list(mod.named_buffers(recurse=False)):
                if not b.is_meta and b.device != torch.device(device):
                    mod._buffers[name] = b.to(device)

    def run(self, block: nn.Module, j: int, entry: dict, h: torch.Tensor) -> torch.Tensor:
        """Block ``j`` (``block``: the module, brought in) on one entry's state ``h``."""
        args, kwargs = entry["calls"][j]
        return block_output(block(h, *args, **kwargs))
