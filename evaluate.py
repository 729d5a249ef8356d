"""Zero-shot (lm-evaluation-harness compatible) and perplexity evaluation of a causal LM.

Works on an original, pruned or corrected model (a saved folder, an HF id, a GGUF, an embedded
name) and writes ``eval_results.json`` + ``eval_results.md`` into ``--output_dir``:

    python evaluate.py --config configs/eval_smollm2.yaml --output_dir results/eval/smollm2
    python evaluate.py --model.name_or_path outputs/run1 --tasks arc_easy,piqa --limit 100 --output_dir /tmp/e
    python evaluate.py --config configs/eval_tiny.yaml --output_dir /tmp/t --trainer.devices 2 \
        --trainer.strategy ddp --trainer.accelerator cpu
    python evaluate.py --config configs/eval_tiny.yaml --print_config
"""

import sys

try:  # importing torch and Lightning takes seconds: Ctrl-C then is one line, not a traceback
    from shift_lightning.recipes.cli import evaluate_main
except KeyboardInterrupt:
    sys.stderr.write("interrupted: stopped on Ctrl-C while starting (nothing was run)\n")
    sys.exit(130)

if __name__ == "__main__":
    evaluate_main()
