"""Formatting shared by the grids' tables."""

from __future__ import annotations

from pathlib import Path

#: Short names of the zero-shot tasks and the text sets in table headers.
TASK_LABELS = {"arc_easy": "ARC-e", "arc_challenge": "ARC-c", "hellaswag": "HellaSwag", "piqa": "PIQA",
               "winogrande": "WinoG", "boolq": "BoolQ", "openbookqa": "OBQA"}
SET_LABELS = {"wiki_summaries": "wiki", "lambada": "LAMBADA", "tasks": "tasks"}


def set_label(name: str) -> str:
    """``wiki_summaries`` → ``wiki``; a path → its file stem."""
    return SET_LABELS.get(name, Path(name).stem)


def fmt_ppl(v: float) -> str:
    return f"{v:.2f}" if v < 1e4 else f"{v:.2e}"


def fmt_ci(v, ci, pct: bool = True, digits: int = 1) -> str:
    """``v [lo, hi]`` (in points when ``pct``); ``–`` when missing."""
    if v is None or v != v:
        return "–"
    k = 100 if pct else 1
    return f"{k * v:.{digits}f} [{k * ci[0]:.{digits}f}, {k * ci[1]:.{digits}f}]"


def fmt_diff(d: dict, key: str) -> str:
    """``±x [lo, hi]`` with ↑ / ↓ when the 95 % interval lies above / below 0; ``–`` when missing."""
    return fmt_change(d[f"{key}_diff"], d[f"{key}_diff_ci"])


def fmt_change(v: float, ci) -> str:
    """A difference and its 95 % interval, as :func:`fmt_diff`."""
    lo, hi = ci
    if v != v:
        return "–"
    mark = "↑" if lo > 0 else "↓" if hi < 0 else ""
    return f"{100 * v:+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}]{mark}"


def fmt_kl(v) -> str:
    if v is None or v != v:
        return "…"
    return f"{v:.3f}" if v < 100 else f"{v:.3g}"


def blocks_label(layers) -> str:
    """``[3, 12, 13, 14]`` → ``3, 12–14``."""
    if not layers:
        return "…"
    from shift_lightning.maps import contiguous_spans

    return ", ".join(f"{s}" if e - s == 1 else f"{s}–{e - 1}" for s, e in contiguous_spans(layers))


#: KL differences (nats per position) below this are ties: refits of the same map (a guard that chose it, a row
#: reused from another) differ by up to ~2e-7 from float summation order; the tables report 3 decimals and
#: the bootstrap intervals are ±0.02–0.05.
KL_TIE = 1e-6


def lower_kl_everywhere(kl: dict, ref: dict) -> bool:
    """Whether ``kl`` (set -> KL) is below ``ref`` on every held-out set by more than :data:`KL_TIE` (a tie is
    not below)."""
    return all(kl[s] < ref[s] - KL_TIE for s in kl)
