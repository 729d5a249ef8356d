"""Closeness of a model to the original: next-token KL and top-1 agreement. Framework-free leaf.

For one position with the original's next-token distribution ``p`` and the model's ``q`` (both over
the vocabulary ``V``)::

    KL(p ‖ q) = Σ_v p_v (log p_v − log q_v)        nats; 0 iff the model predicts exactly as the original
    top1      = [argmax q == argmax p]

The original's distributions are computed once per text set and reused for every model compared
with it, so they are stored compactly (:class:`TopK`): per position the ``k`` most likely tokens of
``p`` and their log-probabilities (``k × 8`` bytes instead of ``V × 4``: 64 → 512 B instead of 1 MiB
for Gemma's 262k vocabulary). KL is then evaluated on the coarse-grained distribution
``(p_1 … p_k, p_tail)`` with ``p_tail = 1 − Σ_k p_i`` (and the same buckets of ``q``)::

    KL_k = Σ_{i≤k} p_i (log p_i − log q_i) + p_tail (log p_tail − log q_tail)

By the log-sum inequality ``KL_k ≤ KL`` (merging outcomes never increases KL), and the gap is the
KL inside the tail, at most ``p_tail``-weighted: small when the top ``k`` carry almost all of
``p``'s mass. The approximation's error against the exact KL is measured on a real model in
``experiments/checks/fidelity_topk.py`` and tested in ``tests/test_closeness.py``.

Memory: the model's logits are consumed a chunk of positions at a time (:func:`kl_top1`), so the
full ``(positions, V)`` float32 array is never held beyond one chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

#: Default number of the original's most likely tokens kept per position.
DEFAULT_TOPK = 256


@dataclass
class TopK:
    """The original's top-``k`` next-token log-probabilities at ``N`` positions.

    ``index``: ``(N, k)`` int64 token ids, most likely first; ``logp``: ``(N, k)`` float32
    log-probabilities (normalised over the full vocabulary)."""

    index: torch.Tensor
    logp: torch.Tensor

    def __len__(self) -> int:
        return self.index.shape[0]

    @property
    def k(self) -> int:
        return self.index.shape[1]

    def slice(self, start: int, stop: int) -> "TopK":
        return TopK(self.index[start:stop], self.logp[start:stop])

    def to(self, device) -> "TopK":
        return TopK(self.index.to(device), self.logp.to(device))

    @staticmethod
    def cat(parts: list["TopK"]) -> "TopK":
        if not parts:
            return TopK(torch.zeros(0, 1, dtype=torch.long), torch.zeros(0, 1))
        return TopK(torch.cat([p.index for p in parts]), torch.cat([p.logp for p in parts]))


def _logp(logits: torch.Tensor, softcap: float | None = None) -> torch.Tensor:
    x = logits.to(torch.promote_types(logits.dtype, torch.float32))
    if softcap:
        x = torch.tanh(x / softcap) * softcap
    return torch.log_softmax(x, dim=-1)


@torch.no_grad()
def topk_reference(logits: torch.Tensor, k: int = DEFAULT_TOPK, softcap: float | None = None,
                   chunk: int = 512) -> TopK:
    """:class:`TopK` of ``logits: (N, V)`` (the original model's), ``chunk`` positions at a time."""
    k = min(k, logits.shape[-1])
    idx, lp = [], []
    for s in range(0, logits.shape[0], chunk):
        v, i = _logp(logits[s:s + chunk], softcap).topk(k, dim=-1)
        idx.append(i.cpu()), lp.append(v.float().cpu())
    if not idx:
        return TopK(torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k))
    return TopK(torch.cat(idx), torch.cat(lp))


@torch.no_grad()
def kl_top1(logits: torch.Tensor, ref: TopK, softcap: float | None = None, chunk: int = 512
            ) -> tuple[torch.Tensor, torch.Tensor]:
    """Per position ``KL_k(p ‖ q)`` (float64, nats) and top-1 agreement (bool) of the model's
    ``logits: (N, V)`` against the original's ``ref`` (same ``N`` positions). See the module doc."""
    assert logits.shape[0] == len(ref), (logits.shape, len(ref))
    kls, agree = [], []
    for s in range(0, logits.shape[0], chunk):
        lq = _logp(logits[s:s + chunk], softcap)
        r = ref.slice(s, s + chunk).to(lq.device)
        lq_k = lq.gather(-1, r.index).double()
        lp_k = r.logp.double()
        p_k = lp_k.exp()
        head = (p_k * (lp_k - lq_k)).sum(-1)
        p_tail = (1.0 - p_k.sum(-1)).clamp_min(0.0)
        q_tail = (1.0 - lq_k.exp().sum(-1)).clamp_min(1e-300)
        tail = torch.where(p_tail > 0, p_tail * (p_tail.clamp_min(1e-300).log() - q_tail.log()),
                           torch.zeros_like(p_tail))
        kls.append((head + tail).clamp_min(0.0).cpu())
        agree.append((lq.argmax(-1) == r.index[:, 0]).cpu())
    if not kls:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.bool)
    return torch.cat(kls), torch.cat(agree)


@torch.no_grad()
def kl_exact(logits_p: torch.Tensor, logits_q: torch.Tensor, softcap: float | None = None, chunk: int = 512
             ) -> torch.Tensor:
    """Exact per-position ``KL(p ‖ q)`` (float64) from both models' full logits ``(N, V)`` (reference
    for measuring the top-``k`` approximation)."""
    out = []
    for s in range(0, logits_p.shape[0], chunk):
        lp, lq = _logp(logits_p[s:s + chunk], softcap).double(), _logp(logits_q[s:s + chunk], softcap).double()
        out.append((lp.exp() * (lp - lq)).sum(-1).cpu())
    return torch.cat(out) if out else torch.zeros(0, dtype=torch.float64)


def lm_softcap(model) -> float | None:
    """The final-logit soft-capping of a model's config (Gemma 2), or None."""
    cfg = getattr(model, "config", None)
    return getattr(cfg, "final_logit_softcapping", None) or None


def _chunked_logits(hidden: torch.Tensor, head, chunk: int):
    for s in range(0, hidden.shape[0], chunk):
        yield s, head(hidden[s:s + chunk])


@torch.no_grad()
def topk_from_hidden(hidden: torch.Tensor, head, k: int = DEFAULT_TOPK, softcap: float | None = None,
                     chunk: int = 512) -> TopK:
    """:func:`topk_reference` of ``head(hidden)`` (``hidden: (N, d)`` after the final norm, ``head``
    the LM head), ``chunk`` positions of logits at a time."""
    return TopK.cat([topk_reference(lg, k, softcap, chunk) for _, lg in _chunked_logits(hidden, head, chunk)]) \
        if hidden.shape[0] else TopK(torch.zeros(0, k, dtype=torch.long), torch.zeros(0, k))


@torch.no_grad()
def kl_top1_from_hidden(hidden: torch.Tensor, head, ref: TopK, softcap: float | None = None, chunk: int = 512
                        ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`kl_top1` of ``head(hidden)`` against ``ref``, ``chunk`` positions of logits at a time."""
    kls, agree = [], []
    for s, lg in _chunked_logits(hidden, head, chunk):
        k_, a_ = kl_top1(lg, ref.slice(s, s + lg.shape[0]), softcap, chunk)
        kls.append(k_), agree.append(a_)
    if not kls:
        return torch.zeros(0, dtype=torch.float64), torch.zeros(0, dtype=torch.bool)
    return torch.cat(kls), torch.cat(agree)


@torch.no_grad()
def window_references(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, k: int = DEFAULT_TOPK,
                      batch_size: int = 4, on_batch=None) -> dict[int, TopK]:
    """The (original) ``model``'s :class:`TopK` at every real position of each window
    ``input_ids, attention_mask: (N, T)``, keyed by window index (CPU tensors). Hidden states are
    computed in batches, the logits a chunk of positions at a time; ``on_batch()`` is called after each
    batch (progress)."""
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    out = {}
    try:
        for s in range(0, input_ids.shape[0], batch_size):
            ids, mask = input_ids[s:s + batch_size].to(dev), attention_mask[s:s + batch_size].to(dev)
            hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            for b in range(ids.shape[0]):
                out[s + b] = topk_from_hidden(hidden[b][mask[b].bool()], model.get_output_embeddings(), k,
                                              lm_softcap(model))
            if on_batch is not None:
                on_batch()
    finally:
        model.train(was)
    return out


@torch.no_grad()
def window_closeness(model, input_ids: torch.Tensor, attention_mask: torch.Tensor, refs: dict[int, TopK],
                     batch_size: int = 4, reduce=None) -> tuple[float, float]:
    """Mean KL(original ‖ ``model``) and top-1 agreement over every real position of the windows, ``refs`` the
    original's :func:`window_references` on them. Across ranks: the windows are this rank's share and
    ``reduce(tensors)`` sums tensors over ranks in place (sums and counts, one call; a rank may have none)."""
    was = model.training
    model.eval()
    dev = next(model.parameters()).device
    head, cap = model.get_output_embeddings(), lm_softcap(model)
    tot = torch.zeros(3, dtype=torch.float64, device=dev)  # Σ KL, Σ agreement, positions
    try:
        for s in range(0, input_ids.shape[0], batch_size):
            ids, mask = input_ids[s:s + batch_size].to(dev), attention_mask[s:s + batch_size].to(dev)
            hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
            for b in range(ids.shape[0]):
                k, a = kl_top1_from_hidden(hidden[b][mask[b].bool()], head, refs[s + b], cap)
                n = torch.tensor(float(k.numel()), dtype=torch.float64, device=k.device)
                tot += torch.stack([k.double().sum(), a.double().sum(), n]).to(dev)
    finally:
        model.train(was)
    if reduce is not None:
        reduce([tot])
    if not tot[2] > 0:
        raise ValueError("window_closeness: no real positions to compare (every window empty or padding)")
    return (tot[0] / tot[2]).item(), (tot[1] / tot[2]).item()


def _chunk_kd_sum(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, index: torch.Tensor,
                  logp: torch.Tensor, softcap: float | None) -> torch.Tensor:
    lq = _logp(torch.nn.functional.linear(hidden, weight, bias), softcap)  # (n, V), float32 at least
    lq_k = lq.gather(-1, index)
    lp_k = logp.to(lq.dtype)
    p_k = lp_k.exp()
    p_tail = (1.0 - p_k.sum(-1)).clamp_min(0.0)
    # log q_tail = logsumexp over the tokens outside the original's top k (no 1 − Σ cancellation)
    lq_tail = torch.logsumexp(lq.scatter(-1, index, float("-inf")), dim=-1)
    tail = torch.where(p_tail > 0, p_tail * (p_tail.clamp_min(1e-30).log() - lq_tail), torch.zeros_like(p_tail))
    return ((p_k * (lp_k - lq_k)).sum(-1) + tail).sum()


def kd_loss_sum(hidden: torch.Tensor, head, ref: TopK, softcap: float | None = None, chunk: int = 1024
                ) -> torch.Tensor:
    """``Σ KL_k(p ‖ q)`` over positions, differentiable in the model (distillation towards the original):
    the same coarse-grained KL as :func:`kl_top1` (``hidden: (N, d)`` after the final norm, ``head``
    the LM head, ``ref`` the original's :class:`TopK` at the same ``N`` positions). The tail bucket's
    ``log q_tail`` is a logsumexp over the tokens outside the top ``k``. Under autograd each chunk of
    logits is recomputed in the backward pass, so at most one ``(chunk, V)`` block exists at a time."""
    assert hidden.shape[0] == len(ref), (hidden.shape, len(ref))
    weight, bias = head.weight, getattr(head, "bias", None)
    total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
    for s in range(0, hidden.shape[0], chunk):
        r = ref.slice(s, s + chunk).to(hidden.device)
        args = (hidden[s:s + chunk], weight, bias, r.index, r.logp, softcap)
        if torch.is_grad_enabled() and (hidden.requires_grad or weight.requires_grad):
            from torch.utils.checkpoint import checkpoint

            total = total + checkpoint(_chunk_kd_sum, *args, use_reentrant=False)
        else:
            total = total + _chunk_kd_sum(*args)
    return total
