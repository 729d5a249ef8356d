"""Peer maps fitted like the LRA (no bias, generic affine, ReplaceMe, LinearPatch): known answers,
float64 references, the ReplaceMe fold, save -> load round trips, and several kinds from one pass."""

from __future__ import annotations

import copy
from dataclasses import replace
from pathlib import Path

import lightning as L
import pytest
import torch
from torch import nn
from torch.testing import assert_close

from shift_lightning import load_pretrained
from shift_lightning.arch import decoder_layers, mlp_branch
from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.data import TextDataConfig, build_windows
from shift_lightning.errors import ConfigError
from shift_lightning.models import build_tiny_model
from shift_lightning.maps.peers import fold_replaceme, hadamard, linearpatch_matrix
from shift_lightning.checkpoint import save_pretrained
from shift_lightning.maps.surgery import apply_maps, remove_blocks

ROOT = Path(__file__).resolve().parents[1]
CORPUS = str(ROOT / "tests" / "data" / "tiny_corpus.txt")


def _trainer():
    return L.Trainer(accelerator="cpu", devices=1, inference_mode=False, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def _windows(tok, n=8, seq_len=64, packing=False):
    return build_windows(TextDataConfig(source=CORPUS, num_samples=n, seq_len=seq_len, packing=packing), tok)


class BlockTap:
    """What a stand-in block reads of an earlier block ``j``: the value a hook inside block ``j`` saw (its MLP
    branch's output, or the input of its ``down_proj`` with ``pre=True``), looked up by block ``j``'s output, which
    is the next block's input. Found in any order of blocks and batches: the walks run block ``j`` on every batch
    before block ``j + 1``."""

    def __init__(self, block: nn.Module, inner: nn.Module, pre: bool = False):
        self.values, self._last = {}, None
        if pre:
            inner.register_forward_pre_hook(lambda mod, a: setattr(self, "_last", a[0]))
        else:
            inner.register_forward_hook(lambda mod, a, out: setattr(self, "_last", out))
        block.register_forward_hook(lambda mod, a, out: self.values.__setitem__(
            self.key(out[0] if isinstance(out, tuple) else out), self._last))

    @staticmethod
    def key(h: torch.Tensor) -> tuple:
        return tuple(h.shape), float(h.double().sum()), float(h.reshape(-1)[::7].double().square().sum())

    def __getitem__(self, h: torch.Tensor) -> torch.Tensor:
        return self.values[self.key(h)]


class Linear(nn.Module):
    """A stand-in block that is exactly ``y = x Aᵀ + c`` (plus ``m Bᵀ`` if it reads a branch: a :class:`BlockTap`)."""

    def __init__(self, A, c=None, branch=None, B=None):
        super().__init__()
        self.A, self.c, self.branch, self.B = A, c, branch, B

    def forward(self, hidden_states, *args, **kwargs):
        y = hidden_states @ self.A.T.to(hidden_states)
        if self.c is not None:
            y = y + self.c.to(hidden_states)
        if self.branch is not None:
            y = y + self.branch[hidden_states] @ self.B.T.to(hidden_states)
        return y


def _rand(d, seed, scale=0.2):
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(d, d, generator=g, dtype=torch.float64)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model("llama", num_hidden_layers=6, dtype=torch.float64)


#: Variants of one pass (a key and the knobs that differ): one LRA per span; the guard with both extra candidates.
SPAN_LRA = {"solver": "lra", "granularity": "span"}
JOINT_GUARD = {"solver": "guarded", "guarded": {"extra": ["span_lra", "lra_replaceme"]}}


def _fit(model, removed, kinds, windows, damping=1e-10):
    mod = CalibrationModule(model, removed, CalibrationConfig(damping=damping), solvers=kinds)
    mod.calibrate(_trainer(), windows, batch_size=4)
    return mod


def test_exactly_linear_spans_are_recovered_exactly(tiny):
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    d = model.config.hidden_size
    eye = torch.eye(d, dtype=torch.float64)
    W0, c0 = _rand(d, 1), 0.1 * torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    A0 = _rand(d, 3, 0.3) + eye
    blocks = decoder_layers(model)
    blocks[2] = Linear(eye + W0)               # residual without bias: nobias recovers W0 exactly
    blocks[4] = Linear(A0, c0)                 # generic affine: the LRA recovers A0 − I, c0 exactly
    mod = _fit(model, [2, 4], ["lra", "nobias"], _windows(tok))
    s2, s4 = mod.sites
    assert_close(mod.solution(s2, "nobias").W, W0, rtol=1e-6, atol=1e-7)
    assert mod.solution(s2, "nobias").b.abs().max() == 0
    assert_close(mod.solution(s2, "lra").W, W0, rtol=1e-6, atol=1e-7)
    assert_close(mod.solution(s4, "lra").W, A0 - eye, rtol=1e-6, atol=1e-7)
    assert_close(mod.solution(s4, "lra").b, c0, rtol=1e-6, atol=1e-7)
    assert mod.reports[s2.key]["solvers"]["nobias"]["calib_rel_error"] < 1e-10
    # the adapters reproduce the blocks they replace
    x = torch.randn(3, 5, d, dtype=torch.float64)
    assert_close(mod.adapter("nobias", s2)(x), x @ (eye + W0).T)
    assert_close(mod.adapter("lra", s4)(x), x @ A0.T + c0)


def test_nobias_equals_uncentred_float64_ridge(tiny):
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    win = _windows(tok)
    cap = {}
    blocks = decoder_layers(model)
    h1 = blocks[3].register_forward_pre_hook(lambda m, a, k: cap.__setitem__("x", a[0] if a else k["hidden_states"]),
                                             with_kwargs=True)
    h2 = blocks[3].register_forward_hook(lambda m, a, o: cap.__setitem__("y", o[0] if isinstance(o, tuple) else o))
    with torch.no_grad():
        model(input_ids=win.input_ids, attention_mask=win.attention_mask, use_cache=False)
    h1.remove(), h2.remove()
    m = win.attention_mask.bool()
    x, dl = cap["x"][m], (cap["y"] - cap["x"])[m]
    S = x.T @ x
    lam = 1e-3 * S.diagonal().mean()
    W = torch.linalg.solve(S + lam * torch.eye(x.shape[1], dtype=x.dtype), x.T @ dl).T
    mod = _fit(model, [3], ["nobias"], win, damping=1e-3)
    assert_close(mod.solution(mod.sites[0], "nobias").W, W, rtol=1e-8, atol=1e-10)


def test_replaceme_recovers_a_span_linear_in_the_mlp_branch_and_folds_exactly(tiny):
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    d = model.config.hidden_size
    T0 = torch.eye(d, dtype=torch.float64) + _rand(d, 7, 0.3)
    blocks = decoder_layers(model)
    shared = BlockTap(blocks[1], mlp_branch(blocks[1]))
    # blocks 2, 3 together add m (T0 - I): exactly what ReplaceMe's folded map reproduces
    blocks[2] = Linear(torch.eye(d, dtype=torch.float64), branch=shared, B=(T0 - torch.eye(d, dtype=torch.float64)).T)
    blocks[3] = Linear(torch.eye(d, dtype=torch.float64))
    win = _windows(tok)
    ids = win.input_ids[:2]
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    mod = _fit(model, [2, 3], ["replaceme"], win)
    corr = mod.fitted_maps("replaceme")
    assert list(corr.branch_maps) == [1]
    assert_close(corr.branch_maps[1], T0, rtol=1e-6, atol=1e-7)
    assert mod.reports[mod.sites[0].key]["calib_rel_error"] < 1e-10
    remove_blocks(model, [2, 3])
    for b in decoder_layers(model):
        b._forward_hooks.clear()
    apply_maps(model, corr, 6, [2, 3])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    assert_close(out, ref, rtol=1e-6, atol=1e-6)  # the pruned, folded model equals the original
    assert not list(model.model.shift_adapters.sites)  # no adapter, no hook: a stock HF model


def test_replaceme_fold_equals_unfolded_map_and_is_a_stock_hf_model(tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    d = model.config.hidden_size
    T = torch.eye(d, dtype=torch.float64) + _rand(d, 11)
    ids = torch.tensor([[5, 9, 33, 100, 7, 8]])
    unfolded = copy.deepcopy(model)
    mlp_branch(decoder_layers(unfolded)[2]).register_forward_hook(lambda m, a, out: out @ T)
    fold_replaceme(decoder_layers(model)[2], T)
    with torch.no_grad():
        assert_close(model(ids).logits, unfolded(ids).logits, rtol=1e-10, atol=1e-10)
    save_pretrained(model, tok, tmp_path, {"original_num_layers": 6, "pruned_layers": []})
    stock = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    with torch.no_grad():
        assert_close(stock(ids).logits, model(ids).logits, rtol=1e-12, atol=1e-12)


def test_replaceme_on_gemma3_wraps_the_post_mlp_norm_and_round_trips(tmp_path):
    model, tok = build_tiny_model("gemma3", num_hidden_layers=6, dtype=torch.float64)
    win = _windows(tok)
    mod = _fit(model, [3, 4], ["replaceme"], win, damping=1e-4)
    ids = win.input_ids[:2, :20]
    remove_blocks(model, [3, 4])
    apply_maps(model, mod.fitted_maps("replaceme"), 6, [3, 4])
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    save_pretrained(model, tok, tmp_path, {"original_num_layers": 6, "pruned_layers": [3, 4]})
    m2, _ = load_pretrained(tmp_path)
    with torch.no_grad():
        assert torch.equal(m2(input_ids=ids, use_cache=False).logits, ref)
    assert m2.generate(ids[:1, :5], max_new_tokens=3, do_sample=False).shape[1] == 8


def _joint_span_model(family, rank=None):
    """A tiny model whose blocks 2–3 add ``x A0ᵀ + m B0ᵀ + c0`` (``m``: block 1's MLP branch): exactly the joint map
    (``A0`` of rank ``rank`` if given)."""
    model, tok = build_tiny_model(family, num_hidden_layers=6, dtype=torch.float64)
    d = model.config.hidden_size
    eye = torch.eye(d, dtype=torch.float64)
    A0, B0 = _rand(d, 5, 0.2), _rand(d, 6, 3.0)  # a random model's branch is much smaller than x
    if rank is not None:
        U, S, Vh = torch.linalg.svd(A0)
        A0 = U[:, :rank] @ torch.diag(S[:rank]) @ Vh[:rank]
    c0 = 0.1 * torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(7))
    blocks = decoder_layers(model)
    shared = BlockTap(blocks[1], mlp_branch(blocks[1]))
    blocks[2] = Linear(eye + A0, c0, branch=shared, B=B0)
    blocks[3] = Linear(eye)
    return model, tok


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_joint_lra_and_replaceme_recovers_a_span_linear_in_x_and_the_branch_and_places_it_exactly(family, tmp_path):
    """Neither the span LRA nor ReplaceMe can fit a span that adds ``x A0ᵀ + m B0ᵀ + c0``; the joint map does,
    and its two halves (branch map before the span, adapter after it) give back the original model exactly,
    folded (Llama) or after the post-MLP norm (Gemma3), saved and loaded."""
    model, tok = _joint_span_model(family)
    win = _windows(tok)
    ids = win.input_ids[:2, :24]
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    mod = _fit(model, [2, 3], {"lra_replaceme": {}, "lra_span": SPAN_LRA, "replaceme": {}}, win)
    errors = mod.reports[mod.spans[0].key]["solvers"]
    assert errors["lra_replaceme"]["calib_rel_error"] < 1e-9
    assert errors["lra_span"]["calib_rel_error"] > 1e-3 and errors["replaceme"]["calib_rel_error"] > 1e-3
    assert errors["lra_replaceme"]["cond_I_plus_A"] < 1e3
    corr = mod.fitted_maps("lra_replaceme")
    assert list(corr.branch_maps) == [1] and list(corr.adapters) == [2]
    remove_blocks(model, [2, 3])
    apply_maps(model, corr, 6, [2, 3])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    assert_close(out, ref, rtol=1e-6, atol=1e-6)  # the pruned, corrected model equals the original
    save_pretrained(model, tok, tmp_path, {"original_num_layers": 6, "pruned_layers": [2, 3],
                                           "solver": "lra_replaceme"})
    m2, _ = load_pretrained(tmp_path)
    with torch.no_grad():
        assert_close(m2(input_ids=ids, use_cache=False).logits, out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_low_rank_joint_map_recovers_a_low_rank_span_exactly_with_2dr_plus_d_parameters(family, tmp_path):
    """``--calibration.rank r`` with the joint map: the adapter after the span is rank r (``2dr + d``
    parameters), the branch map stays full; a span adding ``x A0ᵀ + m B0ᵀ + c0`` with rank(A0) = r is
    recovered exactly (the pruned, corrected model equals the original, saved and loaded), which the
    rank-r span LRA cannot do."""
    from shift_lightning.maps.lra import LinearResidualAdapter

    r = 3
    model, tok = _joint_span_model(family, rank=r)
    d = model.config.hidden_size
    win = _windows(tok)
    ids = win.input_ids[:2, :24]
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    mod = CalibrationModule(model, [2, 3], CalibrationConfig(damping=1e-10, rank=r),
                            solvers={"lra_replaceme": {}, "lra_span": SPAN_LRA})
    mod.calibrate(_trainer(), win, batch_size=4)
    errors = mod.reports[mod.spans[0].key]["solvers"]
    assert errors["lra_replaceme"]["calib_rel_error"] < 1e-9 < 1e-3 < errors["lra_span"]["calib_rel_error"]
    sol = mod.solution(mod.spans[0], "lra_replaceme")
    assert sol.U.shape == sol.V.shape == (d, r) and torch.linalg.matrix_rank(sol.T - torch.eye(d, dtype=torch.float64)) == d
    corr = mod.fitted_maps("lra_replaceme")
    adapter = corr.adapters[2]
    assert isinstance(adapter, LinearResidualAdapter) and adapter.spec.rank == r
    assert sum(p.numel() for p in adapter.parameters()) == 2 * d * r + d
    remove_blocks(model, [2, 3])
    apply_maps(model, corr, 6, [2, 3])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    assert_close(out, ref, rtol=1e-6, atol=1e-6)
    save_pretrained(model, tok, tmp_path, {"original_num_layers": 6, "pruned_layers": [2, 3],
                                           "solver": "lra_replaceme"})
    m2, _ = load_pretrained(tmp_path)
    with torch.no_grad():
        assert_close(m2(input_ids=ids, use_cache=False).logits, out, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("holdout", [False, True])
def test_a_site_with_joint_statistics_takes_its_io_from_them(tiny, holdout):
    """``io`` is not accumulated again where ``joint`` is (a block of it, copied out after the pass): the same
    sums as a pass that gathers ``io`` alone, held-out copies included, spans at block 0 (no joint) untouched."""
    from shift_lightning.calibration.collect import Collector, StopForward
    from shift_lightning.maps.sites import Site

    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    win = _windows(tok, seq_len=512)
    assert (win.attention_mask == 0).any()  # padding, masked out of every sum
    sites = [Site(0, 0, 1), Site(1, 2, 4)]
    k = 4 if holdout else None
    both = Collector(model.config.hidden_size, [(s, {"io", "joint"}) for s in sites], heldout_every=k)
    alone = Collector(model.config.hidden_size, [(s, {"io"}) for s in sites], heldout_every=k)
    for col in (both, alone):
        col.allocate("cpu")
        for i in range(0, 8, 4):
            col.batch(win.attention_mask[i:i + 4].bool(), torch.arange(i, i + 4))
            handles = col.install(model)
            try:
                with torch.no_grad():
                    model(input_ids=win.input_ids[i:i + 4], attention_mask=win.attention_mask[i:i + 4],
                          use_cache=False)
            except StopForward:
                pass
            finally:
                for h in handles:
                    h.remove()
        col.derive()
    assert both.stats[(0, 1)].joint is None and both.stats[(2, 4)].joint is not None
    for key in ((0, 1), (2, 4)):
        for attr in ("io", "held_io") if holdout else ("io",):
            a, b = getattr(both.stats[key], attr), getattr(alone.stats[key], attr)
            assert a.num_tokens == b.num_tokens > 0
            assert_close(a.buffer, b.buffer, rtol=1e-10, atol=1e-8)


def test_guarded_joint_judges_the_joint_map_on_held_out_windows_and_keeps_it_where_it_is_exact():
    model, tok = _joint_span_model("llama")
    win = _windows(tok)
    ids = win.input_ids[:2, :24]
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    mod = _fit(model, [2, 3], {"guarded_joint": JOINT_GUARD, "lra_replaceme": {}}, win)
    guard = mod.reports[mod.spans[0].key]["guards"]["guarded_joint"]
    assert guard["chosen"] == "lra+replaceme" and guard["kl"]["lra+replaceme"] < 1e-8
    assert {"none", "lra@span", "replaceme", "lra+replaceme"} <= set(guard["kl"])
    assert guard["kl"]["lra@span"] > 100 * guard["kl"]["lra+replaceme"]  # the others cannot reach it
    corr = mod.fitted_maps("guarded_joint")
    assert_close(corr.branch_maps[1], mod.fitted_maps("lra_replaceme").branch_maps[1])  # refitted on all windows
    remove_blocks(model, [2, 3])
    apply_maps(model, corr, 6, [2, 3])
    with torch.no_grad():
        assert_close(model(input_ids=ids, use_cache=False).logits, ref, rtol=1e-6, atol=1e-6)


def test_joint_map_at_block_0_is_the_span_lra_and_says_so(tiny):
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    win = _windows(tok)
    mod = _fit(model, [0, 1], {"lra_replaceme": {}, "lra_span": SPAN_LRA}, win, damping=1e-4)
    span = mod.spans[0]
    assert mod.solution(span, "lra_replaceme").T is None
    assert_close(mod.solution(span, "lra_replaceme").W, mod.solution(span, "lra_span").W)
    corr = mod.fitted_maps("lra_replaceme")
    assert not corr.branch_maps and list(corr.adapters) == [0]
    assert any("no block before the span" in n for n in corr.notes)


def test_linearpatch_recovers_an_exact_hadamard_scaling(tiny):
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    d = model.config.hidden_size
    s0 = 0.5 + torch.rand(d, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    P0 = linearpatch_matrix(s0)
    H = hadamard(d)
    assert_close(P0, H @ torch.diag(s0) @ H.T)
    decoder_layers(model)[4] = Linear(P0.T)  # y = x P0
    mod = _fit(model, [4], ["linearpatch"], _windows(tok))
    span = mod.spans[0]
    assert_close(mod.statistics[span.key].scale.scale(), s0, rtol=1e-9, atol=1e-9)
    x = torch.randn(2, 3, d, dtype=torch.float64)
    assert_close(mod.adapter("linearpatch", span)(x), x @ P0)
    mod2 = _fit(model, [4], ["linearpatch", "lra"], _windows(tok))  # with the span's (x, Δ) collected too
    assert mod2.reports[span.key]["solvers"]["linearpatch"]["calib_rel_error"] < 1e-12


def test_all_kinds_from_one_pass_equal_separate_fits_and_round_trip(tmp_path):
    model, tok = build_tiny_model("qwen2", num_hidden_layers=6, dtype=torch.float64)
    win, held = _windows(tok), _windows(tok, n=4)
    kinds = ["lra", "nobias", "replaceme", "linearpatch"]
    together = CalibrationModule(copy.deepcopy(model), [2, 3], CalibrationConfig(), solvers=kinds)
    together.calibrate(_trainer(), win, held, batch_size=4)
    ids = win.input_ids[:2, :16]
    for kind in kinds:
        alone = CalibrationModule(copy.deepcopy(model), [2, 3], CalibrationConfig(solver=kind))
        alone.calibrate(_trainer(), win, held, batch_size=4)
        outs = []
        for mod in (together, alone):
            m = copy.deepcopy(model)
            remove_blocks(m, [2, 3])
            apply_maps(m, mod.fitted_maps(kind), 6, [2, 3])
            with torch.no_grad():
                outs.append(m(input_ids=ids, use_cache=False).logits)
        assert_close(outs[0], outs[1], rtol=1e-9, atol=1e-9)
        # save -> load: identical logits
        save_pretrained(m, tok, tmp_path / kind, {"original_num_layers": 6, "pruned_layers": [2, 3],
                                                   "solver": kind})
        m2, _ = load_pretrained(tmp_path / kind)
        with torch.no_grad():
            assert torch.equal(m2(input_ids=ids, use_cache=False).logits, outs[1])
    span_err = together.reports[together.spans[0].key]["span_errors"]
    assert set(span_err) == set(kinds)
    assert all(0 <= e["heldout_rel_error"] < 1.5 for e in span_err.values())


def test_peer_kinds_refuse_sequential_and_rank():
    from shift_lightning.errors import ConfigError

    model, _ = build_tiny_model("llama")
    with pytest.raises(ConfigError, match="sequential"):
        CalibrationModule(model, [2], CalibrationConfig(mode="sequential", solver="replaceme"))
    with pytest.raises(ConfigError, match="rank"):
        CalibrationModule(model, [2], CalibrationConfig(solver="linearpatch", rank=4))


def test_guard_chooses_by_heldout_closeness_and_refits_on_all_windows(tiny):
    """An exactly affine residual block: the guard keeps the LRA (KL ≈ 0; plain pruning is far);
    a span linear only in block s−1's MLP branch: the guard takes ReplaceMe. The chosen map is refitted
    on every window, so it equals the plain solver's map."""
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    d = model.config.hidden_size
    eye = torch.eye(d, dtype=torch.float64)
    T0 = eye + _rand(d, 7, 0.3)
    blocks = decoder_layers(model)
    blocks[1] = Linear(eye + _rand(d, 5), 0.5 * torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(4)))
    shared = BlockTap(blocks[3], mlp_branch(blocks[3]))
    blocks[4] = Linear(eye, branch=shared, B=(T0 - eye).T)
    win = _windows(tok, n=12)
    mod = CalibrationModule(model, [1, 4], CalibrationConfig(damping=1e-8, guarded={"path": [1e-8, 1e-2, 1.0]}),
                            solvers=["guarded", "lra", "replaceme"])
    mod.calibrate(_trainer(), win, batch_size=3)
    first, second = mod.spans
    g1, g2 = mod.reports[first.key]["guards"]["guarded"], mod.reports[second.key]["guards"]["guarded"]
    assert g1["chosen"] == "lra@1e-08" and g1["kl"]["lra@1e-08"] < 1e-4 * g1["kl"]["none"]
    assert g2["chosen"] == "replaceme" and g2["kl"]["replaceme"] < 1e-4 * g2["kl"]["none"]
    assert all(g["kl"][g["chosen"]] == min(g["kl"].values()) for g in (g1, g2))
    assert set(g1["kl"]) == {"none", "lra@1e-08", "lra@0.01", "lra@1", "nobias", "replaceme"}
    assert g1["held_out_windows"] == 3 and g1["positions"] == int(win.attention_mask[[3, 7, 11]].sum())
    guarded, lra, rme = (mod.fitted_maps(n) for n in ("guarded", "lra", "replaceme"))
    x = torch.randn(2, 3, d, dtype=torch.float64)
    assert_close(guarded.adapters[1](x), lra.adapters[1](x), rtol=1e-9, atol=1e-9)
    assert list(guarded.branch_maps) == [3] and 2 not in guarded.adapters
    assert_close(guarded.branch_maps[3], rme.branch_maps[3], rtol=1e-9, atol=1e-9)


def test_guard_rank_path_picks_the_low_rank_fit_and_stores_it_low_rank(tiny):
    """A block whose update is exactly rank 2: with the full-rank LRA shrunk hard (``guarded.path``),
    the rank-2 candidate of ``guarded.ranks`` is the one that keeps the model at the original; it is
    refitted on every window into the same low-rank adapter (2dr + d parameters) the plain rank-2
    LRA gives. Ranks at or above d are the full-rank fit and are not tried twice."""
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    d = model.config.hidden_size
    g = torch.Generator().manual_seed(11)
    U, V = torch.randn(d, 2, generator=g, dtype=torch.float64), torch.randn(d, 2, generator=g, dtype=torch.float64)
    c = 0.5 * torch.randn(d, dtype=torch.float64, generator=g)
    decoder_layers(model)[2] = Linear(torch.eye(d, dtype=torch.float64) + 0.3 * U @ V.T / d ** 0.5, c)
    win = _windows(tok, n=12)
    cfg = CalibrationConfig(damping=1e-8, guarded={"path": [10.0], "ranks": [2, d]})
    mod = CalibrationModule(model, [2], cfg, solvers=["guarded"])
    mod.calibrate(_trainer(), win, batch_size=3)
    rep = mod.reports[mod.spans[0].key]["guards"]["guarded"]
    assert set(rep["kl"]) == {"none", "lra@10", "lra@r2", "nobias", "replaceme"}
    assert rep["chosen"] == "lra@r2" and rep["kl"]["lra@r2"] < 1e-4 * min(rep["kl"]["none"], rep["kl"]["lra@10"])
    plain = CalibrationModule(copy.deepcopy(model), [2], CalibrationConfig(damping=1e-8, rank=2), solvers=["lra"])
    plain.calibrate(_trainer(), win, batch_size=3)
    got, want = mod.fitted_maps("guarded").adapters[2], plain.fitted_maps("lra").adapters[2]
    assert sum(p.numel() for p in got.parameters()) == 2 * d * 2 + d
    x = torch.randn(2, 3, d, dtype=torch.float64)
    assert_close(got(x), want(x), rtol=1e-9, atol=1e-9)


class SideChannel(nn.Module):
    """``y = x + sign · 3 e₀ |x₁| (+ x Mᵀ)``: writes a nonlinear function of coordinate 1 into
    coordinate 0 (``sign = +1``) or removes it again (``-1``; ``M``'s column 0 is zero, so it only
    reads what the first block left unchanged). Two in a row are exactly ``y = x + x Mᵀ``; each alone
    is not linear."""

    def __init__(self, sign, M=None):
        super().__init__()
        self.sign, self.M = sign, M

    def forward(self, hidden_states, *args, **kwargs):
        y = hidden_states.clone()
        y[..., 0] += self.sign * 3 * hidden_states[..., 1].abs()
        if self.M is not None:
            y = y + hidden_states @ self.M.T.to(hidden_states)
        return y


def test_guard_span_candidate_fits_the_whole_span_at_once(tiny):
    """Blocks 2–3 are together exactly linear, each alone is not: the merged per-block LRAs cannot
    undo block 2's nonlinear write, one LRA fitted to the span's update can. ``guarded_span`` tries
    it, keeps it (KL ≈ 0) and refits it on all windows into the map ``granularity: span`` gives; the
    one-block span (block 5, exactly linear) gets no duplicate candidate. ``guarded``, judged in the
    same module on the same windows, never sees it."""
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    d = model.config.hidden_size
    M = _rand(d, 9, 0.3)
    M[:, 0] = 0
    blocks = decoder_layers(model)
    blocks[2], blocks[3] = SideChannel(+1.0), SideChannel(-1.0, M)
    blocks[5] = Linear(torch.eye(d, dtype=torch.float64) + _rand(d, 5))
    win = _windows(tok, n=12)
    cfg = CalibrationConfig(damping=1e-8, guarded={"path": [1e-8]})
    span = {"solver": "guarded", "guarded": {"extra": ["span_lra"]}}
    mod = CalibrationModule(model, [2, 3, 5], cfg, solvers={"guarded_span": span, "guarded": {}, "lra": {}})
    mod.calibrate(_trainer(), win, batch_size=3)
    assert mod.guards == ["guarded_span", "guarded"]
    (pair, single), (plain_pair, _) = ([mod.reports[s.key]["guards"][g] for s in mod.spans] for g in mod.guards)
    assert set(pair["kl"]) == {"none", "lra@1e-08", "nobias", "replaceme", "lra@span"}
    assert "lra@span" not in single["kl"] and "lra@span" not in plain_pair["kl"]
    assert pair["chosen"] == "lra@span" and pair["kl"]["lra@span"] < 1e-3 * pair["kl"]["lra@1e-08"]
    assert plain_pair["chosen"] != "lra@span" and plain_pair["kl"]["lra@1e-08"] == pair["kl"]["lra@1e-08"]
    span_lra = CalibrationModule(copy.deepcopy(model), [2, 3, 5], CalibrationConfig(solver="lra", damping=1e-8, granularity="span"))
    span_lra.calibrate(_trainer(), win, batch_size=3)
    x = torch.randn(2, 3, d, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    got, want = mod.fitted_maps("guarded_span").adapters[2], span_lra.fitted_maps("lra").adapters[2]
    assert_close(got(x), want(x), rtol=1e-8, atol=1e-8)
    # recovered up to the ridge (damping 1e-8, 12 windows): an unseeded x once met 1.3e-6 at one element of 192
    assert_close(got(x), x + x @ M.T, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(mod.fitted_maps("guarded").adapters[2](x), got(x), atol=1e-4)
    reports = mod.span_reports()  # the first requested guard's judgement, and both when there are two
    assert reports[0]["guard"] == pair and set(reports[0]["guards"]) == {"guarded", "guarded_span"}


def test_the_span_lra_fitted_beside_the_per_block_one_is_the_span_granularity_lra(tiny):
    """Two configurations of one solver from one pass (``lra`` and ``lra`` with ``granularity: span``, as a grid
    fits its variants): the span variant is what ``granularity: span`` alone gives; at a two-block span not the
    merged per-block LRAs, at a one-block span the same map."""
    model, tok = tiny
    win = _windows(tok, n=8)
    cfg = CalibrationConfig(damping=1e-6)
    both = _fit_cfg(model, [2, 3, 5], {"lra": {}, "lra_span": SPAN_LRA}, win, cfg)
    alone = _fit_cfg(model, [2, 3, 5], ["lra"], win, replace(cfg, granularity="span"))
    x = torch.randn(2, 3, model.config.hidden_size, dtype=torch.float64)
    got, want, merged = (m.fitted_maps(n).adapters for m, n in ((both, "lra_span"), (alone, "lra"), (both, "lra")))
    assert set(got) == set(want) == set(merged) and len(got) == 2
    pair, single = sorted(got)
    for at in (pair, single):
        assert_close(got[at](x), want[at](x), rtol=1e-8, atol=1e-8)
    assert_close(got[single](x), merged[single](x), rtol=1e-8, atol=1e-8)
    assert not torch.allclose(got[pair](x), merged[pair](x), atol=1e-6)


def test_replaceme_cosine_follows_the_reference_recipe(tiny):
    """Adam from T = I on cos(m T, m + Δ): the loss falls, the map points where least squares does,
    and the fit is deterministic (seeded order)."""
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    win = _windows(tok, n=12)
    cfg = CalibrationConfig(replaceme_cosine={"epochs": 30, "lr": 1e-2, "batch_tokens": 64})
    runs = [_fit_cfg(model, [3, 4], ["replaceme_cosine", "replaceme"], win, cfg) for _ in range(2)]
    span = runs[0].spans[0]
    cos_sol, ls_sol = runs[0].solution(span, "replaceme_cosine"), runs[0].solution(span, "replaceme")
    assert torch.equal(cos_sol.W, runs[1].solution(span, "replaceme_cosine").W)
    hist = cos_sol.info["cosine_loss"]
    assert len(hist) == 30 and hist[-1] < hist[0]
    st = runs[0].statistics[span.key].branch
    eye = torch.eye(cos_sol.W.shape[0], dtype=torch.float64)
    zero = torch.zeros(cos_sol.W.shape[0], dtype=torch.float64)
    assert st.relative_error(cos_sol.W - eye, zero) < st.relative_error(zero[:, None] * eye, zero)  # beats T = 0
    assert cos_sol.info["tokens"] == int(win.attention_mask.sum())
    corr = runs[0].fitted_maps("replaceme_cosine")
    assert list(corr.branch_maps) == [2] and not corr.adapters
    assert_close(corr.branch_maps[2], cos_sol.W.T)
    assert ls_sol is not None


def _fit_cfg(model, removed, solvers, windows, cfg):
    mod = CalibrationModule(copy.deepcopy(model), removed, cfg, solvers=solvers)
    mod.calibrate(_trainer(), windows, batch_size=4)
    return mod


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_guard_judge_runs_the_pruned_model_exactly(family):
    """The judge runs the corrected pruned model block by block from cached states (adapters entering
    the next kept block, ReplaceMe as a hook on the MLP branch): its KL equals the KL of the same model
    built by surgery and run normally (sliding-window attention included)."""
    from shift_lightning.calibration.judge import GuardJudge
    from shift_lightning.closeness import kl_top1, topk_reference

    model, tok = build_tiny_model(family, num_hidden_layers=6, dtype=torch.float64)
    win = _windows(tok, n=6)
    removed = [2, 4]
    mod = CalibrationModule(copy.deepcopy(model), removed, CalibrationConfig(damping=1e-3), solvers=["lra", "replaceme"])
    mod.calibrate(_trainer(), win, batch_size=3)
    first, second = mod.spans
    for names in (("lra", "lra"), ("replaceme", "lra"), ("lra", "replaceme")):
        maps = {sp.key: mod.span_map(n, sp) for n, sp in zip(names, mod.spans)}
        judge = GuardJudge(copy.deepcopy(model), removed, mod.spans, {k: [m] for k, m in maps.items()}, maps, topk=16)
        judge.run(_trainer(), win, batch_size=3)
        ref_logits = model(input_ids=win.input_ids, attention_mask=win.attention_mask).logits[win.attention_mask.bool()]
        ref = topk_reference(ref_logits, 16)
        m = copy.deepcopy(model)
        remove_blocks(m, removed)
        from shift_lightning.maps.fitted import assemble

        apply_maps(m, assemble("x", list(maps.values()), 6, removed), 6, removed)
        with torch.no_grad():
            lg = m(input_ids=win.input_ids, attention_mask=win.attention_mask).logits[win.attention_mask.bool()]
        kl = kl_top1(lg, ref)[0].mean().item()
        got = judge.results[second.key]["kl"][maps[second.key].source]
        assert got == pytest.approx(kl, rel=1e-6, abs=1e-12), (names, got, kl)
