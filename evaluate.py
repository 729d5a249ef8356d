"""Zero-shot (lm-evaluation-harness compatible) and perplexity evaluation of a causal LM.

Works on an original, pruned or corrected model (a saved folder, an HF id, a GGUF, an embedded
name) and writes ``eval_results.json`` + ``eval_results.md`` into ``--output_dir``:

    python evaluate.py --config configs/eval_smollm2.yaml --output_dir results/eval/smollm2
    python evaluate.py --model.name_or_path outputs/run1 --tasks arc_easy,piqa --limit 100 --output_dir /tmp/e
    python evaluate.py --config configs/eval_tiny.yaml --output_dir /tmp/t --trainer.devices 2 \
        --trainer.strategy ddp --trainer.accelerator cpu
    python evaluate.py --config configs/eval_tiny.yaml --print_config
"""

import dataclasses
import os
import sys

from jsonargparse import ActionConfigFile
from lightning.pytorch.cli import LightningArgumentParser

from shift_lightning.cli import add_trainer_args, setup_logging, trainer_kwargs
from shift_lightning.evaluation.runner import EVAL_TRAINER_DEFAULTS, EvalConfig, markdown_table, run_evaluation
from shift_lightning.models import ModelConfig


def main(argv=None) -> dict:
    setup_logging()
    p = LightningArgumentParser(description=__doc__.splitlines()[0], default_env=False)
    p.add_argument("--config", action=ActionConfigFile, help="YAML config file(s)")
    p.add_class_arguments(ModelConfig, "model", help="Which model to evaluate")
    p.add_class_arguments(EvalConfig, None, help="What to evaluate")  # --tasks, --limit, --ppl, ...
    add_trainer_args(p, EVAL_TRAINER_DEFAULTS)
    p.add_argument("--output_dir", type=str, required=True, help="Folder for eval_results.json/.md")
    p.add_argument("--overwrite", type=bool, default=False, help="Write into an existing non-empty folder")
    cfg = p.parse_args(argv)
    eval_cfg = EvalConfig(**{f.name: cfg[f.name] for f in dataclasses.fields(EvalConfig)})
    res = run_evaluation(p.instantiate(cfg).model, eval_cfg, trainer_kwargs(cfg.trainer),
                         cfg.output_dir, cfg.overwrite)
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        sys.stdout.write(markdown_table(res))
    return res


if __name__ == "__main__":
    main()
