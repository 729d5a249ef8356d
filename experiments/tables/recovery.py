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
    """The run files in ``out`` (a start folder's table, ``<start>/recovery.json``, is not one)."""
    return {(d["criterion"], d["run"]): d for d in (json.loads(f.read_text()) for f in sorted(out.glob("*/*.json")))
            if "criterion" in d and "run" in d}


def _nested_runs(out: Path) -> dict[tuple[str, str, str], dict]:
    """The runs of the recovery tables in ``out``'s subfolders (one folder per starting repair), keyed
    ``(subfolder, criterion, run)``."""
    return {(f.parts[-3], d["criterion"], d["run"]): d for f, d in
            ((f, json.loads(f.read_text())) for f in sorted(out.glob("*/*/*.json")) if f.parts[-3] != "tb")
            if "criterion" in d and "run" in d}


def _kl_cell(run: dict) -> str:
    kl = run.get("kl")
    return " / ".join(fmt_kl(v) for v in kl.values()) if kl else "–"


#: Training text -> how the table's header names it.
TEXT_LABELS = {"wiki_summaries": "wiki-summaries", "mixed": "mixed-domain text (wiki-summaries, CoQA stories, QA pairs)"}


def render(out: Path, cfg, labels: dict[str, str]) -> None:
    """``recovery.{json,md}`` and ``curves.png`` from the runs on disk; ``cfg``: the table's config
    (model, criteria, runs, steps, …, and ``grid``, the paper grid's settings); ``labels``: run -> label."""
    runs = _runs_on_disk(out)
    nested = _nested_runs(out)
    if any("before" in d for d in (*runs.values(), *nested.values())):
        render_before_after(out, cfg, labels, {("", *k): d for k, d in runs.items()} | nested)
        return
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


#: The settings every row of a before/after table must share to be compared (run file key -> how the header says it).
SHARED = ("steps", "batch_size", "seq_len", "train_samples", "train_text", "seed", "loss", "lr", "lra_lr", "lora_r",
          "lora_alpha", "calib_text", "docs")


def _settings(d: dict) -> dict:
    """The training and evaluation settings of a run, from its file."""
    c, r = d["config"], d["recovery"]
    return {"steps": c["steps"], "batch_size": c["batch_size"], "seq_len": c["seq_len"],
            "train_samples": c["train_samples"], "train_text": c["train_source"] or c["grid"]["text_source"],
            "seed": r["seed"], "loss": r["loss"], "lr": r["lr"], "lra_lr": r["lra_lr"], "lora_r": r["lora_r"],
            "lora_alpha": r["lora_alpha"], "calib_text": c["grid"]["calib_source"] or c["grid"]["text_source"],
            "docs": c["grid"]["docs"]}


def _start(d: dict) -> str:
    """The model a run starts from: pruned, or the repair (and the kept-block re-fit) in place."""
    if not d.get("repair"):
        return "pruned"
    refit = d.get("refit")
    if not refit:
        return f"+{d['repair']}"
    kept = ", ".join(map(str, refit["kept"])) or "none"
    return f"+{d['repair']}, re-fit of {refit['k']} kept blocks (kept: {kept})"


def _training(d: dict) -> str:
    r = d["recovery"]
    what = {"lora": "LoRA", "partial": "partial-layer FT", "lra": "the maps"}[r["method"]]
    if r["train_lra"] and r["method"] != "lra":
        what += " + the maps"
    return f"{what}, {'distilled (KD)' if r['loss'] == 'kd' else 'NLL'}"


def _cells(kl: dict | None, top1: dict | None) -> tuple[str, str]:
    if not kl:
        return "–", "–"
    return (" / ".join(fmt_kl(v) for v in kl.values()),
            " / ".join(f"{100 * v:.1f}" for v in (top1 or {}).values()) or "–")


def render_before_after(out: Path, cfg, labels: dict[str, str], runs: dict[tuple[str, str, str], dict]) -> None:
    """``recovery.{json,md}`` of runs that carry their starting model's evaluation (``before``): per row, KL and
    top-1 agreement on the closeness sets, Avg and Robust before training and after. ``runs``: ``(subfolder,
    criterion, run)`` -> run file (subfolder ``""``: ``out``'s own runs); the header's settings come from the run
    files, and settings that differ between rows are named."""
    crits = list(dict.fromkeys([*cfg.criteria, *(k[1] for k in runs)]))
    order = {r: i for i, r in enumerate(labels)}
    keys = sorted(runs, key=lambda k: (crits.index(k[1]), k[0], order.get(k[2], len(order)), k[2]))
    robust = _robust_before_after(runs)
    rows = []
    for k in keys:
        d = runs[k]
        b = d.get("before") or {}
        rows.append({"folder": k[0], "criterion": k[1], "run": k[2], "label": d["label"], "start": _start(d),
                     "training": _training(d), "steps": d["steps"], "trainable_params": d["trainable_params"],
                     **({"refit": {x: d["refit"][x] for x in ("k", "tried", "kept")}} if d.get("refit") else {}),
                     **{when: {"avg": e.get("average"), **robust.get((k, when), {}), "kl": e.get("kl"),
                               "top1": e.get("top1"),
                               "ppl": {p: v["ppl"] for p, v in e.get("perplexity", {}).items()}}
                        for when, e in (("before", b), ("after", d))}})
    settings = [_settings(d) for d in runs.values()]
    shared = {s: settings[0][s] for s in SHARED if all(x[s] == settings[0][s] for x in settings)}
    differ = {s: sorted({str(x[s]) for x in settings}) for s in SHARED if s not in shared}
    any_run = next(iter(runs.values()))
    write_json_atomic(out / "recovery.json", {"rows": rows, "shared_settings": shared, "differing_settings": differ,
                                              "commands": list(dict.fromkeys(d["command"] for d in runs.values()))})

    def say(key, fmt=str):
        return fmt(shared[key]) if key in shared else f"({key}: differs, below)"

    def text(src):
        return TEXT_LABELS.get(src) or Path(str(src)).name

    sets = " / ".join(set_label(s) for s in (any_run.get("kl") or {})) or "–"
    lines = [f"# Before and after recovery: {any_run['model']}, {int(100 * any_run['config']['ratio'])}% depth pruning",
             "",
             "Each row starts from the model in **start** (pruned, or a repair in place, fitted as the paper grid fits "
             f"it, on {say('calib_text', text)} calibration text) and trains as **training** says, every row with the "
             f"same budget: {say('steps')} steps × {say('batch_size')} windows × {say('seq_len')} tokens of "
             f"{say('train_text', text)} (calibration split, {say('train_samples')} windows, seed 1), the same order "
             f"(seed {say('seed')}); LoRA r={say('lora_r')} (α {say('lora_alpha')}) on attention + MLP at lr "
             f"{say('lr', lambda v: format(v, 'g'))}, trained maps at lr {say('lra_lr', lambda v: format(v or 0, 'g'))}; "
             "warm-up then cosine. **Before**: the starting model, evaluated as the trained one is (the same docs, "
             "windows and closeness sets). KL(original ‖ model) in nats per position and top-1 agreement with the "
             f"original (%) on the paper grid's closeness sets, each cell {sets} (the held-out perplexity windows and "
             f"the tasks' prompts); zero-shot **Avg** on {say('docs')} seeded docs per task (7 tasks); **Robust**: the "
             "share of the original's above-chance accuracy kept (as in results/paper; 95% bootstrap interval over "
             "docs).", ""]
    if differ:
        lines += ["Settings that differ between rows: " + "; ".join(f"{s}: {', '.join(v)}" for s, v in differ.items()),
                  ""]
    lines += [_commands({k: runs[k] for k in keys}), "",
              "| criterion | start | training | trainable params | KL before | KL after | top-1 before | top-1 after "
              "| Avg before | Avg after | Robust before | Robust after |",
              "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for k, row in zip(keys, rows):
        d = runs[k]
        kb, tb = _cells(d.get("before", {}).get("kl"), d.get("before", {}).get("top1"))
        ka, ta = _cells(d.get("kl"), d.get("top1"))
        avg_b = row["before"]["avg"]
        lines.append(f"| {k[1]} | {row['start']} | {row['training']} | {d['trainable_params']:,} | {kb} | {ka} | {tb} | "
                     f"{ta} | {'–' if avg_b is None else f'{100 * avg_b:.2f}'} | {100 * d['average']:.2f} | "
                     f"{_robust_cell(robust.get((k, 'before')))} | {_robust_cell(robust.get((k, 'after')))} |")
    write_text_atomic(out / "recovery.md", "\n".join(lines) + "\n")
    if (out / "tb").exists():
        try:
            plot_curves(out, cfg, labels)
        except ImportError:
            log.warning("matplotlib not installed: no curves plot")


def _robust_before_after(runs: dict) -> dict:
    """``(key, "before" | "after")`` -> Robust with its 95% interval, against the original of each run's paper grid
    (scored on the same docs)."""
    from experiments.summary import Bootstrap

    groups: dict[Path, dict] = {}
    for k, d in runs.items():
        orig = Path(d["config"]["grid"]["out"]) / Path(d["model"]).name / "original.json"
        groups.setdefault(orig, {})[k] = d
    out = {}
    for orig, members in groups.items():
        if not orig.exists():
            continue
        named, keys = {"original": json.loads(orig.read_text())}, {}
        for k, d in members.items():
            for when, doc in (("after", d), ("before", d.get("before"))):
                if doc:
                    keys[f"{'/'.join(k)}:{when}"] = (k, when)
                    named[f"{'/'.join(k)}:{when}"] = doc
        boot = Bootstrap(named, "original")
        for name, key in keys.items():
            summ = boot.summary(name)
            out[key] = {"robust": summ["robust"], "robust_ci": summ["robust_ci"]}
    return out


def _commands(runs: dict) -> str:
    """The commands that made the runs on disk (one per process when the runs were split with ``--runs``)."""
    cmds = list(dict.fromkeys(d["command"] for d in runs.values()))
    if len(cmds) == 1:
        return f"Command: `{cmds[0]}`"
    return "Commands (one process each):\n\n" + "\n".join(f"- `{c}`" for c in cmds)


def _robust(paper: Path, runs: dict, ref: dict) -> dict[str, dict]:
    """Robust summary (share of the original's above-chance accuracy kept, with a 95% bootstrap
    interval) of every run, against the paper grid's original model scored on the same docs."""
    from experiments.summary import Bootstrap

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
