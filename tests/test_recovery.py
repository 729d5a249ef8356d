"""RecoveryModule: LoRA / partial / LRA-only fine-tuning of a corrected tiny model, export round trip."""

import copy
from pathlib import Path

import lightning as L
import pytest
import torch

from shift_lightning import load_pretrained
from shift_lightning.criteria import PruneConfig
from shift_lightning.data import TextDataConfig
from shift_lightning.models import ModelConfig, decoder_layers
from shift_lightning.recipes.calibrate import run_calibration
from shift_lightning.recipes.train import run_training
from shift_lightning.recovery import RecoveryConfig, RecoveryModule, base_model
from shift_lightning.maps.surgery import adapter_set

ROOT = Path(__file__).resolve().parents[1]
CORPUS = str(ROOT / "tests" / "data" / "tiny_corpus.txt")
HELDOUT = str(ROOT / "tests" / "data" / "tiny_heldout.txt")


@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "model"
    run_calibration(model=ModelConfig(tiny={"family": "llama"}),
                    data=TextDataConfig(source=CORPUS, num_samples=8, seq_len=48),
                    heldout=TextDataConfig(num_samples=0), prune=PruneConfig(layers=[2, 3]),
                    trainer={"accelerator": "cpu", "enable_progress_bar": False}, output_dir=str(out))
    return out


def _trainer(tmp_path, steps=10):
    return L.Trainer(accelerator="cpu", devices=1, max_steps=steps, val_check_interval=5, check_val_every_n_epoch=None,
                     inference_mode=False, use_distributed_sampler=False, enable_checkpointing=False,
                     num_sanity_val_steps=0,
                     enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                     logger=L.pytorch.loggers.TensorBoardLogger(str(tmp_path / "runs"), name="rec"))


def _data():
    return (TextDataConfig(source=CORPUS, num_samples=16, seq_len=48, batch_size=4),
            TextDataConfig(source=HELDOUT, num_samples=6, seq_len=48))


def test_lora_with_trainable_lra_recovers_and_exports(calibrated, tmp_path):
    data, val = _data()
    before_lra = {k: v.clone() for k, v in load_pretrained(calibrated)[0].model.shift_adapters.state_dict().items()}
    rep = run_training(_trainer(tmp_path), model=ModelConfig(name_or_path=str(calibrated)), train_data=data, val=val,
                       recovery=RecoveryConfig(method="lora", train_lra=True, lora_r=4, lr=2e-3),
                       output_dir=str(tmp_path / "out"))
    assert rep.report.steps == 10
    assert rep.report.metrics_after["val/ppl"] < rep.report.metrics_before["val/ppl"]
    module = rep.module
    # exported folder: LoRA merged, trained LRA in place, identical logits after reload
    m2, tok = load_pretrained(tmp_path / "out")
    ids = tok("After recovery", return_tensors="pt").input_ids
    merged = module.merged_model().eval()
    torch.testing.assert_close(m2(ids).logits, merged(ids).logits, rtol=1e-5, atol=1e-5)
    after_lra = m2.model.shift_adapters.state_dict()
    assert any(not torch.allclose(before_lra[k], after_lra[k]) for k in before_lra)  # the LRA did train
    assert list((tmp_path / "runs" / "rec").rglob("events.out.tfevents*"))  # TensorBoard logs written


def test_partial_and_lra_only_select_the_right_parameters(calibrated):
    model, _ = load_pretrained(calibrated)
    lora = RecoveryModule(copy.deepcopy(model), RecoveryConfig(method="lora", train_lra=True,
                                                               target_modules=["q_proj", "down_proj", "linear"]))
    names = [n for n, p in lora.model.named_parameters() if p.requires_grad]
    assert any("lora_A" in n for n in names) and any("modules_to_save" in n for n in names)
    assert not any("shift_adapters" in n and "lora_" in n for n in names)  # LoRA never on the LRA's linear
    assert {id(p) for p in lora.lra_parameters()} == {id(p) for n, p in lora.model.named_parameters()
                                                     if "modules_to_save" in n}
    # default partial blocks: the block right after the pruning site (original 2,3 -> position 2)
    mod = RecoveryModule(copy.deepcopy(model), RecoveryConfig(method="partial"), pruned_layers=[2, 3], original_num_layers=6)
    assert mod.partial_blocks == [2]
    trainable = {id(p) for p in mod.model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in decoder_layers(mod.model)[2].parameters()}
    lra = RecoveryModule(copy.deepcopy(model), RecoveryConfig(method="lra"))
    trainable = {id(p) for p in lra.model.parameters() if p.requires_grad}
    assert trainable == {id(p) for p in adapter_set(lra.model).adapter_params()} and trainable
    with pytest.raises(ValueError, match="partial_blocks"):
        RecoveryModule(copy.deepcopy(model), RecoveryConfig(method="partial"))
    with pytest.raises(ValueError, match="'lora', 'partial' or 'lra'"):
        RecoveryModule(copy.deepcopy(model), RecoveryConfig(method="full"))


# ------------------------------------------------------------------------------------------------
# train.py: one job, resumable, lean
# ------------------------------------------------------------------------------------------------
import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

from torch.testing import assert_close  # noqa: E402


def _train_cli(*args, world=1, check=True):
    """``train.py`` on the tiny config: one process runs here (a subprocess adds only its start-up), more than
    one as DDP ranks over gloo."""
    if world == 1 and check:
        from shift_lightning.recipes import cli

        return cli.train_main(["--config", "tiny_lora.yaml", *args])
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "train.py"), "--config", "tiny_lora.yaml", *args]
    if world > 1:
        cmd += ["--trainer.devices", str(world), "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"]
    r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    if check:
        assert r.returncode == 0, r.stderr[-3000:]
    return r


def _one_and_two_processes(tmp_path, common: list[str]) -> tuple[dict, dict]:
    """train.py on 1 process (batch 4) and on 2 DDP processes (batch 2 each): their recovery reports."""
    _train_cli("--output_dir", str(tmp_path / "one"), "--trainer.logger.save_dir", str(tmp_path / "r1"),
               *common)
    _train_cli("--output_dir", str(tmp_path / "two"), "--trainer.logger.save_dir", str(tmp_path / "r2"),
               "--train_data.batch_size", "2", *common, world=2)
    return tuple(json.loads((tmp_path / d / "recovery_report.json").read_text()) for d in ("one", "two"))


def _scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    from shift_lightning.reports import read_scalars

    return read_scalars(logdir)


def test_one_job_from_a_model_spec_one_and_two_processes(tmp_path):
    """tiny model spec -> select/prune/calibrate -> LoRA + LRA recovery -> merged export; 2 DDP ranks
    with half the batch each follow the same loss trajectory as 1 process."""
    common = ["--recovery.lora_dropout", "0", "--trainer.max_steps", "6", "--trainer.val_check_interval", "3",
              "--model.dtype", "float64"]  # float64: Adam does not amplify reduction-order rounding
    r1, r2 = _one_and_two_processes(tmp_path, common)
    assert (r1["world_size"], r2["world_size"], r1["steps"], r2["steps"]) == (1, 2, 6, 6)
    assert r1["recovered"] and r1["pruned_layers"] == [2, 3]
    assert_close(torch.tensor(r2["loss_history"]), torch.tensor(r1["loss_history"]), rtol=1e-9, atol=1e-9)
    # the calibration artefacts: report + adapter-only folder, reloadable on its own
    cal = tmp_path / "one.calibration"
    assert (cal / "calibration_report.json").exists() and not (cal / "model.safetensors").exists()
    m_cal, tok = load_pretrained(cal)
    assert len(decoder_layers(m_cal)) == 4 and adapter_set(m_cal) is not None
    m, _ = load_pretrained(tmp_path / "one")
    ids = tok("one job", return_tensors="pt").input_ids
    assert m.generate(ids, max_new_tokens=3, do_sample=False).shape[1] == ids.shape[1] + 3
    # besides the merged model: the LoRA as a PEFT adapter on the corrected base, and model cards
    # (PeftModel round trip: tests/test_interop.py)
    assert (tmp_path / "one" / "lora" / "adapter_config.json").is_file()
    assert (tmp_path / "one" / "base" / "shift_config.json").is_file()
    card = (tmp_path / "one" / "README.md").read_text()
    assert "python train.py --config tiny_lora.yaml --output_dir" in card and "val/ppl" in card
    # TensorBoard: zero-shot at step 0 and at every validation, next to val/ppl, loss, lr, tokens/s
    sc = _scalars(tmp_path / "r1")
    assert [s for s, _ in sc["zeroshot/avg"]] == [0, 3, 6] and [s for s, _ in sc["val/ppl"]] == [0, 3, 6]
    assert {"train/loss", "train/lr", "train/lra_lr", "train/tokens_per_s", "zeroshot/arc_easy"} <= set(sc)
    # zero-shot under DDP equals one process
    assert _scalars(tmp_path / "r2")["zeroshot/avg"] == sc["zeroshot/avg"]


class _Crash(L.Callback):
    def __init__(self, at):
        self.at = at

    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == self.at:
            raise RuntimeError("simulated crash")


def _job(tmp_path, name, steps=8, callbacks=(), ckpt_path=None, train_lra=True, method="lora", **recovery):
    from shift_lightning.calibration import CalibrationConfig
    from shift_lightning.recipes.train import training_callbacks

    out = tmp_path / name
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, val_check_interval=4,
                        check_val_every_n_epoch=None, inference_mode=False, use_distributed_sampler=False,
                        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False, logger=False,
                        accumulate_grad_batches=2,
                        callbacks=[*training_callbacks(str(out), None, 4), *callbacks])
    data, val = _data()
    return run_training(trainer, model=ModelConfig(tiny={"family": "llama"}),
                        data=TextDataConfig(source=CORPUS, num_samples=8, seq_len=48),
                        heldout=TextDataConfig(num_samples=0), prune=PruneConfig(layers=[2, 3]),
                        calibration=CalibrationConfig(solver="lra"), train_data=data, val=val,
                        recovery=RecoveryConfig(method=method, train_lra=train_lra, lora_r=4, lr=2e-3, warmup_steps=2,
                                                **recovery),
                        output_dir=str(out), ckpt_path=ckpt_path)


def _assert_same_exports(dir_a: Path, dir_b: Path, rtol: float, atol: float) -> None:
    a, _ = load_pretrained(dir_a)
    b, _ = load_pretrained(dir_b)
    sa, sb = a.state_dict(), b.state_dict()
    assert list(sa) == list(sb)
    for k in sa:
        assert_close(sa[k], sb[k], rtol=rtol, atol=atol)


def test_resume_equals_uninterrupted_and_checkpoints_hold_only_what_trains(tmp_path):
    full = _job(tmp_path, "full")
    with pytest.raises(RuntimeError, match="simulated crash"):
        _job(tmp_path, "cut", callbacks=[_Crash(3)])
    assert not (tmp_path / "cut").exists() and (tmp_path / "cut.ckpt" / "last.ckpt").exists()
    ck = torch.load(tmp_path / "cut.ckpt" / "last.ckpt", weights_only=True, map_location="cpu")
    assert ck["global_step"] == 3
    module = full.module
    assert set(ck["state_dict"]) and all(("lora_" in k) or ("modules_to_save" in k) for k in ck["state_dict"])
    n_ckpt = sum(t.numel() for t in ck["state_dict"].values())
    assert n_ckpt == full.report.trainable_params < sum(p.numel() for p in module.parameters()) / 4
    resumed = _job(tmp_path, "cut", ckpt_path="last")
    assert resumed.report.steps == full.report.steps == 8
    # the loss history covers the whole run, from step 0 (the checkpoint carries the part before the stop)
    assert len(resumed.report.loss_history) == len(full.report.loss_history) == 8 * 2
    assert_close(torch.tensor(resumed.report.loss_history), torch.tensor(full.report.loss_history),
                 rtol=1e-6, atol=1e-7)
    assert resumed.report.metrics_before == full.report.metrics_before and "val/ppl" in full.report.metrics_before
    _assert_same_exports(tmp_path / "full", tmp_path / "cut", rtol=1e-6, atol=1e-7)


def test_lras_change_only_when_trained_and_zero_steps_export_no_recovery(tmp_path):
    cal = json.loads  # noqa: F841
    frozen = _job(tmp_path, "frozen", steps=4, train_lra=False)
    trained = _job(tmp_path, "trained", steps=4, train_lra=True)
    start, _ = load_pretrained(tmp_path / "frozen.calibration")
    s0 = adapter_set(start).state_dict()
    sf = adapter_set(load_pretrained(tmp_path / "frozen")[0]).state_dict()
    st = adapter_set(load_pretrained(tmp_path / "trained")[0]).state_dict()
    assert all(torch.equal(s0[k], sf[k]) for k in s0)
    assert any(not torch.allclose(s0[k], st[k]) for k in s0)
    assert frozen.report.recovered and trained.report.recovered
    none = _job(tmp_path, "none", steps=0)
    assert none.report.steps == 0 and not none.report.recovered
    assert json.loads((tmp_path / "none" / "shift_config.json").read_text())["recovered"] is False


def test_chunked_loss_equals_full_logits_and_alpaca_targets_the_response(tmp_path):
    from shift_lightning.data import make_alpaca_windows
    from shift_lightning.models import build_tiny_model
    from shift_lightning.nll import lm_nll_sum, token_nll

    model, tok = build_tiny_model("llama", dtype=torch.float64)
    records = [{"instruction": "Add the numbers.", "input": "2 and 3", "output": "5"},
               {"instruction": "Say hello.", "input": "", "output": "Hello there, friend."}]
    win = make_alpaca_windows(records, tok, TextDataConfig(format="alpaca", num_samples=2, seq_len=400, seed=0))
    ids, mask, tgt = win.input_ids, win.attention_mask, win.loss_mask
    # the targets are exactly the response tokens (+ EOS) of each record
    for i in range(2):
        n_resp = int(tgt[i].sum())
        resp = tok.decode(ids[i][tgt[i].bool()][:-1])
        assert resp in ("5", "Hello there, friend.") and n_resp >= 2
    out = model.model(input_ids=ids, attention_mask=mask)
    logits = model.lm_head(out.last_hidden_state)
    nll, _ = token_nll(logits, ids, mask)
    valid = tgt[:, 1:].bool() & mask[:, :-1].bool()
    ref = (nll * valid).sum()
    s, n = lm_nll_sum(out.last_hidden_state, model.lm_head, ids, mask, chunk_tokens=7, loss_mask=tgt)
    assert int(n) == int(valid.sum())
    assert_close(s.double(), ref, rtol=1e-6, atol=1e-8)
    # gradients through the checkpointed chunks equal the full computation
    w = model.lm_head.weight
    w.requires_grad_(True)
    g1 = torch.autograd.grad(lm_nll_sum(out.last_hidden_state.detach(), model.lm_head, ids, mask, 5, loss_mask=tgt)[0], w)[0]
    g2 = torch.autograd.grad((token_nll(model.lm_head(out.last_hidden_state.detach()), ids, mask)[0] * valid).sum(), w)[0]
    assert_close(g1.double(), g2, rtol=1e-5, atol=1e-7)


class _BlockCalls(L.Callback):
    """Counts the calls of the last decoder block's MLP during training (inside the checkpointed forward)."""

    def __init__(self):
        self.n, self._h = 0, None

    def on_train_start(self, trainer, pl_module):
        def count(*_):
            self.n += 1
        self._h = decoder_layers(base_model(pl_module.model))[-1].mlp.register_forward_pre_hook(count)

    def on_train_end(self, trainer, pl_module):
        self._h.remove()


@pytest.mark.parametrize("method", ["lora", "partial"])
def test_gradient_checkpointing_gives_the_same_training(tmp_path, method):
    """Recomputing activations (LoRA dropout, trained LRAs and their hooks inside the recomputed
    blocks) must not change the loss trajectory or the exported weights."""
    calls = {"plain": _BlockCalls(), "ckpt": _BlockCalls()}
    plain = _job(tmp_path, "plain", steps=4, method=method, callbacks=[calls["plain"]])
    ckpt = _job(tmp_path, "ckpt", steps=4, method=method, gradient_checkpointing=True, callbacks=[calls["ckpt"]])
    # every training forward (4 steps x 2 accumulated batches) ran the block again in the backward pass
    assert calls["ckpt"].n - calls["plain"].n == 4 * 2 and calls["plain"].n > 0
    assert_close(torch.tensor(ckpt.report.loss_history), torch.tensor(plain.report.loss_history),
                 rtol=1e-5, atol=1e-6)
    _assert_same_exports(tmp_path / "plain", tmp_path / "ckpt", rtol=1e-5, atol=1e-6)


def test_distillation_moves_towards_the_original_and_resumes_exactly(tmp_path):
    """``loss: kd``: the loss is KL(original ‖ model) on the training windows (recorded from the unpruned
    model before pruning); it brings val/kl down more than the NLL does in the same steps, and a run
    stopped and resumed (the original's distributions recorded again from the folder's base) equals an
    uninterrupted one."""
    nll = _job(tmp_path, "nll", steps=8)
    kd = _job(tmp_path, "kd", steps=8, loss="kd", kd_topk=16)
    before, after = kd.report.metrics_before["val/kl"], kd.report.metrics_after["val/kl"]
    assert nll.report.metrics_before["val/kl"] == pytest.approx(before)
    assert after < before and after < nll.report.metrics_after["val/kl"]
    # the training loss is a KL in nats (non-negative), the NLL's is not (ln V-sized)
    assert min(kd.report.loss_history) >= 0 and max(kd.report.loss_history) < min(nll.report.loss_history)
    with pytest.raises(RuntimeError, match="simulated crash"):
        _job(tmp_path, "cut", steps=8, loss="kd", kd_topk=16, callbacks=[_Crash(3)])
    resumed = _job(tmp_path, "cut", steps=8, loss="kd", kd_topk=16, ckpt_path="last")
    assert_close(torch.tensor(resumed.report.loss_history), torch.tensor(kd.report.loss_history),
                 rtol=1e-6, atol=1e-7)
    _assert_same_exports(tmp_path / "kd", tmp_path / "cut", rtol=1e-6, atol=1e-7)


def test_distillation_without_the_original_is_refused(calibrated):
    model, _ = load_pretrained(calibrated)
    with pytest.raises(Exception, match="loss kd needs the original"):
        RecoveryModule(model, RecoveryConfig(loss="kd"))
    with pytest.raises(Exception, match="recovery.loss must be"):
        RecoveryConfig(loss="mse").validate()


@pytest.mark.extended
def test_distillation_on_one_and_two_processes_records_what_each_rank_reads(tmp_path):
    """``loss: kd`` under DDP: each rank records the original's distributions on the windows it will read
    (StepBatchSampler's stream) and 2 ranks of half the batch follow 1 process's loss trajectory."""
    from shift_lightning.stepdata import StepBatchSampler, visited

    # the windows a rank reads are exactly its sampler's, and the ranks together read the 1-process stream
    one = visited(16, 4, 0, 1, seed=0, total=6)
    two = [visited(16, 2, r, 2, seed=0, total=6) for r in (0, 1)]
    assert set(one) == set(two[0]) | set(two[1])
    assert set(two[1]) == {i for b in StepBatchSampler(16, 2, 1, 2, 0, 6) for i in b}
    assert len(visited(16, 2, 0, 1, seed=0, total=3)) == 6  # a short run records only the windows it reads
    common = ["--recovery.loss", "kd", "--recovery.kd_topk", "16", "--recovery.lora_dropout", "0",
              "--trainer.max_steps", "3", "--trainer.val_check_interval", "3", "--model.dtype", "float64",
              "--save_peft", "false"]
    r1, r2 = _one_and_two_processes(tmp_path, common)
    assert (r1["world_size"], r2["world_size"], r1["steps"], r2["steps"]) == (1, 2, 3, 3)
    assert_close(torch.tensor(r2["loss_history"]), torch.tensor(r1["loss_history"]), rtol=1e-9, atol=1e-9)
