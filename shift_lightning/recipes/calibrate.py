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
from ..calibration import CalibrationConfig, CalibrationModule, check_windows
from ..criteria import CRITERIA, CriterionError, PruneConfig, check_layers, num_to_remove
from ..config import CALIBRATION_SOURCE
from ..data import DataError, TextDataConfig, build_windows, check_seq_len
from ..config import default_heldout
from ..errors import ConfigError
from ..models import ModelConfig, num_params
from ..evaluation.heldout import HeldoutCloseness
from ..outputs.fingerprints import weights_fingerprint
from ..outputs import prepare_output, publish_dir
from ..placement import original_copy, placement_of
from ..progress import with_stage_progress
from ..reports import CalibrationReport
from ..stopping import with_signal_guard
from ..selection import ONLOAD_CRITERIA, select_blocks
from ..maps import FittedMaps, pruned_positions
from ..card import CardFacts
from ..checkpoint import ShiftSpec, load_pretrained, save_adapters, save_pretrained
from ..maps.keptfit import check_block, guarded_refit, refit_pairs
from ..maps.surgery import apply_maps, remove_blocks

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
    """Prune + calibrate; write the corrected model and ``calibration_report.json`` to ``output_dir``
    (the steps: :class:`CalibrationRecipe`).

    ``built=(model, tokenizer)`` injects an already loaded model (tests, notebooks).
    ``evaluate`` (an :class:`~shift_lightning.evaluation.runner.EvalConfig` with tasks and/or
    perplexity sets) evaluates the corrected model, and with ``evaluate_baselines`` also the
    original and the pruned-without-adapters model, on the same Trainer (1 or N processes).
    ``resolved_config`` (YAML text) is saved as ``config.yaml`` next to the outputs.
    ``save_model="adapters"`` writes an adapter-only folder (the base model is named, not copied).
    ``trainer``: Trainer keyword arguments, or a built Trainer to run every pass on.
    ``command``: the command line that made the run (the model card quotes it).
    """
    job = CalibrationJob(
        model=model or ModelConfig(), data=data or TextDataConfig(source=CALIBRATION_SOURCE),
        heldout=heldout if heldout is not None else default_heldout(), prune=prune or PruneConfig(),
        calibration=calibration or CalibrationConfig(), trainer=trainer, output_dir=output_dir, overwrite=overwrite,
        save_model=save_model, built=built, evaluate=evaluate, evaluate_baselines=evaluate_baselines,
        resolved_config=resolved_config, extra_files=extra_files, command=command)
    return CalibrationRecipe(job).run()


@dataclass
class CalibrationJob:
    """What one calibration job is asked to do, defaults filled in (the arguments of :func:`run_calibration`)."""

    model: ModelConfig
    data: TextDataConfig
    heldout: TextDataConfig
    prune: PruneConfig
    calibration: CalibrationConfig
    trainer: dict | L.Trainer | None = None
    output_dir: str | None = None
    overwrite: bool = False
    save_model: bool | Literal["adapters"] = True
    built: tuple | None = None
    evaluate: Any = None
    evaluate_baselines: bool = False
    resolved_config: str | None = None
    extra_files: dict[str, Any] | None = None
    command: str | None = None


class CalibrationRecipe:
    """One calibration job as named steps, run in this order by :meth:`run` (as :class:`RecoveryRecipe` runs
    training):

    ``setup``      every check before any pass: the output folder prepared (rank 0), the model loaded, the
                   windows built and checked against it;
    ``select``     the blocks to remove (``--prune.*``); the original evaluated or its distributions recorded when
                   ``--evaluate`` asks;
    ``calibrate``  the maps fitted (:class:`~shift_lightning.calibration.CalibrationModule`), an onloaded run's
                   held-out report, the blocks removed and the maps put in place;
    ``refit``      the guarded re-fit of the kept blocks (``--calibration.refit.kept``), then the evaluation;
    ``report``     the :class:`~shift_lightning.reports.CalibrationReport`;
    ``save``       rank 0 publishes ``<output_dir>``: the model (or its adapters), the report, ``config.yaml``.
    """

    def __init__(self, job: CalibrationJob):
        self.job = job
        self.seconds: dict[str, float] = {}  # step -> its seconds, evaluations apart ("evaluation")
        self.evals: dict[str, dict] = {}

    def run(self) -> CalibrationResult:
        t0 = time.time()
        for step in (self.setup, self.select, self.calibrate, self.refit):
            t, before = time.time(), self.seconds.get("evaluation", 0.0)
            step()
            self.seconds[step.__name__] = time.time() - t - (self.seconds.get("evaluation", 0.0) - before)
        report = self.report(time.time() - t0)
        self.save(report)
        dist.barrier()
        job = self.job
        return CalibrationResult(report, self.lm, self.tokenizer, Path(job.output_dir) if job.output_dir else None)

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        """Every check before any pass (cheap ones before the model is loaded)."""
        job = self.job
        if dist.launch_rank() == 0:
            prepare_output(job.output_dir, job.overwrite, local_inputs(job.model if job.built is None else None,
                                                                       data=job.data, heldout=job.heldout))
        check_early(job.prune, job.data, job.calibration, job.heldout)
        if job.evaluate is not None:
            job.evaluate.validate("--evaluate.", need_something=False)
        self.lm, self.tokenizer = job.built if job.built is not None else load_pretrained(job.model)
        if self.tokenizer is None:
            raise ConfigError("The model has no tokenizer; calibration needs one to tokenise the data")
        self._check_model()
        self._build_windows()
        self.make_trainer = make_trainer_factory(job.trainer)

    def _check_model(self) -> None:
        job, lm = self.job, self.lm
        if placement_of(lm).onloaded:
            check_onloadable(job.prune, job.calibration, job.evaluate, job.save_model)
        self.base_fingerprint = weights_fingerprint(lm) if job.save_model == "adapters" else None  # as loaded
        self.n_layers = len(decoder_layers(lm))
        if job.prune.layers is not None:  # index checks need the model's depth, but not the data
            check_layers(list(job.prune.layers), self.n_layers)
        else:
            num_to_remove(self.n_layers, job.prune.ratio)
        if job.calibration.refit.kept:  # the layout is the model's: refuse before any pass
            check_block(decoder_layers(lm)[0], f"{lm.config.model_type} blocks")

    def _build_windows(self) -> None:
        job, lm, model_type = self.job, self.lm, self.lm.config.model_type
        self.windows = build_windows(job.data, self.tokenizer, model_type, "--data")
        self.heldout_windows = build_windows(job.heldout, self.tokenizer, model_type, "--heldout") \
            if (job.calibration.heldout and job.heldout.num_samples > 0) else None
        check_windows(lm, self.windows, "--data")  # before any pass
        job.calibration.check_dim(lm.config.hidden_size, warn=False)  # errors now; the module warns
        if self.heldout_windows is not None:
            check_windows(lm, self.heldout_windows, "--heldout", fitting=False)
        if job.evaluate is not None and job.evaluate.ppl:
            check_seq_len(lm, job.evaluate.ppl_seq_len, "--evaluate.ppl_seq_len")

    # ---------------------------------------------------------------- select
    def select(self) -> None:
        """The blocks to remove; the original's evaluation (or its recorded distributions) when asked."""
        job = self.job
        self.selection = select_blocks(job.prune, self.lm, self.windows, self.make_trainer)
        if not self.selection.layers:
            log.warning("No block selected for removal (ratio %.3f of %d blocks)", job.prune.ratio, self.n_layers)
        ev = job.evaluate
        self.scorer = ModelEvaluation(self.lm, self.tokenizer, ev, self.make_trainer) \
            if ev is not None and bool(ev.tasks or ev.ppl) else None
        if self.scorer is not None and job.evaluate_baselines:  # the original's distributions, in the same pass
            self._evaluate("original", record=True)
        elif self.scorer is not None:  # closeness of every later evaluation to the original
            self.scorer.record_reference()

    # ---------------------------------------------------------------- calibrate
    def calibrate(self) -> None:
        """The maps fitted on the windows, the blocks removed and the maps put in place."""
        job, lm, layers = self.job, self.lm, self.selection.layers
        self.params_before = num_params(lm)
        module = CalibrationModule(lm, layers, job.calibration, keep_statistics=False)
        if layers:
            module.calibrate(self.make_trainer(), self.windows, self.heldout_windows, batch_size=job.data.batch_size,
                             check=False)
        module.drop_statistics()
        self.correction = module.fitted_maps() if layers else FittedMaps(job.calibration.solver)
        self.site_reports, self.span_reports = module.site_reports(), module.span_reports()
        del module  # the solutions and per-site adapters (d² floats each): the correction holds the maps
        self.closeness, self.seconds["heldout_closeness"] = heldout_report(
            lm, layers, self.correction, self.make_trainer, self.heldout_windows, job.heldout.batch_size)
        for note in self.correction.notes:
            log.warning(note)
        self.original = original_copy(lm) if job.calibration.refit.kept and layers else None
        remove_blocks(lm, layers)
        if self.scorer is not None and job.evaluate_baselines:
            self._evaluate("pruned")
        apply_maps(lm, self.correction, self.n_layers, layers)

    # ---------------------------------------------------------------- refit
    def refit(self) -> None:
        """The guarded re-fit of the kept blocks (windows shared out over ranks, statistics and scores summed: one
        result), then the corrected model's evaluation."""
        cal, lm = self.job.calibration, self.lm
        self.refit_result = None
        if self.original is not None:
            pairs = refit_pairs(self.selection.layers, self.n_layers, cal.refit.kept)
            log.info("Re-fitting kept blocks %s (relative damping %g)", [o for _, o in pairs], cal.refit.damping)
            self.refit_result = guarded_refit(
                lm, self.original, self.windows, pairs, cal.refit.damping, cal.heldout_every, cal.heldout_topk,
                progress=lambda o, kl, keep: log.info("kept block %d re-fitted: held-out KL %.4f, %s", o, kl,
                                                      "kept" if keep else "undone"),
                rank=dist.rank(), world=dist.world_size(), reduce=dist.all_reduce_flat,
                device=self.make_trainer().strategy.root_device if placement_of(lm).onloaded else None)
            self.original = None
        if self.scorer is not None:
            label = f"pruned+{cal.solver}" + ("+refit" if self.refit_result and self.refit_result["kept"] else "")
            self._evaluate(label)

    def _evaluate(self, label: str, record: bool = False) -> None:
        t = time.time()
        self.evals[label] = self.scorer(label, record=record)
        self.seconds["evaluation"] = self.seconds.get("evaluation", 0.0) + time.time() - t

    # ---------------------------------------------------------------- report
    def report(self, total: float) -> CalibrationReport:
        job, sel, s = self.job, self.selection, self.seconds
        m, hw, refit = job.model, self.heldout_windows, self.refit_result
        seconds = {"selection": s["setup"] + s["select"], "calibration": s["calibrate"] - s["heldout_closeness"],
                   **({"heldout_closeness": s["heldout_closeness"]} if self.closeness else {}),
                   **({"refit": s["refit"]} if refit else {}),
                   **({"evaluation": s["evaluation"]} if "evaluation" in s else {}), "total": total}
        return CalibrationReport(
            model=m.name_or_path if m.tiny is None else {"tiny": m.tiny}, model_type=self.lm.config.model_type,
            original_num_layers=self.n_layers, pruned_layers=sel.layers, selection=sel.to_dict(),
            calibration=asdict(job.calibration), data=asdict(job.data),
            heldout_data=asdict(job.heldout) if hw is not None else None, calibration_tokens=self.windows.num_tokens,
            heldout_tokens=hw.num_tokens if hw is not None else 0, world_size=dist.world_size(),
            sites=self.site_reports, spans=self.span_reports,
            adapters=_adapter_table(self.n_layers, sel.layers, self.correction.adapters),
            branch_maps=sorted(self.correction.branch_maps), notes=self.correction.notes,
            params_before=self.params_before, params_after=num_params(self.lm), seconds=seconds,
            evaluation=self.evals or None, refit=refit, heldout_closeness=self.closeness)

    # ---------------------------------------------------------------- save
    def save(self, report: CalibrationReport) -> None:
        """Rank 0 publishes ``<output_dir>`` at once (nothing of a failed run is left there)."""
        job = self.job
        if job.output_dir is None or dist.rank() != 0:
            return
        sel, corr = self.selection, self.correction
        spec = ShiftSpec(self.n_layers, sel.layers, base_model=report.model, criterion=sel.criterion,
                         solver=job.calibration.solver, refit_blocks=refit_positions(self.refit_result),
                         base_fingerprint=self.base_fingerprint)
        card = CardFacts(command=job.command, calibration=report.to_dict())

        def write(tmp: Path):
            if job.save_model == "adapters":
                kept = [i for i in range(self.n_layers) if i not in set(sel.layers)]
                save_adapters(self.lm, self.tokenizer, tmp, spec, asdict(job.model),
                              {kept.index(i): T for i, T in corr.branch_maps.items()}, card=card,
                              down={kept.index(i): wb for i, wb in corr.down_maps.items()}, embedding=corr.embedding)
            elif job.save_model:
                save_pretrained(self.lm, self.tokenizer, tmp, spec, card=card)
            for name, doc in (job.extra_files or {}).items():
                (tmp / name).write_text(json.dumps(doc, indent=2))
            (tmp / "calibration_report.json").write_text(json.dumps(report.to_dict(), indent=2))
            (tmp / "calibration_report.md").write_text(report.markdown())
            if job.resolved_config:
                (tmp / "config.yaml").write_text(job.resolved_config)

        publish_dir(job.output_dir, write, kind="calibration", overwrite=job.overwrite)
        log.info("Wrote %s", job.output_dir)


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


