"""The research checks (``experiments/checks/``): each runs end to end on a tiny model and its output keeps its
invariants (rows, tables, JSON)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from experiments import variants

ROOT = Path(__file__).resolve().parents[2]


def test_replaceme_cosine_check_rows_and_report(tmp_path):
    """The cosine-vs-least-squares diagnosis: its cached rows are the hidden states ReplaceMe fits
    (``y − m`` is what the span adds to the residual stream), least squares beats the identity on the
    rows it was fitted on, and the report lands as JSON and markdown."""
    sys.path.insert(0, str(ROOT / "experiments" / "checks"))
    import torch

    import _common as C
    import replaceme_cosine_check as R

    model, _ = C.build_model("random:tiny", torch.device("cpu"))
    win = C.windows(model, None, 3, 32)
    m, y = R.branch_rows(model, win, 3, 5)
    with torch.no_grad():
        hs = model(input_ids=win.input_ids, attention_mask=win.attention_mask, output_hidden_states=True).hidden_states
    keep = win.attention_mask.bool()
    assert m.shape == y.shape == (int(keep.sum()), 64)
    torch.testing.assert_close(y - m, (hs[5] - hs[3])[keep].double(), rtol=1e-5, atol=1e-5)
    eye = R.scores(torch.eye(64, dtype=torch.float64), m, y)
    assert abs(eye["rel_error"] - float((y - m).square().sum() / y.square().sum())) < 1e-9
    from shift_lightning.maps.ridge import RidgeStats, ridge_solve

    st = RidgeStats(64)
    st.add_batch(m, y - m)
    ls = R.scores(ridge_solve(st, 1e-4, None, "affine", bias=False).W.T, m, y)
    assert ls["rel_error"] < eye["rel_error"] and ls["cosine"] > eye["cosine"]
    R.main(["--model", "random:tiny", "--blocks", "3,4", "--calib_samples", "4", "--heldout_samples", "2", "--seq_len",
            "32", "--epochs", "1", "--out", str(tmp_path / "rc")])
    doc = json.loads((tmp_path / "rc.json").read_text())
    assert [r["fit"] for r in doc["rows"]] == ["identity (pruned)", "ls", "cosine, 1 epochs"]
    assert doc["rows"][2]["steps"] == 1 and "| 3–4 | ls |" in (tmp_path / "rc.md").read_text()


def test_richer_maps_check_rows_and_its_x_m_fit_is_the_lra_replaceme_solver(tmp_path):
    """The richer-features diagnosis: its ``x, m`` ridge is exactly the ``lra_replaceme`` solver's fitted map
    (same statistics, same per-group damping), richer feature sets fit the calibration rows at least as well
    (nested), and the report lands as JSON and markdown."""
    sys.path.insert(0, str(ROOT / "experiments" / "checks"))
    import lightning as L
    import torch

    import _common as C
    import richer_maps_check as R
    from shift_lightning.calibration import CalibrationConfig, CalibrationModule
    from shift_lightning.maps.solvers.joint import span_delta_map
    from shift_lightning.maps.ridge import ridge_solve

    model, _ = C.build_model("random:tiny", torch.device("cpu"), dtype=torch.float64)
    win = C.windows(model, None, 4, 32)
    d, d_ff = model.config.hidden_size, model.config.intermediate_size
    st = R.collect(model, win, 3, 5, "xm")
    sol = ridge_solve(st, 1e-4, groups=R.group_sizes("xm", d, d_ff))
    mod = CalibrationModule(model, [3, 4], CalibrationConfig(heldout=False), solvers=["lra_replaceme"])
    mod.calibrate(L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, inference_mode=False), win, batch_size=4)
    span = mod.spans[0]
    fitted = mod.solution(span, "lra_replaceme")
    Wj, b = span_delta_map(torch.eye(d, dtype=torch.float64) + fitted.W, fitted.b, fitted.T)
    torch.testing.assert_close(Wj, sol.W, rtol=1e-7, atol=1e-9)
    torch.testing.assert_close(b, sol.b, rtol=1e-7, atol=1e-9)
    in_sample = {g: st_.relative_error(s_.W, s_.b) for g in ("x", "xn", "xna")
                 for st_ in [R.collect(model, win, 3, 5, g)]
                 for s_ in [ridge_solve(st_, 1e-6, groups=R.group_sizes(g, d, d_ff))]}
    assert in_sample["xna"] <= in_sample["xn"] + 1e-6 <= in_sample["x"] + 2e-6
    R.main(["--model", "random:tiny", "--blocks", "3,4", "--samples", "8", "--seq_len", "32", "--out", str(tmp_path / "rm")])
    doc = json.loads((tmp_path / "rm.json").read_text())
    assert [r["map"] for r in doc["rows"]][:6] == ["pruned (no map)", *R.FEATURES]
    assert [r["params"] for r in doc["rows"]][1:3] == [d * d + d, 2 * d * d + d]
    assert doc["text"] == "random tokens" and "| x, m |" in (tmp_path / "rm.md").read_text()
    assert [r["map"] for r in doc["rows"]][-4:] == [f"{f}, then a least-squares map at the final norm's {w}"
                                                    for f in ("x", "x, m") for w in ("input", "output")]
    # the end anchors act where they say: h + h W + b on the final norm's input or output
    W, b = 0.01 * torch.randn(d, d, dtype=torch.float64), torch.randn(d, dtype=torch.float64)
    plain = R.end_states(model, win)
    for where in ("pre", "post"):
        h = R.end_anchor(model, where, W, b)
        try:
            moved = R.end_states(model, win)
        finally:
            h.remove()
        if where == "pre":
            torch.testing.assert_close(moved["pre"], plain["pre"] + plain["pre"] @ W + b)
        else:
            torch.testing.assert_close(moved["post"], plain["post"] + plain["post"] @ W + b)


def test_low_rank_check_rows_from_one_pass_and_full_rank_equals_the_solvers(tmp_path):
    """The low-rank comparison: one row per (rank, solver), adapter parameters 2dr + d, the joint map keeps
    its (folded) branch map at every rank, and its full-rank rows are the solvers' own full-rank fits."""
    sys.path.insert(0, str(ROOT / "experiments" / "checks"))
    import low_rank_check as B

    B.main(["--model", "random:tiny", "--layers", "3,4", "--ranks", "2,4", "--samples", "8", "--seq_len", "32",
            "--out", str(tmp_path / "lr")])
    doc = json.loads((tmp_path / "lr.json").read_text())
    rows = {(r["rank"], r["solver"]): r for r in doc["rows"]}
    assert set(rows) == {(r, s) for r in (2, 4, None) for s in B.SOLVERS}
    import _common as C
    import torch

    d = C.build_model("random:tiny", torch.device("cpu"))[0].config.hidden_size
    for r in (2, 4):
        assert rows[(r, "lra_span")]["adapter_params"] == rows[(r, "lra_replaceme")]["adapter_params"] == 2 * d * r + d
    assert rows[(None, "lra_replaceme")]["adapter_params"] == d * d + d
    assert all(rows[(r, "lra_replaceme")]["branch_maps"] == 1 and rows[(r, "lra_span")]["branch_maps"] == 0
               for r in (2, 4, None))
    # full rank: what a plain calibration with the solvers gives on the same windows
    import copy

    import lightning as L
    from anchored_check import closeness

    from shift_lightning.calibration import CalibrationConfig, CalibrationModule
    from shift_lightning.data import TokenWindows
    from shift_lightning.closeness import window_references
    from shift_lightning.maps.surgery import apply_maps, remove_blocks

    model = C.build_model("random:tiny", torch.device("cpu"))[0]
    win = C.windows(model, None, 8, 32)
    held = torch.arange(len(win)) % 4 == 3
    fit, judge = (TokenWindows(win.input_ids[k], win.attention_mask[k]) for k in (~held, held))
    refs = window_references(model, judge.input_ids, judge.attention_mask)
    mod = CalibrationModule(model, [3, 4], CalibrationConfig(heldout=False), solvers=variants.knobs(B.SOLVERS))
    mod.calibrate(L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, inference_mode=False), fit, batch_size=4)
    for name in B.SOLVERS:
        m = copy.deepcopy(model)
        remove_blocks(m, [3, 4])
        apply_maps(m, mod.fitted_maps(name), model.config.num_hidden_layers, [3, 4])
        assert closeness(m, judge, refs)[0] == pytest.approx(rows[(None, name)]["kl"], rel=1e-5)
    assert "| full |" in (tmp_path / "lr.md").read_text()


def test_refit_check_rows_and_table(tmp_path):
    """The kept-block re-fit check (the algorithm's own tests: ``tests/test_keptfit.py``): the joint map alone
    (k = 0) and each re-fit land as rows, judged on held-out windows, and the table renders."""
    sys.path.insert(0, str(ROOT / "experiments" / "checks"))
    import refit_check as R

    R.main(["--model", "random:tiny", "--criteria", "given", "--layers", "3,4", "--samples", "8", "--seq_len", "32",
            "--ks", "1,2", "--dampings", "1e-2", "--out", str(tmp_path / "rf")])
    doc = json.loads((tmp_path / "rf.json").read_text())
    assert [(r["k"], r["refitted"]) for r in doc["rows"]] == [(0, []), (1, [5]), (2, [5, 6])]
    assert all(r["kl"] > 0 for r in doc["rows"]) and doc["fit_windows"] == 6 and doc["judge_windows"] == 2
    assert "| given | 1 | 0.01 | [5] |" in (tmp_path / "rf.md").read_text()
    R.main(["--model", "random:tiny", "--criteria", "given", "--layers", "3,4", "--samples", "8", "--seq_len", "32",
            "--ks", "2", "--dampings", "1e-2", "--guarded", "--out", str(tmp_path / "rf")])  # the main job's check
    doc = json.loads((tmp_path / "rf.json").read_text())
    g = doc["rows"][-1]
    assert len(doc["rows"]) == 4 and g["guarded"] and g["tried"] == [5, 6] and set(g["refitted"]) <= {5, 6}
    assert doc["commands"][-1].endswith("--guarded") and "| given | 2 (guarded) | 0.01 |" in (tmp_path / "rf.md").read_text()


def test_kd_plateau_epochs_and_slope(tmp_path):
    """The KD plateau reader: the first epoch's losses (fresh batches) in quarters, the second epoch's
    (seen batches), the val/kl slope per doubling of steps from TensorBoard events; runs that are not KD skipped."""
    sys.path.insert(0, str(ROOT / "experiments" / "checks"))
    import kd_plateau as K
    from torch.utils.tensorboard import SummaryWriter

    s = K.epoch_summary([4.0] * 2 + [3.0] * 2 + [2.0] * 2 + [1.0] * 2 + [0.5] * 3, steps_per_epoch=8)
    assert s["fresh_quarters"] == [4.0, 3.0, 2.0, 1.0] and s["seen_mean"] == 0.5
    assert s["fresh_last_quarter_minus_second"] == -2.0 and s["seen_minus_fresh_last_quarter"] == -0.5
    assert K.epoch_summary([1.0, 2.0], 8)["seen_mean"] is None  # a run shorter than an epoch: all fresh
    assert K.per_doubling([(0, 9.0), (2, 1.0), (4, 0.9), (8, 0.8), (16, 0.0)], last_step=8) == pytest.approx(-0.1)

    folder = tmp_path / "rec"
    run = {"criterion": "angular", "run": "lra_lora_kd", "repair": "lra", "kl": {"tasks": 0.5},
           "recovery": {"loss": "kd", "lr": 5e-4, "lora_r": 8}, "loss_history": [0.4] * 4 + [0.3] * 4 + [0.2] * 4,
           "config": {"batch_size": 2, "train_samples": 16, "train_source": "mixed"}}
    (folder / "angular").mkdir(parents=True)
    (folder / "angular" / "lra_lora_kd.json").write_text(json.dumps(run))
    (folder / "angular" / "lra_lora.json").write_text(json.dumps({**run, "run": "lra_lora", "recovery": {"loss": "nll"}}))
    w = SummaryWriter(str(folder / "tb" / "angular" / "lra_lora_kd"))
    for step, v in [(0, 1.0), (2, 0.5), (4, 0.4), (8, 0.3), (12, 0.1)]:
        w.add_scalar("val/kl", v, step)
    w.close()
    K.main(["--folders", json.dumps([str(folder), str(tmp_path / "missing")]), "--out", str(tmp_path / "kd")])
    rows = json.loads((tmp_path / "kd.json").read_text())["rows"]
    assert [r["run"] for r in rows] == ["lra_lora_kd"]
    r = rows[0]
    assert r["steps_per_epoch"] == 8 and r["fresh_quarters"] == pytest.approx([0.4, 0.4, 0.3, 0.3])
    assert r["seen_mean"] == pytest.approx(0.2) and r["val_kl_per_doubling_epoch1"] == pytest.approx(-0.1)
    assert "1.000 → 0.500 → 0.400 → 0.300 |" in (tmp_path / "kd.md").read_text()
