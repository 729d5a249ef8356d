"""Robust against closeness: the curve fit, the rank correlation, the rows read, the committed tables."""

import json
from pathlib import Path

import numpy as np
import pytest

from experiments.summary import Bootstrap
from experiments.robust_vs_kl import (CURVES, RobustVsKLConfig, fit_kappa, grid_rows, render, spearman)

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("curve", sorted(CURVES))
def test_the_fit_recovers_kappa_and_the_kl_at_the_goal(curve):
    f, at = CURVES[curve]
    kl = np.array([0.1, 0.3, 0.5, 0.9, 1.5, 3.0, 12.0])
    exact = f(kl, 1.3)
    assert fit_kappa(kl, exact, curve)[0] == pytest.approx(1.3, rel=1e-3)
    # one fit per row of a (B, n) array, e.g. the bootstrap's resamples
    batch = np.stack([f(kl, k) for k in (0.4, 1.3, 7.0)])
    np.testing.assert_allclose(fit_kappa(kl, batch, curve), [0.4, 1.3, 7.0], rtol=1e-3)
    assert f(at(1.3, 0.8), 1.3) == pytest.approx(0.8)
    # least squares, not interpolation: noise moves κ, and a lower curve gives a smaller κ
    rng = np.random.default_rng(0)
    noisy = exact + rng.normal(0, 0.05, size=(200, len(kl)))
    assert np.median(fit_kappa(kl, noisy, curve)) == pytest.approx(1.3, rel=0.1)
    assert fit_kappa(kl, exact - 0.1, curve)[0] < 1.3


def test_spearman_on_ranks_with_ties():
    x = np.array([0.1, 0.5, 0.2, 3.0, 0.5])
    assert spearman(x, -x ** 3) == pytest.approx(-1.0)
    assert spearman(x, np.exp(x)) == pytest.approx(1.0)
    # ties share their mean rank: Pearson's r of the ranks [1, 3.5, 2, 5, 3.5] and [1, 2, 3, 4, 5]
    rx, ry = np.array([1, 3.5, 2, 5, 3.5]), np.arange(1, 6.0)
    assert spearman(x, ry) == pytest.approx(np.corrcoef(rx, ry)[0, 1])


def _run(crit, variant, layers, acc, kl):
    """A paper-grid run file: three tasks of 40 docs, per-doc outcomes ``acc[t]``, tasks-prompt KL ``kl``."""
    tasks = {t: {"metric": "acc", "value": float(np.mean(a)), "chance": 0.25,
                 "per_doc": {"doc_ids": list(range(len(a))), "acc": list(map(int, a))}} for t, a in acc.items()}
    run = {"criterion": crit, "variant": variant, "pruned_layers": layers, "tasks": tasks}
    if kl is not None:
        run["closeness"] = {"tasks": {"kl": kl, "kl_ci": [kl * 0.9, kl * 1.1]}}
    return run


def test_rows_are_read_from_both_grids_once_each(tmp_path):
    rng = np.random.default_rng(1)
    orig = {t: (rng.random(40) < 0.9).astype(int) for t in ("a", "b", "c")}
    worse = {t: np.where(rng.random(40) < 0.3, 0, v) for t, v in orig.items()}
    runs = {("wiki", "x", "pruned"): _run("x", "pruned", [3], worse, 2.0),
            ("wiki", "x", "lra"): _run("x", "lra", [3], orig, 0.2),
            ("wiki", "y", "lra"): _run("y", "lra", [3], orig, 0.2),  # the same blocks and run: a copy
            ("mixed", "x", "lra"): _run("x", "lra", [3], worse, 0.5),
            ("mixed", "x", "replaceme"): _run("x", "replaceme", [3], worse, None)}  # no closeness: left out
    for (g, c, v), r in runs.items():
        (tmp_path / g / "m" / c).mkdir(parents=True, exist_ok=True)
        (tmp_path / g / "m" / c / f"{v}.json").write_text(json.dumps(r))
    (tmp_path / "wiki" / "m" / "original.json").write_text(json.dumps(_run(None, "original", [], orig, None)))
    # a check folder (another depth): its copy of the original is not read; its rows are not fitted nor merged
    (tmp_path / "chk" / "m" / "x").mkdir(parents=True)
    (tmp_path / "chk" / "m" / "original.json").write_text(json.dumps(_run(None, "original", [], worse, None)))
    (tmp_path / "chk" / "m" / "x" / "lra.json").write_text(json.dumps(_run("x", "lra", [3], orig, 0.2)))
    # the recovery table's layout (<criterion>/<run>.json, the model named inside; another model's runs skipped)
    (tmp_path / "ft" / "x").mkdir(parents=True)
    for m, run in (("m", "lra_lora_kd"), ("other", "lora")):
        doc = {**_run("x", None, [3], orig, 0.1), "model": m, "run": run}
        (tmp_path / "ft" / "x" / f"{run}.json").write_text(json.dumps(doc))
    cfg = RobustVsKLConfig(models=["m"], grids={"wiki": str(tmp_path / "wiki"), "mixed": str(tmp_path / "mixed")},
                           checks={"10 %": str(tmp_path / "chk"), "gone": str(tmp_path / "nope"),
                                   "ft": str(tmp_path / "ft")}, n_boot=50)
    rows, boot = grid_rows(cfg, "m")
    assert sorted(r["row"] for r in rows) == ["10 %/x/lra", "ft/x/lra_lora_kd", "mixed/x/lra", "wiki/x/lra",
                                              "wiki/x/pruned"]
    chk = next(r for r in rows if r["row"] == "10 %/x/lra")
    assert not chk["fitted"] and chk["robust"] == pytest.approx(1.0) and chk["robust_ci"][1] >= 1.0
    assert sum(r["fitted"] for r in rows) == 3 and not next(r for r in rows if r["grid"] == "ft")["fitted"]
    by = {r["row"]: r for r in rows}
    assert by["wiki/x/lra"]["same_as"] == ["wiki/y/lra"] and by["wiki/x/lra"]["robust"] == pytest.approx(1.0)
    assert by["wiki/x/pruned"]["family"] == "pruned" and by["mixed/x/lra"]["family"] == "lra"
    # the Robust point and its resamples are the grids' own (Bootstrap.summary), paired across rows
    ref = Bootstrap({"o": _run(None, "original", [], orig, None), "p": runs[("wiki", "x", "pruned")]}, "o", n_boot=50)
    assert by["wiki/x/pruned"]["robust"] == pytest.approx(ref.summary("p")["robust"])
    assert np.quantile(by["wiki/x/pruned"]["_samples"], 0.975) == pytest.approx(ref.summary("p")["robust_ci"][1])
    # no original: nothing to read
    assert grid_rows(RobustVsKLConfig(models=["m"], grids={"mixed": str(tmp_path / "mixed")}), "m") is None


def _close(a, b) -> bool:
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(map(_close, a, b))
    if isinstance(a, float) and isinstance(b, (int, float)):
        return a == pytest.approx(b, rel=1e-9, abs=1e-12)
    return a == b


def test_the_committed_analysis_is_the_committed_grids(tmp_path, monkeypatch):
    """results/robust_vs_kl.* is re-rendered whenever a grid row lands (the README quotes it)."""
    monkeypatch.chdir(ROOT)
    out = render(RobustVsKLConfig(out=str(tmp_path / "r")))
    committed = json.loads((ROOT / "results" / "robust_vs_kl.json").read_text())
    # numbers to 1e-9 (the fits go through a matrix product, whose rounding may follow the thread count)
    assert _close(json.loads(out.with_suffix(".json").read_text()), committed)
    assert out.with_suffix(".md").read_text() == (ROOT / "results" / "robust_vs_kl.md").read_text()
