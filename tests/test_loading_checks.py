"""No silent wrong result when loading: tampered shift-lightning folders, cut GGUF files and data
files that are not text are refused with a message naming the file and what is wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from safetensors.torch import load_file, save_file

from shift_lightning import load_pretrained
from shift_lightning.data import DataError, TextDataConfig, load_texts
from shift_lightning.models import ModelConfig, ModelLoadError, check_gguf, load_model
from shift_lightning.maps.surgery import SurgeryError

ROOT = Path(__file__).resolve().parents[1]
CORPUS = str(ROOT / "tests" / "data" / "tiny_corpus.txt")


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A corrected tiny model with two adapters (blocks 1 and 3 removed: two sites, not merged)."""
    from shift_lightning.criteria import PruneConfig
    from shift_lightning.recipes.calibrate import run_calibration

    out = tmp_path_factory.mktemp("saved") / "run"
    run_calibration(model=ModelConfig(tiny={"family": "llama"}), data=TextDataConfig(source=CORPUS, num_samples=4,
                                                                                      seq_len=32),
                    heldout=TextDataConfig(num_samples=0), prune=PruneConfig(layers=[1, 3]),
                    trainer={"accelerator": "cpu", "enable_progress_bar": False}, output_dir=str(out))
    return out


def _copy(saved: Path, tmp_path: Path) -> Path:
    d = tmp_path / "copy"
    shutil.copytree(saved, d)
    return d


def _edit_json(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def test_the_untampered_folder_loads(saved):
    model, _ = load_pretrained(saved)
    assert sorted(int(k) for k in model.model.shift_adapters.sites) == [1, 2]


def test_fewer_adapters_listed_than_the_weights_hold(saved, tmp_path):
    d = _copy(saved, tmp_path)
    _edit_json(d / "shift_config.json", lambda doc: doc["adapters"].pop())
    with pytest.raises(SurgeryError, match=r"lra.safetensors holds adapters at positions \['1', '2'\] but "
                                           r"shift_config.json lists \['1'\]"):
        load_pretrained(d)


def test_depth_in_config_json_disagrees_with_the_pruning_record(saved, tmp_path):
    d = _copy(saved, tmp_path)
    _edit_json(d / "config.json", lambda doc: doc.update(num_hidden_layers=6))
    with pytest.raises(SurgeryError, match=r"config.json: num_hidden_layers is 6, but shift_config.json records "
                                           r"6 blocks minus 2 pruned = 4"):
        load_pretrained(d)


def test_nan_adapter_weights(saved, tmp_path):
    d = _copy(saved, tmp_path)
    w = load_file(str(d / "lra.safetensors"))
    k = sorted(w)[0]
    w[k] = w[k].clone()
    w[k].view(-1)[3] = float("nan")
    save_file(w, str(d / "lra.safetensors"), metadata={"format": "pt"})
    with pytest.raises(SurgeryError, match=f"lra.safetensors: non-finite adapter weights in .*{k}"):
        load_pretrained(d)


def test_duplicate_adapter_positions(saved, tmp_path):
    d = _copy(saved, tmp_path)
    _edit_json(d / "shift_config.json", lambda doc: doc["adapters"].append(dict(doc["adapters"][0])))
    with pytest.raises(SurgeryError, match=r"shift_config.json: duplicate adapter positions \[1, 1, 2\]"):
        load_pretrained(d)


def test_adapter_dim_is_bounded_before_anything_is_allocated(saved, tmp_path, monkeypatch):
    from shift_lightning.maps import lra

    d = _copy(saved, tmp_path)
    _edit_json(d / "shift_config.json", lambda doc: doc["adapters"][0]["chain"][0].update(dim=10 ** 9))

    def no_alloc(*a, **k):
        raise AssertionError("an adapter was allocated")

    monkeypatch.setattr(lra.LinearResidualAdapter, "__init__", no_alloc)
    with pytest.raises(SurgeryError, match=r"adapter at position 1 has dim 1000000000, the model's hidden size is 32"):
        load_pretrained(d)


@pytest.mark.parametrize("name", ["shift_config.json", "config.json"])
def test_malformed_json_names_its_file(saved, tmp_path, name):
    d = _copy(saved, tmp_path)
    (d / name).write_text('{"format_version": 1, "adapters": [')
    with pytest.raises(SurgeryError, match=f"{d / name} is malformed JSON"):
        load_pretrained(d)


def test_cut_adapter_weights(saved, tmp_path):
    d = _copy(saved, tmp_path)
    data = (d / "lra.safetensors").read_bytes()
    (d / "lra.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(SurgeryError, match="Cannot read .*lra.safetensors"):
        load_pretrained(d)


def test_unpruned_models_load_by_any_name():
    model, tok = load_pretrained(ModelConfig(tiny={"family": "llama"}))
    assert tok is not None and not hasattr(model.model, "shift_adapters")


# ------------------------------------------------------------------------------------------------
# GGUF files
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def gguf_file(tmp_path_factory) -> Path:
    import gguf

    p = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    w = gguf.GGUFWriter(str(p), "llama")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.ones((16, 8), dtype=np.float32))
    w.add_tensor("output.weight", np.ones((64, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p


@pytest.mark.parametrize("keep", [0.995, 0.5, 10 / 1e9])
def test_a_cut_gguf_names_the_file_and_the_damage(gguf_file, tmp_path, keep):
    check_gguf(gguf_file)  # complete: accepted
    data = gguf_file.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: max(int(len(data) * keep), 8)])
    with pytest.raises(ModelLoadError, match=f"{cut} is truncated"):
        check_gguf(cut)
    with pytest.raises(ModelLoadError, match=f"{cut} is truncated"):  # the loader runs the check when it fails
        load_model(ModelConfig(name_or_path=str(cut), cache_dir=str(tmp_path / "cache")))


def test_not_a_gguf(tmp_path):
    p = tmp_path / "model.gguf"
    p.write_bytes(b"PK\x03\x04 a zip file")
    with pytest.raises(ModelLoadError, match=f"{p} is not a GGUF file"):
        check_gguf(p)


# ------------------------------------------------------------------------------------------------
# Data files
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("suffix", [".txt", ".jsonl", ".json"])
def test_non_utf8_and_binary_data_files_are_named(tmp_path, suffix):
    latin = tmp_path / f"latin1{suffix}"
    latin.write_bytes("Caf\xe9 au lait\n\nsecond".encode("latin-1"))
    with pytest.raises(DataError, match=rf"{latin} is not UTF-8 text \(byte 0xe9 at offset 3\)"):
        load_texts(str(latin))
    binary = tmp_path / f"weights{suffix}"
    binary.write_bytes(b"\x00\x01\x02" * 100)
    with pytest.raises(DataError, match=f"{binary} holds NUL bytes"):
        load_texts(str(binary))


def test_malformed_json_data_names_file_and_line(tmp_path):
    p = tmp_path / "docs.jsonl"
    p.write_text('{"text": "fine"}\n{"text": oops}\n')
    with pytest.raises(DataError, match=f"{p} line 2 is malformed JSON"):
        load_texts(str(p))


def test_task_data_that_is_not_text_is_named(tmp_path):
    from shift_lightning.evaluation.tasks import load_docs

    p = tmp_path / "piqa.jsonl"
    p.write_bytes(b"\xff\xfe binary")
    with pytest.raises(DataError, match=f"{p} is not UTF-8 text"):
        load_docs("piqa", data_files={"piqa": str(p)})
