"""One-off migration of the committed results to the consolidated names (run once; kept as the record of what
changed): in every JSON file under ``results/`` the keys ``fidelity`` → ``closeness`` (the distance to the original)
and ``guard_every`` → ``heldout_every`` (the held-out split); in JSON and Markdown alike, the recorded commands
of tools that moved: ``python -m shift_lightning.recipes.<grid>`` → ``python -m experiments.<grid>`` (the
``fidelity_*`` tools as ``closeness_*``), ``benchmarks/<check>.py`` → ``experiments/checks/<check>.py``. Numbers are
untouched; JSON is written back in the layout the tools write it in (``indent=1``).

    python -m experiments.migrate_results [--check]     # --check: only say which files would change
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = {"fidelity": "closeness", "guard_every": "heldout_every"}
CHECKS = ("anchored_check", "criteria_lra_table", "criteria_table", "damping_sweep", "fidelity_topk", "guard_cost",
          "kd_plateau", "linear_fit_check", "linearpatch_check", "low_rank_check", "refit_check",
          "replaceme_cosine_check", "richer_maps_check")
GRIDS = ("ablations", "compare_runs", "domain_compare", "harness", "recovery_table", "reproduce", "robust_vs_kl",
         "targets_summary")
RENAMED = {"fidelity_sweep": "closeness_sweep", "fidelity_table": "closeness_table"}


def new_text(s: str) -> str:
    """Moved tools' paths and module names, in any text."""
    s = re.sub(r"shift_lightning([./])recipes\1(fidelity_sweep|fidelity_table)\b",
               lambda m: f"experiments{m.group(1)}{RENAMED[m.group(2)]}", s)
    s = re.sub(r"shift_lightning([./])recipes\1(" + "|".join(GRIDS) + r"|tables)\b",
               lambda m: f"experiments{m.group(1)}{m.group(2)}", s)
    s = re.sub(r"shift_lightning([./])evaluation\1trunk\b", lambda m: f"experiments{m.group(1)}trunk", s)
    return re.sub(r"\bbenchmarks/(" + "|".join(CHECKS) + r")\.py", r"experiments/checks/\1.py", s)


def migrate(doc):
    if isinstance(doc, dict):
        return {KEYS.get(k, k): migrate(v) for k, v in doc.items()}
    if isinstance(doc, list):
        return [migrate(v) for v in doc]
    return new_text(doc) if isinstance(doc, str) else doc


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--root", default=str(ROOT / "results"))
    ap.add_argument("--check", action="store_true")
    a = ap.parse_args(argv)
    changed = []
    for f in sorted(Path(a.root).rglob("*")):
        if f.suffix == ".json":
            old = f.read_text()
            new = json.dumps(migrate(json.loads(old)), indent=1, default=str) + "\n"
            if json.dumps(json.loads(old), indent=1, default=str) + "\n" != old:  # not written by our tools: text only
                new = new_text(old).replace('"fidelity":', '"closeness":').replace('"guard_every":', '"heldout_every":')
        elif f.suffix == ".md":
            old = f.read_text()
            new = new_text(old)
        else:
            continue
        if new != old:
            changed.append(f)
            if not a.check:
                f.write_text(new)
    print(f"{len(changed)} files {'would change' if a.check else 'migrated'} under {a.root}")


if __name__ == "__main__":
    main()
