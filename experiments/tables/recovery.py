"""The fine-tuning table (``results/recovery/recovery.{md,json}``, ``curves.png``), rendered from its
run files and TensorBoard event files."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

from shift_lightning.reports import read_scalars
from shift_lightning.outputs import write_file_atomic, write_json_atomic, write_text_atomic
from experiments.tables.common import fmt_kl, fmt_ppl, set_label

log = logging.getLogger(__name__)


def _runs_on_disk(out: Path) -> dict[tuple[str, str], dict]:
    return {(d["criterion"], d["run"]): d for d in (json.loads(f.read_text()) for f in sorted(out.glob("*/*.json")))}


def _kl_cell(run: dict) -> str:
    kl = run.get("kl")
    return " / ".join(fmt_kl(v) for v in kl.values()) if kl else "–"


#: Training text -> how the table's header names it.
TEXT_LABELS = {"wiki_summaries": "wiki-summaries", "mixed": "mixed-domain text (wiki-summaries, CoQA stories, QA pairs)"}


def render(out: Path, cfg, labels: dict[str, str]) -> None:
    """``recovery.{json,md}`` and ``curves.png`` from the runs on disk; ``cfg``: the table's config
    (model, criteria, runs, steps, …, and ``grid``, the paper grid's settings); ``labels``: run -> label."""
    runs = _runs_on_disk(out)
    if not runs:
        return
    paper = Path(cfg.grid.out) / Path(cfg.model).name
    ref = {}
    repair = cfg.repair
    # the untrained rows of the paper grid, same docs: the starting points; pruning alone from the grid's
    # ``pruned_from`` where it ran none (a grid refitted on another calibration text)
    home = {}  # (criterion, variant) -> the grid folder its row came from
    for crit in cfg.criteria:
        for v in ("pruned", repair):
            fallback = [Path(cfg.grid.pruned_from) / paper.name] if v == "pruned" and cfg.grid.pruned_from else []
            for folder in (paper, *fallback):
                f = folder / crit / f"{v}.json"
                if f.exists():
                    ref[(crit, v)] = json.loads(f.read_text())
                    home[(crit, v)] = folder.parent
                    break
    robust = _robust(paper, runs, ref)
    rows = []
    for (crit, name), d in runs.items():
        rows.append({"criterion": crit, "run": name, "label": d["label"], "steps": d["steps"],
                     "trainable_params": d["trainable_params"], "avg": d["average"],
                     **robust.get(f"{crit}/{name}", {}),
                     "tasks": {t: e["value"] for t, e in d["tasks"].items()},
                     "ppl": {p: e["ppl"] for p, e in d["perplexity"].items()}, "kl": d.get("kl")})
    write_json_atomic(out / "recovery.json", {"rows": rows, "config": json.loads(json.dumps(asdict(cfg), default=str)),
                                              "reference_untrained": {f"{c}/{v}": {"avg": r["average"], "ppl": {
                                                  p: e["ppl"] for p, e in r["perplexity"].items()}}
                                                  for (c, v), r in ref.items()}})
    any_run = next(iter(runs.values()))
    src = cfg.train_source or cfg.grid.text_source
    sets = list(any_run["perplexity"])
    lines = [f"# Fine-tuning after pruning: {cfg.model}, {int(100 * cfg.ratio)}% depth pruning", "",
             f"Every run: {cfg.steps} steps × {cfg.batch_size} windows × {cfg.seq_len} tokens of "
             f"{TEXT_LABELS.get(src) or Path(src).name} (calibration split, seed 1), the same order (seed {cfg.seed}); LoRA r={cfg.lora_r} (α {cfg.lora_alpha}) on attention + MLP at "
             f"lr {cfg.lr:g}, partial-layer FT at lr {cfg.lr / 10:g} on the block after each pruning site, a trained "
             f"LRA at lr {cfg.lra_lr:g}; warm-up then cosine. Zero-shot avg on the results tables' "
             f"{cfg.grid.docs} seeded docs per task (7 tasks); **Robust**: the share of the original's above-chance accuracy "
             "kept (as in results/paper, 95% bootstrap interval over docs); PPL on the same windows as results/paper; "
             "KL(original ‖ model) on the paper grid's closeness sets (wiki / LAMBADA / tasks' prompts; – : a run "
             "made before closeness was measured).",
             "",
             _commands(runs), "",
             "| criterion | run | trainable params | Avg | Robust | " + " | ".join(f"{set_label(p)} PPL" for p in sets)
             + " | KL wiki / LAMBADA / tasks |", "|---|---|---:|---:|---:|" + "---:|" * len(sets) + "---:|"]
    for crit in cfg.criteria:
        for v, what in (("pruned", "pruned"), (repair, f"pruned + {'LRA' if repair == 'lra' else repair}")):
            r = ref.get((crit, v))
            if r:
                label = f"{what} (no training; {home[(crit, v)]})"
                lines.append(f"| {crit} | {label} | 0 | {100 * r['average']:.2f} | "
                             f"{_robust_cell(robust.get(f'paper:{crit}/{v}'))} | "
                             + " | ".join(fmt_ppl(r["perplexity"][p]["ppl"]) for p in sets) + f" | {_kl_cell(r)} |")
        for name in cfg.runs:
            d = runs.get((crit, name))
            if d is None:
                lines.append(f"| {crit} | {labels[name]} | … | … | … | " + " | ".join("…" for _ in sets) + " | … |")
                continue
            lines.append(f"| {crit} | {d['label']} | {d['trainable_params']:,} | {100 * d['average']:.2f} | "
                         f"{_robust_cell(robust.get(f'{crit}/{name}'))} | "
                         + " | ".join(fmt_ppl(d["perplexity"][p]["ppl"]) for p in sets) + f" | {_kl_cell(d)} |")
    write_text_atomic(out / "recovery.md", "\n".join(lines) + "\n")
    try:
        plot_curves(out, cfg, labels)
    except ImportError:
        log.warning("matplotlib not installed: no curves plot")


def _commands(runs: dict) -> str:
    """The commands that made the runs on disk (one per process when the runs were split with ``--runs``)."""
    cmds = list(dict.fromkeys(d["command"] for d in runs.values()))
    if len(cmds) == 1:
        return f"Command: `{cmds[0]}`"
    return "Commands (one process each):\n\n" + "\n".join(f"- `{c}`" for c in cmds)


def _robust(paper: Path, runs: dict, ref: dict) -> dict[str, dict]:
    """Robust summary (share of the original's above-chance accuracy kept, with a 95% bootstrap
    interval) of every run, against the paper grid's original model scored on the same docs."""
    from shift_lightning.evaluation.summary import Bootstrap

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


read_curves = read_scalars  # the recovery tables' curves: the run's TensorBoard scalars


def plot_curves(out: Path, cfg, labels: dict[str, str]) -> None:
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
                                    label=labels[name])
        axes[0][j].set_title(f"{crit}: zero-shot avg (%, {cfg.curve_docs} docs/task)")
        axes[1][j].set_title(f"{crit}: held-out val PPL")
        axes[1][j].set_yscale("log")
        axes[1][j].set_xlabel("step")
        if axes[0][j].get_legend_handles_labels()[0]:
            axes[0][j].legend(fontsize=8)
    fig.tight_layout()
    write_file_atomic(out / "curves.png", lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)
