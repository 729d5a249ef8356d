"""The kept-block re-fit (``--calibration.refit.kept``, :mod:`shift_lightning.maps.keptfit`): its targets are the
original's, it brings the re-fitted block's output closer to the original's, and the main job saves and reloads
what it fitted."""

from __future__ import annotations

import copy
import json

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from shift_lightning import load_pretrained
from shift_lightning.calibration import CalibrationConfig
from shift_lightning.criteria import PruneConfig
from shift_lightning.data import TextDataConfig
from shift_lightning.errors import ConfigError
from shift_lightning.maps.keptfit import KeptFitError, Walk, refit_kept, refit_pairs
from shift_lightning.models import ModelConfig, build_tiny_model
from shift_lightning.recipes.calibrate import run_calibration
from shift_lightning.maps.surgery import apply_maps, remove_blocks

from test_calibration import CORPUS, HELDOUT
from test_peers import _trainer, _windows


def _corrected(model, layers, win):
    from shift_lightning.calibration import CalibrationModule
    from shift_lightning.models import decoder_layers

    m = copy.deepcopy(model)
    mod = CalibrationModule(m, layers, CalibrationConfig(damping=1e-4), solvers=["lra_replaceme"])
    mod.calibrate(_trainer(), win, batch_size=4)
    n = len(decoder_layers(m))
    remove_blocks(m, layers)
    apply_maps(m, mod.fitted_maps("lra_replaceme"), n, layers)
    return m


def test_refit_pairs_are_the_first_kept_blocks_after_each_span():
    assert refit_pairs([2, 3], 6, 1) == [(2, 4)]
    assert refit_pairs([1, 3], 6, 2) == [(1, 2), (2, 4), (3, 5)]  # a block after two spans is re-fitted once
    assert refit_pairs([4, 5], 6, 1) == []  # the span ends the model: no kept block after it
    assert refit_pairs([1, 3], 6, "all") == [(1, 2), (2, 4), (3, 5)] == refit_pairs([1, 3], 6, 30)
    assert refit_pairs([1, 2], 8, "all") == [(1, 3), (2, 4), (3, 5), (4, 6), (5, 7)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_refit_changes_nothing_without_drift_and_brings_the_block_closer(arch):
    """On an unpruned copy (inputs equal the original's, no drift) no weight moves — Gemma3's post-norm targets
    (``post_norm="direction"``, the measured-and-refused variant) included; after removing blocks 2–3 and the joint
    map, the re-fitted block's output (pruned block 2 = original block 4) is closer to the original's there. A drift
    term with the wrong sign, or none, fails this."""
    model, tok = build_tiny_model(arch, num_hidden_layers=6, dtype=torch.float64)
    win = _windows(tok, n=8)
    same = copy.deepcopy(model)
    report = refit_kept(same, model, win, [(2, 2), (4, 4)], 1e-2, post_norm="direction")
    tol = dict(rtol=1e-8, atol=1e-10) if arch == "llama" else dict(rtol=1e-5, atol=1e-6)  # Gemma3's norms: float32
    for (name, p), q in zip(model.named_parameters(), same.parameters()):
        assert_close(q, p, **tol, msg=name)
    assert [r["block"] for r in report] == [2, 4] and len(report[0]["relative_change"]) == 7

    def gap(m):
        wp, wo = Walk(m, win, 2), Walk(model, win, 2)
        wp.advance_to(3), wo.advance_to(5)
        return float(sum((a - b)[k].pow(2).sum() for a, b, k in zip(wp.h, wo.h, wp.masks)))

    pruned = _corrected(model, [2, 3], win)
    before = gap(pruned)
    report = refit_kept(pruned, model, win, [(2, 4)], 1e-2, post_norm="direction")
    assert gap(pruned) < 0.8 * before
    assert all(0 < v < 10 for v in report[0]["relative_change"].values())


def test_refit_damping_pulls_towards_the_layers_own_weights():
    """λ regularises towards W: a large damping moves the weights less than a small one (and never infinitely)."""
    model, tok = build_tiny_model("llama", num_hidden_layers=6, dtype=torch.float64)
    win = _windows(tok, n=8)
    pruned = _corrected(model, [2, 3], win)
    moves = [sum(refit_kept(copy.deepcopy(pruned), model, win, [(2, 4)], d)[0]["relative_change"].values())
             for d in (1e-3, 1.0, 1e3)]
    assert moves[0] > moves[1] > moves[2] > 0 and moves[2] < 0.05 * moves[0]
    with pytest.raises(KeptFitError, match="positive and finite"):
        refit_kept(copy.deepcopy(pruned), model, win, [(2, 4)], 0.0)


def test_refit_refuses_a_block_it_cannot_walk():
    model, tok = build_tiny_model("llama", num_hidden_layers=6, dtype=torch.float64)
    win = _windows(tok, n=4)
    pruned = _corrected(model, [2, 3], win)
    pruned.model.layers[2].self_attn.o_proj = nn.Identity()  # not a separate linear layer any more
    with pytest.raises(KeptFitError, match=r"block 4: .*self_attn\.o_proj.*--calibration.refit.kept"):
        refit_kept(pruned, model, win, [(2, 4)], 0.1)


def test_gemma3_blocks_are_refused_by_default_and_early_in_the_main_job(tmp_path):
    """Gemma3 adds its branches through norms: measured to move the model away, refused — by the library before
    any walk, and by the main job before any pass (no output written)."""
    model, tok = build_tiny_model("gemma3", num_hidden_layers=6, dtype=torch.float64)
    with pytest.raises(KeptFitError, match="through norms.*drop --calibration.refit.kept"):
        refit_kept(copy.deepcopy(model), model, _windows(tok, n=4), [(2, 4)], 0.1)
    with pytest.raises(KeptFitError, match="gemma3_text blocks: .*through norms"):
        run_calibration(model=ModelConfig(tiny={"family": "gemma3"}), data=TextDataConfig(source=CORPUS),
                        calibration=CalibrationConfig(refit={"kept": 1}), output_dir=str(tmp_path / "o"))
    assert not (tmp_path / "o" / "calibration_report.json").exists()


@pytest.mark.parametrize("bad,match", [({"kept": -1}, "--calibration.refit.kept must be a whole number"),
                                       ({"kept": True}, "--calibration.refit.kept must be a whole number"),
                                       ({"kept": "every"}, "refit.kept must be .* or 'all', got 'every'"),
                                       ({"damping": 0.0}, "--calibration.refit.damping must be a finite number > 0")])
def test_bad_refit_settings_fail_early(bad, match):
    with pytest.raises(ConfigError, match=match):
        run_calibration(model=ModelConfig(tiny={"family": "llama"}), data=TextDataConfig(source=CORPUS),
                        calibration=CalibrationConfig(refit=bad), output_dir=None)


def test_adapter_only_folder_stores_the_refitted_blocks(tmp_path, monkeypatch):
    """train.py's calibration stage saves adapter-only folders: the re-fitted blocks' layers go with the adapters
    (``kept.<position>.<layer>.weight``, positions in ``refit_blocks``) and the folder rebuilds from the base model
    to the same logits — block 2 carries both a folded ReplaceMe map (before span [3]) and a re-fit (after span
    [1]), so the re-fitted weights must be put in place after the map is folded. A record that does not match the
    stored weights is refused."""
    import shift_lightning.maps.keptfit as K
    from shift_lightning.maps.surgery import SurgeryError

    scores = iter([1.0, 0.5, 0.4])  # both re-fits kept
    monkeypatch.setattr(K, "heldout_kl", lambda *a, **k: next(scores))
    out = tmp_path / "a"
    res = run_calibration(model=ModelConfig(tiny={"family": "llama"}),
                          data=TextDataConfig(source=CORPUS, num_samples=8, seq_len=48),
                          heldout=TextDataConfig(num_samples=0), prune=PruneConfig(layers=[1, 3]),
                          calibration=CalibrationConfig(refit={"kept": 1}), output_dir=str(out), save_model="adapters",
                          trainer={"accelerator": "cpu", "enable_progress_bar": False})
    spec = json.loads((out / "shift_config.json").read_text())
    assert spec["weights"] == "adapters" and spec["refit_blocks"] == [1, 2] and res.report.refit["kept"] == [2, 4]
    assert spec["branch_maps"] == [{"block": 0, "after": "down_proj"}, {"block": 1, "after": "down_proj"}]
    m, tok = load_pretrained(out)
    for i in (1, 2):  # the re-fitted blocks exactly (block 1 = original 2 also had a map folded in)
        for p, q in zip(m.model.layers[i].parameters(), res.model.model.layers[i].parameters()):
            assert torch.equal(p, q)
    ids = tok("Round trip", return_tensors="pt").input_ids
    # block 0's map is stored in float64 as fitted and folded again the same way: the same weights, the same logits
    assert torch.equal(m.model.layers[0].mlp.down_proj.weight, res.model.model.layers[0].mlp.down_proj.weight)
    assert torch.equal(m(ids).logits, res.model(ids).logits)
    from safetensors.torch import load_file, save_file

    w = load_file(str(out / "lra.safetensors"))
    w["kept.2.mlp.down_proj.weight"] = w["kept.2.mlp.down_proj.weight"][:, :-1].contiguous()
    save_file(w, str(out / "lra.safetensors"))
    with pytest.raises(SurgeryError, match=r"lra.safetensors: kept.2.mlp.down_proj.weight has shape \(32, 63\)"):
        load_pretrained(out)
    spec["refit_blocks"] = [1]
    (out / "shift_config.json").write_text(json.dumps(spec))
    with pytest.raises(SurgeryError, match=r"re-fitted weights of kept blocks \[1, 2\] but .* expects \[1\]"):
        load_pretrained(out)


def test_main_job_with_refit_saves_what_it_fitted(tmp_path):
    """``calibrate.py --calibration.refit.kept 1``: the report lists the held-out check and what it kept; a kept
    block differs from the same run without the re-fit, every other block does not; the saved folder reloads to the
    same logits, the card names the re-fitted blocks, and the evaluation label says whether one was kept."""
    from shift_lightning.evaluation.runner import EvalConfig

    kw = dict(model=ModelConfig(tiny={"family": "llama"}), data=TextDataConfig(source=CORPUS, num_samples=8, seq_len=48),
              heldout=TextDataConfig(source=HELDOUT, num_samples=4, seq_len=48), prune=PruneConfig(layers=[2, 3]),
              trainer={"accelerator": "cpu", "enable_progress_bar": False},
              evaluate=EvalConfig(tasks="", ppl=HELDOUT, ppl_seq_len=48, ppl_max_windows=2, progress=False))
    plain = run_calibration(**kw, output_dir=None)
    out = tmp_path / "run"
    res = run_calibration(**kw, calibration=CalibrationConfig(refit={"kept": 1}), output_dir=str(out))
    rep = json.loads((out / "calibration_report.json").read_text())
    r = rep["refit"]
    assert list(r["heldout_kl"]) == ["none", "4"] and rep["calibration"]["refit"]["kept"] == 1
    kept = r["kept"] == [4]
    assert kept == (r["heldout_kl"]["4"] < r["heldout_kl"]["none"]) and (r["kept"] == [] or kept)
    a, b = plain.model.model.layers, res.model.model.layers
    for i in range(len(a)):
        same = all(torch.equal(p, q) for p, q in zip(a[i].parameters(), b[i].parameters()))
        assert same == (i != 2 or not kept), i  # pruned block 2 = original block 4, the first kept after the span
    assert "Kept blocks re-fitted after the maps" in (out / "calibration_report.md").read_text()
    assert ("| kept blocks re-fitted | `[4]` (original indices)" in (out / "README.md").read_text()) == kept
    assert list(rep["evaluation"]) == ["pruned+lra_replaceme" + ("+refit" if kept else "")]
    m, tok = load_pretrained(out)
    ids = tok("Round trip", return_tensors="pt").input_ids
    assert torch.equal(m(ids).logits, res.model(ids).logits)


def test_guard_keeps_a_refit_only_if_it_is_closer_on_held_out_windows(monkeypatch):
    """Two re-fitted blocks (spans [1] and [3] of 6): the judge's scores are scripted — block 2 closer (kept), block 4
    further (undone). Block 4's weights are then exactly the corrected model's, block 2's exactly a re-fit on all
    windows from its own weights; held-out scores are reported per block."""
    import shift_lightning.maps.keptfit as K

    model, tok = build_tiny_model("llama", num_hidden_layers=6, dtype=torch.float64)
    win = _windows(tok, n=8)
    pruned = _corrected(model, [1, 3], win)
    plain = copy.deepcopy(pruned)
    scores = iter([1.0, 0.5, 0.7])
    monkeypatch.setattr(K, "heldout_kl", lambda *a, **k: next(scores))
    res = K.guarded_refit(pruned, model, win, refit_pairs([1, 3], 6, 1), 0.1)
    assert res["heldout_kl"] == {"none": 1.0, "2": 0.5, "4": 0.7} and res["kept"] == [2]
    assert [b["tokens"] for b in res["blocks"]] == [int(win.attention_mask.sum())]  # every real token, once
    for p, q in zip(pruned.model.layers[2].parameters(), plain.model.layers[2].parameters()):
        assert torch.equal(p, q)  # undone
    K.refit_kept(plain, model, win, [(1, 2)], 0.1)
    for p, q in zip(pruned.parameters(), plain.parameters()):
        assert torch.equal(p, q)
    with pytest.raises(KeptFitError, match="at least 4 calibration windows"):
        K.guarded_refit(pruned, model, _windows(tok, n=3), [(1, 2)], 0.1)
    with pytest.raises(KeptFitError, match="needs reduce"):
        K.guarded_refit(pruned, model, win, [(1, 2)], 0.1, rank=0, world=2)


def test_train_job_recovers_from_a_refitted_calibration(tmp_path, monkeypatch):
    """``train.py --calibration.refit.kept 1``: the calibration stage's adapter-only folder carries the re-fitted
    block (reloading it gives what a calibration alone gives), LoRA recovery trains on top, and the exported
    model records the re-fitted positions."""
    import lightning as L

    import shift_lightning.maps.keptfit as K
    from shift_lightning.recipes.train import run_training
    from shift_lightning.recovery import RecoveryConfig

    monkeypatch.setattr(K, "heldout_kl", lambda *a, **k: next(scores))  # the re-fit kept (scripted judge)
    kw = dict(model=ModelConfig(tiny={"family": "llama"}), data=TextDataConfig(source=CORPUS, num_samples=8, seq_len=48),
              heldout=TextDataConfig(num_samples=0), prune=PruneConfig(layers=[2, 3]),
              calibration=CalibrationConfig(refit={"kept": 1}))
    scores = iter([1.0, 0.5])
    alone = run_calibration(**kw, output_dir=None, trainer={"accelerator": "cpu", "enable_progress_bar": False})
    assert alone.report.refit["kept"] == [4]
    scores = iter([1.0, 0.5])
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=2, val_check_interval=2, check_val_every_n_epoch=None,
                        inference_mode=False, use_distributed_sampler=False, num_sanity_val_steps=0,
                        enable_progress_bar=False, enable_model_summary=False, logger=False,
                        default_root_dir=str(tmp_path))  # its checkpoints under tmp_path, not the working directory
    rep = run_training(trainer, **kw, train_data=TextDataConfig(source=CORPUS, num_samples=8, seq_len=48, batch_size=4),
                       val=TextDataConfig(source=HELDOUT, num_samples=2, seq_len=48),
                       recovery=RecoveryConfig(method="lora", lora_r=4, lr=2e-3), output_dir=str(tmp_path / "job"))
    assert rep.report.steps == 2
    cal, _ = load_pretrained(tmp_path / "job.calibration")
    for p, q in zip(cal.model.layers[2].parameters(), alone.model.model.layers[2].parameters()):
        assert torch.equal(p, q)
    assert json.loads((tmp_path / "job.calibration" / "shift_config.json").read_text())["refit_blocks"] == [2]
    assert json.loads((tmp_path / "job" / "shift_config.json").read_text())["refit_blocks"] == [2]
    load_pretrained(tmp_path / "job")


def test_the_walks_run_the_blocks_both_models_compute_alike_once(monkeypatch):
    """Blocks before the first one the repair touched are the original's: the guarded re-fit walks them once for
    both models (fewer block calls) and judges, keeps and fits exactly as with separate walks (bit for bit); a hook
    on such a block (an adapter) or a changed embedding ends the shared prefix."""
    from shift_lightning.maps import keptfit
    from shift_lightning.maps.keptfit import _shared_prefix, guarded_refit
    from shift_lightning.models import decoder_layers

    model, tok = build_tiny_model("llama", num_hidden_layers=8)
    win = _windows(tok, n=12, seq_len=32)
    layers = [3, 4]
    fixed = _corrected(model, layers, win)
    assert _shared_prefix(fixed, model, 3) == 2  # the joint map folds into block 2's down_proj
    pairs = refit_pairs(layers, 8, 2)

    def run(shared: bool):
        m, calls = copy.deepcopy(fixed), [0]

        def counted(blk):
            def forward(*a, **k):
                calls[0] += 1
                return type(blk).forward(blk, *a, **k)
            return forward

        for blk in decoder_layers(m) + decoder_layers(model):
            blk.forward = counted(blk)
        with monkeypatch.context() as mp:
            if not shared:
                mp.setattr(keptfit, "_shared_prefix", lambda *a: 0)
            rep = guarded_refit(m, model, win, pairs, 0.1, 4, 16)
        for blk in decoder_layers(m) + decoder_layers(model):
            del blk.forward
        return rep, m.state_dict(), calls[0]

    (r1, s1, c1), (r0, s0, c0) = run(True), run(False)
    assert r1["heldout_kl"] == r0["heldout_kl"] and r1["kept"] == r0["kept"]
    assert all(torch.equal(s1[k], s0[k]) for k in s0)
    assert c1 < c0
    hooked = copy.deepcopy(fixed)
    decoder_layers(hooked)[1].register_forward_pre_hook(lambda *a: None)
    assert _shared_prefix(hooked, model, 3) == 1
    with torch.no_grad():
        hooked.model.embed_tokens.weight[0, 0] += 1
    assert _shared_prefix(hooked, model, 3) == 0
