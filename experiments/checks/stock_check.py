"""Which stock repair (maps folded into existing weights): chosen on held-out calibration windows, never on evaluated docs.

    python experiments/checks/stock_check.py --model smollm2-135m --criteria angular,reverse_star,magnitude_l1,taylor
    python experiments/checks/stock_check.py --model smollm2-135m --criteria ppl,magnitude_l2 --rows stock,stock+refit2

The stock options (:mod:`shift_lightning.maps.solvers.stock`): ReplaceMe's ``m ↦ m T`` folded into the
``down_proj`` before each span; the stock solver's ridge re-fit of that ``down_proj`` on its ``d_ff``-wide input
(no intercept); each followed by the kept-block re-fit of the first ``k`` kept blocks (``--calibration.refit.kept
k``, damping 0.1, unguarded here: the check itself is the guard). Beside them, for the price of stock: the paper's
per-block ``lra`` and the default ``lra_replaceme``. Rows ``stock_bias`` were measured with the first version of
the solver (commit 7bd0c1e), whose fit had an intercept held in Llama's ``mlp_bias``: it lost (see the table), was
retired, and this script no longer makes those rows.

One selection of the mixed grid per criterion (``results/paper_mixed/<model>/<criterion>/selection.json``); the
grid's 64 × 512 mixed calibration windows, every 4th held out: every map fitted on 48, judged on the 16 held out by
KL(original ‖ model) over the original's top-256 and top-1 agreement. Rows land in ``--out`` (JSON + table) as
each finishes; a rerun skips the rows it has.
"""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import _common as C
from anchored_check import closeness

import torch

from shift_lightning.arch import decoder_layers
from shift_lightning.maps.keptfit import refit_kept, refit_pairs
from shift_lightning.outputs import write_json_atomic, write_text_atomic

#: row -> (variant fitted by the calibration, kept blocks re-fitted after each span)
ROWS = {"replaceme": ("replaceme", 0), "stock": ("stock", 0), "replaceme+refit2": ("replaceme", 2),
        "stock+refit2": ("stock", 2), "lra": ("lra", 0), "lra_replaceme": ("lra_replaceme", 0)}
#: Rows in the table: those this script makes, and the retired intercept fit's (results kept).
SHOWN = ("replaceme", "stock", "stock_bias", "replaceme+refit2", "stock+refit2", "lra", "lra_replaceme")
STOCK = ("replaceme", "stock", "stock_bias", "replaceme+refit2", "stock+refit2")


def render(doc: dict, out: Path) -> None:
    crits = sorted({r["criterion"] for r in doc["rows"]})
    by = {(r["criterion"], r["row"]): r for r in doc["rows"]}
    lines = [f"# Stock repairs on held-out calibration windows: {doc['model']}", "",
             f"`{doc['command']}`", "",
             f"KL(original ‖ model) in nats/token (top-1 agreement in brackets) on {doc['judge_windows']} held-out mixed "
             f"calibration windows (fitted on {doc['fit_windows']}). Stock rows fold into the weights; `lra` and "
             "`lra_replaceme` need `trust_remote_code`. **Bold**: the closest stock row per criterion.", "",
             "| row | " + " | ".join(crits) + " |", "|---|" + "---|" * len(crits)]
    best = {c: min((by[(c, r)]["kl"], r) for r in STOCK if (c, r) in by)[1] for c in crits
            if any((c, r) in by for r in STOCK)}
    for row in (r for r in SHOWN if any((c, r) in by for c in crits)):
        cells = []
        for c in crits:
            r = by.get((c, row))
            cell = "–" if r is None else f"{r['kl']:.3f} ({100 * r['top1']:.1f})"
            cells.append(f"**{cell}**" if best.get(c) == row else cell)
        lines.append(f"| {row} | " + " | ".join(cells) + " |")
    wins = {r: sum(best.get(c) == r for c in crits) for r in STOCK}
    lines += ["", "Closest stock row per criterion: " + ", ".join(f"{r} {n}" for r, n in wins.items() if n) + "."]
    write_text_atomic(str(out.with_suffix(".md")), "\n".join(lines) + "\n")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--criteria", default="angular,reverse_star,magnitude_l1,taylor")
    ap.add_argument("--grid", default="results/paper_mixed")
    ap.add_argument("--damping", type=float, default=1e-4, help="the maps' relative damping (the grid's)")
    ap.add_argument("--refit_damping", type=float, default=0.1)
    ap.add_argument("--rows", default=",".join(ROWS), help="which rows (comma-separated; default all)")
    ap.add_argument("--out", default=None)
    ap.add_argument("--render_only", action="store_true")
    a = ap.parse_args(argv)
    out = Path(a.out or f"results/bench/stock_{a.model.replace(':', '_')}")
    if a.render_only:
        render(json.loads(out.with_suffix(".json").read_text()), out)
        return
    import lightning as L

    from shift_lightning.calibration import CalibrationConfig, CalibrationModule
    from shift_lightning.maps.surgery import apply_maps, remove_blocks

    model, tok = C.build_model(a.model, torch.device("cpu"))
    n = len(decoder_layers(model))
    fit, judge, refs = C.heldout_split(model, tok, 64, 512)
    cmd = "python experiments/checks/stock_check.py " + " ".join(
        f"--{k} {v}" for k, v in vars(a).items() if v not in (None, False, True) and k != "rows")
    path = out.with_suffix(".json")
    doc = json.loads(path.read_text()) if path.exists() else {"rows": []}
    doc.update({"command": cmd, "model": a.model, "machine": C.machine(torch.device("cpu")),
                "fit_windows": len(fit), "judge_windows": len(judge), "damping": a.damping,
                "refit_damping": a.refit_damping})
    done = {(r["criterion"], r["row"]) for r in doc["rows"]}
    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, inference_mode=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    for crit in a.criteria.split(","):
        todo = [r for r in a.rows.split(",") if (crit, r) not in done]
        if not todo:
            continue
        layers = sorted(json.loads((Path(a.grid) / a.model / crit / "selection.json").read_text())["layers"])
        variants = sorted({ROWS[r][0] for r in todo})
        module = CalibrationModule(model, layers, CalibrationConfig(damping=a.damping), solvers=variants)
        module.calibrate(trainer, fit, None, batch_size=4)
        for row in todo:
            variant, k = ROWS[row]
            m = copy.deepcopy(model)
            remove_blocks(m, layers)
            apply_maps(m, module.fitted_maps(variant), n, layers)
            pairs = refit_pairs(layers, n, k) if k else []
            if pairs:
                refit_kept(m, model, fit, pairs, a.refit_damping)
            kl, top1 = closeness(m, judge, refs)
            rec = {"criterion": crit, "row": row, "layers": layers, "kl": kl, "top1": top1,
                   "refit_blocks": [o for _, o in pairs], "params": sum(p.numel() for p in m.parameters())}
            doc["rows"].append(rec)
            print(rec, flush=True)
            write_json_atomic(str(path), doc)
            render(doc, out)
            del m


if __name__ == "__main__":
    main()
