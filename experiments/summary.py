"""Summaries of zero-shot results, with paired bootstrap intervals over documents. Framework-free.

The paper's average (mean of the seven tasks' reported metrics) can be *won* by a damaged model:
on BoolQ a model that answers "yes" to everything scores the majority rate (~62 %), above what a
small healthy model scores, and small-sample noise on WinoGrande moves the average by points. So
beside it we report a summary a collapsed model cannot win:

    robust = mean over eligible tasks t of  (acc_t − chance_t) / (acc_t(original) − chance_t)

the share of the original model's above-chance accuracy that is kept. ``chance_t`` is the best
answer-blind strategy on the same docs (uniform guessing or always the same choice index, e.g.
BoolQ's "yes"; :func:`~shift_lightning.evaluation.evaluator.chance_level`); a task is *eligible* when
the original is clearly above chance on it (margin over 3 bootstrap standard errors). A model
answering at chance keeps 0 %, the original keeps 100 %.

Intervals: docs are resampled with replacement within each task, the same resample for every row
(rows are scored on the same docs, so differences are paired), ``n_boot`` times; 95 % percentile
intervals.
"""

from __future__ import annotations

import numpy as np

from shift_lightning.errors import ConfigError


def task_vectors(result: dict) -> dict[str, np.ndarray]:
    """Per task: the per-doc 0/1 outcomes of the task's reported metric (``acc`` or ``acc_norm``)."""
    out = {}
    for t, e in result["tasks"].items():
        if "chance" not in e:  # loglikelihood tasks (LAMBADA) are not part of the average
            continue
        out[t] = np.asarray(e["per_doc"][e["metric"]], dtype=np.float64)
    return out


def _check_aligned(rows: dict[str, dict]) -> list[str]:
    names = list(rows)
    tasks = [t for t in rows[names[0]]["tasks"] if "chance" in rows[names[0]]["tasks"][t]]
    for n in names[1:]:
        for t in tasks:
            a, b = rows[names[0]]["tasks"][t]["per_doc"]["doc_ids"], rows[n]["tasks"][t]["per_doc"]["doc_ids"]
            if a != b:
                raise ConfigError(f"rows {names[0]!r} and {n!r} were scored on different {t} docs (runs made with other "
                                  "--docs / --sample_seed); move the old runs away or use the same settings")
    return tasks


class Bootstrap:
    """Paired bootstrap over docs for rows scored on the same docs (see the module docstring)."""

    def __init__(self, rows: dict[str, dict], original: str, n_boot: int = 2000, seed: int = 0):
        self.tasks = _check_aligned(rows)
        self.rows, self.original, self.n_boot = rows, original, n_boot
        rng = np.random.default_rng(seed)
        first = rows[original]["tasks"]
        self.idx = {t: rng.integers(0, len(first[t]["per_doc"]["doc_ids"]),
                                    size=(n_boot, len(first[t]["per_doc"]["doc_ids"]))) for t in self.tasks}
        self.chance = {t: float(first[t]["chance"]) for t in self.tasks}
        self._vec = {n: task_vectors(r) for n, r in rows.items()}
        self._memo: dict[str, tuple[dict[str, float], dict[str, np.ndarray]]] = {}
        self._counts: dict[str, np.ndarray] = {}
        o = self._vec[original]
        self._orig_point = {t: float(o[t].mean()) for t in self.tasks}
        self._orig_boot = {t: self._resampled(t, o[t]) for t in self.tasks}
        self.eligible = [t for t in self.tasks
                         if self._orig_point[t] - self.chance[t] > 3 * float(self._orig_boot[t].std())]

    def _means(self, name: str) -> tuple[dict[str, float], dict[str, np.ndarray]]:
        """One row's per-task means and resampled means (computed once per row: the tables ask for a row many
        times, in its summary and in each difference it is part of; callers only read them)."""
        if name not in self._memo:
            v = self._vec[name]
            self._memo[name] = ({t: float(v[t].mean()) for t in self.tasks},
                                {t: self._resampled(t, v[t]) for t in self.tasks})
        return self._memo[name]

    def _resampled(self, t: str, x: np.ndarray) -> np.ndarray:
        """``x[self.idx[t]].mean(1)``, the mean of ``x`` over each resample of task ``t``'s docs. For 0/1 outcomes:
        each resample's draw count of every doc (counted once per task) summed over the docs where ``x`` is 1, over
        the number of docs. That integer is the exact sum of the drawn outcomes, so the result is the same to the bit
        as the mean of the drawn outcomes, without gathering them (~7x faster)."""
        idx = self.idx[t]
        b, n = idx.shape
        if not np.all((x == 0) | (x == 1)):
            return x[idx].mean(1)
        if t not in self._counts:
            flat = (idx + n * np.arange(b)[:, None]).ravel()
            self._counts[t] = np.bincount(flat, minlength=b * n).reshape(b, n).astype(np.min_scalar_type(n))
        return self._counts[t][:, np.flatnonzero(x)].sum(1, dtype=np.int64) / n

    def _robust(self, means: dict, orig: dict, floor: bool = False):
        if not self.eligible:
            return float("nan") if not isinstance(next(iter(means.values())), np.ndarray) else \
                np.full(self.n_boot, np.nan)
        parts = []
        for t in self.eligible:
            den = orig[t] - self.chance[t]
            if floor:  # keep resampled denominators away from 0 (eligible tasks are > 3 SE above chance)
                den = np.maximum(den, 0.25 * (self._orig_point[t] - self.chance[t]))
            parts.append((means[t] - self.chance[t]) / den)
        return sum(parts) / len(parts)

    def summary(self, name: str) -> dict:
        """``avg`` and ``robust`` with 95 % intervals, for one row."""
        point, boot = self._means(name)
        avg_b = sum(boot.values()) / len(self.tasks)
        rob_b = self._robust(boot, self._orig_boot, floor=True)
        return {"avg": sum(point.values()) / len(self.tasks), "avg_ci": _ci(avg_b),
                "robust": self._robust(point, self._orig_point), "robust_ci": _ci(rob_b)}

    def robust_samples(self, name: str) -> tuple[float, np.ndarray]:
        """One row's Robust and its ``n_boot`` resampled values (the same doc resamples for every row, so
        a statistic computed over several rows can be resampled with them)."""
        point, boot = self._means(name)
        return self._robust(point, self._orig_point), self._robust(boot, self._orig_boot, floor=True)

    def difference(self, a: str, b: str) -> dict:
        """``a − b`` in avg and robust, with paired 95 % intervals."""
        pa, ba = self._means(a)
        pb, bb = self._means(b)
        avg_b = (sum(ba.values()) - sum(bb.values())) / len(self.tasks)
        rob_b = self._robust(ba, self._orig_boot, True) - self._robust(bb, self._orig_boot, True)
        return {"avg_diff": (sum(pa.values()) - sum(pb.values())) / len(self.tasks), "avg_diff_ci": _ci(avg_b),
                "robust_diff": self._robust(pa, self._orig_point) - self._robust(pb, self._orig_point),
                "robust_diff_ci": _ci(rob_b)}

    def towards(self, a: str, b: str) -> dict:
        """``a − b`` in avg split into the part that moves each task back towards the original's accuracy
        (:func:`back_towards`) and the rest, with paired 95 % intervals: where ``b`` is pruning alone and
        ``a`` its repair, ``rest`` is what the repair changes beyond undoing pruning's effect on each task."""
        o, ob = self._orig_point, self._orig_boot
        (pa, ba), (pb, bb) = self._means(a), self._means(b)
        n = len(self.tasks)

        def split(ma, mb, mo):
            d = {t: ma[t] - mb[t] for t in self.tasks}
            back = {t: back_towards(d[t], mo[t] - mb[t]) for t in self.tasks}
            return sum(d.values()) / n, sum(back.values()) / n, sum(d[t] - back[t] for t in self.tasks) / n

        diff, towards, rest = split(pa, pb, o)
        _, towards_b, rest_b = split(ba, bb, ob)
        return {"avg_diff": float(diff), "towards": float(towards), "towards_ci": _ci(towards_b),
                "rest": float(rest), "rest_ci": _ci(rest_b)}

    def meta(self) -> dict:
        return {"chance": self.chance, "eligible_tasks": self.eligible, "n_boot": self.n_boot,
                "original_task_acc": self._orig_point,
                "docs_per_task": {t: int(self.idx[t].shape[1]) for t in self.tasks}}


def back_towards(change, gap):
    """The part of a task's ``change`` from a reference (pruning alone) that moves it back towards the
    original, no further than it: ``change`` clipped to lie between 0 and ``gap = original − reference``
    (floats or arrays)."""
    return np.clip(change, np.minimum(gap, 0.0), np.maximum(gap, 0.0))


#: A bound closer to 0 than this is 0: differences of means of 0/1 outcomes that are exactly 0 come out of float
#: sums as ±1e-16, which would make an interval that touches 0 read as lying below (or above) it.
ZERO = 1e-12


def _ci(samples: np.ndarray) -> list[float]:
    s = samples[np.isfinite(samples)]
    if s.size == 0:
        return [float("nan"), float("nan")]
    return [0.0 if abs(b) < ZERO else b for b in (float(np.quantile(s, 0.025)), float(np.quantile(s, 0.975)))]
