"""Command-line front ends (jsonargparse): typed dataclass configs are the documentation.

Every entry point accepts ``--config file.yaml`` (any number, later wins; a bare name such as
``--config smollm2_lora.yaml`` is also looked up in ``configs/``), dotted overrides
(``--prune.ratio 0.25``, ``--trainer.devices 2``), ``--print_config`` and ``--help`` (every knob with
its description and, for fixed choices, the allowed values). Boolean options work as bare flags
(``--overwrite``) or with a value (``--overwrite false``); abbreviations are refused.

Errors the user can fix (:class:`~shift_lightning.errors.ShiftError`) print one line and exit with
status 2; ``--debug`` shows the traceback. A command line the parser refuses (unknown option, bad
value, empty config file) is one ``error:`` line and a pointer to ``--help``, exit 2. Ctrl-C is one
line and exit status 130; every process of a run exits on Ctrl-C, SIGTERM or a dead peer
(:mod:`shift_lightning.stopping`). Every run saves its fully resolved config as ``config.yaml``
next to its outputs.
"""

from __future__ import annotations

import logging
import shlex
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from jsonargparse import ActionConfigFile, ArgumentError, ArgumentParser, Namespace, set_parsing_settings

from ..calibration.config import RENAMED_KNOBS, RETIRED_SOLVERS, renamed_knob_message
from ..config import (CALIBRATION_SOURCE, CalibrationConfig, EvalConfig, ModelConfig, PruneConfig, RecoveryConfig,
                      TextDataConfig, default_heldout)
from ..errors import ConfigError, ShiftError, UsageError
from .trainer import RecoveryTrainerConfig, TrainerConfig

#: Where bare ``--config NAME.yaml`` names are looked up (after the current folder).
CONFIG_DIRS = (Path.cwd() / "configs", Path(__file__).resolve().parents[2] / "configs")

_QUIET = (".*predict returned None.*", ".*isinstance\\(treespec, LeafSpec\\).*", ".*does not have many workers.*",
          ".*module\\(s\\) in eval mode at the start of training.*", ".*is_gradient_checkpointing.*",
          ".*LeafSpec.*", ".*`tensorboardX` has been removed.*", ".*Checkpoint directory .* exists and is not empty.*",
          ".*Total length of `DataLoader` across ranks is zero.*", ".*The number of training batches.*",
          ".*Detected pickle protocol.*",
          ".*It is recommended to use `self.log\\('val/.*sync_dist=True.*")  # val/* are summed over ranks already  # a refused pickle says so in one line of its own


def quiet_third_party() -> None:
    """Silence tips and warnings that say nothing to our users (called by entry points and tests)."""
    for msg in _QUIET:
        warnings.filterwarnings("ignore", message=msg)
    warnings.filterwarnings("ignore", category=DeprecationWarning)  # third-party API deprecations (jsonargparse, ...)
    # rank_zero_info: "GPU available: False", "TPU available", the litlogger tip, model summaries
    for name in ("lightning.pytorch.utilities.rank_zero", "lightning.fabric.utilities.rank_zero",
                 "lightning.pytorch.accelerators.cuda", "lightning.fabric.utilities.distributed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # transformers / hub progress bars ("Loading weights", "Writing model shards") and tips
    import transformers
    from huggingface_hub.utils import disable_progress_bars

    transformers.utils.logging.disable_progress_bar()
    disable_progress_bars()


def setup_logging() -> None:
    """Called by the entry points only (no side effects at import)."""
    quiet_third_party()
    from .. import dist

    level = logging.INFO if dist.launch_rank() == 0 else logging.WARNING
    logging.basicConfig(level=level, format="[%(asctime)s %(name)s] %(message)s", datefmt="%H:%M:%S")


# --------------------------------------------------------------------------------------------
# Parsers
# --------------------------------------------------------------------------------------------
def _parser(description: str) -> ArgumentParser:
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    p = ArgumentParser(description=description, default_env=False, allow_abbrev=False)
    p.exit_on_error = False  # errors are raised (one line, see entry()), not printed after 75 lines of usage
    p.add_argument("--config", action=ActionConfigFile,
                   help="YAML config file(s); a bare name is also looked up in configs/")
    return p


def _output_args(p: ArgumentParser, what: str) -> None:
    p.add_argument("--output_dir", type=str, required=True, help=f"Folder for {what}")
    p.add_argument("--overwrite", type=bool, default=False,
                   help="Replace an existing output folder (only one this project wrote)")


def calibrate_parser() -> ArgumentParser:
    p = _parser("Depth-prune a causal LM and calibrate Linear Residual Adapters in closed form.")
    _calibration_groups(p)
    p.add_class_arguments(EvalConfig, "evaluate", help="Evaluate the corrected model afterwards "
                          "(off unless --evaluate.tasks or --evaluate.ppl is set)")
    p.set_defaults({"evaluate.tasks": "", "evaluate.ppl": None})
    p.add_argument("--evaluate_baselines", type=bool, default=False,
                   help="Also evaluate the original and the pruned model without adapters")
    p.add_class_arguments(TrainerConfig, "trainer", help="Where the passes run (lightning.Trainer)")
    _output_args(p, "the corrected model and report")
    p.add_argument("--save_model", type=bool, default=True, help="Save the corrected model (not only the report)")
    return p


def evaluate_parser() -> ArgumentParser:
    p = _parser("Zero-shot (lm-evaluation-harness compatible) and perplexity evaluation of a causal LM.")
    p.add_class_arguments(ModelConfig, "model", help="Which model to evaluate")
    p.add_class_arguments(EvalConfig, None, help="What to evaluate")  # --tasks, --limit, --ppl, ...
    p.add_class_arguments(TrainerConfig, "trainer", help="Where the passes run (lightning.Trainer)")
    _output_args(p, "eval_results.json/.md")
    return p


def _calibration_groups(p: ArgumentParser) -> None:
    """``--model.* --data.* --heldout.* --prune.* --calibration.*``: shared by calibrate.py and train.py."""
    p.add_class_arguments(ModelConfig, "model", help="Where the model comes from")
    p.add_class_arguments(TextDataConfig, "data", help="Calibration text")
    p.set_defaults({"data.source": CALIBRATION_SOURCE})
    p.add_class_arguments(TextDataConfig, "heldout", help="Held-out text for per-site errors")
    p.set_defaults({f"heldout.{k}": v for k, v in vars(default_heldout()).items()})
    p.add_class_arguments(PruneConfig, "prune", help="Which blocks to remove")
    p.add_class_arguments(CalibrationConfig, "calibration", help="How adapters are fitted")


def train_parser() -> ArgumentParser:
    p = _parser("One job from a model to a recovered model: select blocks, prune, calibrate the LRAs, then "
                "recover with LoRA / partial-layer fine-tuning (LRAs optionally trained). Given a calibrated "
                "folder as --model.name_or_path, calibration is skipped.")
    _calibration_groups(p)
    p.add_class_arguments(TextDataConfig, "train_data", help="Fine-tuning data (text or Alpaca records)")
    p.set_defaults({"train_data.num_samples": 256, "train_data.seed": 1})
    p.add_class_arguments(TextDataConfig, "val", help="Validation text (val/ppl in TensorBoard)")
    p.set_defaults({f"val.{k}": v for k, v in vars(default_heldout()).items()})
    p.add_class_arguments(RecoveryConfig, "recovery", help="What trains and how")
    p.add_class_arguments(EvalConfig, "zeroshot", help="Zero-shot accuracy logged at step 0 and at every "
                          "validation (zeroshot/<task>, zeroshot/avg); --zeroshot.tasks '' turns it off")
    p.set_defaults({"zeroshot.limit": 100, "zeroshot.sample_seed": 1234, "zeroshot.ppl": None,
                    "zeroshot.progress": False})
    p.add_class_arguments(RecoveryTrainerConfig, "trainer", help="Where and how long training runs (lightning.Trainer)")
    _output_args(p, "the recovered (merged) model")
    p.add_argument("--save_peft", type=bool, default=True,
                   help="Under LoRA also save the adapter in PEFT's format (<output_dir>/lora, trained LRAs inside) "
                        "on top of the corrected base (<output_dir>/base: a second copy of the model)")
    p.add_argument("--ckpt_path", type=str | None, default=None,
                   help="Resume training: 'last' (the job's own <output_dir>.ckpt/last.ckpt) or a checkpoint path")
    return p


# --------------------------------------------------------------------------------------------
# argv handling and errors
# --------------------------------------------------------------------------------------------
def find_config(name: str) -> str:
    """``--config`` value as given if it exists, else ``configs/<name>`` (``.yaml`` optional)."""
    if Path(name).expanduser().exists():
        return check_config_file(name)
    candidates = [d / n for d in CONFIG_DIRS for n in (name, f"{name}.yaml")]
    for c in candidates:
        if c.is_file():
            return check_config_file(str(c))
    raise ConfigError(f"Config file {name!r} not found (also looked in {', '.join(str(d) for d in CONFIG_DIRS)}); "
                      "see configs/ for the shipped ones")


def check_config_file(path: str) -> str:
    """A config file must hold a YAML mapping of settings (an empty one is a mistake, not "no settings"), with no
    calibration knob under a name it no longer has (:data:`~shift_lightning.calibration.config.RENAMED_KNOBS`)."""
    import yaml

    from ..configcheck import check_config_doc

    p = Path(path).expanduser()
    if p.is_dir():
        raise UsageError(f"--config {path} is a folder; give a YAML file")
    try:
        doc = yaml.safe_load(p.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as e:
        raise UsageError(f"Config file {path} cannot be read as YAML: {' '.join(str(e).split())}") from e
    if doc is None:
        raise UsageError(f"Config file {path} is empty (no settings); give a YAML mapping such as 'prune: {{ratio: 0.25}}'")
    if not isinstance(doc, dict):
        raise UsageError(f"Config file {path} holds a {type(doc).__name__}, not a mapping of settings "
                         "('section: {option: value}')")
    check_config_doc(doc, path)  # sections are mappings; no alias bomb (shift_lightning.configcheck)
    renamed = [k for k in doc.get("calibration") or {} if k in RENAMED_KNOBS]
    if renamed:
        raise UsageError(renamed_knob_message(renamed[0], path))
    return path


def _is_bool(hint) -> bool:
    import typing

    return hint is bool or (hint is not None and set(typing.get_args(hint)) == {bool, type(None)})


_BOOL_WORDS = {"true", "false", "yes", "no", "1", "0", "on", "off", "null"}


def preprocess_argv(argv: list[str], parser: ArgumentParser) -> list[str]:
    """Resolve bare ``--config`` names and let boolean options stand as bare flags."""
    bools = {s for a in parser._actions if _is_bool(getattr(a, "_typehint", None)) for s in a.option_strings}
    out: list[str] = []
    i = 0
    while i < len(argv):
        a = argv[i]
        if a == "--config" and i + 1 < len(argv):
            out += [a, find_config(argv[i + 1])]
            i += 2
            continue
        if a.startswith("--config="):
            out.append("--config=" + find_config(a.split("=", 1)[1]))
        elif a in bools and (i + 1 == len(argv) or argv[i + 1].lower() not in _BOOL_WORDS):
            out += [a, "true"]
        else:
            out.append(a)
        i += 1
    return out


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())


def _fail(e: ShiftError, debug: bool):
    """A project error as one line (and its cause), exit status 2; ``--debug`` re-raises it."""
    if debug:
        raise e
    sys.stderr.write(f"error: {_one_line(e)}\n")
    if isinstance(e, UsageError):
        sys.stderr.write("  (--help lists every option)\n")
        raise SystemExit(2) from None
    if e.__cause__ is not None and not isinstance(e.__cause__, ShiftError):
        sys.stderr.write(f"  cause: {type(e.__cause__).__name__}: {_one_line(e.__cause__)}\n")
    sys.stderr.write("  (run again with --debug for the traceback)\n")
    raise SystemExit(2) from None


#: What an entry point says when Ctrl-C arrives while it starts (imports, parsing), before any work.
STARTING = "interrupted: stopped on Ctrl-C while starting (nothing was run)\n"


def entry(run: Callable, argv: list[str] | None = None, parse: Callable | None = None):
    """Run an entry point: ``parse(argv)`` (then ``run(parsed)``; without ``parse``, ``run(argv)``),
    ``--debug`` handling, project errors as one line and exit status 2, Ctrl-C as one line and status 130 —
    from the first line on: while starting (parsing, importing torch and Lightning) too —, the run guarded in every
    process (:func:`~shift_lightning.stopping.guarded`). Parsing (``--help``, ``--print_config``, a refused command
    line) happens before torch or Lightning is imported."""
    import signal

    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (a caller that ignores SIGINT keeps it so)
        signal.signal(signal.SIGINT, _on_sigint_while_starting)
    try:
        return _entry(run, argv, parse)
    except BaseException as e:  # the run's own Ctrl-C is a SystemExit(130) by now: this is the start-up window
        # (a Ctrl-C inside torch's imports may surface as another error, e.g. a RecursionError: the flag says)
        starting = isinstance(e, KeyboardInterrupt) or (_SIGINT_WHILE_STARTING and not isinstance(e, SystemExit))
        if not starting or "--debug" in (sys.argv[1:] if argv is None else argv):
            raise
        sys.stderr.write(STARTING)
        raise SystemExit(130) from None


_SIGINT_WHILE_STARTING: list[int] = []


def _on_sigint_while_starting(signum, frame):
    _SIGINT_WHILE_STARTING.append(signum)
    raise KeyboardInterrupt


def _entry(run: Callable, argv: list[str] | None, parse: Callable | None):
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = "--debug" in argv
    argv = [a for a in argv if a != "--debug"]
    parsed = argv
    if parse is not None:
        try:
            parsed = parse(argv)
        except ShiftError as e:
            _fail(e, debug)
    from .. import dist, stopping

    with stopping.guarded():
        try:
            return run(parsed)
        except ShiftError as e:
            _fail(e, debug)
        except BaseException as e:
            # Lightning turns Ctrl-C inside a Trainer call into sys.exit(1) after its shutdown, and SIGTERM
            # into SIGTERMException (a SystemExit with status 0); under DDP a rank may also fail in a
            # collective with a peer that is already stopping: after a stop signal, all of it is the stop
            import signal

            sig = signal.SIGTERM if type(e).__name__ == "SIGTERMException" else stopping.stop_signal()
            lost = None if debug or sig is not None else stopping.lost_peer(e)
            if lost:  # a rank died (killed, out of memory): one line naming it, not gloo's or NCCL's traceback
                sys.stderr.write(f"error: {lost}\n")
                raise SystemExit(1) from None
            if isinstance(e, KeyboardInterrupt):
                sig = sig or signal.SIGINT
            elif sig is None or (isinstance(e, SystemExit) and type(e).__name__ != "SIGTERMException"
                                 and e.code in (0, None, 2)):
                raise
            if debug:
                raise
            if dist.launch_rank() == 0:
                name = "Ctrl-C" if sig == signal.SIGINT else signal.Signals(sig).name
                sys.stderr.write(f"interrupted: the run stopped on {name} (results are published only when complete; "
                                 "an earlier result stays as it was)\n")
            raise SystemExit(128 + sig) from None


def command_line_keys(argv: list[str]) -> set[str]:
    """Dotted option names given on the command line itself (not by a ``--config`` file)."""
    return {a[2:].split("=", 1)[0] for a in argv if a.startswith("--") and len(a) > 2
            and a.split("=", 1)[0] not in ("--config", "--debug", "--print_config", "--help")}


def resolve_prune_request(cfg: Namespace, given: set[str]) -> None:
    """``prune.layers`` overrides ratio and criterion, so a command line that asks for a criterion or
    ratio over a config with explicit layers would silently keep the config's layers. The command
    line wins (said in the log); asking for both on the command line is an error."""
    if cfg.get("prune") is None or cfg.prune.layers is None:
        return
    asked = sorted(k for k in given if k in ("prune.ratio", "prune.criterion"))
    if not asked:
        return
    if "prune.layers" in given:
        raise ConfigError(f"--prune.layers {list(cfg.prune.layers)} and --{' / --'.join(asked)} contradict each "
                          "other: give explicit layers or ratio + criterion, not both")
    logging.getLogger(__name__).warning(
        "--%s given on the command line: selecting blocks with criterion %r, ratio %s instead of the "
        "config's prune.layers %s", " / --".join(asked), cfg.prune.criterion, cfg.prune.ratio, list(cfg.prune.layers))
    cfg.prune.layers = None


def check_renamed_knobs(argv: list[str], parser: ArgumentParser) -> None:
    """A calibration knob given under a name it no longer has (``--calibration.refit_kept``) is refused with its new
    spelling (``--calibration.refit.kept``), before the parser's generic "unrecognized arguments"."""
    if not any("--calibration.solver" in a.option_strings for a in parser._actions):
        return
    for a in argv:
        old = a.split("=", 1)[0].removeprefix("--calibration.")
        if a.startswith("--calibration.") and old in RENAMED_KNOBS:
            raise UsageError(renamed_knob_message(old))


def parse_args(parser, argv: list[str]) -> Namespace:
    """``parser.parse_args`` with our argv conventions; a refused command line is a :class:`UsageError`."""
    check_renamed_knobs(argv, parser)
    try:
        return parser.parse_args(preprocess_argv(argv, parser))
    except ArgumentError as e:
        msg = _one_line(e)
        if "calibration.solver" in msg:
            got = msg.rsplit("Got value: ", 1)[-1].strip()
            if got in RETIRED_SOLVERS:
                msg = f"--calibration.solver {got} is now spelt with knobs: {RETIRED_SOLVERS[got]}"
        raise UsageError(msg) from None


def parse(parser: ArgumentParser, argv: list[str]) -> tuple[Namespace, str]:
    """Parsed config (command-line rules applied) and its fully resolved YAML."""
    cfg = parse_args(parser, argv)
    resolve_prune_request(cfg, command_line_keys(argv))
    try:
        resolved = parser.dump(cfg, skip_none=False)
    except Exception:  # e.g. objects that do not serialise; the run goes on without config.yaml
        resolved = None
    return cfg, resolved


def _summary(lines: list[str]) -> None:
    from .. import dist

    if dist.launch_rank() == 0 and dist.rank() == 0:
        sys.stdout.write("\n".join(lines) + "\n")


# --------------------------------------------------------------------------------------------
# Entry points
# --------------------------------------------------------------------------------------------
@dataclass
class Parsed:
    """A parsed command line: the raw config, its dataclasses, its resolved YAML, the words it was given."""

    cfg: Namespace
    init: Namespace
    resolved: str | None
    argv: list[str]


def parser_step(make_parser: Callable) -> Callable[[list[str]], Parsed]:
    """Parse, build the dataclasses and check the ``--trainer.*`` knobs: nothing is loaded or written yet."""
    def step(argv: list[str]) -> Parsed:
        parser = make_parser()
        cfg, resolved = parse(parser, argv)
        init = parser.instantiate_classes(cfg)
        init.trainer.validate()
        return Parsed(cfg, init, resolved, argv)

    return step


def calibrate_main(argv: list[str] | None = None):
    def run(p: Parsed):
        from .calibrate import run_calibration

        setup_logging()
        cfg, init = p.cfg, p.init
        result = run_calibration(
            model=init.model, data=init.data, heldout=init.heldout, prune=init.prune,
            calibration=init.calibration, trainer=init.trainer.kwargs(),
            output_dir=cfg.output_dir, overwrite=cfg.overwrite, save_model=cfg.save_model,
            evaluate=init.evaluate, evaluate_baselines=cfg.evaluate_baselines, resolved_config=p.resolved,
            command=shlex.join(["python", "calibrate.py", *p.argv]),
        )
        _summary([result.report.markdown(),
                  f"Results in {cfg.output_dir}/ (calibration_report.md, config.yaml"
                  + (", the corrected model: shift_lightning.load_pretrained)" if cfg.save_model else ")")])
        return result

    return entry(run, argv, parser_step(calibrate_parser))


def evaluate_main(argv: list[str] | None = None):
    def run(p: Parsed):
        import dataclasses

        from ..evaluation.runner import markdown_table
        from .evaluate import run_evaluation

        setup_logging()
        cfg = p.cfg
        eval_cfg = EvalConfig(**{f.name: cfg[f.name] for f in dataclasses.fields(EvalConfig)})
        result = run_evaluation(p.init.model, eval_cfg, p.init.trainer.kwargs(), cfg.output_dir, cfg.overwrite,
                                resolved_config=p.resolved)
        _summary([markdown_table(result.results), f"Results in {cfg.output_dir}/ (eval_results.json, eval_results.md)"])
        return result

    return entry(run, argv, parser_step(evaluate_parser))


def train_main(argv: list[str] | None = None):
    def run(p: Parsed):
        from .train import build_trainer, run_training

        setup_logging()
        cfg, init = p.cfg, p.init
        zeroshot = init.zeroshot if init.zeroshot.tasks else None
        trainer = build_trainer(init.trainer, cfg.output_dir, zeroshot)
        result = run_training(trainer, model=init.model, data=init.data, heldout=init.heldout, prune=init.prune,
                              calibration=init.calibration, train_data=init.train_data, val=init.val,
                              recovery=init.recovery, output_dir=cfg.output_dir, overwrite=cfg.overwrite,
                              ckpt_path=cfg.ckpt_path, resolved_config=p.resolved, save_peft=cfg.save_peft,
                              command=shlex.join(["python", "train.py", *p.argv]))
        if trainer.is_global_zero:
            _summary(_training_summary(result.report, p, zeroshot is not None))
        return result

    return entry(run, argv, parser_step(train_parser))


def _training_summary(r, p: Parsed, zeroshot: bool) -> list[str]:
    cfg, init = p.cfg, p.init
    logs = init.trainer.logger.save_dir
    return [f"{r.steps} steps, {r.trainable_params:,} trainable parameters, "
            f"val/ppl {r.metrics_before.get('val/ppl', float('nan')):.4g} -> "
            f"{r.metrics_after.get('val/ppl', float('nan')):.4g}"
            + (f", val/kl {r.metrics_before['val/kl']:.4f} -> {r.metrics_after.get('val/kl', float('nan')):.4f}"
               if "val/kl" in r.metrics_before else "")
            + (f", zeroshot/avg {r.metrics_before.get('zeroshot/avg', float('nan')):.4f} -> "
               f"{r.metrics_after.get('zeroshot/avg', float('nan')):.4f}" if zeroshot else ""),
            f"Recovered model in {cfg.output_dir}/ (recovery_report.json, config.yaml, README.md"
            + (", lora/ + base/: the PEFT adapter and its base" if cfg.save_peft and init.recovery.method == "lora"
               else "") + "); calibration in "
            f"{cfg.output_dir}.calibration/; checkpoints in {cfg.output_dir}.ckpt/"
            + (f"; TensorBoard: tensorboard --logdir {logs}" if logs is not None else "")]


# --------------------------------------------------------------------------------------------
# Recipes driven by one dataclass (python -m shift_lightning.recipes.gguf)
# --------------------------------------------------------------------------------------------
def dataclass_parser(cfg_cls, description: str):
    """A parser whose options are the fields of ``cfg_cls`` (attribute docstrings as help)."""
    set_parsing_settings(docstring_parse_attribute_docstrings=True)
    p = ArgumentParser(description=description, allow_abbrev=False, default_env=False)
    p.exit_on_error = False
    p.add_class_arguments(cfg_cls, None)
    return p
