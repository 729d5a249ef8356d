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
=================  ==========  ===================================================================

Scores are "importance": higher = keep (for ``angular`` the score of block ``ℓ`` is the distance
of the span ``[ℓ, ℓ+k)`` that starts there). Selection takes the lowest scores among the
*candidates*, i.e. the blocks the guards allow (``keep_first``/``keep_last``: the "+" heuristic
of Taylor+/PPL+ in Kim et al. 2024, off by default). Ties are broken by the lower block index.

The data-driven criteria are plain scorer classes below (framework-free: forward hooks on
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

import contextlib
import math
import random
from dataclasses import dataclass, field
from typing import Callable, Literal

import torch
import torch.nn.functional as F
from torch import nn

from .arch import block_hooks, block_input, decoder_layers, skip_block, swapped_blocks
from .errors import ShiftError
from .nll import token_nll


class CriterionError(ShiftError, ValueError):
    """Bad pruning request (unknown criterion, impossible ratio, missing data, bad indices)."""


@dataclass
class PruneConfig:
    """Which blocks to remove: explicit ``layers`` or ``ratio`` + ``criterion``."""

    layers: list[int] | None = None
    """Explicit original block indices to remove (overrides ratio/criterion)."""
    ratio: float = 0.25
    """Fraction of blocks to remove: ⌊ratio·L⌋ blocks. Must be in [0, 1)."""
    criterion: Literal["reverse", "reverse_star", "random", "magnitude_l1", "magnitude_l2", "taylor", "ppl",
                       "block_influence", "angular"] = "reverse_star"
    """Selection criterion: reverse, reverse_star, random, magnitude_l1, magnitude_l2, taylor,
    ppl, block_influence, angular (see the module docstring)."""
    seed: int = 0
    """Seed for the ``random`` criterion (recorded in the report)."""
    keep_first: int = 0
    """Guard: never remove the first ``keep_first`` blocks (0 = off). With ``keep_last`` this is
    the "+" heuristic of Taylor+/PPL+ (Kim et al. 2024 keep the first 4 and last 2 blocks)."""
    keep_last: int = 0
    """Guard: never remove the last ``keep_last`` blocks (0 = off; ``True`` means 1)."""
    angular_tokens: Literal["last", "all"] = "last"
    """``angular`` only: compare hidden states on the ``last`` non-padding token of every window
    (as published by Gromov et al.) or on ``all`` non-padding tokens."""
    batch_size: int = 4
    """Windows per forward pass of the data-driven criteria (scores do not depend on it)."""


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
    out = {}
    with torch.no_grad():
        for i, layer in enumerate(decoder_layers(model)):
            out[i] = float(sum(w.detach().double().abs().pow(p).sum() for w in layer.parameters()))
    return out


# --------------------------------------------------------------------------------------------
# The LM call
# --------------------------------------------------------------------------------------------
def _lm_kwargs(batch) -> dict:
    return dict(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False)


# --------------------------------------------------------------------------------------------
# Data-driven scorers (framework-free; fed by hooks; float64 sums all-reduced once)
# --------------------------------------------------------------------------------------------
class BlockInfluence:
    """ShortGPT Block Influence (Men et al. 2024, "ShortGPT: Layers in Large Language Models are
    More Redundant Than You Expect", Eq. 1):

        BI_i = 1 − E_{tokens t} [ x_{i,t}ᵀ x_{i+1,t} / (‖x_{i,t}‖ ‖x_{i+1,t}‖) ]

    with ``x_i``, ``x_{i+1}``: ``(B, T, d)`` input and output of block ``i`` (hooks, pre-norm),
    the mean taken over every non-padding token of the calibration windows. Sums: ``Σcos`` per
    block ``(L,)`` and the token count, float64. Lowest BI is removed first.
    """

    name = "block_influence"
    needs_grad = False

    def __init__(self, num_layers: int):
        self.L = num_layers

    def setup(self, model: nn.Module) -> None:
        dev = next(model.parameters()).device
        self.cos_sum = torch.zeros(self.L, dtype=torch.float64, device=dev)
        self.tokens = torch.zeros(1, dtype=torch.float64, device=dev)

    def step(self, model: nn.Module, batch: dict) -> None:
        mask = batch["attention_mask"].bool()

        def on_block(i, x_in, x_out):
            cos = F.cosine_similarity(x_in.double(), x_out.double(), dim=-1)  # (B, T)
            self.cos_sum[i] += cos[mask].sum()

        with torch.no_grad(), block_hooks(decoder_layers(model), on_block):
            model.model(**_lm_kwargs(batch))  # hidden states only: the LM head is not needed
        self.tokens += mask.sum()

    def state(self) -> list[torch.Tensor]:
        return [self.cos_sum, self.tokens]

    def finalize(self):
        n = float(self.tokens.item())
        bi = (1.0 - self.cos_sum.cpu() / n).tolist()
        return {i: bi[i] for i in range(self.L)}, {"tokens": int(n)}


class AngularDistance:
    """Angular distance of spans (Gromov et al. 2024, "The Unreasonable Ineffectiveness of the
    Deeper Layers", Eq. 7):

        d(x^ℓ, x^{ℓ+n}) = (1/π) · arccos( x^ℓ·x^{ℓ+n} / (‖x^ℓ‖ ‖x^{ℓ+n}‖) )

    where ``x^ℓ`` is the hidden state entering block ``ℓ`` (``x^L``: leaving the last block,
    pre-norm) and ``n = k``. The paper takes the *last* token of each sequence and averages the
    distance over samples; ``tokens="all"`` averages over every non-padding token instead. The
    span ``[ℓ*, ℓ*+k)`` with the smallest mean distance is removed.

    Sums: ``Σd`` per start ``ℓ = 0..L−k`` (float64) and the count of samples (``last``) or tokens
    (``all``).
    """

    name = "angular"
    needs_grad = False

    def __init__(self, num_layers: int, k: int, tokens: str = "last"):
        if tokens not in ("last", "all"):
            raise CriterionError(f"--prune.angular_tokens must be 'last' or 'all', got {tokens!r}")
        if not 1 <= k <= num_layers:
            raise CriterionError(f"angular needs 1 <= k <= {num_layers}, got k={k}")
        self.L, self.k, self.tokens = num_layers, k, tokens

    def setup(self, model: nn.Module) -> None:
        dev = next(model.parameters()).device
        self.dist_sum = torch.zeros(self.L - self.k + 1, dtype=torch.float64, device=dev)
        self.count = torch.zeros(1, dtype=torch.float64, device=dev)

    def _pick(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(B, T, d)`` → ``(N, d)``: the last non-padding token per window, or all of them."""
        if self.tokens == "all":
            return x[mask]
        pos = torch.arange(mask.shape[1], device=mask.device)
        last = (mask.long() * (pos + 1)).argmax(dim=1)  # index of the last non-padding token
        return x[torch.arange(x.shape[0], device=x.device), last]

    def step(self, model: nn.Module, batch: dict) -> None:
        mask = batch["attention_mask"].bool()
        states: list[torch.Tensor | None] = [None] * (self.L + 1)

        def on_block(i, x_in, x_out):
            states[i] = self._pick(x_in, mask).detach()
            if i == self.L - 1:
                states[self.L] = self._pick(x_out, mask).detach()

        with torch.no_grad(), block_hooks(decoder_layers(model), on_block):
            model.model(**_lm_kwargs(batch))
        for start in range(self.L - self.k + 1):
            cos = F.cosine_similarity(states[start].double(), states[start + self.k].double(), dim=-1)
            self.dist_sum[start] += (torch.arccos(cos.clamp(-1.0, 1.0)) / math.pi).sum()
        self.count += states[0].shape[0]

    def state(self) -> list[torch.Tensor]:
        return [self.dist_sum, self.count]

    def finalize(self):
        n = float(self.count.item())
        d = (self.dist_sum.cpu() / n).tolist()
        spans = {f"{s}-{s + self.k - 1}": d[s] for s in range(len(d))}
        return {s: d[s] for s in range(len(d))}, {
            "angular_tokens": self.tokens, ("samples" if self.tokens == "last" else "tokens"): int(n),
            "span_length": self.k, "span_distances": spans,
            "scores_are": "angular distance of the span of k blocks starting at each block",
        }


class _Replay(nn.Module):
    """Stands in for block ``j <= i`` while the model is replayed from block ``i``'s cached input:
    blocks before ``i`` pass their input on untouched (it is discarded), block ``i`` (the removed
    one) hands on the cached state ``h_i`` it was called with in the full pass."""

    def __init__(self, state: torch.Tensor | None = None):
        super().__init__()
        self.state = state

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states if self.state is None else self.state


class RemovalPerplexity:
    """PPL criterion (Kim et al. 2024, "Shortened LLaMA", PPL metric): for every block ``i``,
    the perplexity of the model with block ``i`` removed (replaced by the identity),
    ``exp(Σ NLL / N)`` over the ``N`` predicted non-padding tokens of the calibration windows.
    One-shot: the blocks whose single removal gives the lowest perplexity are removed. The
    unpruned model's perplexity is reported as ``base_ppl``.

    Sums: token NLL ``(L+1,)`` (entry 0: nothing removed, entry ``i+1``: block ``i`` removed) and
    the token count, float64.

    Cost (``replay=True``, default): one full pass caches ``h_i: (B, T, d)``, the hidden state
    entering every block ``i``; removing block ``i`` leaves blocks ``0 … i−1`` unchanged, so the
    model is then replayed from ``h_i`` handed straight to block ``i+1``: blocks ``i+1 … L−1``,
    the final norm and the LM head. That is ``L + L(L−1)/2`` block calls (+ ``L+1`` LM heads) per
    batch instead of ``L(L+1)`` for ``replay=False`` (``L+1`` full passes, the reference); the
    numbers are the same, since every block sees the same inputs in both. Memory: the ``L``
    cached states of one batch.
    """

    name = "ppl"
    needs_grad = False

    def __init__(self, num_layers: int, replay: bool = True):
        self.L, self.replay = num_layers, replay

    def setup(self, model: nn.Module) -> None:
        dev = next(model.parameters()).device
        self.nll_sum = torch.zeros(self.L + 1, dtype=torch.float64, device=dev)
        self.tokens = torch.zeros(1, dtype=torch.float64, device=dev)

    def _add(self, j: int, logits: torch.Tensor, batch: dict) -> torch.Tensor:
        nll, valid = token_nll(logits, batch["input_ids"], batch["attention_mask"])
        self.nll_sum[j] += nll.double()[valid].sum()
        return valid

    @torch.no_grad()
    def step(self, model: nn.Module, batch: dict) -> None:
        layers = decoder_layers(model)
        if not self.replay:  # reference: L+1 full passes, block j-1 made an identity in pass j
            for j in range(self.L + 1):
                with skip_block(layers[j - 1]) if j > 0 else contextlib.nullcontext():
                    valid = self._add(j, model(**_lm_kwargs(batch)).logits, batch)
            self.tokens += valid.sum()
            return
        inputs: list[torch.Tensor | None] = [None] * self.L

        def record(i):
            def hook(module, args, kwargs):
                inputs[i] = block_input(args, kwargs)
            return hook

        handles = [layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(layers)]
        try:
            valid = self._add(0, model(**_lm_kwargs(batch)).logits, batch)
        finally:
            for h in handles:
                h.remove()
        for i in range(self.L):
            stubs = {j: _Replay(inputs[i] if j == i else None) for j in range(i + 1)}
            with swapped_blocks(model, stubs):
                self._add(i + 1, model(**_lm_kwargs(batch)).logits, batch)
            inputs[i] = None  # free as we go
        self.tokens += valid.sum()

    def state(self) -> list[torch.Tensor]:
        return [self.nll_sum, self.tokens]

    def finalize(self):
        n = float(self.tokens.item())
        mean_nll = (self.nll_sum.cpu() / n).tolist()
        ppl = [math.exp(min(v, 700.0)) for v in mean_nll]
        return {i: ppl[i + 1] for i in range(self.L)}, {
            "tokens": int(n), "base_ppl": ppl[0], "base_nll": mean_nll[0],
            "removal_nll": {str(i): mean_nll[i + 1] for i in range(self.L)},
            "scores_are": "perplexity on the calibration windows with that one block removed",
        }


class TaylorImportance:
    """First-order Taylor importance (Kim et al. 2024, "Shortened LLaMA", Taylor metric, after
    LLM-Pruner / Molchanov et al.):

        I_i = Σ_{W ∈ block i} Σ_jk | W_jk · ∂L(D)/∂W_jk |

    over all parameters of block ``i`` (linear and norm weights). ``L(D)`` is the LM loss over the
    whole calibration set ``D``: the mean next-token NLL over its ``N`` predicted non-padding
    tokens. Per batch ``b`` we backpropagate the token-*summed* NLL ``S_b`` and accumulate the
    signed ``W · ∂S_b/∂W`` per weight in float64; after the (all-ranks) sum, ``|·|`` is taken and
    divided by ``N``. Since ``L(D) = Σ_b S_b / N``, this is exactly ``|W · ∂L(D)/∂W|``,
    independent of batching and of the number of ranks. (The reference code sums HF's per-batch
    *mean* loss over batches; with equal-length unpadded batches that is the same up to a
    constant factor, so the ranking is the same.)

    Memory: one float64 accumulator per block parameter.
    """

    name = "taylor"
    needs_grad = True

    def __init__(self, num_layers: int):
        self.L = num_layers

    def setup(self, model: nn.Module) -> None:
        self.params = [list(layer.parameters()) for layer in decoder_layers(model)]
        self.acc = [[torch.zeros_like(p, dtype=torch.float64) for p in ps] for ps in self.params]
        self.tokens = torch.zeros(1, dtype=torch.float64, device=self.params[0][0].device)

    def step(self, model: nn.Module, batch: dict) -> None:
        flat = [p for ps in self.params for p in ps]
        saved = [p.requires_grad for p in flat]
        try:
            for p in flat:
                p.requires_grad_(True)
            with torch.enable_grad():
                logits = model(**_lm_kwargs(batch)).logits
                nll, valid = token_nll(logits, batch["input_ids"], batch["attention_mask"])
                loss = nll[valid].sum()  # S_b: token-summed NLL of this batch
                grads = torch.autograd.grad(loss, flat, allow_unused=True)
        finally:
            for p, r in zip(flat, saved):
                p.requires_grad_(r)
        with torch.no_grad():
            for a, p, g in zip((a for accs in self.acc for a in accs), flat, grads):
                if g is not None:  # None: the parameter does not influence the loss
                    a += p.detach().double() * g.double()
        self.tokens += valid.sum()

    def state(self) -> list[torch.Tensor]:
        return [a for accs in self.acc for a in accs] + [self.tokens]

    def finalize(self):
        n = float(self.tokens.item())
        scores = {i: float(sum(a.abs().sum() for a in accs).item() / n) for i, accs in enumerate(self.acc)}
        self.acc = None  # free the accumulators (float64 copy of every block weight)
        return scores, {"tokens": int(n), "loss": "mean next-token NLL over all calibration tokens"}


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
DATA_DRIVEN: tuple[str, ...] = ("taylor", "ppl", "block_influence", "angular")

#: Every criterion name.
CRITERIA: tuple[str, ...] = tuple(POSITIONAL) + tuple(WEIGHT_BASED) + DATA_DRIVEN


def make_scorer(name: str, num_layers: int, k: int, cfg: PruneConfig):
    """The framework-free scorer object of a data-driven criterion."""
    if name == "block_influence":
        return BlockInfluence(num_layers)
    if name == "angular":
        return AngularDistance(num_layers, k, cfg.angular_tokens)
    if name == "ppl":
        return RemovalPerplexity(num_layers)
    if name == "taylor":
        return TaylorImportance(num_layers)
    raise CriterionError(f"{name!r} is not a data-driven criterion; those are {', '.join(DATA_DRIVEN)}")


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


def choose(cfg: PruneConfig, plan: Plan, scores: dict[int, float], details: dict) -> Selection:
    """Blocks to remove from a data-driven scorer's (reduced) scores."""
    details = {**plan.guards, **details}
    if cfg.criterion == "angular":
        start = best_span(scores, plan.allowed, plan.k)
        return Selection(list(range(start, start + plan.k)), cfg.criterion, scores, details)
    return Selection(lowest(scores, plan.allowed, plan.k), cfg.criterion, scores, details)
