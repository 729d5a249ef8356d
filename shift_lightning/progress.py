"""Progress that names its stage and survives a log file: :class:`StageProgress`.

Lightning's own bar says "Predicting" for every pass and, written to a file, becomes one long line
of carriage returns. This bar takes its name from the pass (``DataPass.stage``: "criterion
scores", "calibration statistics", "held-out errors", "evaluation", ...). On a terminal it is a
tqdm bar; otherwise (output redirected to a log file, CI) it prints a plain line when a pass starts,
every ``interval`` seconds, and when it ends::

    [12:00:55] calibration statistics: 64 steps
    [12:01:15] calibration statistics: 40% (26/64), 1.31 it/s, elapsed 0:00:20, ETA 0:00:29
    [12:01:44] calibration statistics: done, 64 steps in 0:00:49 (1.31 it/s)

Only rank 0 shows progress. Predict passes only (the passes of calibration, criteria and evaluation).
"""

from __future__ import annotations

import sys
import time
from typing import Any, TextIO

from lightning.pytorch.callbacks.progress.progress_bar import ProgressBar


def _hms(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class StageProgress(ProgressBar):
    """A progress bar per pass, named after its stage; periodic plain lines when not on a terminal."""

    def __init__(self, interval: float = 30.0, stream: TextIO | None = None, tty: bool | None = None):
        super().__init__()
        self.interval = interval
        self._stream = stream
        self._tty = tty
        self._enabled = True
        self._bar = None
        self._name = ""
        self._total = 0
        self._done = 0
        self._t0 = self._last = 0.0

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
        if self._tty is not None:
            return self._tty
        try:
            return self.stream.isatty()
        except (AttributeError, ValueError):
            return False

    # ---------------------------------------------------------------- one pass
    def _begin(self, pl_module, default: str, total) -> None:
        if not self._enabled:
            return
        self._name = getattr(pl_module, "stage", None) or default
        self._total = int(total) if total not in (None, float("inf")) else 0
        self._done = 0
        self._t0 = self._last = time.monotonic()
        if self.tty:
            from tqdm.auto import tqdm

            self._bar = tqdm(total=self._total or None, desc=self._name, file=self.stream, dynamic_ncols=True,
                             leave=False)
        else:
            self._line()

    def _step(self) -> None:
        if not self._enabled:
            return
        self._done += 1
        if self._bar is not None:
            self._bar.update(1)
        elif time.monotonic() - self._last >= self.interval and self._done != self._total:
            self._line()  # (the last step is reported by the closing line)

    def _end(self) -> None:
        if not self._enabled:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        else:
            self._line(final=True)

    def _line(self, final: bool = False) -> None:
        now = time.monotonic()
        self._last, elapsed = now, now - self._t0
        rate = self._done / elapsed if elapsed > 0 else 0.0
        if final:
            msg = f"done, {self._done} steps in {_hms(elapsed)} ({rate:.2f} it/s)"
        elif self._done == 0:
            msg = f"{self._total or 'unknown number of'} steps"
        else:
            pct = (f"{100 * self._done / self._total:.0f}% ({self._done}/{self._total})" if self._total
                   else f"{self._done}")
            eta = f", ETA {_hms((self._total - self._done) / rate)}" if rate and self._total else ""
            msg = f"{pct}, {rate:.2f} it/s, elapsed {_hms(elapsed)}{eta}"
        self.stream.write(f"[{time.strftime('%H:%M:%S')}] {self._name}: {msg}\n")
        self.stream.flush()

    # ---------------------------------------------------------------- Lightning hooks
    def on_predict_start(self, trainer, pl_module) -> None:
        self._begin(pl_module, "predicting", sum(trainer.num_predict_batches))

    def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0) -> None:
        self._step()

    def on_predict_end(self, trainer, pl_module) -> None:
        self._end()


def with_stage_progress(trainer_kwargs: dict) -> dict:
    """``Trainer`` keyword arguments with a :class:`StageProgress` in the callbacks (unless the bar is
    switched off or another progress bar is already there)."""
    if trainer_kwargs.get("enable_progress_bar") is False:
        return trainer_kwargs
    callbacks = list(trainer_kwargs.get("callbacks") or [])
    if not any(isinstance(c, ProgressBar) for c in callbacks):
        callbacks.append(StageProgress())
    return {**trainer_kwargs, "callbacks": callbacks}
