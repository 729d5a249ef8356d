"""``--calibration.mode auto`` (solvers ``lra`` and ``lra_replaceme``): which way of fitting the LRA (or the joint
map) keeps the pruned model closest to the original, judged on held-out calibration windows.

No one way of fitting wins everywhere. On SmolLM2-135M's held-out calibration windows the span LRA
fitted ``anchored`` (each span from the corrected pruned state to the original's state at its end) is
the closest under the criteria that keep the first blocks (Taylor, magnitude-L2, PPL: KL 0.569 / 0.620
/ 0.525 against 0.594 / 0.751 / 0.582 fitted independently) and the furthest where block 0 or 1 is
removed (random 1.185 against 1.066, magnitude-L1 1.338 against 1.034), and the evaluated sets agree
(``results/bench/anchored_check_smollm2.md``). So this mode does not guess: every
``heldout_every``-th calibration window is held out (the guards' split), each fit of
:attr:`~shift_lightning.maps.solvers.ridge.LRA.fits` is made on the others, the pruned
model is run on the held-out windows with each fit's maps in place (:class:`FitJudge`) and the fit
with the lowest mean next-token ``KL(original ‖ model)`` (the original's top-``heldout_topk``; ties go to
the earlier fit, the paper's per-block LRA first) is refitted on all windows. The choice is per run,
not per span: a sequential or anchored span's map assumes the maps before it. The held-out windows
are calibration text, never evaluated data.

Cost: each fit once on 1 − 1/k of the windows, one original and one pruned forward per fit over the
held-out windows, and the chosen fit once more on all windows (about 4.5 LRA calibrations). Fits that
are the same maps for the removed blocks (:func:`coinciding_fits`: with one span the three span modes;
with only one-block spans the per-block and the span LRA) are fitted and judged once.

``lra_replaceme`` in ``mode: auto`` does the same for the joint map
(:attr:`~shift_lightning.maps.solvers.joint.LRAReplaceMe.fits`: independent, sequential, anchored; each
fit's maps are an adapter and ReplaceMe's branch map, judged with both in place): with one span it is the joint
map, judged once; otherwise three fits on 1 − 1/k of the windows, the judge pass and the refit (4.19× the joint
map's calibration time on SmolLM2, Taylor's blocks: ``results/bench/auto_cost_joint_smollm2.md``).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import torch

from ..data import TokenWindows
from ..errors import ConfigError
from ..passes import sum_across_ranks
from .judge import GuardJudge

log = logging.getLogger(__name__)


class FitJudge(GuardJudge):
    """The guard's judge pass (one original forward over the held-out windows, states cached from the
    block before the first span), judging whole corrections: ``fits[name][span.key]`` is fit
    ``name``'s map at each span; all spans are in place at once."""

    stage = "mode auto: closeness of each fit on held-out windows"

    def __init__(self, model, removed: list[int], spans, fits: dict[str, dict], topk: int = 64,
                 solver: str = "lra"):
        super().__init__(model, removed, spans, candidates={}, default={}, topk=topk)
        self.fits = fits
        self.stage = f"{solver}: closeness of each fit on held-out windows"

    @torch.no_grad()
    def finish(self) -> None:
        sums = torch.zeros(len(self.fits), 3, dtype=torch.float64, device=self.device)
        bar = self.progress(f"{self.stage}, each fit", len(self.fits))
        for fi, (name, maps) in enumerate(self.fits.items()):
            for m in maps.values():
                if m.adapter is not None:
                    m.adapter.to(self.device)
            self._score([e["h"] for e in self._batches], self.b0, maps, sums[fi])
            bar.step(extra=name)
        bar.close()
        sum_across_ranks([sums], self.trainer)
        n = sums[:, 2].clamp_min(1)
        kl, top1 = (sums[:, 0] / n).tolist(), (sums[:, 1] / n).tolist()
        names = list(self.fits)
        best = min(range(len(names)), key=lambda i: (kl[i], i))
        self.results = {"chosen": names[best], "positions": int(sums[0, 2].item()),
                        "kl": dict(zip(names, kl)), "top1": dict(zip(names, top1))}
        self._batches = []


def coinciding_fits(fits, spans) -> dict[str, str]:
    """Fit name -> the earlier fit whose maps it equals for these spans (so it is neither fitted nor judged
    again). With one span nothing comes before it: fitted sequentially (on the corrected pruned state) or
    anchored (to the original's state at its end) it sees what the independent fit sees. When every span
    is one block, the span LRA is the per-block LRA."""
    one_span = len(spans) == 1
    one_block = all(sp.end - sp.start == 1 for sp in spans)
    first: dict[tuple, str] = {}
    same = {}
    for name, gran, mode in fits:
        mode = "independent" if one_span else mode
        key = ("block" if one_block and mode == "independent" else gran, mode)
        if key in first:
            same[name] = first[key]
        else:
            first[key] = name
    return same


def choose_fit(module, trainer, windows: TokenWindows, heldout: TokenWindows | None, batch_size: int = 4) -> dict:
    """Fill ``module`` (a :class:`~shift_lightning.calibration.CalibrationModule` in ``mode: auto``, solver ``lra``
    or ``lra_replaceme``) with the chosen fit's maps; returns the judgement (also
    ``module.reports[span]["guards"][key]``)."""
    name = module.primary
    solver = module.solvers[name]
    cfg, base = solver.cfg, solver.name
    k = cfg.heldout_every
    held = torch.tensor([i % k == k - 1 for i in range(len(windows))], dtype=torch.bool)
    if not held.any() or held.all():
        raise ConfigError(f"--calibration.mode auto holds out every {k}-th calibration window, but there are only "
                          f"{len(windows)}: raise --data.num_samples")
    fit_w = TokenWindows(windows.input_ids[~held], windows.attention_mask[~held])
    judge_w = TokenWindows(windows.input_ids[held], windows.attention_mask[held])
    fits = solver.fits

    def fitted(gran: str, mode: str, data: TokenWindows, measure_on=None):
        sub = type(module)(module.model, module.removed, replace(cfg, solver=base, mode=mode, granularity=gran),
                           solvers=[base])
        sub.calibrate(trainer, data, measure_on, batch_size, check=False)
        return sub

    same = coinciding_fits(fits, module.spans)
    maps = {}
    for fit_name, gran, mode in fits:
        if fit_name in same:
            log.info("%s: %s is %s for these spans: fitted and judged once", name, fit_name, same[fit_name])
            continue
        sub = fitted(gran, mode, fit_w)
        maps[fit_name] = {sp.key: replace(sub.span_map(base, sp), source=fit_name) for sp in module.spans}
        log.info("%s: fitted %s (%s, %s) on %d windows", name, fit_name, gran, mode, len(fit_w))
    judge = FitJudge(module.model, module.removed, module.spans, maps, cfg.heldout_topk, name)
    judge.run(trainer, judge_w, batch_size)
    res = {**judge.results, "held_out_windows": len(judge_w), "fit_windows": len(fit_w)}
    if same:  # every fit keeps its line; ties go to the earlier fit, the one actually judged
        for key in ("kl", "top1"):
            res[key] = {f[0]: res[key][same.get(f[0], f[0])] for f in fits}
        res["same_as"] = same
    chosen = next(f for f in fits if f[0] == res["chosen"])
    log.info("%s: held-out KL %s: refitting %s on all %d windows", name,
             ", ".join(f"{n} {v:.4f}" for n, v in res["kl"].items()), chosen[0], len(windows))
    final = fitted(chosen[1], chosen[2], windows, heldout)
    module.adopt(name, {sp.key: replace(final.span_map(base, sp), source=chosen[0]) for sp in module.spans},
                 {sp.key: res for sp in module.spans}, fitted=final, choice=res)
    return res
