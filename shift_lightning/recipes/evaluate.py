"""The evaluation recipe: load a model, score it with ``trainer.predict``, write the results."""

from __future__ import annotations

import datetime as _dt
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from .trainer import build_trainer
from .. import dist
from ..evaluation.runner import EvalConfig, EvalModule, markdown_table
from ..evaluation.tasks import parse_tasks
from ..finite import check_metrics, eval_metrics
from ..models import ModelConfig
from ..outputs import prepare_output, publish_dir
from ..progress import with_stage_progress
from ..stopping import with_signal_guard
from ..checkpoint import load_pretrained

#: Trainer defaults for evaluation runs (``--trainer.*`` overrides them).
EVAL_TRAINER_DEFAULTS: dict[str, Any] = dict(
    accelerator="auto", devices=1, inference_mode=True, logger=False, enable_checkpointing=False,
    use_distributed_sampler=False, enable_model_summary=False,
)


@dataclass
class EvaluationResult:
    results: dict
    """Per task: acc, acc_norm, the reported metric, per-doc outcomes; perplexities; average."""
    output_dir: Path | None = None


def write_results(res: dict, folder: Path, extra: dict | None = None, resolved_config: str | None = None) -> None:
    """``eval_results.json`` + ``eval_results.md`` (+ ``config.yaml``) into ``folder``."""
    doc = dict(res, **(extra or {}), written=_dt.datetime.now().isoformat(timespec="seconds"))
    (folder / "eval_results.json").write_text(json.dumps(doc, indent=2, default=str))
    head = f"# Zero-shot evaluation\n\nmodel: `{(extra or {}).get('model', {}).get('name_or_path', '?')}`, "\
           f"BOS added: {res.get('bos_added')}, processes: {res.get('world_size')}, {res.get('seconds', 0):.0f} s\n\n"
    (folder / "eval_results.md").write_text(head + markdown_table(res))
    if resolved_config:
        (folder / "config.yaml").write_text(resolved_config)


def eval_inputs(model_cfg: ModelConfig, cfg: EvalConfig) -> dict[str, str]:
    """The evaluation's local inputs by option name (the output may not be, contain or lie in one)."""
    from .calibrate import local_inputs

    out = local_inputs(model_cfg)
    out["--data_dir"] = cfg.data_dir
    for task, f in (cfg.data_files or {}).items():
        out[f"--data_files {task}"] = f
    ppl = cfg.ppl.split(",") if isinstance(cfg.ppl, str) else list(cfg.ppl or [])
    for p in ppl:
        out[f"--ppl {p.strip()}"] = p.strip()
    return out


def run_evaluation(model_cfg: ModelConfig, cfg: EvalConfig, trainer: dict | None = None,
                   output_dir: str | None = None, overwrite: bool = False,
                   resolved_config: str | None = None) -> EvaluationResult:
    """Load a model (HF id/folder, GGUF, embedded name, saved pruned+corrected folder, tiny), evaluate it
    with ``trainer.predict`` (1 or more processes) and write ``eval_results.{json,md}`` from rank 0."""
    cfg.validate()
    if dist.launch_rank() == 0:
        prepare_output(output_dir, overwrite, eval_inputs(model_cfg, cfg))
    if cfg.tasks:
        parse_tasks(cfg.tasks)  # unknown task names fail before loading the model
    model, tokenizer = load_pretrained(model_cfg)
    module = EvalModule(model, tokenizer, cfg)
    t = build_trainer(**with_signal_guard(with_stage_progress({**EVAL_TRAINER_DEFAULTS, **(trainer or {})})))
    res = module.evaluate(t)
    check_metrics(eval_metrics(res), "evaluation", "Check the model and the options (e.g. --ppl_max_windows)")
    if t.is_global_zero and output_dir:
        extra = {"model": asdict(model_cfg), "eval": asdict(cfg),
                 "trainer": {k: str(v) for k, v in (trainer or {}).items()}}
        publish_dir(output_dir, lambda tmp: write_results(res, tmp, extra, resolved_config), kind="evaluation",
                    overwrite=overwrite)
    return EvaluationResult(res, Path(output_dir) if output_dir else None)
