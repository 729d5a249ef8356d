"""Compare two folders of grid runs run for run: did another machine (GPU vs CPU, another torch) give
the same numbers?

    python -m experiments.compare_runs --a results/paper/smollm2-135m \\
        --b /tmp/gpu/smollm2-135m --out results/paper/device_check

For every run file present in both folders (``original.json``, ``<criterion>/<variant>.json``; the
``selection.json`` files compare the chosen blocks) it counts the per-doc outcomes (acc, acc_norm of
every scored doc) that differ, the largest task-accuracy difference and the relative perplexity
difference, and names each side's software and device. Writes ``<out>.json`` and ``<out>.md``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from shift_lightning.errors import ConfigError
from shift_lightning.outputs import write_json_atomic, write_text_atomic


@dataclass
class CompareConfig:
    """Two run folders (the same grid, e.g. ``results/paper/<model>``) and where the report goes."""

    a: str
    """First folder of run files (the reference)."""
    b: str
    """Second folder (the same runs, made elsewhere)."""
    out: str = "results/paper/device_check"
    """Report path without suffix: ``<out>.json`` and ``<out>.md``."""


def _per_doc_diff(x: dict, y: dict) -> tuple[int, int]:
    """(differing, total) per-doc outcome fields of one task; docs matched by id."""
    if x.get("doc_ids") != y.get("doc_ids"):
        raise ConfigError("the two runs scored different docs (doc_ids differ): not the same grid")
    diff = n = 0
    for k, v in x.items():
        if k == "doc_ids" or not isinstance(v, list) or k not in y:
            continue
        diff += sum(1 for p, q in zip(v, y[k]) if p != q)
        n += len(v)
    return diff, n


def compare_run(a: dict, b: dict) -> dict:
    """One run made twice: per-doc outcome flips, largest task difference, relative PPL differences."""
    flips = total = 0
    task_diff = {}
    for t, ea in a["tasks"].items():
        eb = b["tasks"][t]
        task_diff[t] = eb["value"] - ea["value"]
        if "per_doc" in ea and "per_doc" in eb:
            d, n = _per_doc_diff(ea["per_doc"], eb["per_doc"])
            flips, total = flips + d, total + n
    ppl = {p: abs(b["perplexity"][p]["ppl"] - e["ppl"]) / e["ppl"] for p, e in a["perplexity"].items()}
    return {"per_doc_outcomes": total, "per_doc_differing": flips,
            "max_abs_task_diff": max((abs(v) for v in task_diff.values()), default=0.0),
            "avg_a": a["average"], "avg_b": b["average"], "ppl_rel_diff": ppl,
            "device_a": a.get("software", {}).get("device", "cpu"), "device_b": b.get("software", {}).get("device", "cpu")}


def run(cfg: CompareConfig) -> dict:
    A, B = Path(cfg.a), Path(cfg.b)
    for p in (A, B):
        if not p.is_dir():
            raise ConfigError(f"{p} is not a folder of run files (e.g. results/paper/smollm2-135m)")
    rows, selections = [], []
    for fb in sorted(B.rglob("*.json")):
        rel = fb.relative_to(B).as_posix()
        fa = A / rel
        if not fa.exists():
            continue
        a, b = json.loads(fa.read_text()), json.loads(fb.read_text())
        if fb.name == "selection.json":
            selections.append({"criterion": fb.parent.name, "same_blocks": sorted(a["layers"]) == sorted(b["layers"])})
            continue
        rows.append({"run": rel.removesuffix(".json"), **compare_run(a, b)})
    if not rows:
        raise ConfigError(f"no run file is in both {A} and {B}")
    first_a = json.loads((A / f"{rows[0]['run']}.json").read_text())
    first_b = json.loads((B / f"{rows[0]['run']}.json").read_text())
    summary = {"runs": len(rows), "per_doc_outcomes": sum(r["per_doc_outcomes"] for r in rows),
               "per_doc_differing": sum(r["per_doc_differing"] for r in rows),
               "max_abs_task_diff": max(r["max_abs_task_diff"] for r in rows),
               "max_ppl_rel_diff": max(max(r["ppl_rel_diff"].values(), default=0.0) for r in rows),
               "selections_equal": all(s["same_blocks"] for s in selections),
               "software_a": first_a.get("software"), "software_b": first_b.get("software")}
    doc = {"a": str(A), "b": str(B), "summary": summary, "selections": selections, "rows": rows}
    out = Path(cfg.out)
    write_json_atomic(out.with_suffix(".json"), doc)
    write_text_atomic(out.with_suffix(".md"), markdown(doc))
    return doc


def markdown(doc: dict) -> str:
    s = doc["summary"]
    lines = [f"# The same runs on two machines: `{doc['a']}` vs `{doc['b']}`", "",
             f"A: {s['software_a']}", "", f"B: {s['software_b']}", "",
             f"{s['runs']} runs in both: {s['per_doc_differing']} of {s['per_doc_outcomes']} per-doc outcomes "
             f"(acc, acc_norm of every scored doc) differ; largest task-accuracy difference "
             f"{100 * s['max_abs_task_diff']:.2f} points; largest relative perplexity difference "
             f"{s['max_ppl_rel_diff']:.1e}" + (f"; block selections equal: {s['selections_equal']}"
                                               if doc["selections"] else "") + ".", "",
             "| run | Avg A | Avg B | per-doc outcomes differing | max task Δ (points) | "
             "max PPL relative Δ |", "|---|---:|---:|---:|---:|---:|"]
    for r in doc["rows"]:
        lines.append(f"| {r['run']} | {100 * r['avg_a']:.2f} | {100 * r['avg_b']:.2f} | "
                     f"{r['per_doc_differing']} / {r['per_doc_outcomes']} | {100 * r['max_abs_task_diff']:.2f} | "
                     f"{max(r['ppl_rel_diff'].values(), default=0.0):.1e} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None):
    from experiments.cli import dataclass_main

    def go(cfg: CompareConfig):
        doc = run(cfg)
        s = doc["summary"]
        print(f"{s['runs']} runs compared: {s['per_doc_differing']}/{s['per_doc_outcomes']} per-doc outcomes differ, "
              f"max PPL relative difference {s['max_ppl_rel_diff']:.1e}; report in {cfg.out}.md")
        return doc

    return dataclass_main(CompareConfig, go, __doc__.splitlines()[0], argv)


if __name__ == "__main__":
    main()
