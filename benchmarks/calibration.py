"""What calibration costs, measured against one bare forward pass of the original model.

Sections (``--sections``, default all that apply to the device):

* ``timing``: on the same windows, in one run, interleaved: one bare forward pass of the original
  model (logits included; "forward"), the same pass stopped after the last removed block
  ("trunk"), ``independent`` calibration for each ``--accum`` scheme and ``sequential`` calibration.
  Each calibration is split into statistics accumulation (time inside ``RidgeStats.add_batch``),
  solve (inside ``ridge_solve``) and the rest (the forward pass, hooks, masking, Lightning).
  Reported as ratios to the bare forward pass.
* ``memory``: peak memory of an independent calibration as the calibration set grows (32 → 1024
  windows by default). CPU: one subprocess per size, peak RSS (``VmHWM`` of /proc/self/status,
  reset through /proc/self/clear_refs just before the calibration); CUDA: ``max_memory_allocated``.
* ``accum``: every accumulation scheme (float64, float32, tf32, bfloat16) fed the SAME activations
  of one pass: time inside ``add_batch`` and the error of G and W against float64, plus the
  excess relative residual error of each scheme's W on the calibration and held-out windows. On
  CPU, tf32 and bfloat16 reproduce the GPU's input rounding, not its speed ("emulated").
* ``ppl``: the ``ppl`` criterion replayed from cached block inputs vs L+1 full passes (same numbers).
* ``processes`` (CPU): ``calibrate.py`` in 1 process with 2 threads vs 2 processes (DDP over gloo)
  with 1 thread each; the calibration seconds of each report.

    python benchmarks/calibration.py --model smollm2-135m                      # CPU, SmolLM2-135M, 25% reverse_star
    python benchmarks/calibration.py --model random:llama3-8b --dtype bfloat16 --device cuda --seq_len 2048 ...

Writes ``results/bench/calibration_<model>_<device>.json`` (``--out``) and prints markdown tables.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import bench_common as C
import lightning as L
import torch

import shift_lightning.maps.ridge as calmod  # where the solvers take ridge_solve from (at call time)
from shift_lightning.arch import block_input, block_output, decoder_layers
from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.criteria import PruneConfig, RemovalPerplexity
from shift_lightning.selection import run_scorer, select_blocks
from shift_lightning.maps.ridge import ACCUM_SCHEMES, RidgeStats, resolve_accum, ridge_solve


def make_trainer(dev: torch.device) -> L.Trainer:
    acc, devices = ("gpu", [dev.index or 0]) if dev.type == "cuda" else ("cpu", 1)
    return L.Trainer(accelerator=acc, devices=devices, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, inference_mode=False,
                     use_distributed_sampler=False)


class _Stop(Exception):
    pass


class Split:
    """Seconds spent inside ``RidgeStats.add_batch`` and ``ridge_solve`` while patched in."""

    def __init__(self, dev):
        self.dev, self.stats, self.solve = dev, 0.0, 0.0

    @contextlib.contextmanager
    def patched(self):
        add, solve = RidgeStats.add_batch, calmod.ridge_solve
        self.stats = self.solve = 0.0

        def timed_add(stats, x, delta):
            C.sync(self.dev)
            t = time.perf_counter()
            add(stats, x, delta)
            C.sync(self.dev)
            self.stats += time.perf_counter() - t

        def timed_solve(*args, **kwargs):
            C.sync(self.dev)
            t = time.perf_counter()
            out = solve(*args, **kwargs)
            C.sync(self.dev)
            self.solve += time.perf_counter() - t
            return out

        RidgeStats.add_batch, calmod.ridge_solve = timed_add, timed_solve
        try:
            yield self
        finally:
            RidgeStats.add_batch, calmod.ridge_solve = add, solve


def batches(win, bs, dev):
    for s in range(0, len(win), bs):
        yield win.input_ids[s:s + bs].to(dev), win.attention_mask[s:s + bs].to(dev)


# ------------------------------------------------------------------------------------------------
def section_timing(model, tok, dev, removed, a) -> dict:
    full = C.windows(model, tok, a.samples, a.seq_len)
    trainer = make_trainer(dev)
    last = max(removed)
    current = {"win": full}  # warm-up runs every variant once on the first batch only

    @torch.no_grad()
    def forward():
        for ids, m in batches(current["win"], a.batch_size, dev):
            model(input_ids=ids, attention_mask=m, use_cache=False)

    def trunk():
        _bare_trunk(model, current["win"], a.batch_size, dev, last)

    splits: dict[str, list] = {}
    split = Split(dev)

    def calibration(mode, accum):
        def run():
            with split.patched():
                CalibrationModule(model, removed, CalibrationConfig(solver="lra", mode=mode, accum_dtype=accum, heldout=False)
                                  ).calibrate(trainer, current["win"], batch_size=a.batch_size)
            splits.setdefault(f"{mode}/{accum}", []).append((split.stats, split.solve))
        return run

    variants = {"forward": forward, "trunk": trunk}
    for acc in a.accum:
        variants[f"independent/{acc}"] = calibration("independent", acc)
    for acc in a.sequential_accum:
        variants[f"sequential/{acc}"] = calibration("sequential", acc)
    from shift_lightning.data import TokenWindows

    current["win"] = TokenWindows(full.input_ids[:a.batch_size], full.attention_mask[:a.batch_size])
    for fn in variants.values():
        fn()
    current["win"] = win = full
    times = C.round_robin(variants, dev, a.repeats, warmup=False)
    fwd = times["forward"]["median"]
    rows, out = [], {"tokens": win.num_tokens, "windows": len(win), "seq_len": a.seq_len,
                     "batch_size": a.batch_size, "repeats": a.repeats, "variants": {}}
    for name, t in times.items():
        entry = {"seconds": t["median"], "seconds_min": t["min"], "runs": t["runs"], "ratio_to_forward": t["median"] / fwd}
        if name in splits:
            ss = splits[name][-a.repeats:]  # the timed runs (not the warm-up)
            st = sorted(s for s, _ in ss)[len(ss) // 2]
            so = sorted(s for _, s in ss)[len(ss) // 2]
            entry.update(stats_seconds=st, solve_seconds=so, rest_seconds=t["median"] - st - so,
                         scheme=resolve_accum(name.split("/")[1], dev, next(model.parameters()).dtype))
        out["variants"][name] = entry
        rows.append([name, t["median"], t["median"] / fwd, entry.get("rest_seconds", t["median"]) / fwd,
                     entry.get("stats_seconds", 0.0) / fwd, entry.get("solve_seconds", 0.0) / fwd,
                     win.num_tokens / t["median"]])
    out["table"] = C.md_table(["pass", "seconds", "÷ forward", "forward+rest ÷ fwd", "stats ÷ fwd", "solve ÷ fwd",
                               "tokens/s"], rows)
    return out


# ------------------------------------------------------------------------------------------------
def _vm(field: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024.0  # kB -> MiB
    return float("nan")


def _bare_trunk(model, win, bs, dev, last: int) -> None:
    """The bare pass calibration rides on: the same batches, stopped after the last removed block."""
    def stop(*_):
        raise _Stop

    h = decoder_layers(model)[last].register_forward_hook(stop)
    try:
        with torch.inference_mode():
            for ids, m in batches(win, bs, dev):
                try:
                    model(input_ids=ids, attention_mask=m, use_cache=False)
                except _Stop:
                    pass
    finally:
        h.remove()


def memory_child(model, tok, dev, removed, a, n: int, bare: bool = False) -> dict:
    """One size: peak memory of an independent calibration over ``n`` windows, or (``bare``) of the
    bare trunk pass over the same windows, the baseline the statistics add to."""
    win = C.windows(model, tok, n, a.memory_seq_len)
    trainer = make_trainer(dev)
    mod = CalibrationModule(model, removed, CalibrationConfig(solver="lra", accum_dtype=a.memory_accum, heldout=False))
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev) / 2 ** 20
    else:
        Path("/proc/self/clear_refs").write_text("5")  # reset VmHWM to the current RSS
        before = _vm("VmRSS")
    t = time.perf_counter()
    if bare:
        _bare_trunk(model, win, a.batch_size, dev, max(removed))
    else:
        mod.calibrate(trainer, win, batch_size=a.batch_size)
    C.sync(dev)
    secs = time.perf_counter() - t
    peak = torch.cuda.max_memory_allocated(dev) / 2 ** 20 if dev.type == "cuda" else _vm("VmHWM")
    stats_mib = 0.0 if bare else sum(mod.statistics[s.key].io.buffer.numel() * 8 for s in mod.sites) / 2 ** 20
    return {"windows": n, "tokens": win.num_tokens, "before_mib": before, "peak_mib": peak,
            "increment_mib": peak - before, "statistics_mib": stats_mib, "seconds": secs}


def section_memory(model, tok, dev, removed, a) -> dict:
    """Peak memory vs calibration-set size, each size next to the bare trunk pass over the same
    windows: streaming statistics must add a constant (the sums), whatever the number of windows."""
    def child(n, bare):
        if dev.type == "cuda" or a.memory_inprocess:
            return memory_child(model, tok, dev, removed, a, n, bare)
        cmd = [sys.executable, __file__, *a.argv, "--memory_child", str(n)] + (["--memory_child_bare"] if bare else [])
        p = subprocess.run(cmd, capture_output=True, text=True, env=os.environ.copy())
        line = next((x for x in p.stdout.splitlines() if x.startswith("MEMORY ")), None)
        if p.returncode != 0 or line is None:
            raise SystemExit(f"memory child for {n} windows failed:\n{p.stderr[-3000:]}")
        return json.loads(line[len("MEMORY "):])

    rows, sizes = [], []
    for n in a.memory_sizes:
        r, b = child(n, False), child(n, True)
        r["bare_peak_mib"], r["over_bare_mib"] = b["peak_mib"], r["peak_mib"] - b["peak_mib"]
        sizes.append(r)
        rows.append([r["windows"], r["tokens"], r["before_mib"], r["peak_mib"], r["increment_mib"], b["peak_mib"],
                     r["over_bare_mib"], r["seconds"]])
    peaks = [r["peak_mib"] for r in sizes]
    incs = [r["increment_mib"] for r in sizes]
    over = [r["over_bare_mib"] for r in sizes]
    what = ("torch.cuda.max_memory_allocated" if dev.type == "cuda" else
            "peak RSS (VmHWM after a reset), " + ("in this process" if a.memory_inprocess else "one process per size"))
    return {"measure": what, "seq_len": a.memory_seq_len, "batch_size": a.batch_size, "sizes": sizes,
            "peak_spread": (max(peaks) - min(peaks)) / min(peaks),
            "increment_spread_mib": max(incs) - min(incs),
            "over_bare_spread_mib": max(over) - min(over),
            "statistics_mib": sizes[0]["statistics_mib"],
            "table": C.md_table(["windows", "tokens", "MiB before", "peak MiB", "peak − before",
                                 "bare trunk peak MiB", "peak − bare", "seconds"], rows)}


# ------------------------------------------------------------------------------------------------
def section_accum(model, tok, dev, removed, a) -> dict:
    """All schemes on the same activations of one pass; errors against float64."""
    blocks, d = decoder_layers(model), model.config.hidden_size
    act_dtype = next(model.parameters()).dtype
    schemes = list(ACCUM_SCHEMES)
    calib = {sc: [RidgeStats(d, f"block {i}", device=dev, accum_dtype=sc) for i in removed] for sc in schemes}
    held = [RidgeStats(d, f"block {i}", device=dev) for i in removed]
    secs = {sc: 0.0 for sc in schemes}

    def run(win, sink, timing):
        cur: dict = {}
        handles = []
        for k, i in enumerate(removed):
            handles.append(blocks[i].register_forward_pre_hook(
                lambda mod, args, kw, i=i: cur.__setitem__(i, block_input(args, kw)), with_kwargs=True))

            def post(mod, args, out, k=k, i=i):
                x = cur[i][mask]
                delta = (block_output(out) - cur[i])[mask]
                for sc, stats in sink.items():
                    C.sync(dev)
                    t = time.perf_counter()
                    stats[k].add_batch(x, delta)
                    C.sync(dev)
                    if timing:
                        secs[sc] += time.perf_counter() - t
                if i == removed[-1]:
                    raise _Stop
            handles.append(blocks[i].register_forward_hook(post))
        try:
            with torch.no_grad():
                for ids, m in batches(win, a.batch_size, dev):
                    mask = m.bool()
                    try:
                        model(input_ids=ids, attention_mask=m, use_cache=False)
                    except _Stop:
                        pass
        finally:
            for h in handles:
                h.remove()

    run(C.windows(model, tok, a.samples, a.seq_len), calib, True)
    run(C.windows(model, tok, a.accum_heldout, a.seq_len, split="heldout"), {"float64": held}, False)
    ref = [ridge_solve(s, a.damping) for s in calib["float64"]]
    ntok = calib["float64"][0].num_tokens
    rows, out = [], {"tokens": ntok, "sites": len(removed), "activations": str(act_dtype).replace("torch.", ""),
                     "auto": resolve_accum("auto", dev, act_dtype), "schemes": {}}
    for sc in schemes:
        g_err, w_err, ex_cal, ex_held = [], [], [], []
        for k, s in enumerate(calib[sc]):
            sol = ridge_solve(s, a.damping)
            g64 = calib["float64"][k].G
            g_err.append(((s.G - g64).norm() / g64.norm()).item())
            w_err.append(((sol.W - ref[k].W).norm() / ref[k].W.norm()).item())
            e = calib["float64"][k].relative_error
            ex_cal.append(e(sol.W, sol.b) - e(ref[k].W, ref[k].b))
            ex_held.append(held[k].relative_error(sol.W, sol.b) - held[k].relative_error(ref[k].W, ref[k].b))
        per_m = secs[sc] / (ntok * len(removed)) * 1e6
        emulated = dev.type != "cuda" and sc in ("tf32", "bfloat16")
        entry = {"seconds": secs[sc], "seconds_per_1M_token_sites": per_m, "speed_vs_float64": secs["float64"] / secs[sc],
                 "emulated": emulated, "G_rel_err_max": max(g_err), "W_rel_err_max": max(w_err),
                 "W_rel_err_mean": sum(w_err) / len(w_err), "excess_calib_rel_error_max": max(ex_cal),
                 "excess_heldout_rel_error_max": max(ex_held),
                 "heldout_rel_error_mean_float64": sum(h.relative_error(r.W, r.b) for h, r in zip(held, ref)) / len(ref)}
        out["schemes"][sc] = entry
        rows.append([sc + (" (emulated)" if emulated else ""), per_m, entry["speed_vs_float64"], max(g_err), max(w_err),
                     max(ex_cal), max(ex_held)])
    out["table"] = C.md_table(["scheme", "s per 1M token·sites", "speed vs float64", "max rel err G", "max rel err W",
                               "max excess calib rel err", "max excess held-out rel err"], rows)
    return out


# ------------------------------------------------------------------------------------------------
def section_ppl(model, tok, dev, a) -> dict:
    win = C.windows(model, tok, a.ppl_samples, a.ppl_seq_len)
    n_layers = len(decoder_layers(model))
    res = {}

    def variant(replay):
        def run():
            res[replay] = run_scorer(RemovalPerplexity(n_layers, replay=replay), model, win, a.batch_size)
        return run

    times = C.round_robin({"replay (cached block inputs)": variant(True), "L+1 full passes": variant(False)},
                          dev, 1, warmup=False)
    s_new, s_old = res[True].finalize()[0], res[False].finalize()[0]
    diff = max(abs(s_new[i] - s_old[i]) / s_old[i] for i in s_old)
    t_new, t_old = times["replay (cached block inputs)"]["median"], times["L+1 full passes"]["median"]
    return {"windows": len(win), "seq_len": a.ppl_seq_len, "layers": n_layers, "seconds_replay": t_new,
            "seconds_full": t_old, "speedup": t_old / t_new, "max_rel_score_diff": diff,
            "block_calls_replay": n_layers + n_layers * (n_layers - 1) // 2, "block_calls_full": n_layers * (n_layers + 1),
            "table": C.md_table(["ppl criterion", "seconds", "block calls / batch"],
                                [["L+1 full passes", t_old, n_layers * (n_layers + 1)],
                                 ["replay from cached block inputs", t_new, n_layers + n_layers * (n_layers - 1) // 2],
                                 ["speed-up", t_old / t_new, ""]]) + f"\n\nmax relative score difference: {diff:.1e}"}


# ------------------------------------------------------------------------------------------------
def section_processes(a) -> dict:
    """calibrate.py: 1 process x 2 threads vs 2 DDP processes (gloo) x 1 thread."""
    out, rows = {}, []
    for world, threads in ((1, 2), (2, 1)):
        with tempfile.TemporaryDirectory() as tmp:
            cmd = [sys.executable, str(C.ROOT / "calibrate.py"), "--model.name_or_path", a.model,
                   "--model.dtype", a.dtype, "--data.num_samples", str(a.samples), "--data.seq_len", str(a.seq_len),
                   "--data.batch_size", str(a.batch_size), "--heldout.num_samples", "0",
                   "--prune.ratio", str(a.ratio), "--prune.criterion", a.criterion,
                   "--calibration.solver", "lra", "--calibration.accum_dtype", a.memory_accum, "--trainer.accelerator", "cpu",
                   "--trainer.enable_progress_bar", "false", "--output_dir", f"{tmp}/out"]
            if world > 1:
                cmd += ["--trainer.devices", str(world), "--trainer.strategy", "ddp"]
            env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
            t = time.perf_counter()
            p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=C.ROOT)
            wall = time.perf_counter() - t
            if p.returncode != 0:
                raise SystemExit(f"calibrate.py ({world} processes) failed:\n{p.stderr[-3000:]}")
            rep = json.loads(Path(f"{tmp}/out/calibration_report.json").read_text())
        key = f"{world} process{'es' if world > 1 else ''} x {threads} thread{'s' if threads > 1 else ''}"
        out[key] = {"world_size": rep["world_size"], "calibration_seconds": rep["seconds"]["calibration"],
                    "wall_seconds": wall, "tokens": rep["calibration_tokens"],
                    "sites_rel_error": [s["calib_rel_error"] for s in rep["sites"]]}
        rows.append([key, rep["seconds"]["calibration"], wall])
    k1, k2 = list(out)
    out["speedup_calibration"] = out[k1]["calibration_seconds"] / out[k2]["calibration_seconds"]
    out["max_rel_error_diff"] = max(abs(x - y) for x, y in zip(out[k1]["sites_rel_error"], out[k2]["sites_rel_error"]))
    out["table"] = C.md_table(["calibrate.py", "calibration seconds (report)", "wall seconds (incl. start-up, load)"],
                              rows) + f"\n\nspeed-up of the calibration phase: {out['speedup_calibration']:.2f}x"
    return out


# ------------------------------------------------------------------------------------------------
def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m", help="smollm2-135m, any load_pretrained name, random:llama3-8b, random:tiny")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--criterion", default="reverse_star")
    ap.add_argument("--samples", type=int, default=16, help="calibration windows (timing, accum, processes)")
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--batch_size", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--accum", default=None, help="schemes timed in independent mode (default: float64,float32 on CPU; "
                                                  "float64,tf32,bfloat16 on CUDA)")
    ap.add_argument("--memory_accum", default="auto", help="scheme of the memory and processes sections")
    ap.add_argument("--sequential_accum", default="auto")
    ap.add_argument("--damping", type=float, default=1e-4)
    ap.add_argument("--accum_heldout", type=int, default=8, help="held-out windows for the accum section's excess error")
    ap.add_argument("--memory_sizes", default="32,64,128,256,512,1024")
    ap.add_argument("--memory_seq_len", type=int, default=64)
    ap.add_argument("--memory_inprocess", action="store_true",
                    help="CPU: measure every size in this process (peak reset before each) instead of one process per size")
    ap.add_argument("--ppl_samples", type=int, default=4)
    ap.add_argument("--ppl_seq_len", type=int, default=256)
    ap.add_argument("--sections", default="timing,accum,ppl,memory,processes")
    ap.add_argument("--out", default=None)
    ap.add_argument("--memory_child", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--memory_child_bare", action="store_true", help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    a.argv = [x for x in (sys.argv[1:] if argv is None else argv)]
    dev = C.pick_device(a.device)
    a.accum = (a.accum or ("float64,tf32,bfloat16" if dev.type == "cuda" else "float64,float32")).split(",")
    a.sequential_accum = [x for x in a.sequential_accum.split(",") if x]
    a.memory_sizes = [int(x) for x in a.memory_sizes.split(",")]
    a.sections = a.sections.split(",")
    return a, dev


def main(argv=None):
    a, dev = parse(argv)
    model, tok = C.build_model(a.model, dev, C.dtype_of(a.dtype))
    removed = select_blocks(PruneConfig(ratio=a.ratio, criterion=a.criterion), model).layers
    if a.memory_child is not None:
        print("MEMORY " + json.dumps(memory_child(model, tok, dev, removed, a, a.memory_child,
                                                        a.memory_child_bare)), flush=True)
        return
    out = Path(a.out or C.ROOT / "results" / "bench" / f"calibration_{a.model.replace(':', '_')}_{dev.type}.json")
    doc = {"benchmark": "calibration", "model": a.model, "dtype": a.dtype, "removed": removed,
           "criterion": a.criterion, "ratio": a.ratio}
    if out.exists():  # sections measured by earlier runs (other --sections) are kept
        old = json.loads(out.read_text())
        if all(old.get(k) == v for k, v in doc.items()):
            doc = old
    command = "python benchmarks/calibration.py " + " ".join(a.argv)
    t0 = time.time()
    steps = {"timing": lambda: section_timing(model, tok, dev, removed, a),
             "accum": lambda: section_accum(model, tok, dev, removed, a),
             "ppl": lambda: section_ppl(model, tok, dev, a),
             "memory": lambda: section_memory(model, tok, dev, removed, a),
             "processes": lambda: section_processes(a)}
    for name in a.sections:
        if name == "processes" and dev.type == "cuda":
            continue  # one GPU here: the CPU run measures 1 vs 2 processes
        t = time.time()
        doc[name] = steps[name]()
        doc[name].update(section_seconds=time.time() - t, command=command, machine=C.machine(dev))
        print(f"\n## {name} ({a.model}, {dev.type}, removed {removed})\n\n{doc[name]['table']}\n", flush=True)
        C.write_json(out, doc)  # after every section: a later failure keeps what was measured
    C.write_json(out, doc)
    print(f"wrote {out} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
