"""The grids' variants: each retired solver name is a knob combination that fits the old maps exactly, and the
grids' own solvers (``affine``, ``lra_guard``) work through the product's registry."""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from experiments import variants
from shift_lightning.arch import decoder_layers
from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.maps import SOLVERS
from shift_lightning.models import build_tiny_model

DATA = Path(__file__).resolve().parent / "data"
sys.path.insert(0, str(DATA))

import retired_solver_maps as R  # noqa: E402  (how the stored maps were made: model, windows, settings)


def test_every_variant_is_a_registered_solver_with_a_label():
    assert all(variants.solver_of(v) in SOLVERS for v in variants.VARIANTS)
    assert set(variants.LABELS) == set(variants.VARIANTS)
    assert {"affine", "lra_guard"} <= set(SOLVERS)  # registered by experiments.solvers, not the product


@pytest.mark.parametrize("setting, mode, names", R.SETTINGS, ids=[s[0] for s in R.SETTINGS])
def test_a_retired_name_spelt_as_knobs_fits_the_maps_it_fitted(setting, mode, names):
    """The maps stored when ``lra_span`` … ``guarded_joint`` were solvers of their own (on a tiny float64 Llama, two
    spans) are fitted again from the variants' spelling: one module per name, and the grid's way, six variants from
    one pass. Each span keeps the map of the same source (the guard's candidate, the auto fit). The same maps up to
    float64 rounding: on a CPU whose BLAS kernels differ from the machine that stored them, 3e-12 at most (the joint
    map's T); on that machine, bit for bit."""
    from safetensors import safe_open

    model, windows = R.model_and_windows()
    mod = CalibrationModule(model, R.REMOVED, CalibrationConfig(mode=mode), solvers=variants.knobs(names))
    mod.calibrate(R.trainer(), windows, batch_size=4)
    with safe_open(str(DATA / "retired_solver_maps.safetensors"), "pt") as f:
        sources = json.loads(f.metadata()["sources"])
        for name in names:
            tensors, got_sources = R.maps_of(mod, name)
            stored = {k.split("/", 2)[2]: f.get_tensor(k) for k in f.keys() if k.startswith(f"{setting}/{name}/")}
            assert set(tensors) == set(stored) and stored, name
            for k in stored:  # stored on another machine: float64 GEMM kernels differ across CPUs by ~1e-15
                assert_close(tensors[k], stored[k], rtol=1e-9, atol=1e-10, msg=lambda m, name=name, k=k: f"{name} {k}: {m}")
            assert got_sources == sources[f"{setting}/{name}"], name


class Linear(nn.Module):
    """A stand-in block that is exactly ``y = x Aᵀ + c``."""

    def __init__(self, A, c=None):
        super().__init__()
        self.A, self.c = A, c

    def forward(self, hidden_states, *args, **kwargs):
        y = hidden_states @ self.A.T.to(hidden_states)
        return y if self.c is None else y + self.c.to(hidden_states)


def _rand(d, seed, scale=0.2):
    return scale * torch.randn(d, d, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_model("llama", num_hidden_layers=6, dtype=torch.float64)


def _windows(tok, n=8, seq_len=64):
    from shift_lightning.data import TextDataConfig, build_windows

    corpus = str(Path(__file__).resolve().parents[2] / "tests" / "data" / "tiny_corpus.txt")
    return build_windows(TextDataConfig(source=corpus, num_samples=n, seq_len=seq_len), tok)


def _trainer():
    return R.trainer()


def test_affine_recovers_an_affine_block_exactly(tiny):
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    d = model.config.hidden_size
    A0 = _rand(d, 3, 0.3) + torch.eye(d, dtype=torch.float64)
    c0 = 0.1 * torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    decoder_layers(model)[4] = Linear(A0, c0)
    mod = CalibrationModule(model, [4], CalibrationConfig(damping=1e-10), solvers=["affine"])
    mod.calibrate(_trainer(), _windows(tok), batch_size=4)
    (s4,) = mod.sites
    assert_close(mod.solution(s4, "affine").W, A0, rtol=1e-6, atol=1e-7)
    assert_close(mod.solution(s4, "affine").b, c0, rtol=1e-6, atol=1e-7)
    x = torch.randn(3, 5, d, dtype=torch.float64)
    assert_close(mod.adapter("affine", s4)(x), x @ A0.T + c0)


def test_do_no_harm_guard_keeps_good_maps_and_drops_useless_ones(tiny):
    """A block that is exactly linear keeps its map (the guard never fires); a block whose update is
    unpredictable noise gets the identity (plain pruning) instead of an overfitted map."""
    model, tok = copy.deepcopy(tiny[0]), tiny[1]
    d = model.config.hidden_size
    eye = torch.eye(d, dtype=torch.float64)

    class Noise(nn.Module):  # y = x + independent noise: nothing linear to learn
        def forward(self, hidden_states, *args, **kwargs):
            g = torch.Generator().manual_seed(int(hidden_states.abs().sum().item() * 1e6) % 2 ** 31)
            return hidden_states + torch.randn(hidden_states.shape, generator=g, dtype=hidden_states.dtype)

    blocks = decoder_layers(model)
    blocks[2] = Linear(eye + _rand(d, 5))
    blocks[4] = Noise()
    win = _windows(tok, n=8, seq_len=24)  # few tokens: a full d x d map overfits the noise
    mod = CalibrationModule(model, [2, 4], CalibrationConfig(damping=1e-6, solver="lra_guard", heldout_every=2),
                            solvers=["lra_guard", "lra"])
    mod.calibrate(_trainer(), win, batch_size=2)
    good, noisy = mod.sites
    g_good = mod.reports[good.key]["solvers"]["lra_guard"]["guard"]
    assert g_good["chosen"] != "identity" and not g_good["fired"]
    assert mod.reports[noisy.key]["solvers"]["lra_guard"]["guard"]["chosen"] == "identity"
    x = torch.randn(2, 3, d, dtype=torch.float64)
    assert torch.equal(mod.adapter("lra_guard", noisy)(x), x)  # identity map
    assert not torch.equal(mod.adapter("lra", noisy)(x), x)     # the unguarded map overfits
    corr = mod.fitted_maps()  # the first requested solver is the guarded one
    assert corr.solver == "lra_guard"




def test_the_spelling_a_retired_name_is_told_is_the_grids_variant():
    """``--calibration.solver lra_span`` is refused with the knobs to set instead; set on the command line, those
    knobs are exactly the grid's variant of that name."""
    import shlex

    from shift_lightning.calibration.config import RETIRED_SOLVERS
    from shift_lightning.recipes import cli

    parser = cli.calibrate_parser()
    assert set(RETIRED_SOLVERS) == {v for v in variants.VARIANTS if variants.solver_of(v) != v}
    for name, spelling in RETIRED_SOLVERS.items():
        argv = cli.preprocess_argv(["--output_dir", "/tmp/unused", *shlex.split(spelling)], parser)
        got = parser.instantiate_classes(parser.parse_args(argv)).calibration
        want = CalibrationConfig(**variants.VARIANTS[name])
        assert got == want, name


@pytest.mark.slow
def test_stored_grid_rows_come_back_from_the_new_spelling_on_the_real_model():
    """SmolLM2-135M, Reverse-order* (blocks 22–28), mixed calibration text: the per-span calibration and held-out
    errors the grid stored for ``lra_span`` and ``lra_replaceme`` (one pass) and ``lra_anchored`` (its walk) are
    fitted again from the variants' spelling (``results/paper_mixed``; float64 sums on CPU, to 1e-6)."""
    from experiments.reproduce import _site_errors
    from shift_lightning.data import TextDataConfig, build_windows
    from shift_lightning.models import ModelConfig, load_model

    root = Path(__file__).resolve().parents[2] / "results" / "paper_mixed" / "smollm2-135m" / "reverse_star"
    stored = {v: json.loads((root / f"{v}.json").read_text()) for v in ("lra_span", "lra_replaceme", "lra_anchored")}
    layers = stored["lra_span"]["pruned_layers"]
    model, tok = load_model(ModelConfig(name_or_path="smollm2-135m"))
    cfg = stored["lra_span"]["config"]
    windows = build_windows(TextDataConfig(source=cfg["calib_source"], split="calibration", num_samples=cfg["calib_samples"],
                                           seq_len=cfg["seq_len"]), tok, model.config.model_type)
    heldout = build_windows(TextDataConfig(source=cfg["text_source"], split="heldout", num_samples=cfg["heldout_samples"],
                                           seq_len=cfg["seq_len"]), tok, model.config.model_type)
    base = CalibrationConfig(damping=cfg["damping"], heldout_every=cfg["heldout_every"])
    for mode, names in (("independent", ["lra_span", "lra_replaceme"]), ("anchored", ["lra_anchored"])):
        mod = CalibrationModule(model, layers, CalibrationConfig(**{**base.__dict__, "mode": mode}),
                                solvers=variants.knobs(names))
        mod.calibrate(R.trainer(), windows, heldout, batch_size=4)
        for name in names:
            got, want = _site_errors(mod, name), stored[name]["sites"]
            assert [g["blocks"] for g in got] == [w["blocks"] for w in want] and [g["map"] for g in got] == \
                [w["map"] for w in want], name
            for g, w in zip(got, want):
                for key in ("calib_rel_error", "heldout_rel_error"):
                    if w[key] is not None:
                        assert g[key] == pytest.approx(w[key], rel=1e-6), (name, key)
