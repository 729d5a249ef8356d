"""What the repairs cost to calibrate: time with each ``--calibration.solver`` against the plain LRA.

    python experiments/checks/guard_cost.py --model smollm2-135m --solvers lra,lra_span,guarded --out results/bench/guard_cost_smollm2

Per criterion (the paper grid's 25 % blocks), the same 64 × 512 calibration windows, one thread, the
solvers timed in alternation (``--repeats`` each; medians): the LRA's one statistics pass + solve, the
span LRA's (the same pass, one fit per contiguous span), and a guard's (the pass with held-out copies,
the candidates' solves, the judge pass over the held-out windows: one original forward and, per span,
one run per candidate from the block before the span, then the refit; ``lra_auto``: its distinct fits on
the non-held-out windows, one judge pass, the refit). Also reports what a guard or ``lra_auto`` chose.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import _common as C

import torch  # noqa: E402

from shift_lightning.calibration import CalibrationConfig, CalibrationModule  # noqa: E402
from experiments import variants  # noqa: E402
from shift_lightning.maps.sites import make_sites  # noqa: E402
from shift_lightning.criteria import PruneConfig  # noqa: E402
from shift_lightning.data import TextDataConfig, build_windows  # noqa: E402
from shift_lightning.outputs import write_json_atomic, write_text_atomic  # noqa: E402
from shift_lightning.selection import select_blocks  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--criteria", default="reverse_star,angular,taylor")
    ap.add_argument("--solvers", default="lra,guarded", help="comma-separated; the first is the reference")
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
    rows, solvers = [], a.solvers.split(",")
    for crit in a.criteria.split(","):
        windows = calib if crit == "linear_fit" else select
        layers = select_blocks(PruneConfig(ratio=0.25, criterion=crit), model, windows, lambda: trainer).layers
        times = {s: [] for s in solvers}
        chosen = {}
        for _ in range(a.repeats):
            for solver in solvers:
                m = copy.deepcopy(model)
                t0 = time.perf_counter()
                mode = variants.mode_of(solver)  # lra_anchored, lra_auto: their own mode
                mod = CalibrationModule(m, layers, CalibrationConfig(mode=mode, heldout=False),
                                        solvers=variants.knobs([solver]))
                mod.calibrate(trainer, calib, batch_size=4)
                times[solver].append(time.perf_counter() - t0)
                if solver.startswith("guarded"):
                    chosen[solver] = [mod.reports[s.key]["guards"][solver]["chosen"] for s in mod.spans]
                if mod.fit_choice is not None:
                    chosen[solver] = [mod.fit_choice["chosen"]]
        med = {k: statistics.median(v) for k, v in times.items()}
        rows.append({"criterion": crit, "pruned_layers": layers, "spans": len(make_sites(layers, "span")),
                     "seconds": med, "runs": times, "ratio": {k: med[k] / med[solvers[0]] for k in solvers[1:]},
                     "chosen": chosen})
        print(rows[-1], flush=True)
    doc = {"command": "python experiments/checks/guard_cost.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
           "model": a.model, "machine": C.machine(torch.device("cpu")), "rows": rows}
    write_json_atomic(a.out + ".json", doc)
    ref, rest = solvers[0], solvers[1:]
    md = [f"# Calibration cost of each repair: {a.model}", "", f"`{doc['command']}` (medians of {a.repeats}; "
          "64 × 512 calibration tokens; 1 thread)", "",
          "| criterion | spans | " + " | ".join(f"{s} s" for s in solvers) + " | "
          + " | ".join(f"{s} ÷ {ref}" for s in rest) + " | chosen per span |",
          "|---|---:|" + "---:|" * (len(solvers) + len(rest)) + "---|"]
    for r in rows:
        md.append(f"| {r['criterion']} | {r['spans']} | " + " | ".join(f"{r['seconds'][s]:.1f}" for s in solvers) + " | "
                  + " | ".join(f"{r['ratio'][s]:.2f}" for s in rest) + " | "
                  + ("; ".join(f"{g}: {', '.join(c)}" for g, c in r["chosen"].items()) or "–") + " |")
    write_text_atomic(a.out + ".md", "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
