"""The ``--trainer.*`` knobs the entry points support: typed dataclasses, checked in one place, turned into
``lightning.Trainer`` keyword arguments only when a run starts (so ``--help`` and ``--print_config``
never import Lightning or torch).

* :class:`TrainerConfig`: where a run computes (``calibrate.py``, ``evaluate.py``);
* :class:`RecoveryTrainerConfig`: the same plus the training schedule and TensorBoard (``train.py``).

Settings every run of a recipe relies on (``inference_mode``, no Lightning checkpoints while
calibrating, our own data sharding, ...) are not knobs: each recipe adds them when it builds its
Trainer (``TRAINER_DEFAULTS`` and friends).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from ..errors import ConfigError

Accelerator = Literal["auto", "cpu", "gpu", "cuda", "mps"]
Precision = Literal["32-true", "16-mixed", "bf16-mixed", "16-true", "bf16-true", "64-true"]


@dataclass
class TrainerConfig:
    """Where the passes run: accelerator, devices, processes, numeric precision."""

    accelerator: Accelerator = "auto"
    """``auto`` (a GPU when there is one), ``cpu``, ``gpu`` / ``cuda`` or ``mps``."""
    devices: int | list[int] | Literal["auto"] = 1
    """Devices per node: a count >= 1, ``-1`` (all), ``auto`` or a list of device indices such as ``[0, 2]``."""
    num_nodes: int = 1
    """Machines taking part (each runs ``devices`` processes)."""
    strategy: Literal["auto", "ddp"] = "auto"
    """``auto`` (one process) or ``ddp`` (one process per device; the extra ranks re-run the command)."""
    precision: Precision = "32-true"
    """Lightning precision: ``32-true``, ``16-mixed``, ``bf16-mixed``, ``16-true``, ``bf16-true``, ``64-true``."""
    enable_progress_bar: bool = True
    """Progress lines for every pass (rank 0 only)."""

    def validate(self) -> None:
        """One line naming the option and its fix for every value Lightning would refuse late, or accept wrongly."""
        d = self.devices
        ok = d == "auto" or (_is_int(d) and (d >= 1 or d == -1)) or \
            (isinstance(d, list) and len(d) > 0 and all(_is_int(i) and i >= 0 for i in d) and len(set(d)) == len(d))
        if not ok:
            raise ConfigError(f"--trainer.devices must be a count >= 1, -1 (all devices), auto or a list of distinct "
                              f"device indices such as [0, 1]; got {d!r}")
        _at_least("num_nodes", self.num_nodes, 1)
        if self.accelerator == "cpu" and isinstance(d, list):
            raise ConfigError(f"--trainer.devices {d} lists device indices, which CPUs do not have; give a count "
                              "(--trainer.devices 2) with --trainer.accelerator cpu")

    def kwargs(self) -> dict[str, Any]:
        """``lightning.Trainer`` keyword arguments (validated first)."""
        self.validate()
        return asdict(self)


@dataclass
class TensorBoardConfig:
    """Where the training curves go (``tensorboard --logdir <save_dir>``)."""

    save_dir: str | None = "runs"
    """Folder of the TensorBoard logs (``null``: no logs)."""
    name: str = "recovery"
    """Subfolder of this kind of run (each run gets ``version_N`` inside)."""


@dataclass
class RecoveryTrainerConfig(TrainerConfig):
    """Where and how long recovery trains; validation and checkpoints every ``val_check_interval`` steps."""

    strategy: Literal["auto", "ddp", "fsdp"] = "auto"
    """``auto`` (one process), ``ddp`` (one process per device) or ``fsdp`` (sharded block by block:
    :class:`~shift_lightning.recipes.train.DecoderFSDPStrategy`)."""
    max_steps: int = 100
    """Optimizer steps (0: no training, the calibrated model is exported as it is)."""
    val_check_interval: int = 50
    """Validate (and write ``last.ckpt``) every N training batches (N >= 1; with ``accumulate_grad_batches`` A,
    every N / A steps)."""
    accumulate_grad_batches: int = 1
    """Batches whose gradients add up to one optimizer step."""
    gradient_clip_val: float | None = 1.0
    """Clip gradients at this value (``null`` or 0: no clipping)."""
    gradient_clip_algorithm: Literal["norm", "value"] | None = None
    """Clip the global gradient ``norm`` (also when ``null``: recorded as null, as in earlier checkpoints) or each
    gradient ``value``."""
    log_every_n_steps: int = 5
    """Log ``train/*`` every N steps."""
    logger: TensorBoardConfig = field(default_factory=TensorBoardConfig)
    """TensorBoard logs (``--trainer.logger.save_dir``, ``--trainer.logger.name``)."""

    def validate(self) -> None:
        super().validate()
        _at_least("max_steps", self.max_steps, 0, " (0: export the calibrated model untrained)")
        _at_least("accumulate_grad_batches", self.accumulate_grad_batches, 1, " (1: one batch per step)")
        _at_least("log_every_n_steps", self.log_every_n_steps, 1)
        _at_least("val_check_interval", self.val_check_interval, 1, " (training batches between validations)")
        c = self.gradient_clip_val
        if c is not None and not (isinstance(c, (int, float)) and not isinstance(c, bool) and math.isfinite(c) and c >= 0):
            raise ConfigError(f"--trainer.gradient_clip_val must be a finite number >= 0 or null (no clipping); got {c!r}")

    def kwargs(self) -> dict[str, Any]:
        """As :meth:`TrainerConfig.kwargs`; ``logger`` is a ``TensorBoardLogger`` (or ``False``), and
        ``strategy`` stays a name (the training recipe turns ``fsdp`` into its block-wise strategy)."""
        kw = super().kwargs()
        kw["logger"] = False
        if self.logger.save_dir is not None:
            from lightning.pytorch.loggers import TensorBoardLogger

            from ..outputs import check_writable

            check_writable(Path(self.logger.save_dir) / self.logger.name,  # a read-only working folder: before compute
                           "choose a writable --trainer.logger.save_dir, or null for no TensorBoard logs")
            kw["logger"] = TensorBoardLogger(save_dir=self.logger.save_dir, name=self.logger.name)
        return kw


def build_trainer(**kwargs):
    """``lightning.Trainer(**kwargs)``; what Lightning refuses about this machine (no GPU for ``--trainer.accelerator
    gpu``, more devices than it has, …) is one line naming the setting and its fix, not Lightning's traceback."""
    import lightning as L
    from lightning.fabric.utilities.exceptions import MisconfigurationException

    try:
        return L.Trainer(**kwargs)
    except MisconfigurationException as e:
        msg = " ".join(str(e).split())
        acc, dev = kwargs.get("accelerator"), kwargs.get("devices")
        if "gpu backend" in msg or ("not available" in msg.lower() and acc in ("gpu", "cuda", "mps")):
            raise ConfigError(f"--trainer.accelerator {acc}: this machine has no usable {acc.upper()} ({msg}); use "
                              "--trainer.accelerator cpu, or auto to take one when there is one") from None
        raise ConfigError(f"Lightning cannot run --trainer.accelerator {acc} --trainer.devices {dev} here: {msg}; "
                          "change those --trainer.* settings") from None


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _at_least(name: str, v, lo: int, hint: str = "") -> None:
    if not _is_int(v) or v < lo:
        raise ConfigError(f"--trainer.{name} must be an integer >= {lo}{hint}; got {v!r}")
