"""Closeness to the original: top-k KL against the exact KL, and the evaluator's KL / top-1 sets."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from shift_lightning.evaluation.runner import EvalConfig, evaluate_model, make_evaluator, record_reference
from shift_lightning.closeness import kd_loss_sum, kl_exact, kl_top1, topk_reference
from shift_lightning.models import build_tiny_model
from shift_lightning.maps.surgery import remove_blocks

ROOT = Path(__file__).resolve().parents[1]
TINY_DATA = ROOT / "tests" / "data" / "eval_tiny"


def _logits(n=40, V=300, seed=0, scale=3.0):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, V, generator=g, dtype=torch.float64)


def test_topk_kl_is_exact_with_the_whole_vocabulary_and_a_lower_bound_otherwise():
    p, q = _logits(seed=0), _logits(seed=1)
    exact = kl_exact(p, q)
    full, agree = kl_top1(q, topk_reference(p, k=p.shape[1]))
    torch.testing.assert_close(full, exact, rtol=1e-5, atol=1e-6)  # the reference is stored in float32
    assert torch.equal(agree, p.argmax(-1) == q.argmax(-1))
    prev = torch.zeros_like(exact)
    for k in (1, 8, 64, 256):
        approx, _ = kl_top1(q, topk_reference(p, k=k))
        assert (approx <= exact + 1e-5).all()             # merging outcomes never increases KL
        assert (approx >= prev - 1e-5).all()              # finer buckets: closer to the exact value
        prev = approx
    # peaked distributions (as a trained LM's): k = 64 of 300 already gives the KL to < 1 %
    p2, q2 = _logits(seed=2, scale=8.0), _logits(seed=2, scale=8.0) + 0.3 * _logits(seed=3)
    e2, a2 = kl_exact(p2, q2), kl_top1(q2, topk_reference(p2, k=64))[0]
    assert ((e2 - a2).sum() / e2.sum()).item() < 0.01
    # identical distributions: zero, top-1 agreement everywhere
    same, agree = kl_top1(p, topk_reference(p, k=16))
    assert same.abs().max() < 1e-12 and agree.all()


@pytest.mark.parametrize("softcap", [None, 5.0])
def test_the_distillation_loss_is_the_measured_kl_and_its_gradient_the_dense_one(softcap):
    """kd_loss_sum (recovery's ``loss: kd``) is kl_top1's KL, summed, for any chunking; its gradient through
    the checkpointed chunks equals that of the same KL written densely over the whole vocabulary."""
    torch.manual_seed(0)
    d, V, n = 16, 300, 37
    head = torch.nn.Linear(d, V, bias=False).double()
    h_p, h_q = torch.randn(n, d, dtype=torch.float64), torch.randn(n, d, dtype=torch.float64)
    cap = (lambda x: torch.tanh(x / softcap) * softcap) if softcap else (lambda x: x)
    with torch.no_grad():
        ref = topk_reference(head(h_p), k=8, softcap=softcap)
        measured, _ = kl_top1(head(h_q), ref, softcap=softcap)
    for chunk in (5, 37, 1024):
        torch.testing.assert_close(kd_loss_sum(h_q, head, ref, softcap, chunk=chunk).double(), measured.sum(),
                                   rtol=1e-6, atol=1e-8)
    # dense: the same k + 1 buckets from the full log-softmax
    x = h_q.clone().requires_grad_(True)
    lq = torch.log_softmax(cap(head(x)), -1)
    lq_k, lp_k = lq.gather(-1, ref.index), ref.logp.double()
    p_tail = 1 - lp_k.exp().sum(-1)
    q_tail = 1 - lq_k.exp().sum(-1)
    dense = ((lp_k.exp() * (lp_k - lq_k)).sum(-1) + p_tail * (p_tail.log() - q_tail.log())).sum()
    g_dense, g_w_dense = torch.autograd.grad(dense, [x, head.weight])
    y = h_q.clone().requires_grad_(True)
    g, g_w = torch.autograd.grad(kd_loss_sum(y, head, ref, softcap, chunk=5), [y, head.weight])
    torch.testing.assert_close(g, g_dense, rtol=1e-6, atol=1e-9)
    torch.testing.assert_close(g_w, g_w_dense, rtol=1e-6, atol=1e-9)
    # the original itself: zero loss, zero gradient
    z = h_p.clone().requires_grad_(True)
    loss = kd_loss_sum(z, head, ref, softcap)
    assert abs(loss.item()) < 1e-5 and torch.autograd.grad(loss, z)[0].abs().max() < 1e-5


def test_evaluator_reports_closeness_on_every_set_with_intervals():
    model, tok = build_tiny_model("llama", num_hidden_layers=6, dtype=torch.float64)
    cfg = EvalConfig(tasks="arc_easy,piqa,winogrande", data_dir=str(TINY_DATA), ppl=str(TINY_DATA / "ppl_text.txt"),
                     ppl_max_windows=3, ppl_seq_len=48, progress=False, batch_size=4, kl=True, kl_docs=5, kl_topk=16)
    ev = make_evaluator(model, tok, cfg)
    assert ev.prompts and len(ev.prompt_labels) == 15  # 5 docs of 3 tasks; WinoGrande: two contexts a doc
    assert sum(lbl.startswith("winogrande") for lbl in ev.prompt_labels) == 5
    assert len([w for w in ev.prompts if ev.prompt_labels[w.item].startswith("winogrande")]) == 10
    record_reference(model, ev)
    same = evaluate_model(model, tok, cfg, ev)
    sets = {str(TINY_DATA / "ppl_text.txt"), "tasks"}
    assert set(same["kl"]) == set(same["top1"]) == sets
    for s in sets:
        assert same["kl"][s] == pytest.approx(0.0, abs=1e-10) and same["top1"][s] == 1.0
    pruned = copy.deepcopy(model)
    remove_blocks(pruned, [2, 3])
    res = evaluate_model(pruned, tok, cfg, ev)
    for s in sets:
        f = res["closeness"][s]
        assert f["kl"] > 0 and 0 <= f["top1"] < 1
        assert f["kl_ci"][0] <= f["kl"] <= f["kl_ci"][1]
        assert len(f["per_item"]["kl"]) == f["items"] and sum(f["per_item"]["n"]) == f["positions"]
    assert res["closeness"]["tasks"]["items"] == 15
    # the perplexity set's positions are exactly its scored tokens
    assert res["closeness"][str(TINY_DATA / "ppl_text.txt")]["positions"] == \
        res["perplexity"][str(TINY_DATA / "ppl_text.txt")]["tokens"]
    # and the numbers do not change the accuracy / perplexity results
    plain = evaluate_model(pruned, tok, EvalConfig(**{**cfg.__dict__, "kl": False}))
    assert plain["tasks"]["piqa"]["per_doc"] == res["tasks"]["piqa"]["per_doc"]
    assert plain["perplexity"] == res["perplexity"] and "kl" not in plain


