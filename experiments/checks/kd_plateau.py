"""Where distillation stops, and why: the training loss on batches the model has not seen yet.

    python experiments/checks/kd_plateau.py
    python experiments/checks/kd_plateau.py --folders '["results/recovery_kd200_mixed"]' --out results/bench/kd_plateau

The recovery table's KD runs (``recovery_table``, ``--recovery.loss kd``) draw ``train_samples`` windows
and cycle through them, ``train_samples / batch_size`` steps an epoch. Each step's logged loss is computed
on its batch *before* the update, so every loss of the first epoch is measured on text the model has not
been trained on: a held-out loss of the training distribution, one batch at a time. From the second epoch
on the batches have been seen. This reads the finished runs (no model is loaded) and puts side by side,
per run:

* the first epoch's loss in quarters (fresh text: how fast the model still learns from new text),
* the second epoch's (seen text: what repeating the windows adds, memorised or not),
* the held-out ``val/kl`` (wiki-summaries held-out windows, the original's top-256; from the run's
  TensorBoard events) at the first epoch's validations, and its change per doubling of steps there
  (least squares of ``val/kl`` on ``log2(step)``, steps 1 … one epoch),
* the tasks' KL of the finished run (the grids' closeness measure).

A second epoch whose loss falls without ``val/kl`` following is memorising the windows; a fresh-text loss
that has flattened says more text at this rate gains little (the README's fine-tuning section runs it: 2.5x
the steps over 3.9x the unseen text gain 5 % in KL). Output: ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import _common as C

DEFAULT_FOLDERS = ["results/recovery", "results/recovery_kd200", "results/recovery_kd200_mixed",
                   "results/recovery_kd100_lr2e-3_mixed", "results/recovery_kd100_lr2e-3_r32_mixed",
                   "results/recovery_kd200_mixed_default", "results/recovery_kd500_fresh_mixed"]


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else float("nan")


def epoch_summary(losses: list[float], steps_per_epoch: int) -> dict:
    """The first epoch's losses in quarters (fresh batches) and the second epoch's mean (seen batches)."""
    e = min(steps_per_epoch, len(losses))
    q = max(e // 4, 1)
    quarters = [_mean(losses[i * q:(i + 1) * q if i < 3 else e]) for i in range(4)] if e >= 4 else [_mean(losses[:e])]
    seen = losses[steps_per_epoch:2 * steps_per_epoch]
    return {"steps_per_epoch": steps_per_epoch, "steps": len(losses), "fresh_quarters": quarters,
            "fresh_last_quarter_minus_second": quarters[-1] - quarters[1] if len(quarters) == 4 else None,
            "seen_mean": _mean(seen) if seen else None,
            "seen_minus_fresh_last_quarter": (_mean(seen) - quarters[-1]) if seen else None}


def per_doubling(points: list[tuple[int, float]], last_step: int) -> float | None:
    """Least-squares slope of ``value`` on ``log2(step)`` over the points with ``0 < step ≤ last_step``."""
    pts = [(math.log2(s), v) for s, v in points if 0 < s <= last_step]
    if len(pts) < 2:
        return None
    mx, my = _mean([x for x, _ in pts]), _mean([y for _, y in pts])
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    return sum((x - mx) * (y - my) for x, y in pts) / sxx if sxx else None


def runs_of(folder: Path) -> list[dict]:
    """The KD run files of a recovery-table folder (``<criterion>/<run>.json``) that have a loss history."""
    docs = [json.loads(f.read_text()) for f in sorted(folder.glob("*/*.json"))]
    return [d for d in docs if d.get("recovery", {}).get("loss") == "kd" and d.get("loss_history")]


def summarize(folder: Path, doc: dict) -> dict:
    cfg = doc.get("config", {})
    bs, n = int(cfg.get("batch_size", 4)), int(cfg.get("train_samples", 512))
    row = {"folder": str(folder), "criterion": doc["criterion"], "run": doc["run"], "repair": doc.get("repair"),
           "lr": doc["recovery"]["lr"], "lora_r": doc["recovery"]["lora_r"],
           "train_source": cfg.get("train_source") or cfg.get("grid", {}).get("text_source"),
           "train_windows": n, **epoch_summary(doc["loss_history"], -(-n // bs)),
           "kl_tasks": (doc.get("kl") or {}).get("tasks")}
    tb = folder / "tb" / doc["criterion"] / doc["run"]
    if tb.exists():
        from experiments.tables.recovery import read_curves

        pts = read_curves(tb).get("val/kl", [])
        row["val_kl"] = [[int(s), float(v)] for s, v in pts]
        row["val_kl_per_doubling_epoch1"] = per_doubling(pts, row["steps_per_epoch"])
    return row


def render(rows: list[dict]) -> str:
    def f(v, sign=False):
        return "–" if v is None else f"{v:+.3f}" if sign else f"{v:.3f}"

    body = []
    for r in rows:
        vk = dict((s, v) for s, v in r.get("val_kl", []))
        e = r["steps_per_epoch"]
        vals = " → ".join(f"{vk[s]:.3f}" for s in sorted(vk) if s <= e) if vk else "–"
        body.append([f"{Path(r['folder']).name}: {r['criterion']} / {r['run']}", f"{r['lr']:g}, r={r['lora_r']}, "
                     f"{r['train_source']}", f"{r['steps']} ({e} an epoch)",
                     " / ".join(f"{q:.3f}" for q in r["fresh_quarters"]),
                     f(r["seen_mean"]), f(r["seen_minus_fresh_last_quarter"], True), vals,
                     f(r.get("val_kl_per_doubling_epoch1"), True), f(r["kl_tasks"])])
    head = ["run", "lr, rank, text", "steps", "fresh-text loss, epoch 1 by quarters", "seen-text loss, epoch 2",
            "epoch 2 − last fresh quarter", "val/kl in epoch 1", "val/kl per doubling (epoch 1)", "KL tasks (end)"]
    return ("# Where distillation stops: the loss on text the model has not seen yet\n\n"
            "`python experiments/checks/kd_plateau.py` (reads the recovery table's run files and TensorBoard events; no model "
            "is loaded). Each step's training loss (KD: KL to the original's top-64 on the training windows) is "
            "computed before that step's update, so in the first epoch every batch is unseen text. "
            "val/kl: held-out wiki-summaries windows, the original's top-256, at each validation of the first epoch.\n\n"
            + C.md_table(head, body) + "\n")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--folders", type=json.loads, default=DEFAULT_FOLDERS,
                   help="recovery-table output folders, a JSON list (missing ones skipped)")
    p.add_argument("--out", default="results/bench/kd_plateau")
    a = p.parse_args(argv)
    rows = [summarize(Path(d), doc) for d in a.folders if Path(d).exists() for doc in runs_of(Path(d))]
    if not rows:
        raise SystemExit(f"no KD runs with a loss history in {a.folders}")
    out = Path(a.out)
    C.write_json(out.with_suffix(".json"), {"rows": rows, "folders": a.folders})
    out.with_suffix(".md").write_text(render(rows))
    print(render(rows))


if __name__ == "__main__":
    main()
