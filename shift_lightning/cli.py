"""Command-line front ends (jsonargparse): typed dataclass configs are the documentation.

Every entry point accepts ``--config file.yaml`` (any number, later wins), dotted overrides
(``--prune.ratio 0.25``, ``--trainer.devices 2``) and ``--print_config``.
"""

from __future__ import annotations

import logging
import os
import sys

from jsonargparse import ActionConfigFile
from lightning import Trainer
from lightning.pytorch.cli import LightningArgumentParser

from .calibration import CalibrationConfig
from .criteria import PruneConfig
from .data import TextDataConfig
from .models import ModelConfig
from .pipeline import TRAINER_DEFAULTS, default_heldout


def setup_logging() -> None:
    """Called by the entry points only (no side effects at import)."""
    import warnings

    for msg in (".*predict returned None.*", ".*isinstance\\(treespec, LeafSpec\\).*",
                ".*does not have many workers.*"):
        warnings.filterwarnings("ignore", message=msg)
    rank = int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0")))
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING,
                        format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")


def add_trainer_args(parser: LightningArgumentParser, defaults: dict) -> None:
    """``--trainer.*``: every ``lightning.Trainer`` argument, with our defaults."""
    parser.add_class_arguments(Trainer, "trainer", instantiate=False, fail_untyped=False,
                               skip={"callbacks", "plugins"})
    parser.set_defaults({f"trainer.{k}": v for k, v in defaults.items()})


def trainer_kwargs(ns) -> dict:
    kw = {k: v for k, v in vars(ns).items() if not k.startswith("__")}
    return {k: v for k, v in kw.items() if v is not None or k in TRAINER_DEFAULTS}


def calibrate_parser() -> LightningArgumentParser:
    p = LightningArgumentParser(description="Depth-prune a causal LM and calibrate Linear Residual Adapters "
                                "in closed form.", default_env=False)
    p.add_argument("--config", action=ActionConfigFile, help="YAML config file(s)")
    p.add_class_arguments(ModelConfig, "model", help="Where the model comes from")
    p.add_class_arguments(TextDataConfig, "data", help="Calibration text")
    p.add_class_arguments(TextDataConfig, "heldout", help="Held-out text for per-site errors")
    p.set_defaults({f"heldout.{k}": v for k, v in vars(default_heldout()).items()})
    p.add_class_arguments(PruneConfig, "prune", help="Which blocks to remove")
    p.add_class_arguments(CalibrationConfig, "calibration", help="How adapters are fitted")
    from .evaluation.runner import EvalConfig

    p.add_class_arguments(EvalConfig, "evaluate", help="Evaluate the corrected model afterwards "
                          "(off unless --evaluate.tasks or --evaluate.ppl is set)")
    p.set_defaults({"evaluate.tasks": "", "evaluate.ppl": None})
    p.add_argument("--evaluate_baselines", type=bool, default=False,
                   help="Also evaluate the original and the pruned model without adapters")
    add_trainer_args(p, TRAINER_DEFAULTS)
    p.add_argument("--output_dir", type=str, required=True, help="Folder for the corrected model and report")
    p.add_argument("--overwrite", type=bool, default=False, help="Replace an existing output folder")
    p.add_argument("--save_model", type=bool, default=True, help="Save the corrected model (not only the report)")
    return p


def calibrate_main(argv: list[str] | None = None) -> dict:
    from .pipeline import run_calibration

    setup_logging()
    parser = calibrate_parser()
    cfg = parser.parse_args(argv)
    init = parser.instantiate_classes(cfg)
    report = run_calibration(
        model=init.model, data=init.data, heldout=init.heldout, prune=init.prune,
        calibration=init.calibration, trainer=trainer_kwargs(cfg.trainer),
        output_dir=cfg.output_dir, overwrite=cfg.overwrite, save_model=cfg.save_model,
        evaluate=init.evaluate, evaluate_baselines=cfg.evaluate_baselines,
    )
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        from .pipeline import report_markdown

        sys.stdout.write(report_markdown({k: v for k, v in report.items() if not k.startswith("_")}))
    return report


#: Trainer defaults for recovery (TensorBoard logs under runs/recovery).
RECOVERY_TRAINER_DEFAULTS: dict = dict(
    accelerator="auto", devices=1, max_steps=100, val_check_interval=50, check_val_every_n_epoch=None,
    use_distributed_sampler=False, enable_checkpointing=False, log_every_n_steps=5, gradient_clip_val=1.0,
    inference_mode=False,
)


def train_parser() -> LightningArgumentParser:
    from .recovery import RecoveryConfig

    p = LightningArgumentParser(description="Recover a pruned + corrected model with LoRA / partial-layer "
                                "fine-tuning, optionally training the LRAs.", default_env=False)
    p.add_argument("--config", action=ActionConfigFile, help="YAML config file(s)")
    p.add_class_arguments(ModelConfig, "model", help="The corrected model (a calibrate.py output folder)")
    p.add_class_arguments(TextDataConfig, "data", help="Fine-tuning text")
    p.add_class_arguments(TextDataConfig, "val", help="Validation text (val/ppl in TensorBoard)")
    p.set_defaults({f"val.{k}": v for k, v in vars(default_heldout()).items()})
    p.add_class_arguments(RecoveryConfig, "recovery", help="What trains and how")
    p.add_lightning_class_args(Trainer, "trainer")
    p.set_defaults({f"trainer.{k}": v for k, v in RECOVERY_TRAINER_DEFAULTS.items()})
    p.set_defaults({"trainer.logger": {"class_path": "lightning.pytorch.loggers.TensorBoardLogger",
                                       "init_args": {"save_dir": "runs", "name": "recovery"}}})
    p.add_argument("--output_dir", type=str, required=True, help="Folder for the recovered (merged) model")
    p.add_argument("--overwrite", type=bool, default=False, help="Replace an existing output folder")
    return p


def train_main(argv: list[str] | None = None) -> dict:
    from .pipeline import check_output_dir, run_recovery

    setup_logging()
    parser = train_parser()
    cfg = parser.parse_args(argv)
    check_output_dir(cfg.output_dir, cfg.overwrite)  # before building anything
    init = parser.instantiate_classes(cfg)  # instantiates logger / callbacks, not the Trainer itself
    trainer = Trainer(**{k: v for k, v in vars(init.trainer).items() if not k.startswith("__")})
    report = run_recovery(trainer, model=init.model, data=init.data, val=init.val, recovery=init.recovery,
                          output_dir=cfg.output_dir, overwrite=cfg.overwrite)
    if trainer.is_global_zero:
        import json

        sys.stdout.write(json.dumps({k: v for k, v in report.items() if not k.startswith("_")}, indent=2) + "\n")
    return report
