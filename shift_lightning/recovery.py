"""Optional recovery after calibration: PEFT LoRA or partial-layer fine-tuning, LRAs trainable too.

``RecoveryModule`` receives an already corrected model (dependency injection) and wraps it:

* ``method="lora"``: PEFT LoRA on ``target_modules`` of the decoder blocks. LoRA never lands on
  the LRA's own linear layers (they are excluded by name); with ``train_lra`` the LRAs are trained
  through PEFT ``modules_to_save`` (PEFT freezes everything it does not own).
* ``method="partial"``: fine-tune whole decoder blocks (``partial_blocks``: pruned-model
  positions; default: the block right after each pruning site), everything else frozen.
* ``method="lra"``: train only the LRAs (needs ``train_lra``; implied).

Which parameters train is decided from declared module sets (LoRA layers PEFT created, the
adapter container, chosen blocks), never by substring-matching parameter names.
After ``trainer.fit``, :meth:`RecoveryModule.export` merges LoRA into the weights and saves a
normal shift-lightning folder that :func:`shift_lightning.load_pretrained` reloads.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import lightning as L
import torch
from torch import nn
from torch.utils.data import DataLoader, DistributedSampler

from .arch import decoder_layers
from .data import RankShard, TokenWindows
from .errors import ConfigError
from .nll import token_nll
from .surgery import adapter_module_names, adapter_set, pruned_positions, save_pretrained

DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class RecoveryConfig:
    """What is fine-tuned after calibration, and how."""

    method: Literal["lora", "partial", "lra"] = "lora"
    """``lora`` (PEFT LoRA), ``partial`` (whole blocks) or ``lra`` (only the adapters)."""
    train_lra: bool = False
    """Also train the Linear Residual Adapters (initialised at their closed-form solution)."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: int = 16
    """LoRA scaling numerator (scale = alpha / r)."""
    lora_dropout: float = 0.05
    """Dropout on the LoRA branch."""
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Module names LoRA wraps inside the decoder blocks."""
    partial_blocks: list[int] | None = None
    """``partial``: pruned-model block positions to unfreeze (default: the block after each site)."""
    lr: float = 2e-4
    """Learning rate for LoRA / unfrozen blocks."""
    lra_lr: float | None = None
    """Learning rate for the adapters (default: ``lr``)."""
    weight_decay: float = 0.0
    """AdamW weight decay (never applied to biases or norms)."""
    warmup_steps: int = 0
    """Linear warm-up steps, then cosine decay to 10% over ``trainer.max_steps``."""


class RecoveryModule(L.LightningModule):
    """Fine-tunes a corrected model; logs ``train/loss``, ``val/loss`` and ``val/ppl`` (token-weighted)."""

    def __init__(self, model: nn.Module, cfg: RecoveryConfig | None = None, pruned_layers: list[int] | None = None,
                 original_num_layers: int | None = None):
        super().__init__()
        self.cfg = cfg = cfg or RecoveryConfig()
        if cfg.method not in ("lora", "partial", "lra"):
            raise ConfigError(f"recovery.method must be 'lora', 'partial' or 'lra', got {cfg.method!r}")
        if cfg.method == "lra" and adapter_set(model) is None:
            raise ConfigError("recovery.method='lra' needs a model with adapters (a calibrated folder)")
        self.train_lra = cfg.train_lra or cfg.method == "lra"
        if self.train_lra and adapter_set(model) is None:
            raise ConfigError("recovery.train_lra needs a model with adapters (a calibrated folder)")
        self.pruned_layers, self.original_num_layers = pruned_layers or [], original_num_layers
        self.model = self._wrap(model)
        from torchmetrics import SumMetric

        # float64 sums; torchmetrics states ignore precision="bf16-true" casts (only set_dtype changes them)
        self.val_nll, self.val_tokens = SumMetric().set_dtype(torch.float64), SumMetric().set_dtype(torch.float64)

    # ---------------------------------------------------------------- which parameters train
    def _wrap(self, model: nn.Module) -> nn.Module:
        cfg = self.cfg
        for p in model.parameters():
            p.requires_grad_(False)
        if cfg.method == "lora":
            from peft import LoraConfig, get_peft_model

            lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                              target_modules=list(cfg.target_modules), exclude_modules=r".*shift_adapters.*",
                              modules_to_save=adapter_module_names(model) if self.train_lra else None,
                              task_type="CAUSAL_LM")
            return get_peft_model(model, lcfg)
        if cfg.method == "partial":
            blocks = decoder_layers(model)
            chosen = cfg.partial_blocks
            if chosen is None:
                if not self.pruned_layers or self.original_num_layers is None:
                    raise ConfigError("recovery.partial_blocks is required when the pruning sites are unknown")
                pos = pruned_positions(self.original_num_layers, self.pruned_layers)
                chosen = sorted({min(p, len(blocks) - 1) for p in pos.values()})
            bad = [i for i in chosen if not 0 <= i < len(blocks)]
            if bad:
                raise ConfigError(f"recovery.partial_blocks {bad} outside 0..{len(blocks) - 1}")
            self.partial_blocks = chosen
            for i in chosen:
                for p in blocks[i].parameters():
                    p.requires_grad_(True)
        if self.train_lra:
            for p in adapter_set(model).adapter_params():
                p.requires_grad_(True)
        return model

    def lra_parameters(self) -> list[nn.Parameter]:
        """The trainable adapter parameters (PEFT's trainable copies under LoRA)."""
        if not self.train_lra:
            return []
        base = self.model.get_base_model() if hasattr(self.model, "get_base_model") else self.model
        return [p for p in adapter_set(base).sites.parameters() if p.requires_grad]

    def configure_optimizers(self):
        lra_ids = {id(p) for p in self.lra_parameters()}
        decay, no_decay = [], []
        for n, p in self.model.named_parameters():
            if p.requires_grad and id(p) not in lra_ids:
                (no_decay if p.ndim < 2 else decay).append(p)
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay, "lr": self.cfg.lr},
                  {"params": no_decay, "weight_decay": 0.0, "lr": self.cfg.lr}]
        if lra_ids:
            groups.append({"params": self.lra_parameters(), "weight_decay": 0.0, "lr": self.cfg.lra_lr or self.cfg.lr})
        groups = [g for g in groups if g["params"]]
        if not groups:
            raise ConfigError("Nothing to train: check recovery.method / target_modules / train_lra")
        opt = torch.optim.AdamW(groups)
        total = max(int(self.trainer.max_steps or 0), 1) if self.trainer.max_steps and self.trainer.max_steps > 0 else None
        warm = self.cfg.warmup_steps

        def lr_lambda(step):
            if warm and step < warm:
                return (step + 1) / warm
            if total is None:
                return 1.0
            t = min(1.0, (step - warm) / max(1, total - warm))
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---------------------------------------------------------------- steps
    def on_train_start(self) -> None:
        self.model.train()  # loaded models come in eval mode; LoRA dropout must be active while training

    def _nll(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = batch["input_ids"], batch["attention_mask"]
        logits = self.model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        nll, valid = token_nll(logits.float(), ids, mask)
        return (nll * valid).sum(), valid.sum()

    def training_step(self, batch, batch_idx):
        s, n = self._nll(batch)
        loss = s / n.clamp_min(1)
        self.log("train/loss", loss, prog_bar=True, batch_size=batch["input_ids"].shape[0])
        return loss

    def validation_step(self, batch, batch_idx):
        s, n = self._nll(batch)
        self.val_nll.update(s.double())
        self.val_tokens.update(n.double())

    def on_validation_epoch_end(self):
        nll, n = self.val_nll.compute(), self.val_tokens.compute()  # summed over ranks
        self.log("val/loss", (nll / n).float(), sync_dist=False)
        self.log("val/ppl", torch.exp(nll / n).float(), prog_bar=True, sync_dist=False)
        self.val_nll.reset(), self.val_tokens.reset()

    # ---------------------------------------------------------------- export
    def merged_model(self) -> nn.Module:
        """The plain corrected model with LoRA merged into the weights and trained LRAs in place.

        Merging is in place: afterwards ``self.model`` is that plain model.
        """
        if hasattr(self.model, "merge_and_unload"):
            self.model = self.model.merge_and_unload()
        return self.model

    def export(self, out_dir: str | Path, tokenizer, spec: dict) -> Path:
        model = self.merged_model()
        for p in model.parameters():
            p.requires_grad_(False)
        return save_pretrained(model, tokenizer, out_dir, spec)


class RecoveryData(L.LightningDataModule):
    """Training windows (shuffled, ``DistributedSampler`` per rank) and validation windows
    (sharded without repetition). Use with ``Trainer(use_distributed_sampler=False)``."""

    def __init__(self, train: TokenWindows, val: TokenWindows | None, batch_size: int = 4, seed: int = 0):
        super().__init__()
        self.train, self.val, self.batch_size, self.seed = train, val, batch_size, seed

    def train_dataloader(self):
        t = self.trainer
        sampler = DistributedSampler(self.train, num_replicas=t.world_size, rank=t.global_rank, shuffle=True,
                                     seed=self.seed)
        return DataLoader(self.train, batch_size=self.batch_size, sampler=sampler)

    def val_dataloader(self):
        if self.val is None:
            return []
        t = self.trainer
        return DataLoader(self.val, batch_size=self.batch_size, sampler=RankShard(len(self.val), t.global_rank, t.world_size))
