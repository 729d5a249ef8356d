"""One job from a model to a recovered model: select blocks, prune, calibrate the LRAs (same Trainer,
same DDP processes), then recover with PEFT LoRA or partial-layer fine-tuning (LRAs optionally
trained) and export the merged model.

    python train.py --config smollm2_lora.yaml --output_dir outputs/smollm2_lora      # CPU, embedded SmolLM2
    python train.py --config llama8b_lora.yaml --trainer.devices 8 --trainer.strategy ddp
    python train.py --config llama8b_lora.yaml --ckpt_path last                       # resume
    tensorboard --logdir runs
"""

import sys

try:  # importing torch and Lightning takes seconds: Ctrl-C then is one line, not a traceback
    from shift_lightning.recipes.cli import train_main
except KeyboardInterrupt:
    sys.stderr.write("interrupted: stopped on Ctrl-C while starting (nothing was run)\n")
    sys.exit(130)

if __name__ == "__main__":
    train_main()
