"""Layer-selection criteria: known answers on tiny models, errors, and 1 vs 2 DDP processes."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shift_lightning.criteria import (CRITERIA, DATA_DRIVEN, CriterionError, PruneConfig, Selection,
                                      candidates)
from shift_lightning.selection import select_blocks
from shift_lightning.models import build_tiny_model, decoder_layers

sys.path.insert(0, str(Path(__file__).parent))
from ddp_criteria_main import compute, tiny_windows  # noqa: E402

L = 6  # tiny model depth


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model("llama", seed=0)


@pytest.fixture(scope="module")
def windows(tiny):
    return tiny_windows(tiny[1])  # 7 right-padded windows of 40 tokens


def make_identity(layer) -> None:
    """Zero the block's two output projections: block(x) == x exactly (residual + 0)."""
    with torch.no_grad():
        layer.self_attn.o_proj.weight.zero_()
        layer.mlp.down_proj.weight.zero_()


def model_with_identity(blocks, dtype=torch.float32, family="llama"):
    model, _ = build_tiny_model(family, seed=1, dtype=dtype)
    for i in blocks:
        make_identity(decoder_layers(model)[i])
    return model


def cfg(criterion, ratio=1 / 6, **kw) -> PruneConfig:
    return PruneConfig(criterion=criterion, ratio=ratio, batch_size=2, **kw)


# ------------------------------------------------------------------------------------------
# Positional criteria and guards
# ------------------------------------------------------------------------------------------
def test_reverse_reverse_star_random_and_guards(tiny):
    model = tiny[0]
    assert select_blocks(cfg("reverse", 0.5), model).layers == [3, 4, 5]
    assert select_blocks(cfg("reverse_star", 0.5), model).layers == [2, 3, 4]
    assert select_blocks(cfg("reverse", 0.5, keep_last=2), model).layers == [1, 2, 3]
    assert select_blocks(cfg("reverse_star", 0.5, keep_last=True), model).layers == [2, 3, 4]

    a = select_blocks(cfg("random", 0.5, seed=3), model)
    assert a.layers == select_blocks(cfg("random", 0.5, seed=3), model).layers
    assert a.details["seed"] == 3 and len(set(a.layers)) == 3
    draws = {tuple(select_blocks(cfg("random", 0.5, seed=s), model).layers) for s in range(10)}
    assert len(draws) > 1
    for s in range(10):  # guards: the first block and the last block are never drawn
        assert set(select_blocks(cfg("random", 0.5, seed=s, keep_first=1, keep_last=True), model).layers) <= {1, 2, 3, 4}
    assert candidates(6, PruneConfig(keep_first=4, keep_last=2)) == []  # Taylor+ of the reference code
    assert select_blocks(cfg("reverse", 0.0), model).layers == []


# ------------------------------------------------------------------------------------------
# Weight-based
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p", [1, 2])
def test_magnitude_zeroed_block_is_smallest(p):
    model, _ = build_tiny_model("llama", seed=1)
    with torch.no_grad():
        for w in decoder_layers(model)[2].parameters():
            w.zero_()
    sel = select_blocks(cfg(f"magnitude_l{p}"), model)
    assert sel.layers == [2] and sel.scores[2] == 0.0
    # Hand computation over the state dict: every parameter of block 4, norms included.
    ref = sum(v.double().abs().pow(p).sum().item() for k, v in model.state_dict().items()
              if k.startswith("model.layers.4."))
    assert math.isclose(sel.scores[4], ref, rel_tol=1e-12)
    assert len([k for k in model.state_dict() if k.startswith("model.layers.4.")]) == 9  # 7 linears + 2 norms
    # Guard: the zeroed block is protected -> next smallest is chosen instead.
    guarded = select_blocks(cfg(f"magnitude_l{p}", keep_first=3), model)
    assert guarded.layers == [min(range(3, 6), key=lambda i: sel.scores[i])]


# ------------------------------------------------------------------------------------------
# Block influence (ShortGPT)
# ------------------------------------------------------------------------------------------
def test_block_influence_identity_block_has_zero_bi_and_goes_first(windows):
    model = model_with_identity([3])
    sel = select_blocks(cfg("block_influence"), model, windows)
    assert sel.layers == [3]
    assert abs(sel.scores[3]) < 1e-12
    assert all(sel.scores[i] > 1e-4 for i in range(L) if i != 3)
    assert sel.details["tokens"] == windows.num_tokens  # padding excluded

    # Independent reference from output_hidden_states (entries 0..L-1 are block inputs).
    with torch.no_grad():
        hs = model(input_ids=windows.input_ids, attention_mask=windows.attention_mask,
                   output_hidden_states=True).hidden_states
    m = windows.attention_mask.bool()
    for i in range(L - 1):
        cos = torch.nn.functional.cosine_similarity(hs[i].double(), hs[i + 1].double(), dim=-1)[m]
        assert math.isclose(sel.scores[i], 1 - cos.mean().item(), rel_tol=1e-5, abs_tol=1e-9)


@pytest.mark.parametrize("family", ["qwen2", "gemma3"])
def test_block_influence_other_families(family, windows):
    model = model_with_identity([1], family=family)
    sel = select_blocks(cfg("block_influence"), model, windows)
    assert sel.layers == [1] and abs(sel.scores[1]) < 1e-12


# ------------------------------------------------------------------------------------------
# Angular distance (Gromov et al.)
# ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tokens", ["last", "all"])
def test_angular_picks_identity_span(tokens, windows):
    model = model_with_identity([2, 3])
    sel = select_blocks(cfg("angular", ratio=2 / 6, angular_tokens=tokens), model, windows)
    assert sel.layers == [2, 3]
    assert sel.scores[2] < 1e-6 and min(sel.scores[s] for s in (0, 1, 3, 4)) > 1e-3
    assert set(sel.details["span_distances"]) == {"0-1", "1-2", "2-3", "3-4", "4-5"}
    assert sel.details["samples" if tokens == "last" else "tokens"] == (
        len(windows) if tokens == "last" else windows.num_tokens)

    # Independent reference for the span [0, 2): hidden_states[0] vs [2].
    with torch.no_grad():
        hs = model(input_ids=windows.input_ids, attention_mask=windows.attention_mask,
                   output_hidden_states=True).hidden_states
    m = windows.attention_mask.bool()
    a, b = hs[0].double(), hs[2].double()
    if tokens == "last":
        last = m.sum(1) - 1  # right padding
        rows = torch.arange(len(last))
        a, b = a[rows, last], b[rows, last]
    else:
        a, b = a[m], b[m]
    ref = (torch.arccos(torch.nn.functional.cosine_similarity(a, b, dim=-1).clamp(-1, 1)) / math.pi).mean()
    assert math.isclose(sel.scores[0], ref.item(), rel_tol=1e-5)

    # Guard: the span must lie in the candidates.
    guarded = select_blocks(cfg("angular", ratio=2 / 6, angular_tokens=tokens, keep_first=3), model, windows)
    assert guarded.layers[0] >= 3


# ------------------------------------------------------------------------------------------
# Removal perplexity
# ------------------------------------------------------------------------------------------
def test_ppl_identity_block_equals_base_and_matches_deletion(windows):
    model = model_with_identity([4])
    sel = select_blocks(cfg("ppl"), model, windows)
    d = sel.details
    assert sel.scores[4] == pytest.approx(d["base_ppl"], rel=1e-12)

    def hf_ppl(m):  # HF's own loss: labels with padding ignored
        labels = windows.input_ids.masked_fill(windows.attention_mask == 0, -100)
        with torch.no_grad():
            out = m(input_ids=windows.input_ids, attention_mask=windows.attention_mask, labels=labels,
                      use_cache=False)
        return math.exp(out.loss.item())

    assert d["base_ppl"] == pytest.approx(hf_ppl(model), rel=1e-5)
    deleted = copy.deepcopy(model)  # block 1 physically removed
    del deleted.model.layers[1]
    deleted.config.num_hidden_layers = L - 1
    assert sel.scores[1] == pytest.approx(hf_ppl(deleted), rel=1e-5)
    assert sel.layers == [min(range(L), key=lambda i: (sel.scores[i], i))]


# ------------------------------------------------------------------------------------------
# Taylor (Shortened-LLaMA)
# ------------------------------------------------------------------------------------------
def test_taylor_matches_hand_computed_w_grad(windows):
    """float64 model; reference = one full-batch backward of the mean token NLL; the criterion
    runs batches of 2 (4 batches, last one short), so this also checks batch independence."""
    model = model_with_identity([2], dtype=torch.float64)
    ref_model = copy.deepcopy(model)
    sel = select_blocks(cfg("taylor", ratio=2 / 6), model, windows)

    # (HF's own `labels=` loss casts logits to float32, so the float64 reference is written out.)
    labels = windows.input_ids.masked_fill(windows.attention_mask == 0, -100)[:, 1:]
    logits = ref_model(input_ids=windows.input_ids, attention_mask=windows.attention_mask).logits[:, :-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1),
                                             ignore_index=-100)  # mean over non-padding targets
    assert loss.dtype == torch.float64
    loss.backward()
    for i, layer in enumerate(decoder_layers(ref_model)):
        ref = sum((p.detach() * p.grad).abs().sum().item() for p in layer.parameters())
        # rel 1e-6, not 1e-12: HF's RMSNorm computes in float32 even in a float64 model, and the
        # criterion backpropagates the token-summed loss (gradients N× larger) before dividing by N.
        assert sel.scores[i] == pytest.approx(ref, rel=1e-6), i
    assert sel.scores[2] == 0.0  # identity block: every weight's w·grad vanishes
    assert 2 in sel.layers
    assert sel.details["tokens"] == int((labels != -100).sum())
    # The criterion leaves the model's gradients and requires_grad flags alone.
    assert all(p.grad is None and p.requires_grad for p in model.parameters())


def test_taylor_signed_accumulation_before_abs():
    """Σ_b w·g_b then |·| (not Σ_b |w·g_b|): two windows whose gradients cancel exactly."""
    model, tok = build_tiny_model("llama", seed=2, dtype=torch.float64)
    from shift_lightning.data import TokenWindows

    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(0))
    w = TokenWindows(ids.repeat(2, 1), torch.ones(2, 12, dtype=torch.long))
    one = select_blocks(cfg("taylor"), model, TokenWindows(ids, torch.ones(1, 12, dtype=torch.long)))
    two = select_blocks(PruneConfig(criterion="taylor", ratio=1 / 6, batch_size=1), model, w)
    for i in range(L):  # the same window twice: mean loss unchanged -> identical scores
        assert two.scores[i] == pytest.approx(one.scores[i], rel=1e-10)


# ------------------------------------------------------------------------------------------
# Errors and report
# ------------------------------------------------------------------------------------------
def test_errors(tiny, windows):
    model = tiny[0]
    with pytest.raises(CriterionError, match="valid choices: .*block_influence.*angular"):
        select_blocks(PruneConfig(criterion="shortgpt"), model)
    for r in (1.0, 1.5, -0.1, float("nan")):
        with pytest.raises(CriterionError, match=r"\[0, 1\)"):
            select_blocks(PruneConfig(criterion="reverse", ratio=r), model)
    for name in DATA_DRIVEN:
        with pytest.raises(CriterionError, match="--data.source"):
            select_blocks(PruneConfig(criterion=name), model, None)
    with pytest.raises(CriterionError, match="guards"):
        select_blocks(PruneConfig(criterion="magnitude_l1", ratio=0.5, keep_first=3, keep_last=1), model)
    for guard in ({"keep_first": -1}, {"keep_last": -2}, {"keep_first": 1.5}):  # once clamped to 0 / cut silently
        with pytest.raises(CriterionError, match=f"--prune.{next(iter(guard))} must be a whole number of blocks >= 0"):
            select_blocks(PruneConfig(criterion="reverse", **guard), model)
    with pytest.raises(CriterionError, match="angular_tokens"):
        select_blocks(PruneConfig(criterion="angular", angular_tokens="first"), model, windows)
    with pytest.raises(CriterionError, match="every block"):
        select_blocks(PruneConfig(layers=list(range(L))), model)
    assert set(CRITERIA) == {"reverse", "reverse_star", "random", "magnitude_l1", "magnitude_l2",
                             "taylor", "ppl", "block_influence", "angular", "linear_fit", "linear_fit_kl"}
    with pytest.raises(CriterionError, match="heldout_every"):
        select_blocks(PruneConfig(criterion="linear_fit", heldout_every=1), model, windows)


def test_report_is_json(tiny, windows):
    sel = select_blocks(cfg("block_influence"), tiny[0], windows)
    d = json.loads(json.dumps(sel.to_dict()))
    assert d["criterion"] == "block_influence" and set(d["scores"]) == {str(i) for i in range(L)}
    assert isinstance(sel, Selection)


# ------------------------------------------------------------------------------------------
# DDP: 2 gloo processes on CPU == 1 process
# ------------------------------------------------------------------------------------------
def test_ddp_two_processes_match_one(tmp_path):
    script = Path(__file__).parent / "ddp_criteria_main.py"
    out = tmp_path / "ddp.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(Path(__file__).parents[1])}
    r = subprocess.run([sys.executable, str(script), "--devices", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=240, env=env, cwd=str(tmp_path))
    assert r.returncode == 0, r.stderr[-3000:]
    two = json.loads(out.read_text())
    assert two["world_size"] == 2
    one = compute(1)
    for key, ref in one.items():
        got = two[key]
        assert got["layers"] == ref["layers"], key
        for i, v in ref["scores"].items():
            assert got["scores"][i] == pytest.approx(v, rel=1e-6), (key, i)
        for count in ("tokens", "samples"):
            assert got.get(count) == ref.get(count)


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_ppl_replay_from_cached_states_equals_full_passes(family, windows):
    """The one-pass implementation (replay from each block's cached input) gives the numbers of the
    L+1 full passes with one block skipped each (padded windows, batches of 2, sliding windows)."""
    from shift_lightning.criteria import RemovalPerplexity
    from shift_lightning.selection import run_scorer

    model, _ = build_tiny_model(family, seed=3)
    fast = run_scorer(RemovalPerplexity(L), model, windows, batch_size=2)
    full = run_scorer(RemovalPerplexity(L, replay=False), model, windows, batch_size=2)
    assert fast.tokens.item() == full.tokens.item()
    torch.testing.assert_close(fast.nll_sum, full.nll_sum, rtol=1e-12, atol=0)
    assert fast.finalize() == full.finalize()


# ------------------------------------------------------------------------------------------
# linear_fit: the repaired spans' costs and the joint choice
# ------------------------------------------------------------------------------------------
def lras_fitted_apart(model, windows, every: int = 3, damping: float = 1e-3):
    """Every block's LRA calibrated on the windows linear_fit fits on (all but every ``every``-th), and
    the windows it judges on."""
    import lightning as L_

    from shift_lightning.calibration import CalibrationConfig, CalibrationModule

    fit = windows.subset([i for i in range(len(windows)) if i % every != every - 1])
    judge = windows.subset([i for i in range(len(windows)) if i % every == every - 1])
    trainer = L_.Trainer(accelerator="cpu", devices=1, logger=False, enable_checkpointing=False, inference_mode=False,
                         enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)
    cal = CalibrationModule(model, list(range(L)), CalibrationConfig(solver="lra", damping=damping, heldout=False))
    cal.calibrate(trainer, fit, batch_size=2)
    return cal, judge


def test_linear_fit_costs_are_the_merged_maps_heldout_error(tiny, windows):
    """Every span's cost is the held-out residual energy of the chain of per-block LRAs (the merged
    map calibration builds) fitted on the other windows, relative to the stream's energy."""
    import copy
    import itertools

    from shift_lightning.arch import block_hooks, decoder_layers
    from shift_lightning.criteria import select_spans

    model = copy.deepcopy(tiny[0]).double()
    sel = select_blocks(PruneConfig(criterion="linear_fit", ratio=0.34, heldout_every=3, damping=1e-3,
                                    batch_size=2), model, windows)
    k = sel.details["k"]
    cal, judge = lras_fitted_apart(model, windows)
    states = {}
    with torch.no_grad(), block_hooks(decoder_layers(model), lambda i, x, y: states.update({i: x, i + 1: y})):
        model.model(input_ids=judge.input_ids, attention_mask=judge.attention_mask, use_cache=False)
    m = judge.attention_mask.bool()
    for a, n in [(0, 1), (1, 2), (2, 2), (3, k)]:
        y = states[a]
        for j in range(a, a + n):
            y = cal.adapter("lra", cal.sites[j])(y)
        ref = ((states[a + n] - y)[m].square().sum() / states[a + n][m].square().sum()).item()
        assert sel.details["span_costs"][f"{a}-{a + n - 1}"] == pytest.approx(ref, rel=1e-4), (a, n)
    # the choice is the brute-force minimum over every set of k blocks, scored span by span
    cost = {tuple(int(x) for x in key.split("-")): v for key, v in sel.details["span_costs"].items()}
    cost = {(a, b + 1): v for (a, b), v in cost.items()}
    from shift_lightning.maps import contiguous_spans

    def total(blocks):
        return sum(cost[s] for s in contiguous_spans(list(blocks)))

    best = min(itertools.combinations(range(L), k), key=lambda c: (total(c), c))
    assert sel.layers == list(best) == select_spans(cost, list(range(L)), L, k)
    assert sel.details["selected_span_costs"] and sel.details["stat_passes"] == 1


def test_linear_fit_groups_blocks_when_statistics_exceed_the_memory_budget(tiny, windows):
    one = select_blocks(PruneConfig(criterion="linear_fit", ratio=0.34, batch_size=2), tiny[0], windows)
    d = tiny[0].config.hidden_size
    per_block_gb = ((d + 1) ** 2 + (d + 1) * d + 1) * 8 / 2 ** 30
    small = select_blocks(PruneConfig(criterion="linear_fit", ratio=0.34, batch_size=2, max_stats_gb=2.5 * per_block_gb),
                          tiny[0], windows)
    assert small.details["stat_passes"] == 3 and one.details["stat_passes"] == 1
    assert small.layers == one.layers
    for key, v in one.details["span_costs"].items():
        assert small.details["span_costs"][key] == pytest.approx(v, rel=1e-6)


# ------------------------------------------------------------------------------------------
# linear_fit_kl: linear_fit's best set per number of spans, judged as whole repaired models
# ------------------------------------------------------------------------------------------
def test_best_per_span_count_is_the_brute_force_minimum_for_each_count():
    import itertools
    import random as rnd

    from shift_lightning.maps import contiguous_spans
    from shift_lightning.criteria import best_per_span_count, select_spans

    n_layers, k = 8, 4
    for seed in range(5):
        r = rnd.Random(seed)
        cost = {(a, b): r.random() * (b - a) for a in range(n_layers) for b in range(a + 1, min(a + k, n_layers) + 1)}
        allowed = [i for i in range(n_layers) if i != 5] if seed % 2 else list(range(n_layers))
        got = best_per_span_count(cost, allowed, n_layers, k)
        want: dict[int, tuple] = {}
        for c in itertools.combinations(allowed, k):
            spans = contiguous_spans(list(c))
            key = (sum(cost[(a, b)] for a, b in spans), c)
            if len(spans) not in want or key < want[len(spans)]:
                want[len(spans)] = key
        assert got == {s: list(v[1]) for s, v in sorted(want.items())}
        overall = min(want.values())
        assert select_spans(cost, allowed, n_layers, k) == list(overall[1])


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_linear_fit_kl_judges_each_candidate_as_the_whole_repaired_model(family, windows):
    """Every candidate's KL is the held-out KL(original ‖ model with each removed block replaced by its
    LRA fitted on the other windows); the candidates are linear_fit's best set per span count and the
    closest one is chosen; the span costs are linear_fit's."""
    from shift_lightning.arch import Bypass, swapped_blocks
    from shift_lightning.criteria import best_per_span_count
    from shift_lightning.closeness import kl_top1, lm_softcap, topk_reference

    model = build_tiny_model(family, seed=2)[0].double()
    kw = dict(ratio=0.34, heldout_every=3, damping=1e-3, batch_size=2)
    sel = select_blocks(PruneConfig(criterion="linear_fit_kl", **kw), model, windows)
    plain = select_blocks(PruneConfig(criterion="linear_fit", **kw), model, windows)
    assert sel.details["span_costs"] == pytest.approx(plain.details["span_costs"], rel=1e-9)
    assert sel.details["residual_choice"] == plain.layers
    cost = {(int(a), int(b) + 1): v for a, b, v in ((*key.split("-"), v) for key, v in sel.details["span_costs"].items())}
    cands = best_per_span_count(cost, list(range(L)), L, sel.details["k"])
    assert [c["blocks"] for c in sel.details["candidates"]] == list(cands.values()) and len(cands) >= 2

    cal, judge = lras_fitted_apart(model, windows)
    m = judge.attention_mask.bool()
    softcap = lm_softcap(model)
    with torch.no_grad():
        ref = topk_reference(model(input_ids=judge.input_ids, attention_mask=judge.attention_mask).logits[m], 256,
                             softcap)
        for c in sel.details["candidates"]:
            with swapped_blocks(model, {j: Bypass(cal.adapter("lra", cal.sites[j])) for j in c["blocks"]}):
                logits = model(input_ids=judge.input_ids, attention_mask=judge.attention_mask).logits[m]
            kl, agree = kl_top1(logits, ref, softcap)
            assert c["kl"] == pytest.approx(kl.mean().item(), rel=1e-4), c
            assert c["top1"] == pytest.approx(agree.double().mean().item(), abs=1e-12), c
    best = min(sel.details["candidates"], key=lambda c: (c["kl"], c["spans"]))
    assert sel.layers == best["blocks"] and sel.details["judge_positions"] == int(m.sum())
