"""Prune blocks of a causal LM and calibrate Linear Residual Adapters in closed form.

    python calibrate.py --config configs/smollm2_reverse_star.yaml --output_dir outputs/smollm2_rs
    python calibrate.py --config configs/tiny.yaml --output_dir /tmp/t --trainer.devices 2 \
        --trainer.strategy ddp --trainer.accelerator cpu
    python calibrate.py --config configs/tiny.yaml --print_config
"""

import sys

try:  # importing torch and Lightning takes seconds: Ctrl-C then is one line, not a traceback
    from shift_lightning.recipes.cli import calibrate_main
except KeyboardInterrupt:
    sys.stderr.write("interrupted: stopped on Ctrl-C while starting (nothing was run)\n")
    sys.exit(130)

if __name__ == "__main__":
    calibrate_main()
