"""The distributed solve: job ``n`` runs on rank ``n mod world``, its map is broadcast to every rank.

Every solver returns a :class:`~shift_lightning.maps.ridge.Solution` of known shapes (``W (d, d)``,
``b (d,)`` (``W (d, d_ff)`` for the stock repair's ``down_proj`` update), ``U, V (d, r)`` when low rank, a branch map ``T (d, d)`` beside the adapter for the joint
solver, ``λ``), so the broadcast is the same for every map. The owner's small ``info`` dict, which
tensors it filled (and any :class:`~shift_lightning.maps.ridge.SolveError`) travel first, as an object: a
failed solve raises the same one-line error on every rank, and every rank sizes the buffers alike.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import dist
from ..maps.ridge import Solution, SolveError
from .collect import SiteStatistics
from ..maps.sites import Site
from ..maps.solvers import Solver


@dataclass
class Job:
    """Fit ``site`` with ``solver`` on ``stats``; ``tag`` says where the solution belongs."""

    tag: str
    site: Site
    solver: Solver
    stats: SiteStatistics


def _broadcast_object(obj, src: int):
    if dist.world_size() == 1:
        return obj
    import torch.distributed as tdist

    box = [obj]
    tdist.broadcast_object_list(box, src=src)
    return box[0]


def solve_shared(jobs: list[Job], dim: int, device, on_solved=None, first: int = 0) -> list[Solution]:
    """Solve ``jobs`` shared out among ranks; every rank returns every solution (same order). ``on_solved(n, job,
    solution)`` is called on every rank as each job's solution arrives (e.g. to free what no later job needs).
    ``first``: the jobs solved before by the same caller (job ``n`` runs on rank ``(first + n) mod world``)."""
    world, me = dist.world_size(), dist.rank()
    out = []
    for n, job in enumerate(jobs):
        owner = (first + n) % world
        r = job.solver.rank(dim)
        sol, meta = None, {}
        if me == owner:
            try:
                job.solver.device = device
                sol = job.solver.fit(job.stats)
                meta = {"kind": sol.kind, "info": sol.info, "low_rank": sol.U is not None, "T": sol.T is not None,
                        "W_shape": tuple(sol.W.shape)}
            except SolveError as e:
                meta = {"error": str(e)}
        meta = _broadcast_object(meta, owner)  # first: every rank then knows the shapes (or the error)
        if "error" in meta:
            raise SolveError(meta["error"])
        f64 = dict(dtype=torch.float64, device=device)
        W, b, lam = torch.zeros(*meta["W_shape"], **f64), torch.zeros(dim, **f64), torch.zeros(1, **f64)
        U, V = torch.zeros(dim, r or 1, **f64), torch.zeros(dim, r or 1, **f64)
        T = torch.zeros(dim, dim, **f64) if meta["T"] else torch.zeros(1, 1, **f64)
        if sol is not None:
            W.copy_(sol.W), b.copy_(sol.b), lam.fill_(sol.lam)
            if r and sol.U is not None:
                U.copy_(sol.U), V.copy_(sol.V)
            if sol.T is not None:
                T.copy_(sol.T)
        dist.broadcast_tensors([W, b, U, V, T, lam], src=owner)
        if not torch.isfinite(W).all():
            raise SolveError(f"{job.site.name}: the {job.solver.name} solve failed on rank {owner}; increase "
                             "--calibration.damping")
        low = meta["low_rank"]
        out.append(Solution(W, b, U if low else None, V if low else None, float(lam.item()), meta["kind"],
                            info=meta["info"], T=T if meta["T"] else None))
        if on_solved is not None:
            on_solved(n, job, out[-1])
    return out
