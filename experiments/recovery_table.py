"""The paper's fine-tuning-compatibility table: does the LRA still help when the pruned model is fine-tuned?

    python -m experiments.recovery_table                 # SmolLM2-135M, 25%, two criteria
    python -m experiments.recovery_table --render_only

Distilling from another map on another text (the span LRA fitted on mixed text, trained on mixed text;
``--grid.*``: the paper grid's settings, here its mixed-text refit):

    python -m experiments.recovery_table --criteria '[angular]' --runs '[lra_lora_kd]'
        --repair lra_span --train_source mixed --grid.calib_source mixed --grid.out results/paper_mixed
        --out results/recovery_kd200_mixed --steps 200

For each criterion, these runs with the same data, steps and seed:

    ========================  =========================================================
    pruned + LoRA             no correction, LoRA on attention + MLP
    pruned + LRA + LoRA       the closed-form LRA frozen, LoRA trained
    pruned + LRA* + LoRA      the LRA trained too (its own, lower learning rate)
    pruned + partial FT       no correction, the block after each pruning site trained
    pruned + LRA + partial FT the frozen LRA in place, the same blocks trained
    pruned + LoRA (KD)        as "pruned + LoRA", distilled: KL(original ‖ model) as the loss
    pruned + LRA + LoRA (KD)  as "pruned + LRA + LoRA", distilled
    pruned + LRA* + LoRA (KD) as "pruned + LRA* + LoRA", distilled (opt-in: ``--runs '[lra_trained_lora_kd]'``)
    ========================  =========================================================

With a folded repair (``--repair stock``: the maps live in existing weights, no adapter parameters) the
``lra*`` runs start from the repaired model and train LoRA alone (``lra_lora*``; nothing else is trainable, so the
``lra_trained*`` runs are refused). The grid's ``--grid.refit_kept k`` re-fits the first k kept blocks after each
span once the repair is in place, as the paper grid's re-fit does (``results/paper_mixed_refit``), before training.

The price after recovery: the same training from several repairs, one ``--out`` folder per repair (a run file is
named by criterion and run, not by repair) under one parent, whose ``--render_only`` renders the table across them::

    python -m experiments.recovery_table --repair stock --grid.refit_kept 2 --runs '[lra_lora_kd]'
        --train_source mixed --steps 200 --grid.calib_source mixed --grid.out results/paper_mixed_refit
        --out results/recovery_price/stock_refit2
    python -m experiments.recovery_table --render_only --out results/recovery_price

Each run logs to TensorBoard (``<out>/tb/<criterion>/<run>``: ``val/ppl`` and ``zeroshot/avg`` on a
small fixed doc subset at step 0 and every validation) and is then evaluated like the paper grid's
rows (:mod:`~experiments.reproduce`: the same seeded docs, the same perplexity windows)
into ``<out>/<criterion>/<run>.json``; existing runs are skipped. Its starting model (pruned, or with the repair in
place) is evaluated the same way before training (``before``, once per starting model and process). The table lands in
``<out>/recovery.{json,md}`` (KL, top-1, Avg and Robust before and after per run; a folder of older runs, made before
``before`` was recorded, keeps its layout: the paper grid's untrained rows as the references) and the curves, read back
from the event files, in ``<out>/curves.png``.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.criteria import PruneConfig
from shift_lightning.data import TextDataConfig
from shift_lightning.errors import ConfigError
from shift_lightning.evaluation.callbacks import ZeroShotAccuracy
from shift_lightning.evaluation.runner import EvalConfig
from shift_lightning.progress import StageProgress
from shift_lightning.recovery import RecoveryConfig
from shift_lightning.selection import select_blocks
from shift_lightning.maps.surgery import apply_maps, remove_blocks
from shift_lightning.maps import SOLVERS
from experiments import harness, variants
from experiments.reproduce import ReproduceConfig, check_config, check_refit_layout, eval_config, refit_kept_blocks
from experiments.tables import recovery as tables
from experiments.tables.recovery import read_curves  # noqa: F401  (re-exported)
from shift_lightning.recipes.train import run_training

log = logging.getLogger(__name__)

#: run name -> (LRA in place, LRA trained, method, loss)
RUNS = {"lora": (False, False, "lora", "nll"), "lra_lora": (True, False, "lora", "nll"),
        "lra_trained_lora": (True, True, "lora", "nll"), "partial": (False, False, "partial", "nll"),
        "lra_partial": (True, False, "partial", "nll"), "lora_kd": (False, False, "lora", "kd"),
        "lra_lora_kd": (True, False, "lora", "kd"), "lra_trained_lora_kd": (True, True, "lora", "kd")}
#: The runs of the table by default (``lra_trained_lora_kd`` is opt-in).
DEFAULT_RUNS = tuple(r for r in RUNS if r != "lra_trained_lora_kd")
LABELS = {"lora": "pruned + LoRA", "lra_lora": "pruned + LRA (frozen) + LoRA",
          "lra_trained_lora": "pruned + LRA (trained) + LoRA", "partial": "pruned + partial-layer FT",
          "lra_partial": "pruned + LRA (frozen) + partial-layer FT", "lora_kd": "pruned + LoRA, distilled (KD)",
          "lra_lora_kd": "pruned + LRA (frozen) + LoRA, distilled (KD)",
          "lra_trained_lora_kd": "pruned + LRA (trained) + LoRA, distilled (KD)"}


@dataclass
class RecoveryTableConfig:
    """The runs of the fine-tuning table and their shared budget."""

    model: str = "smollm2-135m"
    """The model to prune (embedded name, HF id or folder)."""
    criteria: list[str] = field(default_factory=lambda: ["reverse_star", "angular"])
    """Layer-selection criteria (one positional, one data-driven)."""
    repair: str = "lra"
    """The closed-form map of the ``lra*`` runs: a repair variant of the paper grid (``lra``: one LRA per block,
    merged; ``lra_span``: one LRA per contiguous span; ``guarded``, …), fitted as the grid fits it (on
    ``grid.calib_source``'s windows, the grid's damping)."""
    train_source: str | None = None
    """Training text (its calibration split, seed 1; default: ``grid.text_source``, wiki-summaries), e.g.
    ``mixed``. Never an evaluated split: ``heldout`` windows stay for ``val/ppl``."""
    runs: list[str] = field(default_factory=lambda: list(DEFAULT_RUNS))
    """Which rows to run (any of :data:`RUNS`; ``lra_trained_lora_kd`` is not among the defaults)."""
    ratio: float = 0.25
    """Depth-pruning ratio."""
    steps: int = 100
    """Optimizer steps per run (the same for every run)."""
    batch_size: int = 4
    """Windows per step."""
    seq_len: int = 256
    """Tokens per training window."""
    train_samples: int = 512
    """Training windows (``train_source``'s calibration split, seed 1; disjoint from the held-out split)."""
    lr: float = 5e-4
    """LoRA learning rate (partial-layer FT uses a tenth)."""
    lra_lr: float = 5e-5
    """Learning rate of a trained LRA."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: int = 16
    """LoRA scale numerator (the update is scaled by ``lora_alpha / lora_r``; keep the ratio when changing the rank)."""
    val_samples: int = 8
    """Held-out windows (of the grid's ``seq_len``) for ``val/ppl``."""
    val_every: int = 25
    """Steps between validations (val/ppl and zeroshot/avg in TensorBoard)."""
    curve_docs: int = 25
    """Docs per task of the zero-shot curves (a small fixed seeded subset)."""
    seed: int = 0
    """Seed of the data order, LoRA's initialisation and dropout."""
    out: str = "results/recovery"
    """Where the runs, the table and the plot go."""
    render_only: bool = False
    """Only render the table and the plot from the runs on disk (a folder of such folders: the table across them)."""
    grid: ReproduceConfig = field(default_factory=ReproduceConfig)
    """The paper grid's settings: calibration budget, selection windows, zero-shot docs and perplexity
    windows (the table uses the same docs as results/paper)."""


def labels(repair: str = "lra", refit_kept: int | str = 0) -> dict[str, str]:
    """Run -> label, naming the map when it is not the per-block LRA, and the kept-block re-fit when there is one."""
    name = "LRA" if repair == "lra" else repair
    if refit_kept:
        name = f"{name} + re-fit of {refit_kept} kept blocks"
    return LABELS if name == "LRA" else {k: v.replace("LRA", name) for k, v in LABELS.items()}


def folded(repair: str) -> bool:
    """Whether ``repair``'s maps are folded into existing weights (no adapter parameters to train)."""
    return SOLVERS[variants.solver_of(repair)].placement != "adapter"


def validate(cfg: RecoveryTableConfig) -> None:
    if cfg.repair not in variants.VARIANTS:
        raise ConfigError(f"--repair {cfg.repair!r} is not a variant the paper grid fits; use one of "
                          f"{', '.join(variants.VARIANTS)}")
    unknown = [r for r in cfg.runs if r not in RUNS]
    if unknown:
        raise ConfigError(f"--runs: unknown run(s) {unknown}; use any of {', '.join(RUNS)}")
    trained = [r for r in cfg.runs if RUNS[r][1]]
    if trained and folded(cfg.repair):
        raise ConfigError(f"--repair {cfg.repair} folds its maps into existing weights: no map parameters to train in "
                          f"{trained}; use the lra_lora* runs (the repair in place, LoRA trained)")
    check_config(cfg.grid)


def run(cfg: RecoveryTableConfig) -> Path:
    validate(cfg)
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    names = labels(cfg.repair, cfg.grid.refit_kept)
    if cfg.render_only:
        tables.render(out, cfg, names)
        return out
    g = cfg.grid
    ctx = harness.open_grid(cfg.model, g.tiny, "cpu", lambda v, d: eval_config(g, v, d),
                            {"config": json.loads(json.dumps(asdict(cfg), default=str)), "command": rerun_command(cfg)},
                            g.text_source)
    base, tokenizer = ctx.model, ctx.tokenizer
    check_refit_layout(g, base)
    curve = EvalConfig(tasks=ctx.eval_config.tasks, limit=cfg.curve_docs, sample_seed=g.sample_seed, progress=False,
                       max_batch_tokens=ctx.eval_config.max_batch_tokens, data_dir=g.eval_data_dir)
    train_data = TextDataConfig(source=cfg.train_source or g.text_source, num_samples=cfg.train_samples,
                                seq_len=cfg.seq_len, seed=1, batch_size=cfg.batch_size)
    val = TextDataConfig(source=g.text_source, split="heldout", num_samples=cfg.val_samples, seq_len=g.seq_len)
    runs = harness.RunFolder(out)
    for crit in cfg.criteria:
        todo = runs.pending([f"{crit}/{r}" for r in cfg.runs])
        if not todo:
            continue
        windows = ctx.windows(g.select_samples, g.select_seq_len)
        layers = select_blocks(PruneConfig(ratio=cfg.ratio, criterion=crit), base, windows, ctx.make_trainer).layers
        n = ctx.num_layers
        module = CalibrationModule(copy.deepcopy(base), layers,
                                   CalibrationConfig(damping=g.damping, heldout_every=g.heldout_every,
                                                     mode=variants.mode_of(cfg.repair)),
                                   solvers=variants.knobs([cfg.repair]))
        calib = ctx.windows(g.calib_samples, g.seq_len, source=g.calib_source)
        module.calibrate(ctx.make_trainer(), calib, ctx.windows(g.heldout_samples, g.seq_len, split="heldout"),
                         batch_size=4)
        correction = module.fitted_maps(cfg.repair)
        before: dict[bool, dict] = {}  # with the repair in place or not -> the starting model's evaluation
        for run_name in todo:
            name = run_name.split("/")[1]
            if runs.done(run_name):  # finished meanwhile by another process (--runs split)
                continue
            with_lra, train_lra, method, loss = RUNS[name]
            model = copy.deepcopy(base)
            remove_blocks(model, layers)
            t0 = time.time()
            refit = None
            if with_lra:
                apply_maps(model, correction, n, layers)
                if g.refit_kept:
                    refit = refit_kept_blocks(g, base, model, layers, calib)
            t_refit = time.time() - t0
            t_before = None
            if with_lra not in before:
                t0 = time.time()
                before[with_lra] = harness.row_doc(ctx.evaluate(model.eval()))
                t_before = time.time() - t0
            spec = {"original_num_layers": n, "pruned_layers": layers, "criterion": crit,
                    "solver": cfg.repair if with_lra else "none"}
            rec = RecoveryConfig(method=method, train_lra=train_lra, lora_r=cfg.lora_r, lora_alpha=cfg.lora_alpha, loss=loss,
                                 lr=cfg.lr if method == "lora" else cfg.lr / 10, lra_lr=cfg.lra_lr,
                                 warmup_steps=max(cfg.steps // 20, 1), seed=cfg.seed)
            stale = out / "tb" / crit / name  # events of an earlier, interrupted attempt would mix into the curves
            if stale.exists():
                shutil.rmtree(stale)
            trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=cfg.steps, val_check_interval=cfg.val_every,
                                check_val_every_n_epoch=None, use_distributed_sampler=False, inference_mode=False,
                                num_sanity_val_steps=0, gradient_clip_val=1.0, log_every_n_steps=5,
                                enable_checkpointing=False, enable_model_summary=False,
                                logger=TensorBoardLogger(str(out / "tb"), name=crit, version=name),
                                callbacks=[ZeroShotAccuracy(curve, when=("validation_end",)), StageProgress()])
            t0 = time.time()
            result = run_training(trainer, train_data=train_data, val=val, recovery=rec, built=(model, tokenizer, spec),
                                  reference=base)
            t1 = time.time()
            merged = result.module.merged_model().eval()
            res = ctx.evaluate(merged)
            doc = {"model": cfg.model, "criterion": crit, "run": name, "label": names[name],
                   "repair": cfg.repair if with_lra else None, "pruned_layers": layers,
                   **({"refit": refit} if refit is not None else {}),
                   "recovery": asdict(rec), "steps": result.report.steps,
                   "trainable_params": result.report.trainable_params,
                   "loss_history": result.report.loss_history, **harness.row_doc(res),
                   "before": before[with_lra],
                   "seconds": {"train": t1 - t0, "evaluation": time.time() - t1,
                               **({"refit": t_refit} if refit is not None else {}),
                               **({"before_evaluation": t_before} if t_before is not None else {})},
                   "config": ctx.meta["config"], "command": ctx.meta["command"], "software": ctx.meta["software"]}
            runs.write(run_name, doc)
            log.info("%s %s: avg %.2f, wiki PPL %.3f (train %.0f s)", crit, name, 100 * res["average"],
                     res["perplexity"][g.ppl_sets[0]]["ppl"], t1 - t0)
            tables.render(out, cfg, names)
    tables.render(out, cfg, names)
    return out


def rerun_command(cfg: RecoveryTableConfig) -> str:
    from experiments.cli import rerun_command as command

    return command("experiments.recovery_table", cfg)


def render(out: Path, cfg: RecoveryTableConfig) -> None:
    tables.render(out, cfg, labels(cfg.repair, cfg.grid.refit_kept))


def main(argv: list[str] | None = None):
    from experiments.cli import dataclass_main

    def go(cfg: RecoveryTableConfig):
        out = run(cfg)
        print(f"Table in {out / 'recovery.md'}, curves in {out / 'curves.png'}")
        return out

    return dataclass_main(RecoveryTableConfig, go, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
