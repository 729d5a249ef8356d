"""One job from a model to a recovered model: select blocks, prune, calibrate the LRAs (same Trainer,
same DDP processes), then recover with PEFT LoRA or partial-layer fine-tuning (LRAs optionally
trained) and export the merged model.

    python train.py --config smollm2_lora.yaml --output_dir outputs/smollm2_lora      # CPU, embedded SmolLM2
    python train.py --config llama8b_lora.yaml --trainer.devices 8 --trainer.strategy ddp
    python train.py --config llama8b_lora.yaml --ckpt_path last                       # resume
    tensorboard --logdir runs
"""

from shift_lightning.recipes.cli import train_main

if __name__ == "__main__":
    train_main()
