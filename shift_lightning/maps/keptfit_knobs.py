"""The kept-block re-fit's knobs (``--calibration.refit.*``): apart from :mod:`.keptfit`, which imports torch, so that
the config (and ``--help``) does not."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from ..errors import ConfigError


@dataclass
class RefitKnobs:
    """The kept-block re-fit after the maps (:mod:`shift_lightning.maps.keptfit`; Llama layout only)."""

    kept: int | Literal["all"] = 0
    """Re-fit the first k kept blocks after each removed span (``all``: every one; 0: off), each kept only if the
    held-out calibration windows get closer to the original (``docs/method.md#the-kept-block-re-fit``)."""
    damping: float = 0.1
    """The re-fit's relative damping δ towards each layer's own weights (λ = δ · mean diag(XᵀX))."""

    def validate(self) -> None:
        """Cheap checks (before any model is loaded)."""
        if self.kept != "all" and (isinstance(self.kept, bool) or not isinstance(self.kept, int) or self.kept < 0):
            raise ConfigError(f"--calibration.refit.kept must be a whole number of blocks >= 0 (0: off) or 'all', "
                              f"got {self.kept!r}")
        if not (isinstance(self.damping, (int, float)) and math.isfinite(self.damping) and self.damping > 0):
            raise ConfigError(f"--calibration.refit.damping must be a finite number > 0, got {self.damping}")


def refit_damping(calibration: dict) -> float | None:
    """The re-fit's relative damping in a report's calibration settings (``refit.damping``; a report written before
    the knobs were grouped: ``refit_damping``)."""
    return (calibration.get("refit") or {}).get("damping", calibration.get("refit_damping"))
