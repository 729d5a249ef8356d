"""Relative ridge damping vs held-out quality on a real model (how the default was chosen).

One statistics pass, then one solve per damping value; for each: per-site held-out relative
residual error and the pruned+LRA model's held-out wiki-summaries perplexity.

    python benchmarks/damping_sweep.py --out results/damping_smollm2
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import lightning as L
import torch

from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.criteria import PruneConfig, select_blocks
from shift_lightning.data import TextDataConfig, build_windows
from shift_lightning.models import ModelConfig, load_model
from shift_lightning.surgery import attach_adapters, remove_blocks


@torch.no_grad()
def window_perplexity(model, windows, batch_size: int = 4) -> float:
    """exp(mean next-token NLL) over the real tokens of fixed windows."""
    nll, n = 0.0, 0
    for i in range(0, len(windows), batch_size):
        ids = windows.input_ids[i:i + batch_size]
        mask = windows.attention_mask[i:i + batch_size]
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits.float()
        lp = torch.log_softmax(logits[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]
        m = mask[:, 1:].bool() & mask[:, :-1].bool()
        nll -= lp[m].double().sum().item()
        n += int(m.sum())
    return float(torch.tensor(nll / n).exp())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--criterion", default="reverse_star")
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--calib_samples", type=int, default=64)
    ap.add_argument("--ppl_samples", type=int, default=16)
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--dampings", default="1e-6,1e-5,1e-4,1e-3,1e-2,1e-1")
    ap.add_argument("--out", default="results/damping_smollm2")
    a = ap.parse_args()
    torch.manual_seed(0)
    model, tok = load_model(ModelConfig(name_or_path=a.model))
    mt = model.config.model_type
    calib = build_windows(TextDataConfig(num_samples=a.calib_samples, seq_len=a.seq_len), tok, mt)
    held_err = build_windows(TextDataConfig(split="heldout", num_samples=16, seq_len=a.seq_len, seed=1), tok, mt)
    held_ppl = build_windows(TextDataConfig(split="heldout", num_samples=a.ppl_samples, seq_len=a.seq_len), tok, mt)
    sel = select_blocks(PruneConfig(ratio=a.ratio, criterion=a.criterion), model)
    trainer = L.Trainer(accelerator="cpu", devices=1, inference_mode=False, logger=False,
                        enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    rows = []
    t0 = time.time()
    base = window_perplexity(model, held_ppl)
    pruned = copy.deepcopy(model)
    remove_blocks(pruned, sel.layers)
    rows.append({"variant": "original", "ppl": base})
    rows.append({"variant": "pruned", "ppl": window_perplexity(pruned, held_ppl)})
    del pruned
    module = CalibrationModule(model, sel.layers, CalibrationConfig(damping=1e-4))
    module.calibrate(trainer, calib, None)
    for damp in [float(x) for x in a.dampings.split(",")]:
        module.cfg.damping = damp
        module._solve(module.sites)
        module.measure(trainer, held_err)
        m = copy.deepcopy(model)
        ads = module.adapters_by_position()
        remove_blocks(m, sel.layers)
        attach_adapters(m, copy.deepcopy(ads))
        ppl = window_perplexity(m, held_ppl)
        errs = [s.report["heldout_rel_error"] for s in module.sites]
        cal = [s.report["calib_rel_error"] for s in module.sites]
        rows.append({"variant": "pruned+LRA", "damping": damp, "ppl": ppl,
                     "calib_rel_error_mean": sum(cal) / len(cal), "heldout_rel_error_mean": sum(errs) / len(errs)})
        print(rows[-1], flush=True)
        del m
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"command": "python benchmarks/damping_sweep.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
            "model": a.model, "pruned_layers": sel.layers, "calibration_tokens": calib.num_tokens,
            "ppl_tokens": held_ppl.num_tokens, "seconds": time.time() - t0, "rows": rows}
    out.with_suffix(".json").write_text(json.dumps(meta, indent=2))
    md = [f"# Damping sweep: {a.model}, {a.criterion} {a.ratio:.0%} (blocks {sel.layers})", "",
          f"`{meta['command']}`", "",
          f"Calibration: {calib.num_tokens:,} wiki-summaries tokens; perplexity: {held_ppl.num_tokens:,} held-out tokens.", "",
          "| variant | damping | held-out PPL | mean calib rel. err | mean held-out rel. err |", "|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['variant']} | {r.get('damping', '')} | {r['ppl']:.2f} | {r.get('calib_rel_error_mean', float('nan')):.4f} "
                  f"| {r.get('heldout_rel_error_mean', float('nan')):.4f} |")
    out.with_suffix(".md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
