"""Closeness to the original model on evaluation text: KL and top-1 agreement per window or doc.

Three kinds of held-out text (the maths and the top-``k`` storage: :mod:`shift_lightning.closeness`):

* every perplexity set (held-out wiki-summaries, LAMBADA passages, …): the positions that predict
  the window's scored tokens, from the very logits the perplexity is computed on (no extra pass);
* ``tasks``: the zero-shot tasks' own prompts, i.e. the distinct contexts the scorer runs for the
  first ``kl_docs`` docs of each task's (seeded) sample, tokenised as the scorer tokenises them
  (lm-eval's joint tokenisation, BOS as configured); every position of a context counts, the last
  one being the distribution over the first answer token. No answer and no label is used.

The original's distributions are recorded once (:meth:`~shift_lightning.evaluation.runner.Evaluator.record_reference`)
and every later evaluation with the same evaluator reports, per set, the mean KL in nats per
position and the top-1 agreement, with 95 % bootstrap intervals over windows (perplexity sets) or
docs (``tasks``): the items are resampled, and the ratio ``Σ KL / Σ positions`` is taken per resample.

Memory: the reference keeps ``k`` (int64 + float32) values per position (256 → 3 KB), e.g. 94 MB for
the 16 k positions of two 16 × 512-token sets plus ~14 k prompt positions, whatever the vocabulary;
the model's logits are consumed one batch (perplexity) or one token budget (prompts) at a time.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from ..closeness import TopK, kl_top1
from . import scoring as S
from .tasks import Doc

#: The closeness set of the zero-shot tasks' prompts.
TASKS_SET = "tasks"


@dataclass(frozen=True)
class PromptWindow:
    """One context of doc ``item``: its tokens; every position's next-token distribution counts."""

    input_ids: tuple[int, ...]
    item: int


def prompt_windows(task_docs: dict[str, list[Doc]], tokenizer, add_bos: bool | None, docs_per_task: int,
                   max_length: int | None = None) -> tuple[list[PromptWindow], list[str]]:
    """The distinct contexts of the first ``docs_per_task`` docs of each task, and the item labels
    (``"<task>/<doc idx>"``; item ``i`` of the windows is label ``i``)."""
    windows, labels = [], []
    for task, docs in task_docs.items():
        for d in docs[:docs_per_task]:
            item = len(labels)
            labels.append(f"{task}/{d.idx}")
            seen = set()
            for c, x in zip(d.contexts, d.continuations):
                ctx, _ = S.encode_pair(tokenizer, c, x, add_bos)
                ctx = tuple(ctx[-max_length:]) if max_length else tuple(ctx)
                if ctx not in seen:
                    seen.add(ctx)
                    windows.append(PromptWindow(ctx, item))
    return windows, labels


@torch.no_grad()
def prompt_logits(model: nn.Module, windows: list[PromptWindow], max_batch_tokens: int, pad_id: int):
    """Yield ``(window index, logits (T, V))`` for ``windows``, right-padded batches of at most
    ``max_batch_tokens`` tokens (similar lengths together)."""
    dev = S._param_device(model)
    order = sorted(range(len(windows)), key=lambda i: -len(windows[i].input_ids))
    s = 0
    while s < len(order):
        width = len(windows[order[s]].input_ids)
        n = max(1, min(len(order) - s, max_batch_tokens // max(width, 1)))
        idx = order[s:s + n]
        ids = torch.full((len(idx), width), pad_id, dtype=torch.long)
        mask = torch.zeros(len(idx), width, dtype=torch.long)
        for b, i in enumerate(idx):
            t = windows[i].input_ids
            ids[b, :len(t)], mask[b, :len(t)] = torch.tensor(t), 1
        logits = model(input_ids=ids.to(dev), attention_mask=mask.to(dev), use_cache=False).logits
        for b, i in enumerate(idx):
            yield i, logits[b, :len(windows[i].input_ids)]
        s += n


class ClosenessSums:
    """Per-item float64 sums of one set (``Σ KL``, ``Σ top-1``, positions), dense over the items so a
    plain sum across ranks gives every rank all of them."""

    def __init__(self, n_items: int, device=None):
        f64 = dict(dtype=torch.float64, device=device)
        self.kl, self.top1, self.n = (torch.zeros(n_items, **f64) for _ in range(3))

    def tensors(self) -> list[torch.Tensor]:
        return [self.kl, self.top1, self.n]

    def add(self, item: int, logits: torch.Tensor, ref: TopK, softcap: float | None) -> None:
        kl, agree = kl_top1(logits, ref, softcap)
        self.kl[item] += kl.sum().to(self.kl.device)
        self.top1[item] += agree.sum().to(self.kl.device)
        self.n[item] += kl.numel()


def summarize(sums: ClosenessSums, n_boot: int = 1000, seed: int = 0) -> dict:
    """Mean KL / top-1 over positions, 95 % bootstrap intervals over items, and the per-item sums."""
    kl, top1, n = (t.cpu().numpy() for t in sums.tensors())
    keep = n > 0
    kl, top1, n = kl[keep], top1[keep], n[keep]
    total = float(n.sum())
    out = {"kl": float(kl.sum() / total) if total else float("nan"),
           "top1": float(top1.sum() / total) if total else float("nan"),
           "positions": int(total), "items": int(keep.sum())}
    if total:
        rng = np.random.default_rng(seed)
        idx = rng.integers(0, len(n), size=(n_boot, len(n)))
        den = n[idx].sum(1)
        out["kl_ci"] = [float(v) for v in np.quantile(kl[idx].sum(1) / den, [0.025, 0.975])]
        out["top1_ci"] = [float(v) for v in np.quantile(top1[idx].sum(1) / den, [0.025, 0.975])]
    out["per_item"] = {"kl": [round(float(v), 6) for v in kl], "top1": [int(v) for v in top1],
                       "n": [int(v) for v in n]}
    return out
