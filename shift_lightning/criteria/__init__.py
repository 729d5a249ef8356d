"""Layer-selection criteria: which blocks to remove.

``--prune.criterion NAME --prune.ratio ρ`` removes ``k = ⌊ρL⌋`` of the ``L`` decoder blocks.
:func:`select_blocks` is the one entry point; it returns a :class:`Selection` whose
``to_dict()`` lands in ``calibration_report.json`` with every block's score.

=================  ==========  ===================================================================
criterion          needs       removes
=================  ==========  ===================================================================
``reverse``        nothing     the last ``k`` blocks
``reverse_star``   nothing     the ``k`` blocks just before the final block (which is kept)
``random``         nothing     ``k`` blocks drawn with ``PruneConfig.seed``
``magnitude_l1``   weights     the ``k`` blocks with the smallest ``Σ|w|``
``magnitude_l2``   weights     the ``k`` blocks with the smallest ``Σ w²``
``taylor``         data+grad   the ``k`` blocks with the smallest ``Σ|w·∂L/∂w|``
``ppl``            data        the ``k`` blocks whose single removal hurts perplexity least
``block_influence`` data       the ``k`` blocks with the smallest ``1 − E[cos(x_i, x_{i+1})]``
``angular``        data        the contiguous span of ``k`` blocks whose input and output are
                               closest in angular distance
``linear_fit``     data        the ``k`` blocks whose spans the closed-form LRA repairs best on
                               held-out windows (:mod:`.linear_fit`; repair-aware)
``linear_fit_kl``  data        linear_fit's best set for each number of spans, judged whole: the one
                               whose repaired model is closest to the original (held-out KL)
=================  ==========  ===================================================================

Scores are "importance": higher = keep (for ``angular`` the score of block ``ℓ`` is the distance
of the span ``[ℓ, ℓ+k)`` that starts there). Selection takes the lowest scores among the
*candidates*, i.e. the blocks the guards allow (``keep_first``/``keep_last``: the "+" heuristic
of Taylor+/PPL+ in Kim et al. 2024, off by default). Ties are broken by the lower block index.

The data-driven criteria are plain scorer classes (:mod:`.scorers`, :mod:`.linear_fit`) (framework-free: forward hooks on
``decoder_layers(model)[i]``, float64 sums, padding masked). Each exposes

* ``setup(model)``: allocate float64 accumulators on the model's device,
* ``step(model, batch)``: add one batch ``{"input_ids": (B, T), "attention_mask": (B, T)}``,
* ``state()``: the list of float64 sum tensors, summed across ranks with ONE all-reduce,
* ``finalize()``: ``(scores, details)`` from the (reduced) sums,

so 1 and N processes give the same scores up to float rounding. This module is Lightning-free:
the pass that feeds a scorer, and :func:`~shift_lightning.selection.select_blocks`, live in
:mod:`shift_lightning.selection`; :func:`choose` turns scores into the blocks to remove.
"""

from __future__ import annotations

from .base import (CRITERIA, DATA_DRIVEN, POSITIONAL, REPAIR_AWARE, WEIGHT_BASED, CriterionError, Plan, PruneConfig,  # noqa: F401
                   Selection, best_span, candidates, check_data_request, check_layers, choose, lowest,
                   magnitude_scores, num_to_remove, plan_removal, random_blocks, reverse, reverse_star,
                   select_static)
from .linear_fit import LinearFit, LinearFitKL, best_per_span_count, select_spans  # noqa: F401
from .scorers import AngularDistance, BlockInfluence, RemovalPerplexity, TaylorImportance  # noqa: F401


def make_scorer(name: str, num_layers: int, k: int, cfg: PruneConfig, allowed: list[int] | None = None):
    """The framework-free scorer object of a data-driven criterion."""
    if name == "block_influence":
        return BlockInfluence(num_layers)
    if name == "angular":
        return AngularDistance(num_layers, k, cfg.angular_tokens)
    if name == "ppl":
        return RemovalPerplexity(num_layers)
    if name == "taylor":
        return TaylorImportance(num_layers)
    if name in REPAIR_AWARE:
        cls = LinearFitKL if name == "linear_fit_kl" else LinearFit
        return cls(num_layers, k, allowed if allowed is not None else candidates(num_layers, cfg), cfg.damping,
                   cfg.heldout_every, cfg.max_stats_gb)
    raise CriterionError(f"{name!r} is not a data-driven criterion; those are {', '.join(DATA_DRIVEN)}")
