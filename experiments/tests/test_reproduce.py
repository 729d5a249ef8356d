"""The paper grid recipe end to end on a tiny model: every variant of two criteria, resumability,
the table as data (JSON), markdown and plot."""

from __future__ import annotations

import json
import os
from dataclasses import replace
from pathlib import Path

import pytest

from shift_lightning.calibration import CalibrationConfig

ROOT = Path(__file__).resolve().parents[2]


def test_grid_runs_resumes_and_renders(tmp_path):
    from experiments.reproduce import ReproduceConfig, VARIANTS, run

    cfg = ReproduceConfig(model="tiny", tiny={"family": "llama", "num_hidden_layers": 8, "max_position_embeddings": 512},
                          criteria=["reverse_star", "block_influence"], ratio=0.25, calib_samples=6, seq_len=64,
                          select_samples=4, select_seq_len=32, heldout_samples=3, docs=4, ppl_windows=2,
                          text_source=str(ROOT / "tests" / "data" / "tiny_corpus.txt"),
                          eval_data_dir=str(ROOT / "tests" / "data" / "eval_tiny"),
                          ppl_sets=[str(ROOT / "tests" / "data" / "tiny_heldout.txt")], out=str(tmp_path), n_boot=200)
    folder = run(cfg)
    files = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.json"))
    assert "original.json" in files and "reverse_star/selection.json" in files
    assert all(f"{c}/{v}.json" in files for c in cfg.criteria for v in VARIANTS)
    table = json.loads((tmp_path / "tiny.json").read_text())
    rows = table["rows"]
    assert len(rows) == 1 + 2 * len(VARIANTS) and table["info"]["pending"] == []
    for r in rows:
        assert set(r) >= {"criterion", "variant", "tasks", "avg", "robust", "ppl"}
        assert r["variant"] in ("original",) + VARIANTS and len(r["tasks"]) == 7
    lra = next(r for r in rows if r["criterion"] == "reverse_star" and r["variant"] == "lra")
    assert lra["pruned_layers"] == [5, 6] and "vs_pruned" in lra
    # every row scored on the same docs; the trunk cache was used for all but the first variant
    rs = json.loads((folder / "reverse_star" / "nobias.json").read_text())
    assert rs["trunk_cache"]["hits"] > 0 and rs["trunk_cache"]["misses"] == 0
    md = (tmp_path / "tiny.md").read_text()
    assert "| reverse_star | +ReplaceMe |" in md and "Gain" in md
    assert "Over 2 criteria with both runs: +LRA beats pruned on Avg in" in md and "LRA − ReplaceMe (Avg)" in md
    assert (tmp_path / "tiny.png").exists()
    # a second run finds everything done: nothing is recomputed or rewritten
    stamp = (folder / "reverse_star" / "lra.json").stat().st_mtime_ns
    run(cfg)
    assert (folder / "reverse_star" / "lra.json").stat().st_mtime_ns == stamp
    # a deleted run is pending in the table until it is redone
    (folder / "block_influence" / "affine.json").unlink()
    from experiments.reproduce import render

    render(folder, cfg)
    assert "block_influence/affine" in json.loads((tmp_path / "tiny.json").read_text())["info"]["pending"]
    assert "| block_influence | +affine | " in (tmp_path / "tiny.md").read_text()


def test_ablations_run_and_render_on_a_tiny_model(tmp_path):
    from experiments.ablations import AblationConfig, run
    from experiments.reproduce import ReproduceConfig

    grid = ReproduceConfig(model="tiny", tiny={"family": "llama", "num_hidden_layers": 8, "max_position_embeddings": 512},
                           calib_samples=4, seq_len=64, select_samples=4, select_seq_len=32, ppl_windows=2,
                           text_source=str(ROOT / "tests" / "data" / "tiny_corpus.txt"),
                           eval_data_dir=str(ROOT / "tests" / "data" / "eval_tiny"),
                           ppl_sets=[str(ROOT / "tests" / "data" / "tiny_heldout.txt")], out=str(tmp_path / "paper"))
    cfg = AblationConfig(model="tiny", criteria=["reverse_star"], samples=[2, 4, 8], ranks=[4], ratios=[0.25, 0.5],
                         dampings=[1e-4, 1e-2], domains=["wiki_summaries"], docs=3, out=str(tmp_path / "abl"), grid=grid)
    folder = run(cfg)
    runs = sorted(p.stem for p in (folder / "reverse_star").glob("*.json"))
    assert runs == sorted(["pruned", "samples=2", "samples=4", "samples=8", "mode=sequential", "granularity=span",
                           "rank=4", "damping=0.0001", "damping=0.01", "ratio=0.5_pruned", "ratio=0.5_lra"])
    s4 = json.loads((folder / "reverse_star" / "samples=4.json").read_text())
    d4 = json.loads((folder / "reverse_star" / "damping=0.0001.json").read_text())
    # the N-window statistics summed chunk by chunk equal the default calibration (same windows)
    assert abs(s4["perplexity"][grid.ppl_sets[0]]["ppl"] - d4["perplexity"][grid.ppl_sets[0]]["ppl"]) < 1e-4
    md = (tmp_path / "abl" / "tiny.md").read_text()
    assert "## Calibration samples" in md and "| reverse_star | ratio=0.5/lra |" in md
    assert (tmp_path / "abl" / "tiny.png").exists()


def test_recovery_table_runs_resumes_and_plots_on_a_tiny_model(tmp_path):
    """The fine-tuning table end to end: runs, table (JSON + markdown), curves read back from the event
    files; a finished run is skipped, a restarted one does not mix an interrupted attempt's events in."""
    from experiments.recovery_table import RecoveryTableConfig, read_curves, run
    from experiments.reproduce import ReproduceConfig

    grid = ReproduceConfig(model="tiny", tiny={"family": "llama", "num_hidden_layers": 8, "max_position_embeddings": 512},
                           calib_samples=6, seq_len=64, select_samples=4, select_seq_len=32, docs=4, ppl_windows=2,
                           text_source=str(ROOT / "tests" / "data" / "tiny_corpus.txt"),
                           eval_data_dir=str(ROOT / "tests" / "data" / "eval_tiny"),
                           ppl_sets=[str(ROOT / "tests" / "data" / "tiny_heldout.txt")], out=str(tmp_path / "paper"))
    from experiments.reproduce import run as run_grid

    run_grid(ReproduceConfig(**{**grid.__dict__, "criteria": ["reverse_star"], "variants": ["pruned", "lra"]}))
    cfg = RecoveryTableConfig(model="tiny", criteria=["reverse_star"], runs=["lora", "lra_trained_lora"], steps=4,
                              batch_size=2, seq_len=32, train_samples=8, val_samples=2, val_every=2, curve_docs=2,
                              lora_r=2, grid=grid, out=str(tmp_path / "rec"))
    out = run(cfg)
    table = json.loads((out / "recovery.json").read_text())
    assert {(r["criterion"], r["run"]) for r in table["rows"]} == {("reverse_star", "lora"),
                                                                 ("reverse_star", "lra_trained_lora")}
    # each run carries its starting model's evaluation: the table shows before and after
    assert all(r["steps"] == 4 and 0 < r["before"]["avg"] <= 1 and 0 < r["after"]["avg"] <= 1 for r in table["rows"])
    assert all("robust" in r[w] and len(r[w]["robust_ci"]) == 2 for r in table["rows"] for w in ("before", "after"))
    starts = {r["run"]: (r["start"], r["training"]) for r in table["rows"]}  # robust: against the grid's original
    assert starts == {"lora": ("pruned", "LoRA, NLL"), "lra_trained_lora": ("+lra", "LoRA + the maps, NLL")}
    md = (out / "recovery.md").read_text()
    assert "| reverse_star | +lra | LoRA + the maps, NLL |" in md and "| Avg before | Avg after |" in md
    assert (out / "curves.png").exists()
    curve = read_curves(out / "tb" / "reverse_star" / "lora")
    assert [s for s, _ in curve["zeroshot/avg"]] == [0, 2, 4] and [s for s, _ in curve["val/ppl"]] == [0, 2, 4]
    # rerun: the finished run is skipped; a run whose JSON is gone is redone from a clean event folder
    stamp = (out / "reverse_star" / "lora.json").stat().st_mtime_ns
    (out / "reverse_star" / "lra_trained_lora.json").unlink()
    run(cfg)
    assert (out / "reverse_star" / "lora.json").stat().st_mtime_ns == stamp
    redone = read_curves(out / "tb" / "reverse_star" / "lra_trained_lora")
    assert [s for s, _ in redone["val/ppl"]] == [0, 2, 4]


def test_recovery_table_starts_from_the_chosen_repair_and_trains_on_the_chosen_text(tmp_path, capsys):
    """``--repair lra_span``: the distilled run starts from one LRA over the whole contiguous span (not the
    merged per-block LRAs: a different starting model, seen in val/ppl at step 0), is labelled and recorded
    so, and the table's reference row is the grid's ``lra_span`` row; ``--train_source`` names the
    training text; an unknown repair fails before any work."""
    from shift_lightning.errors import ConfigError
    from experiments.recovery_table import RecoveryTableConfig, read_curves, run
    from experiments.reproduce import ReproduceConfig
    from experiments.reproduce import run as run_grid

    grid = ReproduceConfig(model="tiny", tiny={"family": "llama", "num_hidden_layers": 8, "max_position_embeddings": 512},
                           calib_samples=6, seq_len=64, select_samples=4, select_seq_len=32, heldout_samples=3, docs=4,
                           ppl_windows=2, text_source=str(ROOT / "tests" / "data" / "tiny_corpus.txt"),
                           eval_data_dir=str(ROOT / "tests" / "data" / "eval_tiny"),
                           ppl_sets=[str(ROOT / "tests" / "data" / "tiny_heldout.txt")], out=str(tmp_path / "paper"))
    run_grid(ReproduceConfig(**{**grid.__dict__, "criteria": ["reverse_star"], "variants": ["pruned"]}))
    # the repair's rows in a grid of their own (as a refitted grid is), pruning alone read from the first
    grid = replace(grid, out=str(tmp_path / "paper_span"), pruned_from=str(tmp_path / "paper"))
    run_grid(ReproduceConfig(**{**grid.__dict__, "criteria": ["reverse_star"], "variants": ["lra_span"]}))
    common = dict(model="tiny", criteria=["reverse_star"], runs=["lra_lora_kd"], steps=2, batch_size=2, seq_len=32,
                  train_samples=4, val_samples=2, val_every=2, curve_docs=2, lora_r=2, grid=grid)
    with pytest.raises(ConfigError, match="--repair 'lra_spam'.*lra_span"):
        run(RecoveryTableConfig(**common, repair="lra_spam", out=str(tmp_path / "bad")))
    assert not (tmp_path / "bad").exists()
    capsys.readouterr()
    per_block = run(RecoveryTableConfig(**common, out=str(tmp_path / "lra")))
    err = capsys.readouterr().err  # long stages show progress: the teacher's distributions, the training steps
    assert "teacher distributions (kd): done, 2 steps" in err and "training: done" in err, err[-2000:]
    span = run(RecoveryTableConfig(**common, repair="lra_span", out=str(tmp_path / "span"),
                                   train_source=str(ROOT / "tests" / "data" / "tiny_heldout.txt")))
    doc = json.loads((span / "reverse_star" / "lra_lora_kd.json").read_text())
    assert doc["repair"] == "lra_span" and "lra_span (frozen)" in doc["label"]
    assert json.loads((per_block / "reverse_star" / "lra_lora_kd.json").read_text())["repair"] == "lra"
    start = {k: read_curves(o / "tb" / "reverse_star" / "lra_lora_kd")["val/ppl"][0] for k, o in
             (("lra", per_block), ("span", span))}
    assert start["lra"][0] == start["span"][0] == 0 and start["lra"][1] != pytest.approx(start["span"][1], rel=1e-6)
    md = (span / "recovery.md").read_text()
    assert "| reverse_star | +lra_span | LoRA, distilled (KD) |" in md and "tokens of tiny_heldout.txt" in md
    assert doc["before"]["kl"] and doc["before"]["average"] > 0  # the starting model, evaluated before training
    assert "Command: `" in md and "--repair lra_span" in md
    # the command reproduces the run: the grid's settings too
    assert "--grid.calib_samples 6" in doc["command"] and f"--grid.out {grid.out}" in doc["command"]
    # a second process adds a run to the folder: the table lists both commands
    run(RecoveryTableConfig(**{**common, "runs": ["lra_trained_lora_kd"]}, repair="lra_span", out=str(span),
                            train_source=str(ROOT / "tests" / "data" / "tiny_heldout.txt")))
    md = (span / "recovery.md").read_text()
    assert "Commands (one process each)" in md and "--runs '[\"lra_lora_kd\"]'" in md and "--runs '[\"lra_trained_lora_kd\"]'" in md
    trained = json.loads((span / "reverse_star" / "lra_trained_lora_kd.json").read_text())  # the span LRA trained too
    assert trained["recovery"]["train_lra"] and trained["recovery"]["loss"] == "kd"
    assert trained["trainable_params"] > doc["trainable_params"] and "lra_span (trained)" in trained["label"]


def _tiny_grid(tmp_path, **kw):
    from experiments.reproduce import ReproduceConfig

    base = dict(model="tiny", tiny={"family": "llama", "num_hidden_layers": 8, "max_position_embeddings": 512},
                criteria=["reverse_star", "block_influence"], ratio=0.25, calib_samples=6, seq_len=64,
                select_samples=4, select_seq_len=32, heldout_samples=3, docs=4, ppl_windows=2,
                text_source=str(ROOT / "tests" / "data" / "tiny_corpus.txt"),
                eval_data_dir=str(ROOT / "tests" / "data" / "eval_tiny"),
                ppl_sets=[str(ROOT / "tests" / "data" / "tiny_heldout.txt")], n_boot=50)
    return ReproduceConfig(**{**base, **kw})


def test_grid_device_cuda_without_a_gpu_is_a_clear_error(tmp_path, monkeypatch):
    import pytest
    import torch

    from shift_lightning.errors import ConfigError
    from experiments.reproduce import resolve_device, run

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("auto").type == "cpu"
    with pytest.raises(ConfigError, match="no GPU is visible"):
        run(_tiny_grid(tmp_path, device="cuda", out=str(tmp_path)))


def test_grid_on_gpu_equals_cpu(tmp_path):
    """Every run of the grid on the GPU (selection, calibration of every kind, the peers' folds, the
    trunk cache, scoring) gives the CPU's numbers: same blocks, accuracies within one doc, PPL to 1e-3."""
    import pytest
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU")
    from experiments.reproduce import VARIANTS, run

    cpu = run(_tiny_grid(tmp_path, device="cpu", out=str(tmp_path / "cpu")))
    gpu = run(_tiny_grid(tmp_path, device="cuda", out=str(tmp_path / "gpu")))
    for f in sorted(cpu.rglob("*.json")):
        a, b = json.loads(f.read_text()), json.loads((gpu / f.relative_to(cpu)).read_text())
        if f.name == "selection.json":
            assert a["layers"] == b["layers"]
            continue
        assert b["software"]["device"].startswith("cuda") and a["software"]["device"] == "cpu"
        for t in a["tasks"]:
            assert abs(a["tasks"][t]["value"] - b["tasks"][t]["value"]) <= 1 / a["tasks"][t]["n"] + 1e-9, (f, t)
        for p in a["perplexity"]:
            x, y = a["perplexity"][p]["ppl"], b["perplexity"][p]["ppl"]
            assert abs(x - y) <= 1e-3 * x, (f, p, x, y)
    assert len(list(gpu.rglob("*.json"))) == 1 + 2 * (1 + len(VARIANTS))


def test_compare_runs_finds_identical_and_changed_outcomes(tmp_path):
    """The cross-machine check: the same grid twice gives 0 differing per-doc outcomes; one flipped doc
    and a changed perplexity are counted."""
    from experiments.compare_runs import CompareConfig, run as compare
    from experiments.reproduce import run

    kw = dict(criteria=["reverse_star"], variants=["pruned", "lra"], device="cpu")
    a = run(_tiny_grid(tmp_path, out=str(tmp_path / "a"), **kw))
    b = run(_tiny_grid(tmp_path, out=str(tmp_path / "b"), **kw))
    doc = compare(CompareConfig(a=str(a), b=str(b), out=str(tmp_path / "same")))
    s = doc["summary"]
    assert s["runs"] == 3 and s["per_doc_outcomes"] > 0 and s["per_doc_differing"] == 0
    assert s["max_ppl_rel_diff"] < 1e-9 and s["selections_equal"]
    f = b / "reverse_star" / "lra.json"
    d = json.loads(f.read_text())
    task = next(iter(d["tasks"]))
    d["tasks"][task]["per_doc"]["acc"][0] = 1 - d["tasks"][task]["per_doc"]["acc"][0]
    ppl_set = next(iter(d["perplexity"]))
    d["perplexity"][ppl_set]["ppl"] *= 1.01
    f.write_text(json.dumps(d))
    s = compare(CompareConfig(a=str(a), b=str(b), out=str(tmp_path / "changed")))["summary"]
    assert s["per_doc_differing"] == 1 and abs(s["max_ppl_rel_diff"] - 0.01) < 1e-6
    assert "1 of" in (tmp_path / "changed.md").read_text()


def test_fidelity_sweep_reuses_the_grid_and_plots_kl_against_blocks_removed(tmp_path):
    from experiments.closeness_sweep import SweepConfig, run as sweep
    from experiments.reproduce import run as run_grid

    grid = _tiny_grid(tmp_path, criteria=["reverse_star"], variants=["pruned", "lra", "guarded"], out=str(tmp_path / "p"),
                      calib_samples=8)
    run_grid(grid)
    cfg = SweepConfig(model="tiny", criteria=["reverse_star", "linear_fit"], ratios=[0.125, 0.25],
                      repairs=["pruned", "lra", "guarded"], out=str(tmp_path / "sweep"), grid=grid)
    folder = sweep(cfg)
    made = sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*.json"))
    # the grid's reverse_star runs at its ratio are reused; everything else is measured
    assert made == sorted([f"reverse_star/ratio=0.125_{r}.json" for r in cfg.repairs]
                          + [f"linear_fit/ratio={x:g}_{r}.json" for x in cfg.ratios for r in cfg.repairs])
    doc = json.loads((tmp_path / "sweep" / "tiny.json").read_text())
    assert len(doc["points"]) == 2 * 2 * 3
    one = next(p for p in doc["points"] if p["criterion"] == "reverse_star" and p["ratio"] == 0.125)
    assert one["blocks_removed"] == 1 and set(one["kl"]) == {grid.ppl_sets[0], "tasks"}
    assert (tmp_path / "sweep" / "tiny.png").exists() and "| linear_fit | 0.25 | 2 |" in (tmp_path / "sweep" / "tiny.md").read_text()
    # the guard's choice per span, from the sweep's runs and from the grid's reused run alike
    path = CalibrationConfig().guarded.ridge_path(grid.damping)
    allowed = {"none", "nobias", "replaceme"} | {f"lra@{x:g}" for x in path}
    for p in doc["points"]:
        assert (p["repair"] != "pruned") == bool(p["maps"]) and set(p["maps"]) <= allowed | {"lra"}
        if p["repair"] == "guarded":
            assert len(p["maps"]) >= 1 and set(p["maps"]) <= allowed
    md = (tmp_path / "sweep" / "tiny.md").read_text().splitlines()
    assert md[4].endswith("| +guarded maps |")
    reused = next(p for p in doc["points"] if p["criterion"] == "reverse_star" and p["ratio"] == 0.25
                  and p["repair"] == "guarded")
    assert next(r for r in md if r.startswith("| reverse_star | 0.25 |")).endswith(f"| {', '.join(reused['maps'])} |")


def test_anchored_and_auto_rows_take_passes_of_their_own(tmp_path):
    """``lra_anchored`` and ``lra_auto`` beside ``lra`` and ``lra_span`` in one grid: each fitted in a pass
    of its own mode. Under reverse_star (one span, nothing before it to undo) the anchored map is the
    span LRA, so are their rows; ``lra_auto`` records its held-out judgement and its row is the row of
    the fit it chose (the per-block LRA, or the span LRA, which the three span fits equal here)."""
    from experiments.reproduce import run

    variants = ["pruned", "lra", "lra_span", "lra_anchored", "lra_auto", "lra_replaceme", "lra_replaceme_anchored",
                "lra_replaceme_auto"]
    folder = run(_tiny_grid(tmp_path, criteria=["reverse_star"], variants=variants, out=str(tmp_path / "g"),
                            calib_samples=8))
    rows = {v: json.loads((folder / "reverse_star" / f"{v}.json").read_text()) for v in variants[1:]}
    assert rows["lra_anchored"]["solver"] == "lra_anchored" and rows["lra_anchored"]["sites"][0]["map"]
    choice = rows["lra_auto"]["fit_choice"]
    assert set(choice["kl"]) == {"lra", "lra_span", "lra_sequential", "lra_anchored"} and choice["held_out_windows"] == 2
    same = "lra" if choice["chosen"] == "lra" else "lra_span"
    assert rows["lra_auto"]["sites"][0]["map"] == choice["chosen"]
    if choice["chosen"] in ("lra", "lra_span"):  # its maps are that run's: perplexity and KL checked, tasks reused
        assert rows["lra_auto"]["tasks_from"] == f"reverse_star/{choice['chosen']}"
        assert rows["lra_auto"]["maps_check"]["max_rel_diff"] <= 1e-4 and rows["lra_auto"]["maps_check"]["values"]
    # its maps are the span LRA's, so that row's zero-shot outcomes are reused once perplexity and KL agree
    assert rows["lra_anchored"]["tasks_from"] == "reverse_star/lra_span"
    assert rows["lra_anchored"]["maps_check"]["max_rel_diff"] <= 1e-4
    assert rows["lra_replaceme_anchored"]["tasks_from"] == "reverse_star/lra_replaceme"  # likewise the joint map
    joint = rows["lra_replaceme_auto"]["fit_choice"]  # one span: the three walks are one map, judged once
    assert joint["chosen"] == "lra_replaceme" and set(joint["same_as"]) == {"lra_replaceme_sequential",
                                                                             "lra_replaceme_anchored"}
    assert rows["lra_replaceme_auto"]["tasks_from"] == "reverse_star/lra_replaceme"
    for a, b in (("lra_anchored", "lra_span"), ("lra_auto", same), ("lra_replaceme_anchored", "lra_replaceme"),
                 ("lra_replaceme_auto", "lra_replaceme")):
        for ppl_set, e in rows[b]["perplexity"].items():
            assert rows[a]["perplexity"][ppl_set]["ppl"] == pytest.approx(e["ppl"], rel=1e-5)
        for kl_set, v in rows[b]["kl"].items():
            assert rows[a]["kl"][kl_set] == pytest.approx(v, rel=1e-4, abs=1e-7)
    for a, b in (("lra_auto", same), ("lra_replaceme_auto", "lra_replaceme")):  # the chosen fit's errors, not null
        assert rows[a]["sites"][0]["calib_rel_error"] is not None
        assert rows[a]["sites"][0]["calib_rel_error"] == pytest.approx(rows[b]["sites"][0]["calib_rel_error"], rel=1e-6)
    md = (tmp_path / "g" / "tiny.md").read_text()
    assert "+LRA per span, anchored" in md and "+LRA, fit chosen on held-out KL" in md
    assert "+LRA & ReplaceMe (joint), fit chosen on held-out KL" in md


def test_refit_grid_rescores_every_map_after_the_guarded_kept_block_refit(tmp_path, monkeypatch):
    """``--refit_kept``: each map is followed by the main job's guarded re-fit before its row is scored, and every
    re-fitted weight is put back before the next variant. Judge scripted: the first variant's re-fit is kept (its
    row moves off the plain grid's), the second's is undone (its row is the plain grid's exactly — it would not
    be if the first variant's re-fitted weights had stayed), so with ``--refit_of`` the plain grid its zero-shot
    outcomes are taken from the plain row once perplexity and KL agree. A Gemma3 model is refused before any run.
    The re-fit grid takes the plain grid's original row (``--original_from``), refused if scored otherwise."""
    import itertools

    import shift_lightning.maps.keptfit as K
    import experiments.reproduce as R
    from shift_lightning.errors import ConfigError

    variants = ["lra_replaceme", "lra"]
    plain = R.run(_tiny_grid(tmp_path, criteria=["reverse_star"], variants=variants, out=str(tmp_path / "plain")))
    real, calls = R.guarded_refit, []

    def scripted(*a, **k):
        calls.append(len(calls))
        scores = itertools.count(1.0, -0.1) if len(calls) == 1 else itertools.chain([1.0], itertools.repeat(2.0))
        monkeypatch.setattr(K, "heldout_kl", lambda *a, **k: next(scores))
        return real(*a, **k)

    monkeypatch.setattr(R, "guarded_refit", scripted)
    folder = R.run(_tiny_grid(tmp_path, criteria=["reverse_star"], variants=variants, out=str(tmp_path / "refit"),
                              refit_kept="all", refit_of=str(tmp_path / "plain"), original_from=str(plain.parent)))
    orig, plain_orig = (json.loads((f / "original.json").read_text()) for f in (folder, plain))
    assert orig.pop("copied_from") == str(plain / "original.json") and orig == plain_orig
    rows = {v: json.loads((folder / "reverse_star" / f"{v}.json").read_text()) for v in variants}
    base = {v: json.loads((plain / "reverse_star" / f"{v}.json").read_text()) for v in variants}
    joint, lra = rows["lra_replaceme"]["refit"], rows["lra"]["refit"]
    assert rows["lra_replaceme"]["pruned_layers"] == [5, 6] and joint["tried"] == [7] == lra["tried"]
    assert joint["kept"] == [7] and lra["kept"] == [] and joint["k"] == "all" and joint["blocks"][0]["tokens"] > 0
    assert rows["lra_replaceme"]["seconds"]["refit"] > 0 and "tasks_from" not in rows["lra_replaceme"]
    assert rows["lra"]["tasks_from"] == f"{tmp_path / 'plain'}/reverse_star/lra"
    assert rows["lra"]["maps_check"]["max_rel_diff"] <= 1e-4 and rows["lra"]["tasks"] == base["lra"]["tasks"]
    md = (tmp_path / "refit" / "tiny.md").read_text()
    assert """--variants '["lra_replaceme", "lra"]' --refit_kept all --refit_damping 0.1`""" in md
    assert "Kept of tried: reverse_star/lra none of 7 (k = all, δ = 0.1); reverse_star/lra_replaceme 7 of 7" in md
    moved = rows["lra_replaceme"]["perplexity"], base["lra_replaceme"]["perplexity"]
    assert all(moved[0][s]["ppl"] != pytest.approx(e["ppl"], rel=1e-6) for s, e in moved[1].items())
    for s, e in base["lra"]["perplexity"].items():
        assert rows["lra"]["perplexity"][s]["ppl"] == pytest.approx(e["ppl"], rel=1e-9)
    for s, v in base["lra"]["kl"].items():
        assert rows["lra"]["kl"][s] == pytest.approx(v, rel=1e-9, abs=1e-12)
    with pytest.raises(ConfigError, match="through norms.*drop --refit_kept"):
        R.run(_tiny_grid(tmp_path, tiny={"family": "gemma3", "num_hidden_layers": 8}, refit_kept=1,
                         out=str(tmp_path / "gemma")))
    with pytest.raises(ConfigError, match="refit_kept must be"):
        R.run(_tiny_grid(tmp_path, refit_kept=-1, out=str(tmp_path / "bad")))
    # --original_from: refused before any model is loaded when the original was scored otherwise, or is not there
    with pytest.raises(ConfigError, match=r"scored with other settings \(docs 4 there, 3 here\)"):
        R.run(_tiny_grid(tmp_path, docs=3, original_from=str(plain.parent), out=str(tmp_path / "other")))
    with pytest.raises(ConfigError, match="no original row at .*drop --original_from"):
        R.run(_tiny_grid(tmp_path, original_from=str(tmp_path / "nowhere"), out=str(tmp_path / "other")))


def test_domain_comparison_of_two_grids(tmp_path):
    """The same grid calibrated on two texts: the comparison pairs the rows on the same docs."""
    from experiments.domain_compare import DomainCompareConfig, compare, render
    from experiments.reproduce import run

    kw = dict(criteria=["reverse_star"], variants=["pruned", "lra", "guarded", "guarded_span", "replaceme"], calib_samples=8)
    run(_tiny_grid(tmp_path, out=str(tmp_path / "a"), **kw))
    run(_tiny_grid(tmp_path, out=str(tmp_path / "b"), calib_source=str(ROOT / "tests" / "data" / "tiny_heldout.txt"), **kw))
    # each grid's own table names the text its maps were fitted on
    md_b = (tmp_path / "b" / "tiny.md").read_text()
    assert "calibration tokens (" + str(ROOT / "tests" / "data" / "tiny_heldout.txt") + ")" in md_b
    assert "calibration tokens (" + str(ROOT / "tests" / "data" / "tiny_corpus.txt") + ")" in (tmp_path / "a" / "tiny.md").read_text()
    out = render(DomainCompareConfig(model="tiny", a=str(tmp_path / "a"), b=str(tmp_path / "b"), n_boot=50))
    doc = json.loads(out.with_suffix(".json").read_text())
    assert {(r["criterion"], r["repair"]) for r in doc["rows"]} == {("reverse_star", v) for v in ("lra", "guarded", "replaceme")}
    lra = next(r for r in doc["rows"] if r["repair"] == "lra")
    assert lra["kl"]["a"] != lra["kl"]["b"] and "avg_diff_ci" in lra["b_minus_a"]
    pruned = json.loads((tmp_path / "a" / "tiny" / "reverse_star" / "pruned.json").read_text())["kl"]
    assert lra["kl_pruned"] == {"a": pruned, "b": pruned}  # the same blocks: one pruned reference for both
    # the harm test: each side against pruning alone, paired on the same docs
    from experiments.summary import Bootstrap

    runs = {n: json.loads((tmp_path / g / "tiny" / "reverse_star" / f"{v}.json").read_text())
            for n, g, v in (("p", "a", "pruned"), ("b", "b", "lra"))}
    runs["original"] = json.loads((tmp_path / "a" / "tiny" / "original.json").read_text())
    direct = Bootstrap(runs, "original", n_boot=50).difference("b", "p")
    assert lra["minus_pruned"]["b"]["avg_diff"] == direct["avg_diff"]
    md = out.with_suffix(".md").read_text()
    assert "| reverse_star | +LRA |" in md and "closer to the original than pruning on every set in" in md
    assert "significantly below pruning on Avg or Robust in" in md
    # any two grids: named as asked, equal KL is a tie, pruning alone taken from a third grid where neither has it
    import shutil

    shutil.copytree(tmp_path / "b", tmp_path / "b_copy")
    for f in (tmp_path / "b_copy").rglob("pruned.json"):
        f.unlink()
    two = dict(model="tiny", a=str(tmp_path / "b_copy"), b=str(tmp_path / "b_copy"), n_boot=50, a_label="one", b_label="two",
               title="Same grid")
    assert all(r["kl_pruned"] == {"a": None, "b": None} for r in compare(DomainCompareConfig(**two))["rows"])
    out = render(DomainCompareConfig(**two, pruned_from=str(tmp_path / "a")))
    same = json.loads(out.with_suffix(".json").read_text())["rows"]
    assert all(r["kl_pruned"] == {"a": pruned, "b": pruned} for r in same)
    md = out.with_suffix(".md").read_text()
    assert md.startswith("# Same grid: tiny,") and "| Avg one → two |" in md
    assert f"two lower in 0 of {len(same)} rows ({len(same)} equal within a relative 0.0001)." in md
    assert f"- Avg: two higher in 0 of {len(same)} (significantly: 0; significantly lower: 0)" in md

    # the cross-grid closeness table: the same counts, computed from the same files
    from experiments.closeness_table import ClosenessTableConfig, render as render_table

    out = render_table(ClosenessTableConfig(models=["tiny"], grids={"wiki": str(tmp_path / "a"), "mixed": str(tmp_path / "b")},
                                           criteria=["reverse_star", "angular"], out=str(tmp_path / "fid"), n_boot=50))
    table = json.loads(out.with_suffix(".json").read_text())["models"][0]
    t = table["targets"]["mixed"]
    assert t["criteria"] == 1 and t["closer_of"] == 1 and t["replaceme_of"] == 1  # angular: not run, not counted
    lra_b = runs["b"]
    rm_b = json.loads((tmp_path / "b" / "tiny" / "reverse_star" / "replaceme.json").read_text())
    assert (t["closer"] == ["reverse_star"]) == all(lra_b["kl"][s] < pruned[s] for s in pruned)
    assert (t["kl_below_replaceme"] == ["reverse_star"]) == all(lra_b["kl"][s] < rm_b["kl"][s] for s in pruned)
    row = table["rows"][0]["targets"]["mixed"]
    assert row["vs_pruned"]["avg_diff"] == direct["avg_diff"] and row["replaceme"]["variant"] == "replaceme"
    assert row["robust_below_replaceme_significantly"] == (row["replaceme"]["diff"]["robust_diff_ci"][1] < 0)
    rms = [json.loads((tmp_path / g / "tiny" / "reverse_star" / "replaceme.json").read_text())["kl"] for g in "ab"]
    assert (t["kl_below_replaceme_any_text"] == ["reverse_star"]) == all(lra_b["kl"][s] < min(k[s] for k in rms) for s in pruned)
    assert (t["harm"] == []) == (direct["avg_diff_ci"][1] >= 0 and direct["robust_diff_ci"][1] >= 0)
    falls = {k: runs["b"]["tasks"][k]["value"] - runs["p"]["tasks"][k]["value"] for k in runs["p"]["tasks"]}
    worst, drop = min(falls, key=falls.get), row["largest_task_drop"]  # the task that falls most, if any falls
    assert (drop is None) == (falls[worst] >= 0)
    if drop is not None:
        assert drop["task"] == worst and drop["original"] == runs["original"]["tasks"][worst]["value"]
        assert abs(drop["avg_share"] - falls[worst] / len(falls)) < 1e-12
    split = row["avg_towards_original"]  # Avg's change = back towards the original + the rest
    assert abs(split["avg_diff"] - sum(falls.values()) / len(falls)) < 1e-12
    assert abs(split["towards"] + split["rest"] - split["avg_diff"]) < 1e-12
    assert split["rest_ci"][0] <= split["rest"] <= split["rest_ci"][1]
    md = out.with_suffix(".md").read_text()
    assert "| reverse_star |" in md and "| angular | … |" in md and "**mixed** (1 of 2 criteria run)" in md
    assert md.count("against the better ReplaceMe fitted on the same text: lower KL on every set under") == 2
    # the per-criterion comparison behind the counts: the paired difference, the same as Bootstrap's directly
    runs["rm"] = rm_b
    d = Bootstrap(runs, "original", n_boot=50).difference("b", "rm")
    line = next(x for x in md.splitlines() if x.startswith("| reverse_star | mixed | replaceme |"))
    assert line.endswith(f" | {100 * d['avg_diff']:+.1f} [{100 * d['avg_diff_ci'][0]:+.1f}, {100 * d['avg_diff_ci'][1]:+.1f}] |")
    rm_kl = " / ".join(f"{rm_b['kl'][s]:.2f}" for s in table["sets"])
    assert f"| {rm_kl} |" in line and " | – | – | – | " in line  # tiny models: no task above chance, no Robust
    # the guard beside the repair: its choices per span and its own paired fall below pruning
    runs["g"] = json.loads((tmp_path / "b" / "tiny" / "reverse_star" / "guarded.json").read_text())
    boot = Bootstrap(runs, "original", n_boot=50)
    gd, dg = row["guards"]["guarded"], boot.difference("g", "p")
    assert gd["chosen"] == [site["guard"]["chosen"] for site in runs["g"]["sites"]] and gd["chosen"]
    assert gd["vs_pruned"]["avg_diff"] == dg["avg_diff"] and gd["vs_repair"]["avg_diff"] == boot.difference("g", "b")["avg_diff"]
    gc = t["guards"]["guarded"]
    assert gc["of"] == 1 and (gc["harm"] == []) == gd["no_harm"] and list(t["guards"]) == ["guarded", "guarded_span"]
    assert gc["where_harm"] == t["harm"] and set(gc["removes_harm"]) <= set(t["harm"])
    assert f"| reverse_star | mixed | {', '.join(gd['chosen'])} | " in md
    assert "- **mixed**: run under 1 of 2 criteria; significantly below pruning on Avg or Robust under" in md
    # each guard has its own summary and table; the span guard's choices come from its own run
    span_run = json.loads((tmp_path / "b" / "tiny" / "reverse_star" / "guarded_span.json").read_text())
    assert row["guards"]["guarded_span"]["chosen"] == [site["guard"]["chosen"] for site in span_run["sites"]]
    assert "The do-no-harm guard `guarded` (" in md and "The do-no-harm guard `guarded_span` (" in md
    # the targets of another repair (a candidate default): counted from its own rows, in whichever grid has them
    out = render_table(ClosenessTableConfig(models=["tiny"], grids={"wiki": str(tmp_path / "a"), "mixed": str(tmp_path / "b")},
                                           criteria=["reverse_star", "angular"], out=str(tmp_path / "fid_g"), n_boot=50,
                                           repair="guarded_span"))
    tg = json.loads(out.with_suffix(".json").read_text())["models"][0]["rows"][0]["targets"]
    assert list(tg) == ["wiki", "mixed"] and tg["mixed"]["kl"] == span_run["kl"]
    assert "guarded_span" not in tg["mixed"].get("guards", {}) and "guarded" in tg["mixed"]["guards"]
    md_g = out.with_suffix(".md").read_text()
    assert "Targets for the repair `guarded_span`" in md_g and "`guarded_span` against the better ReplaceMe" in md_g
    assert "| top-1 tasks pruned → guarded_span |" in md_g
    # a grid without same-text ReplaceMe rows says so instead of counting "0 of 0"
    (tmp_path / "b" / "tiny" / "reverse_star" / "replaceme.json").unlink()
    out = render_table(ClosenessTableConfig(models=["tiny"], grids={"wiki": str(tmp_path / "a"), "mixed": str(tmp_path / "b")},
                                           criteria=["reverse_star", "angular"], out=str(tmp_path / "fid"), n_boot=50))
    assert json.loads(out.with_suffix(".json").read_text())["models"][0]["targets"]["mixed"]["replaceme_of"] == 0
    md = out.with_suffix(".md").read_text()
    assert md.count("against the better ReplaceMe fitted on the same text") == 1
    assert "no ReplaceMe row fitted on the same text yet" in md
    # a grid that ran no pruned rows (refitted on another text) shows the other grid's, on the same docs
    import shutil

    from experiments.reproduce import render as render_grid

    (tmp_path / "b" / "tiny" / "reverse_star" / "pruned.json").unlink()
    cfg_b = _tiny_grid(tmp_path, out=str(tmp_path / "b"), calib_source=str(ROOT / "tests" / "data" / "tiny_heldout.txt"),
                       pruned_from=str(tmp_path / "a"), **kw)
    render_grid(tmp_path / "b" / "tiny", cfg_b)
    tb = json.loads((tmp_path / "b" / "tiny.json").read_text())
    assert tb["info"]["pruned_from"] == {"grid": os.path.relpath(tmp_path / "a" / "tiny"), "criteria": ["reverse_star"]}
    assert next(r for r in tb["rows"] if r["variant"] == "lra")["vs_pruned"]["avg_diff"] == direct["avg_diff"]
    md_b = (tmp_path / "b" / "tiny.md").read_text()
    assert "| reverse_star | pruned |" in md_b and f"Pruned rows (reverse_star): from `{os.path.relpath(tmp_path / 'a' / 'tiny')}/`" in md_b
    # ... but never from a grid that scored other docs
    shutil.copytree(tmp_path / "a", tmp_path / "c")
    orig_c = tmp_path / "c" / "tiny" / "original.json"
    orig_c.write_text(json.dumps({**(o := json.loads(orig_c.read_text())), "eval": {**o["eval"], "sample_seed": 7}}))
    render_grid(tmp_path / "b" / "tiny", replace(cfg_b, pruned_from=str(tmp_path / "c")))
    tb = json.loads((tmp_path / "b" / "tiny.json").read_text())
    assert tb["info"]["pruned_from"] is None and "vs_pruned" not in next(r for r in tb["rows"] if r["variant"] == "lra")


def test_a_criterion_with_the_same_blocks_reuses_the_run_and_recomputing_it_gives_the_same_numbers(tmp_path):
    """The reuse rule rests on determinism: a run depends on the criterion only through its blocks. A
    criterion whose cached blocks equal another's takes its files; recomputed, they are identical."""
    from experiments.harness import RunFolder
    from experiments.reproduce import run

    cfg = _tiny_grid(tmp_path, criteria=["reverse_star"], variants=["pruned", "lra"], out=str(tmp_path / "a"))
    folder = run(cfg)
    sel = json.loads((folder / "reverse_star" / "selection.json").read_text())
    for out in ("a", "b"):  # block_influence told to remove reverse_star's blocks, in both folders
        (tmp_path / out / "tiny" / "block_influence").mkdir(parents=True, exist_ok=True)
        (tmp_path / out / "tiny" / "block_influence" / "selection.json").write_text(json.dumps(sel))
    run(_tiny_grid(tmp_path, criteria=["block_influence"], variants=["pruned", "lra"], out=str(tmp_path / "a")))
    reused = RunFolder(folder).read("block_influence/lra")
    assert reused["reused_from"] == "reverse_star/lra" and reused["criterion"] == "block_influence"
    # other settings: no reuse (a different damping changes the map)
    from experiments.reproduce import _reuse

    (folder / "taylor").mkdir()
    (folder / "taylor" / "selection.json").write_text(json.dumps(sel))
    layers = sorted(sel["layers"])
    assert not _reuse(_tiny_grid(tmp_path, damping=1e-2, out=str(tmp_path / "a")), RunFolder(folder), "taylor",
                      layers, "lra")
    assert _reuse(_tiny_grid(tmp_path, out=str(tmp_path / "a")), RunFolder(folder), "taylor", layers, "lra")
    assert RunFolder(folder).read("taylor/lra")["reused_from"] == "reverse_star/lra"  # the root, not a copy
    # a run older than a setting (no such key in its config) has that setting's default; on another device too
    old = RunFolder(folder).read("reverse_star/lra")
    del old["config"]["heldout_every"], old["config"]["kl_docs"]
    old["closeness_added"] = {"eval": {"kl_docs": 50}}
    RunFolder(folder).write("reverse_star/lra", old)
    (folder / "taylor" / "lra.json").unlink()
    assert _reuse(_tiny_grid(tmp_path, device="cuda", out=str(tmp_path / "a")), RunFolder(folder), "taylor", layers, "lra")
    (folder / "taylor" / "lra.json").unlink()
    old["closeness_added"] = {"eval": {"kl_docs": 7}}  # closeness measured on other docs: not the same run
    for name in ("reverse_star/lra", "block_influence/lra"):  # every run on these blocks
        RunFolder(folder).write(name, old)
    assert not _reuse(_tiny_grid(tmp_path, out=str(tmp_path / "a")), RunFolder(folder), "taylor", layers, "lra")
    # recomputed from scratch in a folder without reverse_star's runs: the same numbers
    run(_tiny_grid(tmp_path, criteria=["block_influence"], variants=["pruned", "lra"], out=str(tmp_path / "b")))
    fresh = RunFolder(tmp_path / "b" / "tiny").read("block_influence/lra")
    assert "reused_from" not in fresh
    for key in ("kl", "top1", "perplexity", "average"):
        assert fresh[key] == reused[key], key
    assert [d["per_doc"] for d in fresh["tasks"].values()] == [d["per_doc"] for d in reused["tasks"].values()]


def test_an_older_run_gets_closeness_rebuilt_or_copied_from_a_criterion_with_the_same_blocks(tmp_path):
    """A run file made before closeness existed: the model is rebuilt and its closeness added (the same
    numbers a fresh run records); another criterion's run on the same blocks copies it, after checking
    the two runs' perplexities agree, and says where from."""
    from experiments.harness import RunFolder
    from experiments.reproduce import _reuse_closeness, run

    cfg = _tiny_grid(tmp_path, criteria=["reverse_star"], variants=["pruned", "lra"], out=str(tmp_path / "a"))
    runs = RunFolder(run(cfg))
    fresh = runs.read("reverse_star/lra")
    older = {k: v for k, v in fresh.items() if k not in ("kl", "top1", "closeness")}
    (runs.folder / "block_influence").mkdir()
    (runs.folder / "block_influence" / "selection.json").write_text((runs.folder / "reverse_star" / "selection.json").read_text())
    runs.write("reverse_star/lra", older)
    runs.write("block_influence/lra", {**older, "criterion": "block_influence"})
    run(_tiny_grid(tmp_path, criteria=["reverse_star", "block_influence"], variants=["pruned", "lra"],
                   fill="closeness", out=str(tmp_path / "a")))
    rebuilt, copied = runs.read("reverse_star/lra"), runs.read("block_influence/lra")
    assert rebuilt["kl"] == fresh["kl"] and rebuilt["top1"] == fresh["top1"] and rebuilt["closeness_added"]["seconds"] > 0
    assert copied["closeness_added"]["copied_from"] == "reverse_star/lra" and copied["closeness_added"]["max_ppl_rel_diff"] == 0
    assert (copied["kl"], copied["closeness"]) == (fresh["kl"], fresh["closeness"])
    # a run whose perplexity disagrees is not the same model: nothing copied
    other = {**older, "criterion": "block_influence"}
    other["perplexity"] = {p: {**e, "ppl": 1.01 * e["ppl"]} for p, e in older["perplexity"].items()}
    runs.write("block_influence/lra", other)
    assert not _reuse_closeness(cfg, runs, "block_influence", sorted(older["pruned_layers"]), "lra")
    assert "kl" not in runs.read("block_influence/lra")


def test_maps_check_reuses_tasks_only_when_perplexity_and_kl_agree():
    from experiments.reproduce import _maps_check

    doc = {"perplexity": {"wiki": {"ppl": 20.0}, "lambada": {"ppl": 50.0}}, "kl": {"wiki": 0.5, "tasks": 0.4}}
    same = {"perplexity": {"wiki": {"ppl": 20.0000001}, "lambada": {"ppl": 50.0}}, "kl": {"wiki": 0.5, "tasks": 0.40000001}}
    name, got, check = _maps_check(same, "c/lra_span", doc)
    assert name == "c/lra_span" and got is doc and check["max_rel_diff"] < 1e-6 and len(check["values"]) == 4
    off = {**same, "kl": {"wiki": 0.5, "tasks": 0.41}}  # another map: KL 2.5 % away
    assert _maps_check(off, "c/lra_span", doc) is None
    assert _maps_check({"perplexity": {"other": {"ppl": 1.0}}}, "c/lra_span", doc) is None  # nothing to compare


def test_a_guard_that_kept_the_lra_or_the_span_lra_names_that_row_as_its_twin():
    """The guard refits the candidate it chose as that candidate's own variant is fitted, so where it kept
    the LRA at the calibration damping at every span (``guarded``: the ``lra`` row), or one LRA per
    multi-block span (``guarded_span``: the ``lra_span`` row), that row's zero-shot outcomes can be reused
    once :func:`_maps_check` finds the same perplexity and KL; any other choice has no twin."""
    from types import SimpleNamespace

    from shift_lightning.maps.sites import span_sites
    from experiments.reproduce import _twin

    cfg = _tiny_grid(Path("."), damping=1e-4)
    spans = span_sites([2, 5, 6])  # a one-block span and a two-block one

    def module(variant, *chosen):
        reports = {s.key: {"guards": {variant: {"chosen": c}}} for s, c in zip(spans, chosen)}
        return SimpleNamespace(fit_choice=None, guards=[variant], spans=spans, reports=reports)

    assert _twin(cfg, module("guarded", "lra@0.0001", "lra@0.0001"), "guarded") == "lra"
    assert _twin(cfg, module("guarded_span", "lra@0.0001", "lra@0.0001"), "guarded_span") == "lra"
    assert _twin(cfg, module("guarded_span", "lra@0.0001", "lra@span"), "guarded_span") == "lra_span"
    for chosen in (("lra@0.01", "lra@0.0001"), ("nobias", "lra@0.0001"), ("lra@0.0001", "replaceme"),
                   ("none", "lra@span")):
        assert _twin(cfg, module("guarded_span", *chosen), "guarded_span") is None, chosen
    assert _twin(cfg, module("guarded", "lra@0.0001", "lra@0.0001"), "lra") is None  # not a guard's run
    # the span LRA is the per-block LRA where every removed block is a span of its own
    assert _twin(cfg, SimpleNamespace(fit_choice=None, guards=[], spans=span_sites([2, 5, 8]), reports={}),
                 "lra_span") == "lra"
    assert _twin(cfg, SimpleNamespace(fit_choice=None, guards=[], spans=spans, reports={}), "lra_span") is None
    # the anchored span LRA has nothing to anchor before its first span: with one span it is the span LRA
    one_span = span_sites([5, 6, 7])
    assert _twin(cfg, SimpleNamespace(fit_choice=None, guards=[], spans=one_span, reports={}),
                 "lra_anchored") == "lra_span"
    assert _twin(cfg, SimpleNamespace(fit_choice=None, guards=[], spans=span_sites([5]), reports={}),
                 "lra_anchored") == "lra"
    assert _twin(cfg, SimpleNamespace(fit_choice=None, guards=[], spans=spans, reports={}), "lra_anchored") is None
    auto = SimpleNamespace(fit_choice={"chosen": "lra_sequential"}, guards=[], spans=spans, reports={})
    assert _twin(cfg, auto, "lra_auto") == "lra_sequential"


def test_a_twin_whose_own_outcomes_were_reused_points_to_the_run_that_evaluated_them(tmp_path):
    """``lra_anchored`` with one span is the span LRA, whose row may itself have reused another row's
    outcomes: the reuse then names the run that evaluated the tasks, never a copy."""
    from dataclasses import asdict
    from types import SimpleNamespace

    from shift_lightning.maps.sites import span_sites
    from experiments import harness
    from experiments.reproduce import _same_maps

    cfg = _tiny_grid(tmp_path, damping=1e-4)
    runs = harness.RunFolder(tmp_path / "runs")
    base = {"config": asdict(cfg), "closeness": {}, "tasks": {"arc_easy": {}}}
    runs.write("taylor/lra", base)
    runs.write("taylor/lra_span", {**base, "tasks_from": "taylor/lra"})
    module = SimpleNamespace(fit_choice=None, guards=[], spans=span_sites([4, 5]), reports={})
    name, doc = _same_maps(cfg, runs, "taylor", module, "lra_anchored")
    assert name == "taylor/lra" and "tasks_from" not in doc
    runs.path("taylor/lra").unlink()  # the evaluated run is gone: nothing to reuse
    assert _same_maps(cfg, runs, "taylor", module, "lra_anchored") is None
