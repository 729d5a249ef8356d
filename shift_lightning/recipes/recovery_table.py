"""The paper's fine-tuning-compatibility table: does the LRA still help when the pruned model is fine-tuned?

    python -m shift_lightning.recipes.recovery_table                 # SmolLM2-135M, 25%, two criteria
    python -m shift_lightning.recipes.recovery_table --render_only

For each criterion, five runs with the same data, steps and seed:

    ========================  =========================================================
    pruned + LoRA             no correction, LoRA on attention + MLP
    pruned + LRA + LoRA       the closed-form LRA frozen, LoRA trained
    pruned + LRA* + LoRA      the LRA trained too (its own, lower learning rate)
    pruned + partial FT       no correction, the block after each pruning site trained
    pruned + LRA + partial FT the frozen LRA in place, the same blocks trained
    ========================  =========================================================

Each run logs to TensorBoard (``<out>/tb/<criterion>/<run>``: ``val/ppl`` and ``zeroshot/avg`` on a
small fixed doc subset at step 0 and every validation) and is then evaluated like the paper grid's
rows (:mod:`~shift_lightning.recipes.reproduce`: the same seeded docs, the same perplexity windows)
into ``<out>/<criterion>/<run>.json``; existing runs are skipped. The table lands in
``<out>/recovery.{json,md}`` and the curves, read back from the event files, in ``<out>/curves.png``.
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

from ..calibration import CalibrationConfig, CalibrationModule
from ..criteria import PruneConfig
from ..data import TextDataConfig, build_windows
from ..evaluation.runner import EvalConfig, evaluate_model, make_evaluator
from ..models import ModelConfig
from ..outputs import write_json_atomic
from ..recovery import RecoveryConfig
from ..selection import select_blocks
from ..surgery import apply_correction, load_pretrained, remove_blocks
from .reproduce import ReproduceConfig, _eval_config, _row_doc, _software
from .train import run_training

log = logging.getLogger(__name__)

#: run name -> (LRA in place, LRA trained, method)
RUNS = {"lora": (False, False, "lora"), "lra_lora": (True, False, "lora"), "lra_trained_lora": (True, True, "lora"),
        "partial": (False, False, "partial"), "lra_partial": (True, False, "partial")}
LABELS = {"lora": "pruned + LoRA", "lra_lora": "pruned + LRA (frozen) + LoRA",
          "lra_trained_lora": "pruned + LRA (trained) + LoRA", "partial": "pruned + partial-layer FT",
          "lra_partial": "pruned + LRA (frozen) + partial-layer FT"}


@dataclass
class RecoveryTableConfig:
    """The runs of the fine-tuning table and their shared budget."""

    model: str = "smollm2-135m"
    """The model to prune (embedded name, HF id or folder)."""
    criteria: list[str] = field(default_factory=lambda: ["reverse_star", "angular"])
    """Layer-selection criteria (one positional, one data-driven)."""
    runs: list[str] = field(default_factory=lambda: list(RUNS))
    """Which rows to run."""
    ratio: float = 0.25
    """Depth-pruning ratio."""
    steps: int = 100
    """Optimizer steps per run (the same for every run)."""
    batch_size: int = 4
    """Windows per step."""
    seq_len: int = 256
    """Tokens per training window."""
    train_samples: int = 512
    """Training windows (wiki-summaries calibration split, seed 1; disjoint from the held-out split)."""
    lr: float = 5e-4
    """LoRA learning rate (partial-layer FT uses a tenth)."""
    lra_lr: float = 5e-5
    """Learning rate of a trained LRA."""
    lora_r: int = 8
    """LoRA rank."""
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
    """Only render the table and the plot from the runs on disk."""
    grid: ReproduceConfig = field(default_factory=ReproduceConfig)
    """The paper grid's settings: calibration budget, selection windows, zero-shot docs and perplexity
    windows (the table uses the same docs as results/paper)."""


def run(cfg: RecoveryTableConfig) -> Path:
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    if cfg.render_only:
        render(out, cfg)
        return out
    g = cfg.grid
    base, tok = load_pretrained(ModelConfig(name_or_path=cfg.model, tiny=g.tiny))
    mtype = base.config.model_type
    ev = _eval_config(g, base.config.vocab_size)
    evaluator = make_evaluator(base, tok, ev)
    curve = EvalConfig(tasks=ev.tasks, limit=cfg.curve_docs, sample_seed=g.sample_seed, progress=False,
                       max_batch_tokens=ev.max_batch_tokens)
    src = g.text_source
    calib = build_windows(TextDataConfig(source=src, num_samples=g.calib_samples, seq_len=g.seq_len), tok, mtype)
    select_w = build_windows(TextDataConfig(source=src, num_samples=g.select_samples, seq_len=g.select_seq_len),
                             tok, mtype)
    train_data = TextDataConfig(source=src, num_samples=cfg.train_samples, seq_len=cfg.seq_len, seed=1,
                                batch_size=cfg.batch_size)
    val = TextDataConfig(source=src, split="heldout", num_samples=cfg.val_samples, seq_len=g.seq_len)
    for crit in cfg.criteria:
        todo = [r for r in cfg.runs if not (out / crit / f"{r}.json").exists()]
        if not todo:
            continue
        sel = select_blocks(PruneConfig(ratio=cfg.ratio, criterion=crit), base, select_w, _quiet_trainer)
        layers = sel.layers
        n = len(base.model.layers)
        module = CalibrationModule(copy.deepcopy(base), layers, CalibrationConfig(damping=g.damping))
        module.calibrate(_quiet_trainer(), calib, batch_size=4)
        correction = module.correction("lra")
        for name in todo:
            if (out / crit / f"{name}.json").exists():  # finished meanwhile by another process (--runs split)
                continue
            with_lra, train_lra, method = RUNS[name]
            model = copy.deepcopy(base)
            remove_blocks(model, layers)
            if with_lra:
                apply_correction(model, correction, n, layers)
            spec = {"original_num_layers": n, "pruned_layers": layers, "criterion": crit,
                    "correction": "lra" if with_lra else "none"}
            rec = RecoveryConfig(method=method, train_lra=train_lra, lora_r=cfg.lora_r,
                                 lr=cfg.lr if method == "lora" else cfg.lr / 10, lra_lr=cfg.lra_lr,
                                 warmup_steps=max(cfg.steps // 20, 1), seed=cfg.seed)
            from lightning.pytorch.loggers import TensorBoardLogger

            from ..evaluation.callbacks import ZeroShotAccuracy

            stale = out / "tb" / crit / name  # events of an earlier, interrupted attempt would mix into the curves
            if stale.exists():
                shutil.rmtree(stale)
            trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=cfg.steps, val_check_interval=cfg.val_every,
                                check_val_every_n_epoch=None, use_distributed_sampler=False, inference_mode=False,
                                num_sanity_val_steps=0, gradient_clip_val=1.0, log_every_n_steps=5,
                                enable_checkpointing=False, enable_model_summary=False, enable_progress_bar=False,
                                logger=TensorBoardLogger(str(out / "tb"), name=crit, version=name),
                                callbacks=[ZeroShotAccuracy(curve, when=("validation_end",))])
            t0 = time.time()
            result = run_training(trainer, train_data=train_data, val=val, recovery=rec, built=(model, tok, spec))
            t1 = time.time()
            merged = result.module.merged_model().eval()
            res = evaluate_model(merged, tok, ev, evaluator)
            doc = {"model": cfg.model, "criterion": crit, "run": name, "label": LABELS[name], "pruned_layers": layers,
                   "recovery": asdict(rec), "steps": result.report["steps"],
                   "trainable_params": result.report["trainable_params"],
                   "loss_history": result.report["loss_history"], **_row_doc(res),
                   "seconds": {"train": t1 - t0, "evaluation": time.time() - t1},
                   "config": _jsonable(cfg), "command": rerun_command(cfg), "software": _software()}
            write_json_atomic(out / crit / f"{name}.json", doc)
            log.info("%s %s: avg %.2f, wiki PPL %.3f (train %.0f s)", crit, name, 100 * res["average"],
                     res["perplexity"][g.ppl_sets[0]]["ppl"], t1 - t0)
            render(out, cfg)
    render(out, cfg)
    return out


def _quiet_trainer():
    return L.Trainer(accelerator="cpu", devices=1, inference_mode=False, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)


def _jsonable(cfg: RecoveryTableConfig) -> dict:
    return json.loads(json.dumps(asdict(cfg), default=str))


def rerun_command(cfg: RecoveryTableConfig) -> str:
    from .cli import rerun_command as command

    return command("shift_lightning.recipes.recovery_table", cfg)


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------
def _runs_on_disk(out: Path) -> dict[tuple[str, str], dict]:
    return {(d["criterion"], d["run"]): d for d in (json.loads(f.read_text()) for f in sorted(out.glob("*/*.json")))}


def render(out: Path, cfg: RecoveryTableConfig) -> None:
    runs = _runs_on_disk(out)
    if not runs:
        return
    paper = Path(cfg.grid.out) / Path(cfg.model).name
    ref = {}
    for crit in cfg.criteria:  # the untrained rows of the paper grid, same docs: the starting points
        for v in ("pruned", "lra"):
            f = paper / crit / f"{v}.json"
            if f.exists():
                ref[(crit, v)] = json.loads(f.read_text())
    robust = _robust(paper, runs, ref)
    rows = []
    for (crit, name), d in runs.items():
        rows.append({"criterion": crit, "run": name, "label": d["label"], "steps": d["steps"],
                     "trainable_params": d["trainable_params"], "avg": d["average"],
                     **robust.get(f"{crit}/{name}", {}),
                     "tasks": {t: e["value"] for t, e in d["tasks"].items()},
                     "ppl": {p: e["ppl"] for p, e in d["perplexity"].items()}})
    write_json_atomic(out / "recovery.json", {"rows": rows, "config": _jsonable(cfg),
                                              "reference_untrained": {f"{c}/{v}": {"avg": r["average"], "ppl": {
                                                  p: e["ppl"] for p, e in r["perplexity"].items()}}
                                                  for (c, v), r in ref.items()}})
    any_run = next(iter(runs.values()))
    sets = list(any_run["perplexity"])
    lines = [f"# Fine-tuning after pruning: {cfg.model}, {int(100 * cfg.ratio)}% depth pruning", "",
             f"Every run: {cfg.steps} steps × {cfg.batch_size} windows × {cfg.seq_len} tokens of wiki-summaries "
             f"(calibration split, seed 1), the same order (seed {cfg.seed}); LoRA r={cfg.lora_r} on attention + MLP at "
             f"lr {cfg.lr:g}, partial-layer FT at lr {cfg.lr / 10:g} on the block after each pruning site, a trained "
             f"LRA at lr {cfg.lra_lr:g}; warm-up then cosine. Zero-shot avg on the results tables' "
             f"{cfg.grid.docs} seeded docs per task (7 tasks); **Robust**: the share of the original's above-chance accuracy "
             "kept (as in results/paper, 95% bootstrap interval over docs); PPL on the same windows as results/paper.",
             "",
             f"Command: `{any_run['command']}`", "",
             "| criterion | run | trainable params | Avg | Robust | " + " | ".join(f"{_set_label(p)} PPL" for p in sets)
             + " |", "|---|---|---:|---:|---:|" + "---:|" * len(sets)]
    for crit in cfg.criteria:
        for v, label in (("pruned", "pruned (no training; results/paper)"), ("lra", "pruned + LRA (no training; results/paper)")):
            r = ref.get((crit, v))
            if r:
                lines.append(f"| {crit} | {label} | 0 | {100 * r['average']:.2f} | "
                             f"{_robust_cell(robust.get(f'paper:{crit}/{v}'))} | "
                             + " | ".join(_ppl(r["perplexity"][p]["ppl"]) for p in sets) + " |")
        for name in cfg.runs:
            d = runs.get((crit, name))
            if d is None:
                lines.append(f"| {crit} | {LABELS[name]} | … | … | … | " + " | ".join("…" for _ in sets) + " |")
                continue
            lines.append(f"| {crit} | {d['label']} | {d['trainable_params']:,} | {100 * d['average']:.2f} | "
                         f"{_robust_cell(robust.get(f'{crit}/{name}'))} | "
                         + " | ".join(_ppl(d["perplexity"][p]["ppl"]) for p in sets) + " |")
    (out / "recovery.md").write_text("\n".join(lines) + "\n")
    try:
        plot_curves(out, cfg)
    except ImportError:
        log.warning("matplotlib not installed: no curves plot")


def _robust(paper: Path, runs: dict, ref: dict) -> dict[str, dict]:
    """Robust summary (share of the original's above-chance accuracy kept, with a 95% bootstrap
    interval) of every run, against the paper grid's original model scored on the same docs."""
    from ..evaluation.summary import Bootstrap

    orig = paper / "original.json"
    if not orig.exists():
        return {}
    named = {"original": json.loads(orig.read_text()), **{f"{c}/{n}": d for (c, n), d in runs.items()},
             **{f"paper:{c}/{v}": r for (c, v), r in ref.items()}}
    boot = Bootstrap(named, "original")
    out = {}
    for name in named:
        if name != "original":
            summ = boot.summary(name)
            out[name] = {"robust": summ["robust"], "robust_ci": summ["robust_ci"]}
    return out


def _robust_cell(r: dict | None) -> str:
    if not r or r["robust"] != r["robust"]:
        return "–"
    lo, hi = r["robust_ci"]
    return f"{100 * r['robust']:.1f} [{100 * lo:.1f}, {100 * hi:.1f}]"


def _set_label(p: str) -> str:
    return {"wiki_summaries": "wiki", "lambada": "LAMBADA"}.get(p, Path(p).stem)


def _ppl(v: float) -> str:
    return f"{v:.2f}" if v < 1e4 else f"{v:.2e}"


def read_curves(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Scalars of one run's TensorBoard event files: ``{tag: [(step, value), …]}``."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list] = {}
    for f in sorted(logdir.rglob("events.out.tfevents*")):
        ea = EventAccumulator(str(f))
        ea.Reload()
        for tag in ea.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in ea.Scalars(tag))
    return {k: sorted(v) for k, v in out.items()}


def plot_curves(out: Path, cfg: RecoveryTableConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(cfg.criteria), figsize=(6 * len(cfg.criteria), 8), squeeze=False)
    for j, crit in enumerate(cfg.criteria):
        for name in cfg.runs:
            d = out / "tb" / crit / name
            if not d.exists():
                continue
            c = read_curves(d)
            for i, tag in enumerate(("zeroshot/avg", "val/ppl")):
                pts = c.get(tag, [])
                if pts:
                    axes[i][j].plot([s for s, _ in pts], [100 * v if i == 0 else v for _, v in pts], marker="o",
                                    label=LABELS[name])
        axes[0][j].set_title(f"{crit}: zero-shot avg (%, {cfg.curve_docs} docs/task)")
        axes[1][j].set_title(f"{crit}: held-out val PPL")
        axes[1][j].set_yscale("log")
        axes[1][j].set_xlabel("step")
        if axes[0][j].get_legend_handles_labels()[0]:
            axes[0][j].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "curves.png", dpi=110)
    plt.close(fig)


def _done(out: Path) -> str:
    return f"Table in {out / 'recovery.md'}, curves in {out / 'curves.png'}"


def main(argv: list[str] | None = None):
    from .cli import dataclass_main

    def go(cfg: RecoveryTableConfig):
        out = run(cfg)
        print(_done(out))
        return out

    return dataclass_main(RecoveryTableConfig, go, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
