"""Lightning callbacks that evaluate the module's model at chosen points and log to every logger.

``ZeroShotAccuracy`` logs ``zeroshot/<task>`` (the task's reported metric), ``zeroshot/<task>/acc``,
``zeroshot/<task>/acc_norm`` and ``zeroshot/avg``; ``Perplexity`` logs ``ppl/<set>``. Under DDP every
rank scores its share of the docs and the torchmetrics states are synced (each doc counted once).

The model is ``getattr(pl_module, model_attr)`` (default ``"model"``; the module itself when it has
no such attribute); the tokenizer is the one given, else ``getattr(pl_module, tokenizer_attr)``.

When (``when``): ``fit_start``, ``fit_end``, ``validation_end``, ``test_end``, ``predict_end``
(e.g. after a calibration run through ``trainer.predict``), plus ``every_n_epochs`` /
``every_n_train_steps`` during training.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Sequence

import lightning.pytorch as pl

from ..errors import ConfigError
from .runner import EvalConfig, Evaluator, evaluate_model, make_evaluator

_WHEN = ("fit_start", "fit_end", "validation_end", "test_end", "predict_end")


class _EvalCallback(pl.Callback):
    prefix = "eval"

    def __init__(self, cfg: EvalConfig | None = None, tokenizer=None, when: Sequence[str] = ("fit_end",),
                 every_n_epochs: int | None = None, every_n_train_steps: int | None = None,
                 model_attr: str = "model", tokenizer_attr: str = "tokenizer"):
        bad = [w for w in when if w not in _WHEN]
        if bad:
            raise ConfigError(f"Unknown evaluation point(s) {bad}; choose from {_WHEN}")
        self.cfg = cfg or self.default_config()
        if self.cfg.tasks:  # unknown task names fail here, before any compute (not after a calibration)
            from .tasks import parse_tasks

            parse_tasks(self.cfg.tasks)
        self.cfg.validate("--zeroshot.", need_something=False)
        self.tokenizer = tokenizer
        self.when = tuple(when)
        self.every_n_epochs, self.every_n_train_steps = every_n_epochs, every_n_train_steps
        self.model_attr, self.tokenizer_attr = model_attr, tokenizer_attr
        self.history: list[dict] = []
        self._evaluator: Evaluator | None = None

    def default_config(self) -> EvalConfig:
        return EvalConfig()

    # ------------------------------------------------------------------ core
    def run(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", point: str) -> dict:
        model = getattr(pl_module, self.model_attr, pl_module)
        tokenizer = self.tokenizer if self.tokenizer is not None else getattr(pl_module, self.tokenizer_attr, None)
        if self._evaluator is None:  # data loaded once
            cfg = replace(self.cfg, progress=self.cfg.progress and trainer.is_global_zero)
            self._evaluator = make_evaluator(model, tokenizer, cfg)
        res = evaluate_model(model, tokenizer, self._evaluator.cfg, evaluator=self._evaluator)
        metrics = self.flatten(res)
        if trainer.is_global_zero:
            for logger in trainer.loggers:
                logger.log_metrics(metrics, step=trainer.global_step)
        import torch

        trainer.callback_metrics.update({k: torch.tensor(v) for k, v in metrics.items()})
        self.history.append({"point": point, "step": trainer.global_step, "epoch": trainer.current_epoch,
                             "metrics": metrics, "results": res})
        return res

    def flatten(self, res: dict) -> dict[str, float]:
        raise NotImplementedError

    # ------------------------------------------------------------------ hooks
    def on_fit_start(self, trainer, pl_module):
        if "fit_start" in self.when:
            self.run(trainer, pl_module, "fit_start")

    def on_fit_end(self, trainer, pl_module):
        if "fit_end" in self.when:
            self.run(trainer, pl_module, "fit_end")

    def on_validation_end(self, trainer, pl_module):
        if "validation_end" in self.when and not trainer.sanity_checking:
            self.run(trainer, pl_module, "validation_end")

    def on_test_end(self, trainer, pl_module):
        if "test_end" in self.when:
            self.run(trainer, pl_module, "test_end")

    def on_predict_end(self, trainer, pl_module):
        if "predict_end" in self.when:
            self.run(trainer, pl_module, "predict_end")

    def on_train_epoch_end(self, trainer, pl_module):
        if self.every_n_epochs and (trainer.current_epoch + 1) % self.every_n_epochs == 0:
            self.run(trainer, pl_module, f"epoch_{trainer.current_epoch}")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.every_n_train_steps and trainer.global_step % self.every_n_train_steps == 0 and trainer.global_step:
            self.run(trainer, pl_module, f"step_{trainer.global_step}")


class ZeroShotAccuracy(_EvalCallback):
    """Zero-shot accuracy on lm-eval tasks (``cfg.tasks``); logs ``zeroshot/<task>`` and ``zeroshot/avg``."""

    prefix = "zeroshot"

    def flatten(self, res: dict) -> dict[str, float]:
        out: dict[str, float] = {}
        for t, e in res["tasks"].items():
            out[f"{self.prefix}/{t}"] = e["value"]
            for k in ("acc", "acc_norm", "ppl"):
                if k in e:
                    out[f"{self.prefix}/{t}/{k}"] = e[k]
        if res.get("average") is not None:
            out[f"{self.prefix}/avg"] = res["average"]
        for p, e in res.get("perplexity", {}).items():
            out[f"ppl/{p}"] = e["ppl"]
        return out


class Perplexity(ZeroShotAccuracy):
    """Perplexity on fixed windows (``cfg.ppl``, default wiki-summaries held-out); logs ``ppl/<set>``."""

    prefix = "ppl"

    def default_config(self) -> EvalConfig:
        return EvalConfig(tasks="", ppl="wiki_summaries")
