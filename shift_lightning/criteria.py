"""Layer-selection criteria: which blocks to remove.

Every criterion maps ``(model, calibration windows)`` to per-block scores (higher = more
important) or directly to a selection; :func:`select_blocks` turns that into a sorted list of
original block indices, applying the optional guards.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

from torch import nn


class CriterionError(ValueError):
    """Bad pruning request (unknown criterion, impossible ratio, missing data, bad indices)."""


@dataclass
class PruneConfig:
    """Which blocks to remove: explicit ``layers`` or ``ratio`` + ``criterion``."""

    layers: list[int] | None = None
    """Explicit original block indices to remove (overrides ratio/criterion)."""
    ratio: float = 0.25
    """Fraction of blocks to remove: ⌊ratio·L⌋ blocks. Must be in [0, 1)."""
    criterion: str = "reverse_star"
    """Selection criterion, see ``CRITERIA``."""
    seed: int = 0
    """Seed for the ``random`` criterion (recorded in the report)."""
    keep_first: int = 0
    """Guard: never remove the first ``keep_first`` blocks (the "+" heuristic; 0 = off)."""
    keep_last: bool = False
    """Guard: never remove the final block."""


@dataclass
class Selection:
    """Result of a criterion: the blocks to remove and the evidence."""

    layers: list[int]
    criterion: str
    scores: dict[int, float] | None = None
    details: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"criterion": self.criterion, "layers": self.layers,
                "scores": None if self.scores is None else {str(k): v for k, v in self.scores.items()},
                **self.details}


def num_to_remove(num_layers: int, ratio: float) -> int:
    if not (0.0 <= ratio < 1.0) or math.isnan(ratio):
        raise CriterionError(f"--prune.ratio must be in [0, 1), got {ratio}")
    k = int(math.floor(ratio * num_layers))
    if k >= num_layers:
        raise CriterionError(f"ratio {ratio} would remove all {num_layers} blocks")
    return k


def candidates(num_layers: int, cfg: PruneConfig) -> list[int]:
    """Block indices a criterion may remove under the guards."""
    hi = num_layers - 1 if cfg.keep_last else num_layers
    return list(range(min(cfg.keep_first, num_layers), hi))


def check_layers(layers: list[int], num_layers: int) -> list[int]:
    """Validate explicit indices: in range, no duplicates, not every block."""
    bad = [i for i in layers if not isinstance(i, int) or not 0 <= i < num_layers]
    if bad:
        raise CriterionError(f"Unknown layer index {bad}: the model has blocks 0..{num_layers - 1}")
    if len(set(layers)) != len(layers):
        raise CriterionError(f"Duplicate layer indices in {layers}")
    if len(set(layers)) >= num_layers:
        raise CriterionError(f"Cannot prune every block ({num_layers}); keep at least one")
    return sorted(layers)


# --------------------------------------------------------------------------------------------
# Data-free criteria
# --------------------------------------------------------------------------------------------
def reverse(num_layers: int, k: int, cfg: PruneConfig) -> list[int]:
    """Remove the last ``k`` blocks (Reverse-order; Men et al. 2024 "ShortGPT", baseline)."""
    return candidates(num_layers, cfg)[::-1][:k]


def reverse_star(num_layers: int, k: int, cfg: PruneConfig) -> list[int]:
    """Reverse-order*: remove the ``k`` blocks just before the final block, which is kept
    (Kim et al. 2024, "Shortened LLaMA"; the final block is far more important than its predecessors)."""
    cfg = PruneConfig(**{**cfg.__dict__, "keep_last": True})
    return candidates(num_layers, cfg)[::-1][:k]


def random_blocks(num_layers: int, k: int, cfg: PruneConfig) -> list[int]:
    """``k`` blocks drawn uniformly without replacement with ``cfg.seed`` (recorded)."""
    return random.Random(cfg.seed).sample(candidates(num_layers, cfg), k)


#: Criteria that need no model or data: name -> fn(num_layers, k, cfg) -> indices.
POSITIONAL: dict[str, Callable] = {"reverse": reverse, "reverse_star": reverse_star, "random": random_blocks}

#: Every criterion name (extended by the data/weight-driven ones below).
CRITERIA: tuple[str, ...] = tuple(POSITIONAL)


def select_blocks(cfg: PruneConfig, model: nn.Module, windows=None, make_trainer=None) -> Selection:
    """Decide which original blocks of ``model`` to remove.

    ``windows`` (a :class:`~shift_lightning.data.TokenWindows`) and ``make_trainer`` (a callable
    returning a fresh Lightning ``Trainer`` for a gradient-free or gradient pass) are needed only
    by the data-driven criteria.
    """
    from .models import decoder_layers

    num_layers = len(decoder_layers(model))
    if cfg.layers is not None:
        return Selection(check_layers(list(cfg.layers), num_layers), "explicit")
    if cfg.criterion not in CRITERIA:
        raise CriterionError(f"Unknown criterion {cfg.criterion!r}; valid choices: {', '.join(CRITERIA)}")
    k = num_to_remove(num_layers, cfg.ratio)
    if k > len(candidates(num_layers, cfg)):
        raise CriterionError(f"Cannot remove {k} blocks with guards keep_first={cfg.keep_first}, keep_last={cfg.keep_last}")
    if cfg.criterion in POSITIONAL:
        layers = POSITIONAL[cfg.criterion](num_layers, k, cfg)
        details = {"seed": cfg.seed} if cfg.criterion == "random" else {}
        return Selection(sorted(layers), cfg.criterion, None, details)
    raise CriterionError(f"criterion {cfg.criterion!r} is not implemented")  # pragma: no cover
