"""Evaluation of an in-memory model over ranks: zero-shot tasks, perplexity and closeness to the original.

* :class:`~shift_lightning.evaluation.evaluator.EvalConfig` and
  :class:`~shift_lightning.evaluation.evaluator.Evaluator` (framework-free; re-exported here);
* :func:`evaluate_model` — library entry point: ``evaluate_model(model, tokenizer, cfg) -> dict``
  (shards over ranks itself when ``torch.distributed`` is initialised); :func:`record_reference`
  records the original's distributions (closeness) the same way;
* :class:`EvalModule` — the same as a :class:`~shift_lightning.passes.DataPass` for
  ``trainer.predict`` (units sharded over ranks, one sum-reduce at the end);
* :func:`markdown_table` — a readable table of one result.
"""

from __future__ import annotations

import time

import torch
from torch import nn

from .. import dist
from ..data import RankShard
from ..passes import DataPass, sum_across_ranks
from . import scoring as S
from .evaluator import EvalConfig, Evaluator, Unit, make_evaluator  # noqa: F401 (user-facing: EvalConfig)

def run_units(model: nn.Module, evaluator: Evaluator, units: list[Unit], progress: bool, record: bool = False,
              stage: str = "evaluation") -> None:
    """Score ``units`` in eval mode (training mode restored afterwards); ``progress``: a bar named ``stage``
    on a terminal, a line every 30 s in a log file (:func:`~shift_lightning.progress.stage_bar`)."""
    from ..progress import stage_bar

    was_training = model.training
    model.eval()
    bar = stage_bar(stage, len(units)) if progress else None
    try:
        for u in units:
            evaluator.score_unit(model, u, record=record)
            if bar is not None:
                bar.step()
    finally:
        model.train(was_training)
        if bar is not None:
            bar.close()


def record_reference(model: nn.Module, evaluator: Evaluator) -> None:
    """Record ``model``'s (the original's) next-token distributions on the closeness sets as the
    reference of every later evaluation with ``evaluator`` (``EvalConfig.kl``). Under
    ``torch.distributed`` every rank records the units it will score."""
    if not evaluator.cfg.kl:
        return
    units = evaluator.units()
    mine = [units[i] for i in RankShard(len(units), dist.rank(), dist.world_size())]
    evaluator.reset(S._param_device(model))
    run_units(model, evaluator, [u for u in mine if u.kind != "task"], evaluator.cfg.progress and dist.rank() == 0,
              record=True, stage="closeness reference (original model)")
    evaluator.recorded = True


def evaluate_model(model: nn.Module, tokenizer, cfg: EvalConfig | None = None, evaluator: Evaluator | None = None,
                   tasks: bool = True, record: bool = False) -> dict:
    """Evaluate an in-memory (original, pruned, corrected or LoRA-wrapped) model.

    Under ``torch.distributed`` every rank must call it; each scores units ``rank::world`` and all
    get the same synced result. Returns the results dict (see :meth:`Evaluator.compute`).
    ``tasks=False``: perplexity and closeness only (the zero-shot units are skipped); ``record``:
    ``model`` is the original, whose distributions become the closeness reference in the same pass.
    """
    cfg = cfg or EvalConfig()
    evaluator = evaluator or make_evaluator(model, tokenizer, cfg)
    evaluator.reset(S._param_device(model))
    units = evaluator.units()
    mine = [units[i] for i in RankShard(len(units), dist.rank(), dist.world_size())]
    if not tasks:
        mine = [u for u in mine if u.kind != "task"]
    t0 = time.time()
    run_units(model, evaluator, mine, cfg.progress and dist.rank() == 0, record,
              stage="evaluation (original model, recording the closeness reference)" if record and cfg.kl
              else "evaluation" if tasks else "evaluation (perplexity and closeness)")
    sum_across_ranks(evaluator.state())
    evaluator.recorded = evaluator.recorded or (record and cfg.kl)
    out = evaluator.compute(tasks=tasks)
    out["seconds"] = time.time() - t0
    out["world_size"] = dist.world_size()
    return out


class EvalModule(DataPass):
    """``trainer.predict`` wrapper: one predict step = one :class:`Unit`; results in ``self.results``.

    The per-doc sums live outside the module's state so ``precision="bf16-true"`` cannot cast them.
    """

    stage = "evaluation"

    def __init__(self, model: nn.Module, tokenizer, cfg: EvalConfig):
        super().__init__()
        self.model = model
        self.cfg = cfg
        self.evaluator = make_evaluator(model, tokenizer, cfg)
        self.results: dict | None = None
        self._t0 = 0.0
        self._record = self._reference_only = False

    def evaluate(self, trainer, record: bool = False) -> dict:
        """Score every unit once over all ranks; returns (and keeps) the results. ``record``: this is
        the original model; its distributions become the closeness reference in the same pass."""
        self._record = record and self.cfg.kl
        if self._record:
            self.evaluator.recorded = True
        try:
            self.run(trainer, self.evaluator.units(), batch_size=None)
        finally:
            self._record = False
        return self.results

    def record_reference(self, trainer) -> None:
        """Record the (original) model's distributions as the closeness reference (``cfg.kl``) without
        scoring the tasks: the same units on the same ranks as every later :meth:`evaluate`."""
        if not self.cfg.kl:
            return
        stage, self.stage = self.stage, "closeness reference (original model)"
        self._record = self._reference_only = True
        self.evaluator.recorded = True
        try:
            self.run(trainer, self.evaluator.units(), batch_size=None)
        finally:
            self.stage, self._record, self._reference_only = stage, False, False

    def begin(self) -> None:
        self.evaluator.reset(self.device)
        self.model.eval()
        self._t0 = time.time()

    def step(self, unit: Unit, batch_idx: int) -> None:
        if self._reference_only and unit.kind == "task":
            return
        self.evaluator.score_unit(self.model, unit, record=self._record)

    def state(self) -> list[torch.Tensor]:
        return self.evaluator.state()

    def finish(self) -> None:
        if self._reference_only:
            return
        self.results = self.evaluator.compute()
        self.results["seconds"] = time.time() - self._t0
        self.results["world_size"] = self.trainer.world_size


# ---------------------------------------------------------------------------------------------
# Reporting
# ---------------------------------------------------------------------------------------------
def markdown_table(res: dict) -> str:
    lines = ["| task | metric | value | acc | acc_norm | docs | split | data |", "|---|---|---|---|---|---|---|---|"]
    for t, e in res.get("tasks", {}).items():
        an = e.get("acc_norm")
        lines.append(f"| {t} | {e['metric']} | {100 * e['value']:.2f} | {100 * e['acc']:.2f} | "
                     f"{'' if an is None else f'{100 * an:.2f}'} | {e['n']} of {e['n_available']} "
                     f"({e['sampling']}) | {e['split']} | {e['data']} |")
    if res.get("average") is not None:
        lines.append(f"| **average** | reported | **{100 * res['average']:.2f}** | | | | | |")
    out = "\n".join(lines)
    if res.get("perplexity"):
        out += "\n\n| perplexity set | PPL | tokens | windows | seq_len | stride | BOS |\n|---|---|---|---|---|---|---|\n"
        out += "\n".join(f"| {p} | {e['ppl']:.3f} | {e['tokens']} | {e['windows']} | {e['seq_len']} | "
                         f"{e['stride']} | {e['bos']} |" for p, e in res["perplexity"].items())
    if res.get("closeness"):
        out += "\n\n| closeness set | KL(original ‖ model), nats/position | top-1 agreement | positions | items |\n" \
               "|---|---|---|---|---|\n"
        out += "\n".join(f"| {p} | {e['kl']:.4f} [{e['kl_ci'][0]:.4f}, {e['kl_ci'][1]:.4f}] | "
                         f"{100 * e['top1']:.2f} % | {e['positions']} | {e['items']} |" for p, e in res["closeness"].items())
    return out + "\n"
