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
from shift_lightning.recipes.train import run_recovery
from shift_lightning.recovery import RecoveryConfig, RecoveryModule
from shift_lightning.surgery import adapter_set

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
                     enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=1,
                     logger=L.pytorch.loggers.TensorBoardLogger(str(tmp_path / "runs"), name="rec"))


def _data():
    return (TextDataConfig(source=CORPUS, num_samples=16, seq_len=48, batch_size=4),
            TextDataConfig(source=HELDOUT, num_samples=6, seq_len=48))


def test_lora_with_trainable_lra_recovers_and_exports(calibrated, tmp_path):
    data, val = _data()
    before_lra = {k: v.clone() for k, v in load_pretrained(calibrated)[0].model.shift_adapters.state_dict().items()}
    rep = run_recovery(_trainer(tmp_path), model=ModelConfig(name_or_path=str(calibrated)), data=data, val=val,
                       recovery=RecoveryConfig(method="lora", train_lra=True, lora_r=4, lr=2e-3),
                       output_dir=str(tmp_path / "out"))
    assert rep.report["steps"] == 10
    assert rep.report["metrics_after"]["val/ppl"] < rep.report["metrics_before"]["val/ppl"]
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
