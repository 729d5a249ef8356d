"""Closeness to the original across the paper grids: the README's closeness table and the targets.

    python -m experiments.closeness_table          # -> results/fidelity.{md,json}
    python -m experiments.closeness_table --repair lra_span --out results/fidelity_lra_span

Reads the run files of the wiki-calibrated grid (``results/paper``) and of the mixed-calibrated grid
(``results/paper_mixed``) of every model and writes, per model, one row per criterion: KL(original ‖
model) on every closeness set for pruning alone and for each repair, then per calibration text the
three questions a user of a pruning method asks of the repair (``--repair``, the LRA by default):

* **closer**: is it closer to the original than pruning (lower KL on every set)?
* **no harm**: is it never significantly below pruning on Avg or Robust (paired 95 % bootstrap)? Where it
  is, the task that falls most is named with the original's accuracy beside it (a fall towards the
  original undoes an accidental gain of pruning).
* **vs ReplaceMe**: is it closer (every set) and more accurate (Robust) than the better ReplaceMe
  variant fitted on the same text (the one with the lower mean KL)?

and the best Robust of any criterion; then, where the do-no-harm guard (``guarded``) ran, whether it removes
the repair's significant falls below pruning. Every row is scored on the same docs, so one paired bootstrap
covers both grids. Rows that are missing show as ``…`` and are left out of the counts (the counts
say out of how many).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from shift_lightning.outputs import write_json_atomic, write_text_atomic
from experiments.harness import model_key
from experiments.tables.common import fmt_change, fmt_ci, fmt_diff, fmt_kl, lower_kl_everywhere, set_label
from experiments.tables.paper import GUARDS, REPLACEME, load_runs

log = logging.getLogger(__name__)

#: The table's columns: (grid, variant, header).
COLUMNS = (("wiki", "pruned", "pruned"), ("wiki", "lra", "+LRA"), ("wiki", "replaceme", "+ReplaceMe (LS)"),
           ("wiki", "replaceme_cosine", "+ReplaceMe (cosine)"), ("wiki", "guarded", "+guarded"),
           ("mixed", "lra", "+LRA, mixed calib."), ("mixed", "lra_span", "+LRA per span, mixed calib."),
           ("mixed", "lra_anchored", "+LRA per span, anchored, mixed calib."),
           ("mixed", "lra_auto", "+LRA, fit chosen on held-out KL, mixed calib."),
           ("mixed", "replaceme", "+ReplaceMe (LS), mixed calib."),
           ("mixed", "replaceme_cosine", "+ReplaceMe (cosine), mixed calib."), ("mixed", "guarded", "+guarded, mixed calib."),
           ("mixed", "guarded_span", "+guarded (span LRA), mixed calib."),
           ("mixed", "lra_replaceme", "+LRA & ReplaceMe (joint), mixed calib."),
           ("mixed", "lra_replaceme_anchored", "+LRA & ReplaceMe (joint), anchored, mixed calib."),
           ("mixed", "lra_replaceme_auto", "+LRA & ReplaceMe (joint), fit chosen on held-out KL, mixed calib."),
           ("mixed", "guarded_joint", "+guarded (joint), mixed calib."),
           ("mixed_refit", "lra_replaceme", "+LRA & ReplaceMe (joint) + kept-block re-fit, mixed calib."))


@dataclass
class ClosenessTableConfig:
    """The grids to read and the repair whose targets are counted."""

    models: list[str] = field(default_factory=lambda: ["smollm2-135m", "gemma3-270m"])
    grids: dict[str, str] = field(default_factory=lambda: {"wiki": "results/paper", "mixed": "results/paper_mixed",
                                                           "mixed_refit": "results/paper_mixed_refit"})
    """Calibration setting → paper-grid folder (the same docs, windows and settings otherwise); ``mixed_refit``:
    the mixed text with every map followed by the guarded kept-block re-fit (``reproduce --refit_kept``)."""
    peer_grids: dict[str, str] = field(default_factory=lambda: {"mixed_refit": "mixed"})
    """A grid whose ReplaceMe rows are another's (the re-fit grid runs only the repair; its maps and text are the
    mixed grid's)."""
    criteria: list[str] = field(default_factory=lambda: ["reverse_star", "angular", "taylor", "block_influence",
                                                         "reverse", "random", "magnitude_l1", "magnitude_l2", "ppl",
                                                         "linear_fit"])
    repair: str = "lra"
    """The repair whose targets are counted (the default solver)."""
    out: str = "results/fidelity"
    n_boot: int = 2000


def _against_pruned(boot, named: dict, name: str, pruned: str) -> dict:
    """Is ``name`` closer than pruning alone on every set, and never significantly below it on Avg or
    Robust (paired on the same docs)?"""
    vs_pruned = boot.difference(name, pruned)
    return {"closer": lower_kl_everywhere(named[name]["kl"], named[pruned]["kl"]),
            "vs_pruned": vs_pruned,
            "no_harm": vs_pruned["avg_diff_ci"][1] >= 0 and vs_pruned["robust_diff_ci"][1] >= 0}


def _guard_summary(boot, named: dict, guard: str, repair: str, pruned: str) -> dict:
    """The do-no-harm guard's row beside the repair's: what it chose per span and whether it avoids the
    repair's significant falls below pruning."""
    run = named[guard]
    return {"chosen": [site.get("guard", {}).get("chosen") for site in run.get("sites", [])], "kl": run["kl"],
            **_against_pruned(boot, named, guard, pruned), "vs_repair": boot.difference(guard, repair)}


def _guard_counts(gv: str, ts: dict, with_p: dict) -> dict:
    """Guard ``gv`` over the criteria of one text: where it ran, where it is significantly below
    pruning, and which of the repair's significant falls it removes."""
    ran = {c: t["guards"][gv] for c, t in ts.items() if gv in t.get("guards", {})}
    return {"of": len(ran), "harm": [c for c, gd in ran.items() if not gd["no_harm"]],
            "removes_harm": [c for c, t in with_p.items() if not t["no_harm"] and c in ran and ran[c]["no_harm"]],
            "where_harm": [c for c, t in with_p.items() if not t["no_harm"] and c in ran]}


def _mean_kl(run: dict) -> float:
    return sum(run["kl"].values()) / len(run["kl"])


def _largest_drop(run: dict, pruned: dict, original: dict) -> dict | None:
    """The task whose accuracy falls most from pruning alone to ``run``, with the original's accuracy beside
    it: a fall *towards* the original is the repair undoing an accidental gain of pruning, not new harm."""
    drops = [(run["tasks"][t]["value"] - pruned["tasks"][t]["value"], t) for t in run["tasks"] if t in pruned["tasks"]]
    if not drops:
        return None
    d, t = min(drops)
    if d >= 0:
        return None
    o = original["tasks"].get(t, {}).get("value")
    return {"task": t, "pruned": pruned["tasks"][t]["value"], "repaired": run["tasks"][t]["value"], "original": o,
            "avg_share": d / len(drops)}


def model_rows(cfg: ClosenessTableConfig, model: str) -> dict | None:
    """Rows and target counts for one model; ``None`` when the wiki grid has no original row."""
    from experiments.summary import Bootstrap

    key = model_key(model)
    grids = {g: load_runs(Path(folder) / key) for g, folder in cfg.grids.items()}
    ref = next(iter(grids))
    if (None, "original") not in grids[ref]:
        return None
    named = {"original": grids[ref][(None, "original")]}
    for g, runs in grids.items():
        for (crit, v), r in runs.items():
            if crit is not None and "closeness" in r:
                named[f"{g}:{crit}/{v}"] = r
    boot = Bootstrap(named, "original", n_boot=cfg.n_boot)

    def pruned_of(run: dict) -> str | None:
        """Pruning alone on the run's blocks, from whichever grid has it."""
        for g, runs in grids.items():
            for (crit, v), r in runs.items():
                if v == "pruned" and f"{g}:{crit}/{v}" in named and r["pruned_layers"] == run["pruned_layers"]:
                    return f"{g}:{crit}/{v}"
        return None

    rows = []
    for crit in cfg.criteria:
        row = {"criterion": crit, "cells": {}, "targets": {}}
        for g, v, _ in COLUMNS:
            r = named.get(f"{g}:{crit}/{v}")
            if r is not None:
                row["cells"][f"{g}:{v}"] = {"kl": r["kl"], "top1": r["top1"], "blocks": r["pruned_layers"],
                                            **boot.summary(f"{g}:{crit}/{v}")}
        for g in grids:
            name = f"{g}:{crit}/{cfg.repair}"
            if name not in named:
                continue
            run, p = named[name], pruned_of(named[name])
            t = {"kl": run["kl"], **boot.summary(name)}
            if p is not None:
                t["kl_pruned"] = named[p]["kl"]
                t.update(_against_pruned(boot, named, name, p))
                t["largest_task_drop"] = _largest_drop(run, named[p], named["original"])
                t["avg_towards_original"] = boot.towards(name, p)
            pg = cfg.peer_grids.get(g, g)
            peers = [f"{pg}:{crit}/{m}" for m in REPLACEME if f"{pg}:{crit}/{m}" in named]
            if peers:
                best = min(peers, key=lambda n: _mean_kl(named[n]))
                t["replaceme"] = {"variant": best.split("/")[-1], "kl": named[best]["kl"], **boot.summary(best),
                                  "diff": boot.difference(name, best)}
                t["kl_below_replaceme"] = lower_kl_everywhere(run["kl"], named[best]["kl"])
                t["robust_above_replaceme"] = t["robust"] > t["replaceme"]["robust"]
                t["robust_below_replaceme_significantly"] = t["replaceme"]["diff"]["robust_diff_ci"][1] < 0
            anywhere = [f"{h}:{crit}/{m}" for h in grids for m in REPLACEME if f"{h}:{crit}/{m}" in named]
            if anywhere:  # ReplaceMe at its strongest: its lowest KL on each set over both variants and texts
                t["replaceme_any_text"] = sorted(anywhere)
                t["kl_below_replaceme_any_text"] = all(run["kl"][s] < min(named[n]["kl"][s] for n in anywhere)
                                                       for s in run["kl"])
            for gv in GUARDS:
                guard = f"{g}:{crit}/{gv}"
                if p is not None and guard in named and gv != cfg.repair:
                    t.setdefault("guards", {})[gv] = _guard_summary(boot, named, guard, name, p)
            row["targets"][g] = t
        rows.append(row)
    targets = {}
    for g in grids:
        ts = {r["criterion"]: r["targets"][g] for r in rows if g in r["targets"]}
        with_p = {c: t for c, t in ts.items() if "closer" in t}
        with_rm = {c: t for c, t in ts.items() if "replaceme" in t}
        best = max(ts.items(), key=lambda ct: ct[1]["robust"], default=None)
        targets[g] = {
            "criteria": len(ts),
            "closer": [c for c, t in with_p.items() if t["closer"]], "closer_of": len(with_p),
            "harm": [c for c, t in with_p.items() if not t["no_harm"]], "harm_of": len(with_p),
            "best_robust": {"criterion": best[0], "robust": best[1]["robust"], "robust_ci": best[1]["robust_ci"]}
            if best else None,
            "kl_below_replaceme": [c for c, t in with_rm.items() if t["kl_below_replaceme"]],
            "robust_above_replaceme": [c for c, t in with_rm.items() if t["robust_above_replaceme"]],
            "robust_below_replaceme_significantly": [c for c, t in with_rm.items()
                                                     if t["robust_below_replaceme_significantly"]],
            "replaceme_of": len(with_rm),
            "kl_below_replaceme_any_text": [c for c, t in ts.items() if t.get("kl_below_replaceme_any_text")],
            "replaceme_any_text_of": sum("replaceme_any_text" in t for t in ts.values()),
            "guards": {gv: _guard_counts(gv, ts, with_p) for gv in GUARDS
                       if any(gv in t.get("guards", {}) for t in ts.values())}}
    sets = next((list(r["kl"]) for n, r in named.items() if n != "original"), [])
    return {"model": model, "sets": sets, "rows": rows, "targets": targets, "bootstrap": boot.meta()}


def _cell(row: dict, g: str, v: str, sets: list[str]) -> str:
    c = row["cells"].get(f"{g}:{v}")
    if c is None:
        return "…"
    txt = " / ".join(f"{c['kl'][s]:.2f}" if c["kl"][s] < 100 else fmt_kl(c["kl"][s]) for s in sets)
    p = row["cells"].get("wiki:pruned")
    if v != "pruned" and p is not None and p["blocks"] == c["blocks"] and all(c["kl"][s] < p["kl"][s] for s in sets):
        return f"**{txt}**"
    return txt


def _drop_note(d: dict | None) -> str:
    if not d:
        return ""
    o = f", original {100 * d['original']:.1f}" if d["original"] is not None else ""
    return (f"; largest fall {d['task']} {100 * d['pruned']:.1f} → {100 * d['repaired']:.1f}{o}: "
            f"{100 * d['avg_share']:+.1f} of Avg")


def _towards_note(x: dict | None) -> str:
    if not x:
        return ""
    return (f"; of Avg's {100 * x['avg_diff']:+.1f}, {100 * x['towards']:+.1f} is tasks moving back towards the "
            f"original's accuracy, {fmt_change(x['rest'], x['rest_ci'])} the rest")


def markdown(docs: list[dict], cfg: ClosenessTableConfig) -> str:
    lines = ["# Closeness to the original across the paper grids", "",
             "Cells: KL(original ‖ model) in nats per position on "
             + " / ".join(set_label(s) for s in docs[0]["sets"]) + " (held-out wiki-summaries windows, LAMBADA "
             "passages, the seven tasks' prompts). **Bold**: lower than pruning the same blocks on every set. "
             "`…`: run pending. Intervals, top-1 agreement and accuracy are in each grid's "
             "`results/paper*/<model>.md`.", "",
             f"Command: `python -m experiments.closeness_table` (grids: "
             + ", ".join(f"{g} = `{f}`" for g, f in cfg.grids.items()) + ")."]
    for doc in docs:
        sets = doc["sets"]
        lines += ["", f"## {doc['model']}", "",
                  "| criterion | " + " | ".join(h for _, _, h in COLUMNS) + f" | top-1 tasks pruned → {cfg.repair} |",
                  "|---|" + "---:|" * (len(COLUMNS) + 1)]
        for row in doc["rows"]:
            p = row["cells"].get("wiki:pruned")
            lra = next((row["cells"][f"{g}:{cfg.repair}"] for g in cfg.grids if f"{g}:{cfg.repair}" in row["cells"]), None)
            top1 = f"{100 * p['top1']['tasks']:.1f} → {100 * lra['top1']['tasks']:.1f}" if p and lra else "…"
            lines.append(f"| {row['criterion']} | " + " | ".join(_cell(row, g, v, sets) for g, v, _ in COLUMNS)
                         + f" | {top1} |")
        lines += ["", f"Targets for the repair `{cfg.repair}`, per calibration text:", ""]
        for g, t in doc["targets"].items():
            if not t["criteria"]:
                lines.append(f"- **{g}**: no `{cfg.repair}` runs of this model in `{cfg.grids[g]}`.")
                continue
            by = {r["criterion"]: r["targets"][g] for r in doc["rows"] if g in r["targets"]}
            harm = [f"{c}: Avg {fmt_diff(by[c]['vs_pruned'], 'avg')}, Robust {fmt_diff(by[c]['vs_pruned'], 'robust')}"
                    + _drop_note(by[c].get("largest_task_drop")) + _towards_note(by[c].get("avg_towards_original"))
                    for c in t["harm"]]
            b = t["best_robust"]
            lines.append(
                f"- **{g}** ({t['criteria']} of {len(cfg.criteria)} criteria run): closer than pruning on every set "
                f"under {len(t['closer'])} of {t['closer_of']}"
                + (f" (not: {', '.join(c for c in by if 'closer' in by[c] and not by[c]['closer'])})"
                   if len(t["closer"]) < t["closer_of"] else "")
                + f"; significantly below pruning on Avg or Robust under {len(t['harm'])} of {t['harm_of']}"
                + (f" ({'; '.join(harm)})" if harm else "")
                + f"; best Robust {fmt_ci(b['robust'], b['robust_ci'])} ({b['criterion']}); "
                + ("no ReplaceMe row fitted on the same text yet; " if not t["replaceme_of"] else
                   f"against the better ReplaceMe fitted on the same text: lower KL on every set under "
                   f"{len(t['kl_below_replaceme'])} of {t['replaceme_of']}, higher Robust under "
                   f"{len(t['robust_above_replaceme'])} of {t['replaceme_of']} "
                   f"(significantly lower under {len(t['robust_below_replaceme_significantly'])}"
                   + (f": {', '.join(t['robust_below_replaceme_significantly'])}"
                      if t["robust_below_replaceme_significantly"] else "") + "); ")
                + f"lower KL on every set than any ReplaceMe row (either variant, either text) under "
                f"{len(t['kl_below_replaceme_any_text'])} of {t['replaceme_any_text_of']}.")
        lines += _replaceme_table(doc, cfg)
        lines += _guard_table(doc, cfg)
    return "\n".join(lines) + "\n"


def _pct(v: float) -> str:
    return "–" if v != v else f"{100 * v:.1f}"


def _replaceme_table(doc: dict, cfg: ClosenessTableConfig) -> list[str]:
    """Per criterion and calibration text: the repair against the better ReplaceMe fitted on the same text,
    with the paired differences (repair − ReplaceMe) behind the target counts."""
    sets = doc["sets"]
    rows = [(r["criterion"], g, t) for g in cfg.grids for r in doc["rows"]
            for t in [r["targets"].get(g)] if t and "replaceme" in t]
    if not rows:
        return []
    kl = " / ".join(set_label(s) for s in sets)
    lines = ["", f"`{cfg.repair}` against the better ReplaceMe variant fitted on the same text (by mean KL), paired 95 % "
             "bootstrap over the same docs (↑ / ↓: the interval lies above / below 0):", "",
             f"| criterion | text | ReplaceMe variant | KL {kl}: ReplaceMe | KL: {cfg.repair} | Robust ReplaceMe | "
             f"Robust {cfg.repair} | Robust {cfg.repair} − ReplaceMe | Avg {cfg.repair} − ReplaceMe |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for crit, g, t in rows:
        rm = t["replaceme"]
        lines.append(f"| {crit} | {g} | {rm['variant']} | " + " / ".join(f"{rm['kl'][s]:.2f}" for s in sets)
                     + " | " + " / ".join(f"{t['kl'][s]:.2f}" for s in sets)
                     + f" | {_pct(rm['robust'])} | {_pct(t['robust'])} | {fmt_diff(rm['diff'], 'robust')}"
                     f" | {fmt_diff(rm['diff'], 'avg')} |")
    return lines


def _guard_table(doc: dict, cfg: ClosenessTableConfig) -> list[str]:
    """Per guard, criterion and calibration text where it ran: its choices per span, its KL beside the
    repair's, and its paired differences from pruning alone (does it remove the repair's falls?)."""
    sets = doc["sets"]
    kl = " / ".join(set_label(s) for s in sets)
    lines = []
    for gv in GUARDS:
        rows = [(r["criterion"], g, r["targets"][g]) for g in cfg.grids for r in doc["rows"]
                if gv in r["targets"].get(g, {}).get("guards", {})]
        if not rows:
            continue
        what = ("per span, the candidate whose pruned model is closest to the original on held-out calibration "
                "windows" + {"guarded_span": ", one LRA fitted to the whole span among the candidates",
                             "guarded_joint": ", one LRA fitted to the whole span and the joint LRA & ReplaceMe map "
                                              "among the candidates"}.get(gv, ""))
        lines += ["", f"The do-no-harm guard `{gv}` ({what}) against pruning alone, where it ran (paired 95 % "
                  "bootstrap; ↑ / ↓: the interval lies above / below 0):", ""]
        for g, t in doc["targets"].items():
            gc = t.get("guards", {}).get(gv)
            if not gc:
                continue
            where = gc["where_harm"]
            lines.append(f"- **{g}**: run under {gc['of']} of {len(cfg.criteria)} criteria; significantly below "
                         f"pruning on Avg or Robust under {len(gc['harm'])} of {gc['of']}"
                         + (f" ({', '.join(gc['harm'])})" if gc["harm"] else "")
                         + (f"; of the {len(where)} where `{cfg.repair}` is ({', '.join(where)}), it removes the fall "
                            f"under {len(gc['removes_harm'])}" if where else
                            f"; `{cfg.repair}` is significantly below pruning under none of these")
                         + ".")
        lines += ["", f"| criterion | text | chosen per span | KL {kl}: {gv} | KL: {cfg.repair} | "
                  f"Avg {gv} − pruned | Robust {gv} − pruned | Avg {gv} − {cfg.repair} |",
                  "|---|---|---|---:|---:|---:|---:|---:|"]
        for crit, g, t in rows:
            gd = t["guards"][gv]
            lines.append(f"| {crit} | {g} | {', '.join(str(c) for c in gd['chosen']) or '–'} | "
                         + " / ".join(f"{gd['kl'][s]:.2f}" for s in sets) + " | "
                         + " / ".join(f"{t['kl'][s]:.2f}" for s in sets)
                         + f" | {fmt_diff(gd['vs_pruned'], 'avg')} | {fmt_diff(gd['vs_pruned'], 'robust')}"
                         f" | {fmt_diff(gd['vs_repair'], 'avg')} |")
    return lines


def render(cfg: ClosenessTableConfig) -> Path:
    docs = [d for d in (model_rows(cfg, m) for m in cfg.models) if d is not None]
    if not docs:
        raise FileNotFoundError(f"No paper-grid runs under {list(cfg.grids.values())} for {cfg.models}: run "
                                "python -m experiments.reproduce --model … first")
    out = Path(cfg.out)
    write_json_atomic(out.with_suffix(".json"), {"repair": cfg.repair, "grids": cfg.grids, "models": docs})
    write_text_atomic(out.with_suffix(".md"), markdown(docs, cfg))
    return out


def main(argv: list[str] | None = None):
    from experiments.cli import dataclass_main

    def go(cfg: ClosenessTableConfig):
        out = render(cfg)
        print(f"Fidelity table in {out.with_suffix('.md')}")
        return out

    return dataclass_main(ClosenessTableConfig, go, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
