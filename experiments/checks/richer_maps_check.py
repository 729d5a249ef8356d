"""How much closer could a richer closed-form repair get? Held-out closeness of ridge maps on more features.

    python experiments/checks/richer_maps_check.py --model smollm2-135m --criterion angular
    python experiments/checks/richer_maps_check.py --model gemma3-270m --criterion reverse_star

The LRA regresses what a removed span adds, ``Δ = h_end − x``, on the state entering it, ``x``: a linear
function of ``x``, while the span is not. This fits the same ridge (the library's ``ridge_solve``, each
feature group damped relative to its own mean variance, relative damping ``--damping``) on richer
features that a corrected model can compute at no or little extra cost, and asks how much closer to
the original the pruned model gets:

* ``x``: the span LRA (``lra_span``);
* ``x, n(x)``: plus ``x / rms(x)`` (what every block's input norm sees; needs an adapter of its own);
* ``x, m``: plus the MLP-branch output ``m`` of block ``start − 1`` (= the ``lra_replaceme`` solver, placed
  exactly as an LRA plus ReplaceMe's branch map);
* ``x, a``: plus that block's MLP hidden activations ``a`` (``down_proj``'s input, ``d_ff`` wide);
* ``x, n(x), a``: both;
* ``x`` + re-anchoring: the span LRA, then an LRA at the input of each of the next ``k`` kept blocks,
  fitted one after the other from the corrected pruned model's state there to the *original's*
  (``k`` = 1, 2, 4);
* ``x`` (and ``x, m``) + an end anchor: the span map, then one least-squares map at the end of the
  model, from the corrected pruned model's state to the original's, either at the final norm's input
  (the residual stream) or at its output (what the LM head reads, so the fit is least squares in the
  head's input space: ``y = n + n W + b``).

One contiguous span of the mixed grid's block choice (``results/paper_mixed/<model>/<criterion>/selection.json``,
or ``--blocks``); the grid's 64 × 512 mixed calibration windows, every 4th held out (the guard's split):
fitted on 48, judged on 16 by the mean next-token KL(original ‖ model) (the original's top-256, as
the grids) and top-1 agreement. No evaluated doc is read; nothing is tuned. Also the relative error
``‖Δ − Δ̂‖² / ‖Δ‖²`` on the held-out tokens and the map's parameters.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import _common as C
from anchored_check import closeness  # the held-out KL / top-1 of the grids' checks

import torch  # noqa: E402
from torch import nn  # noqa: E402

from shift_lightning.arch import (Bypass, block_input, block_output, decoder_layers, final_norm, mlp_branch,  # noqa: E402
                                  swapped_blocks, with_block_input)
from shift_lightning.data import TokenWindows  # noqa: E402
from shift_lightning.outputs import write_json_atomic, write_text_atomic  # noqa: E402
from shift_lightning.maps.ridge import RidgeStats, ridge_solve  # noqa: E402

#: Feature sets of the one-map rows: name -> groups (x: span input, n: x / rms(x), m: MLP branch, a: MLP hidden).
FEATURES = {"x": "x", "x, n(x)": "xn", "x, m": "xm", "x, a": "xa", "x, n(x), a": "xna"}
REANCHOR = (1, 2, 4)


def rms_normed(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)


class Taps:
    """Forward hooks on block ``start − 1`` that keep its MLP branch ``m`` and MLP hidden ``a`` of the last call."""

    def __init__(self, model, start: int):
        blk = decoder_layers(model)[start - 1]
        self.got: dict = {}
        self.handles = [mlp_branch(blk).register_forward_hook(lambda mod, a, out: self.got.__setitem__("m", out)),
                        blk.mlp.down_proj.register_forward_pre_hook(lambda mod, a: self.got.__setitem__("a", a[0]))]

    def remove(self):
        for h in self.handles:
            h.remove()


def features(groups: str, x: torch.Tensor, got: dict) -> list[torch.Tensor]:
    parts = {"x": lambda: x, "n": lambda: rms_normed(x), "m": lambda: got["m"], "a": lambda: got["a"]}
    return [parts[g]() for g in groups]


class FeatureMap(nn.Module):
    """Stands in for block ``start``: ``y = x + F W + b`` with ``F`` the features of ``x`` (and of the taps)."""

    def __init__(self, groups: str, W: torch.Tensor, b: torch.Tensor, got: dict):
        super().__init__()
        self.groups, self.W, self.b, self.got = groups, W.float(), b.float(), got

    def forward(self, hidden_states, *args, **kwargs):
        F = torch.cat(features(self.groups, hidden_states, self.got), dim=-1).float()
        return hidden_states + F @ self.W.to(hidden_states.device) + self.b.to(hidden_states.device)


@torch.no_grad()
def collect(model, windows: TokenWindows, start: int, end: int, groups: str, batch: int = 4) -> RidgeStats:
    """Ridge statistics of ``(features, Δ)`` over the real tokens of ``windows`` (the original model)."""
    layers = decoder_layers(model)
    taps, got = Taps(model, start), {}
    hooks = [layers[start].register_forward_pre_hook(lambda mod, a, kw: got.__setitem__("x", block_input(a, kw)),
                                                     with_kwargs=True),
             layers[end - 1].register_forward_hook(lambda mod, a, kw, out: got.__setitem__("y", block_output(out)),
                                                   with_kwargs=True)]
    st = None
    try:
        for s in range(0, len(windows), batch):
            ids, mask = windows.input_ids[s:s + batch], windows.attention_mask[s:s + batch]
            model(input_ids=ids, attention_mask=mask, use_cache=False)
            keep = mask.bool()
            F = torch.cat(features(groups, got["x"], taps.got), dim=-1)[keep].double()
            if st is None:
                st = RidgeStats(F.shape[1], groups, out_dim=got["x"].shape[-1])
            st.add_batch(F, (got["y"] - got["x"])[keep].double())
    finally:
        taps.remove()
        for h in hooks:
            h.remove()
    return st


def group_sizes(groups: str, d: int, d_ff: int) -> tuple[int, ...]:
    return tuple(d_ff if g == "a" else d for g in groups)


class Anchors:
    """LRAs at kept blocks' inputs (forward pre-hooks), ``{block: (W, b)}``: ``h ↦ h + h W + b``."""

    def __init__(self, model):
        self.model, self.maps, self.handles = model, {}, []

    def install(self):
        layers = decoder_layers(self.model)
        for j, (W, b) in self.maps.items():
            mod = layers[j] if j < len(layers) else final_norm(self.model)
            self.handles.append(mod.register_forward_pre_hook(
                lambda m, a, kw, W=W, b=b: with_block_input(a, kw, block_input(a, kw) + block_input(a, kw) @ W + b),
                with_kwargs=True))

    def remove(self):
        for h in self.handles:
            h.remove()
        self.handles = []


@torch.no_grad()
def states_at(model, windows: TokenWindows, j: int, batch: int = 4) -> torch.Tensor:
    """float64 rows of the state entering block ``j`` (before any anchor there) over the real tokens."""
    got, rows = {}, []
    h = decoder_layers(model)[j].register_forward_pre_hook(
        lambda mod, a, kw: got.__setitem__("h", block_input(a, kw)), with_kwargs=True, prepend=True)
    try:
        for s in range(0, len(windows), batch):
            ids, mask = windows.input_ids[s:s + batch], windows.attention_mask[s:s + batch]
            model(input_ids=ids, attention_mask=mask, use_cache=False)
            rows.append(got["h"][mask.bool()].double())
    finally:
        h.remove()
    return torch.cat(rows)


@torch.no_grad()
def end_states(model, windows: TokenWindows, batch: int = 4) -> dict[str, torch.Tensor]:
    """float64 rows of the final norm's input (``pre``) and output (``post``) over the real tokens."""
    got, rows = {}, {"pre": [], "post": []}
    h = final_norm(model).register_forward_hook(lambda mod, a, out: got.update(pre=a[0], post=out))
    try:
        for s in range(0, len(windows), batch):
            ids, mask = windows.input_ids[s:s + batch], windows.attention_mask[s:s + batch]
            model.model(input_ids=ids, attention_mask=mask, use_cache=False)
            for k in rows:
                rows[k].append(got[k][mask.bool()].double())
    finally:
        h.remove()
    return {k: torch.cat(v) for k, v in rows.items()}


def end_anchor(model, where: str, W: torch.Tensor, b: torch.Tensor):
    """Hook ``h ↦ h + h W + b`` on the final norm's input (``pre``) or output (``post``); returns the handle."""
    if where == "pre":
        return final_norm(model).register_forward_pre_hook(lambda mod, a: (a[0] + a[0] @ W + b, *a[1:]))
    return final_norm(model).register_forward_hook(lambda mod, a, out: out + out @ W + b)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--criterion", default="angular")
    ap.add_argument("--blocks", default=None, help="first,last block of the span (default: the grid's choice)")
    ap.add_argument("--grid", default="results/paper_mixed")
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--damping", type=float, default=1e-4)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    model, tok = C.build_model(a.model, torch.device("cpu"))
    if a.blocks:
        first, last = (int(v) for v in a.blocks.split(","))
    else:
        layers = json.loads((Path(a.grid) / a.model / a.criterion / "selection.json").read_text())["layers"]
        if layers != list(range(layers[0], layers[-1] + 1)):
            raise SystemExit(f"{a.criterion} removes {layers}, not one contiguous span: pass --blocks first,last")
        first, last = layers[0], layers[-1]
    start, end = first, last + 1
    if start < 1:
        raise SystemExit("the span must have a block before it (the m and a features come from block start − 1)")
    out = Path(a.out or f"results/bench/richer_maps_{a.model.replace(':', '_')}_{a.criterion}")
    fit, judge, refs = C.heldout_split(model, tok, a.samples, a.seq_len)
    d, d_ff = model.config.hidden_size, model.config.intermediate_size
    n_layers = len(decoder_layers(model))
    doc = {"command": "python experiments/checks/richer_maps_check.py " + " ".join(f"--{k} {v}" for k, v in vars(a).items()
                                                                         if v is not None),
           "model": a.model, "blocks": [first, last], "machine": C.machine(torch.device("cpu")),
           "text": "mixed" if tok is not None else "random tokens", "fit_windows": len(fit), "judge_windows": len(judge),
           "damping": a.damping, "rows": []}

    def land(row):
        doc["rows"].append(row)
        print(row, flush=True)
        write_json_atomic(str(out.with_suffix(".json")), doc)

    bypass = {j: Bypass() for j in range(start + 1, end)}
    with swapped_blocks(model, {start: Bypass(), **bypass}):
        kl, top1 = closeness(model, judge, refs)
    land({"map": "pruned (no map)", "kl": kl, "top1": top1, "params": 0, "heldout_rel_error": 1.0, "seconds": 0.0})
    sols = {}
    for label, groups in FEATURES.items():
        t0 = time.perf_counter()
        st = collect(model, fit, start, end, groups)
        sol = ridge_solve(st, a.damping, groups=group_sizes(groups, d, d_ff))
        held_st = collect(model, judge, start, end, groups)
        err = held_st.relative_error(sol.W, sol.b)
        taps = Taps(model, start)
        try:
            with swapped_blocks(model, {start: FeatureMap(groups, sol.W.T, sol.b, taps.got), **bypass}):
                kl, top1 = closeness(model, judge, refs)
        finally:
            taps.remove()
        sols[groups] = sol
        land({"map": label, "kl": kl, "top1": top1, "params": sol.W.numel() + sol.b.numel(),
              "heldout_rel_error": err, "seconds": time.perf_counter() - t0})
    base = sols["x"]
    # re-anchoring after the span LRA: LRAs at the next kept blocks' inputs, fitted one after the other
    anchors = Anchors(model)
    kept_after = [j for j in range(end + 1, n_layers)] + [n_layers]
    orig = {}
    t0 = time.perf_counter()
    for k in range(1, max(REANCHOR) + 1):
        j = kept_after[k - 1]
        if j >= n_layers:
            break
        if j not in orig:
            orig[j] = states_at(model, fit, j)
        with swapped_blocks(model, {start: FeatureMap("x", base.W.T, base.b, {}), **bypass}):
            anchors.install()
            try:
                h = states_at(model, fit, j)
            finally:
                anchors.remove()
            st = RidgeStats(d, f"anchor {j}")
            st.add_batch(h, orig[j] - h)
            sol = ridge_solve(st, a.damping)
            anchors.maps[j] = (sol.W.T.float(), sol.b.float())
            if k in REANCHOR:
                anchors.install()
                try:
                    kl, top1 = closeness(model, judge, refs)
                finally:
                    anchors.remove()
                land({"map": f"x, then re-anchored at the next {k} block(s)", "kl": kl, "top1": top1,
                      "params": (k + 1) * (d * d + d), "heldout_rel_error": None,
                      "seconds": time.perf_counter() - t0})
    # one least-squares map at the end of the model, after the span map (x, or x and m)
    ends = end_states(model, fit)
    for label, groups in (("x", "x"), ("x, m", "xm")):
        t0, span = time.perf_counter(), sols[groups]
        taps = Taps(model, start)
        try:
            with swapped_blocks(model, {start: FeatureMap(groups, span.W.T, span.b, taps.got), **bypass}):
                mine = end_states(model, fit)
                for where, name in (("pre", "input"), ("post", "output")):
                    st = RidgeStats(d, f"end anchor ({where})")
                    st.add_batch(mine[where], ends[where] - mine[where])
                    sol = ridge_solve(st, a.damping)
                    h = end_anchor(model, where, sol.W.T.float(), sol.b.float())
                    try:
                        kl, top1 = closeness(model, judge, refs)
                    finally:
                        h.remove()
                    land({"map": f"{label}, then a least-squares map at the final norm's {name}", "kl": kl,
                          "top1": top1, "params": span.W.numel() + span.b.numel() + d * d + d,
                          "heldout_rel_error": None, "seconds": time.perf_counter() - t0})
        finally:
            taps.remove()
    rows = doc["rows"]
    lra = next(r["kl"] for r in rows if r["map"] == "x")
    md = [f"# Richer closed-form maps: {a.model}, blocks {first}–{last}", "", f"`{doc['command']}`", "",
          f"{doc['fit_windows']} {doc['text']} calibration windows × {a.seq_len} fitted, {doc['judge_windows']} held out (every "
          "4th; no evaluated doc). KL(original ‖ model) in nats per position (the original's top-256) and top-1 "
          "agreement on the held-out windows; held-out relative error of Δ; parameters of the map(s). Features: x the "
          "span's input, n(x) = x / rms(x), m the MLP branch of the block before the span, a its MLP hidden "
          "activations.", "",
          "| map (features) | KL | vs span LRA | top-1 % | held-out rel. error | parameters |",
          "|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        err = "–" if r["heldout_rel_error"] is None else f"{r['heldout_rel_error']:.3f}"
        md.append(f"| {r['map']} | {r['kl']:.4f} | {r['kl'] / lra - 1:+.1%} | {100 * r['top1']:.1f} | {err} | "
                  f"{r['params']:,} |")
    write_text_atomic(str(out.with_suffix(".md")), "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
