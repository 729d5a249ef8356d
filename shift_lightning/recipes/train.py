"""The recovery recipe: fine-tune a corrected model (LoRA / partial / LRAs) and export it merged."""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import lightning as L

from .. import dist
from ..data import TextDataConfig, build_windows
from ..models import ModelConfig
from ..outputs import prepare_output, publish_dir
from ..recovery import RecoveryConfig, RecoveryData, RecoveryModule
from ..surgery import is_shift_folder, load_pretrained, read_shift_config

#: Trainer defaults for recovery (TensorBoard logs under runs/recovery).
RECOVERY_TRAINER_DEFAULTS: dict = dict(
    accelerator="auto", devices=1, max_steps=100, val_check_interval=50, check_val_every_n_epoch=None,
    use_distributed_sampler=False, enable_checkpointing=False, log_every_n_steps=5, gradient_clip_val=1.0,
    inference_mode=False,
)


@dataclass
class RecoveryResult:
    report: dict
    """Trainable parameters, steps, metrics before / after, seconds (also ``recovery_report.json``)."""
    module: RecoveryModule
    output_dir: Path | None = None


def run_recovery(
    trainer: L.Trainer,
    model: ModelConfig | None = None,
    data: TextDataConfig | None = None,
    val: TextDataConfig | None = None,
    recovery: RecoveryConfig | None = None,
    output_dir: str | None = None,
    overwrite: bool = False,
    built: tuple | None = None,
    resolved_config: str | None = None,
) -> RecoveryResult:
    """Fine-tune a corrected model (LoRA / partial / LRA only) and export it merged.

    ``model`` usually points at a folder written by the calibration recipe. The Trainer comes
    built (``--trainer.*``: devices, max_steps, logger = TensorBoard by default, callbacks).
    """
    model_cfg, data = model or ModelConfig(), data or TextDataConfig()
    recovery = recovery or RecoveryConfig()
    if dist.launch_rank() == 0:
        prepare_output(output_dir, overwrite)
    t0 = time.time()
    lm, tok = built if built is not None else load_pretrained(model_cfg)
    spec = {}
    if built is None and model_cfg.tiny is None and is_shift_folder(model_cfg.name_or_path):
        spec = {k: v for k, v in read_shift_config(model_cfg.name_or_path).items()
                if k not in ("adapters", "format_version")}
    mtype = lm.config.model_type
    train_w = build_windows(data, tok, mtype)
    val_w = build_windows(val, tok, mtype) if val is not None and val.num_samples > 0 else None
    module = RecoveryModule(lm, recovery, spec.get("pruned_layers"), spec.get("original_num_layers"))
    n_train = sum(p.numel() for p in module.parameters() if p.requires_grad)
    dm = RecoveryData(train_w, val_w, batch_size=data.batch_size, seed=data.seed)
    if val_w is not None:
        trainer.validate(module, datamodule=dm, verbose=False)
    before = {k: float(v) for k, v in trainer.callback_metrics.items()}
    trainer.fit(module, datamodule=dm)
    after = {k: float(v) for k, v in trainer.callback_metrics.items()}
    report = {
        "model": model_cfg.name_or_path, "recovery": asdict(recovery), "trainable_params": n_train,
        "train_tokens_per_epoch": train_w.num_tokens, "steps": trainer.global_step,
        "metrics_before": before, "metrics_after": after, "world_size": trainer.world_size,
        "seconds": time.time() - t0,
    }
    if output_dir is not None and trainer.is_global_zero:
        def write(tmp: Path):
            module.export(tmp, tok, {**spec, "original_num_layers": spec.get("original_num_layers"),
                                     "pruned_layers": spec.get("pruned_layers", []), "recovered": True})
            (tmp / "recovery_report.json").write_text(json.dumps(report, indent=2))
            if resolved_config:
                (tmp / "config.yaml").write_text(resolved_config)

        publish_dir(output_dir, write, kind="recovery", overwrite=overwrite)
    dist.barrier()
    return RecoveryResult(report, module, Path(output_dir) if output_dir else None)
