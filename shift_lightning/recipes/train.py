"""The training recipe: one job from a model to a recovered model.

    model (HF id / folder / embedded name)  ──select, prune, calibrate (same Trainer, same DDP ranks)──>
        <output_dir>.calibration/   report + adapter-only folder (reused when the job is run again)
    ──recover (LoRA / partial / LRAs; TensorBoard: val/ppl, zeroshot/*, train/*)──>
        <output_dir>.ckpt/last.ckpt  trainable tensors + optimizer + scheduler + loop (also on a stop)
    ──export──> <output_dir>/        merged model + recovery_report.json + config.yaml + README.md (card);
                 <output_dir>/lora/   under LoRA: the adapter in PEFT's format (LRAs trained with it inside)
                 <output_dir>/base/   ... on top of this corrected base (pruned + repaired, before recovery)

The job runs as named steps (:class:`RecoveryRecipe`: setup → calibrate → fit → validate → save); the
:class:`~shift_lightning.recovery.RecoveryModule` only trains and validates, the recipe writes every folder.
Given a calibrated folder (``calibrate.py`` output or ``<output_dir>.calibration``) as
``--model.name_or_path``, the calibration stage is skipped. ``--ckpt_path last`` resumes.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.strategies import FSDPStrategy
from torch import nn

from .. import dist
from ..arch import decoder_layers
from ..calibration import CalibrationConfig
from ..card import CardFacts, base_model_name
from ..criteria import PruneConfig
from ..config import default_heldout
from ..config import CALIBRATION_SOURCE
from ..data import TextDataConfig, build_windows
from ..errors import ConfigError
from ..export.merged import export_recovered
from ..evaluation.runner import EvalConfig
from ..models import ModelConfig
from ..outputs import prepare_output, publish_dir
from ..finite import check_trained
from ..outputs.fingerprints import input_digest, read_key
from ..precheck import check_training
from ..remote_code import base_model_settings
from ..reports import RecoveryReport
from ..recovery import RecoveryConfig, RecoveryModule
from ..stepdata import RecoveryData
from ..stepdata import visited
from ..checkpoint import ShiftSpec, is_shift_folder, load_pretrained, read_shift_config
from ..resume import (AtomicCheckpointIO, check_checkpoint_dir, check_run, clear_checkpoints, read_checkpoint,
                      resolve_resume, run_key, run_settings)
from .calibrate import check_early, local_inputs
from .trainer import RecoveryTrainerConfig
from .trainer import build_trainer as lightning_trainer

log = logging.getLogger(__name__)

#: Trainer settings training relies on (the knobs are :class:`~.trainer.RecoveryTrainerConfig`, ``--trainer.*``).
RECOVERY_TRAINER_DEFAULTS: dict = dict(
    check_val_every_n_epoch=None, use_distributed_sampler=False, inference_mode=False, num_sanity_val_steps=0,
    enable_model_summary=False,
)


def build_trainer(cfg: RecoveryTrainerConfig, output_dir: str | None, zeroshot: EvalConfig | None = None) -> L.Trainer:
    """The training Trainer: ``--trainer.*`` over :data:`RECOVERY_TRAINER_DEFAULTS`, ``fsdp`` sharded block by
    block (:class:`DecoderFSDPStrategy`), checkpoints, zero-shot accuracy, progress lines and the stop guards."""
    from ..progress import with_stage_progress
    from ..stopping import with_signal_guard

    kw = {**RECOVERY_TRAINER_DEFAULTS, **cfg.kwargs()}
    if kw["strategy"] == "fsdp":
        kw["strategy"] = DecoderFSDPStrategy()
    kw["callbacks"] = training_callbacks(output_dir, zeroshot, cfg.val_check_interval)
    return lightning_trainer(**with_signal_guard(with_stage_progress(kw)))


@dataclass
class RecoveryResult:
    report: RecoveryReport
    """Trainable parameters, steps, metrics before / after, loss history, seconds (``recovery_report.json``)."""
    module: RecoveryModule
    output_dir: Path | None = None


def calibration_dir(output_dir: str | Path) -> Path:
    out = Path(output_dir)
    return out.with_name(out.name + ".calibration")


def checkpoint_dir(output_dir: str | Path) -> Path:
    out = Path(output_dir)
    return out.with_name(out.name + ".ckpt")


def base_model_config(spec: dict) -> ModelConfig | None:
    """The unpruned model a saved folder's record names (``None`` when it names none)."""
    base = spec.get("base_model")
    if isinstance(base, dict):
        return ModelConfig(tiny=base["tiny"]) if set(base) == {"tiny"} else ModelConfig(**base_model_settings(base))
    return ModelConfig(name_or_path=base) if isinstance(base, str) else None


def _calibrated_model(trainer: L.Trainer, model_cfg: ModelConfig, calib: dict, output_dir: str | None,
                      overwrite: bool, resolved_config: str | None, on_original=None):
    """``(model, tokenizer, spec)``: a calibrated folder as given, the job's own earlier calibration,
    or a fresh calibration on ``trainer`` written to ``<output_dir>.calibration``. ``on_original(model,
    tokenizer)`` sees the unpruned model first (the closeness reference is recorded from it)."""
    from .calibrate import refit_positions, run_calibration

    def original_of(spec: dict) -> None:
        base = base_model_config(spec)
        if on_original is None or base is None:
            return
        try:
            on_original(*load_pretrained(base))
        except Exception as e:  # the base model is gone or unreachable: train without val/kl
            log.warning("Could not load the base model %s (%s): no val/kl", base.name_or_path, e)

    if model_cfg.tiny is None and is_shift_folder(model_cfg.name_or_path):
        lm, tokenizer = load_pretrained(model_cfg)
        spec = read_shift_config(model_cfg.name_or_path).to_dict()
        log.info("Recovering the calibrated model in %s (no calibration)", model_cfg.name_or_path)
        original_of(spec)
        return lm, tokenizer, spec
    key = {"model": asdict(model_cfg), **{k: asdict(v) for k, v in calib.items()}}
    key["content"] = input_digest(model_cfg, calib)  # reused only for the same bytes, not just the same names
    calib_dir = calibration_dir(output_dir) if output_dir else None
    if calib_dir is not None and is_shift_folder(calib_dir):
        done = read_key(calib_dir)
        if done == json.loads(json.dumps(key)):
            log.info("Reusing the calibration in %s (same model, data, pruning and calibration settings)", calib_dir)
            lm, tokenizer = load_pretrained(calib_dir)
            spec = read_shift_config(calib_dir).to_dict()
            original_of(spec)
            return lm, tokenizer, spec
        if not overwrite:
            raise ConfigError(f"{calib_dir} holds a calibration with other settings; pass --overwrite to redo it or "
                              "choose another --output_dir")
    if calib_dir is not None and dist.launch_rank() == 0:
        prepare_output(calib_dir, overwrite=True)  # replaced below: never a foreign folder or a file someone added
    built = load_pretrained(model_cfg)
    if on_original is not None:
        on_original(*built)
    result = run_calibration(model=model_cfg, data=calib["data"], heldout=calib["heldout"], prune=calib["prune"],
                             calibration=calib["calibration"], trainer=trainer, output_dir=str(calib_dir) if calib_dir else None,
                             overwrite=True, save_model="adapters", resolved_config=resolved_config,
                             extra_files={"calibration_key.json": key}, built=built)
    r = result.report
    spec = ShiftSpec(r.original_num_layers, r.pruned_layers, base_model=r.model, criterion=r.criterion,
                     solver=calib["calibration"].solver, refit_blocks=refit_positions(r.refit)).to_dict()
    return result.model, result.tokenizer, spec


def run_training(
    trainer: L.Trainer,
    model: ModelConfig | None = None,
    data: TextDataConfig | None = None,
    heldout: TextDataConfig | None = None,
    prune: PruneConfig | None = None,
    calibration: CalibrationConfig | None = None,
    train_data: TextDataConfig | None = None,
    val: TextDataConfig | None = None,
    recovery: RecoveryConfig | None = None,
    output_dir: str | None = None,
    overwrite: bool = False,
    ckpt_path: str | None = None,
    built: tuple | None = None,
    resolved_config: str | None = None,
    reference: nn.Module | None = None,
    save_peft: bool = True,
    command: str | None = None,
) -> RecoveryResult:
    """The whole job (see the module docstring and :class:`RecoveryRecipe`). ``trainer`` comes built
    (``--trainer.*``: devices, strategy, precision, max_steps, logger, callbacks); ``built=(model, tokenizer,
    spec)`` injects an already corrected model (tests, notebooks), ``reference`` its unpruned original
    (``val/kl``). ``save_peft``: under LoRA also write ``lora/`` (PEFT adapter) and ``base/`` (the corrected
    base); ``command``: the command line of the job (the model card quotes it)."""
    job = TrainingJob(
        model=model or ModelConfig(), train_data=train_data or TextDataConfig(num_samples=256, seed=1), val=val,
        calib={"data": data or TextDataConfig(source=CALIBRATION_SOURCE), "heldout": heldout or default_heldout(),
               "prune": prune or PruneConfig(), "calibration": calibration or CalibrationConfig()},
        recovery=recovery or RecoveryConfig(), output_dir=output_dir, overwrite=overwrite, ckpt_path=ckpt_path,
        built=built, resolved_config=resolved_config, reference=reference, save_peft=save_peft, command=command)
    return RecoveryRecipe(trainer, job).run()


@dataclass
class TrainingJob:
    """What one training job is asked to do, defaults filled in (the arguments of :func:`run_training`)."""

    model: ModelConfig
    calib: dict[str, Any]
    """``data``, ``heldout``, ``prune``, ``calibration``: how the job calibrates when it has to."""
    train_data: TextDataConfig
    val: TextDataConfig | None
    recovery: RecoveryConfig
    output_dir: str | None = None
    overwrite: bool = False
    ckpt_path: str | None = None
    built: tuple | None = None
    resolved_config: str | None = None
    reference: nn.Module | None = None
    save_peft: bool = True
    command: str | None = None


class RecoveryRecipe:
    """One training job as named steps, run in this order by :meth:`run` (torchtune's recipe style):

    ``setup``      every check before any compute, the resume state, the output folder prepared (rank 0);
    ``calibrate``  the corrected model: injected, a calibrated folder, or calibrated now into
                   ``<output_dir>.calibration``; the original's distributions are recorded on the way;
    ``fit``        one validation at step 0 (unless resuming), then ``trainer.fit`` of the
                   :class:`~shift_lightning.recovery.RecoveryModule` (which trains and validates only);
    ``validate``   the final model, unless its last step was just validated;
    ``save``       rank 0 publishes ``<output_dir>`` at once: the merged model (+ ``lora/``, ``base/``),
                   ``recovery_report.json``, ``config.yaml``.
    """

    def __init__(self, trainer: L.Trainer, job: TrainingJob):
        self.trainer, self.job = trainer, job
        m = job.model
        self.calibrating = job.built is None and not (m.tiny is None and is_shift_folder(m.name_or_path))
        self.ckpt_dir = checkpoint_dir(job.output_dir) if job.output_dir else None
        self.closeness: dict = {}  # the original's distributions: "ref" (validation windows), "teacher" (kd)

    def run(self) -> RecoveryResult:
        self.setup()
        t0 = time.time()
        self.calibrate()
        t_cal = time.time()
        self.fit()
        self.validate()
        report = self.report({"calibration": t_cal - t0, "fit": self.seconds_fit, "total": time.time() - t0})
        self.save(report)
        dist.barrier()
        return RecoveryResult(report, self.module, Path(self.job.output_dir) if self.job.output_dir else None)

    # ---------------------------------------------------------------- setup
    def setup(self) -> None:
        """Every check before any compute (and before the calibration this job may run first)."""
        job, trainer = self.job, self.trainer
        job.recovery.validate()
        job.train_data.validate("--train_data")
        if job.val is not None:
            job.val.validate("--val", optional=True)
        if self.calibrating:
            check_early(job.calib["prune"], job.calib["data"], job.calib["calibration"], job.calib["heldout"])
        check_maps_trainable(job.recovery, job.calib["calibration"].solver if self.calibrating else None,
                             job.model.name_or_path if job.built is None and not self.calibrating else None)
        check_schedule(trainer, job.val)
        check_training(job.model if job.built is None else None, job.train_data, job.recovery)  # format, LoRA targets
        self.settings = run_settings(self._sections(), trainer)
        self.resume_from = resolve_resume(job.ckpt_path, self.ckpt_dir)
        self.resumed = read_checkpoint(self.resume_from) if self.resume_from is not None else None
        if self.resumed is not None:
            check_run(self.resumed, self.resume_from, self.settings)
        if dist.launch_rank() == 0:
            self._prepare_folders()

    def _sections(self) -> dict:
        """The settings that make this run what it is (a checkpoint of another run is refused)."""
        job = self.job
        sections = {"model": job.model, **(job.calib if self.calibrating else {}), "train_data": job.train_data,
                    "val": job.val, "recovery": job.recovery}
        if job.built is not None:
            sections = {"spec": {k: job.built[2].get(k) for k in ("original_num_layers", "pruned_layers")}, **sections}
            sections.pop("model")
        return sections

    def _prepare_folders(self) -> None:
        job, calibrating = self.job, self.calibrating
        inputs = local_inputs(job.model if job.built is None else None,
                              data=job.calib["data"] if calibrating else None,
                              heldout=job.calib["heldout"] if calibrating else None, train_data=job.train_data, val=job.val)
        prepare_output(job.output_dir, job.overwrite or self.resumed is not None, inputs)  # a resumed run replaces its own result
        check_checkpoint_dir(self.ckpt_dir, resuming=self.resumed is not None, overwrite=job.overwrite)

    # ---------------------------------------------------------------- calibrate
    def calibrate(self) -> None:
        """``self.lm, self.tokenizer, self.spec``: the corrected model and the record its export starts from."""
        job = self.job
        if job.built is not None:
            self.lm, self.tokenizer, spec = job.built
            if job.reference is not None:
                self.record_original(job.reference, self.tokenizer)
        else:
            self.lm, self.tokenizer, spec = _calibrated_model(self.trainer, job.model, job.calib, job.output_dir,
                                                              job.overwrite, job.resolved_config, self.record_original)
        self.spec = _recovery_spec(spec, self.lm)

    def record_original(self, original: nn.Module, tokenizer) -> None:
        """The unpruned model's distributions: on the validation windows (``val/kl``) and, under
        ``loss="kd"``, on the training windows this rank will read (the teacher)."""
        from ..closeness import window_references

        rec, val = self.job.recovery, self.job.val
        if rec.val_kl and val is not None and val.num_samples > 0:
            w = build_windows(val, tokenizer, original.config.model_type, "--val")
            self.closeness["ref"] = window_references(original, w.input_ids, w.attention_mask, rec.val_kl_topk,
                                                      val.batch_size)
        if rec.loss == "kd":
            self.closeness["teacher"] = self._teacher(original, tokenizer)

    def _teacher(self, original: nn.Module, tokenizer) -> dict:
        """The original's top ``kd_topk`` on only the training windows this rank reads in ``max_steps`` steps."""
        from ..closeness import window_references
        from ..progress import stage_bar

        trainer, rec, data = self.trainer, self.job.recovery, self.job.train_data
        t = time.time()
        w = build_windows(data, tokenizer, original.config.model_type, "--train_data")
        idx = visited(len(w), data.batch_size, trainer.global_rank, trainer.world_size, rec.seed,
                      max(int(trainer.max_steps), 0) * trainer.accumulate_grad_batches)
        bar = stage_bar("teacher distributions (kd)", -(-len(idx) // data.batch_size)) \
            if trainer.is_global_zero and trainer.progress_bar_callback is not None else None
        try:
            refs = window_references(original, w.input_ids[idx], w.attention_mask[idx], rec.kd_topk,
                                     data.batch_size, on_batch=bar.step if bar is not None else None)
        finally:
            if bar is not None:
                bar.close()
        n = int(w.attention_mask[idx].sum())
        log.info("kd: the original's top %d on the %d of %d training windows read (%d positions, %.0f MB; %.0f s)",
                 rec.kd_topk, len(idx), len(w), n, n * rec.kd_topk * 12 / 2 ** 20, time.time() - t)
        return {i: refs[j] for j, i in enumerate(idx)}

    # ---------------------------------------------------------------- fit
    def fit(self) -> None:
        """Train from the corrected model (or from the checkpoint being resumed); ``self.before``: the
        step-0 validation, ``self.after``: the metrics at the end of training."""
        trainer, resumed = self.trainer, self.resumed
        self._build_module()
        self.before = self._validation_at_step0()
        self.module.metrics_before = self.before
        if resumed is None and trainer.is_global_zero:
            clear_checkpoints(self.ckpt_dir)  # an earlier run's (checked in setup: only with --overwrite)
        dist.barrier()
        self.step0 = int(resumed.get("global_step", 0)) if resumed is not None else trainer.global_step
        self.after: dict = {}
        t = time.time()
        if trainer.max_steps != 0:
            trainer.fit(self.module, datamodule=self.dm, ckpt_path=str(self.resume_from) if resumed is not None else None,
                        weights_only=True)  # nothing unpickled
            self.after = {k: float(v) for k, v in trainer.callback_metrics.items()}
        self.seconds_fit = time.time() - t

    def _build_module(self) -> None:
        """The training and validation windows, the :class:`RecoveryModule` and its data."""
        job, model_type = self.job, self.lm.config.model_type
        self.train_w = build_windows(job.train_data, self.tokenizer, model_type, "--train_data")
        self.val_w = build_windows(job.val, self.tokenizer, model_type, "--val") \
            if job.val is not None and job.val.num_samples > 0 else None
        self.module = RecoveryModule(self.lm, job.recovery, self.spec.get("pruned_layers"),
                                     self.spec.get("original_num_layers"), tokenizer=self.tokenizer,
                                     reference=self.closeness.get("ref"), teacher=self.closeness.get("teacher"))
        self.dm = RecoveryData(self.train_w, self.val_w, batch_size=job.train_data.batch_size, seed=job.recovery.seed)
        self.module.run_info = {"key": run_key(self.settings), "settings": self.settings}

    def _validation_at_step0(self) -> dict:
        if self.resumed is not None:  # the step-0 validation of the run being resumed
            return dict(self.resumed["shift_lightning"].get("metrics_before", {}))
        if self.val_w is None:
            return {}
        self.trainer.validate(self.module, datamodule=self.dm, verbose=False)  # val/ppl, val/kl, zeroshot/*
        return {k: float(v) for k, v in self.trainer.callback_metrics.items()}

    # ---------------------------------------------------------------- validate
    def validate(self) -> None:
        """The final model is always validated (once: not again when its last step just was)."""
        trainer = self.trainer
        if trainer.max_steps != 0 and self.val_w is not None and self.module.last_validated_step != trainer.global_step:
            trainer.validate(self.module, datamodule=self.dm, verbose=False)
        self.after.update({k: float(v) for k, v in trainer.callback_metrics.items()})

    # ---------------------------------------------------------------- report and save
    def report(self, seconds: dict[str, float]) -> RecoveryReport:
        trainer, job = self.trainer, self.job
        steps, t_fit = trainer.global_step, seconds["fit"]
        tokens = (steps - self.step0) * trainer.world_size * job.train_data.batch_size \
            * trainer.accumulate_grad_batches * job.train_data.seq_len
        if steps == 0:
            log.warning("No training step was taken (max_steps %s): the exported model is the calibrated one, "
                        "marked \"recovered\": false", trainer.max_steps)
        check_trained(self.module.model, self.after, steps)  # non-finite is never success (shift_lightning.finite)
        m = job.model
        return RecoveryReport(
            model=m.name_or_path if m.tiny is None else {"tiny": m.tiny}, pruned_layers=self.spec["pruned_layers"],
            recovery=asdict(job.recovery), trainable_params=sum(p.numel() for p in self.module.parameters() if p.requires_grad),
            train_windows=len(self.train_w), train_tokens_per_window=job.train_data.seq_len, steps=steps,
            recovered=steps > 0, metrics_before=self.before, metrics_after=self.after,
            loss_history=self.module.loss_history, world_size=trainer.world_size, seconds=seconds,
            train_tokens_per_s=tokens / t_fit if t_fit > 0 and tokens else None,
            peak_gpu_memory_bytes=torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None)

    def save(self, report: RecoveryReport) -> None:
        """Rank 0 writes ``<output_dir>`` in a temporary folder and publishes it at once. Afterwards
        ``self.module.model`` is the merged plain model."""
        job = self.job
        if job.output_dir is None or not self.trainer.is_global_zero:
            return
        card = CardFacts(command=job.command, calibration=_calibration_report(job.model, job.output_dir, job.built),
                         recovery=report.to_dict())
        spec = {**self.spec, "recovered": report.steps > 0, "recovery_steps": report.steps}
        base_ref = str(Path(job.output_dir).resolve() / "base")

        def write(tmp: Path):
            self.module.model = export_recovered(self.module.model, self.tokenizer, tmp, spec, card, job.save_peft, base_ref)
            (tmp / "recovery_report.json").write_text(json.dumps(report.to_dict(), indent=2))
            if job.resolved_config:
                (tmp / "config.yaml").write_text(job.resolved_config)

        publish_dir(job.output_dir, write, kind="recovery", overwrite=job.overwrite or self.resumed is not None)


def _recovery_spec(spec: dict, lm: nn.Module) -> dict:
    """The corrected model's record, as the recovered model's record starts (no adapter or weight entries)."""
    base = base_model_name(spec.get("base_model"))
    spec = {k: v for k, v in spec.items() if k not in ("adapters", "format_version", "weights", "base_model",
                                                       "branch_maps")}
    if base is not None:
        spec["base_model"] = base
    spec.setdefault("original_num_layers", len(decoder_layers(lm)))
    spec.setdefault("pruned_layers", [])
    return spec


def check_maps_trainable(recovery: RecoveryConfig, solver: str | None = None, folder: str | None = None) -> None:
    """Before any pass: ``--recovery.train_lra`` (and ``method: lra``) train the LRAs, which a solver that places its
    maps elsewhere does not leave (``stock``: folded into the model's existing weights; ``replaceme``: on the MLP
    branch), and a calibrated ``folder`` without adapters does not hold. One line naming the fix (the LoRA trains the
    folded weights like any other weight). An injected model is checked by
    :class:`~shift_lightning.recovery.RecoveryModule`."""
    from ..maps.solvers import SOLVERS

    if not (recovery.train_lra or recovery.method == "lra"):
        return
    spec = read_shift_config(folder) if folder is not None else None
    if solver is not None and SOLVERS[solver].placement != "adapter":
        where = f"--calibration.solver {solver} " + ("folds its maps into the model's existing weights"
                                                     if SOLVERS[solver].placement == "down" else
                                                     "puts its maps on the MLP branch")
    elif spec is not None and not spec.adapters:
        where = f"the calibrated folder {folder} holds none (solver {spec.solver})"
    else:
        return
    if recovery.method == "lra":
        raise ConfigError(f"--recovery.method lra trains only the LRAs, but {where}: there are no LRA parameters; use "
                          "--recovery.method lora or partial (they train the folded weights like any other weight)")
    raise ConfigError(f"--recovery.train_lra true trains the LRAs, but {where}: there are no LRA parameters; set "
                      "--recovery.train_lra false (the LoRA trains the folded weights like any other weight)")


def check_schedule(trainer: L.Trainer, val: TextDataConfig | None) -> None:
    """Warn when no validation falls inside the training (the final model is validated anyway)."""
    every, steps = trainer.val_check_interval, trainer.max_steps
    if val is None or val.num_samples == 0 or not isinstance(every, int) or steps is None or steps <= 0:
        return
    batches = steps * trainer.accumulate_grad_batches
    if every > batches:
        log.warning("--trainer.val_check_interval %d is more than the %d training batches (--trainer.max_steps %d): "
                    "no validation during training, and no periodic checkpoint; the final model is validated once "
                    "at the end", every, batches, steps)


def _calibration_report(model_cfg: ModelConfig, output_dir: str, built) -> dict | None:
    """The calibration report of the corrected model (the given calibrated folder's, or the job's own)."""
    if built is not None:
        return None
    folder = Path(model_cfg.name_or_path) if model_cfg.tiny is None and is_shift_folder(model_cfg.name_or_path) \
        else calibration_dir(output_dir)
    f = folder / "calibration_report.json"
    return json.loads(f.read_text()) if f.is_file() else None


def training_callbacks(output_dir: str | None, zeroshot: EvalConfig | None, every_n_steps: int | None) -> list:
    """Checkpoints of the trainable state (every validation and on a stop) and zero-shot accuracy."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    from ..evaluation.callbacks import ZeroShotAccuracy

    cbs: list[Any] = []
    if output_dir is not None:
        ckpt = checkpoint_dir(output_dir)
        cbs.append(ModelCheckpoint(dirpath=str(ckpt), filename="step{step}", save_top_k=0, save_last=True,
                                   every_n_train_steps=every_n_steps or None, save_on_train_epoch_end=False,
                                   auto_insert_metric_name=False, enable_version_counter=False))
        cbs.append(CheckpointOnStop(ckpt))
    if zeroshot is not None and zeroshot.tasks:
        cbs.append(ZeroShotAccuracy(zeroshot, when=("validation_end",)))
    return cbs


class CheckpointOnStop(L.Callback):
    """Write ``last.ckpt`` when training stops on an exception (Ctrl-C, a crash, a dead peer, a preempted
    job), and make every checkpoint write atomic (:class:`~shift_lightning.resume.AtomicCheckpointIO`).

    Under DDP the stop checkpoint is written by rank 0 alone, without a collective: the other ranks may
    be stopping at another point, or be dead (a barrier would wait for them forever). Ctrl-C is held
    back during the update (:meth:`RecoveryModule.optimizer_step`), so it always holds a whole step.
    A sharded (FSDP) run has no stop checkpoint (gathering it needs every rank)."""

    def __init__(self, dirpath: Path):
        self.dirpath = Path(dirpath)

    def setup(self, trainer, pl_module, stage):
        from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

        if type(trainer.strategy.checkpoint_io) is TorchCheckpointIO:
            trainer.strategy.checkpoint_io = AtomicCheckpointIO()

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if isinstance(pl_module, RecoveryModule):  # before ModelCheckpoint (Lightning runs it last)
            pl_module.end_of_update()

    def on_exception(self, trainer, pl_module, exception):
        from .. import stopping

        stopping.rearm()  # Lightning ignores Ctrl-C from here on: a second one should still end the process
        stopping.reset_critical()
        stopping.spare_rank0_on_lost_peer(exception)  # a rank died: rank 0 saves and says so before it ends
        if trainer.state.fn != "fit" or trainer.global_step == 0:
            return
        path = self.dirpath / "last.ckpt"
        try:
            if trainer.world_size == 1:
                trainer.save_checkpoint(str(path))
            elif isinstance(trainer.strategy, FSDPStrategy):
                if trainer.is_global_zero:
                    log.warning("Stopped at step %d (%s): no stop checkpoint for a sharded run; resume from the "
                                "last periodic one", trainer.global_step, type(exception).__name__)
                return
            else:  # replicated trainable state: rank 0 writes it alone (strategy.save_checkpoint: rank 0 only)
                checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
                trainer.strategy.save_checkpoint(checkpoint, str(path))
            if trainer.is_global_zero:
                log.warning("Stopped at step %d (%s): checkpoint in %s; resume with --ckpt_path last",
                            trainer.global_step, type(exception).__name__, path)
        except Exception as e:  # never hide the original error
            log.warning("Could not write a checkpoint on stop: %s", e)


class DecoderFSDPStrategy(FSDPStrategy):
    """FSDP that shards the model block by block: the auto-wrap policy is the model's own decoder-block
    class, found at setup (``configs/llama8b_lora_fsdp.yaml``). ``use_orig_params`` keeps the frozen
    base and the trainable LoRA / LRA tensors in the same flat parameters."""

    def __init__(self, **kwargs):
        kwargs.setdefault("use_orig_params", True)
        super().__init__(**kwargs)

    def _setup_model(self, model):
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        from ..arch import base_model

        if "auto_wrap_policy" not in self.kwargs:  # model: the LightningModule holding the HF model
            blocks = decoder_layers(base_model(model.model))
            self.kwargs["auto_wrap_policy"] = ModuleWrapPolicy({type(blocks[0])})
        return super()._setup_model(model)
