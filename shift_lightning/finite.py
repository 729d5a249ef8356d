"""Non-finite is never success: the one place that decides.

A NaN or an infinity in a metric a run reports (perplexity, accuracy, loss, KL) or in a weight it
exports or resumes from ends the run with one :class:`NonFiniteError` line and exit status 2,
never with a result written and exit 0. Used by evaluation (before its results are written),
training (before the model is exported, and when a checkpoint is resumed) and loading
(:func:`shift_lightning.weightfiles.check_finite`).
"""

from __future__ import annotations

import math
from typing import Any, Iterable

from .errors import ShiftError


class NonFiniteError(ShiftError, ArithmeticError):
    """A result or a weight is NaN or infinite."""


def _nonfinite(v: Any) -> bool:
    return isinstance(v, float) and not math.isfinite(v)


def check_metrics(metrics: dict[str, Any], what: str, fix: str) -> None:
    """Refuse ``metrics`` (name -> number) holding a NaN or an infinity."""
    bad = [f"{k} = {v}" for k, v in metrics.items() if _nonfinite(v)]
    if bad:
        raise NonFiniteError(f"{what}: {', '.join(bad[:4])} (not finite); nothing was written. {fix}")


def eval_metrics(res: dict) -> dict[str, Any]:
    """The reported numbers of an evaluation result (per task, per perplexity set, the average)."""
    out: dict[str, Any] = {}
    for t, e in (res.get("tasks") or {}).items():
        for k in ("value", "acc", "acc_norm", "ppl"):
            if k in e:
                out[f"{t}/{k}"] = e[k]
    for p, e in (res.get("perplexity") or {}).items():
        out[f"ppl {p}"] = e.get("ppl")
    for name, v in (res.get("kl") or {}).items():
        out[f"kl {name}"] = v
    out["average"] = res.get("average")
    return out


def check_tensors(named: Iterable[tuple[str, Any]], what: str, fix: str) -> None:
    """Refuse floating-point tensors holding a NaN or an infinity, naming them."""
    import torch

    bad = []
    with torch.no_grad():
        for name, t in named:
            if isinstance(t, torch.Tensor) and t.is_floating_point() and t.device.type != "meta" \
                    and not bool(torch.isfinite(t.detach()).all()):
                bad.append(name)
    if bad:
        raise NonFiniteError(f"{what}: non-finite weights (NaN or infinity) in {bad[:3]}"
                             f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}. {fix}")


def check_trained(model, metrics: dict[str, Any], steps: int) -> None:
    """Before a trained model is exported: its weights and its last metrics are finite."""
    fix = ("The training diverged (lower --recovery.lr, set --trainer.gradient_clip_val) or resumed from a damaged "
           "checkpoint (start afresh with --overwrite)")
    check_tensors(model.named_parameters(), f"after {steps} training steps", "Nothing was exported. " + fix)
    check_metrics({k: v for k, v in metrics.items() if isinstance(v, float)}, f"after {steps} training steps", fix)


def _flat(doc, prefix=""):
    if isinstance(doc, dict):
        for k, v in doc.items():
            yield from _flat(v, f"{prefix}{k}.")
    else:
        yield prefix.rstrip("."), doc


def check_checkpoint(ck: dict, path) -> None:
    """A checkpoint to resume from holds only finite weights."""
    check_tensors(_flat(ck.get("state_dict") or {}), f"checkpoint {path}",
                  "It cannot be resumed; start afresh with --overwrite")
