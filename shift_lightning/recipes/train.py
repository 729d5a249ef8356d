"""The training recipe: one job from a model to a recovered model.

    model (HF id / folder / embedded name)  ──select, prune, calibrate (same Trainer, same DDP ranks)──>
        <output_dir>.calibration/   report + adapter-only folder (reused when the job is run again)
    ──recover (LoRA / partial / LRAs; TensorBoard: val/ppl, zeroshot/*, train/*)──>
        <output_dir>.ckpt/last.ckpt  trainable tensors + optimizer + scheduler + loop (also on a stop)
    ──export──> <output_dir>/        merged model + recovery_report.json + config.yaml + README.md (card);
                 <output_dir>/lora/   under LoRA: the adapter in PEFT's format (LRAs trained with it inside)
                 <output_dir>/base/   ... on top of this corrected base (pruned + repaired, before recovery)

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
from ..data import CALIBRATION_SOURCE, TextDataConfig, build_windows
from ..errors import ConfigError
from ..evaluation.runner import EvalConfig
from ..models import ModelConfig
from ..outputs import prepare_output, publish_dir
from ..finite import check_trained
from ..fingerprints import input_digest, read_key
from ..precheck import check_training
from ..remote_code import base_model_settings
from ..reports import RecoveryReport
from ..recovery import RecoveryConfig, RecoveryData, RecoveryModule
from ..stepdata import visited
from ..checkpoint import ShiftSpec, is_shift_folder, load_pretrained, read_shift_config
from ..resume import (AtomicCheckpointIO, check_checkpoint_dir, check_run, clear_checkpoints, read_checkpoint,
                      resolve_resume, run_key, run_settings)
from .calibrate import check_early, local_inputs

log = logging.getLogger(__name__)

#: Trainer defaults for training (TensorBoard logs under runs/recovery; --trainer.* overrides them).
RECOVERY_TRAINER_DEFAULTS: dict = dict(
    accelerator="auto", devices=1, max_steps=100, val_check_interval=50, check_val_every_n_epoch=None,
    use_distributed_sampler=False, log_every_n_steps=5, gradient_clip_val=1.0, inference_mode=False,
    num_sanity_val_steps=0, enable_model_summary=False,
)


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
                     correction=calib["calibration"].solver, refit_blocks=refit_positions(r.refit)).to_dict()
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
    """The whole job (see the module docstring). ``trainer`` comes built (``--trainer.*``: devices,
    strategy, precision, max_steps, logger, callbacks); ``built=(model, tokenizer, spec)`` injects an
    already corrected model (tests, notebooks), ``reference`` its unpruned original (``val/kl``).
    ``save_peft``: under LoRA also write ``lora/`` (PEFT adapter) and ``base/`` (the corrected base);
    ``command``: the command line of the job (the model card quotes it)."""
    model_cfg = model or ModelConfig()
    recovery = recovery or RecoveryConfig()
    train_data = train_data or TextDataConfig(num_samples=256, seed=1)
    calib = {"data": data or TextDataConfig(source=CALIBRATION_SOURCE), "heldout": heldout or TextDataConfig(split="heldout", num_samples=16),
             "prune": prune or PruneConfig(), "calibration": calibration or CalibrationConfig()}
    calibrating = built is None and not (model_cfg.tiny is None and is_shift_folder(model_cfg.name_or_path))
    # every check before any compute (and before the calibration this job may run first)
    recovery.validate()
    train_data.validate("--train_data")
    if val is not None:
        val.validate("--val", optional=True)
    if calibrating:
        check_early(calib["prune"], calib["data"], calib["calibration"], calib["heldout"])
    check_schedule(trainer, val)
    check_training(model_cfg if built is None else None, train_data, recovery)  # format, LoRA targets: no compute
    ckpt_dir = checkpoint_dir(output_dir) if output_dir else None
    sections = {"model": model_cfg, **(calib if calibrating else {}), "train_data": train_data, "val": val,
                "recovery": recovery}
    if built is not None:
        sections = {"spec": {k: built[2].get(k) for k in ("original_num_layers", "pruned_layers")}, **sections}
        sections.pop("model")
    settings = run_settings(sections, trainer)
    resume_from = resolve_resume(ckpt_path, ckpt_dir)
    resumed = read_checkpoint(resume_from) if resume_from is not None else None
    if resumed is not None:
        check_run(resumed, resume_from, settings)
    if dist.launch_rank() == 0:
        prepare_output(output_dir, overwrite or resumed is not None,  # a resumed run replaces its own result
                       local_inputs(model_cfg if built is None else None, data=calib["data"] if calibrating else None,
                                    heldout=calib["heldout"] if calibrating else None, train_data=train_data, val=val))
        check_checkpoint_dir(ckpt_dir, resuming=resumed is not None, overwrite=overwrite)
    t0 = time.time()
    closeness: dict = {}

    def record(original, tokenizer):  # the original's distributions: validation windows (val/kl), training (kd)
        from ..fidelity import window_references
        from ..progress import stage_bar

        if recovery.val_kl and val is not None and val.num_samples > 0:
            w = build_windows(val, tokenizer, original.config.model_type, "--val")
            closeness["ref"] = window_references(original, w.input_ids, w.attention_mask, recovery.val_kl_topk,
                                                 val.batch_size)
        if recovery.loss == "kd":  # only the windows this rank will read in max_steps steps
            t = time.time()
            w = build_windows(train_data, tokenizer, original.config.model_type, "--train_data")
            idx = visited(len(w), train_data.batch_size, trainer.global_rank, trainer.world_size, recovery.seed,
                          max(int(trainer.max_steps), 0) * trainer.accumulate_grad_batches)
            bar = stage_bar("teacher distributions (kd)", -(-len(idx) // train_data.batch_size)) \
                if trainer.is_global_zero and trainer.progress_bar_callback is not None else None
            try:
                refs = window_references(original, w.input_ids[idx], w.attention_mask[idx], recovery.kd_topk,
                                         train_data.batch_size, on_batch=bar.step if bar is not None else None)
            finally:
                if bar is not None:
                    bar.close()
            closeness["teacher"] = {i: refs[j] for j, i in enumerate(idx)}
            n = int(w.attention_mask[idx].sum())
            log.info("kd: the original's top %d on the %d of %d training windows read (%d positions, %.0f MB; %.0f s)",
                     recovery.kd_topk, len(idx), len(w), n, n * recovery.kd_topk * 12 / 2 ** 20, time.time() - t)

    if built is not None:
        lm, tokenizer, spec = built
        if reference is not None:
            record(reference, tokenizer)
    else:
        lm, tokenizer, spec = _calibrated_model(trainer, model_cfg, calib, output_dir, overwrite, resolved_config, record)
    base = base_model_name(spec.get("base_model"))
    spec = {k: v for k, v in spec.items() if k not in ("adapters", "format_version", "weights", "base_model",
                                                       "branch_maps")}
    if base is not None:
        spec["base_model"] = base
    spec.setdefault("original_num_layers", len(decoder_layers(lm)))
    spec.setdefault("pruned_layers", [])
    t_cal = time.time()
    model_type = lm.config.model_type
    train_w = build_windows(train_data, tokenizer, model_type, "--train_data")
    val_w = build_windows(val, tokenizer, model_type, "--val") if val is not None and val.num_samples > 0 else None
    module = RecoveryModule(lm, recovery, spec.get("pruned_layers"), spec.get("original_num_layers"), tokenizer=tokenizer,
                            reference=closeness.get("ref"), teacher=closeness.get("teacher"))
    n_train = sum(p.numel() for p in module.parameters() if p.requires_grad)
    dm = RecoveryData(train_w, val_w, batch_size=train_data.batch_size, seed=recovery.seed)
    module.run_info = {"key": run_key(settings), "settings": settings}
    before = {}
    if resumed is not None:  # the step-0 validation of the run being resumed
        before = dict(resumed["shift_lightning"].get("metrics_before", {}))
    elif val_w is not None:  # one validation at step 0 (val/ppl, zeroshot/*)
        trainer.validate(module, datamodule=dm, verbose=False)
        before = {k: float(v) for k, v in trainer.callback_metrics.items()}
    module.metrics_before = before
    if resumed is None and trainer.is_global_zero:
        clear_checkpoints(ckpt_dir)  # an earlier run's (checked above: only with --overwrite)
    dist.barrier()
    after = {}
    step0 = int(resumed.get("global_step", 0)) if resumed is not None else trainer.global_step
    t_fit = time.time()
    if trainer.max_steps != 0:
        trainer.fit(module, datamodule=dm, ckpt_path=str(resume_from) if resumed is not None else None,
                    weights_only=True)  # nothing unpickled
        after = {k: float(v) for k, v in trainer.callback_metrics.items()}
    t_fit = time.time() - t_fit
    if trainer.max_steps != 0 and val_w is not None and module.last_validated_step != trainer.global_step:
        trainer.validate(module, datamodule=dm, verbose=False)  # the final model is always validated
    after.update({k: float(v) for k, v in trainer.callback_metrics.items()})
    steps = trainer.global_step
    tokens = (steps - step0) * trainer.world_size * train_data.batch_size * trainer.accumulate_grad_batches \
        * train_data.seq_len
    report = RecoveryReport(
        model=model_cfg.name_or_path if model_cfg.tiny is None else {"tiny": model_cfg.tiny},
        pruned_layers=spec["pruned_layers"], recovery=asdict(recovery), trainable_params=n_train,
        train_windows=len(train_w), train_tokens_per_window=train_data.seq_len, steps=steps, recovered=steps > 0,
        metrics_before=before, metrics_after=after, loss_history=module.loss_history, world_size=trainer.world_size,
        seconds={"calibration": t_cal - t0, "fit": t_fit, "total": time.time() - t0},
        train_tokens_per_s=tokens / t_fit if t_fit > 0 and tokens else None,
        peak_gpu_memory_bytes=torch.cuda.max_memory_allocated() if torch.cuda.is_available() else None)
    if steps == 0:
        log.warning("No training step was taken (max_steps %s): the exported model is the calibrated one, "
                    "marked \"recovered\": false", trainer.max_steps)
    check_trained(module.model, after, steps)  # non-finite is never success (shift_lightning.finite)
    if output_dir is not None and trainer.is_global_zero:
        card = CardFacts(command=command, calibration=_calibration_report(model_cfg, output_dir, built), recovery=report.to_dict())

        def write(tmp: Path):
            module.export(tmp, tokenizer, {**spec, "recovered": steps > 0, "recovery_steps": steps}, card=card,
                          peft=save_peft, base_ref=str(Path(output_dir).resolve() / "base"))
            (tmp / "recovery_report.json").write_text(json.dumps(report.to_dict(), indent=2))
            if resolved_config:
                (tmp / "config.yaml").write_text(resolved_config)

        publish_dir(output_dir, write, kind="recovery", overwrite=overwrite or resumed is not None)
    dist.barrier()
    return RecoveryResult(report, module, Path(output_dir) if output_dir else None)


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
