"""What the KL guard costs: calibration time with ``--calibration.solver guarded`` against the plain LRA.

    python benchmarks/guard_cost.py --model smollm2-135m --out results/bench/guard_cost_smollm2

Per criterion (the paper grid's 25 % blocks), the same 64 × 512 calibration windows, one thread, the
two solvers timed in alternation (``--repeats`` each; medians): the LRA's one statistics pass + solve,
and the guard's (the pass with held-out copies, the candidates' solves, the judge pass over the
held-out windows: one original forward and, per span, one run per candidate from the block before
the span, then the refit). Also reports what the guard chose.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import _common as C

import torch  # noqa: E402

from shift_lightning.calibration import CalibrationConfig, CalibrationModule  # noqa: E402
from shift_lightning.criteria import PruneConfig  # noqa: E402
from shift_lightning.data import TextDataConfig, build_windows  # noqa: E402
from shift_lightning.outputs import write_json_atomic, write_text_atomic  # noqa: E402
from shift_lightning.selection import select_blocks  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--criteria", default="reverse_star,angular,taylor")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="results/bench/guard_cost_smollm2")
    a = ap.parse_args(argv)
    model, tok = C.build_model(a.model, torch.device("cpu"))
    mt = model.config.model_type
    calib = build_windows(TextDataConfig(num_samples=64, seq_len=512), tok, mt)
    select = build_windows(TextDataConfig(num_samples=16, seq_len=256), tok, mt)
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, inference_mode=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    rows = []
    for crit in a.criteria.split(","):
        windows = calib if crit == "linear_fit" else select
        layers = select_blocks(PruneConfig(ratio=0.25, criterion=crit), model, windows, lambda: trainer).layers
        times = {"lra": [], "guarded": []}
        chosen = None
        for _ in range(a.repeats):
            for solver in ("lra", "guarded"):
                m = copy.deepcopy(model)
                t0 = time.perf_counter()
                mod = CalibrationModule(m, layers, CalibrationConfig(solver=solver, heldout=False))
                mod.calibrate(trainer, calib, batch_size=4)
                times[solver].append(time.perf_counter() - t0)
                if solver == "guarded":
                    chosen = [mod.reports[s.key]["guards"]["guarded"]["chosen"] for s in mod.spans]
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"criterion": crit, "pruned_layers": layers, "spans": len(chosen), "seconds": med,
                     "runs": times, "ratio": med["guarded"] / med["lra"], "chosen": chosen})
        print(rows[-1], flush=True)
    doc = {"command": "python benchmarks/guard_cost.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
           "model": a.model, "machine": C.machine(torch.device("cpu")), "rows": rows}
    write_json_atomic(a.out + ".json", doc)
    md = [f"# The KL guard's calibration cost: {a.model}", "", f"`{doc['command']}` (medians of {a.repeats}; "
          "64 × 512 calibration tokens; 1 thread)", "",
          "| criterion | spans | LRA s | guarded s | guarded ÷ LRA | chosen per span |", "|---|---:|---:|---:|---:|---|"]
    for r in rows:
        md.append(f"| {r['criterion']} | {r['spans']} | {r['seconds']['lra']:.1f} | {r['seconds']['guarded']:.1f} | "
                  f"{r['ratio']:.2f} | {', '.join(r['chosen'])} |")
    write_text_atomic(a.out + ".md", "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
