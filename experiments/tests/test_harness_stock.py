"""The grids evaluate every variant on one pruned model: the stock repair's folds are undone exactly."""

from __future__ import annotations

import torch

from experiments import harness
from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.data import TextDataConfig, build_windows
from shift_lightning.models import build_tiny_model
from shift_lightning.maps.surgery import remove_blocks

import lightning as L
from pathlib import Path

CORPUS = str(Path(__file__).resolve().parents[2] / "tests" / "data" / "tiny_corpus.txt")


def test_corrected_undoes_the_stock_folds_exactly():
    model, tok = build_tiny_model("llama", num_hidden_layers=6, dtype=torch.float64, tie_word_embeddings=True)
    win = build_windows(TextDataConfig(source=CORPUS, num_samples=8, seq_len=48), tok)
    removed = [0, 3]  # a span at block 0 (embedding fold) and one with a block before it (down_proj)
    mod = CalibrationModule(model, removed, CalibrationConfig(damping=1e-4), solvers=["stock"])
    mod.calibrate(L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                            enable_progress_bar=False, enable_model_summary=False, inference_mode=False), win)
    corr = mod.fitted_maps("stock")
    assert corr.embedding is not None and corr.down_maps
    remove_blocks(model, removed)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    ids = win.input_ids[:2, :24]
    with torch.no_grad():
        ref = model(input_ids=ids).logits
    with harness.corrected(model, corr, 6, removed):
        assert not model.config.tie_word_embeddings
        with torch.no_grad():
            assert not torch.allclose(model(input_ids=ids).logits, ref)
    after = model.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert model.config.tie_word_embeddings
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, ref)
