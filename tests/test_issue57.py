"""Issue 57: nothing runs that should not, nothing the user made is lost, nothing silently wrong.

One test per case (grouped where one rule covers several). The three rules:

* what a folder may ask for (:func:`shift_lightning.remote_code.trust_kwargs`): nothing a folder says
  turns remote code on;
* what the tool may delete (:mod:`shift_lightning.ownership`): a leftover is recognised by an owner
  file written inside it and a dead owner, never by its name alone;
* non-finite is never success (:mod:`shift_lightning.finite`): a non-finite metric or weight ends
  the run with one error line and exit 2.
"""

from __future__ import annotations

import builtins
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shift_lightning.recipes import cli

ROOT = Path(__file__).resolve().parents[1]
CORPUS = str(ROOT / "tests" / "data" / "tiny_corpus.txt")
FAST = ["--trainer.enable_progress_bar", "false"]


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def _calibrate(out: Path, model=None, save_model=True) -> Path:
    from shift_lightning.criteria import PruneConfig
    from shift_lightning.data import TextDataConfig
    from shift_lightning.models import ModelConfig
    from shift_lightning.recipes.calibrate import run_calibration

    run_calibration(model=model or ModelConfig(tiny={"family": "llama", "max_position_embeddings": 512}),
                    data=TextDataConfig(source=CORPUS, num_samples=4, seq_len=32),
                    heldout=TextDataConfig(num_samples=0), prune=PruneConfig(layers=[2, 3]),
                    trainer={"accelerator": "cpu", "enable_progress_bar": False}, output_dir=str(out),
                    save_model=save_model)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return _calibrate(tmp_path_factory.mktemp("saved") / "cal")


def _error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err.splitlines()[0]


def _edit_json(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def _evil_code(folder: Path, module: str, pwned: Path) -> None:
    (folder / f"{module}.py").write_text(f"open({str(pwned)!r}, 'w').write('ran')\n")


# ================================================================================================
# Code runs that should not (rule: what a folder may ask for)
# ================================================================================================
def test_a_tokenizer_auto_map_in_a_folder_never_runs_its_code(saved, tmp_path, monkeypatch, capsys):
    from shift_lightning import load_pretrained
    from shift_lightning.models import ModelLoadError

    monkeypatch.setattr(builtins, "input", lambda *a, **k: "y")  # a user answering "y" to the prompt
    pwned = tmp_path / "PWNED"
    d = tmp_path / "m"
    shutil.copytree(saved, d)
    _evil_code(d, "evil_tok", pwned)
    _edit_json(d / "tokenizer_config.json", lambda doc: doc.update(
        tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil_tok.EvilTokenizer", "evil_tok.EvilTokenizer"]}))
    with pytest.raises(ModelLoadError, match="names code of the folder .auto_map.*--model.trust_remote_code true"):
        load_pretrained(d)
    assert not pwned.exists()
    line = _error(cli.evaluate_main, ["--config", "eval_tiny.yaml", "--model.tiny", "null", "--model.name_or_path",
                                      str(d), "--output_dir", str(tmp_path / "e")], capsys)  # evaluate.py: the same
    assert "auto_map" in line and not pwned.exists()


def test_an_adapter_only_record_cannot_turn_on_the_base_folders_code(tmp_path, monkeypatch):
    from shift_lightning import load_pretrained
    from shift_lightning.models import ModelConfig, build_tiny_model

    monkeypatch.setattr(builtins, "input", lambda *a, **k: "y")
    base = tmp_path / "base"
    model, tok = build_tiny_model("llama")
    model.save_pretrained(base)
    tok.save_pretrained(base)
    d = _calibrate(tmp_path / "ad", model=ModelConfig(name_or_path=str(base)), save_model="adapters")
    pwned = tmp_path / "PWNED"
    _evil_code(base, "evil_model", pwned)
    _edit_json(base / "config.json", lambda doc: doc.update(
        auto_map={"AutoConfig": "evil_model.C", "AutoModelForCausalLM": "evil_model.M"}))
    _edit_json(d / "shift_config.json", lambda doc: doc["base_model"].update(trust_remote_code=True))
    load_pretrained(d)  # the base folder's stock classes, none of its code
    assert not pwned.exists()
    from shift_lightning.recipes.train import base_model_config

    assert base_model_config(json.loads((d / "shift_config.json").read_text())).trust_remote_code is False
