"""Recover a pruned + corrected model with PEFT LoRA or partial-layer fine-tuning (LRAs optionally trained).

    python train.py --config configs/smollm2_lora.yaml --model.name_or_path outputs/smollm2_rs --output_dir outputs/smollm2_rs_lora
    python train.py --config configs/llama8b_lora.yaml --trainer.devices 8 --trainer.strategy ddp
    tensorboard --logdir runs
"""

from shift_lightning.recipes.cli import train_main

if __name__ == "__main__":
    train_main()
