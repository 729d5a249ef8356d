"""Which calibration mode keeps the pruned model closest to the original, judged on held-out windows
of the calibration text (never on the evaluated sets).

    python experiments/checks/anchored_check.py --model smollm2-135m --criteria taylor,magnitude_l2 --out results/bench/anchored_check_smollm2

The paper grid's 25 % blocks per criterion (``results/paper/<model>/<criterion>/selection.json``);
the 64 × 512 ``mixed`` calibration windows of the grid, every 4th held out (16, the guard's split)
and the other 48 fitted. Per ``--calibration.mode`` (``independent``: every site on the original's
states; ``sequential``: on the corrected pruned model's states, target the removed blocks run on
them; ``anchored``: on those states, target the original's state at the site's end) and granularity,
the mean next-token KL(original ‖ model) and top-1 agreement on the held-out windows (the original's
top-256, as the grids), plus the calibration seconds. Modes differ only where a site has an earlier
site before it: one-span selections (reverse_star, angular) are left out by default.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import _common as C

import torch  # noqa: E402

from shift_lightning.calibration import CalibrationConfig, CalibrationModule  # noqa: E402
from shift_lightning.maps.sites import make_sites  # noqa: E402
from shift_lightning.data import TextDataConfig, TokenWindows, build_windows  # noqa: E402
from shift_lightning.closeness import window_closeness, window_references  # noqa: E402
from shift_lightning.outputs import write_json_atomic, write_text_atomic  # noqa: E402
from experiments.tables.common import blocks_label  # noqa: E402
from shift_lightning.maps.surgery import apply_maps, remove_blocks  # noqa: E402


@torch.no_grad()
def closeness(model, windows: TokenWindows, refs: dict, batch_size: int = 4) -> tuple[float, float]:
    """Mean KL(original ‖ model) and top-1 agreement over every real position of ``windows``."""
    return window_closeness(model, windows.input_ids, windows.attention_mask, refs, batch_size)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--criteria", default="taylor,magnitude_l2,ppl")
    ap.add_argument("--modes", default="independent,sequential,anchored")
    ap.add_argument("--granularity", default="span", help="span, block or both (comma-separated)")
    ap.add_argument("--grid", default="results/paper", help="where the criteria's block choices are")
    ap.add_argument("--solver", default="lra", help="a solver that walks: lra (the LRA family) or lra_replaceme")
    ap.add_argument("--out", default="results/bench/anchored_check_smollm2")
    a = ap.parse_args(argv)
    model, tok = C.build_model(a.model, torch.device("cpu"))
    mt = model.config.model_type
    win = build_windows(TextDataConfig(source="mixed", num_samples=64, seq_len=512), tok, mt)
    held = torch.arange(len(win)) % 4 == 3
    fit = TokenWindows(win.input_ids[~held], win.attention_mask[~held])
    judge = TokenWindows(win.input_ids[held], win.attention_mask[held])
    refs = window_references(model, judge.input_ids, judge.attention_mask)
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, inference_mode=False,
                        enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    out = Path(a.out)
    done = json.loads(out.with_suffix(".json").read_text())["rows"] if out.with_suffix(".json").exists() else []
    rows = list(done)
    seen = {(r["criterion"], r["granularity"], r["mode"], r.get("solver", "lra")) for r in rows}
    doc = {"command": "python experiments/checks/anchored_check.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()),
           "model": a.model, "machine": C.machine(torch.device("cpu")), "fit_windows": len(fit),
           "judge_windows": len(judge), "rows": rows}
    L_ = model.config.num_hidden_layers
    for crit in a.criteria.split(","):
        sel = json.loads((Path(a.grid) / a.model / crit / "selection.json").read_text())
        layers = sel["layers"]
        for gran in a.granularity.split(","):
            for mode in a.modes.split(","):
                if (crit, gran, mode, a.solver) in seen:
                    continue
                m = copy.deepcopy(model)
                t0 = time.perf_counter()
                mod = CalibrationModule(m, layers, CalibrationConfig(solver=a.solver, mode=mode, granularity=gran,
                                                                     heldout=False))
                mod.calibrate(trainer, fit, batch_size=4)
                secs = time.perf_counter() - t0
                remove_blocks(m, layers)
                apply_maps(m, mod.fitted_maps(), L_, layers)
                kl, top1 = closeness(m, judge, refs)
                rows.append({"criterion": crit, "pruned_layers": layers, "spans": len(make_sites(layers, "span")),
                             "granularity": gran, "mode": mode, "solver": a.solver, "kl": kl, "top1": top1, "seconds": secs})
                print(rows[-1], flush=True)
                doc["rows"] = rows
                write_json_atomic(str(out.with_suffix(".json")), doc)
                del m, mod
    md = [f"# Calibration mode vs closeness on held-out calibration windows: {a.model}", "",
          f"`{doc['command']}`", "",
          f"{doc['fit_windows']} mixed windows × 512 fitted, {doc['judge_windows']} held out (every 4th); KL(original ‖ model) "
          "in nats per position (original's top-256), top-1 agreement; calibration seconds (one process, shared cores).", "",
          "| criterion | removed | spans | solver | granularity | mode | KL | top-1 % | seconds |",
          "|---|---|---:|---|---|---|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['criterion']} | {blocks_label(r['pruned_layers'])} | "
                  f"{r['spans']} | {r.get('solver', 'lra')} | {r['granularity']} | {r['mode']} | {r['kl']:.4f} | {100 * r['top1']:.1f} | "
                  f"{r['seconds']:.0f} |")
    write_text_atomic(str(out.with_suffix(".md")), "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
