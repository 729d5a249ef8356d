"""The statistics' products: the one full GEMM against block-triangular products (:func:`gram_products`).

Every batch of a calibration pass adds ``R[:, :p]ᵀ R`` to each site's master sums
(:class:`shift_lightning.maps.ridge.RidgeStats`), with ``R = [x, 1, Δ]`` (the LRA, ``p = d + 1``) or
``R = [x, m, 1, Δ]`` (the joint map, ``p = 2d + 1``). The Gram block ``(p, p)`` is symmetric, so
:func:`~shift_lightning.maps.ridge.gram_products` (on CPU) multiplies only its upper block triangle: the columns ``[0, p)`` cut into ``k``
row blocks, each multiplied against the columns from its own start on, the blocks below the diagonal
mirrored — ``p²(k+1)/2k + p(q−p)`` products instead of ``pq`` (the joint map's 6d² a token about 4.4d² at
d = 640 and 256-wide blocks, ``k = 5``). This times, interleaved, the full GEMM against it for several row-block widths, on random
float64 rows of the real models' widths (the cost does not depend on the values), and checks each
against the full product.

    python benchmarks/gram.py                           # CPU, one thread, d = 576 (SmolLM2), 640 (Gemma3), 2048

Writes ``results/bench/gram_<device>.json`` (``--out``) and prints a markdown table.
"""

from __future__ import annotations

import argparse

import bench_common as C
import torch

from shift_lightning.outputs import write_text_atomic
from shift_lightning.maps.ridge import GRAM_BLOCK, chunk_products, gram_products


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dims", default="576,640,2048", help="hidden sizes, comma-separated")
    ap.add_argument("--tokens", type=int, default=2048, help="rows per batch (the grid's 4 × 512)")
    ap.add_argument("--blocks", default="128,192,256,384,512", help="row-block widths to time")
    ap.add_argument("--scheme", default="float64")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    dev = C.pick_device(a.device)
    work = torch.float64 if a.scheme == "float64" else torch.float32
    g = torch.Generator(device=dev).manual_seed(0)
    rows, doc = [], {"machine": C.machine(dev), "scheme": a.scheme, "tokens": a.tokens,
                     "results": []}
    blocks = [int(b) for b in a.blocks.split(",")]
    headers = ["d", "statistics", "full ms"] + [f"÷ full, block {b}" for b in blocks] + ["max rel. err"]
    for d in (int(x) for x in a.dims.split(",")):
        for name, p in (("[x, 1] (LRA)", d + 1), ("[x, m, 1] (joint)", 2 * d + 1)):
            R = torch.randn(a.tokens, p + d, generator=g, device=dev, dtype=work)
            full = chunk_products(R[:, :p], R, a.scheme)
            variants = {"full": lambda R=R, p=p: chunk_products(R[:, :p], R, a.scheme)}
            for b in blocks:
                variants[f"block {b}"] = lambda R=R, p=p, b=b: gram_products(R, p, a.scheme, block=b)
            t = C.round_robin(variants, dev, a.repeats)
            err = {b: ((gram_products(R, p, a.scheme, block=b) - full).abs().max() / full.abs().max()).item()
                   for b in blocks}
            res = {"d": d, "stats": name, "p": p, "q": p + d, "full_s": t["full"]["median"],
                   "ratio": {b: t[f"block {b}"]["median"] / t["full"]["median"] for b in blocks},
                   "max_rel_err": err, "runs": t}
            doc["results"].append(res)
            rows.append([d, name, f"{res['full_s'] * 1e3:.1f}"] + [f"{res['ratio'][b]:.2f}" for b in blocks]
                        + [f"{max(err.values()):.0e}"])
            print(C.md_table(headers, rows[-1:]).splitlines()[-1], flush=True)
    table = C.md_table(headers, rows)
    print(table)
    out = a.out or f"results/bench/gram_{dev.type}"
    C.write_json(out + ".json", doc)
    write_text_atomic(out + ".md", f"# Statistics products: full GEMM against block-triangular\n\n`python benchmarks/gram.py "
                      f"--dims {a.dims} --scheme {a.scheme} --threads {a.threads}` ({a.tokens} rows a batch, medians "
                      f"of {a.repeats} interleaved runs; the default row block is {GRAM_BLOCK})\n\n{table}\n")


if __name__ == "__main__":
    main()
