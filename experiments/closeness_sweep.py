"""Closeness to the original as more blocks are removed: every criterion × pruning ratio × repair.

    python -m experiments.closeness_sweep --model smollm2-135m
    python -m experiments.closeness_sweep --model smollm2-135m --render_only

For each criterion and ratio the blocks are chosen as in the paper grid, the repairs (plain pruning,
the LRA, the KL guard, …) fitted on the grid's calibration windows, and each corrected model is
compared with the original on the grid's closeness sets (KL and top-1 on held-out wiki-summaries,
LAMBADA passages and the tasks' prompts; no zero-shot scoring, which the paper grid and the
ablations do). The paper grid's own runs at its ratio are reused (read, not rerun). Runs land in
``<out>/<model>/<criterion>/ratio=<r>_<repair>.json`` (skipped when present), the table and the plot
(blocks removed vs KL, one line per criterion, one panel per repair and set) in ``<out>/<model>.{md,json,png}``.
"""

from __future__ import annotations

import copy
import json
import logging
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.criteria import REPAIR_AWARE, PruneConfig
from experiments.trunk import TrunkCache
from shift_lightning.selection import select_blocks
from shift_lightning.maps.surgery import remove_blocks
from experiments import harness, variants
from experiments.reproduce import CRITERIA_ORDER, ReproduceConfig, eval_config
from experiments.tables import sweep as tables

log = logging.getLogger(__name__)


@dataclass
class SweepConfig:
    """Criteria × ratios × repairs, closeness only."""

    model: str = "smollm2-135m"
    """The model (embedded name, HF id or folder)."""
    criteria: list[str] = field(default_factory=lambda: list(CRITERIA_ORDER))
    """Criteria (the paper grid's)."""
    ratios: list[float] = field(default_factory=lambda: [0.1, 0.25, 0.4])
    """Pruning ratios (⌊ratio·L⌋ blocks)."""
    repairs: list[str] = field(default_factory=lambda: ["pruned", "lra", "guarded"])
    """``pruned`` and calibration solvers."""
    out: str = "results/fidelity_sweep"
    """Where runs, table and plot go."""
    render_only: bool = False
    """Only render from the runs on disk."""
    grid: ReproduceConfig = field(default_factory=ReproduceConfig)
    """The paper grid's settings (windows, closeness sets, damping) and where its runs are."""


def run(cfg: SweepConfig) -> Path:
    folder = Path(cfg.out) / harness.model_key(cfg.model)
    folder.mkdir(parents=True, exist_ok=True)
    if cfg.render_only:
        tables.render(folder, cfg)
        return folder
    g = cfg.grid
    meta = {"config": json.loads(json.dumps(asdict(cfg), default=str)), "command": rerun_command(cfg)}
    ctx = harness.open_grid(cfg.model, g.tiny, g.device, lambda v, d: eval_config(g, v, d), meta, g.text_source)
    runs = harness.RunFolder(folder)
    paper = harness.RunFolder(Path(g.out) / harness.model_key(cfg.model))
    for crit in cfg.criteria:
        for ratio in cfg.ratios:
            names = {r: f"{crit}/ratio={ratio:g}_{r}" for r in cfg.repairs}
            todo = [r for r, n in names.items() if not runs.done(n)]
            if ratio == g.ratio:  # the paper grid's runs, when they have closeness
                todo = [r for r in todo if not (paper.done(f"{crit}/{r}") and "closeness" in paper.read(f"{crit}/{r}"))]
            if todo:
                _run(cfg, ctx, runs, crit, ratio, todo, names)
        tables.render(folder, cfg)
    return folder


def _run(cfg: SweepConfig, ctx: harness.GridContext, runs: harness.RunFolder, crit: str, ratio: float,
         todo: list[str], names: dict[str, str]) -> None:
    g = cfg.grid
    repair = crit in REPAIR_AWARE
    windows = ctx.windows(g.calib_samples, g.seq_len) if repair else ctx.windows(g.select_samples, g.select_seq_len)
    sel = select_blocks(PruneConfig(ratio=ratio, criterion=crit, damping=g.damping), ctx.model, windows,
                        ctx.make_trainer)
    layers = sorted(sel.layers)
    log.info("%s %s ratio %g: blocks %s; repairs %s", cfg.model, crit, ratio, layers, todo)
    model = copy.deepcopy(ctx.model)
    solvers = [r for r in todo if r != "pruned"]
    module = None
    t0 = time.time()
    if solvers:
        module = CalibrationModule(model, layers, CalibrationConfig(damping=g.damping, heldout_every=g.heldout_every,
                                                                    heldout=False), solvers=variants.knobs(solvers))
        module.calibrate(ctx.make_trainer(), ctx.windows(g.calib_samples, g.seq_len), batch_size=4)
    cal_seconds = time.time() - t0
    n_layers = ctx.num_layers
    remove_blocks(model, layers)
    cache = TrunkCache(depth=max(layers[0] - 1, 0))
    for i, r in enumerate(sorted(todo, key=lambda r: r != "pruned")):
        correction = module.fitted_maps(r) if r != "pruned" else None
        t1 = time.time()
        with harness.corrected(model, correction, n_layers, layers):
            res = ctx.evaluate(model, cache, record=i == 0, tasks=False)
        runs.write(names[r], {**ctx.meta, "criterion": crit, "ratio": ratio, "repair": r, "pruned_layers": layers,
                              "blocks_removed": len(layers), "selection": sel.to_dict(),
                              "maps": [m.source for m in correction.spans] if correction is not None else [],
                              **harness.row_doc(res),
                              "seconds": {"calibration": cal_seconds, "evaluation": time.time() - t1}})
        log.info("%s ratio %g %s: KL %s", crit, ratio, r, ", ".join(f"{k} {v:.3f}" for k, v in res["kl"].items()))


def rerun_command(cfg: SweepConfig) -> str:
    from experiments.cli import rerun_command as command

    return command("experiments.closeness_sweep", cfg)


def main(argv: list[str] | None = None):
    from experiments.cli import dataclass_main

    def go(cfg: SweepConfig):
        out = run(cfg)
        print(f"Table in {out.with_suffix('.md')}, plot in {out.with_suffix('.png')}")
        return out

    return dataclass_main(SweepConfig, go, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
