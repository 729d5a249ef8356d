"""The calibration recipe: config → model + data → selection → calibration → surgery → artefacts.

:func:`run_calibration` is what ``calibrate.py`` calls; it can also be used from Python::

    from shift_lightning.recipes.calibrate import run_calibration
    result = run_calibration(model=ModelConfig(...), prune=PruneConfig(ratio=0.25), output_dir="out")
    result.report.pruned_layers, result.model
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Literal

import lightning as L
from torch import nn

from .trainer import build_trainer
from .. import dist
from ..arch import decoder_layers
from ..calibration import CalibrationConfig, CalibrationModule, Correction, check_windows
from ..criteria import CRITERIA, CriterionError, PruneConfig, check_layers, num_to_remove
from ..data import CALIBRATION_SOURCE, DataError, TextDataConfig, build_windows, check_seq_len
from ..config import default_heldout
from ..errors import ConfigError
from ..models import ModelConfig, num_params
from ..evaluation.heldout import HeldoutCloseness
from ..fingerprints import weights_fingerprint
from ..outputs import prepare_output, publish_dir
from ..placement import original_copy, placement_of
from ..progress import with_stage_progress
from ..reports import CalibrationReport
from ..stopping import with_signal_guard
from ..selection import ONLOAD_CRITERIA, select_blocks
from ..calibration import pruned_positions
from ..card import CardFacts
from ..checkpoint import ShiftSpec, load_pretrained, save_adapters, save_pretrained
from ..keptfit import check_block, guarded_refit, refit_pairs
from ..surgery import apply_correction, remove_blocks

log = logging.getLogger(__name__)

#: Trainer settings the calibration pass relies on (the user's --trainer.* overrides the rest).
TRAINER_DEFAULTS: dict[str, Any] = dict(
    accelerator="auto", devices=1, inference_mode=False, logger=False, enable_checkpointing=False,
    use_distributed_sampler=False, enable_model_summary=False,
)


@dataclass
class CalibrationResult:
    """What :func:`run_calibration` returns."""

    report: CalibrationReport
    """The calibration report (also written as ``calibration_report.json``)."""
    model: nn.Module
    """The pruned + corrected in-memory model."""
    tokenizer: Any
    output_dir: Path | None = None


def check_early(prune: PruneConfig, data: TextDataConfig, calibration: CalibrationConfig,
                heldout: TextDataConfig | None = None) -> None:
    """Cheap validation before any model is loaded."""
    if prune.layers is None:
        if prune.criterion not in CRITERIA:
            raise CriterionError(f"Unknown criterion {prune.criterion!r}; valid choices: {', '.join(CRITERIA)}")
        num_to_remove(10_000, prune.ratio)  # range check only
    elif any((not isinstance(i, int)) or i < 0 for i in prune.layers):
        raise CriterionError(f"--prune.layers must be non-negative block indices, got {prune.layers}")
    src = data.source
    if src not in ("wiki_summaries", "wiki-summaries", "mixed") and not src.startswith("hf:") \
            and not Path(src).expanduser().exists():
        raise DataError(f"Calibration data not found: {src}. Use --data.source wiki_summaries, an existing "
                        ".txt/.json/.jsonl file or folder, or hf:<dataset>[:<config>].")
    data.validate("--data")
    if heldout is not None and calibration.heldout:
        heldout.validate("--heldout", optional=True)
    calibration.validate()


def check_onloadable(prune: PruneConfig, calibration: CalibrationConfig, evaluate, save_model) -> None:
    """Before any pass: what an onloaded run (``--model.placement onload``) cannot do yet, each named with its fix."""
    fix = "or load the model whole with --model.placement memory"
    if prune.layers is None and prune.criterion not in ONLOAD_CRITERIA:
        raise ConfigError(f"--prune.criterion {prune.criterion} scores blocks with forward passes of the whole model; "
                          f"an onloaded run selects with {', '.join(ONLOAD_CRITERIA)} or --prune.layers: choose one, "
                          + fix)
    if calibration.mode == "auto" or calibration.solver == "guarded":
        what = "--calibration.mode auto" if calibration.mode == "auto" else "--calibration.solver guarded"
        raise ConfigError(f"{what} judges its maps by the logits of the whole model on held-out windows; onloaded, use "
                          f"--calibration.mode independent, sequential or anchored with another solver, {fix}")
    if evaluate is not None and (evaluate.tasks or evaluate.ppl):
        raise ConfigError("The evaluation after calibration runs the whole model; onloaded, switch it off "
                          "(--evaluate.ppl '' --evaluate.tasks '') and evaluate the saved folder with evaluate.py, "
                          + fix)


def local_inputs(model: ModelConfig | None, **sets: TextDataConfig | None) -> dict[str, str]:
    """The run's inputs that may be local paths, by option name (an output may not be, contain or lie
    in one of them: :func:`~shift_lightning.outputs.check_not_input`)."""
    out = {}
    if model is not None and model.tiny is None:
        out["--model.name_or_path"] = model.name_or_path
        if model.gguf_file:
            out["--model.gguf_file"] = str(Path(model.name_or_path).expanduser() / model.gguf_file)
    for name, cfg in sets.items():
        if cfg is not None:
            out[f"--{name}.source"] = cfg.source
    return out


def make_trainer_factory(trainer: dict | L.Trainer | None) -> Callable[[], L.Trainer]:
    """One Trainer for every pass: a given one (``train.py`` calibrates on its training Trainer),
    or one built from ``trainer`` keyword arguments over :data:`TRAINER_DEFAULTS`."""
    if isinstance(trainer, L.Trainer):
        return lambda: trainer
    kwargs = with_signal_guard(with_stage_progress({**TRAINER_DEFAULTS, **(trainer or {})}))
    cache: list[L.Trainer] = []

    def make() -> L.Trainer:  # one Trainer serves every pass (criteria, statistics, held-out)
        if not cache:
            cache.append(build_trainer(**kwargs))
        return cache[0]

    return make


def run_calibration(
    model: ModelConfig | None = None,
    data: TextDataConfig | None = None,
    heldout: TextDataConfig | None = None,
    prune: PruneConfig | None = None,
    calibration: CalibrationConfig | None = None,
    trainer: dict | L.Trainer | None = None,
    output_dir: str | None = None,
    overwrite: bool = False,
    save_model: bool | Literal["adapters"] = True,
    built: tuple | None = None,
    evaluate=None,
    evaluate_baselines: bool = False,
    resolved_config: str | None = None,
    extra_files: dict[str, Any] | None = None,
    command: str | None = None,
) -> CalibrationResult:
    """Prune + calibrate; write the corrected model and ``calibration_report.json`` to ``output_dir``.

    ``built=(model, tokenizer)`` injects an already loaded model (tests, notebooks).
    ``evaluate`` (an :class:`~shift_lightning.evaluation.runner.EvalConfig` with tasks and/or
    perplexity sets) evaluates the corrected model, and with ``evaluate_baselines`` also the
    original and the pruned-without-adapters model, on the same Trainer (1 or N processes).
    ``resolved_config`` (YAML text) is saved as ``config.yaml`` next to the outputs.
    ``save_model="adapters"`` writes an adapter-only folder (the base model is named, not copied).
    ``trainer``: Trainer keyword arguments, or a built Trainer to run every pass on.
    ``command``: the command line that made the run (the model card quotes it).
    """
    model_cfg, data = model or ModelConfig(), data or TextDataConfig(source=CALIBRATION_SOURCE)
    heldout = heldout if heldout is not None else default_heldout()
    prune, calibration = prune or PruneConfig(), calibration or CalibrationConfig()
    if dist.launch_rank() == 0:
        prepare_output(output_dir, overwrite, local_inputs(model_cfg if built is None else None, data=data,
                                                           heldout=heldout))
    check_early(prune, data, calibration, heldout)
    if evaluate is not None:
        evaluate.validate("--evaluate.", need_something=False)
    t0 = time.time()

    lm, tokenizer = built if built is not None else load_pretrained(model_cfg)
    if tokenizer is None:
        raise ConfigError("The model has no tokenizer; calibration needs one to tokenise the data")
    if placement_of(lm).onloaded:
        check_onloadable(prune, calibration, evaluate, save_model)
    base_fingerprint = weights_fingerprint(lm) if save_model == "adapters" else None  # the base, as loaded
    n_layers = len(decoder_layers(lm))
    if prune.layers is not None:  # index checks need the model's depth, but not the data
        check_layers(list(prune.layers), n_layers)
    else:
        num_to_remove(n_layers, prune.ratio)
    model_type = lm.config.model_type
    if calibration.refit_kept:  # the layout is the model's: refuse before any pass
        check_block(decoder_layers(lm)[0], f"{model_type} blocks")
    windows = build_windows(data, tokenizer, model_type, "--data")
    heldout_windows = build_windows(heldout, tokenizer, model_type, "--heldout") \
        if (calibration.heldout and heldout.num_samples > 0) else None
    check_windows(lm, windows, "--data")  # before any pass
    calibration.check_dim(lm.config.hidden_size, warn=False)  # errors now; the module warns
    if heldout_windows is not None:
        check_windows(lm, heldout_windows, "--heldout", fitting=False)
    if evaluate is not None and evaluate.ppl:
        check_seq_len(lm, evaluate.ppl_seq_len, "--evaluate.ppl_seq_len")
    make_trainer = make_trainer_factory(trainer)

    selection = select_blocks(prune, lm, windows, make_trainer)
    if not selection.layers:
        log.warning("No block selected for removal (ratio %.3f of %d blocks)", prune.ratio, n_layers)
    t_sel = time.time()
    do_eval = evaluate is not None and bool(evaluate.tasks or evaluate.ppl)
    evals: dict[str, dict] = {}
    scorer = ModelEvaluation(lm, tokenizer, evaluate, make_trainer) if do_eval else None
    if do_eval and evaluate_baselines:  # the original's distributions are recorded in the same pass
        evals["original"] = scorer("original", record=True)
    elif do_eval:  # closeness of every later evaluation to the original
        scorer.record_reference()

    params_before = num_params(lm)
    module = CalibrationModule(lm, selection.layers, calibration, keep_statistics=False)
    if selection.layers:
        module.calibrate(make_trainer(), windows, heldout_windows, batch_size=data.batch_size, check=False)
    module.drop_statistics()
    correction = module.correction() if selection.layers else Correction(calibration.solver)
    site_reports, span_reports = module.site_reports(), module.span_reports()
    del module  # the solutions and per-site adapters (d² floats each): the correction holds the maps, the report the rest
    closeness, t_close = heldout_report(lm, selection.layers, correction, make_trainer, heldout_windows,
                                        heldout.batch_size)
    adapters = correction.adapters
    for note in correction.notes:
        log.warning(note)
    original = original_copy(lm) if calibration.refit_kept and selection.layers else None
    remove_blocks(lm, selection.layers)
    t_cal = time.time()
    if do_eval and evaluate_baselines:
        evals["pruned"] = scorer("pruned")
    apply_correction(lm, correction, n_layers, selection.layers)
    refit = None
    if original is not None:  # windows shared out over ranks, statistics and scores summed: one result
        pairs = refit_pairs(selection.layers, n_layers, calibration.refit_kept)
        log.info("Re-fitting kept blocks %s (relative damping %g)", [o for _, o in pairs], calibration.refit_damping)
        refit = guarded_refit(lm, original, windows, pairs, calibration.refit_damping, calibration.heldout_every,
                              calibration.guard_topk, progress=lambda o, kl, keep: log.info(
                                  "kept block %d re-fitted: held-out KL %.4f, %s", o, kl, "kept" if keep else "undone"),
                              rank=dist.rank(), world=dist.world_size(), reduce=dist.all_reduce_flat,
                              device=make_trainer().strategy.root_device if placement_of(lm).onloaded else None)
        del original
    t_fit = time.time()
    if do_eval:
        label = f"pruned+{calibration.solver}" + ("+refit" if refit and refit["kept"] else "")
        evals[label] = scorer(label)

    report = CalibrationReport(
        model=model_cfg.name_or_path if model_cfg.tiny is None else {"tiny": model_cfg.tiny}, model_type=model_type,
        original_num_layers=n_layers, pruned_layers=selection.layers, selection=selection.to_dict(),
        calibration=asdict(calibration), data=asdict(data),
        heldout_data=asdict(heldout) if heldout_windows is not None else None,
        calibration_tokens=windows.num_tokens,
        heldout_tokens=heldout_windows.num_tokens if heldout_windows is not None else 0,
        world_size=dist.world_size(), sites=site_reports, spans=span_reports,
        adapters=_adapter_table(n_layers, selection.layers, adapters), branch_maps=sorted(correction.branch_maps),
        notes=correction.notes, params_before=params_before, params_after=num_params(lm),
        seconds={"selection": t_sel - t0, "calibration": t_cal - t_sel - t_close,
                 **({"heldout_closeness": t_close} if closeness else {}),
                 **({"refit": t_fit - t_cal} if refit else {}), "total": time.time() - t0},
        evaluation=evals or None, refit=refit, heldout_closeness=closeness)
    if output_dir is not None and dist.rank() == 0:
        spec = ShiftSpec(n_layers, selection.layers, base_model=report.model, criterion=selection.criterion,
                         correction=calibration.solver, refit_blocks=refit_positions(refit),
                         base_fingerprint=base_fingerprint)

        card = CardFacts(command=command, calibration=report.to_dict())

        def write(tmp: Path):
            if save_model == "adapters":
                kept = [i for i in range(n_layers) if i not in set(selection.layers)]
                save_adapters(lm, tokenizer, tmp, spec, asdict(model_cfg),
                              {kept.index(i): T for i, T in correction.branch_maps.items()}, card=card,
                              down={kept.index(i): wb for i, wb in correction.down_maps.items()},
                              embedding=correction.embedding)
            elif save_model:
                save_pretrained(lm, tokenizer, tmp, spec, card=card)
            for name, doc in (extra_files or {}).items():
                (tmp / name).write_text(json.dumps(doc, indent=2))
            (tmp / "calibration_report.json").write_text(json.dumps(report.to_dict(), indent=2))
            (tmp / "calibration_report.md").write_text(report.markdown())
            if resolved_config:
                (tmp / "config.yaml").write_text(resolved_config)

        publish_dir(output_dir, write, kind="calibration", overwrite=overwrite)
        log.info("Wrote %s", output_dir)
    dist.barrier()
    return CalibrationResult(report, lm, tokenizer, Path(output_dir) if output_dir else None)


def heldout_report(lm, removed: list[int], correction, make_trainer, windows, batch_size: int) -> tuple[dict | None, float]:
    """An onloaded run's stand-in for ``--evaluate``: the block-major held-out report
    (:class:`~shift_lightning.evaluation.heldout.HeldoutCloseness`) and its seconds; ``(None, 0)`` otherwise."""
    if not (placement_of(lm).onloaded and windows is not None and removed):
        return None, 0.0
    t0 = time.time()
    report = HeldoutCloseness(lm, removed, correction)
    report.run(make_trainer(), windows, batch_size)
    return report.results, time.time() - t0


def refit_positions(refit: dict | None) -> list[int] | None:
    """Pruned positions of the kept blocks the re-fit changed (``shift_config.json``'s ``refit_blocks``)."""
    return [b["position"] for b in refit["blocks"]] if refit and refit["kept"] else None


class ModelEvaluation:
    """Zero-shot / perplexity / closeness evaluations of one in-memory model as it is pruned and
    corrected in place, through ``trainer.predict`` (1 or N processes); docs and windows are loaded
    once, the original's distributions recorded once (:meth:`record_reference`)."""

    def __init__(self, model, tokenizer, cfg, make_trainer):
        from ..evaluation.runner import EvalModule

        self.module, self.make_trainer = EvalModule(model, tokenizer, cfg), make_trainer

    def record_reference(self) -> None:
        self.module.record_reference(self.make_trainer())

    def __call__(self, label: str, record: bool = False) -> dict:
        self.module.stage = f"evaluation ({label} model)"
        return self.module.evaluate(self.make_trainer(), record=record)


def _adapter_table(n_layers: int, removed: list[int], adapters: dict) -> list[dict]:
    pos = pruned_positions(n_layers, removed)
    return [{"position": p, "replaces_blocks": [i for i in removed if pos[i] == p], "params": num_params(a)}
            for p, a in sorted(adapters.items())]


