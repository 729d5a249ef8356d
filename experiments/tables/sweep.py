"""The closeness sweep's table and plot (``results/fidelity_sweep/<model>.{md,json,png}``): KL to the
original against the number of blocks removed, per criterion and repair, from the sweep's run files
and the paper grid's runs at its ratio."""

from __future__ import annotations

import json
from pathlib import Path

from shift_lightning.outputs import write_file_atomic, write_json_atomic, write_text_atomic
from experiments.tables.common import fmt_kl, set_label
from experiments.tables.paper import GUARDS, LABELS


def maps_of(run: dict) -> list[str]:
    """The map per span of a run: the sweep's ``maps``, or the paper grid's per-site ``map``."""
    if "maps" in run:
        return list(run["maps"])
    return [site["map"] for site in run.get("sites", []) if site.get("map")]


def points(folder: Path, cfg) -> list[dict]:
    """Every measured (criterion, ratio, repair): blocks removed, KL and top-1 per set."""
    g = cfg.grid
    paper = Path(g.out) / folder.name
    out = []
    for crit in cfg.criteria:
        for ratio in cfg.ratios:
            for r in cfg.repairs:
                f = folder / crit / f"ratio={ratio:g}_{r}.json"
                if not f.exists() and ratio == g.ratio:
                    f = paper / crit / f"{r}.json"
                if not f.exists():
                    continue
                d = json.loads(f.read_text())
                if "kl" not in d:
                    continue
                out.append({"criterion": crit, "ratio": ratio, "repair": r, "blocks_removed": len(d["pruned_layers"]),
                            "pruned_layers": d["pruned_layers"], "maps": maps_of(d), "kl": d["kl"], "top1": d["top1"],
                            "kl_ci": {k: e.get("kl_ci") for k, e in d["closeness"].items()},
                            "source": str(f.relative_to(f.parents[2]))})
    return out


def render(folder: Path, cfg) -> None:
    pts = points(folder, cfg)
    if not pts:
        return
    sets = list(pts[0]["kl"])
    write_json_atomic(folder.with_suffix(".json"), {"points": pts, "config": json.loads(json.dumps(
        {"criteria": cfg.criteria, "ratios": cfg.ratios, "repairs": cfg.repairs}))})
    by = {(p["criterion"], p["ratio"], p["repair"]): p for p in pts}
    guards = [r for r in cfg.repairs if r in GUARDS]
    lines = [f"# Closeness to the original vs blocks removed: {cfg.model}", "",
             "Mean next-token KL(original ‖ model) in nats per position on held-out wiki-summaries, LAMBADA passages and "
             "the tasks' prompts (the paper grid's closeness sets; its runs at its ratio are reused). `…` = pending."
             + (" Maps: what the KL guard chose per span, first to last (`lra@λ`: the LRA at relative damping λ; "
                "`lra@span`: one LRA for the whole span; `nobias`: without bias; `replaceme`; `none`: pruning "
                "alone)." if guards else ""), "",
             "| criterion | ratio | blocks | " + " | ".join(f"{LABELS.get(r, r)} KL {set_label(s)}" for r in cfg.repairs
                                                         for s in sets)
             + "".join(f" | {LABELS.get(g, g)} maps" for g in guards) + " |",
             "|---|---:|---:|" + "---:|" * (len(cfg.repairs) * len(sets)) + "---|" * len(guards)]
    for crit in cfg.criteria:
        for ratio in cfg.ratios:
            row = [by.get((crit, ratio, r)) for r in cfg.repairs]
            n = next((p["blocks_removed"] for p in row if p), None)
            if n is None:
                continue
            cells = [fmt_kl(p["kl"][s]) if p else "…" for p in row for s in sets]
            for gv in guards:
                g = by.get((crit, ratio, gv))
                cells.append((", ".join(g["maps"]) or "–") if g else "…")
            lines.append(f"| {crit} | {ratio:g} | {n} | " + " | ".join(cells) + " |")
    write_text_atomic(folder.with_suffix(".md"), "\n".join(lines) + "\n")
    try:
        plot(folder, cfg, pts, sets)
    except ImportError:
        pass


def plot(folder: Path, cfg, pts: list[dict], sets: list[str]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(cfg.repairs), len(sets), figsize=(5 * len(sets), 3.6 * len(cfg.repairs)),
                             squeeze=False, sharex=True, sharey="col")
    # ten colours, then the same colours again with dashed lines and square markers
    style = {c: dict(color=plt.cm.tab10(i % 10), linestyle="-" if i < 10 else "--", marker="o" if i < 10 else "s")
             for i, c in enumerate(cfg.criteria)}
    for i, r in enumerate(cfg.repairs):
        for j, s in enumerate(sets):
            ax = axes[i][j]
            for crit in cfg.criteria:
                xs = sorted((p["blocks_removed"], p["kl"][s]) for p in pts if p["criterion"] == crit and p["repair"] == r)
                if xs:
                    ax.plot([x for x, _ in xs], [y for _, y in xs], label=crit, **style[crit])
            ax.set_yscale("log")
            ax.set_title(f"{LABELS.get(r, r)}: KL to the original, {set_label(s)}")
            ax.set_xlabel("blocks removed")
            if i == 0 and j == 0:
                ax.legend(fontsize=7, ncol=2)
    fig.suptitle(f"{cfg.model}: closeness to the original vs depth pruned (nats per position, log scale)")
    fig.tight_layout()
    write_file_atomic(folder.with_name(folder.name + ".png"), lambda tmp: fig.savefig(tmp, dpi=100))
    plt.close(fig)
