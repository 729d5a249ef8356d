"""The ablations' tables (``results/ablations/<model>.{md,json,png}``), rendered from their run files:
calibration samples, mode, granularity, rank, pruning ratio, calibration domain, ridge strength, each
with Avg, perplexity and closeness to the original (KL per set)."""

from __future__ import annotations

import json
from pathlib import Path

from shift_lightning.outputs import write_file_atomic, write_json_atomic, write_text_atomic
from experiments.tables.common import fmt_kl, fmt_ppl, set_label


def _runs(folder: Path) -> dict[tuple[str, str], dict]:
    out = {}
    for f in sorted(folder.glob("*/*.json")):
        d = json.loads(f.read_text())
        out[(d["criterion"], d["run"])] = d
    return out


def render(folder: Path, cfg) -> None:
    """``<model>.{md,json,png}`` from the runs on disk; ``cfg``: the ablations' config (model, criteria,
    docs, and ``grid``, the paper grid's settings)."""
    runs = _runs(folder)
    orig_f = folder / "original.json"
    if not runs or not orig_f.exists():
        return
    orig = json.loads(orig_f.read_text())
    rows = [{"criterion": c, "run": r, "avg": d["average"], "ppl": {p: e["ppl"] for p, e in d["perplexity"].items()},
             "tasks": {t: e["value"] for t, e in d["tasks"].items()}, "params": d.get("params"),
             **({"kl": d["kl"], "top1": d["top1"], "kl_ci": {k: e.get("kl_ci") for k, e in d["closeness"].items()}}
                if "closeness" in d else {})}
            for (c, r), d in runs.items()]
    write_json_atomic(folder.with_suffix(".json"), {"original": {"avg": orig["average"], "ppl": {
        p: e["ppl"] for p, e in orig["perplexity"].items()}}, "rows": rows, "config": orig["config"]})
    g = cfg.grid
    lines = [f"# Ablations: {cfg.model}, {int(100 * g.ratio)}% depth pruning unless said otherwise", "",
             f"Zero-shot avg over the seven tasks on {cfg.docs} seeded docs per task (seed {g.sample_seed}; fewer "
             f"than the results tables' {g.docs}, so compare within this file), wiki-summaries and LAMBADA PPL on "
             f"the grid's windows. Defaults: {g.calib_samples} × {g.seq_len}-token wiki-summaries windows, independent, "
             f"one LRA per block merged per span, full rank, relative damping {g.damping:g}. Original: avg "
             f"{100 * orig['average']:.2f}, " + ", ".join(f"{set_label(p)} PPL {e['ppl']:.2f}"
                                                       for p, e in orig["perplexity"].items()) + ".", "",
             f"Command: `{orig['command']}`", ""]
    ppl_sets = list(orig["perplexity"])
    kl_sets = next((list(d["kl"]) for d in runs.values() if "kl" in d), [])
    sections = [("Calibration samples (windows of 512 tokens)", "samples="),
                ("Independent vs sequential", "mode="), ("Merged per-block LRAs vs one LRA per span", "granularity="),
                ("Rank (one LRA per span)", "rank="), ("Pruning ratio", "ratio="),
                ("Calibration domain", "domain="), ("Ridge strength (relative damping)", "damping=")]
    for title, prefix in sections:
        lines += [f"## {title}", "", "| criterion | run | Avg | " + " | ".join(f"{set_label(p)} PPL" for p in ppl_sets)
                  + "".join(f" | KL {set_label(s)}" for s in kl_sets) + " |",
                  "|---|---|---:|" + "---:|" * (len(ppl_sets) + len(kl_sets))]
        for crit in cfg.criteria:
            ref = runs.get((crit, f"samples={g.calib_samples}"))
            extra = []
            if prefix in ("mode=", "granularity=", "rank=", "domain="):
                if ref:
                    extra.append((f"default ({'independent' if prefix == 'mode=' else 'merged per block' if prefix == 'granularity=' else 'full rank, per block' if prefix == 'rank=' else 'wiki_summaries'})", ref))
            if prefix == "ratio=":
                p, l = runs.get((crit, "pruned")), ref
                if p:
                    extra.append((f"ratio={g.ratio:g}/pruned", p))
                if l:
                    extra.append((f"ratio={g.ratio:g}/lra", l))
            chosen = [(r, d) for (c, r), d in runs.items() if c == crit and r.startswith(prefix)]
            if prefix == "ratio=":  # the default ratio's rows take their place in the sweep
                chosen, extra = chosen + extra, []
            chosen.sort(key=lambda x: _sort_key(x[0]))
            for r, d in extra + chosen:
                lines.append(f"| {crit} | {r} | {100 * d['average']:.2f} | "
                             + " | ".join(fmt_ppl(d["perplexity"][p]["ppl"]) for p in ppl_sets)
                             + "".join(f" | {fmt_kl(d['kl'][s]) if 'kl' in d else '…'}" for s in kl_sets) + " |")
        lines.append("")
    write_text_atomic(folder.with_suffix(".md"), "\n".join(lines) + "\n")
    try:
        plot(folder, cfg, runs, orig)
    except ImportError:
        pass


def _sort_key(name: str):
    v = name.split("=", 1)[1].split("/")[0]
    try:
        return (0, float(v), name)
    except ValueError:
        return (1, 0.0, name)


def plot(folder: Path, cfg, runs: dict, orig: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    first = next(iter(orig["perplexity"]))
    panels = [("samples=", "calibration windows", True), ("rank=", "LRA rank (per span)", True),
              ("ratio=", "pruning ratio", False), ("damping=", "relative damping", True)]
    fig, axes = plt.subplots(2, len(panels), figsize=(5 * len(panels), 8))
    for j, (prefix, xlabel, logx) in enumerate(panels):
        for crit in cfg.criteria:
            pts = []
            for (c, r), d in runs.items():
                if c != crit or not r.startswith(prefix) or (prefix == "ratio=" and not r.endswith("/lra")):
                    continue
                pts.append((float(r.split("=", 1)[1].split("/")[0]), d))
            if prefix == "ratio=" and (crit, f"samples={cfg.grid.calib_samples}") in runs:
                pts.append((cfg.grid.ratio, runs[(crit, f"samples={cfg.grid.calib_samples}")]))
            pts.sort(key=lambda p: p[0])
            if not pts:
                continue
            xs = [p[0] for p in pts]
            axes[0][j].plot(xs, [100 * p[1]["average"] for p in pts], marker="o", label=crit)
            axes[1][j].plot(xs, [p[1]["perplexity"][first]["ppl"] for p in pts], marker="o", label=crit)
        for i in (0, 1):
            if logx:
                axes[i][j].set_xscale("log")
            axes[i][j].set_xlabel(xlabel)
        axes[0][j].axhline(100 * orig["average"], color="k", ls="--", lw=1, label="original")
        axes[1][j].axhline(orig["perplexity"][first]["ppl"], color="k", ls="--", lw=1)
        axes[1][j].set_yscale("log")
        axes[0][j].set_title(f"+LRA zero-shot avg (%) vs {xlabel}")
        axes[1][j].set_title(f"+LRA {set_label(first)} PPL vs {xlabel}")
        axes[0][j].legend(fontsize=8)
    fig.tight_layout()
    write_file_atomic(folder.with_name(folder.name + ".png"), lambda tmp: fig.savefig(tmp, dpi=100))
    plt.close(fig)
