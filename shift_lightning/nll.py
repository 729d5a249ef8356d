"""The next-token negative log-likelihood, used by the criteria, perplexity and recovery alike.

Framework-free leaf. Position ``t`` of ``logits`` predicts token ``t + 1``; a prediction counts when
both tokens are real (not padding). Log-probabilities are computed in float32 at least (float64 for
float64 models), never in bf16/fp16.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def token_nll(logits: torch.Tensor, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token NLL of every predicted position.

    ``logits``: ``(B, T, V)``; ``input_ids``, ``attention_mask``: ``(B, T)`` (mask ``None``: all real).
    Returns ``(nll, valid)``: ``(B, T-1)`` NLL and the bool mask of positions that count.
    """
    logits = logits[:, :-1]
    if logits.dtype in (torch.float16, torch.bfloat16):
        logits = logits.float()
    labels = input_ids[:, 1:]
    if attention_mask is None:
        valid = torch.ones_like(labels, dtype=torch.bool)
    else:
        valid = attention_mask[:, 1:].bool() & attention_mask[:, :-1].bool()
    nll = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), reduction="none")
    return nll.view(labels.shape), valid


def _chunk_nll_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, labels: torch.Tensor,
                   valid: torch.Tensor, softcap: float | None) -> torch.Tensor:
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    nll = F.cross_entropy(logits, labels, reduction="none")
    return (nll * valid).sum()


def lm_nll_sum(hidden: torch.Tensor, lm_head: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
               chunk_tokens: int = 1024, softcap: float | None = None, loss_mask: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Σ NLL, #predicted tokens)`` from the final hidden states without materialising the logits.

    ``hidden``: ``(B, T, d)`` after the final norm; ``lm_head``: the output ``nn.Linear(d, V)``.
    The same quantity as ``token_nll(lm_head(hidden), ...)`` summed over valid positions, computed
    ``chunk_tokens`` positions at a time; under autograd each chunk is recomputed in the backward
    pass (activation checkpointing), so at most one chunk of ``(chunk_tokens, V)`` float32 logits
    exists at any time instead of ``(B, T, V)``. ``loss_mask`` ``(B, T)`` restricts the targets
    (e.g. to an instruction's response); default: every real token.
    """
    h = hidden[:, :-1].reshape(-1, hidden.shape[-1])
    labels = input_ids[:, 1:].reshape(-1)
    target = loss_mask if loss_mask is not None else attention_mask
    valid = (target[:, 1:].bool() & attention_mask[:, :-1].bool()).reshape(-1)
    keep = valid.nonzero().squeeze(1)
    h, labels = h[keep], labels[keep]
    ones = torch.ones(h.shape[0], dtype=torch.promote_types(h.dtype, torch.float32), device=h.device)
    weight, bias = lm_head.weight, getattr(lm_head, "bias", None)
    total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    for s in range(0, h.shape[0], chunk_tokens):
        args = (h[s:s + chunk_tokens], weight, bias, labels[s:s + chunk_tokens], ones[s:s + chunk_tokens], softcap)
        if torch.is_grad_enabled() and (h.requires_grad or weight.requires_grad):
            from torch.utils.checkpoint import checkpoint

            total = total + checkpoint(_chunk_nll_sum, *args, use_reentrant=False)
        else:
            total = total + _chunk_nll_sum(*args)
    return total, valid.sum()
