"""Why ReplaceMe's cosine fit loses to its least-squares fit here: direction against scale.

    python experiments/checks/replaceme_cosine_check.py --model smollm2-135m --criterion angular
    python experiments/checks/replaceme_cosine_check.py --model gemma3-270m --criterion ppl

ReplaceMe maps the MLP branch ``m`` of the last kept block so that ``m T ≈ y = m + Δ`` (``Δ``: what the
removed span adds to the residual stream). Its repo's default objective, ``1 − cos(m T, y)``, does not
see the length of ``m T``; the residual stream it is added to does. For every span of a grid row
(``results/paper/<model>/<criterion>/selection.json``, or ``--blocks``) this caches ``(m, y)`` on the
grid's calibration windows (64 × 512 wiki-summaries tokens) and on held-out windows (16 × 512,
the ``heldout`` split; no evaluated doc), fits

* ``ls``: least squares, ``T = (mᵀm + λI)⁻¹ mᵀy`` (the library's ``ridge_solve``, as the grid);
* ``cosine``: the grid's ``replaceme_cosine`` (``cosine_fit``: Adam from ``T = I``, lr 1e-4, 1024 tokens
  a step, ``--epochs`` over the cached tokens; 10 is the repo's default),

and reports on the held-out rows: the mean cosine of ``m T`` with ``y`` (what the cosine fit
optimises), the median length ratio ``‖m T‖ / ‖y‖``, and the relative error ``‖m T − y‖² / ‖y‖²``; for
the cosine maps also that error after the one scalar that best rescales ``T`` on the calibration rows
(``α = ⟨mT, y⟩ / ⟨mT, mT⟩``): the part of the loss that is scale alone. Nothing here is tuned; it
explains the grid's ``replaceme_cosine`` rows.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _common as C

import torch  # noqa: E402

from shift_lightning.arch import base_model, block_input, block_output, decoder_layers, mlp_branch  # noqa: E402
from shift_lightning.maps.sites import contiguous_spans  # noqa: E402
from shift_lightning.maps.solvers.replaceme import cosine_fit  # noqa: E402
from shift_lightning.outputs import write_json_atomic, write_text_atomic  # noqa: E402
from shift_lightning.maps.ridge import RidgeStats, ridge_solve  # noqa: E402


@torch.no_grad()
def branch_rows(model, windows, start: int, end: int, batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``(m, y)`` float64 rows of the real tokens: ``m`` the MLP branch output of block ``start − 1``,
    ``y = m + h_end − h_start`` (``h_k``: the input of block ``k``; ``h_L``: the last block's output)."""
    layers = decoder_layers(model)
    got: dict = {}
    hooks = [mlp_branch(layers[start - 1]).register_forward_hook(lambda mod, a, out: got.__setitem__("m", out)),
             layers[start].register_forward_pre_hook(lambda mod, a, kw: got.__setitem__("hs", block_input(a, kw)),
                                                     with_kwargs=True)]
    if end < len(layers):
        hooks.append(layers[end].register_forward_pre_hook(
            lambda mod, a, kw: got.__setitem__("he", block_input(a, kw)), with_kwargs=True))
    else:
        hooks.append(layers[end - 1].register_forward_hook(lambda mod, a, out: got.__setitem__("he", block_output(out))))
    ms, ys = [], []
    try:
        for s in range(0, len(windows), batch):
            ids, mask = windows.input_ids[s:s + batch], windows.attention_mask[s:s + batch]
            base_model(model)(input_ids=ids, attention_mask=mask, use_cache=False)
            keep = mask.bool()
            m = got["m"][keep].double()
            ms.append(m)
            ys.append(m + got["he"][keep].double() - got["hs"][keep].double())
    finally:
        for h in hooks:
            h.remove()
    return torch.cat(ms), torch.cat(ys)


def scores(T: torch.Tensor, m: torch.Tensor, y: torch.Tensor) -> dict:
    p = m @ T
    cos = torch.nn.functional.cosine_similarity(p, y, dim=1)
    ratio = p.norm(dim=1) / y.norm(dim=1).clamp_min(1e-30)
    return {"cosine": float(cos.mean()), "length_ratio_median": float(ratio.median()),
            "rel_error": float((p - y).square().sum() / y.square().sum())}


def render(doc: dict) -> str:
    """The markdown table of a run (``error ÷ pruned``: the error relative to the identity's, i.e. to
    what the span adds, ``‖mT − y‖² / ‖Δ‖²``, the grid's per-site held-out error)."""
    ident = {r["span"]: r["rel_error"] for r in doc["rows"] if r["fit"].startswith("identity")}
    lines = [f"# ReplaceMe's cosine fit against least squares: {doc['model']}, {doc['criterion']} "
             f"(blocks {doc['blocks']})", "",
             f"Held-out rows ({doc['heldout_tokens']} tokens of the heldout split); fits on {doc['calib_tokens']} "
             "calibration tokens. cos: mean cosine of mT with y; ‖mT‖/‖y‖: median length ratio; error: "
             "‖mT − y‖²/‖y‖² over all tokens; error ÷ pruned: the same over the identity's (= ‖mT − y‖²/‖Δ‖²); "
             "rescaled: the error after the best single scale α of T (fitted on the calibration rows)."
             + (" Top 1 %: the share of ‖y‖² held by the 1 % longest tokens." if "top1pct_energy" in doc["rows"][0]
                else "") + f" `{doc['command']}`", "",
             "| span | fit | cos | ‖mT‖/‖y‖ | error | error ÷ pruned | α | error rescaled | loss epoch 1 → last |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        extra = (f"{r['alpha']:.3g} | {r['rel_error_rescaled']:.3f} | {r['loss_first_last_epoch'][0]:.3f} → "
                 f"{r['loss_first_last_epoch'][1]:.3f}") if "alpha" in r else "– | – | –"
        span = r["span"] + (f" (top 1 %: {100 * r['top1pct_energy']:.0f} % of ‖y‖²)" if "top1pct_energy" in r
                            and r["fit"].startswith("identity") else "")
        lines.append(f"| {span} | {r['fit']} | {r['cosine']:.3f} | {r['length_ratio_median']:.3g} | "
                     f"{r['rel_error']:.4f} | {r['rel_error'] / ident[r['span']]:.2f} | {extra} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--criterion", default="angular", help="take the blocks of this grid row")
    ap.add_argument("--grid", default="results/paper")
    ap.add_argument("--blocks", default=None, help="comma-separated blocks instead of the grid row's")
    ap.add_argument("--calib_samples", type=int, default=64)
    ap.add_argument("--heldout_samples", type=int, default=16)
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--epochs", default="10,50", help="cosine-fit epochs to compare (10: the repo's default)")
    ap.add_argument("--damping", type=float, default=1e-4)
    ap.add_argument("--out", default=None, help="default results/bench/replaceme_cosine_check_<model>_<criterion>")
    ap.add_argument("--render_only", action="store_true", help="rewrite the markdown from the JSON")
    a = ap.parse_args(argv)
    out = Path(a.out or f"results/bench/replaceme_cosine_check_{a.model.split('/')[-1]}_{a.criterion}")
    if a.render_only:
        doc = json.loads(out.with_suffix(".json").read_text())
        write_text_atomic(out.with_suffix(".md"), render(doc))
        return
    if a.blocks:
        blocks = sorted(int(b) for b in a.blocks.split(","))
    else:
        sel = Path(a.grid) / a.model / a.criterion / "selection.json"
        if not sel.exists():
            raise SystemExit(f"{sel} not found: run the grid row first or pass --blocks")
        blocks = sorted(json.loads(sel.read_text())["layers"])
    t0 = time.time()
    torch.manual_seed(0)
    model, tok = C.build_model(a.model, torch.device("cpu"))
    calib = C.windows(model, tok, a.calib_samples, a.seq_len)
    held = C.windows(model, tok, a.heldout_samples, a.seq_len, split="heldout")
    epochs = [int(e) for e in a.epochs.split(",")]
    rows = []
    for start, end in contiguous_spans(blocks):
        if start < 1:
            continue  # ReplaceMe has no block before the span to fold into
        m, y = branch_rows(model, calib, start, end)
        mh, yh = branch_rows(model, held, start, end)
        stats = RidgeStats(m.shape[1], f"{start}-{end}")
        stats.add_batch(m, y - m)
        ls = ridge_solve(stats, a.damping, None, "affine", bias=False)
        fits = {"identity (pruned)": torch.eye(m.shape[1], dtype=torch.float64), "ls": ls.W.T}
        hist = {}
        for e in epochs:
            t1 = time.time()
            T, h = cosine_fit(m.float(), y.float(), epochs=e)
            fits[f"cosine, {e} epochs"], hist[e] = T, (h, time.time() - t1)
        energy = yh.square().sum(dim=1).sort(descending=True).values
        top = float(energy[:max(1, len(energy) // 100)].sum() / energy.sum())
        for name, T in fits.items():
            r = {"span": f"{start}–{end - 1}", "fit": name, **scores(T, mh, yh), "top1pct_energy": top}
            if name.startswith("cosine"):
                p = m @ T
                alpha = float((p * y).sum() / p.square().sum())
                e = int(name.split()[1])
                r.update(alpha=alpha, rel_error_rescaled=scores(alpha * T, mh, yh)["rel_error"],
                         loss_first_last_epoch=[hist[e][0][0], hist[e][0][-1]], fit_seconds=hist[e][1],
                         steps=e * -(-m.shape[0] // 1024))
            rows.append(r)
            print(json.dumps(r))
    doc = {"model": a.model, "criterion": a.criterion, "blocks": blocks, "calib_tokens": int(calib.attention_mask.sum()),
           "heldout_tokens": int(held.attention_mask.sum()), "rows": rows, "seconds": time.time() - t0,
           "command": "python experiments/checks/replaceme_cosine_check.py " + " ".join(argv or __import__("sys").argv[1:])}
    out.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(out.with_suffix(".json"), doc)
    write_text_atomic(out.with_suffix(".md"), render(doc))
    print(f"wrote {out.with_suffix('.md')} ({time.time() - t0:.0f} s)")


if __name__ == "__main__":
    main()
