"""Score the data-driven criteria on a tiny model with N Lightning processes; write JSON (rank 0).

Run as a script (Lightning's ``ddp`` strategy re-launches ``sys.argv`` for the extra ranks, so
it cannot run inside pytest's own process)::

    OMP_NUM_THREADS=1 python tests/ddp_criteria_main.py --devices 2 --out scores.json

``tests/test_criteria.py`` compares the 2-process output with the 1-process one.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

#: criterion name, extra PruneConfig fields
CASES = [("block_influence", {}), ("angular", {"angular_tokens": "last"}),
         ("angular", {"angular_tokens": "all"}), ("ppl", {}), ("taylor", {}), ("linear_fit", {"heldout_every": 3}),
         ("linear_fit_kl", {"heldout_every": 3})]


def tiny_texts(n: int = 40, seed: int = 0) -> list[str]:
    """Deterministic pseudo-English documents of varied length (no files needed)."""
    words = ("the of and a to in is was for on that by with as at from his an were are which "
             "river city music school war king film team north island church born played").split()
    rng = random.Random(seed)
    return [" ".join(rng.choice(words) for _ in range(rng.randint(3, 14))) + "." for _ in range(n)]


def tiny_windows(tokenizer, num_samples: int = 7, seq_len: int = 40, packing: bool = False):
    """Token windows; unpacked → right-padded windows of different lengths."""
    from shift_lightning.data import TextDataConfig, make_windows

    cfg = TextDataConfig(num_samples=num_samples, seq_len=seq_len, packing=packing)
    return make_windows(tiny_texts(), tokenizer, cfg)


def make_trainer_factory(devices: int):
    import lightning as L

    def make():
        return L.Trainer(accelerator="cpu", devices=devices, strategy="ddp" if devices > 1 else "auto",
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, inference_mode=False, use_distributed_sampler=False)

    return make


def compute(devices: int) -> dict:
    from shift_lightning.criteria import PruneConfig
    from shift_lightning.selection import select_blocks
    from shift_lightning.models import build_tiny_model

    model, tok = build_tiny_model("llama", seed=0)
    windows = tiny_windows(tok)
    out = {}
    for name, extra in CASES:
        cfg = PruneConfig(criterion=name, ratio=0.34, batch_size=2, **extra)
        sel = select_blocks(cfg, model, windows, make_trainer_factory(devices))
        key = name + ("_" + extra["angular_tokens"] if "angular_tokens" in extra else "")
        out[key] = sel.to_dict()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--devices", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = compute(args.devices)
    from shift_lightning import dist

    if dist.rank() == 0:
        out["world_size"] = dist.world_size()
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)


if __name__ == "__main__":
    main()
