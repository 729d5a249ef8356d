"""The criteria's shared pieces: the config, the result, positional and weight-based criteria,
guards and the selection rules (see :mod:`shift_lightning.criteria` for the table)."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch import nn

from ..arch import decoder_layers
from ..config import PruneConfig  # noqa: F401 (re-exported)
from ..errors import ShiftError


class CriterionError(ShiftError, ValueError):
    """Bad pruning request (unknown criterion, impossible ratio, missing data, bad indices)."""


@dataclass
class Selection:
    """Result of a criterion: the blocks to remove and the evidence."""

    layers: list[int]
    """Original indices of the blocks to remove, sorted."""
    criterion: str
    scores: dict[int, float] | None = None
    """Per-block score, keyed by original block index (None for positional criteria)."""
    details: dict = field(default_factory=dict)
    """Criterion-specific evidence (tokens used, conventions, span distances, ...)."""

    def to_dict(self) -> dict:
        return {"criterion": self.criterion, "layers": self.layers,
                "scores": None if self.scores is None else {str(k): v for k, v in self.scores.items()},
                **self.details}


def num_to_remove(num_layers: int, ratio: float) -> int:
    """``k = ⌊ratio · num_layers⌋``; ``ratio`` must be in [0, 1) and leave at least one block."""
    if not isinstance(ratio, (int, float)) or math.isnan(ratio) or not (0.0 <= ratio < 1.0):
        raise CriterionError(f"--prune.ratio must be in [0, 1) (the fraction of blocks to remove), got {ratio}")
    k = int(math.floor(ratio * num_layers))
    if k >= num_layers:
        raise CriterionError(f"--prune.ratio {ratio} would remove all {num_layers} blocks; keep at least one")
    return k


def candidates(num_layers: int, cfg: PruneConfig) -> list[int]:
    """Block indices a criterion may remove under the guards ``keep_first`` / ``keep_last``."""
    lo = min(max(int(cfg.keep_first), 0), num_layers)
    hi = num_layers - min(max(int(cfg.keep_last), 0), num_layers)
    return list(range(lo, hi))


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


def lowest(scores: dict[int, float], allowed: list[int], k: int) -> list[int]:
    """The ``k`` indices of ``allowed`` with the smallest score (ties: lower index first)."""
    return sorted(sorted(allowed, key=lambda i: (scores[i], i))[:k])


# --------------------------------------------------------------------------------------------
# Data-free criteria
# --------------------------------------------------------------------------------------------
def reverse(num_layers: int, k: int, cfg: PruneConfig) -> list[int]:
    """Remove the last ``k`` blocks (Reverse-order; the baseline of Men et al. 2024, "ShortGPT",
    and Kim et al. 2024, "Shortened LLaMA")."""
    return candidates(num_layers, cfg)[::-1][:k]


def reverse_star(num_layers: int, k: int, cfg: PruneConfig) -> list[int]:
    """Reverse-order*: remove the ``k`` blocks just before the final block, which is kept
    (Kim et al. 2024, "Shortened LLaMA": the final block matters far more than its predecessors)."""
    cfg = PruneConfig(**{**cfg.__dict__, "keep_last": max(int(cfg.keep_last), 1)})
    return candidates(num_layers, cfg)[::-1][:k]


def random_blocks(num_layers: int, k: int, cfg: PruneConfig) -> list[int]:
    """``k`` blocks drawn uniformly without replacement with ``cfg.seed`` (recorded)
    (``random.Random(seed).sample`` over the candidates in index order)."""
    return random.Random(cfg.seed).sample(candidates(num_layers, cfg), k)


def magnitude_scores(model: nn.Module, p: int) -> dict[int, float]:
    """Block importance ``I_i = Σ_{W ∈ block i} Σ_jk |W_jk|^p`` for ``p`` = 1 or 2, summed over all
    the block's parameters (its linear weights and its norm weights), in float64.

    Kim et al. 2024, "Shortened LLaMA: Depth Pruning for LLMs" (Mag criterion; the reference
    code ``anal_block_sensitivity_magnitude.py`` sums ``|w|^p`` over every ``*weight`` of the
    block, norms included). Blocks with the smallest importance are removed.
    """
    from ..placement import placement_of

    out, placement = {}, placement_of(model)  # onloaded: each block read from the files in turn
    with torch.no_grad():
        for i in range(len(decoder_layers(model))):
            with placement.block(model, i) as layer:
                out[i] = float(sum(w.detach().double().abs().pow(p).sum() for w in layer.parameters()))
    return out


# --------------------------------------------------------------------------------------------
# Registry and entry point
# --------------------------------------------------------------------------------------------
#: Criteria that need no model or data: name -> fn(num_layers, k, cfg) -> indices.
POSITIONAL: dict[str, Callable] = {"reverse": reverse, "reverse_star": reverse_star, "random": random_blocks}

#: Criteria scored from the weights alone: name -> fn(model) -> {block: importance}.
WEIGHT_BASED: dict[str, Callable] = {
    "magnitude_l1": lambda model: magnitude_scores(model, 1),
    "magnitude_l2": lambda model: magnitude_scores(model, 2),
}

#: Criteria that need calibration windows (and a Lightning pass).
DATA_DRIVEN: tuple[str, ...] = ("taylor", "ppl", "block_influence", "angular", "linear_fit", "linear_fit_kl")

#: Data-driven criteria that fit the maps and judge the repaired model (held-out windows).
REPAIR_AWARE: tuple[str, ...] = ("linear_fit", "linear_fit_kl")

#: Every criterion name.
CRITERIA: tuple[str, ...] = tuple(POSITIONAL) + tuple(WEIGHT_BASED) + DATA_DRIVEN


def best_span(distances: dict[int, float], allowed: list[int], k: int) -> int:
    """Start ``ℓ`` of the span ``[ℓ, ℓ+k)`` inside ``allowed`` with the smallest distance."""
    ok = set(allowed)
    starts = [s for s in distances if all(s + j in ok for j in range(k))]
    if not starts:
        raise CriterionError(f"No contiguous span of {k} blocks fits the guards (allowed blocks {allowed})")
    return min(starts, key=lambda s: (distances[s], s))


@dataclass
class Plan:
    """What a criterion may do on a model of ``num_layers`` blocks: remove ``k`` of ``allowed``."""

    num_layers: int
    k: int
    allowed: list[int]
    guards: dict


def plan_removal(cfg: PruneConfig, num_layers: int) -> Plan:
    """Validate ``cfg`` against the model depth: criterion name, ratio, guards."""
    if cfg.criterion not in CRITERIA:
        raise CriterionError(f"Unknown criterion {cfg.criterion!r}; valid choices: {', '.join(CRITERIA)}")
    for name in ("keep_first", "keep_last"):
        v = getattr(cfg, name)
        if not isinstance(v, bool) and (not isinstance(v, int) or v < 0):
            raise CriterionError(f"--prune.{name} must be a whole number of blocks >= 0 (0 = off), got {v!r}")
    k = num_to_remove(num_layers, cfg.ratio)
    allowed = candidates(num_layers, cfg)
    if k > len(allowed):
        raise CriterionError(
            f"Cannot remove {k} of {num_layers} blocks with guards keep_first={cfg.keep_first}, "
            f"keep_last={cfg.keep_last} ({len(allowed)} candidates)")
    return Plan(num_layers, k, allowed, {"k": k, "keep_first": int(cfg.keep_first), "keep_last": int(cfg.keep_last)})


def select_static(cfg: PruneConfig, model: nn.Module) -> Selection | None:
    """The selection of explicit layers and of data-free criteria; ``None`` for a data-driven one."""
    num_layers = len(decoder_layers(model))
    if cfg.layers is not None:
        return Selection(check_layers(list(cfg.layers), num_layers), "explicit")
    plan = plan_removal(cfg, num_layers)
    if cfg.criterion in POSITIONAL:
        layers = POSITIONAL[cfg.criterion](num_layers, plan.k, cfg)
        details = {"seed": cfg.seed} if cfg.criterion == "random" else {}
        return Selection(sorted(layers), cfg.criterion, None, {**plan.guards, **details})
    if cfg.criterion in WEIGHT_BASED:
        scores = WEIGHT_BASED[cfg.criterion](model)
        return Selection(lowest(scores, plan.allowed, plan.k), cfg.criterion, scores, plan.guards)
    return None


def check_data_request(cfg: PruneConfig, num_windows: int) -> None:
    """Errors of a data-driven request that can be found before any pass."""
    if num_windows == 0:
        raise CriterionError(
            f"Criterion {cfg.criterion!r} scores blocks on calibration data, but no data is configured: "
            "set --data.source (e.g. wiki_summaries), --data.num_samples and --data.seq_len, or choose a "
            f"data-free criterion ({', '.join(tuple(POSITIONAL) + tuple(WEIGHT_BASED))}).")
    if cfg.angular_tokens not in ("last", "all"):
        raise CriterionError(f"--prune.angular_tokens must be 'last' or 'all', got {cfg.angular_tokens!r}")
    if cfg.batch_size < 1:
        raise CriterionError(f"--prune.batch_size must be >= 1, got {cfg.batch_size}")
    if cfg.criterion in REPAIR_AWARE:
        if cfg.heldout_every < 2 or num_windows < cfg.heldout_every:
            raise CriterionError(f"{cfg.criterion} holds out every --prune.heldout_every-th window (>= 2) to judge the "
                                 f"repaired spans: it needs at least {max(cfg.heldout_every, 2)} windows, got "
                                 f"{num_windows} windows and heldout_every {cfg.heldout_every}")
        if not (math.isfinite(cfg.damping) and cfg.damping > 0) or not cfg.max_stats_gb > 0:
            raise CriterionError("--prune.damping and --prune.max_stats_gb must be > 0")


def choose(cfg: PruneConfig, plan: Plan, scores: dict[int, float], details: dict) -> Selection:
    """Blocks to remove from a data-driven scorer's (reduced) scores."""
    details = {**plan.guards, **details}
    if cfg.criterion == "angular":
        start = best_span(scores, plan.allowed, plan.k)
        return Selection(list(range(start, start + plan.k)), cfg.criterion, scores, details)
    if cfg.criterion in REPAIR_AWARE:  # spans chosen jointly by the scorer (its repaired-span costs)
        return Selection(sorted(details["selected"]), cfg.criterion, scores, details)
    return Selection(lowest(scores, plan.allowed, plan.k), cfg.criterion, scores, details)
