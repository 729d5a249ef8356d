"""Every shipped config runs end to end in its tiny form: the config's own pruning, solver, recovery method and
evaluation settings, on a tiny random model, the test text and one CPU process (``-m tiny_runs``; about a minute
each on 2 cores: not part of ``make test``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_structure import _entry_for

ROOT = Path(__file__).resolve().parents[1]
DATA, HELD = "tests/data/tiny_corpus.txt", "tests/data/tiny_heldout.txt"
TINY = '{"family": "llama", "num_hidden_layers": 8, "max_position_embeddings": 512}'
#: The same everywhere: a tiny model on one CPU process.
COMMON = ["--model.name_or_path", "tiny", "--model.tiny", TINY, "--model.dtype", "float32",
          "--trainer.accelerator", "cpu", "--trainer.devices", "1", "--trainer.strategy", "auto",
          "--trainer.precision", "32-true", "--trainer.enable_progress_bar", "false"]
TEXT = ["--data.source", DATA, "--data.split", "calibration", "--data.num_samples", "8", "--data.seq_len", "32",
        "--data.batch_size", "4", "--heldout.source", HELD, "--heldout.split", "heldout", "--heldout.num_samples", "2",
        "--heldout.seq_len", "32"]
EVAL = ["--ppl", HELD, "--ppl_seq_len", "32", "--ppl_max_windows", "2", "--data_dir", "tests/data/eval_tiny",
        "--limit", "2", "--tasks", "arc_easy,piqa"]
TRAIN = ["--train_data.source", DATA, "--train_data.split", "calibration", "--train_data.num_samples", "8",
         "--train_data.seq_len", "32", "--train_data.batch_size", "2", "--val.source", HELD, "--val.split", "heldout",
         "--val.num_samples", "2", "--val.seq_len", "32", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2",
         "--trainer.accumulate_grad_batches", "1", "--recovery.warmup_steps", "1", "--zeroshot.data_dir",
         "tests/data/eval_tiny", "--zeroshot.limit", "2", "--zeroshot.tasks", "arc_easy"]
SCRIPT = {"calibrate_parser": "calibrate.py", "train_parser": "train.py", "evaluate_parser": "evaluate.py"}


def _tiny_folder(folder: Path) -> Path:
    from shift_lightning.models import build_tiny_model

    model, tok = build_tiny_model("llama", **{k: v for k, v in json.loads(TINY).items() if k != "family"})
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


@pytest.mark.tiny_runs
@pytest.mark.parametrize("config", sorted((ROOT / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_config_runs_its_tiny_form(config, tmp_path):
    entry = _entry_for(config).__name__
    text = config.read_text()
    args = [*COMMON]
    if entry == "evaluate_parser":
        args += EVAL
    else:
        args += TEXT
    if entry == "calibrate_parser" and "evaluate:" in text:
        args += ["--evaluate.ppl", HELD, "--evaluate.ppl_seq_len", "32", "--evaluate.ppl_max_windows", "2",
                 "--evaluate.tasks", ""]
    if entry == "train_parser":
        args += TRAIN + ["--trainer.logger.save_dir", str(tmp_path / "tb")]
    if "placement: onload" in text:  # onloaded: the tiny model read from a folder of safetensors files
        args[args.index("--model.tiny"):args.index("--model.tiny") + 2] = []
        args[args.index("tiny")] = str(_tiny_folder(tmp_path / "model"))
    out = tmp_path / "out"
    cmd = [sys.executable, SCRIPT[entry], "--config", str(config), *args, "--output_dir", str(out)]
    r = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=900,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, (" ".join(cmd), r.stderr[-3000:])
    report = {"calibrate_parser": "calibration_report.json", "train_parser": "recovery_report.json",
              "evaluate_parser": "eval_results.json"}[entry]
    assert json.loads((out / report).read_text())
