"""Past a map at the pruning site: re-fit the kept blocks after it in closed form (no gradients).

    python experiments/checks/refit_check.py --model smollm2-135m --criteria ppl --evaluate
    python experiments/checks/refit_check.py --model smollm2-135m --criteria taylor,random,magnitude_l1 --ks 1,2 --dampings 1e-2,1e-1
    python experiments/checks/refit_check.py --out results/bench/refit_smollm2-135m --render_only  # .md from the JSON

Every map the repo fits sits at the pruning site: a function of the state there, which the kept blocks after it
then process as if nothing had changed. The richer-maps check found that richer features gain at most 14 % and
that re-anchoring the stream with more LRAs stops helping after two blocks. This check asks what the *kept
blocks* can absorb: after the default correction (the joint map, ``lra_replaceme``), the first ``k`` kept blocks
after each removed span are re-fitted layer group by layer group, each layer by one ridge regression towards its
own weights whose target is the original's output plus the stream's drift (:mod:`shift_lightning.maps.keptfit`, what
``--calibration.refit.kept k --calibration.refit.damping δ`` runs). Gemma3's blocks add their branches through
norms; the check fits them with the target's direction (``post_norm="direction"``), which the library refuses
by default because of what this check measured.

One selection of the mixed grid (``results/paper_mixed/<model>/<criterion>/selection.json``, or ``--layers``);
the grid's 64 × 512 mixed calibration windows. Held-out check: the map and the re-fit fitted on 48, judged on the
16 held out (every 4th; no evaluated doc) by KL(original ‖ model) (the original's top-256, as the grids) and
top-1 agreement, for each ``k`` and ``δ`` asked for. ``--evaluate``: the setting closest on the held-out windows
(``k`` and ``δ`` chosen there, never on evaluated docs) is re-fitted on all 64 windows, on top of the grid's own
joint map, and scored as the grid scores a row (perplexity, KL / top-1 on every held-out set, the zero-shot
tasks); Robust and Avg against the original, the grid's pruned row and its ``lra_replaceme`` row, paired
bootstrap. Parameters are unchanged (the re-fitted layers replace the originals). ``--samples N`` (another
``--out``): the held-out check on N mixed windows (3N/4 fitted, N/4 judged); ``--evaluate`` then keeps the grid's
map (its 64 windows) and re-fits on N. ``--guarded``: the main job's per-block check inside the fit windows.
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from dataclasses import replace
from pathlib import Path

import _common as C
from anchored_check import closeness

import torch

from shift_lightning.arch import decoder_layers
from shift_lightning.maps.keptfit import Walk, guarded_refit, refit_kept, refit_pairs  # noqa: F401 (Walk: the tests)
from shift_lightning.outputs import write_json_atomic, write_text_atomic

def corrected_copy(model, layers: list[int], windows, damping: float, make_trainer):
    """A deep copy of ``model``, pruned of ``layers`` and corrected by the default joint map fitted on ``windows``."""
    from shift_lightning.calibration import CalibrationConfig, CalibrationModule
    from shift_lightning.maps.surgery import apply_maps, remove_blocks

    m = copy.deepcopy(model)
    module = CalibrationModule(m, layers, CalibrationConfig(damping=damping), solvers=["lra_replaceme"])
    module.calibrate(make_trainer(), windows, None, batch_size=4)
    n = len(decoder_layers(m))
    remove_blocks(m, layers)
    apply_maps(m, module.fitted_maps("lra_replaceme"), n, layers)
    return m


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--criteria", default="ppl")
    ap.add_argument("--grid", default="results/paper_mixed")
    ap.add_argument("--layers", default=None, help="removed blocks, comma-separated (default: each criterion's "
                    "selection in --grid)")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--ks", default="1,2", help="kept blocks re-fitted after each span")
    ap.add_argument("--dampings", default="1e-3,1e-2,1e-1")
    ap.add_argument("--map_damping", type=float, default=1e-4, help="the joint map's (the grid's)")
    ap.add_argument("--guarded", action="store_true", help="the main job's do-no-harm check: each block's re-fit "
                    "kept only if closer on a held-out quarter of the fit windows (--calibration.refit.kept)")
    ap.add_argument("--evaluate", action="store_true", help="score the held-out choice as the grid scores a row")
    ap.add_argument("--out", default=None)
    ap.add_argument("--render_only", action="store_true", help="rewrite the markdown from the JSON")
    a = ap.parse_args(argv)
    out = Path(a.out or f"results/bench/refit_{a.model.replace(':', '_')}")
    if a.render_only:
        render(json.loads(out.with_suffix(".json").read_text()), out)
        return
    import lightning as L

    model, tok = C.build_model(a.model, torch.device("cpu"))
    n = len(decoder_layers(model))
    fit, judge, refs = C.heldout_split(model, tok, a.samples, a.seq_len)
    doc = json.loads(out.with_suffix(".json").read_text()) if out.with_suffix(".json").exists() else {"rows": []}
    cmd = "python experiments/checks/refit_check.py " + " ".join(
        f"--{k} {v}" for k, v in vars(a).items() if v not in (None, False, True)) + \
        "".join(f" --{k}" for k, v in vars(a).items() if v is True)
    doc["commands"] = [c for c in doc.get("commands", [doc["command"]] if "command" in doc else []) if c != cmd] + [cmd]
    doc.update({"command": cmd, "model": a.model, "machine": C.machine(torch.device("cpu")), "fit_windows": len(fit),
        "judge_windows": len(judge)})
    done = {(r["criterion"], r["k"], r["damping"], r.get("guarded", False)) for r in doc["rows"]}

    def trainer():
        return L.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, inference_mode=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)

    def land(row):
        doc["rows"].append(row)
        print(row, flush=True)
        write_json_atomic(str(out.with_suffix(".json")), doc)

    for crit in a.criteria.split(","):
        if a.layers:
            layers = sorted(int(v) for v in a.layers.split(","))
        else:
            layers = sorted(json.loads((Path(a.grid) / a.model / crit / "selection.json").read_text())["layers"])
        base = None
        if not refit_pairs(layers, n, 1):
            print(f"{crit}: {layers} leave no kept block after a removed span: nothing to re-fit", flush=True)
            continue
        for k in (int(v) for v in a.ks.split(",")):
            pairs = refit_pairs(layers, n, k)
            for damp in (float(v) for v in a.dampings.split(",")):
                if (crit, k, damp, a.guarded) in done:
                    continue
                if base is None:
                    base = corrected_copy(model, layers, fit, a.map_damping, trainer)
                    if (crit, 0, None, False) not in done:
                        kl, top1 = closeness(base, judge, refs)
                        land({"criterion": crit, "layers": layers, "k": 0, "damping": None, "refitted": [],
                              "kl": kl, "top1": top1, "seconds": 0.0})
                t0 = time.perf_counter()
                m = copy.deepcopy(base)
                if a.guarded:  # what the main job runs: its own held-out split inside the fit windows
                    refitted = guarded_refit(m, model, fit, pairs, damp)["kept"]
                else:
                    refit_kept(m, model, fit, pairs, damp, post_norm="direction")
                    refitted = [o for _, o in pairs]
                kl, top1 = closeness(m, judge, refs)
                land({"criterion": crit, "layers": layers, "k": k, "damping": damp, "refitted": refitted,
                      **({"guarded": True, "tried": [o for _, o in pairs]} if a.guarded else {}),
                      "kl": kl, "top1": top1, "seconds": time.perf_counter() - t0})
                del m
        if a.evaluate:
            evaluate(a, crit, layers, doc, land, trainer, n)
    render(doc, out)


def evaluate(a, crit: str, layers: list[int], doc: dict, land, trainer, n: int) -> None:
    """Score the held-out choice (re-fitted on all ``--samples`` windows, on the grid's joint map) as the grid scores
    a row."""
    from experiments.summary import Bootstrap
    from experiments import harness
    from experiments.reproduce import ReproduceConfig, eval_config

    tried = [r for r in doc["rows"] if r["criterion"] == crit and not r.get("evaluated") and r["k"] > 0]
    best = min(tried, key=lambda r: r["kl"])
    key = lambda r: (r["criterion"], r["k"], r["damping"], r.get("guarded", False))  # noqa: E731
    if any(r.get("evaluated") and key(r) == key(best) for r in doc["rows"]):
        return  # this choice is scored already (an earlier choice, from fewer settings, stays in the table)
    grid = Path(a.grid) / a.model
    cfg = replace(ReproduceConfig(model=a.model, calib_source="mixed"),
                  **{k: v for k, v in json.loads((grid / crit / "lra_replaceme.json").read_text())["config"].items()
                     if k in ("text_source", "calib_samples", "seq_len", "heldout_samples", "damping", "docs",
                              "sample_seed", "ppl_windows", "kl", "kl_docs", "kl_topk", "n_boot")})
    ctx = harness.open_grid(cfg.model, None, "cpu", lambda v, d: eval_config(cfg, v, d), {}, cfg.text_source)
    t0 = time.perf_counter()
    calib = ctx.windows(cfg.calib_samples, cfg.seq_len, source=cfg.calib_source)
    m = corrected_copy(ctx.model, layers, calib, cfg.damping, trainer)  # the grid's map, on the grid's windows
    # the re-fit on as many windows as the held-out check had (the grid's 64 by default)
    more = calib if a.samples == cfg.calib_samples else ctx.windows(a.samples, cfg.seq_len, source=cfg.calib_source)
    pairs = refit_pairs(layers, n, best["k"])
    if best.get("guarded"):  # the guard's choice made again, as the main job makes it, on all the windows
        refitted = guarded_refit(m, ctx.model, more, pairs, best["damping"])["kept"]
    else:
        refit_kept(m, ctx.model, more, pairs, best["damping"], post_norm="direction")
        refitted = [o for _, o in pairs]
    fit_s = time.perf_counter() - t0
    res = ctx.evaluate(m, tasks=True)
    row = {"criterion": crit, "layers": layers, "k": best["k"], "damping": best["damping"], "evaluated": True,
           "refitted": refitted, **({"guarded": True} if best.get("guarded") else {}), "refit_windows": len(more),
           **harness.row_doc(res), "seconds": {"map_and_refit": fit_s, "evaluation": time.perf_counter() - t0 - fit_s}}
    write_json_atomic(str(Path(a.out or f"results/bench/refit_{a.model}").with_name(
        f"refit_{a.model}_{crit}_k{best['k']}_d{best['damping']:g}{'_guarded' if best.get('guarded') else ''}"
        f"{'_w%d' % len(more) if more is not calib else ''}_row.json")), row)  # kept before anything can fail
    joint = json.loads((grid / crit / "lra_replaceme.json").read_text())
    pruned_dir = Path(joint["config"].get("pruned_from") or a.grid) / a.model
    rows = {"original": json.loads((grid / "original.json").read_text()), "lra_replaceme": joint,
            "pruned": json.loads(((pruned_dir if (pruned_dir / crit / "pruned.json").exists() else grid) / crit /
                                  "pruned.json").read_text()), "refit": row}
    bs = Bootstrap(rows, "original", n_boot=cfg.n_boot)
    row["summary"] = {name: bs.summary(name) for name in ("pruned", "lra_replaceme", "refit")}
    row["vs_lra_replaceme"] = bs.difference("refit", "lra_replaceme")
    row["vs_pruned"] = bs.difference("refit", "pruned")
    row["grid_kl"] = {name: rows[name]["kl"] for name in ("pruned", "lra_replaceme")}
    land(row)


def _refit_label(r: dict) -> str:
    """An evaluated re-fit's row name: its setting, the guard's choice, and its windows when not the grid's 64."""
    parts = [f"k = {r['k']}", f"δ = {r['damping']:g}"]
    if r.get("guarded"):
        parts.append(f"guarded: {r['refitted']}")
    if r.get("refit_windows", 64) != 64:
        parts.append(f"{r['refit_windows']} windows")
    return f"joint map + re-fit ({', '.join(parts)})"


def render(doc: dict, out: Path) -> None:
    md = [f"# Re-fitting the kept blocks after the joint map: {doc['model']}", "",
          *[f"`{c}`  " for c in doc.get("commands", [doc["command"]])], "",
          f"Held-out check: map and re-fit fitted on {doc['fit_windows']} mixed calibration windows, judged on the "
          f"{doc['judge_windows']} held out (every 4th; no evaluated doc). k = 0: the joint map alone; a k beyond the "
          "blocks after a span re-fits all of them; guarded: the main job's check (each block's re-fit kept only if "
          f"closer on a held-out quarter of the {doc['fit_windows']} fit windows).", "",
          "| criterion | k | δ | re-fitted blocks | held-out KL | vs joint map | top-1 % | seconds |",
          "|---|---:|---:|---|---:|---:|---:|---:|"]
    base = {r["criterion"]: r["kl"] for r in doc["rows"] if r["k"] == 0 and not r.get("evaluated")}
    for r in doc["rows"]:
        if r.get("evaluated"):
            continue
        d = "–" if r["damping"] is None else f"{r['damping']:g}"
        blocks = (f"{r['refitted'] or 'none'} kept of {r['tried']}" if r.get("guarded") else r["refitted"]) or "–"
        kk = f"{r['k']} (guarded)" if r.get("guarded") else r["k"]
        md.append(f"| {r['criterion']} | {kk} | {d} | {blocks} | {r['kl']:.4f} | "
                  f"{r['kl'] / base[r['criterion']] - 1:+.1%} | {100 * r['top1']:.1f} | {r['seconds']:.0f} |")
    ev = [r for r in doc["rows"] if r.get("evaluated")]
    if ev:
        sets = list(ev[0]["kl"])
        wins = sorted({r.get("refit_windows", 64) for r in ev})
        md += ["", f"Evaluated as the grid scores a row (the held-out choice re-fitted on all {'/'.join(map(str, wins))} "
               "windows on top of the grid's joint map, fitted on its 64; Robust / Avg with 95 % paired-bootstrap "
               "intervals):", "",
               "| criterion | row | " + " | ".join(f"KL {s}" for s in sets) + " | Robust | Avg |",
               "|---|---|" + "---:|" * (len(sets) + 2)]
        for r in ev:
            for name in ("pruned", "lra_replaceme", "refit"):
                kl = r["kl"] if name == "refit" else r["grid_kl"][name]
                s = r["summary"][name]
                label = name if name != "refit" else _refit_label(r)
                md.append(f"| {r['criterion']} | {label} | " + " | ".join(f"{kl[x]:.3f}" for x in sets) +
                          f" | {100 * s['robust']:.1f} [{100 * s['robust_ci'][0]:.1f}, {100 * s['robust_ci'][1]:.1f}]"
                          f" | {100 * s['avg']:.2f} |")
            dv = r["vs_lra_replaceme"]
            md.append(f"| {r['criterion']} | re-fit − joint map | | | | {100 * dv['robust_diff']:+.1f} "
                      f"[{100 * dv['robust_diff_ci'][0]:+.1f}, {100 * dv['robust_diff_ci'][1]:+.1f}] | "
                      f"{100 * dv['avg_diff']:+.2f} [{100 * dv['avg_diff_ci'][0]:+.2f}, {100 * dv['avg_diff_ci'][1]:+.2f}] |")
    write_text_atomic(str(out.with_suffix(".md")), "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
