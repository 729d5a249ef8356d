"""Training data in a step-indexed order: a resumed run continues exactly where it stopped.

:class:`RecoveryData` serves the training windows through :class:`StepBatchSampler` (the position
follows from the trainer's step) and the validation windows sharded without repetition.
"""

from __future__ import annotations

import lightning as L
import torch
from torch.utils.data import DataLoader, Sampler

from .data import RankShard, TokenWindows


class StepBatchSampler(Sampler[list[int]]):
    """Micro-batches ``position() … total−1`` of one deterministic stream of sample indices.

    The stream concatenates seeded permutations of the ``n`` samples (epoch ``e``: seed + e). The
    global micro-batch ``m`` is ``stream[m·B·W : (m+1)·B·W]``; rank ``r`` takes its ``r``-th slice of
    ``B``. So ``W`` processes of batch ``B`` see exactly the global batches of 1 process of batch
    ``B·W``. Iteration starts at the micro-step ``position()`` (the trainer's ``global_step ×
    accumulate_grad_batches``, read when iteration begins), so a resumed run continues the same
    stream; the length is always ``total`` (Lightning counts the batches already done itself).
    """

    def __init__(self, n: int, batch_size: int, rank: int, world: int, seed: int, total: int,
                 position=lambda: 0):
        self.n, self.b, self.rank, self.world, self.seed = n, batch_size, rank, world, seed
        self.total, self.position = total, position
        self.start = 0
        self._perm_epoch, self._perm = -1, None

    def _index(self, p: int) -> int:
        e, i = divmod(p, self.n)
        if e != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + e)
            self._perm, self._perm_epoch = torch.randperm(self.n, generator=g).tolist(), e
        return self._perm[i]

    def __iter__(self):
        gb = self.b * self.world
        self.start = self.position()
        for m in range(self.start, self.total):
            pos = m * gb + self.rank * self.b
            yield [self._index(p) for p in range(pos, pos + self.b)]

    def __len__(self) -> int:
        return self.total


def visited(n: int, batch_size: int, rank: int, world: int, seed: int, total: int) -> list[int]:
    """The sample indices rank ``rank`` reads in micro-batches ``0 … total−1`` (:class:`StepBatchSampler`)."""
    return sorted({i for batch in StepBatchSampler(n, batch_size, rank, world, seed, total) for i in batch})


class _StepLoader(DataLoader):
    """A DataLoader Lightning treats as resumable: its position is the trainer's step (see
    :class:`StepBatchSampler`), so the saved state only records it."""

    def state_dict(self) -> dict:
        s = self.batch_sampler
        return {"start": s.start, "total": s.total, "seed": s.seed}

    def load_state_dict(self, state: dict) -> None:  # the position is re-derived from global_step
        pass


class RecoveryData(L.LightningDataModule):
    """Training windows in a step-indexed order (:class:`StepBatchSampler`) and validation windows
    (sharded without repetition). Use with ``Trainer(use_distributed_sampler=False)``."""

    def __init__(self, train: TokenWindows, val: TokenWindows | None, batch_size: int = 4, seed: int = 0):
        super().__init__()
        self.train, self.val, self.batch_size, self.seed = train, val, batch_size, seed

    def train_dataloader(self):
        t = self.trainer
        accum = t.accumulate_grad_batches
        total = max(int(t.max_steps), 0) * accum
        sampler = StepBatchSampler(len(self.train), self.batch_size, t.global_rank, t.world_size, self.seed,
                                   total=total, position=lambda: t.global_step * accum)
        return _StepLoader(self.train, batch_sampler=sampler)

    def val_dataloader(self):
        if self.val is None:
            return []
        t = self.trainer
        return DataLoader(self.val, batch_size=self.batch_size, sampler=RankShard(len(self.val), t.global_rank, t.world_size))
