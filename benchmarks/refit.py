"""What the kept-block re-fit (``--calibration.refit.kept``) costs, against the calibration it follows.

On a real model and real calibration text: the selection (``--criterion``), then, timed, the calibration of
``--solver`` (``independent``, the recipe's settings), then the guarded re-fit of the first ``--refit_kept`` kept
blocks after each span (:func:`shift_lightning.maps.keptfit.guarded_refit`: fitted on 3 of every 4 windows, judged by the
held-out KL on the 4th, the kept ones refitted on all), timed, with the number of block calls each makes (a call:
one block on one batch, whole or as far as a group's taps) and one bare forward of the original on the same windows
as the unit.

``--compare PATH``: the same measurement with the ``shift_lightning`` of another checkout (e.g. a worktree of an
earlier commit), in a subprocess, alternating with this one ``--repeats`` times: the ratio of the two in one run.

    python benchmarks/refit.py --model smollm2-135m --criterion angular --solver stock --refit_kept 2 \\
        --samples 32 --seq_len 256 --out results/bench/refit_cost_smollm2-135m.json

Writes the JSON (``--out``) and prints a markdown table.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import time

if os.environ.get("SHIFT_BENCH_TREE"):  # measure another checkout's package: bound before bench_common binds ours
    sys.path.insert(0, os.environ["SHIFT_BENCH_TREE"])
    import shift_lightning  # noqa: F401

import bench_common as C  # noqa: E402
import torch  # noqa: E402


def measure(a) -> dict:
    """One measurement with the ``shift_lightning`` this process imports."""
    import lightning as L

    import shift_lightning
    from shift_lightning.arch import decoder_layers
    from shift_lightning.calibration import CalibrationConfig, CalibrationModule
    from shift_lightning.criteria import PruneConfig
    from shift_lightning.selection import select_blocks
    try:
        from shift_lightning.maps.keptfit import guarded_refit, refit_pairs
        from shift_lightning.maps.surgery import apply_maps, remove_blocks
    except ImportError:  # a checkout from before the map's modules moved to shift_lightning.maps
        from shift_lightning.keptfit import guarded_refit, refit_pairs
        from shift_lightning.surgery import apply_maps, remove_blocks

    torch.manual_seed(0)
    dev = C.pick_device("cpu")
    model, tok = C.build_model(a.model, dev)
    win = C.windows(model, tok, a.samples, a.seq_len)

    def trainer():
        return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, inference_mode=False,
                         use_distributed_sampler=False)

    n = len(decoder_layers(model))
    sel = select_blocks(PruneConfig(criterion=a.criterion, ratio=a.ratio, batch_size=a.batch_size), model, win, trainer)
    t0 = time.perf_counter()
    with torch.no_grad():
        for b in range(0, len(win), a.batch_size):
            model(input_ids=win.input_ids[b:b + a.batch_size], attention_mask=win.attention_mask[b:b + a.batch_size])
    forward = time.perf_counter() - t0
    cfg = CalibrationConfig(solver=a.solver, damping=a.damping)
    t0 = time.perf_counter()
    mod = CalibrationModule(model, sel.layers, cfg, keep_statistics=False)
    mod.calibrate(trainer(), win, None, batch_size=a.batch_size)
    correction = mod.fitted_maps()
    calibration = time.perf_counter() - t0
    del mod
    original = copy.deepcopy(model)
    remove_blocks(model, sel.layers)
    apply_maps(model, correction, n, sel.layers)
    calls = {"pruned": 0, "original": 0}

    def counted(blk, k):  # counts calls without a hook (the re-fit shares a hook-free block prefix of both models)
        def forward(*args, **kwargs):
            calls[k] += 1
            return type(blk).forward(blk, *args, **kwargs)
        return forward

    for k, m in (("pruned", model), ("original", original)):
        for blk in decoder_layers(m):
            blk.forward = counted(blk, k)
    pairs = refit_pairs(sel.layers, n, a.refit_kept)
    t0 = time.perf_counter()
    res = guarded_refit(model, original, win, pairs, a.refit_damping, 4, 64, device=None) \
        if "device" in guarded_refit.__code__.co_varnames else guarded_refit(model, original, win, pairs,
                                                                             a.refit_damping, 4, 64)
    refit = time.perf_counter() - t0
    for m in (model, original):
        for blk in decoder_layers(m):
            del blk.forward
    return {"shift_lightning": shift_lightning.__file__, "pruned_layers": sel.layers,
            "refit_blocks": [o for _, o in pairs], "kept": res["kept"], "heldout_kl": res["heldout_kl"],
            "seconds": {"forward": forward, "calibration": calibration, "refit": refit},
            "refit_over_calibration": refit / calibration, "refit_over_forward": refit / forward,
            "block_calls": calls, "batches": -(-len(win) // a.batch_size), "blocks": n}


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--criterion", default="angular")
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--solver", default="stock")
    ap.add_argument("--damping", type=float, default=1e-4)
    ap.add_argument("--refit_kept", type=int, default=2)
    ap.add_argument("--refit_damping", type=float, default=0.1)
    ap.add_argument("--samples", type=int, default=32)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--compare", default=None, help="another checkout whose shift_lightning is measured alongside")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--out", default=None)
    return ap.parse_args(argv)


def _child(a, tree: str | None) -> dict:
    """One measurement in a fresh process (``tree``: the checkout whose package it imports; None: this one)."""
    argv = [sys.executable, os.path.abspath(__file__), "--child"] + [
        x for k, v in vars(a).items() if k not in ("child", "out", "compare", "repeats") for x in (f"--{k}", str(v))]
    env = dict(os.environ)
    if tree is not None:
        env["SHIFT_BENCH_TREE"] = os.path.abspath(tree)
    r = subprocess.run(argv, env=env, capture_output=True, text=True, check=False)
    if r.returncode != 0:
        raise SystemExit(f"measurement failed ({tree or 'this checkout'}):\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main(argv=None):
    a = parse(argv)
    if a.child:
        print(json.dumps(measure(a)))
        return
    runs: dict[str, list[dict]] = {"this": [], **({"compare": []} if a.compare else {})}
    for _ in range(a.repeats):
        runs["this"].append(_child(a, None))
        if a.compare:
            runs["compare"].append(_child(a, a.compare))
    rows = []
    for name, rs in runs.items():
        best = min(rs, key=lambda r: r["seconds"]["refit"])
        rows.append([name, best["shift_lightning"].rsplit("/shift_lightning", 1)[0], f"{best['seconds']['forward']:.1f}",
                     f"{best['seconds']['calibration']:.1f}", f"{best['seconds']['refit']:.1f}",
                     f"{best['refit_over_calibration']:.2f}", f"{best['refit_over_forward']:.1f}",
                     f"{best['block_calls']['pruned']} + {best['block_calls']['original']}", best["kept"]])
    table = C.md_table(["code", "checkout", "forward s", "calibration s", "re-fit s", "re-fit ÷ calibration",
                        "re-fit ÷ forward", "block calls (pruned + original)", "kept"], rows)
    if a.compare:
        t, c = (min(r["seconds"]["refit"] for r in runs[k]) for k in ("this", "compare"))
        table += f"\n\nre-fit seconds, this ÷ compare: {t / c:.3f}"
    print(table)
    doc = {"benchmark": "refit", "command": "python benchmarks/refit.py " + " ".join(sys.argv[1:]),
           "machine": C.machine(torch.device("cpu")), "settings": {k: v for k, v in vars(a).items() if k != "child"},
           "runs": runs, "table": table}
    if a.out:
        C.write_json(a.out, doc)


if __name__ == "__main__":
    main()
