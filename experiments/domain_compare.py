"""Calibration domain: the paper grid's repairs fitted on wiki-summaries against the same repairs fitted
on the ``mixed`` corpus (wiki-summaries + reading passages + QA pairs), on the same blocks, docs and
windows.

    python -m experiments.reproduce --model smollm2-135m --calib_source mixed \\
        --out results/paper_mixed --variants '[lra, guarded]' --fill new        # the mixed runs
    python -m experiments.domain_compare --model smollm2-135m          # the comparison
    python -m experiments.domain_compare --a results/paper_mixed --b results/paper_mixed_refit \\
        --repairs '[lra_replaceme]' --a_label "joint map" --b_label "+ re-fit" --title "Kept-block re-fit" \\
        --differs "the second grid re-fitted the kept blocks after each map" --pruned_from results/paper  # any two

Writes ``<b>/<model>_vs_<a>.{md,json}``: per criterion and repair, KL to the original on every
closeness set, Avg and Robust for both calibration texts, and the paired bootstrap differences
(mixed − wiki, and each − pruning alone on the same blocks; the rows are scored on the same docs).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from shift_lightning.outputs import write_json_atomic, write_text_atomic
from experiments.harness import model_key
from experiments.tables.common import fmt_ci, fmt_diff, fmt_kl, set_label
from experiments.tables.paper import LABELS, load_runs

log = logging.getLogger(__name__)


@dataclass
class DomainCompareConfig:
    """Two paper-grid folders of the same model, calibrated on different text."""

    model: str = "smollm2-135m"
    a: str = "results/paper"
    """The reference grid (wiki-summaries calibration)."""
    b: str = "results/paper_mixed"
    """The other grid (``--calib_source mixed``)."""
    repairs: list[str] = field(default_factory=lambda: ["lra", "guarded", "replaceme"])
    """Repairs compared where both grids have the row (ReplaceMe refitted on the other text too)."""
    n_boot: int = 2000
    a_label: str = "wiki"
    """What the table calls ``a`` (short: it heads columns)."""
    b_label: str = "mixed"
    """What the table calls ``b``."""
    title: str = "Calibration domain"
    """The table's heading."""
    differs: str = ("only the calibration text of the maps differs (except under `linear_fit`, which chooses its "
                    "blocks on the calibration windows; the blocks are in the JSON)")
    """What differs between the two grids' rows, for the table's preamble."""
    pruned_from: str | None = None
    """A grid (same model) whose pruned rows stand for pruning alone where neither grid has one on the same blocks
    (pruning alone does not depend on the maps), e.g. ``results/paper``."""
    kl_rtol: float = 1e-4
    """KL values within this relative difference count as equal, not lower (the same maps fitted again agree to
    ~1e-5)."""


def _pruned(grids: tuple[dict, ...], crit: str, layers: list[int]) -> dict | None:
    """The pruned row of ``crit`` on ``layers`` (linear_fit may choose other blocks on other text)."""
    return next((g[(crit, "pruned")] for g in grids if (crit, "pruned") in g
                 and g[(crit, "pruned")]["pruned_layers"] == layers), None)


def compare(cfg: DomainCompareConfig) -> dict:
    from experiments.summary import Bootstrap

    key = model_key(cfg.model)
    runs_a, runs_b = load_runs(Path(cfg.a) / key), load_runs(Path(cfg.b) / key)
    grids = (runs_a, runs_b) + ((load_runs(Path(cfg.pruned_from) / key),) if cfg.pruned_from else ())
    named = {"original": runs_a[(None, "original")]}
    pairs = []
    for (crit, v), r in sorted(runs_b.items(), key=lambda x: (str(x[0][0]), x[0][1])):
        if crit is None or v not in cfg.repairs or (crit, v) not in runs_a:
            continue
        if runs_a[(crit, v)]["pruned_layers"] != r["pruned_layers"]:
            log.warning("%s/%s: different blocks in the two grids (%s vs %s); compared anyway", crit, v,
                        runs_a[(crit, v)]["pruned_layers"], r["pruned_layers"])
        named[f"a:{crit}/{v}"], named[f"b:{crit}/{v}"] = runs_a[(crit, v)], r
        for side, row in (("a", runs_a[(crit, v)]), ("b", r)):  # pruning alone on the same blocks
            p = _pruned(grids, crit, row["pruned_layers"])
            if p is not None:
                named[f"p{side}:{crit}/{v}"] = p
        pairs.append((crit, v))
    rows = []
    if not pairs:
        return {"rows": rows}
    boot = Bootstrap(named, "original", n_boot=cfg.n_boot)
    for crit, v in pairs:
        ra, rb = named[f"a:{crit}/{v}"], named[f"b:{crit}/{v}"]
        sa, sb = boot.summary(f"a:{crit}/{v}"), boot.summary(f"b:{crit}/{v}")
        pruned = {side: (named.get(f"p{side}:{crit}/{v}") or {}).get("kl") for side in ("a", "b")}
        rows.append({"criterion": crit, "repair": v, "pruned_layers": {"a": ra["pruned_layers"], "b": rb["pruned_layers"]},
                     "kl": {"a": ra.get("kl"), "b": rb.get("kl")}, "kl_pruned": pruned,
                     "avg": {"a": sa["avg"], "b": sb["avg"]},
                     "robust": {"a": sa["robust"], "b": sb["robust"]},
                     "robust_ci": {"a": sa["robust_ci"], "b": sb["robust_ci"]},
                     "b_minus_a": boot.difference(f"b:{crit}/{v}", f"a:{crit}/{v}"),
                     "minus_pruned": {side: boot.difference(f"{side}:{crit}/{v}", f"p{side}:{crit}/{v}")
                                      if f"p{side}:{crit}/{v}" in named else None for side in ("a", "b")}})
    return {"rows": rows, "bootstrap": boot.meta()}


def render(cfg: DomainCompareConfig) -> Path:
    doc = compare(cfg)
    out = Path(cfg.b) / f"{model_key(cfg.model)}_vs_{Path(cfg.a).name}"
    write_json_atomic(out.with_suffix(".json"), doc)
    rows = doc["rows"]
    sets = next((list(r["kl"]["a"]) for r in rows if r["kl"]["a"]), [])
    a, b = cfg.a_label, cfg.b_label
    lines = [f"# {cfg.title}: {cfg.model}, `{cfg.b}` ({b}) against `{cfg.a}` ({a})", "",
             f"The same blocks, docs and windows; {cfg.differs}. **pruned**: the {a} row's blocks without a map. "
             "KL(original ‖ model) in nats per position; Avg and Robust in points with 95% intervals; "
             f"**Δ** = {b} − {a}: paired bootstrap differences (↑ / ↓: the interval lies above / below 0).", "",
             "| criterion | repair | " + " | ".join(f"KL {set_label(s)} pruned / {a} → {b}" for s in sets)
             + f" | Avg {a} → {b} | Robust {a} → {b} | Δ Avg | Δ Robust | − pruned: Avg {a} / {b} "
             f"| − pruned: Robust {a} / {b} |",
             "|---|---|" + "---:|" * (len(sets) + 6)]
    for r in rows:
        kl = [f"{fmt_kl((r['kl_pruned']['a'] or {}).get(s))} / {fmt_kl((r['kl']['a'] or {}).get(s))} → "
              f"{fmt_kl((r['kl']['b'] or {}).get(s))}" for s in sets]
        lines.append(f"| {r['criterion']} | {LABELS.get(r['repair'], r['repair'])} | " + " | ".join(kl)
                     + f" | {100 * r['avg']['a']:.1f} → {100 * r['avg']['b']:.1f} | "
                     f"{fmt_ci(r['robust']['a'], r['robust_ci']['a'])} → {fmt_ci(r['robust']['b'], r['robust_ci']['b'])} | "
                     f"{fmt_diff(r['b_minus_a'], 'avg')} | {fmt_diff(r['b_minus_a'], 'robust')} | "
                     + " | ".join(" / ".join(fmt_diff(r["minus_pruned"][side], key) if r["minus_pruned"][side] else "–"
                                             for side in ("a", "b")) for key in ("avg", "robust")) + " |")
    if rows and sets:
        lines.append("")
        both = [r for r in rows if r["kl"]["a"] and r["kl"]["b"]]
        for s in sets:
            same = sum(abs(r["kl"]["b"][s] - r["kl"]["a"][s]) <= cfg.kl_rtol * abs(r["kl"]["a"][s]) for r in both)
            n = sum(r["kl"]["b"][s] < r["kl"]["a"][s] * (1 - cfg.kl_rtol) for r in both)
            lines.append(f"- KL {set_label(s)}: {b} lower in {n} of {len(rows)} rows"
                         + (f" ({same} equal within a relative {cfg.kl_rtol:g})." if same else "."))
        for side, name in (("a", a), ("b", b)):
            known = [r for r in rows if r["kl"][side] and r["kl_pruned"][side]]
            n = sum(all(r["kl"][side][s] < r["kl_pruned"][side][s] for s in sets) for r in known)
            lines.append(f"- {name}: closer to the original than pruning on every set in {n} of {len(known)} rows.")
        for side, name in (("a", a), ("b", b)):
            known = [r for r in rows if r["minus_pruned"][side]]
            hurt = [r["criterion"] + ("" if r["repair"] == "lra" else f" ({r['repair']})") for r in known
                    if r["minus_pruned"][side]["avg_diff_ci"][1] < 0 or r["minus_pruned"][side]["robust_diff_ci"][1] < 0]
            lines.append(f"- {name}: significantly below pruning on Avg or Robust in {len(hurt)} of "
                         f"{len(known)} rows" + (f" ({', '.join(hurt)})." if hurt else "."))
        diff = [r["b_minus_a"] for r in rows]
        lines.append(f"- Avg: {b} higher in {sum(d['avg_diff'] > 0 for d in diff)} of {len(rows)} "
                     f"(significantly: {sum(d['avg_diff_ci'][0] > 0 for d in diff)}; significantly lower: "
                     f"{sum(d['avg_diff_ci'][1] < 0 for d in diff)}); Robust: {b} higher in "
                     f"{sum(d['robust_diff'] > 0 for d in diff)} of {len(rows)} (significantly: "
                     f"{sum(d['robust_diff_ci'][0] > 0 for d in diff)}; significantly lower: "
                     f"{sum(d['robust_diff_ci'][1] < 0 for d in diff)}).")
    write_text_atomic(out.with_suffix(".md"), "\n".join(lines) + "\n")
    return out


def main(argv: list[str] | None = None):
    from experiments.cli import dataclass_main

    def go(cfg: DomainCompareConfig):
        out = render(cfg)
        print(f"Comparison in {out.with_suffix('.md')}")
        return out

    return dataclass_main(DomainCompareConfig, go, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
