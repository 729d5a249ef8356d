"""How good is the top-k KL? The closeness measure stores the original's top-k next-token
probabilities per position plus one bucket for the rest (:mod:`shift_lightning.closeness`); this
compares that with the exact KL from both models' full logits, on a real model and real text.

    python experiments/checks/fidelity_topk.py --model smollm2-135m --out results/bench/fidelity_topk_smollm2
    python experiments/checks/fidelity_topk.py --model gemma3-270m --out results/bench/fidelity_topk_gemma3

Models compared with the original: 25 % pruned by Reverse-order* and by angular distance, each
without and with the LRA (the paper grid's blocks; 64 × 512 calibration tokens), so the KL spans
small and large values. Positions: ``--windows`` × ``--seq_len`` held-out wiki-summaries tokens.
Reports, per model and k: mean exact KL, mean top-k KL, their relative difference, the largest
per-position shortfall, and the reference's memory per position and for the grid's sets.
"""

from __future__ import annotations

import argparse
import copy
import time

import _common as C

import torch  # noqa: E402

from shift_lightning.calibration import CalibrationConfig, CalibrationModule  # noqa: E402
from shift_lightning.criteria import PruneConfig  # noqa: E402
from shift_lightning.data import TextDataConfig, build_windows  # noqa: E402
from shift_lightning.closeness import kl_exact, kl_top1, lm_softcap, topk_reference  # noqa: E402
from shift_lightning.outputs import write_json_atomic, write_text_atomic  # noqa: E402
from shift_lightning.selection import select_blocks  # noqa: E402
from shift_lightning.maps.surgery import apply_maps, remove_blocks  # noqa: E402


@torch.no_grad()
def logits_of(model, windows, batch: int = 2) -> torch.Tensor:
    out = []
    for s in range(0, len(windows), batch):
        ids, mask = windows.input_ids[s:s + batch], windows.attention_mask[s:s + batch]
        lg = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        out.append(lg[mask.bool()].float())
    return torch.cat(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--windows", type=int, default=4)
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--ks", default="8,16,64,256,1024")
    ap.add_argument("--calib_samples", type=int, default=64)
    ap.add_argument("--out", default="results/bench/fidelity_topk_smollm2")
    a = ap.parse_args(argv)
    t0 = time.time()
    model, tok = C.build_model(a.model, torch.device("cpu"))
    mt = model.config.model_type
    held = build_windows(TextDataConfig(split="heldout", num_samples=a.windows, seq_len=a.seq_len), tok, mt)
    calib = build_windows(TextDataConfig(num_samples=a.calib_samples, seq_len=a.seq_len), tok, mt)
    select = build_windows(TextDataConfig(num_samples=16, seq_len=256), tok, mt)
    softcap = lm_softcap(model)
    ref_logits = logits_of(model, held)
    V, n_pos = ref_logits.shape[1], ref_logits.shape[0]
    ks = [int(k) for k in a.ks.split(",")]
    refs = {k: topk_reference(ref_logits, k, softcap) for k in ks}
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, inference_mode=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    rows = []
    n = model.config.num_hidden_layers
    for crit in ("reverse_star", "angular"):
        layers = select_blocks(PruneConfig(ratio=0.25, criterion=crit), model, select, lambda: trainer).layers
        mod = CalibrationModule(copy.deepcopy(model), layers, CalibrationConfig(solver="lra", heldout=False))
        mod.calibrate(trainer, calib, batch_size=4)
        for variant in ("pruned", "lra"):
            m = copy.deepcopy(model)
            remove_blocks(m, layers)
            if variant == "lra":
                apply_maps(m, mod.fitted_maps("lra"), n, layers)
            lg = logits_of(m, held)
            exact = kl_exact(ref_logits, lg, softcap)
            for k in ks:
                approx, _ = kl_top1(lg, refs[k], softcap)
                rows.append({"model": f"{crit} {variant}", "k": k, "kl_exact": float(exact.mean()),
                             "kl_topk": float(approx.mean()),
                             "rel_diff": float((exact.mean() - approx.mean()) / exact.mean()),
                             "max_shortfall": float((exact - approx).max()),
                             "tail_mass_mean": float(1 - refs[k].logp.double().exp().sum(-1).mean())})
                print(rows[-1], flush=True)
            del m
    mem = {k: k * (8 + 4) for k in ks}
    doc = {"command": "python experiments/checks/fidelity_topk.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
           "model": a.model, "vocab": V, "positions": n_pos, "seconds": time.time() - t0, "machine": C.machine(torch.device("cpu")),
           "bytes_per_position": mem, "rows": rows}
    write_json_atomic(a.out + ".json", doc)
    md = [f"# Top-k KL against the exact KL: {a.model} (vocabulary {V:,})", "",
          f"`{doc['command']}` — {n_pos:,} held-out wiki-summaries positions; models 25 % pruned, without / with "
          "the LRA. **rel. diff** = (exact − top-k) / exact of the mean KL (top-k is a lower bound); "
          "**tail mass**: the original's probability outside its top k, averaged over positions.", "",
          "| model | k | exact KL | top-k KL | rel. diff | max shortfall (one position) | tail mass | bytes / position |",
          "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['model']} | {r['k']} | {r['kl_exact']:.4f} | {r['kl_topk']:.4f} | {100 * r['rel_diff']:.2f} % | "
                  f"{r['max_shortfall']:.3f} | {r['tail_mass_mean']:.4f} | {mem[r['k']]} |")
    write_text_atomic(a.out + ".md", "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
