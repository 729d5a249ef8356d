"""Low-rank adapters: the span LRA against the joint map (``lra_replaceme``) at the same adapter rank.

    python experiments/checks/low_rank_check.py --model smollm2-135m --criterion angular
    python experiments/checks/low_rank_check.py --model gemma3-270m --criterion angular

``--calibration.rank r`` makes the adapter after a span ``y = x + x V Uᵀ + b`` (``2dr + d`` parameters).
The span LRA (``lra_span``) is then the optimal rank-r ridge fit on ``x``; the joint map constrains only
its adapter half to rank r and refits ReplaceMe's branch half (folded into ``down_proj``: no parameters)
given it (:func:`shift_lightning.maps.ridge.ridge_solve`). Both are solved here from ONE statistics pass
(the real :class:`~shift_lightning.calibration.CalibrationModule`, each rank a re-solve of the same sums)
and judged like the other checks: the grid's 64 × 512 mixed calibration windows, every 4th held out,
fitted on 48 and judged on 16 by the mean next-token KL(original ‖ model) (the original's top-256, as the
grids) and top-1 agreement. No evaluated doc is read; nothing is tuned.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import _common as C
from anchored_check import closeness  # the held-out KL / top-1 of the grids' checks

import torch  # noqa: E402

from shift_lightning.calibration import CalibrationConfig, CalibrationModule  # noqa: E402
from experiments import variants  # noqa: E402
from shift_lightning.models import num_params  # noqa: E402
from shift_lightning.outputs import write_json_atomic, write_text_atomic  # noqa: E402
from shift_lightning.maps.surgery import apply_maps, remove_blocks  # noqa: E402

SOLVERS = ("lra_span", "lra_replaceme")  # grid variants (experiments/variants.py)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--criterion", default="angular")
    ap.add_argument("--layers", default=None, help="comma-separated removed blocks (default: the grid's choice)")
    ap.add_argument("--grid", default="results/paper_mixed")
    ap.add_argument("--ranks", default="8,32,64,128,256", help="adapter ranks (full rank is always added)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    model, tok = C.build_model(a.model, torch.device("cpu"))
    if a.layers:
        layers = sorted(int(v) for v in a.layers.split(","))
    else:
        layers = json.loads((Path(a.grid) / a.model / a.criterion / "selection.json").read_text())["layers"]
    fit, judge, refs = C.heldout_split(model, tok, a.samples, a.seq_len)
    d, n_layers = model.config.hidden_size, model.config.num_hidden_layers
    ranks = [int(r) for r in a.ranks.split(",") if int(r) < d] + [None]
    out = Path(a.out or f"results/bench/low_rank_{a.model.replace(':', '_')}_{a.criterion}")
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, inference_mode=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    t0 = time.perf_counter()
    base = CalibrationModule(model, layers, CalibrationConfig(heldout=False), solvers=variants.knobs(SOLVERS))
    base.calibrate(trainer, fit, batch_size=4)
    doc = {"command": "python experiments/checks/low_rank_check.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()
                                                                       if v is not None),
           "model": a.model, "pruned_layers": layers, "spans": [[s.start, s.end - 1] for s in base.spans],
           "machine": C.machine(torch.device("cpu")), "text": "mixed" if tok is not None else "random tokens",
           "fit_windows": len(fit), "judge_windows": len(judge), "statistics_seconds": time.perf_counter() - t0,
           "rows": []}
    for r in ranks:
        mod = CalibrationModule(model, layers, CalibrationConfig(heldout=False, rank=r), solvers=variants.knobs(SOLVERS))
        mod.add_statistics(base)
        mod.solve()
        for name in SOLVERS:
            m = copy.deepcopy(model)
            corr = mod.fitted_maps(name)
            remove_blocks(m, layers)
            apply_maps(m, corr, n_layers, layers)
            kl, top1 = closeness(m, judge, refs)
            doc["rows"].append({"rank": r, "solver": name, "kl": kl, "top1": top1,
                                "adapter_params": sum(num_params(x) for x in corr.adapters.values()),
                                "branch_maps": len(corr.branch_maps)})
            print(doc["rows"][-1], flush=True)
            write_json_atomic(str(out.with_suffix(".json")), doc)
            del m
    by = {(row["rank"], row["solver"]): row for row in doc["rows"]}
    md = [f"# Low-rank adapters: span LRA vs the joint map, {a.model}, {a.criterion} (blocks {layers[0]}–{layers[-1]})",
          "", f"`{doc['command']}`", "",
          f"{doc['fit_windows']} {doc['text']} calibration windows × {a.seq_len} fitted, {doc['judge_windows']} held out "
          "(every 4th; no evaluated doc), one statistics pass, each rank a re-solve. KL(original ‖ model) in nats per "
          "position (the original's top-256) and top-1 agreement on the held-out windows. Adapter parameters: "
          "2dr + d per span (the joint map's branch half is folded into a weight: no parameters).", "",
          "| adapter rank | parameters | span LRA KL | joint map KL | joint vs span | span LRA top-1 % | joint top-1 % |",
          "|---|---:|---:|---:|---:|---:|---:|"]
    for r in ranks:
        s, j = by[(r, "lra_span")], by[(r, "lra_replaceme")]
        md.append(f"| {'full' if r is None else r} | {j['adapter_params']:,} | {s['kl']:.4f} | {j['kl']:.4f} | "
                  f"{j['kl'] / s['kl'] - 1:+.1%} | {100 * s['top1']:.1f} | {100 * j['top1']:.1f} |")
    write_text_atomic(str(out.with_suffix(".md")), "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
