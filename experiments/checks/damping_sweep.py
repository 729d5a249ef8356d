"""Relative ridge damping vs held-out quality on a real model (how the default was chosen).

One statistics pass, then one solve per damping value; for each: per-site held-out relative
residual error and the pruned+LRA model's held-out wiki-summaries perplexity.

    python experiments/checks/damping_sweep.py --out results/damping_smollm2
"""

from __future__ import annotations

import argparse
import copy
import math
import time
from pathlib import Path

import lightning as L
import torch

from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.criteria import PruneConfig
from shift_lightning.selection import select_blocks
from shift_lightning.data import TextDataConfig, build_windows, load_texts, wants_bos
from shift_lightning.evaluation.perplexity import ppl_windows, window_nll
from shift_lightning.models import ModelConfig, load_model
from shift_lightning.outputs import prepare_file, write_json_atomic, write_text_atomic
from shift_lightning.maps.surgery import attach_adapters, remove_blocks


def window_perplexity(model, windows) -> float:
    nll, n = window_nll(model, windows, batch_size=4)
    return math.exp(nll / n)


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
    out = Path(a.out)
    for f in (out.with_suffix(".json"), out.with_suffix(".md")):
        prepare_file(f)  # writable, before any compute
    torch.manual_seed(0)
    model, tok = load_model(ModelConfig(name_or_path=a.model))
    mt = model.config.model_type
    calib = build_windows(TextDataConfig(num_samples=a.calib_samples, seq_len=a.seq_len), tok, mt)
    held_err = build_windows(TextDataConfig(split="heldout", num_samples=16, seq_len=a.seq_len, seed=1), tok, mt)
    # the same perplexity windows as evaluate.py / calibrate.py --evaluate.ppl wiki_summaries
    held_ppl = ppl_windows(tok, load_texts("wiki_summaries", "heldout"), a.seq_len, None, wants_bos(tok, mt),
                           max_windows=a.ppl_samples)
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
    module = CalibrationModule(model, sel.layers, CalibrationConfig(solver="lra", damping=1e-4))
    module.calibrate(trainer, calib, None)
    for damp in [float(x) for x in a.dampings.split(",")]:
        module.cfg.damping = damp
        module.solve()
        module.measure(trainer, held_err)
        m = copy.deepcopy(model)
        ads = module.adapters_by_position()
        remove_blocks(m, sel.layers)
        attach_adapters(m, copy.deepcopy(ads))
        ppl = window_perplexity(m, held_ppl)
        errs = [module.reports[s.key]["heldout_rel_error"] for s in module.sites]
        cal = [module.reports[s.key]["calib_rel_error"] for s in module.sites]
        rows.append({"variant": "pruned+LRA", "damping": damp, "ppl": ppl,
                     "calib_rel_error_mean": sum(cal) / len(cal), "heldout_rel_error_mean": sum(errs) / len(errs)})
        print(rows[-1], flush=True)
        del m
    meta = {"command": "python experiments/checks/damping_sweep.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
            "model": a.model, "pruned_layers": sel.layers, "calibration_tokens": calib.num_tokens,
            "ppl_tokens": sum(w.n_scored for w in held_ppl), "seconds": time.time() - t0, "rows": rows}
    write_json_atomic(out.with_suffix(".json"), meta, indent=2)
    md = [f"# Damping sweep: {a.model}, {a.criterion} {a.ratio:.0%} (blocks {sel.layers})", "",
          f"`{meta['command']}`", "",
          f"Calibration: {calib.num_tokens:,} wiki-summaries tokens; perplexity: {meta['ppl_tokens']:,} held-out tokens.", "",
          "| variant | damping | held-out PPL | mean calib rel. err | mean held-out rel. err |", "|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['variant']} | {r.get('damping', '')} | {r['ppl']:.2f} | {r.get('calib_rel_error_mean', float('nan')):.4f} "
                  f"| {r.get('heldout_rel_error_mean', float('nan')):.4f} |")
    write_text_atomic(out.with_suffix(".md"), "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
