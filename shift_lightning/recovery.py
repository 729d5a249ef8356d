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

Training details a long run needs:

* the loss is the next-token NLL computed from the final hidden states in chunks
  (:func:`~shift_lightning.nll.lm_nll_sum`): no ``(B, T, V)`` float32 logits are materialised;
  Alpaca data restricts it to the response tokens; ``loss="kd"``: KL(original ‖ model) instead, chunked
  the same way (:func:`~shift_lightning.closeness.kd_loss_sum`);
* AdamW (no decay on biases/norms), LRAs in their own parameter group (``lra_lr``), linear warm-up
  then cosine decay to ``min_lr_ratio``; logs ``train/loss``, ``train/lr`` (``train/lra_lr``),
  ``train/tokens_per_s``, ``val/loss``, ``val/ppl`` (token-weighted, summed over ranks);
* checkpoints hold what trains (LoRA, LRAs, unfrozen blocks), the optimizer, the scheduler and the
  loop state, not the frozen base model; the data position follows from the step
  (:class:`StepBatchSampler`) and dropout is reseeded from ``(seed, step, rank)``, so a resumed run
  equals an uninterrupted one.

The module trains and validates; it writes no folders. After ``trainer.fit``, the training recipe
(:mod:`shift_lightning.recipes.train`) exports it with :func:`shift_lightning.export.export_recovered`
(LoRA merged into the weights, a folder :func:`shift_lightning.load_pretrained` reloads; under LoRA also the
adapter in PEFT's format on top of the corrected base); :meth:`RecoveryModule.merged_model` gives the
merged model in memory.
"""

from __future__ import annotations

import math
import time

import lightning as L
import torch
from torch import nn

from . import dist, stopping
from .arch import base_model, decoder_layers
from .config import RecoveryConfig  # noqa: F401 (user-facing: beside RecoveryModule)
from .errors import ConfigError
from .closeness import kd_loss_sum, kl_top1_from_hidden
from .nll import lm_nll_sum
from .maps.sites import pruned_positions
from .maps.surgery import adapter_module_names, adapter_set

class RecoveryModule(L.LightningModule):
    """Fine-tunes a corrected model; see the module docstring for what it logs and checkpoints."""

    def __init__(self, model: nn.Module, cfg: RecoveryConfig | None = None, pruned_layers: list[int] | None = None,
                 original_num_layers: int | None = None, tokenizer=None, reference: dict | None = None,
                 teacher: dict | None = None):
        super().__init__()
        self.reference = reference  # val window index -> the original's TopK (val/kl, val/top1); plain attribute
        self.teacher = teacher  # train window index -> the original's TopK (loss "kd"); plain attribute
        self.cfg = cfg = cfg or RecoveryConfig()
        cfg.validate()
        if cfg.loss == "kd" and teacher is None:
            raise ConfigError("--recovery.loss kd needs the original model's distributions on the training windows, "
                              "recorded from the unpruned model: a calibrated folder whose base model loads")
        self.has_lras = has_lras = adapter_set(model) is not None and bool(adapter_set(model).adapter_params())
        if cfg.method == "lra" and not has_lras:  # none attached, or an empty set (stock: maps folded into weights)
            raise ConfigError("recovery.method='lra' needs a model with adapters (a calibrated folder with LRAs); "
                              "use recovery.method='lora' or 'partial'")
        self.train_lra = cfg.train_lra or cfg.method == "lra"
        if self.train_lra and not has_lras:
            raise ConfigError("recovery.train_lra needs a model with adapters (a calibrated folder with LRAs); set "
                              "recovery.train_lra=False (LoRA trains folded maps like any other weight)")
        self.pruned_layers, self.original_num_layers = pruned_layers or [], original_num_layers
        self.tokenizer = tokenizer  # plain attribute (ZeroShotAccuracy reads it)
        self.model = self._wrap(model)
        self.strict_loading = False  # checkpoints hold the trainable tensors only
        self.loss_history: list[float] = []
        """Mean training loss of every micro-batch since step 0 (kept in the checkpoints across resumes)."""
        self.metrics_before: dict = {}
        """The step-0 validation (kept in the checkpoints: a resumed run reports it too)."""
        self.run_info: dict | None = None
        """The settings of the run (:func:`~shift_lightning.resume.run_settings`), recorded in every checkpoint."""
        self.last_validated_step: int | None = None
        self._updating = False
        self._t_last: float | None = None
        self._val_nll = self._val_tokens = None

    # ---------------------------------------------------------------- which parameters train
    def _wrap(self, model: nn.Module) -> nn.Module:
        cfg = self.cfg
        for p in model.parameters():
            p.requires_grad_(False)
        if cfg.gradient_checkpointing:
            if not getattr(model, "supports_gradient_checkpointing", False):
                raise ConfigError(f"{type(model).__name__} does not support gradient checkpointing; "
                                  "set --recovery.gradient_checkpointing false")
            # non-reentrant: inputs need no grad, the adapters' pre-hooks are recomputed with their block
            if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x
                model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
            else:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        if cfg.method == "lora":
            from peft import LoraConfig, get_peft_model

            lcfg = LoraConfig(r=cfg.lora_r, lora_alpha=cfg.lora_alpha, lora_dropout=cfg.lora_dropout,
                              target_modules=list(cfg.target_modules),
                              exclude_modules=r".*shift_adapters.*" if self.has_lras else None,
                              modules_to_save=adapter_module_names(model) if self.train_lra else None,
                              task_type="CAUSAL_LM")
            with torch.random.fork_rng(devices=[]):  # LoRA's random init depends on the seed alone
                torch.manual_seed(cfg.seed)
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
        return [p for p in adapter_set(base_model(self.model)).sites.parameters() if p.requires_grad]

    def trainable_names(self) -> set[str]:
        return {n for n, p in self.named_parameters() if p.requires_grad}

    def configure_optimizers(self):
        if self.trainer.max_steps is None or self.trainer.max_steps < 0:
            raise ConfigError("Recovery is step-based: set --trainer.max_steps (e.g. 100)")
        lra_ids = {id(p) for p in self.lra_parameters()}
        decay, no_decay = [], []
        for n, p in self.model.named_parameters():
            if p.requires_grad and id(p) not in lra_ids:
                (no_decay if p.ndim < 2 else decay).append(p)
        groups = [{"params": decay, "weight_decay": self.cfg.weight_decay, "lr": self.cfg.lr, "name": "main"},
                  {"params": no_decay, "weight_decay": 0.0, "lr": self.cfg.lr, "name": "main_no_decay"}]
        if lra_ids:
            groups.append({"params": self.lra_parameters(), "weight_decay": 0.0,
                           "lr": self.cfg.lra_lr or self.cfg.lr, "name": "lra"})
        groups = [g for g in groups if g["params"]]
        if not groups:
            raise ConfigError("Nothing to train: check recovery.method / target_modules / train_lra")
        opt = torch.optim.AdamW(groups)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, warmup_cosine(self.cfg.warmup_steps, self.trainer.max_steps,
                                                                     self.cfg.min_lr_ratio))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    # ---------------------------------------------------------------- checkpoints: trainable tensors only
    def on_save_checkpoint(self, checkpoint: dict) -> None:
        keep = self.trainable_names()
        checkpoint["state_dict"] = {k: v for k, v in checkpoint["state_dict"].items() if k in keep}
        done = self.global_step * self.trainer.accumulate_grad_batches  # micro-batches of completed steps
        checkpoint["shift_lightning"] = {"trainable": sorted(keep), "method": self.cfg.method,
                                         "train_lra": self.train_lra, "run": self.run_info,
                                         "loss_history": list(self.loss_history[:done]),
                                         "metrics_before": dict(self.metrics_before)}

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        from .resume import check_state

        check_state(checkpoint["state_dict"], self.state_dict(), self.trainable_names())
        rec = checkpoint.get("shift_lightning", {})
        self.loss_history = [float(x) for x in rec.get("loss_history", [])]
        self.metrics_before = dict(rec.get("metrics_before", {}))

    # ---------------------------------------------------------------- steps
    def on_train_start(self) -> None:
        self.model.train()  # loaded models come in eval mode; LoRA dropout must be active while training
        self._t_last = None
        self._updating = False
        stopping.reset_critical()

    def optimizer_step(self, epoch, batch_idx, optimizer, optimizer_closure=None):
        """The update, with Ctrl-C held back from the moment the weights change until the step is
        counted (``on_train_batch_end``): a stop checkpoint then always holds a whole step."""
        def closure():
            out = optimizer_closure() if optimizer_closure is not None else None
            if not self._updating:
                self._updating = True
                stopping.enter_critical()
            return out

        optimizer.step(closure=closure)

    def _forward(self, batch):
        lm = base_model(self.model)  # PEFT injects LoRA into the modules: the HF model runs them
        hidden = lm.model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                          use_cache=False).last_hidden_state
        return lm, hidden, getattr(lm.config, "final_logit_softcapping", None)

    def _nll(self, batch, fwd: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        lm, hidden, softcap = fwd or self._forward(batch)
        return lm_nll_sum(hidden, lm.lm_head, batch["input_ids"], batch["attention_mask"], self.cfg.loss_chunk_tokens,
                          softcap, loss_mask=batch.get("loss_mask"))

    def on_train_batch_start(self, batch, batch_idx):
        # dropout masks are a function of (seed, step, rank): a resumed run draws the same ones
        micro = self.global_step * self.trainer.accumulate_grad_batches + batch_idx % self.trainer.accumulate_grad_batches
        torch.manual_seed(self.cfg.seed * 1_000_003 + micro * 7919 + self.global_rank)

    def _kd(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        """``(Σ KL_k(original ‖ model), #positions)`` over the batch's real positions (loss ``kd``)."""
        lm, hidden, softcap = self._forward(batch)
        mask, refs = batch["attention_mask"].bool(), [self.teacher[int(w)] for w in batch["index"].tolist()]
        total = sum(kd_loss_sum(hidden[b][mask[b]], lm.lm_head, r, softcap, self.cfg.loss_chunk_tokens)
                    for b, r in enumerate(refs))
        return total, torch.tensor(sum(map(len, refs)), device=hidden.device)

    def training_step(self, batch, batch_idx):
        s, n = self._kd(batch) if self.cfg.loss == "kd" else self._nll(batch)
        loss = s / n.clamp_min(1)
        bs = batch["input_ids"].shape[0]
        self.log("train/loss", loss, prog_bar=True, batch_size=bs, sync_dist=True)
        g = loss.detach().clone()
        if dist.is_dist():
            torch.distributed.all_reduce(g)
            g /= dist.world_size()
        self.loss_history.append(float(g))
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx):
        now = time.perf_counter()
        tokens = int(batch["attention_mask"].sum()) * self.trainer.world_size
        if self._t_last is not None:
            self.log("train/tokens_per_s", tokens / max(now - self._t_last, 1e-9), batch_size=1)
        self._t_last = now
        groups = self.trainer.optimizers[0].param_groups
        self.log("train/lr", groups[0]["lr"], batch_size=1)
        for g in groups:
            if g.get("name") == "lra":
                self.log("train/lra_lr", g["lr"], batch_size=1)
        self.end_of_update()

    def end_of_update(self) -> None:
        """The step is counted and the scheduler has stepped: a held-back Ctrl-C is raised now
        (:class:`~shift_lightning.recipes.train.CheckpointOnStop` calls it before the periodic checkpoint
        callback, so a stopping rank never enters that checkpoint's collective)."""
        if self._updating:
            self._updating = False
            stopping.leave_critical()

    def on_validation_epoch_start(self) -> None:
        self._val_nll = torch.zeros(1, dtype=torch.float64, device=self.device)
        self._val_tokens = torch.zeros(1, dtype=torch.float64, device=self.device)
        self._val_close = torch.zeros(3, dtype=torch.float64, device=self.device)  # Σ KL, Σ top-1, positions

    def validation_step(self, batch, batch_idx):
        lm, hidden, softcap = fwd = self._forward(batch)
        s, n = self._nll(batch, fwd)
        self._val_nll += s.double()
        self._val_tokens += n.double()
        if self.reference is not None and "index" in batch:
            mask = batch["attention_mask"].bool()
            for b, w in enumerate(batch["index"].tolist()):
                kl, agree = kl_top1_from_hidden(hidden[b][mask[b]], lm.lm_head, self.reference[int(w)], softcap)
                self._val_close += torch.tensor([kl.sum().item(), agree.sum().item(), kl.numel()],
                                                dtype=torch.float64, device=self.device)

    def on_validation_epoch_end(self):
        from .passes import sum_across_ranks

        sum_across_ranks([self._val_nll, self._val_tokens, self._val_close], self.trainer)  # each window on one rank
        mean = self._val_nll / self._val_tokens.clamp_min(1)
        metrics = {"val/loss": float(mean), "val/ppl": float(torch.exp(mean))}
        if self.reference is not None and self._val_close[2] > 0:
            metrics["val/kl"] = float(self._val_close[0] / self._val_close[2])
            metrics["val/top1"] = float(self._val_close[1] / self._val_close[2])
        # logged at the number of optimizer steps taken (0 before training), like zeroshot/*
        if not self.trainer.sanity_checking:
            self.last_validated_step = self.trainer.global_step
        for name, v in metrics.items():
            self.log(name, v, prog_bar=name == "val/ppl", logger=False, sync_dist=False)
        if self.trainer.is_global_zero and not self.trainer.sanity_checking:
            for logger in self.trainer.loggers:
                logger.log_metrics(metrics, step=self.trainer.global_step)

    # ---------------------------------------------------------------- the result
    def merged_model(self) -> nn.Module:
        """The plain corrected model with LoRA merged into the weights and trained LRAs in place.

        Merging is in place: afterwards ``self.model`` is that plain model.
        """
        if hasattr(self.model, "merge_and_unload"):
            self.model = self.model.merge_and_unload()
        return self.model


def warmup_cosine(warmup: int, total: int, floor: float = 0.1):
    """``lr_lambda(step)``: linear warm-up over ``warmup`` steps, then cosine from 1 to ``floor`` at ``total``."""

    def lr_lambda(step: int) -> float:
        if warmup and step < warmup:
            return (step + 1) / warmup
        t = min(1.0, (step - warmup) / max(1, total - warmup))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))

    return lr_lambda
