"""The paper grid's tables (``results/paper/<model>.{md,json,png}``), rendered from its run files.

Rows: every criterion × variant (pruned, the LRA, the peers' maps, the guards) plus the original.
Accuracy: per task, Avg and Robust with paired bootstrap intervals over docs. Closeness to the
original: mean next-token KL and top-1 agreement on held-out wiki-summaries, LAMBADA passages and
the tasks' prompts, with bootstrap intervals over windows / docs.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
from pathlib import Path

from experiments.harness import read_run
from experiments.variants import LABELS as VARIANT_LABELS, solver_of
from shift_lightning.outputs import write_file_atomic, write_json_atomic, write_text_atomic
from experiments.tables.common import TASK_LABELS, blocks_label, fmt_ci, fmt_diff, fmt_kl, fmt_ppl, set_label

log = logging.getLogger(__name__)

LABELS = {"original": "original", "pruned": "pruned", **VARIANT_LABELS}
#: The KL guard's variants (they choose a map per span).
GUARDS = tuple(n for n in VARIANT_LABELS if solver_of(n) == "guarded")
#: Peers of the LRA in the comparisons (and the two ReplaceMe variants, whose better one is "ReplaceMe").
PEERS = ("lra_span", "lra_anchored", "lra_auto", "lra_replaceme", "lra_replaceme_anchored", "lra_replaceme_auto",
         "nobias", "affine", "replaceme", "replaceme_cosine", "linearpatch", "lra_guard", "guarded", "guarded_span",
         "guarded_joint", "stock")
REPLACEME = ("replaceme", "replaceme_cosine")


#: How the table names a calibration text (``--calib_source``).
CALIB_TEXTS = {"wiki_summaries": "wiki-summaries",
               "mixed": "the mixed corpus: wiki-summaries with CoQA stories and SciQ, Social IQa, CommonsenseQA "
                        "question-answer text, none of them evaluated"}


def load_runs(folder: Path) -> dict[tuple, dict]:
    """``(criterion, variant) -> run`` (the original as ``(None, "original")``)."""
    runs = {}
    if (folder / "original.json").exists():
        runs[(None, "original")] = read_run(folder / "original.json")
    for f in sorted(folder.glob("*/*.json")):
        if f.name == "selection.json":
            continue
        d = read_run(f)
        runs[(d["criterion"], d["variant"])] = d
    return runs


def table_rows(folder: Path, n_boot: int = 2000, runs: dict[tuple, dict] | None = None) -> tuple[list[dict], dict]:
    """The table as data: one row per finished run, with avg, robust, closeness and their intervals.

    ``runs``: :func:`load_runs` of ``folder`` when the caller already has it (each file is read once).
    """
    from experiments.summary import Bootstrap

    runs = load_runs(folder) if runs is None else runs
    if (None, "original") not in runs:
        return [], {}
    named = {f"{c}/{v}": r for (c, v), r in runs.items()}
    boot = Bootstrap(named, "None/original", n_boot=n_boot)
    rows = []
    for (c, v), r in runs.items():
        s = boot.summary(f"{c}/{v}")
        row = {"criterion": c if c is not None else "none", "variant": v, "pruned_layers": r["pruned_layers"],
               "tasks": {t: e["value"] for t, e in r["tasks"].items()}, "avg": r["average"],
               "avg_ci": s["avg_ci"], "robust": s["robust"], "robust_ci": s["robust_ci"],
               "ppl": {p: e["ppl"] for p, e in r["perplexity"].items()}, "params": r["params"],
               "device": r.get("software", {}).get("device", "cpu")}
        if "closeness" in r:
            row["kl"] = {k: e["kl"] for k, e in r["closeness"].items()}
            row["kl_ci"] = {k: e.get("kl_ci") for k, e in r["closeness"].items()}
            row["top1"] = {k: e["top1"] for k, e in r["closeness"].items()}
            row["top1_ci"] = {k: e.get("top1_ci") for k, e in r["closeness"].items()}
        if v not in ("original", "pruned") and (c, "pruned") in runs:
            row["vs_pruned"] = boot.difference(f"{c}/{v}", f"{c}/pruned")
        if v != "lra" and v not in ("original", "pruned") and (c, "lra") in runs:
            row["lra_minus_this"] = boot.difference(f"{c}/lra", f"{c}/{v}")
        if "sites" in r:
            row["sites"] = r["sites"]
        rows.append(row)
    return rows, boot.meta()


#: The settings that decide what a row is scored on (docs, perplexity and closeness windows).
_SCORED_ON = ("docs", "sample_seed", "ppl_sets", "ppl_windows", "seq_len", "kl", "kl_docs", "kl_topk")


def borrow_pruned(runs: dict[tuple, dict], source: Path) -> list[str]:
    """Pruning alone does not depend on the calibration text, so a grid fitted on another text (which
    runs no ``pruned`` rows of its own) takes them from ``source``, the same model's grid, wherever that
    grid scored the same docs and pruned the same blocks. Adds them to ``runs`` in place; returns the
    criteria whose rows it took."""
    mine, theirs = runs.get((None, "original")), load_runs(source) if source.is_dir() else {}
    other = theirs.get((None, "original"))
    if mine is None or other is None or mine["eval"] != other["eval"] or \
            any(t.get("sampling") != other["tasks"].get(n, {}).get("sampling") for n, t in mine["tasks"].items()) or \
            any(mine["config"].get(k) != other["config"].get(k) for k in _SCORED_ON):
        return []
    taken = []
    for (crit, v), r in list(runs.items()):
        p = theirs.get((crit, "pruned"))
        if crit is None or (crit, "pruned") in runs or p is None or p["pruned_layers"] != r["pruned_layers"]:
            continue
        runs[(crit, "pruned")] = p
        taken.append(crit)
    return taken


def _calib_text(cfg: dict) -> str:
    """The text a run's maps were fitted on (runs made before ``calib_source`` existed: the grid's text)."""
    return cfg.get("calib_source") or cfg.get("text_source") or "wiki_summaries"


def render(folder: Path, criteria: list[str], variants: list[str], ratio: float, n_boot: int = 2000,
           pruned_from: Path | None = None) -> None:
    """``<model>.json``, ``<model>.md`` and the PNG plot from the runs on disk; ``pruned_from``: the grid
    whose pruned rows this one shows where it has none (:func:`borrow_pruned`)."""
    runs = load_runs(folder)
    borrowed = borrow_pruned(runs, pruned_from) if pruned_from is not None and pruned_from.resolve() != folder.resolve() else []
    borrowed.sort(key=lambda c: criteria.index(c) if c in criteria else len(criteria))
    rows, meta = table_rows(folder, n_boot, runs)
    if not rows:
        return
    orig = runs[(None, "original")]
    made = {k: r for k, r in runs.items() if k != (None, "original")}
    info = {"model": orig["model"], "layers": orig["layers"], "config": orig["config"], "eval": orig["eval"],
            "command": orig["command"], "software": orig["software"], "bootstrap": meta,
            "pending": [f"{c}/{v}" for c in criteria for v in variants if (c, v) not in made],
            "closeness_pending": [f"{c}/{v}" for c in criteria for v in variants
                                  if (c, v) in made and "closeness" not in made[(c, v)]],
            "selections": {c: sorted(json.loads((folder / c / "selection.json").read_text())["layers"])
                           for c in criteria if (folder / c / "selection.json").exists()},
            "calib_text": sorted({_calib_text(r["config"]) for k, r in made.items() if k[1] != "pruned"}),
            "pruned_from": {"grid": os.path.relpath(pruned_from), "criteria": borrowed} if borrowed else None}
    refitted = {k: r for k, r in made.items() if "refit" in r}
    one = len({v for _, v in refitted}) == 1  # named by criterion alone when the grid re-fits one variant
    refit = {c if one else f"{c}/{v}": {k: r["refit"][k] for k in ("k", "damping", "tried", "kept")}
             for (c, v), r in refitted.items()}
    if refit:  # a re-fit grid (reproduce --refit_kept)
        info["refit"] = refit
    # The grid's own command is the original's; a grid whose maps were fitted on another text names it.
    if info["calib_text"] and info["calib_text"] != [_calib_text(orig["config"])] and info["command"]:
        info["command"] += f" --calib_source {','.join(info['calib_text'])} --out {os.path.relpath(folder.parent)}"
    if refit and info["command"]:  # the variants it re-fitted: the default ones would re-fit all nine
        first = next(iter(info["refit"].values()))
        fitted = sorted({v for _, v in refitted}, key=lambda v: (variants.index(v) if v in variants else len(variants), v))
        info["command"] += (f" --variants {shlex.quote(json.dumps(fitted))} --refit_kept {first['k']}"
                            f" --refit_damping {first['damping']:g}")
    write_json_atomic(folder.with_suffix(".json"), {"info": info, "rows": rows})
    write_text_atomic(folder.with_suffix(".md"), markdown(rows, info, criteria, variants))
    try:
        plot(rows, folder, criteria, variants, ratio)
    except ImportError:  # matplotlib is optional
        log.warning("matplotlib not installed: no plots (pip install matplotlib)")


def markdown(rows: list[dict], info: dict, criteria: list[str], variants: list[str]) -> str:
    by = {(r["criterion"], r["variant"]): r for r in rows}
    orig = by[("none", "original")]
    tasks = list(orig["tasks"])
    c = info["config"]
    ppl_sets = list(orig["ppl"])
    lines = [f"# {info['model']}: {int(100 * c['ratio'])}% depth pruning, every criterion × correction", "",
             f"Zero-shot on {c['docs']} seeded docs per task (seed {c['sample_seed']}, the same docs for every row; "
             "lm-eval-harness prompts and scoring; acc for ARC-e, PIQA, WinoGrande, BoolQ, acc_norm for ARC-c, "
             "HellaSwag, OBQA). **Avg** is the paper's seven-task mean; **Robust** is the share of the original "
             "model's above-chance accuracy kept, averaged over the tasks where the original is clearly above "
             f"chance ({', '.join(TASK_LABELS.get(t, t) for t in info['bootstrap']['eligible_tasks'])}); 95% "
             f"paired bootstrap intervals over docs ({info['bootstrap']['n_boot']} resamples). PPL: "
             f"{c['ppl_windows']} × {c['seq_len']}-token windows of held-out wiki-summaries and of LAMBADA passages. "
             f"Maps fitted on {c['calib_samples']} × {c['seq_len']} calibration tokens ("
             + ", ".join(CALIB_TEXTS.get(t, t) for t in info.get("calib_text") or ["wiki_summaries"]) + "), relative "
             f"damping {c['damping']:g}; data-driven criteria scored on {c['select_samples']} × {c['select_seq_len']} "
             "tokens (linear_fit: on the calibration windows, every 4th judging). **Gain** = +LRA − pruned (Avg "
             "points). `…` = run still pending.", "",
             f"Command: `{info.get('command') or 'make reproduce MODEL=' + info['model']}`", "",
             "| criterion | variant | removed | " + " | ".join(TASK_LABELS.get(t, t) for t in tasks)
             + " | Avg | Robust | Gain | " + " | ".join(f"{set_label(p)} PPL" for p in ppl_sets) + " |",
             "|---|---|---|" + "---:|" * len(tasks) + "---:|---:|---:|---:|---:|"]

    def cells(r):
        return [f"{100 * r['tasks'][t]:.1f}" for t in tasks] + [fmt_ci(r["avg"], r["avg_ci"]),
                                                                 fmt_ci(r["robust"], r["robust_ci"])]

    lines.append("| – | original | – | " + " | ".join(cells(orig)) + " | | "
                 + " | ".join(f"{orig['ppl'][p]:.2f}" for p in ppl_sets) + " |")
    for crit in criteria:
        layers = next((r["pruned_layers"] for (cc, _), r in by.items() if cc == crit), None) or\
            info.get("selections", {}).get(crit)
        for v in variants:
            r = by.get((crit, v))
            if r is None:
                lines.append(f"| {crit} | {LABELS[v]} | {blocks_label(layers)} | "
                             + " | ".join(["…"] * (len(tasks) + 3 + len(ppl_sets))) + " |")
                continue
            gain = ""
            if v == "lra" and (crit, "pruned") in by:
                d = r["vs_pruned"]
                gain = f"{100 * d['avg_diff']:+.1f} [{100 * d['avg_diff_ci'][0]:+.1f}, {100 * d['avg_diff_ci'][1]:+.1f}]"
            lines.append(f"| {crit} | {LABELS[v]} | {blocks_label(layers)} | " + " | ".join(cells(r)) + f" | {gain} | "
                         + " | ".join(fmt_ppl(r["ppl"][p]) for p in ppl_sets) + " |")
    if info.get("refit"):
        lines += ["", "Every map is followed by the guarded kept-block re-fit (`--refit_kept`: the first k kept blocks "
                  "after each span re-fitted in closed form, each kept only if closer to the original on every "
                  f"{c.get('heldout_every', 4)}th calibration window; `shift_lightning/maps/keptfit.py`). Kept of tried: "
                  + "; ".join(f"{crit} {', '.join(map(str, x['kept'])) or 'none'} of {', '.join(map(str, x['tried']))}"
                              f" (k = {x['k']}, δ = {x['damping']:g})" for crit, x in info["refit"].items()) + "."]
    if info.get("pruned_from"):
        lines += ["", f"Pruned rows ({', '.join(info['pruned_from']['criteria'])}): from `{info['pruned_from']['grid']}/`"
                  " (pruning alone does not depend on the calibration text; the same docs and blocks)."]
    if info["pending"]:
        lines += ["", f"Pending: {len(info['pending'])} runs ({', '.join(info['pending'])})."]
    lines += ["", *closeness_table(rows, info, criteria, variants)]
    lines += ["", *summary(rows, criteria, variants)]
    lines += ["", *closeness_summary(rows, criteria, variants)]
    devices: dict[str, int] = {}
    for r in rows:
        devices[r["device"]] = devices.get(r["device"], 0) + 1
    lines += ["", "Runs per device (the same numbers either way: see `results/device_check/`): "
              + "; ".join(f"{n} on {d}" for d, n in devices.items()) + f". Software of the original row: "
              f"{info['software']}."]
    return "\n".join(lines) + "\n"


def _closeness_sets(rows: list[dict]) -> list[str]:
    for r in rows:
        if "kl" in r:
            return list(r["kl"])
    return []


def closeness_table(rows: list[dict], info: dict, criteria: list[str], variants: list[str]) -> list[str]:
    """Criterion × variant: KL(original ‖ model) and top-1 agreement on every closeness set."""
    sets = _closeness_sets(rows)
    if not sets:
        return []
    by = {(r["criterion"], r["variant"]): r for r in rows}
    eval_settings = info.get("eval", {})
    lines = ["## Closeness to the original", "",
             "Mean next-token **KL(original ‖ model)** in nats per position (lower is closer) and **top-1** agreement "
             "with the original's most likely next token (%), on the held-out wiki-summaries and LAMBADA windows "
             f"(the perplexity windows) and on the tasks' prompts (the contexts the scorer runs, first "
             f"{eval_settings.get('kl_docs', 50)} docs of each task's sample, no answers); the original's top-"
             f"{eval_settings.get('kl_topk', 64)} probabilities per position plus one bucket for the rest "
             "(`experiments/checks/fidelity_topk.py` measures that approximation). Brackets: 95% bootstrap intervals over "
             "windows / docs. `…` = not measured yet.", "",
             "| criterion | variant | " + " | ".join(f"KL {set_label(s)}" for s in sets) + " | "
             + " | ".join(f"top-1 {set_label(s)}" for s in sets) + " |",
             "|---|---|" + "---:|" * (2 * len(sets))]
    for crit in criteria:
        for v in variants:
            r = by.get((crit, v))
            if r is None:
                continue
            if "kl" not in r:
                lines.append(f"| {crit} | {LABELS[v]} | " + " | ".join(["…"] * (2 * len(sets))) + " |")
                continue
            kl = [f"{fmt_kl(r['kl'][s])} [{fmt_kl(r['kl_ci'][s][0])}, {fmt_kl(r['kl_ci'][s][1])}]" for s in sets]
            t1 = [f"{100 * r['top1'][s]:.1f}" for s in sets]
            lines.append(f"| {crit} | {LABELS[v]} | " + " | ".join(kl + t1) + " |")
    return lines


def summary(rows: list[dict], criteria: list[str], variants: list[str]) -> list[str]:
    """Per criterion: what the LRA gains over pruning (Avg, Robust, PPL) and how it compares with each
    peer map, then the counts over criteria. ↑/↓: the 95% interval lies above/below zero."""
    by = {(r["criterion"], r["variant"]): r for r in rows}
    peers = [v for v in PEERS if v in variants]
    ppl_sets = list(by[("none", "original")]["ppl"])
    head = ("| criterion | Gain Avg | Gain Robust | " + " | ".join(f"{set_label(p)} PPL pruned → +LRA" for p in ppl_sets)
            + "".join(f" | LRA − {LABELS[v].lstrip('+')} (Avg)" for v in peers) + " |")
    lines = ["## Summary: +LRA against pruning and against the peer maps", "",
             "Differences in points with 95% paired bootstrap intervals; ↑ / ↓: the interval lies above / below 0.", "",
             head, "|---|---:|---:|" + "---:|" * len(ppl_sets) + "---:|" * len(peers)]
    count = {"avg": [0, 0, 0], "robust": [0, 0, 0], **{p: [0, 0] for p in ppl_sets}}
    n = 0
    for crit in criteria:
        lra, pr = by.get((crit, "lra")), by.get((crit, "pruned"))
        if lra is None or pr is None:
            continue
        n += 1
        d = lra["vs_pruned"]
        for k in ("avg", "robust"):
            count[k][0] += d[f"{k}_diff"] > 0
            count[k][1] += d[f"{k}_diff_ci"][0] > 0
            count[k][2] += d[f"{k}_diff_ci"][1] < 0
        for p in ppl_sets:
            count[p][0] += lra["ppl"][p] < pr["ppl"][p]
        cells = [fmt_diff(d, "avg"), fmt_diff(d, "robust")] + [f"{fmt_ppl(pr['ppl'][p])} → {fmt_ppl(lra['ppl'][p])}"
                                                               for p in ppl_sets]
        cells += [fmt_diff(by[(crit, v)]["lra_minus_this"], "avg") if (crit, v) in by else "…" for v in peers]
        lines.append(f"| {crit} | " + " | ".join(cells) + " |")
    if n:
        lines += ["", f"Over {n} criteria with both runs: +LRA beats pruned on Avg in {count['avg'][0]} "
                  f"(interval above 0 in {count['avg'][1]}, below 0 in {count['avg'][2]}), on Robust in "
                  f"{count['robust'][0]} (above {count['robust'][1]}, below {count['robust'][2]}), "
                  + ", ".join(f"on {set_label(p)} PPL in {count[p][0]}" for p in ppl_sets) + "."]
    return lines


def closeness_summary(rows: list[dict], criteria: list[str], variants: list[str]) -> list[str]:
    """Per repair: under how many criteria it is closer to the original than pruning on every set, never
    significantly below pruning in accuracy, and ahead of the better ReplaceMe variant."""
    sets = _closeness_sets(rows)
    if not sets:
        return []
    by = {(r["criterion"], r["variant"]): r for r in rows}
    repairs = [v for v in ("lra", "lra_span", "lra_anchored", "lra_auto", "lra_replaceme", "lra_replaceme_anchored",
                           "lra_replaceme_auto", "guarded", "guarded_span",
                           "guarded_joint", "nobias",
                           "lra_guard", "replaceme", "replaceme_cosine", "linearpatch", "affine", "stock") if v in variants]
    lines = ["## Closeness and harm, per repair", "",
             "Per repair, over the criteria where both rows have closeness numbers: **closer** = lower KL than "
             "pruning on every set; **no harm** = the Avg and Robust differences to pruning are not significantly "
             "negative (95% interval); **vs ReplaceMe** = lower KL on every set / higher Robust than the better of "
             "the two ReplaceMe variants (the one with the lower mean KL).", "",
             "| repair | criteria | closer on every set | no harm (Avg, Robust) | KL below best ReplaceMe | "
             "Robust above best ReplaceMe |", "|---|---:|---:|---:|---:|---:|"]
    for v in repairs:
        n = closer = harmless = kl_win = rob_win = n_rm = 0
        for crit in criteria:
            r, p = by.get((crit, v)), by.get((crit, "pruned"))
            if r is None or p is None or "kl" not in r or "kl" not in p:
                continue
            n += 1
            closer += all(r["kl"][s] < p["kl"][s] for s in sets)
            d = r.get("vs_pruned")
            harmless += d is not None and d["avg_diff_ci"][1] >= 0 and d["robust_diff_ci"][1] >= 0
            rms = [by[(crit, m)] for m in REPLACEME if (crit, m) in by and "kl" in by[(crit, m)] and m != v]
            if rms and v not in REPLACEME:
                best = min(rms, key=lambda x: sum(x["kl"].values()))
                n_rm += 1
                kl_win += all(r["kl"][s] < best["kl"][s] for s in sets)
                rob_win += r["robust"] > best["robust"]
        if n:
            lines.append(f"| {LABELS[v]} | {n} | {closer} | {harmless} | "
                         + (f"{kl_win} of {n_rm} | {rob_win} of {n_rm}" if n_rm else "– | –") + " |")
    return lines


def plot(rows: list[dict], folder: Path, criteria: list[str], variants: list[str], ratio: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    by = {(r["criterion"], r["variant"]): r for r in rows}
    crits = [c for c in criteria if any((c, v) in by for v in variants)]
    if not crits:
        return
    orig = by[("none", "original")]
    first_ppl = next(iter(orig["ppl"]))
    sets = _closeness_sets(rows)
    panels = [("avg", "Avg zero-shot accuracy (%)"), ("robust", "Robust: above-chance accuracy kept (%)"),
              ("ppl", "held-out PPL (log scale)")] + ([("kl", f"KL to the original, {set_label(sets[-1])} (log)")]
                                                      if sets else [])
    x = np.arange(len(crits))
    w = 0.8 / len(variants)
    fig, axes = plt.subplots(1, len(panels), figsize=(6 * len(panels), 4.8))
    for k, (ax, (key, title)) in enumerate(zip(axes, panels)):
        for j, v in enumerate(variants):
            vals, lo, hi = [], [], []
            for c in crits:
                r = by.get((c, v))
                if r is None or (key == "kl" and "kl" not in r):
                    vals.append(np.nan), lo.append(0), hi.append(0)
                    continue
                if key == "ppl":
                    vals.append(r["ppl"][first_ppl]), lo.append(0), hi.append(0)
                elif key == "kl":
                    val, ci = r["kl"][sets[-1]], r["kl_ci"][sets[-1]]
                    vals.append(val), lo.append(max(val - ci[0], 0)), hi.append(max(ci[1] - val, 0))
                else:
                    val, ci = 100 * r[key], [100 * t for t in r[f"{key}_ci"]]
                    vals.append(val), lo.append(max(val - ci[0], 0)), hi.append(max(ci[1] - val, 0))
            err = None if key == "ppl" else np.array([lo, hi])
            ax.bar(x + (j - (len(variants) - 1) / 2) * w, vals, w, yerr=err, capsize=2, label=LABELS[v])
        if key != "kl":
            ref = orig["ppl"][first_ppl] if key == "ppl" else 100 * orig[key]
            ax.axhline(ref, color="k", ls="--", lw=1, label="original")
        if key in ("ppl", "kl"):
            ax.set_yscale("log")
        ax.set_xticks(x, crits, rotation=30, ha="right")
        ax.set_title(title)
        if k == 0:
            ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{orig.get('model', folder.name)}: {int(100 * ratio)}% depth pruning "
                 f"({folder.name}; bars: 95% bootstrap intervals)")
    fig.tight_layout()
    write_file_atomic(folder.with_name(folder.name + ".png"), lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)
