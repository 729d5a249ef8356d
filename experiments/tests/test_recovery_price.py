"""The price after recovery (``experiments.recovery_table`` from a folded repair, before and after): one stock row
with the kept-block re-fit, end to end on a tiny random model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _lora_params(model, r: int) -> int:
    """LoRA's parameters on every decoder block's attention + MLP linear layers at rank ``r``."""
    from shift_lightning.arch import decoder_layers
    from shift_lightning.config import DEFAULT_TARGETS

    return sum(r * (m.in_features + m.out_features) for b in decoder_layers(model) for n, m in b.named_modules()
               if n.split(".")[-1] in DEFAULT_TARGETS)


def test_stock_with_refit_row_records_before_and_after(tmp_path):
    """``--repair stock --grid.refit_kept 2``: the run starts from the paper grid's stock + re-fit row (the same
    model: its ``before`` equals that row's KL, top-1, perplexity and accuracy), trains LoRA and nothing else (the
    maps are folded: no map parameters), and its file and table carry KL, top-1, Avg and Robust before and after; the
    parent folder renders the table across its start folders; a trained map with a folded repair is refused before
    any work."""
    from shift_lightning.checkpoint import load_pretrained
    from shift_lightning.errors import ConfigError
    from shift_lightning.models import ModelConfig
    from shift_lightning.maps.surgery import remove_blocks
    from experiments.recovery_table import RecoveryTableConfig, run
    from experiments.reproduce import ReproduceConfig
    from experiments.reproduce import run as run_grid

    tiny = {"family": "llama", "num_hidden_layers": 8, "max_position_embeddings": 512}
    grid = ReproduceConfig(model="tiny", tiny=tiny, criteria=["block_influence"], variants=["stock"], refit_kept=2,
                           calib_samples=8, seq_len=64, select_samples=4, select_seq_len=32, heldout_samples=3, docs=4,
                           ppl_windows=2, n_boot=50, text_source=str(ROOT / "tests" / "data" / "tiny_corpus.txt"),
                           eval_data_dir=str(ROOT / "tests" / "data" / "eval_tiny"),
                           ppl_sets=[str(ROOT / "tests" / "data" / "tiny_heldout.txt")], out=str(tmp_path / "paper"))
    grid_row = json.loads((run_grid(grid) / "block_influence" / "stock.json").read_text())
    assert grid_row["refit"]["tried"], "the tiny model's selection leaves no kept block to re-fit"

    common = dict(model="tiny", criteria=["block_influence"], repair="stock", steps=2, batch_size=2, seq_len=32,
                  train_samples=4, val_samples=2, val_every=2, curve_docs=2, lora_r=2, grid=grid)
    parent = tmp_path / "price"
    with pytest.raises(ConfigError, match="folds its maps.*lra_trained_lora_kd"):
        run(RecoveryTableConfig(**common, runs=["lra_trained_lora_kd"], out=str(parent / "bad")))
    assert not (parent / "bad").exists()

    out = run(RecoveryTableConfig(**common, runs=["lra_lora_kd"], out=str(parent / "stock_refit2")))
    doc = json.loads((out / "block_influence" / "lra_lora_kd.json").read_text())
    before = doc["before"]
    sets = list(grid_row["kl"])
    assert len(sets) == 2 and set(doc["kl"]) == set(before["kl"]) == set(doc["top1"]) == set(before["top1"]) == set(sets)
    # the starting model is the grid's stock + re-fit row: same blocks removed, re-fitted and kept, same numbers
    assert doc["pruned_layers"] == grid_row["pruned_layers"]
    assert doc["refit"]["tried"] == grid_row["refit"]["tried"] and doc["refit"]["kept"] == grid_row["refit"]["kept"]
    for s in sets:
        assert before["kl"][s] == pytest.approx(grid_row["kl"][s], rel=1e-5)
        assert before["top1"][s] == pytest.approx(grid_row["top1"][s], abs=1e-9)
    for p, e in grid_row["perplexity"].items():
        assert before["perplexity"][p]["ppl"] == pytest.approx(e["ppl"], rel=1e-5)
    assert before["average"] == pytest.approx(grid_row["average"], abs=1e-9)
    # training moved the model (after is not before) and trained LoRA alone: the folded maps add no parameters
    assert any(doc["kl"][s] != pytest.approx(before["kl"][s], rel=1e-6) for s in sets)
    model, _ = load_pretrained(ModelConfig(name_or_path="tiny", tiny=tiny))
    remove_blocks(model, doc["pruned_layers"])
    assert doc["trainable_params"] == _lora_params(model, 2)
    assert doc["seconds"]["refit"] > 0 and doc["seconds"]["before_evaluation"] > 0

    # Robust is measured against the grid's original: a random tiny model sits at chance (no task counts, NaN), so
    # let that original answer every doc right; then every task counts and Robust is (acc - chance) / (1 - chance)
    orig_file = Path(grid.out) / "tiny" / "original.json"
    orig = json.loads(orig_file.read_text())
    for e in orig["tasks"].values():
        if "chance" in e:
            e["per_doc"][e["metric"]] = [1] * len(e["per_doc"][e["metric"]])
    orig_file.write_text(json.dumps(orig))
    run(RecoveryTableConfig(**common, runs=["lra_lora_kd"], render_only=True, out=str(out)))
    table = json.loads((out / "recovery.json").read_text())
    (row,) = table["rows"]
    for when, d in (("before", before), ("after", doc)):
        assert set(row[when]["kl"]) == set(row[when]["top1"]) == set(sets)
        assert row[when]["avg"] == d["average"] and len(row[when]["robust_ci"]) == 2
        kept = [(sum(e["per_doc"][e["metric"]]) / len(e["per_doc"][e["metric"]]) - e["chance"]) / (1 - e["chance"])
                for e in d["tasks"].values() if "chance" in e]
        assert row[when]["robust"] == pytest.approx(sum(kept) / len(kept), abs=1e-12)
    assert row["after"]["kl"] == doc["kl"] and row["before"]["kl"] == before["kl"]
    assert row["start"].startswith("+stock, re-fit of 2 kept blocks")
    assert row["training"] == "LoRA, distilled (KD)"
    md = (out / "recovery.md").read_text()
    header = next(line for line in md.splitlines() if line.startswith("| criterion"))
    assert [c.strip() for c in header.strip("|").split("|")][4:] == [
        "KL before", "KL after", "top-1 before", "top-1 after", "Avg before", "Avg after", "Robust before",
        "Robust after"]
    cells = [c.strip() for c in md.splitlines()[md.splitlines().index(header) + 2].strip("|").split("|")]
    assert cells[4] == " / ".join(f"{before['kl'][s]:.3f}" for s in sets)
    assert cells[9] == f"{100 * doc['average']:.2f}" and "[" in cells[11]
    assert "--repair stock" in md and "--grid.refit_kept 2" in md

    # the parent folder: the table across its start folders, the same row
    run(RecoveryTableConfig(render_only=True, out=str(parent)))
    across = json.loads((parent / "recovery.json").read_text())
    assert [(r["folder"], r["criterion"], r["run"]) for r in across["rows"]] == [
        ("stock_refit2", "block_influence", "lra_lora_kd")]
    assert across["rows"][0]["before"] == row["before"] and across["rows"][0]["after"] == row["after"]
