"""Local copies of our task data in lm-evaluation-harness's own task format (shared by the lm-eval tests).

For each task: a JSONL copy of the docs (the harness's HF schema) and a YAML that ``include:``s the
harness's task file with ``dataset_path: json`` pointing at that copy, so
``TaskManager(include_path=root)`` runs the harness's own prompts and metrics on exactly our docs.
"""

from __future__ import annotations

import json
from pathlib import Path

TASKS = ["arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "boolq", "openbookqa"]
#: harness YAML (relative to lm_eval/tasks) and the split key it evaluates.
HARNESS = {
    "arc_easy": ("arc/arc_easy.yaml", "test"), "arc_challenge": ("arc/arc_challenge.yaml", "test"),
    "hellaswag": ("hellaswag/hellaswag.yaml", "validation"), "piqa": ("piqa/piqa.yaml", "validation"),
    "winogrande": ("winogrande/default.yaml", "validation"), "boolq": ("super_glue/boolq/default.yaml", "validation"),
    "openbookqa": ("openbookqa/openbookqa.yaml", "test"),
}


def write_local_tasks(root: Path, n_docs: int | None = None, tasks=TASKS, data_dir: str | None = None,
                      prefix: str = "parity") -> list[str]:
    """JSONL copies (``root/<task>.jsonl``, the first ``n_docs`` docs of the offline copies, or of
    ``data_dir``'s files) + YAMLs that include the harness's task files; returns the harness task names
    (``<prefix>_<task>``)."""
    import lm_eval

    from shift_lightning.evaluation.tasks import TASKS as OURS, load_raw_docs

    tasks_dir = Path(lm_eval.__file__).parent / "tasks"
    names = []
    for t in tasks:
        docs, _ = load_raw_docs(OURS[t], data_dir=data_dir)
        docs = docs[:n_docs] if n_docs is not None else docs
        if t == "boolq":  # original BoolQ -> SuperGLUE label semantics (1 = yes)
            docs = [dict(d, label=int(d["answer"])) for d in docs]
        data = root / f"{t}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        yaml_path, split = HARNESS[t]
        other = [s for s in ("training_split", "validation_split", "test_split") if not s.startswith(split)]
        (root / f"{prefix}_{t}.yaml").write_text(
            f"include: {tasks_dir / yaml_path}\ntask: {prefix}_{t}\ntag: []\ndataset_path: json\n"
            f"dataset_name: null\ndataset_kwargs:\n  data_files:\n    {split}: {data}\n{split}_split: {split}\n"
            + "".join(f"{o}: null\n" for o in other)
        )
        names.append(f"{prefix}_{t}")
    return names
