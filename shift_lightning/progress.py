"""Progress that names its stage and survives a log file: :class:`StageProgress`.

Lightning's own bar says "Predicting" for every pass and, written to a file, becomes one long line
of carriage returns. This bar takes its name from the pass (``DataPass.stage``: "criterion
scores", "calibration statistics", "held-out errors", "evaluation", ...). On a terminal it is a
tqdm bar; otherwise (output redirected to a log file, CI) it prints a plain line when a pass starts,
every ``interval`` seconds, and when it ends::

    [12:00:55] calibration statistics: 64 steps
    [12:01:15] calibration statistics: 40% (26/64), 1.31 it/s, elapsed 0:00:20, ETA 0:00:29
    [12:01:44] calibration statistics: done, 64 steps in 0:00:49 (1.31 it/s)

Only rank 0 shows progress. Predict passes (calibration, criteria, evaluation), training (steps of
``max_steps`` with the loss and an ETA) and validation.
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar


def _steps(n) -> str:
    return f"{n} step" if n == 1 else f"{n} steps"


def _is_tty(stream: TextIO) -> bool:
    """Whether ``stream`` is a terminal (False for closed or stream-like objects without ``isatty``)."""
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _hms(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class _Bar:
    """One named progress: a tqdm bar on a terminal, periodic plain lines otherwise."""

    def __init__(self, owner: "StageProgress", name: str, total, done: int = 0, position: int = 0):
        self.owner, self.name = owner, name
        self.total = int(total) if total not in (None, float("inf")) and total > 0 else 0
        self.done = self.start = done
        self.t0 = self.last = time.monotonic()
        self.extra = ""
        self.bar = None
        if owner.tty:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.total or None, initial=done, desc=name, file=owner.stream,
                            dynamic_ncols=True, leave=False, position=position)
        else:
            self.line()

    def step(self, n: int = 1, extra: str = "") -> None:
        self.done += n
        self.extra = extra
        if self.bar is not None:
            self.bar.update(n)
            if extra:
                self.bar.set_postfix_str(extra, refresh=False)
        elif time.monotonic() - self.last >= self.owner.interval and self.done != self.total:
            self.line()  # (the last step is reported by the closing line)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        else:
            self.line(final=True)

    def line(self, final: bool = False) -> None:
        now = time.monotonic()
        self.last, elapsed = now, now - self.t0
        rate = (self.done - self.start) / elapsed if elapsed > 0 else 0.0
        extra = f", {self.extra}" if self.extra else ""
        if final:
            msg = f"done, {_steps(self.done)} in {_hms(elapsed)} ({rate:.2f} it/s){extra}"
        elif self.done == self.start:
            msg = _steps(self.total or "unknown number of") + (f", from step {self.start}" if self.start else "")
        else:
            pct = f"{100 * self.done / self.total:.0f}% ({self.done}/{self.total})" if self.total else f"{self.done}"
            eta = f", ETA {_hms((self.total - self.done) / rate)}" if rate and self.total else ""
            msg = f"{pct}, {rate:.2f} it/s, elapsed {_hms(elapsed)}{eta}{extra}"
        self.owner.stream.write(f"[{time.strftime('%H:%M:%S')}] {self.name}: {msg}\n")
        self.owner.stream.flush()


class StageProgress(ProgressBar):
    """A progress bar per pass, named after its stage; periodic plain lines when not on a terminal.

    Training counts optimizer steps of ``max_steps`` (from the resumed step), with the loss; each
    validation during training has its own short progress.
    """

    def __init__(self, interval: float = 30.0, stream: TextIO | None = None, tty: bool | None = None):
        super().__init__()
        self.interval = interval
        self._stream = stream
        self._tty = tty
        self._enabled = True
        self._bars: dict[str, _Bar] = {}
        self._step_seen = 0

    # ---------------------------------------------------------------- ProgressBar API
    def disable(self) -> None:
        self._enabled = False

    def enable(self) -> None:
        self._enabled = True

    @property
    def is_enabled(self) -> bool:
        return self._enabled

    def print(self, *args: Any, **kwargs: Any) -> None:
        print(*args, file=self.stream, **kwargs)

    @property
    def stream(self) -> TextIO:
        return self._stream or sys.stderr

    @property
    def tty(self) -> bool:
        return self._tty if self._tty is not None else _is_tty(self.stream)

    def bar(self, name: str, total: int) -> "_Bar | NullBar":
        """A progress of its own for work a pass does after its loop (its ``finish``: the guard's
        candidates, ``mode: auto``'s fits), where the pass's own bar has already closed."""
        return _Bar(self, name, total) if self._enabled else NullBar()

    def _open(self, key: str, name: str, total, done: int = 0) -> None:
        if self._enabled:
            self._bars[key] = _Bar(self, name, total, done, position=len(self._bars))

    def _close(self, key: str) -> None:
        bar = self._bars.pop(key, None)
        if bar is not None:
            bar.close()

    # ---------------------------------------------------------------- Lightning hooks
    def on_predict_start(self, trainer, pl_module) -> None:
        self._open("predict", getattr(pl_module, "stage", None) or "predicting", sum(trainer.num_predict_batches))

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if "predict" in self._bars:
            self._bars["predict"].step()

    def on_predict_end(self, trainer, pl_module) -> None:
        self._close("predict")

    def on_train_start(self, trainer, pl_module) -> None:
        total = trainer.max_steps if trainer.max_steps and trainer.max_steps > 0 else None
        self._step_seen = trainer.global_step
        self._open("train", getattr(pl_module, "stage", None) or "training", total, done=trainer.global_step)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        bar = self._bars.get("train")
        if bar is not None and trainer.global_step > self._step_seen:
            loss = trainer.callback_metrics.get("train/loss")
            bar.step(trainer.global_step - self._step_seen, f"loss {float(loss):.4f}" if loss is not None else "")
            self._step_seen = trainer.global_step

    def on_train_end(self, trainer, pl_module) -> None:
        self._close("train")

    def on_validation_start(self, trainer, pl_module) -> None:
        if not trainer.sanity_checking:
            self._open("val", f"validation (step {trainer.global_step})", sum(trainer.num_val_batches))

    def on_validation_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        if "val" in self._bars:
            self._bars["val"].step()

    def on_validation_end(self, trainer, pl_module) -> None:
        ppl = trainer.callback_metrics.get("val/ppl")
        if "val" in self._bars and ppl is not None:
            self._bars["val"].extra = f"val/ppl {float(ppl):.4g}"
        self._close("val")


class NullBar:
    """A progress that shows nothing (progress off, or a rank other than 0)."""

    def step(self, n: int = 1, extra: str = "") -> None:
        pass

    def close(self) -> None:
        pass


class _Plain:
    """What a :class:`_Bar` needs of its owner, outside a Trainer."""

    def __init__(self, interval: float, stream: TextIO | None, tty: bool | None):
        self.interval, self.stream = interval, stream or sys.stderr
        self.tty = tty if tty is not None else _is_tty(self.stream)


def stage_bar(name: str, total: int, interval: float = 30.0, stream: TextIO | None = None,
              tty: bool | None = None) -> _Bar:
    """The same progress as :class:`StageProgress` for a loop outside Lightning (the evaluator's units in
    the grids): ``bar.step()`` per item, ``bar.close()`` at the end."""
    return _Bar(_Plain(interval, stream, tty), name, total)


def with_stage_progress(trainer_kwargs: dict) -> dict:
    """``Trainer`` keyword arguments with a :class:`StageProgress` in the callbacks (unless the bar is
    switched off or another progress bar is already there)."""
    if trainer_kwargs.get("enable_progress_bar") is False:
        return trainer_kwargs
    callbacks = list(trainer_kwargs.get("callbacks") or [])
    if not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(StageProgress())
    return {**trainer_kwargs, "callbacks": callbacks}
