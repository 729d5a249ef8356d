"""The data-driven scorers (framework-free: forward hooks, float64 sums all-reduced once; fed by
:mod:`shift_lightning.selection`). Each exposes ``setup(model)``, ``step(model, batch)``, ``state()``
and ``finalize() -> (scores, details)``."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from ..arch import block_hooks, block_input, decoder_layers, skip_block, swapped_blocks
from ..nll import token_nll
from .base import CriterionError


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

    def setup(self, model: nn.Module, device=None) -> None:
        dev = device or next(model.parameters()).device
        self.cos_sum = torch.zeros(self.L, dtype=torch.float64, device=dev)
        self.tokens = torch.zeros(1, dtype=torch.float64, device=dev)

    def on_block(self, i: int, x_in: torch.Tensor, x_out: torch.Tensor, mask: torch.Tensor, entry: int = 0) -> None:
        """Block ``i`` ran on one batch (block-major walks call this block by block, every batch)."""
        cos = F.cosine_similarity(x_in.double(), x_out.double(), dim=-1)  # (B, T)
        self.cos_sum[i] += cos[mask].sum()
        if i == 0:
            self.tokens += mask.sum()

    def step(self, model: nn.Module, batch: dict) -> None:
        mask = batch["attention_mask"].bool()
        with torch.no_grad(), block_hooks(decoder_layers(model), lambda i, a, b: self.on_block(i, a, b, mask)):
            model.model(**_lm_kwargs(batch))  # hidden states only: the LM head is not needed

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

    def setup(self, model: nn.Module, device=None) -> None:
        dev = device or next(model.parameters()).device
        self.dist_sum = torch.zeros(self.L - self.k + 1, dtype=torch.float64, device=dev)
        self.count = torch.zeros(1, dtype=torch.float64, device=dev)
        self._kept: dict[int, dict[int, torch.Tensor]] = {}  # per batch: the picked states still needed

    def _pick(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """``(B, T, d)`` → ``(N, d)``: the last non-padding token per window, or all of them."""
        if self.tokens == "all":
            return x[mask]
        pos = torch.arange(mask.shape[1], device=mask.device)
        last = (mask.long() * (pos + 1)).argmax(dim=1)  # index of the last non-padding token
        return x[torch.arange(x.shape[0], device=x.device), last]

    def on_block(self, i: int, x_in: torch.Tensor, x_out: torch.Tensor, mask: torch.Tensor, entry: int = 0) -> None:
        """Block ``i`` ran on batch ``entry``: ``x^i`` and (last block) ``x^L`` picked; a span's distance is added as
        soon as the state at its end is known, and only the last ``k`` states of a batch are kept."""
        kept = self._kept.setdefault(entry, {})
        kept[i] = self._pick(x_in, mask).detach()
        if i == 0:
            self.count += kept[0].shape[0]
        if i == self.L - 1:
            kept[self.L] = self._pick(x_out, mask).detach()
        for end in (i, self.L) if i == self.L - 1 else (i,):
            start = end - self.k
            if start >= 0:
                cos = F.cosine_similarity(kept[start].double(), kept[end].double(), dim=-1)
                self.dist_sum[start] += (torch.arccos(cos.clamp(-1.0, 1.0)) / math.pi).sum()
                del kept[start]
        if i == self.L - 1:
            del self._kept[entry]

    def step(self, model: nn.Module, batch: dict) -> None:
        mask = batch["attention_mask"].bool()
        with torch.no_grad(), block_hooks(decoder_layers(model), lambda i, a, b: self.on_block(i, a, b, mask)):
            model.model(**_lm_kwargs(batch))

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


