"""``--calibration.mode auto`` (solvers ``lra_auto`` and ``lra_replaceme_auto``): each way of fitting the LRA
(the joint map) judged on held-out calibration windows, the closest refitted on all of them."""

from __future__ import annotations

import copy
from dataclasses import replace

import pytest
import torch
from torch.testing import assert_close

from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.maps.fitted import assemble
from shift_lightning.maps.solvers.joint import LRAReplaceMe
from shift_lightning.maps.solvers.ridge import LRA
from shift_lightning.data import TokenWindows
from shift_lightning.errors import ConfigError
from shift_lightning.closeness import kl_top1, topk_reference
from shift_lightning.models import build_tiny_model
from shift_lightning.maps.surgery import apply_maps, remove_blocks

from test_peers import _trainer, _windows

REMOVED = [1, 3, 4]  # two spans: the fits differ (a one-block span and a two-block one after it)


@pytest.fixture(scope="module")
def fitted():
    model, tok = build_tiny_model("llama", num_hidden_layers=6, dtype=torch.float64)
    win = _windows(tok, n=8)
    cfg = CalibrationConfig(solver="lra", mode="auto", damping=1e-4, heldout_topk=16)
    mod = CalibrationModule(copy.deepcopy(model), REMOVED, cfg)
    mod.calibrate(_trainer(), win, batch_size=4)
    return model, win, cfg, mod


def _fit(model, win, cfg, gran, mode):
    m = CalibrationModule(copy.deepcopy(model), REMOVED, replace(cfg, solver="lra", mode=mode, granularity=gran))
    m.calibrate(_trainer(), win, batch_size=4)
    return m


def test_auto_judges_every_fit_as_the_pruned_model_runs_and_keeps_the_closest(fitted):
    """Each fit's held-out KL is the KL of the pruned model built by surgery with that fit (made on the
    other windows) in place; the chosen one has the lowest KL; the fits genuinely differ."""
    model, win, cfg, mod = fitted
    res = mod.fit_choice
    assert list(res["kl"]) == [f[0] for f in LRA.fits]
    assert res["chosen"] == min(res["kl"], key=lambda n: (res["kl"][n], list(res["kl"]).index(n)))
    held = torch.arange(len(win)) % cfg.heldout_every == cfg.heldout_every - 1
    fit_w = TokenWindows(win.input_ids[~held], win.attention_mask[~held])
    ids, mask = win.input_ids[held], win.attention_mask[held]
    assert res["held_out_windows"] == int(held.sum()) and res["fit_windows"] == len(fit_w)
    with torch.no_grad():
        ref = topk_reference(model(input_ids=ids, attention_mask=mask).logits[mask.bool()], cfg.heldout_topk)
    for name, gran, mode in LRA.fits:
        m = _fit(model, fit_w, cfg, gran, mode)
        pruned = copy.deepcopy(model)
        remove_blocks(pruned, REMOVED)
        apply_maps(pruned, assemble(name, [m.span_map("lra", sp) for sp in m.spans], 6, REMOVED), 6, REMOVED)
        with torch.no_grad():
            kl = kl_top1(pruned(input_ids=ids, attention_mask=mask).logits[mask.bool()], ref)[0].mean().item()
        assert res["kl"][name] == pytest.approx(kl, rel=1e-6, abs=1e-12), name
    assert len({round(v, 12) for v in res["kl"].values()}) == len(LRA.fits)


def test_auto_maps_are_the_chosen_fit_refitted_on_all_windows(fitted):
    model, win, cfg, mod = fitted
    name, gran, mode = next(f for f in LRA.fits if f[0] == mod.fit_choice["chosen"])
    want = _fit(model, win, cfg, gran, mode).fitted_maps("lra").adapters
    got = mod.fitted_maps().adapters
    assert set(got) == set(want) and len(got) == 2
    x = torch.randn(2, 3, model.config.hidden_size, dtype=torch.float64)
    for at in got:
        assert_close(got[at](x), want[at](x), rtol=1e-8, atol=1e-8)
    assert {r["maps"]["lra"] for r in mod.span_reports()} == {name}
    assert all(r["guard"]["chosen"] == name for r in mod.span_reports())
    assert all("calib_rel_error" in r for r in mod.site_reports())  # the refit's own errors


def test_auto_refuses_what_it_cannot_do(fitted):
    model, win, _, _ = fitted
    for solver in ("nobias", "replaceme", "guarded"):  # the message names the solvers with an auto mode
        with pytest.raises(ConfigError, match="mode auto.*lra / lra_replaceme solvers.*--calibration.solver "
                                              "lra_replaceme .*or lra"):
            CalibrationModule(copy.deepcopy(model), [2], CalibrationConfig(solver=solver, mode="auto"))
    mod = CalibrationModule(copy.deepcopy(model), [2], CalibrationConfig(solver="lra", mode="auto"))
    with pytest.raises(ConfigError, match="every 4-th calibration window.*only 3.*--data.num_samples"):
        mod.calibrate(_trainer(), TokenWindows(win.input_ids[:3], win.attention_mask[:3]), batch_size=4)


@pytest.mark.parametrize("removed, same", [
    ([2, 3], {"lra_sequential": "lra_span", "lra_anchored": "lra_span"}),  # one span: nothing before it
    ([1, 3], {"lra_span": "lra"}),  # one-block spans: the span LRA is the per-block LRA
    ([2], {"lra_span": "lra", "lra_sequential": "lra", "lra_anchored": "lra"}),
    (REMOVED, {})])
def test_fits_that_coincide_for_the_removed_blocks_are_fitted_and_judged_once(removed, same):
    """The fits :func:`coinciding_fits` skips are the same maps when fitted (so the choice is unchanged),
    and ``mode: auto`` records which fit stood for which."""
    from shift_lightning.calibration.auto import coinciding_fits
    from shift_lightning.maps.sites import span_sites

    assert coinciding_fits(LRA.fits, span_sites(removed)) == same
    if not same:
        return
    model, tok = build_tiny_model("llama", num_hidden_layers=6, dtype=torch.float64)
    win = _windows(tok, n=8)
    cfg = CalibrationConfig(solver="lra", mode="auto", damping=1e-4, heldout_topk=16)
    x = torch.randn(2, 3, model.config.hidden_size, dtype=torch.float64)
    modes = {f[0]: f[1:] for f in LRA.fits}
    for name, twin in same.items():
        maps = []
        for n in (name, twin):
            m = CalibrationModule(copy.deepcopy(model), removed, replace(cfg, solver="lra", mode=modes[n][1],
                                                                          granularity=modes[n][0]))
            m.calibrate(_trainer(), win, batch_size=4)
            maps.append(m.fitted_maps("lra").adapters)
        assert set(maps[0]) == set(maps[1])
        for at in maps[0]:
            assert_close(maps[0][at](x), maps[1][at](x), rtol=1e-9, atol=1e-9)
    mod = CalibrationModule(copy.deepcopy(model), removed, cfg)
    mod.calibrate(_trainer(), win, batch_size=4)
    res = mod.fit_choice
    assert res["same_as"] == same and list(res["kl"]) == [f[0] for f in LRA.fits]
    assert all(res["kl"][n] == res["kl"][t] for n, t in same.items()) and res["chosen"] not in same


# ---------------------------------------------------------------- the joint map (lra_replaceme_auto)
def _fit_joint(model, win, cfg, mode, removed=REMOVED):
    m = CalibrationModule(copy.deepcopy(model), removed, replace(cfg, solver="lra_replaceme", mode=mode,
                                                                 granularity="span"))
    m.calibrate(_trainer(), win, batch_size=4)
    return m


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def fitted_joint(request):
    model, tok = build_tiny_model(request.param, num_hidden_layers=6, dtype=torch.float64)
    win = _windows(tok, n=8)
    cfg = CalibrationConfig(solver="lra_replaceme", mode="auto", damping=1e-4, heldout_topk=16)
    mod = CalibrationModule(copy.deepcopy(model), REMOVED, cfg)
    mod.calibrate(_trainer(), win, batch_size=4)
    return model, win, cfg, mod


def test_joint_auto_judges_each_walk_of_the_joint_map_with_both_halves_in_place(fitted_joint):
    """Each fit's held-out KL is that of the pruned model built by surgery with the joint map fitted that way
    (on the other windows): adapter AND ReplaceMe's branch map in place. A judge that dropped the branch map
    would score another model; the three fits genuinely differ."""
    model, win, cfg, mod = fitted_joint
    res = mod.fit_choice
    assert list(res["kl"]) == [f[0] for f in LRAReplaceMe.fits] and "same_as" not in res
    assert res["chosen"] == min(res["kl"], key=lambda n: (res["kl"][n], list(res["kl"]).index(n)))
    held = torch.arange(len(win)) % cfg.heldout_every == cfg.heldout_every - 1
    fit_w = TokenWindows(win.input_ids[~held], win.attention_mask[~held])
    ids, mask = win.input_ids[held], win.attention_mask[held]
    with torch.no_grad():
        ref = topk_reference(model(input_ids=ids, attention_mask=mask).logits[mask.bool()], cfg.heldout_topk)
    for name, _, mode in LRAReplaceMe.fits:
        m = _fit_joint(model, fit_w, cfg, mode)
        corr = m.fitted_maps("lra_replaceme")
        assert len(corr.branch_maps) == 2 and len(corr.adapters) == 2  # both spans have a block before them
        kls = []
        for c in (corr, replace(corr, branch_maps={})):
            pruned = copy.deepcopy(model)
            remove_blocks(pruned, REMOVED)
            apply_maps(pruned, c, 6, REMOVED)
            with torch.no_grad():
                logits = pruned(input_ids=ids, attention_mask=mask).logits[mask.bool()]
            kls.append(kl_top1(logits, ref)[0].mean().item())
        assert res["kl"][name] == pytest.approx(kls[0], rel=1e-6, abs=1e-12), name
        assert abs(kls[1] - kls[0]) > 1e-6 * kls[0], name  # the branch map matters to the score
    assert len({round(v, 12) for v in res["kl"].values()}) == len(LRAReplaceMe.fits)


def test_joint_auto_maps_are_the_chosen_walk_refitted_on_all_windows(fitted_joint):
    model, win, cfg, mod = fitted_joint
    name, _, mode = next(f for f in LRAReplaceMe.fits if f[0] == mod.fit_choice["chosen"])
    want = _fit_joint(model, win, cfg, mode).fitted_maps("lra_replaceme")
    got = mod.fitted_maps()
    assert got.solver == "lra_replaceme"
    assert set(got.adapters) == set(want.adapters) and set(got.branch_maps) == set(want.branch_maps) == {0, 2}
    x = torch.randn(2, 3, model.config.hidden_size, dtype=torch.float64)
    for at in got.adapters:
        assert_close(got.adapters[at](x), want.adapters[at](x), rtol=1e-8, atol=1e-8)
    for at in got.branch_maps:
        assert_close(got.branch_maps[at], want.branch_maps[at], rtol=1e-8, atol=1e-10)
    assert {r["maps"]["lra_replaceme"] for r in mod.span_reports()} == {name}
    assert all(r["guard"]["chosen"] == name for r in mod.span_reports())


@pytest.mark.parametrize("removed, same", [
    ([2, 3], {"lra_replaceme_sequential": "lra_replaceme", "lra_replaceme_anchored": "lra_replaceme"}),
    ([1, 3], {}),  # one-block spans: each walk still sees the spans before it
    ([0, 1, 3], {})])
def test_joint_walks_that_coincide_are_fitted_and_judged_once(removed, same):
    """With one span the three walks of the joint map are one map (checked by fitting both); a span at block 0
    (no branch before it: the span LRA alone) is still judged as the walk it belongs to."""
    from shift_lightning.calibration.auto import coinciding_fits
    from shift_lightning.maps.sites import span_sites

    assert coinciding_fits(LRAReplaceMe.fits, span_sites(removed)) == same
    model, tok = build_tiny_model("llama", num_hidden_layers=6, dtype=torch.float64)
    win = _windows(tok, n=8)
    cfg = CalibrationConfig(solver="lra_replaceme", mode="auto", damping=1e-4, heldout_topk=16)
    modes = {f[0]: f[2] for f in LRAReplaceMe.fits}
    x = torch.randn(2, 3, model.config.hidden_size, dtype=torch.float64)
    for name, twin in same.items():
        a, b = (_fit_joint(model, win, cfg, modes[n], removed).fitted_maps("lra_replaceme") for n in (name, twin))
        assert set(a.adapters) == set(b.adapters) and set(a.branch_maps) == set(b.branch_maps)
        for at in a.adapters:
            assert_close(a.adapters[at](x), b.adapters[at](x), rtol=1e-9, atol=1e-9)
        for at in a.branch_maps:
            assert_close(a.branch_maps[at], b.branch_maps[at], rtol=1e-9, atol=1e-10)
    mod = CalibrationModule(copy.deepcopy(model), removed, cfg)
    mod.calibrate(_trainer(), win, batch_size=4)
    res = mod.fit_choice
    assert res.get("same_as", {}) == same and list(res["kl"]) == list(modes)
    assert all(res["kl"][n] == res["kl"][t] for n, t in same.items()) and res["chosen"] not in same
    if removed[0] == 0:
        assert any("starts at block 0" in n or "no block before" in n for n in mod.fitted_maps().notes)
