"""The headline job's second half (called by ``benchmarks/headline_gpu.sh``): reload the exported model
with ``load_pretrained``, ``generate()`` from it, read the job's report and TensorBoard scalars, and
write one JSON (machine, command, seconds per stage, peak GPU memory, tokens/s, the logged curves).
Fails (exit 1, naming what is missing) when the job did not produce what it must."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import bench_common as C

import torch  # noqa: E402

from shift_lightning import load_pretrained  # noqa: E402
from shift_lightning.outputs import write_json_atomic  # noqa: E402
from experiments.tables.recovery import read_curves  # noqa: E402
from shift_lightning.reports import RecoveryReport  # noqa: E402

REQUIRED = ("val/ppl", "val/kl", "zeroshot/avg", "train/loss")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model_dir", required=True)
    ap.add_argument("--tb", required=True)
    ap.add_argument("--train_seconds", type=float, default=None)
    ap.add_argument("--command", default="")
    ap.add_argument("--out", required=True)
    a = ap.parse_args(argv)
    report = RecoveryReport.read(Path(a.model_dir) / "recovery_report.json")
    curves = read_curves(Path(a.tb))
    missing = [t for t in REQUIRED if t not in curves]
    if missing:
        print(f"missing TensorBoard scalars {missing} in {a.tb} (have {sorted(curves)})", file=sys.stderr)
        return 1
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    model, tok = load_pretrained(a.model_dir, device=dev)
    load_s = time.time() - t0
    ids = tok("The capital of France is", return_tensors="pt").input_ids.to(dev)
    t1 = time.time()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=32, do_sample=False)
    if dev.type == "cuda":
        torch.cuda.synchronize()
    gen_s = time.time() - t1
    new = out.shape[1] - ids.shape[1]
    if new != 32:
        print(f"generate() produced {new} new tokens instead of 32", file=sys.stderr)
        return 1
    doc = {"command": a.command, "machine": C.machine(dev), "model_dir": a.model_dir,
           "seconds": {"train_job": a.train_seconds, **report.seconds, "load_pretrained": load_s, "generate_32": gen_s},
           "steps": report.steps, "trainable_params": report.trainable_params,
           "train_tokens_per_s": report.train_tokens_per_s,
           "peak_gpu_memory_gib": {"train_job": report.peak_gpu_memory_bytes / 2 ** 30
                                   if report.peak_gpu_memory_bytes is not None else None,
                                   "reload_and_generate": torch.cuda.max_memory_allocated() / 2 ** 30
                                   if dev.type == "cuda" else None},
           "generate_tokens_per_s": new / gen_s, "pruned_layers": report.pruned_layers,
           "metrics_before": report.metrics_before, "metrics_after": report.metrics_after,
           "curves": {t: curves[t] for t in sorted(curves)}}
    write_json_atomic(a.out, doc)
    print(json.dumps({k: doc[k] for k in ("seconds", "train_tokens_per_s", "peak_gpu_memory_gib", "steps")}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
