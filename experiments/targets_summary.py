"""The issue's targets for several repairs side by side, read from the closeness tables' JSON.

    python -m experiments.targets_summary        # -> results/targets.{md,json}

Each closeness table (``python -m experiments.closeness_table [--repair …]``) counts, for one
repair and per model and calibration text, how many criteria meet each target. This puts those counts
in one table, one line per model and repair, with each target marked **met**, **not met**, or **open**
(criteria still missing could still change it), so that which repair reaches which target, on which
model, is one look rather than four files:

* **closer**: lower KL than pruning on every held-out set, under every criterion;
* **no harm**: never significantly below pruning on Avg or Robust (paired 95 % bootstrap);
* **Robust**: the best criterion keeps at least ``robust_goal`` of the original's above-chance accuracy;
* **KL vs ReplaceMe**: lower KL on every set than the better ReplaceMe fitted on the same text, under
  every criterion;
* **Robust vs ReplaceMe**: higher Robust than that ReplaceMe under at least ``robust_above`` criteria.

Beside the targets, for every repair but the ``default``: under how many of the criteria where both
have run it is closer than the default repair (lower KL on every held-out set), the first clause of the
README's switch rules for a new default.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from shift_lightning.outputs import write_json_atomic, write_text_atomic
from experiments.tables.common import fmt_change, fmt_ci, fmt_diff, lower_kl_everywhere

MET, NOT_MET, OPEN = "met", "not met", "open"


@dataclass
class TargetsSummaryConfig:
    """The closeness tables to read (one per repair) and the targets' thresholds."""

    tables: list[str] = field(default_factory=lambda: ["results/fidelity.json", "results/fidelity_lra_span.json",
                                                       "results/fidelity_lra_anchored.json",
                                                       "results/fidelity_lra_auto.json",
                                                       "results/fidelity_guarded_span.json",
                                                       "results/fidelity_lra_replaceme.json",
                                                       "results/fidelity_lra_replaceme_anchored.json",
                                                       "results/fidelity_lra_replaceme_auto.json",
                                                       "results/fidelity_guarded_joint.json"])
    grid: str = "mixed"
    """The calibration text whose rows are counted (the closeness tables' grid name)."""
    also: dict[str, str] = field(default_factory=lambda: {"mixed_refit": "+ kept-block re-fit"})
    """Further grids counted where a table has rows on them, each line labelled ``repair`` + this (``mixed_refit``:
    the same maps on the same text, each followed by the guarded kept-block re-fit); compared with the default
    repair on ``grid``."""
    robust_goal: float = 0.80
    robust_above: int = 8
    """Criteria (of all) under which the repair must beat the better ReplaceMe on Robust."""
    default: str = "lra_replaceme"
    """The default repair (``CalibrationConfig.solver``'s default), which the others are compared with (closer on
    every set or not)."""
    out: str = "results/targets"


def _all_of(hits: int, run: int, total: int) -> str:
    """A target that must hold under every criterion."""
    if hits < run:
        return NOT_MET
    return MET if run == total else OPEN


def _at_least(hits: int, run: int, total: int, need: int) -> str:
    if hits >= need:
        return MET
    return NOT_MET if hits + (total - run) < need else OPEN


def _falls(model: dict, grid: str, harm: list[str]) -> list[dict]:
    """Per criterion where the repair is significantly below pruning: the paired differences and the task
    that fell most (the closeness table's own reading, so that a ✗ carries its reason)."""
    by = {r["criterion"]: r.get("targets", {}).get(grid) or {} for r in model["rows"]}
    return [{"criterion": c, "vs_pruned": by.get(c, {}).get("vs_pruned"),
             "largest_task_drop": by.get(c, {}).get("largest_task_drop"),
             "avg_towards_original": by.get(c, {}).get("avg_towards_original")} for c in harm]


def closer_than(model: dict, grid: str, repair: str, other: str, other_grid: str | None = None) -> list[int] | None:
    """``[k, n]``: of the ``n`` criteria where ``repair`` has a row on ``grid`` and ``other`` on ``other_grid``
    (default: the same), the ``k`` where ``repair`` has the lower KL on every held-out set (None when they are one
    and the same)."""
    other_grid = other_grid or grid
    if (repair, grid) == (other, other_grid):
        return None
    hits = n = 0
    for r in model["rows"]:
        cells = r.get("cells", {})
        a, b = cells.get(f"{grid}:{repair}"), cells.get(f"{other_grid}:{other}")
        if not (a and b and a.get("kl") and b.get("kl")):
            continue
        n += 1
        hits += lower_kl_everywhere(a["kl"], b["kl"])
    return [hits, n]


def summarize(doc: dict, cfg: TargetsSummaryConfig) -> list[dict]:
    """One line per model and grid (``cfg.grid``, then ``cfg.also``'s) of a closeness table where it has rows: the
    counts and each target's status."""
    return [x for grid in (cfg.grid, *cfg.also) for x in _summarize(doc, cfg, grid)]


def _summarize(doc: dict, cfg: TargetsSummaryConfig, grid: str) -> list[dict]:
    lines = []
    for m in doc["models"]:
        t = m["targets"].get(grid)
        if not t or not t["criteria"]:
            continue
        total = len(m["rows"])
        b = t["best_robust"]
        rm = t["replaceme_of"]
        lines.append({
            "model": m["model"], "repair": doc["repair"], "grid": grid, "criteria": t["criteria"], "of": total,
            "closer": [len(t["closer"]), t["closer_of"]], "harm": [len(t["harm"]), t["harm_of"]],
            "harm_criteria": t["harm"], "falls": _falls(m, grid, t["harm"]), "best_robust": b,
            "kl_below_replaceme": [len(t["kl_below_replaceme"]), rm],
            "robust_above_replaceme": [len(t["robust_above_replaceme"]), rm],
            "closer_than_default": closer_than(m, grid, doc["repair"], cfg.default, cfg.grid),
            "status": {
                "closer": _all_of(len(t["closer"]), t["closer_of"], total),
                "no_harm": _all_of(t["harm_of"] - len(t["harm"]), t["harm_of"], total),
                "robust": MET if b["robust"] >= cfg.robust_goal else NOT_MET if t["criteria"] == total else OPEN,
                "kl_vs_replaceme": _all_of(len(t["kl_below_replaceme"]), rm, total),
                "robust_vs_replaceme": _at_least(len(t["robust_above_replaceme"]), rm, total, cfg.robust_above)}})
    return lines


def _mark(status: str) -> str:
    return {MET: " ✓", NOT_MET: " ✗", OPEN: " …"}[status]


def markdown(lines: list[dict], cfg: TargetsSummaryConfig) -> str:
    goal = f"{100 * cfg.robust_goal:.0f}"
    out = [f"# The issue's targets, per repair ({cfg.grid} calibration text)", "",
           "Counts of criteria from the closeness tables (`python -m experiments.closeness_table "
           "[--repair …]`); ✓ met, ✗ not met, … open (criteria not run yet could change it). Targets: closer "
           "than pruning on every set under every criterion; significantly below pruning on Avg or Robust under "
           f"none; the best criterion keeps ≥ {goal} % Robust; lower KL on every set than the better ReplaceMe "
           f"under every criterion and higher Robust under ≥ {cfg.robust_above}. Last column: under how many of "
           f"the criteria where both have run the repair is closer than the default `{cfg.default}` on every set (a tie, "
           "e.g. the same map at one-block sites, is not closer).", "",
           "| model | repair | criteria run | closer than pruning | significantly below pruning | best Robust "
           f"(criterion) | lower KL than ReplaceMe | higher Robust than ReplaceMe | closer than `{cfg.default}` |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for x in lines:
        s, b = x["status"], x["best_robust"]
        out.append(f"| {x['model']} | {_repair(x, cfg)} | {x['criteria']} of {x['of']} | "
                   f"{x['closer'][0]} of {x['closer'][1]}{_mark(s['closer'])} | "
                   f"{x['harm'][0]} of {x['harm'][1]}{_mark(s['no_harm'])} | "
                   f"{fmt_ci(b['robust'], b['robust_ci'])} ({b['criterion']}){_mark(s['robust'])} | "
                   f"{x['kl_below_replaceme'][0]} of {x['kl_below_replaceme'][1]}{_mark(s['kl_vs_replaceme'])} | "
                   f"{x['robust_above_replaceme'][0]} of {x['robust_above_replaceme'][1]}"
                   f"{_mark(s['robust_vs_replaceme'])} | {_count(x.get('closer_than_default'))} |")
    falls = [x for x in lines if x.get("falls")]
    if falls:
        out += ["", "Where a repair is significantly below pruning (paired difference, repaired − pruned, with its "
                "95 % interval; the task that fell most, pruned → repaired, and the original's accuracy; Avg's change "
                "split into the part that moves each task back towards the original's accuracy, no further than "
                "it, and the rest):", ""]
        for x in falls:
            out.append(f"- {x['model']} {_repair(x, cfg)}: " + "; ".join(_fall(f) for f in x["falls"]))
    return "\n".join(out) + "\n"


def _repair(x: dict, cfg: TargetsSummaryConfig) -> str:
    return f"`{x['repair']}`" + (f" {cfg.also[x['grid']]}" if x.get("grid") in cfg.also else "")


def _count(kn: list[int] | None) -> str:
    return "–" if not kn or not kn[1] else f"{kn[0]} of {kn[1]}"


def _fall(f: dict) -> str:
    d, v = f.get("largest_task_drop"), f.get("vs_pruned")
    text = f["criterion"]
    if v:
        text += f" (Avg {fmt_diff(v, 'avg')}, Robust {fmt_diff(v, 'robust')}"
        if d:
            o = f", original {100 * d['original']:.1f}" if d.get("original") is not None else ""
            text += f"; {d['task']} {100 * d['pruned']:.1f} → {100 * d['repaired']:.1f}{o}"
        x = f.get("avg_towards_original")
        if x:
            rest = fmt_change(x["rest"], x["rest_ci"])
            text += f"; Avg {100 * x['towards']:+.1f} back towards the original, {rest} the rest"
        text += ")"
    return text


def render(cfg: TargetsSummaryConfig) -> Path:
    missing = [p for p in cfg.tables if not Path(p).exists()]
    if missing:
        raise FileNotFoundError(f"Closeness tables not found: {missing}. Render each with python -m "
                                "experiments.closeness_table --repair <repair> --out <path without .json>")
    docs = [json.loads(Path(p).read_text()) for p in cfg.tables]
    models = list(dict.fromkeys(m["model"] for d in docs for m in d["models"]))
    lines = sorted((x for d in docs for x in summarize(d, cfg)), key=lambda x: models.index(x["model"]))
    out = Path(cfg.out)
    write_json_atomic(out.with_suffix(".json"), {"grid": cfg.grid, "robust_goal": cfg.robust_goal,
                                                 "robust_above": cfg.robust_above, "default": cfg.default,
                                                 "tables": cfg.tables,
                                                 "lines": lines})
    write_text_atomic(out.with_suffix(".md"), markdown(lines, cfg))
    return out


def main(argv: list[str] | None = None):
    from experiments.cli import dataclass_main

    def go(cfg: TargetsSummaryConfig):
        out = render(cfg)
        print(f"Targets in {out.with_suffix('.md')}")
        return out

    return dataclass_main(TargetsSummaryConfig, go, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
