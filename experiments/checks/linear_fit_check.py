"""Does ``linear_fit``'s cost predict how close the repaired model stays to the original?

    python experiments/checks/linear_fit_check.py --model smollm2-135m --out results/bench/linear_fit_check_smollm2

``linear_fit`` scores a span by the residual energy its merged per-block LRA leaves unexplained on
held-out windows (cheap: one fitting pass and one judging pass for every span at once). The
alternative would judge each candidate span by the repaired *model*'s next-token KL to the
original (one forward pass per candidate). This measures, on the same windows the criterion uses
(64 × 512 calibration tokens; every 4th window judges, the LRAs are fitted on the others), for
every span of ``--lengths`` blocks: the criterion's cost, the repaired model's KL on the judging
windows, the plain pruned model's KL, and the span's angular distance (what the identity map
leaves, the ``angular`` criterion). Reported: Spearman rank correlations with the repaired KL, and
the rank (by repaired KL) of the span each score would choose.
"""

from __future__ import annotations

import argparse
import time

import _common as C

import torch  # noqa: E402

from shift_lightning.arch import Bypass, swapped_blocks  # noqa: E402
from shift_lightning.calibration import CalibrationConfig, CalibrationModule  # noqa: E402
from shift_lightning.maps.fitted import chain  # noqa: E402
from shift_lightning.criteria import PruneConfig  # noqa: E402
from shift_lightning.data import TextDataConfig, build_windows  # noqa: E402
from shift_lightning.closeness import kl_top1, lm_softcap, topk_reference  # noqa: E402
from shift_lightning.outputs import write_json_atomic, write_text_atomic  # noqa: E402
from shift_lightning.selection import select_blocks  # noqa: E402


@torch.no_grad()
def model_logits(model, windows, batch=2):
    out = []
    for s in range(0, len(windows), batch):
        ids, mask = windows.input_ids[s:s + batch], windows.attention_mask[s:s + batch]
        out.append(model(input_ids=ids, attention_mask=mask, use_cache=False).logits[mask.bool()].float())
    return torch.cat(out)


def spearman(a, b) -> float:
    ra = torch.tensor(a).argsort().argsort().double()
    rb = torch.tensor(b).argsort().argsort().double()
    ra, rb = ra - ra.mean(), rb - rb.mean()
    return float((ra * rb).sum() / (ra.norm() * rb.norm()))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--calib_samples", type=int, default=64)
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--lengths", default="1,7")
    ap.add_argument("--out", default="results/bench/linear_fit_check_smollm2")
    a = ap.parse_args(argv)
    t0 = time.time()
    model, tok = C.build_model(a.model, torch.device("cpu"))
    L = model.config.num_hidden_layers
    windows = build_windows(TextDataConfig(num_samples=a.calib_samples, seq_len=a.seq_len), tok, model.config.model_type)
    import lightning as Lt

    trainer = Lt.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, inference_mode=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    lengths = [int(x) for x in a.lengths.split(",")]
    k = max(lengths)
    t1 = time.time()
    sel = select_blocks(PruneConfig(criterion="linear_fit", ratio=(k + 0.5) / L), model, windows, lambda: trainer)
    criterion_seconds = time.time() - t1
    costs = {tuple(int(x) for x in key.split("-")): v for key, v in sel.details["span_costs"].items()}
    fit = windows.subset([i for i in range(len(windows)) if i % 4 != 3])
    judge = windows.subset([i for i in range(len(windows)) if i % 4 == 3])
    cal = CalibrationModule(model, list(range(L)), CalibrationConfig(solver="lra", heldout=False))
    cal.calibrate(trainer, fit, batch_size=4)
    softcap = lm_softcap(model)
    ref = topk_reference(model_logits(model, judge), 64, softcap)
    angular_sel = select_blocks(PruneConfig(criterion="angular", ratio=(k + 0.5) / L, angular_tokens="all"), model,
                                judge, lambda: trainer)
    rows = []
    for n in lengths:
        for s in range(0, L - n + 1):
            blocks = list(range(s, s + n))
            adapter = chain([cal.adapter("lra", cal.sites[j]) for j in blocks], True)
            pruned = {j: Bypass() for j in blocks}
            repaired = {**{j: Bypass() for j in blocks[:-1]}, blocks[-1]: Bypass(adapter)}
            kl = {}
            for name, swap in (("pruned", pruned), ("repaired", repaired)):
                with swapped_blocks(model, swap):
                    kl[name] = float(kl_top1(model_logits(model, judge), ref, softcap)[0].mean())
            row = {"blocks": f"{s}-{s + n - 1}", "length": n, "cost": costs[(s, s + n - 1)],
                   "kl_repaired": kl["repaired"], "kl_pruned": kl["pruned"]}
            if n == k:
                row["angular"] = angular_sel.scores[s]
            rows.append(row)
            print(row, flush=True)
    summary = []
    for n in lengths:
        rs = [r for r in rows if r["length"] == n]
        by_kl = sorted(rs, key=lambda r: r["kl_repaired"])
        rank = {r["blocks"]: i + 1 for i, r in enumerate(by_kl)}
        entry = {"length": n, "spans": len(rs),
                 "spearman_cost_vs_repaired_kl": spearman([r["cost"] for r in rs], [r["kl_repaired"] for r in rs]),
                 "spearman_pruned_kl_vs_repaired_kl": spearman([r["kl_pruned"] for r in rs],
                                                               [r["kl_repaired"] for r in rs]),
                 "best_by_repaired_kl": by_kl[0]["blocks"],
                 "rank_of_lowest_cost": rank[min(rs, key=lambda r: r["cost"])["blocks"]],
                 "rank_of_lowest_pruned_kl": rank[min(rs, key=lambda r: r["kl_pruned"])["blocks"]]}
        if all("angular" in r for r in rs):
            entry["spearman_angular_vs_repaired_kl"] = spearman([r["angular"] for r in rs],
                                                                [r["kl_repaired"] for r in rs])
            entry["rank_of_lowest_angular"] = rank[min(rs, key=lambda r: r["angular"])["blocks"]]
        summary.append(entry)
    doc = {"command": "python experiments/checks/linear_fit_check.py " + " ".join(f"--{x} {v}" for x, v in vars(a).items()),
           "model": a.model, "criterion_seconds": criterion_seconds, "seconds": time.time() - t0,
           "machine": C.machine(torch.device("cpu")), "summary": summary, "rows": rows}
    write_json_atomic(a.out + ".json", doc)
    md = [f"# linear_fit's cost against the repaired model's closeness: {a.model}", "",
          f"`{doc['command']}` — {judge.num_tokens:,} judging tokens (every 4th of {len(windows)} calibration windows); "
          f"the criterion took {criterion_seconds:.0f} s (one fitting pass, one judging pass, all spans).", "",
          "| span length | spans | Spearman(cost, repaired KL) | Spearman(angular, repaired KL) | "
          "Spearman(pruned KL, repaired KL) | best span by repaired KL | repaired-KL rank of the lowest-cost span | … of the lowest-angular span |",
          "|---:|---:|---:|---:|---:|---|---:|---:|"]
    for e in summary:
        md.append(f"| {e['length']} | {e['spans']} | {e['spearman_cost_vs_repaired_kl']:.3f} | "
                  f"{e.get('spearman_angular_vs_repaired_kl', float('nan')):.3f} | "
                  f"{e['spearman_pruned_kl_vs_repaired_kl']:.3f} | {e['best_by_repaired_kl']} | "
                  f"{e['rank_of_lowest_cost']} | {e.get('rank_of_lowest_angular', '–')} |")
    md += ["", "| span | cost | repaired KL | pruned KL | angular |", "|---|---:|---:|---:|---:|"]
    for r in rows:
        md.append(f"| {r['blocks']} | {r['cost']:.4f} | {r['kl_repaired']:.4f} | {r['kl_pruned']:.4f} | "
                  f"{r.get('angular', float('nan')):.4f} |")
    write_text_atomic(a.out + ".md", "\n".join(md) + "\n")
    print("\n".join(md[:8]))


if __name__ == "__main__":
    main()
