"""Why does LinearPatch blow up on some spans (the grid's Gemma3 wiki PPL 2e6–3e16 under block influence,
PPL, magnitude-L1 and -L2, where pruning alone is at 62–6e6), when its scaling is a few-fold per channel?

    python experiments/checks/linearpatch_check.py --model gemma3-270m --criterion ppl --out results/bench/linearpatch_check_gemma3-270m_ppl

LinearPatch (:mod:`shift_lightning.maps.peers`) applies ``P = H diag(s) Hᵀ`` at the pruning interface, ``s``
the per-channel ratio of the span's output to its input magnitude in the Hadamard basis. For a
residual stream whose energy sits in a few massive channels, every Hadamard coordinate carries those
channels' ``±a/√d``, so a non-uniform ``s`` writes a fraction of ``a`` into every ordinary channel.
Per span of the grid's blocks (``results/paper/<model>/<criterion>/selection.json``), on the same
calibration windows as the grid (the library's own :class:`~shift_lightning.maps.peers.ChannelScaleStats`):
the spread of ``s``; on held-out windows, the share of ``‖x‖²`` in the top-8 channels, and the
patch's deviation from a uniform scaling on the other channels, ``‖(xP − s̄x)_rest‖``, against their
own norm, with and without the top-8 channels in ``x``. Then held-out perplexity of the original, the
pruned model, LinearPatch, LinearPatch with ``s`` measured without position 0 (the first token
carries the largest activations; the reference cuts windows from a token stream), and a diagnostic,
not a method: LinearPatch with the 8 channels of largest calibration energy kept out of the mixing
(their rows of ``P`` replaced by ``s̄`` on the diagonal) — if the leak is the cause, this repairs it.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time

import _common as C

import torch  # noqa: E402

from shift_lightning.arch import block_input, block_output, decoder_layers, final_norm, with_block_input, with_block_output  # noqa: E402
from shift_lightning.maps.sites import contiguous_spans  # noqa: E402
from shift_lightning.data import TextDataConfig, build_windows  # noqa: E402
from shift_lightning.outputs import write_json_atomic, write_text_atomic  # noqa: E402
from shift_lightning.maps.peers import ChannelScaleStats, hadamard, linearpatch_matrix  # noqa: E402
from shift_lightning.maps.surgery import remove_blocks  # noqa: E402


def capture(model, idx: list[int]):
    """Forward pre-hooks recording the hidden state entering blocks ``idx`` (float64; index ``L``: the
    final norm's input)."""
    seen = {}
    blocks = decoder_layers(model)
    where = lambda i: blocks[i] if i < len(blocks) else final_norm(model)  # noqa: E731

    def hook(i):
        def f(_m, args, kwargs):
            seen[i] = block_input(args, kwargs).double()
        return f
    return seen, [where(i).register_forward_pre_hook(hook(i), with_kwargs=True) for i in idx]


@torch.no_grad()
def perplexity(model, windows) -> float:
    nll, n = 0.0, 0
    for b in range(len(windows)):
        ids, am = windows.input_ids[b:b + 1], windows.attention_mask[b:b + 1]
        lg = model(input_ids=ids, attention_mask=am, use_cache=False).logits[0, :-1].double()
        mk = am[0, 1:].bool()
        nll += torch.nn.functional.cross_entropy(lg[mk], ids[0, 1:][mk], reduction="sum").item()
        n += int(mk.sum())
    return math.exp(nll / n)


@torch.no_grad()
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--criterion", default="ppl")
    ap.add_argument("--grid", default="results/paper")
    ap.add_argument("--calib_samples", type=int, default=64)
    ap.add_argument("--heldout", type=int, default=8)
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--out", default="results/bench/linearpatch_check_gemma3-270m_ppl")
    a = ap.parse_args(argv)
    t0 = time.time()
    layers = json.loads((C.ROOT / a.grid / a.model / a.criterion / "selection.json").read_text())["layers"]
    spans = contiguous_spans(layers)
    model, tok = C.build_model(a.model, torch.device("cpu"))
    mt = model.config.model_type
    cal = build_windows(TextDataConfig(source="wiki_summaries", split="calibration", num_samples=a.calib_samples,
                                       seq_len=a.seq_len), tok, mt)
    held = build_windows(TextDataConfig(source="wiki_summaries", split="heldout", num_samples=a.heldout,
                                        seq_len=a.seq_len), tok, mt)
    d = model.config.hidden_size
    need = sorted({i for sp in spans for i in sp})
    stats = {(sp, k): ChannelScaleStats(d, f"{sp}") for sp in spans for k in ("all", "no_first")}
    energy = {sp: torch.zeros(d, dtype=torch.float64) for sp in spans}  # Σ x² per channel at the span input
    seen, hooks = capture(model, need)
    for b in range(len(cal)):
        ids, am = cal.input_ids[b:b + 1], cal.attention_mask[b:b + 1]
        model(input_ids=ids, attention_mask=am, use_cache=False)
        later = am.clone()
        later[:, 0] = 0
        for s, e in spans:
            energy[(s, e)] += (seen[s][0][am[0].bool()] ** 2).sum(0)
            stats[((s, e), "all")].add_batch(seen[s], seen[e], am)
            stats[((s, e), "no_first")].add_batch(seen[s], seen[e], later)
        print(f"\rcalibration windows {b + 1}/{len(cal)}", end="", flush=True)
    print()
    # leakage on one held-out window (its real tokens after the first)
    model(input_ids=held.input_ids[:1], attention_mask=held.attention_mask[:1], use_cache=False)
    for h in hooks:
        h.remove()
    rows = []
    for sp in spans:
        s = stats[(sp, "all")].scale()
        P = linearpatch_matrix(s)
        x = seen[sp[0]][0][held.attention_mask[0].bool()][1:]
        e2 = (x ** 2).mean(0)
        top = e2.topk(8).indices
        rest = torch.ones(d, dtype=torch.bool)
        rest[top] = False
        dev = (x @ P - s.mean() * x)[:, rest].norm(dim=-1).median()
        xr = x * rest
        dev_rest = (xr @ P - s.mean() * xr)[:, rest].norm(dim=-1).median()
        rows.append({"span": list(sp), "scale_min": float(s.min()), "scale_median": float(s.median()),
                     "scale_max": float(s.max()), "scale_cv": float(s.std() / s.mean()),
                     "top8_energy_share": float(e2[top].sum() / e2.sum()),
                     "rest_norm": float(x[:, rest].norm(dim=-1).median()), "patch_dev_rest": float(dev),
                     "patch_dev_rest_without_top8": float(dev_rest)})
    ppl = {"original": perplexity(model, held)}
    pruned = copy.deepcopy(model)
    blocks = decoder_layers(pruned)
    remove_blocks(pruned, layers)
    ppl["pruned"] = perplexity(pruned, held)
    for k in ("all", "no_first", "massive_kept_out"):
        hs = []
        for sp in spans:
            s = stats[(sp, "no_first" if k == "no_first" else "all")].scale()
            P = linearpatch_matrix(s)
            if k == "massive_kept_out":  # the top-8 calibration channels only scaled by s̄, not mixed into the rest
                top = energy[sp].topk(8).indices
                P[top, :] = 0.0
                P[top, top] = s.mean()
            P = P.float()

            def after(_m, _args, out, P=P):  # the output of the block before the span, as the reference
                return with_block_output(out, block_output(out) @ P)

            def before(_m, args, kwargs, P=P):  # a span at block 0: into the first kept block
                return with_block_input(args, kwargs, block_input(args, kwargs) @ P)
            hs.append(blocks[sp[0] - 1].register_forward_hook(after) if sp[0] > 0 else
                      blocks[sp[1]].register_forward_pre_hook(before, with_kwargs=True))
        ppl["linearpatch" if k == "all" else f"linearpatch_{k}"] = perplexity(pruned, held)
        for h in hs:
            h.remove()
    doc = {"model": a.model, "criterion": a.criterion, "layers": layers, "spans": rows, "heldout_ppl": ppl,
           "calib_windows": len(cal), "heldout_windows": len(held), "seq_len": a.seq_len,
           "hadamard_order": d, "hadamard_orthonormal_err": float((hadamard(d) @ hadamard(d).T - torch.eye(d, dtype=torch.float64)).abs().max()),
           "seconds": time.time() - t0, "machine": C.machine(torch.device("cpu"))}
    write_json_atomic(a.out + ".json", doc)
    md = [f"# LinearPatch on {a.model}, {a.criterion}'s blocks {layers}", "",
          f"`python experiments/checks/linearpatch_check.py --model {a.model} --criterion {a.criterion}` "
          f"({len(cal)} calibration × {a.seq_len} tokens, wiki-summaries; {len(held)} held-out windows)", "",
          "| span | scale s: min / median / max (CV) | top-8 channels' share of ‖x‖² | ‖x‖ other channels | "
          "‖xP − s̄x‖ there | same, top-8 zeroed in x |", "|---|---|---|---|---|---|"]
    for r in rows:
        md.append(f"| {r['span'][0]}–{r['span'][1] - 1} | {r['scale_min']:.2f} / {r['scale_median']:.2f} / "
                  f"{r['scale_max']:.2f} ({r['scale_cv']:.2f}) | {100 * r['top8_energy_share']:.1f} % | "
                  f"{r['rest_norm']:.1f} | {r['patch_dev_rest']:.1f} | {r['patch_dev_rest_without_top8']:.1f} |")
    md += ["", "Held-out wiki-summaries perplexity: " + ", ".join(f"{k} {v:.4g}" for k, v in ppl.items()), ""]
    write_text_atomic(a.out + ".md", "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
