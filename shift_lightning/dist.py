"""Thin torch.distributed helpers that are no-ops on a single process."""

from __future__ import annotations

import torch
import torch.distributed as tdist


def is_dist() -> bool:
    return tdist.is_available() and tdist.is_initialized()


def rank() -> int:
    return tdist.get_rank() if is_dist() else 0


def world_size() -> int:
    return tdist.get_world_size() if is_dist() else 1


def all_reduce_flat(tensors: list[torch.Tensor]) -> None:
    """Sum ``tensors`` across ranks in place with ONE all-reduce (packed into a flat buffer).

    All tensors must share dtype and device.
    """
    if not is_dist() or not tensors:
        return
    if len(tensors) == 1:
        tdist.all_reduce(tensors[0])
        return
    flat = torch.cat([t.reshape(-1) for t in tensors])
    tdist.all_reduce(flat)
    off = 0
    for t in tensors:
        n = t.numel()
        t.copy_(flat[off: off + n].view_as(t))
        off += n


def broadcast_tensors(tensors: list[torch.Tensor], src: int) -> None:
    """Broadcast ``tensors`` (same shapes on every rank) from ``src`` in place."""
    if not is_dist():
        return
    for t in tensors:
        tdist.broadcast(t, src)


def barrier() -> None:
    if is_dist():
        tdist.barrier()


def launch_rank() -> int:
    """This process's global rank, also before ``torch.distributed`` is initialised (launchers such as
    Lightning's DDP, torchrun and SLURM set ``RANK`` / ``LOCAL_RANK`` / ``SLURM_PROCID``)."""
    if is_dist():
        return rank()
    import os

    for key in ("RANK", "LOCAL_RANK", "SLURM_PROCID"):
        if os.environ.get(key, "").isdigit():
            return int(os.environ[key])
    return 0
