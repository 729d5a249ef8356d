"""The grid tools' own behaviour (moved from the product's tests with the code they test): the reproduce command line,
grid progress, the cached trunk and reference, significance marks, rendering an empty grid."""

from __future__ import annotations

import copy
import io
import re
from pathlib import Path

import lightning as L
import pytest

from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.data import TextDataConfig, build_windows
from shift_lightning.models import build_tiny_model
from shift_lightning.recipes import cli
from shift_lightning.maps.surgery import apply_maps, remove_blocks

ROOT = Path(__file__).resolve().parents[2]
CORPUS = str(ROOT / "tests" / "data" / "tiny_corpus.txt")
TINY_DATA = ROOT / "tests" / "data" / "eval_tiny"


def _parsers():
    from experiments.reproduce import reproduce_parser

    return {"reproduce": reproduce_parser}


def _trainer():
    return L.Trainer(accelerator="cpu", devices=1, inference_mode=False, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def _windows(tok, n=8, seq_len=64, packing=False):
    return build_windows(TextDataConfig(source=CORPUS, num_samples=n, seq_len=seq_len, packing=packing), tok)


def test_a_recorded_command_pastes_into_a_shell_and_parses_back_to_the_same_grid():
    """A grid run records the command that makes it again: lists (JSON) and values with spaces are shell-quoted,
    so pasting it gives the same settings (where the files go is not part of it)."""
    import dataclasses
    import shlex

    from experiments.reproduce import ReproduceConfig, rerun_command

    cfg = ReproduceConfig(model="smollm2-135m", calib_source="mixed", criteria=["ppl", "angular"],
                          variants=["lra_replaceme"], refit_kept=2, refit_of="results/paper mixed", ratio=0.375)
    cmd = rerun_command(cfg)
    assert "--criteria '[\"ppl\", \"angular\"]'" in cmd and "--refit_of 'results/paper mixed'" in cmd
    argv = shlex.split(cmd)
    assert argv[:3] == ["python", "-m", "experiments.reproduce"]
    p = _parsers()["reproduce"]()
    init = p.instantiate_classes(p.parse_args(cli.preprocess_argv(argv[3:], p)))
    again = ReproduceConfig(**{f.name: init[f.name] for f in dataclasses.fields(ReproduceConfig)})
    assert again == cfg


def test_grid_evaluation_shows_progress_in_a_log_file(capsys):
    """The grids evaluate outside Lightning (``evaluate_model``): each pass still names itself, with a
    closing line, instead of tqdm's carriage returns (and the grid's own trainer shows its passes)."""
    from dataclasses import replace

    from shift_lightning.evaluation.runner import EvalConfig, evaluate_model
    from shift_lightning.models import build_tiny_model
    from shift_lightning.progress import StageProgress, _Plain, stage_bar
    from experiments.harness import quiet_trainer_factory

    assert any(isinstance(c, StageProgress) for c in quiet_trainer_factory()().callbacks)
    model, tok = build_tiny_model("llama")
    cfg = EvalConfig(tasks="", ppl=CORPUS, ppl_seq_len=32, ppl_max_windows=4, kl=False)
    capsys.readouterr()
    evaluate_model(model, tok, cfg, tasks=False)
    err = capsys.readouterr().err
    assert "\r" not in err and re.search(r"\] evaluation \(perplexity and closeness\): \d+ steps?\n", err), err
    assert re.search(r"\] evaluation \(perplexity and closeness\): done, \d+ steps? in 0:00:\d\d", err), err
    evaluate_model(model, tok, replace(cfg, progress=False), tasks=False)
    assert capsys.readouterr().err == ""
    log = io.StringIO()
    bar = stage_bar("scores", 3, interval=0, stream=log)  # a StringIO is not a terminal: plain lines
    for _ in range(3):
        bar.step()
    bar.close()
    lines = log.getvalue().splitlines()
    assert lines[0].endswith("] scores: 3 steps") and re.search(r"\] scores: 33% \(1/3\), [\d.]+ it/s", lines[1])
    assert re.search(r"\] scores: done, 3 steps in 0:00:00", lines[-1]) and len(lines) == 4
    closed = io.StringIO()
    closed.close()  # isatty() raises ValueError on a closed stream: not a terminal, no crash
    assert not StageProgress(stream=closed).tty and not _Plain(0, closed, None).tty
def test_an_interval_bound_that_is_zero_up_to_float_noise_is_zero():
    """Sums of 0/1-outcome means that are exactly 0 come out as ±1e-16; such a bound must not make an interval
    that touches 0 read as significantly below or above it (it did: SmolLM2 angular + re-fit, Avg − pruned
    [−3.5, −1.3e-16] was counted as harm). Real bounds, however small, stay."""
    import numpy as np

    from experiments.summary import _ci
    from experiments.tables.common import fmt_change

    noisy = (np.array([0.1, 0.2, 0.7]) - np.array([0.3, 0.2, 0.5])).sum() / 7  # exactly 0, ≈ 1e-17 in floats
    assert noisy != 0.0
    lo, hi = _ci(np.concatenate([np.full(60, -0.035), np.full(40, noisy)]))
    assert lo == -0.035 and hi == 0.0 and not fmt_change(-0.018, [lo, hi]).endswith("↓")
    assert _ci(np.concatenate([np.full(60, -0.035), np.full(40, -1e-4)]))[1] == -1e-4
def test_grid_reference_is_cached_and_gives_the_same_closeness(tmp_path, monkeypatch):
    """A grid process records the original's distributions once per model and settings; a later process
    reads them back (no pass) and measures the same KL; other settings get their own file."""
    from experiments import harness
    from experiments.reproduce import ReproduceConfig, eval_config

    monkeypatch.setenv("SHIFT_LIGHTNING_CACHE", str(tmp_path))
    cfg = ReproduceConfig(model="tiny", tiny={"family": "llama", "num_hidden_layers": 6}, docs=4, ppl_windows=2,
                          seq_len=64, eval_data_dir=str(TINY_DATA), ppl_sets=[str(TINY_DATA / "ppl_text.txt")])
    open_ = [harness.open_grid(cfg.model, cfg.tiny, "cpu", lambda v, d, c=c: eval_config(c, v, d), {}) for c in
             (cfg, cfg, ReproduceConfig(**{**cfg.__dict__, "kl_docs": 2}))]
    assert open_[0].evaluator.reference_file is None and open_[1].evaluator.reference_file is not None
    assert open_[2].evaluator.reference_file is None  # other settings: recorded, not read
    assert len(list((tmp_path / "closeness").glob("*.safetensors"))) == 2
    pruned = copy.deepcopy(open_[0].model)
    remove_blocks(pruned, [2])
    assert open_[0].evaluate(pruned, tasks=False)["kl"] == open_[1].evaluate(pruned, tasks=False)["kl"]
def test_trunk_cache_gives_bit_identical_evaluations():
    from shift_lightning.evaluation.runner import EvalConfig, evaluate_model
    from experiments.trunk import TrunkCache

    ev = EvalConfig(tasks="arc_easy,piqa,winogrande", data_dir=str(ROOT / "tests" / "data" / "eval_tiny"),
                    ppl=str(ROOT / "tests" / "data" / "tiny_heldout.txt"), ppl_max_windows=3, ppl_seq_len=48,
                    progress=False, batch_size=4)
    model, tok = build_tiny_model("llama", num_hidden_layers=6)
    win = _windows(tok)
    mod = CalibrationModule(copy.deepcopy(model), [3, 4], CalibrationConfig(), solvers=["lra", "replaceme"])
    mod.calibrate(_trainer(), win, batch_size=4)
    variants = {}
    for kind in (None, "lra", "replaceme"):
        m = copy.deepcopy(model)
        remove_blocks(m, [3, 4])
        if kind:
            apply_maps(m, mod.fitted_maps(kind), 6, [3, 4])
        variants[kind] = m
    plain = {k: evaluate_model(m, tok, ev) for k, m in variants.items()}
    cache = TrunkCache(depth=2)  # ReplaceMe changes block 2: blocks 0, 1 are shared
    cached = {}
    with cache.recording(variants[None]):
        cached[None] = evaluate_model(variants[None], tok, ev)
    for k in ("lra", "replaceme"):
        with cache.replaying(variants[k]):
            cached[k] = evaluate_model(variants[k], tok, ev)
    assert cache.hits > 0 and cache.misses == 0
    for k in variants:
        for t in plain[k]["tasks"]:
            assert plain[k]["tasks"][t]["per_doc"] == cached[k]["tasks"][t]["per_doc"]
        for p in plain[k]["perplexity"]:
            assert plain[k]["perplexity"][p]["ppl"] == cached[k]["perplexity"][p]["ppl"]
    assert plain["lra"]["perplexity"] != plain["replaceme"]["perplexity"]


def test_case7_render_only_on_an_empty_folder_says_there_is_nothing(tmp_path, capsys):
    from experiments import reproduce

    empty = tmp_path / "empty"
    reproduce.main(["--render_only", "--out", str(empty), "--model", "tiny"])
    out = capsys.readouterr().out
    assert "No finished runs" in out and "nothing to render" in out and "Tables in" not in out
    assert not empty.exists()  # nothing written, not even a folder




def test_reproduce_errors_are_one_line_and_its_help_and_flags_work(tmp_path, capsys):
    from experiments import reproduce

    with pytest.raises(SystemExit) as e:
        reproduce.main(["--criteria", '["nope"]', "--out", str(tmp_path / "p")])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert "Unknown criteria ['nope']" in err.splitlines()[0], err
    parser = reproduce.reproduce_parser()
    text = " ".join(parser.format_help().split())
    assert "Docs per zero-shot task" in text and "Only render the tables" in text
    args = parser.parse_args(cli.preprocess_argv(["--render_only"], parser))
    assert args["render_only"] is True
    assert parser.parse_args(cli.preprocess_argv(["--render_only", "false"], parser))["render_only"] is False


def _error(main, argv, capsys) -> str:
    """The one ``error:`` line of a refused run (exit 2, no traceback)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    return err.splitlines()[0]


def _never(*a, **k):
    raise AssertionError("compute started before the input was checked")


def test_nan_damping_is_refused_before_the_grid_loads_its_model(tmp_path, monkeypatch, capsys):
    from experiments import harness, reproduce

    monkeypatch.setattr(harness, "open_grid", _never)  # the grid's model would be loaded first
    line = _error(reproduce.main, ["--damping", ".nan", "--out", str(tmp_path / "p")], capsys)
    assert "--calibration.damping must be a finite number > 0, got nan" in line


def test_reproduce_with_a_missing_model_leaves_no_folder(tmp_path, capsys):
    from experiments import reproduce

    line = _error(reproduce.main, ["--model", "./no/such/model", "--out", str(tmp_path / "p")], capsys)
    assert "Model folder not found" in line and not (tmp_path / "p").exists()


@pytest.mark.parametrize("content", ['{"criterion": "ppl", "variant"', "[1, 2]", "\xff\xfe"])
def test_a_damaged_grid_run_file_is_one_line_naming_it(tmp_path, capsys, content):
    """A run file cut short (a full disk, a killed copy), not an object, or not text: the grid and its renderer say
    which file and how to redo that cell, in one line and exit 2, instead of a JSON traceback."""
    from experiments import reproduce

    folder = tmp_path / "grid" / "tiny" / "ppl"
    folder.mkdir(parents=True)
    bad = folder / "lra.json"
    bad.write_bytes(content.encode("latin-1"))
    line = _error(reproduce.main, ["--render_only", "--out", str(tmp_path / "grid"), "--model", "tiny"], capsys)
    assert f"Run file {bad} " in line and "delete it and run the grid again" in line
