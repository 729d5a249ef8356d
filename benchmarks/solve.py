"""Ridge solve time vs hidden size: float64 vs float32, full rank vs reduced rank, CPU (and CUDA).

The solve is :func:`shift_lightning.maps.ridge.ridge_solve` exactly as calibration calls it (centring,
relative damping, Cholesky, ``cholesky_solve`` for the d right-hand sides, and for rank r the
``eigh`` of ``Bᵀ H B``), on synthetic statistics of size d (a random symmetric positive definite
``XᵀX``; the cost does not depend on the values). Per site: about ``d³/3`` (Cholesky) + ``2d³``
(solve for d right-hand sides) flops, + the ``d × d`` eigendecomposition for rank r.

``--real_model`` also solves one real site of that model (25% reverse_star, a few windows) in
float32 and float64: the float32 solve's relative error of W on real, badly scaled statistics.

    python benchmarks/solve.py                                   # CPU, d = 576 … 8192
    python benchmarks/solve.py --device cuda --real_model ""
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import bench_common as C
import torch

from shift_lightning.maps.ridge import RidgeStats, ridge_solve


def synthetic(d: int, dev, seed: int = 0) -> RidgeStats:
    g = torch.Generator(device=dev).manual_seed(seed)
    s = RidgeStats(d, f"d={d}", device=dev)
    A = torch.rand(d, d, generator=g, device=dev, dtype=torch.float64) - 0.5
    S = 0.5 * (A + A.T) + d * torch.eye(d, device=dev, dtype=torch.float64)  # diagonally dominant: SPD
    n = 1e6
    s.G[:d, :d] = S
    s.G[d, d] = n
    s.C[:d] = torch.rand(d, d, generator=g, device=dev, dtype=torch.float64)
    return s


def real_site(model_name: str, dev) -> dict:
    """float32 vs float64 solve on one real site's statistics."""
    import lightning as L

    from shift_lightning.calibration import CalibrationConfig, CalibrationModule
    from shift_lightning.criteria import PruneConfig
    from shift_lightning.selection import select_blocks

    model, tok = C.build_model(model_name, dev)
    removed = select_blocks(PruneConfig(ratio=0.25, criterion="reverse_star"), model).layers
    win = C.windows(model, tok, 8, 256)
    acc, devices = ("gpu", [dev.index or 0]) if dev.type == "cuda" else ("cpu", 1)
    trainer = L.Trainer(accelerator=acc, devices=devices, logger=False, enable_checkpointing=False,
                        enable_progress_bar=False, enable_model_summary=False, inference_mode=False)
    mod = CalibrationModule(model, removed, CalibrationConfig(solver="lra", accum_dtype="float64", heldout=False))
    mod.calibrate(trainer, win, batch_size=4)
    out = []
    for site in mod.sites:
        st = mod.statistics[site.key].io
        w64 = ridge_solve(st).W
        try:
            w32 = ridge_solve(st, dtype=torch.float32).W.double()
            err = ((w32 - w64).norm() / w64.norm()).item()
        except Exception as e:  # a float32 Cholesky can fail on badly scaled statistics
            err = f"failed: {type(e).__name__}"
        out.append({"site": site.name, "W_rel_err_float32_solve": err,
                    "excess_rel_error": None if isinstance(err, str) else
                    st.relative_error(w32, ridge_solve(st, dtype=torch.float32).b.double())
                    - st.relative_error(w64, ridge_solve(st).b)})
    return {"model": model_name, "tokens": win.num_tokens, "sites": out}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dims", default="576,1024,2048,4096,8192")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--rank_max_d", type=int, default=None,
                    help="largest d for the reduced-rank solve (default: 2048 on CPU, all on CUDA)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--real_model", default="smollm2-135m", help='"" to skip the real-statistics check')
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    argv_used = argv if argv is not None else __import__("sys").argv[1:]
    dev = C.pick_device(a.device)
    rank_max = a.rank_max_d if a.rank_max_d is not None else (10 ** 9 if dev.type == "cuda" else 2048)
    t0 = time.time()
    rows, res = [], []
    for d in [int(x) for x in a.dims.split(",")]:
        s = synthetic(d, dev)
        variants = {"float64": lambda: ridge_solve(s), "float32": lambda: ridge_solve(s, dtype=torch.float32)}
        if d <= rank_max and a.rank < d:
            variants[f"float64 rank {a.rank}"] = lambda: ridge_solve(s, rank=a.rank)
        t = C.round_robin(variants, dev, a.repeats, warmup=d <= 1024)
        w64, w32 = ridge_solve(s).W, ridge_solve(s, dtype=torch.float32).W.double()
        entry = {"d": d, "seconds": {k: v["median"] for k, v in t.items()},
                 "gflops_float64": (d ** 3 / 3 + 2 * d ** 3) / t["float64"]["median"] / 1e9,
                 "W_rel_err_float32_synthetic": ((w32 - w64).norm() / w64.norm()).item()}
        res.append(entry)
        rows.append([d, t["float64"]["median"], t["float32"]["median"], t["float64"]["median"] / t["float32"]["median"],
                     t.get(f"float64 rank {a.rank}", {}).get("median", ""), entry["gflops_float64"]])
        print(f"d={d}: " + ", ".join(f"{k} {v['median']:.3g} s" for k, v in t.items()), flush=True)
        del s
    table = C.md_table(["d", "float64 s", "float32 s", "float64 ÷ float32", f"float64 rank-{a.rank} s",
                        "float64 GFLOP/s"], rows)
    doc = {"benchmark": "solve", "machine": C.machine(dev), "command": "python benchmarks/solve.py " + " ".join(argv_used),
           "rank": a.rank, "results": res, "table": table}
    if a.real_model:
        doc["real"] = real_site(a.real_model, dev)
    doc["seconds"] = time.time() - t0
    out = Path(a.out or C.ROOT / "results" / "bench" / f"solve_{dev.type}.json")
    C.write_json(out, doc)
    print(f"\n## ridge solve ({dev.type})\n\n{table}\n")
    if a.real_model:
        errs = [s["W_rel_err_float32_solve"] for s in doc["real"]["sites"]]
        print(f"float32 solve on real {a.real_model} statistics: W relative error per site {errs}")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
