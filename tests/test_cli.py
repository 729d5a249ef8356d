"""What a person sees at the command line: one-line errors with exit status 2 from every entry point,
bare boolean flags everywhere, descriptions in --help, explicit choices between the command line and
the config, warnings before a pass, and progress lines that name their stage in a log file."""

from __future__ import annotations

import io
import logging
import re
from pathlib import Path

import pytest

from shift_lightning.recipes import cli

ROOT = Path(__file__).resolve().parents[1]
CORPUS = str(ROOT / "tests" / "data" / "tiny_corpus.txt")


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs name their data relative to the repository


def _parsers():
    return {"calibrate": cli.calibrate_parser, "evaluate": cli.evaluate_parser, "train": cli.train_parser}


def _one_line_error(main, argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err and "--debug" in err, err
    return err.splitlines()[0]


# ------------------------------------------------------------------------------------------------
# One-line errors (exit 2) from every entry point; --debug shows the traceback
# ------------------------------------------------------------------------------------------------
def test_calibrate_errors_are_one_line(tmp_path, capsys):
    out = ["--output_dir", str(tmp_path / "o")]
    tiny = ["--config", "tiny.yaml", *out, "--trainer.enable_progress_bar", "false"]
    binary = tmp_path / "corpus.txt"
    binary.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00")
    tampered = tmp_path / "model"
    tampered.mkdir()
    (tampered / "shift_config.json").write_text("{not json")
    cases = [
        (["--config", "nope.yaml", *out], "Config file 'nope.yaml' not found"),  # bad config
        ([*tiny, "--calibration.damping", "0"], "--calibration.damping must be a finite number > 0"),
        ([*tiny, "--calibration.guarded.ranks", "[0]"], "--calibration.guarded.ranks must be whole ranks >= 1"),
        ([*tiny, "--data.source", "/no/such/corpus.txt"], "Calibration data not found: /no/such/corpus.txt"),
        ([*tiny, "--data.source", str(binary)], f"{binary} is not UTF-8 text"),
        ([*tiny, "--data.num_samples", "100000"], "windows of 64 tokens fit in the text (asked for 100000)"),
        ([*tiny, "--data.seq_len", "300"], "--data.seq_len 300 exceeds the model's maximum positions (256"),
        ([*tiny, "--model.tiny", "null", "--model.name_or_path", str(tampered)],
         f"{tampered}/shift_config.json is malformed JSON"),
        ([*tiny, "--model.tiny", "null", "--model.name_or_path", "./no/such/model"], "Model folder not found"),
    ]
    for argv, match in cases:
        line = _one_line_error(cli.calibrate_main, argv, capsys)
        assert match in line, (match, line)
    assert not (tmp_path / "o").exists()
    with pytest.raises(Exception) as e:  # --debug: the exception itself, with its traceback
        cli.calibrate_main([*tiny, "--calibration.damping", "0", "--debug"])
    assert "damping" in str(e.value)


def test_failed_solve_is_one_line(tmp_path, capsys, monkeypatch):
    from shift_lightning.maps import ridge as stats

    def failing(*a, **k):
        raise stats.SolveError("site 0 (blocks 2..2): Cholesky failed; raise --calibration.damping")

    monkeypatch.setattr(stats, "ridge_solve", failing)  # every solver takes it from maps.ridge when it solves
    line = _one_line_error(cli.calibrate_main, ["--config", "tiny.yaml", "--output_dir", str(tmp_path / "o"),
                                                "--trainer.enable_progress_bar", "false"], capsys)
    assert "Cholesky failed; raise --calibration.damping" in line and not (tmp_path / "o").exists()


def test_unexpected_errors_keep_their_traceback(tmp_path, monkeypatch):
    from shift_lightning.recipes import calibrate

    def bug(**k):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(calibrate, "run_calibration", bug)
    with pytest.raises(ZeroDivisionError):
        cli.calibrate_main(["--config", "tiny.yaml", "--output_dir", str(tmp_path / "o")])


def test_evaluate_and_train_errors_are_one_line(tmp_path, capsys):
    ev = ["--config", "eval_tiny.yaml", "--output_dir", str(tmp_path / "e")]
    assert "Valid task names" in _one_line_error(cli.evaluate_main, [*ev, "--tasks", "arc_hard"], capsys)
    assert "Data for task 'piqa' not found" in _one_line_error(
        cli.evaluate_main, [*ev, "--tasks", "piqa", "--data_files", f'{{"piqa": "{tmp_path}/none.jsonl"}}'], capsys)
    assert "--ppl_seq_len 4096 exceeds the model's maximum positions (2048" in _one_line_error(
        cli.evaluate_main, [*ev, "--ppl_seq_len", "4096"], capsys)
    assert "Model folder not found" in _one_line_error(
        cli.evaluate_main, [*ev, "--model.tiny", "null", "--model.name_or_path", "./no/model"], capsys)
    assert "Model folder not found" in _one_line_error(
        cli.train_main, ["--config", "tiny_lora.yaml", "--model.tiny", "null", "--model.name_or_path", "./no/model", "--output_dir",
                         str(tmp_path / "t")], capsys)


# ------------------------------------------------------------------------------------------------
# Bare boolean flags and --help on every entry point
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["calibrate", "evaluate", "train"])
def test_every_boolean_option_works_as_a_bare_flag(name):
    parser = _parsers()[name]()
    flags = sorted({s for a in parser._actions if cli._is_bool(getattr(a, "_typehint", None))
                    for s in a.option_strings if s.startswith("--")})
    assert "--overwrite" in flags, flags
    base = ["--output_dir", "/tmp/unused"]
    if name == "train":
        base += ["--model.name_or_path", "x"]
    for flag in flags:
        key = flag[2:]
        assert parser.parse_args(cli.preprocess_argv([*base, flag], parser))[key] is True, flag  # bare, last
        assert parser.parse_args(cli.preprocess_argv([flag, *base], parser))[key] is True, flag  # bare, then options
        assert parser.parse_args(cli.preprocess_argv([*base, flag, "false"], parser))[key] is False, flag


@pytest.mark.parametrize("name,expect", [
    ("calibrate", ["Relative ridge damping", "Fraction of blocks to remove", "{independent,sequential,anchored,auto}"]),
    ("evaluate", ["Tokens per perplexity window", "Evaluate only N docs per task"]),
    ("train", ["LoRA rank", "Also train the Linear Residual Adapters"]),
])
def test_help_shows_every_knob_with_its_description(name, expect):
    text = " ".join(_parsers()[name]().format_help().split())
    for e in expect:
        assert e in text, (name, e)


@pytest.mark.parametrize("name", ["calibrate", "train"])
def test_calibration_text_defaults_to_the_mixed_corpus_and_other_text_to_wiki(name):
    """The documented defaults: maps are fitted on ``mixed``; held-out, fine-tuning and validation text stay wiki."""
    args = _parsers()[name]().parse_args(["--output_dir", "/tmp/unused", "--model.name_or_path", "x"])
    assert args["data.source"] == "mixed" and args["heldout.source"] == "wiki_summaries"
    if name == "train":
        assert args["train_data.source"] == args["val.source"] == "wiki_summaries"


# ------------------------------------------------------------------------------------------------
# Command line vs config
# ------------------------------------------------------------------------------------------------
def test_command_line_criterion_over_config_layers_wins_and_says_so(tmp_path, caplog):
    p = cli.calibrate_parser()
    out = ["--output_dir", str(tmp_path / "o")]
    cfg, resolved = cli.parse(p, ["--config", "tiny.yaml", *out])
    assert cfg.prune.layers == [2, 3]  # the config's explicit layers
    with caplog.at_level(logging.WARNING):
        cfg, resolved = cli.parse(p, ["--config", "tiny.yaml", *out, "--prune.criterion", "angular",
                                      "--prune.ratio", "0.5"])
    assert cfg.prune.layers is None and cfg.prune.criterion == "angular" and "layers: null" in resolved
    assert re.search(r"--prune.criterion / --prune.ratio given on the command line: selecting blocks with "
                     r"criterion 'angular', ratio 0.5 instead of the config's prune.layers \[2, 3\]", caplog.text)
    with pytest.raises(cli.ConfigError, match="contradict each other"):
        cli.parse(p, ["--config", "tiny.yaml", *out, "--prune.layers", "[1]", "--prune.ratio", "0.5"])
    cfg, _ = cli.parse(p, ["--config", "tiny.yaml", *out, "--prune.layers", "[1]"])  # layers alone: fine
    assert cfg.prune.layers == [1]
    assert cli.command_line_keys(["--config", "x.yaml", "--prune.ratio=0.3", "--overwrite", "--debug"]) == \
        {"prune.ratio", "overwrite"}


# ------------------------------------------------------------------------------------------------
# Warnings and refusals before the pass
# ------------------------------------------------------------------------------------------------
class _Stop(Exception):
    pass


def _stop_at_selection(*a, **k):
    raise _Stop


def test_too_few_tokens_warn_and_too_long_windows_refuse_before_any_pass(monkeypatch, caplog):
    from shift_lightning.criteria import PruneConfig
    from shift_lightning.data import DataError, TextDataConfig
    from shift_lightning.models import ModelConfig
    from shift_lightning.recipes import calibrate

    monkeypatch.setattr(calibrate, "select_blocks", _stop_at_selection)  # the first pass
    kw = dict(model=ModelConfig(tiny={"family": "llama"}), heldout=TextDataConfig(num_samples=0),
              prune=PruneConfig(layers=[2]))
    with caplog.at_level(logging.WARNING), pytest.raises(_Stop):
        calibrate.run_calibration(data=TextDataConfig(source=CORPUS, num_samples=1, seq_len=16), **kw)
    assert "each site 16 tokens, fewer than the d + 1 = 33 unknowns" in caplog.text
    assert "Raise --data.num_samples / --data.seq_len to at least 33 tokens" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING), pytest.raises(_Stop):
        calibrate.run_calibration(data=TextDataConfig(source=CORPUS, num_samples=2, seq_len=32), **kw)
    assert "fewer than the d + 1" not in caplog.text
    with pytest.raises(DataError, match=r"--data.seq_len 300 exceeds the model's maximum positions \(256"):
        calibrate.run_calibration(data=TextDataConfig(source=CORPUS, num_samples=1, seq_len=300), **kw)


# ------------------------------------------------------------------------------------------------
# Progress
# ------------------------------------------------------------------------------------------------
def _logging_trainer(log):
    """A one-process CPU Trainer whose stage progress goes, as plain lines, to ``log``."""
    import lightning as L

    from shift_lightning.progress import StageProgress

    return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                     enable_model_summary=False, inference_mode=False, use_distributed_sampler=False,
                     callbacks=[StageProgress(interval=0, stream=log, tty=False)])


def test_progress_lines_name_their_stage_in_a_log_file():
    from shift_lightning.calibration import CalibrationModule
    from shift_lightning.data import TextDataConfig, build_windows
    from shift_lightning.models import build_tiny_model
    from shift_lightning.progress import StageProgress, with_stage_progress

    assert isinstance(with_stage_progress({})["callbacks"][0], StageProgress)
    assert "callbacks" not in with_stage_progress({"enable_progress_bar": False})
    model, tok = build_tiny_model("llama")
    windows = build_windows(TextDataConfig(source=CORPUS, num_samples=8, seq_len=48), tok)
    log = io.StringIO()
    trainer = _logging_trainer(log)
    CalibrationModule(model, [2, 3]).calibrate(trainer, windows, windows, batch_size=2)
    lines = log.getvalue().splitlines()
    assert "Predicting" not in log.getvalue()
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d\] calibration statistics: 4 steps", lines[0])
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d\] calibration statistics: 50% \(2/4\), [\d.]+ it/s, elapsed "
                        r"0:00:\d\d, ETA 0:00:\d\d", lines[2])
    assert re.fullmatch(r"\[\d\d:\d\d:\d\d\] calibration statistics: done, 4 steps in 0:00:\d\d \([\d.]+ it/s\)",
                        lines[4])
    # the walk after the loop: one step a block (blocks 0..3), then the held-out pass and its walk
    assert lines[5].endswith("calibration statistics, block by block: 4 steps") and lines[9].endswith("block 3")
    assert lines[10].endswith("held-out errors: 4 steps") and "held-out errors, block by block: done" in lines[-1]


@pytest.mark.parametrize("solver, mode, stage", [
    ("guarded", "independent", "guard: closeness to the original on held-out windows, each candidate"),
    ("lra", "auto", "lra: closeness of each fit on held-out windows, each fit")])
def test_the_judges_work_after_their_pass_shows_progress(solver, mode, stage):
    """The guard's and mode auto's judges run the candidates after the pass's own bar has closed (minutes per
    span on a real model): that work has a progress of its own, one step per candidate or fit."""
    from shift_lightning.calibration import CalibrationConfig, CalibrationModule
    from shift_lightning.data import TextDataConfig, build_windows
    from shift_lightning.models import build_tiny_model

    model, tok = build_tiny_model("llama")
    windows = build_windows(TextDataConfig(source=CORPUS, num_samples=8, seq_len=48), tok)
    log = io.StringIO()
    trainer = _logging_trainer(log)
    mod = CalibrationModule(model, [1, 3, 4], CalibrationConfig(solver=solver, mode=mode, heldout_topk=16))
    mod.calibrate(trainer, windows, batch_size=2)
    lines = [x for x in log.getvalue().splitlines() if f"] {stage}: " in x]
    n = len(mod.fit_choice["kl"]) if mode == "auto" else sum(len(r["guard"]["kl"]) for r in mod.span_reports())
    assert lines[0].endswith(f"{stage}: {n} steps"), log.getvalue()
    assert re.search(rf"{stage}: done, {n} steps in 0:00:\d\d", lines[-1]) and len(lines) == n + 1


# ------------------------------------------------------------------------------------------------
# --trainer.*: typed choices checked before anything runs; --help / --print_config without the frameworks
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("main,config,option,value,match", [
    ("calibrate", "tiny.yaml", "accelerator", "gpux", "Expected a typing.Literal['auto', 'cpu', 'gpu', 'cuda', 'mps']"),
    ("calibrate", "tiny.yaml", "strategy", "dpp", "Expected a typing.Literal['auto', 'ddp']"),
    ("calibrate", "tiny.yaml", "devices", "0", "--trainer.devices must be a count >= 1, -1 (all devices), auto or a list"),
    ("evaluate", "eval_tiny.yaml", "devices", "[0, 0]", "--trainer.devices must be a count >= 1"),
    ("evaluate", "eval_tiny.yaml", "devices", "two", 'Parser key "trainer.devices"'),
    ("evaluate", "eval_tiny.yaml", "precision", "bf16", "Expected a typing.Literal['32-true', '16-mixed', 'bf16-mixed'"),
    ("train", "tiny_lora.yaml", "strategy", "ddp_spwan", "Expected a typing.Literal['auto', 'ddp', 'fsdp']"),
    ("train", "tiny_lora.yaml", "val_check_interval", "0",
     "--trainer.val_check_interval must be an integer >= 1 (training batches between validations); got 0"),
    ("train", "tiny_lora.yaml", "accumulate_grad_batches", "0", "--trainer.accumulate_grad_batches must be an integer >= 1"),
    ("train", "tiny_lora.yaml", "max_steps", "-1", "--trainer.max_steps must be an integer >= 0"),
])
def test_bad_trainer_values_are_one_line_errors_before_anything_runs(main, config, option, value, match, tmp_path, capsys):
    """A bad ``--trainer.*`` value is refused at parse time in one line naming the option (Lightning used to
    refuse it with a traceback after the output folder was made, or, for ``accumulate_grad_batches 0``,
    to train 0 steps and exit 0)."""
    out = tmp_path / "o"
    with pytest.raises(SystemExit) as e:
        getattr(cli, f"{main}_main")(["--config", config, "--output_dir", str(out), f"--trainer.{option}", value])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.startswith("error: ") and "Traceback" not in err, err
    assert match in err.splitlines()[0], err
    assert not out.exists()


def test_trainer_choices_are_ones_lightning_knows():
    """Every fixed choice of the ``--trainer.*`` knobs names an accelerator, strategy or precision of Lightning."""
    import typing

    from lightning.fabric.connector import _PRECISION_INPUT_STR
    from lightning.pytorch.accelerators import AcceleratorRegistry
    from lightning.pytorch.strategies import StrategyRegistry

    from shift_lightning.recipes.trainer import Accelerator, Precision, RecoveryTrainerConfig, TrainerConfig

    def choices(cls, name):
        return set(typing.get_args(typing.get_type_hints(cls)[name]))

    assert set(typing.get_args(Precision)) <= set(typing.get_args(_PRECISION_INPUT_STR))
    assert set(typing.get_args(Accelerator)) - {"auto", "gpu"} <= set(AcceleratorRegistry.available_accelerators())
    for cls in (TrainerConfig, RecoveryTrainerConfig):
        assert choices(cls, "strategy") - {"auto"} <= set(StrategyRegistry.available_strategies()), cls
    assert choices(TrainerConfig, "strategy") == {"auto", "ddp"} and "fsdp" in choices(RecoveryTrainerConfig, "strategy")


def test_trainer_values_parse_and_reach_the_trainer_arguments():
    p = cli.train_parser()
    base = ["--config", "tiny_lora.yaml", "--output_dir", "/tmp/unused"]
    for given, want in (("auto", "auto"), ("-1", -1), ("2", 2), ("[0, 2]", [0, 2])):
        init = p.instantiate_classes(cli.parse_args(p, [*base, "--trainer.devices", given, "--trainer.accelerator", "gpu"]))
        init.trainer.validate()
        assert init.trainer.devices == want
    init.trainer.accelerator = "cpu"
    with pytest.raises(cli.ConfigError, match=r"--trainer.devices \[0, 2\] lists device indices, which CPUs do not have"):
        init.trainer.validate()
    init = p.instantiate_classes(cli.parse_args(p, [*base, "--trainer.val_check_interval", "3",
                                                    "--trainer.logger.save_dir", "null"]))
    kw = init.trainer.kwargs()
    assert kw["val_check_interval"] == 3 and kw["logger"] is False and kw["max_steps"] == 12
    from shift_lightning.recipes.train import build_trainer

    from shift_lightning.recipes.train import DecoderFSDPStrategy

    trainer = build_trainer(init.trainer, None)
    assert trainer.max_steps == 12 and trainer.accumulate_grad_batches == 1 and trainer.logger is None
    init.trainer.strategy = "fsdp"  # configs/llama8b_lora_fsdp.yaml: sharded block by block
    assert isinstance(build_trainer(init.trainer, None).strategy, DecoderFSDPStrategy)


def test_help_and_print_config_answer_without_torch_lightning_or_transformers():
    """``--help`` and ``--print_config`` of every entry point parse without importing the frameworks (they
    took ~9 s; the parse alone is well under a second)."""
    import subprocess
    import sys

    code = """
import contextlib, io, sys
from shift_lightning.recipes import cli
cases = [(cli.calibrate_main, ["--help"]), (cli.train_main, ["--help"]), (cli.evaluate_main, ["--help"]),
         (cli.calibrate_main, ["--config", "tiny.yaml", "--output_dir", "/tmp/unused", "--print_config"]),
         (cli.train_main, ["--config", "llama8b_lora_fsdp.yaml", "--output_dir", "/tmp/unused", "--print_config"]),
         (cli.evaluate_main, ["--config", "eval_tiny.yaml", "--output_dir", "/tmp/unused", "--print_config"])]
for main, argv in cases:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        try:
            main(argv)
        except SystemExit as e:
            assert e.code in (0, None), (argv, e.code)
    assert "trainer" in out.getvalue(), argv
    print(argv[-1], len(out.getvalue()))
print("loaded:", sorted(m for m in ("torch", "lightning", "transformers", "peft") if m in sys.modules))
"""
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.count("--help") == 3 and r.stdout.count("--print_config") == 3, r.stdout
    assert "loaded: []" in r.stdout, r.stdout


@pytest.mark.parametrize("name", ["lra_span", "lra_auto", "guarded_joint"])
def test_a_retired_solver_name_says_how_it_is_spelt_now(name, capsys):
    from shift_lightning.calibration.config import RETIRED_SOLVERS

    with pytest.raises(SystemExit) as e:
        cli.calibrate_main(["--config", "tiny.yaml", "--output_dir", "/tmp/unused", "--calibration.solver", name])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert err.splitlines()[0] == f"error: --calibration.solver {name} is now spelt with knobs: {RETIRED_SOLVERS[name]}"


def test_a_solvers_knobs_are_a_group_of_their_own_that_reaches_it(tmp_path):
    """``--calibration.guarded.*``, ``--calibration.replaceme_cosine.*`` and ``--calibration.refit.*`` are headed
    groups in ``--help``; set on the command line (a group given in part keeps its other defaults), they reach the
    guard's candidates, the cosine fit and the kept-block re-fit."""
    from shift_lightning.maps.keptfit_knobs import RefitKnobs
    from shift_lightning.maps.solvers import get_solver
    from shift_lightning.maps.solvers.guard import GuardKnobs
    from shift_lightning.maps.solvers.replaceme import CosineKnobs

    parser = cli.calibrate_parser()
    help_text = parser.format_help()
    for heading in ("``--calibration.solver guarded``:", "``--calibration.solver replaceme_cosine``:",
                    "The kept-block re-fit after the maps"):
        assert heading in help_text
    argv = ["--config", "tiny.yaml", "--output_dir", str(tmp_path / "o"), "--calibration.solver", "guarded",
            "--calibration.guarded.extra", "[span_lra]", "--calibration.guarded.ranks", "[8]",
            "--calibration.replaceme_cosine.epochs", "3", "--calibration.refit.kept", "all",
            "--calibration.heldout_topk", "16"]
    cal = parser.instantiate_classes(cli.parse_args(parser, argv)).calibration
    assert cal.guarded == GuardKnobs(extra=["span_lra"], ranks=[8])
    assert cal.replaceme_cosine == CosineKnobs(epochs=3) and cal.refit == RefitKnobs(kept="all")
    assert cal.heldout_topk == 16
    cal.validate()
    names = [c.name for c in get_solver("guarded", cal).candidates(32)]
    assert names == ["none", "lra@0.0001", "lra@0.01", "lra@1", "lra@100", "lra@r8", "nobias", "replaceme", "lra@span"]


def test_the_kept_block_refit_runs_from_its_nested_flag(tmp_path):
    """``--calibration.refit.kept 1`` on the command line re-fits the first kept block after the span."""
    res = cli.calibrate_main(["--config", "tiny.yaml", "--output_dir", str(tmp_path / "o"), "--calibration.refit.kept",
                              "1", "--save_model", "false", "--trainer.enable_progress_bar", "false"])
    assert list(res.report.refit["heldout_kl"]) == ["none", "4"]
    assert res.report.calibration["refit"] == {"kept": 1, "damping": 0.1}


@pytest.mark.parametrize("old", ["refit_kept", "guard_extra", "guard_topk", "cosine_lr", "seed"])
def test_a_renamed_knob_on_the_command_line_says_its_new_spelling(old, capsys):
    from shift_lightning.calibration.config import RENAMED_KNOBS

    with pytest.raises(SystemExit) as e:
        cli.calibrate_main(["--config", "tiny.yaml", "--output_dir", "/tmp/unused", f"--calibration.{old}", "2"])
    err = capsys.readouterr().err
    told = f"error: --calibration.{old} is now --calibration.{RENAMED_KNOBS[old]}"
    assert e.value.code == 2 and "Traceback" not in err, err
    assert err.splitlines()[0] == told
    with pytest.raises(SystemExit):  # the ``--flag=value`` form too, and train.py alike
        cli.train_main(["--config", "tiny.yaml", "--output_dir", "/tmp/unused", f"--calibration.{old}=2"])
    assert capsys.readouterr().err.splitlines()[0] == told


def test_a_renamed_knob_in_a_config_file_says_its_new_spelling(tmp_path, capsys):
    cfg = tmp_path / "old.yaml"
    cfg.write_text("calibration:\n  solver: stock\n  refit_kept: 2\n")
    with pytest.raises(SystemExit) as e:
        cli.calibrate_main(["--config", "tiny.yaml", "--config", str(cfg), "--output_dir", "/tmp/unused"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err, err
    assert err.splitlines()[0] == (f"error: Config file {cfg}: calibration.refit_kept is now calibration.refit.kept "
                                   "(in YAML 'calibration: {refit: {kept: ...}}'; on the command line "
                                   "--calibration.refit.kept)")


@pytest.mark.parametrize("group,bad,match", [
    ("guarded", {"extra": ["span"]}, r"--calibration.guarded.extra \['span'\]: choose from \['span_lra', 'lra_"),
    ("guarded", {"path": []}, r"--calibration.guarded.path must be finite relative dampings > 0, got \[\]"),
    ("guarded", {"path": [1e-2, float("inf")]}, "--calibration.guarded.path must be finite relative dampings > 0"),
    ("guarded", {"ranks": [4, True]}, "--calibration.guarded.ranks must be whole ranks >= 1"),
    ("replaceme_cosine", {"epochs": 0}, "--calibration.replaceme_cosine.epochs must be >= 1, got 0"),
    ("replaceme_cosine", {"batch_tokens": 0}, "--calibration.replaceme_cosine.batch_tokens must be >= 1"),
    ("replaceme_cosine", {"max_tokens": -1}, "--calibration.replaceme_cosine.max_tokens must be >= 1"),
    ("replaceme_cosine", {"lr": float("nan")}, "--calibration.replaceme_cosine.lr must be a finite number > 0"),
    ("refit", {"kept": -1}, "--calibration.refit.kept must be a whole number of blocks >= 0"),
    ("refit", {"damping": 0}, "--calibration.refit.damping must be a finite number > 0"),
])
def test_each_knob_group_validates_its_own_knobs(group, bad, match):
    """Each group's ``validate`` refuses its bad values (named by their flag), alone and through the config's."""
    from shift_lightning.calibration.config import GROUPS, CalibrationConfig
    from shift_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match=match):
        GROUPS[group](**bad).validate()
    with pytest.raises(ConfigError, match=match):
        CalibrationConfig(**{group: bad}).validate()
    with pytest.raises(ConfigError, match="--calibration.heldout_topk must be >= 1"):
        CalibrationConfig(heldout_topk=0).validate()


def test_guard_ranks_above_the_hidden_size_are_refused_by_the_guards_knobs():
    from shift_lightning.calibration.config import CalibrationConfig
    from shift_lightning.errors import ConfigError

    with pytest.raises(ConfigError, match=r"--calibration.guarded.ranks \[40\] exceed the model's hidden size d = 32"):
        CalibrationConfig(guarded={"ranks": [8, 40]}).check_dim(32)
    CalibrationConfig(guarded={"ranks": [8, 32]}).check_dim(32)


def test_a_variants_group_knobs_keep_the_configs_others():
    """``CalibrationModule(solvers={key: knobs})``: a group given as a mapping sets only the knobs it names; an old flat
    name is refused with the new one."""
    from shift_lightning.calibration.config import CalibrationConfig
    from shift_lightning.errors import ConfigError

    base = CalibrationConfig(guarded={"path": [1.0]})
    got = base.with_knobs({"solver": "guarded", "guarded": {"extra": ["span_lra"]}})
    assert got.solver == "guarded" and got.guarded.path == [1.0] and got.guarded.extra == ["span_lra"]
    assert base.guarded.extra == []
    with pytest.raises(ConfigError, match="'guard_extra' is now 'guarded.extra'"):
        base.with_knobs({"guard_extra": ["span_lra"]})
