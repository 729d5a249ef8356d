"""The targets summary: counts from the closeness tables, each target met / not met / open."""

import json
from pathlib import Path

import pytest

from experiments.targets_summary import MET, NOT_MET, OPEN, TargetsSummaryConfig, render, summarize

ROOT = Path(__file__).resolve().parents[2]
CRITERIA = ["a", "b", "c", "d"]


def _doc(repair, run, closer, harm, robust, kl_below, robust_above):
    """A closeness table's JSON for one model: ``run`` of the four criteria have the repair's rows."""
    t = {"criteria": len(run), "closer": closer, "closer_of": len(run), "harm": harm, "harm_of": len(run),
         "best_robust": {"criterion": run[0], "robust": robust, "robust_ci": [robust - 0.1, robust + 0.1]},
         "kl_below_replaceme": kl_below, "robust_above_replaceme": robust_above, "replaceme_of": len(run)}
    return {"repair": repair, "models": [{"model": "m", "rows": [{"criterion": c} for c in CRITERIA],
                                          "targets": {"mixed": t}}]}


def test_each_target_is_met_not_met_or_open_by_what_the_missing_criteria_could_change():
    cfg = TargetsSummaryConfig(robust_above=3)
    full = summarize(_doc("lra", CRITERIA, CRITERIA, [], 0.85, CRITERIA, ["a", "b", "c"]), cfg)[0]
    assert full["status"] == {"closer": MET, "no_harm": MET, "robust": MET, "kl_vs_replaceme": MET,
                              "robust_vs_replaceme": MET}
    assert full["closer"] == [4, 4] and full["robust_above_replaceme"] == [3, 4]
    # two criteria not run: targets that must hold under all stay open; a failure already seen is final
    part = summarize(_doc("x", ["a", "b"], ["a", "b"], ["b"], 0.70, ["a"], ["a"]), cfg)[0]
    assert part["status"] == {"closer": OPEN, "no_harm": NOT_MET, "robust": OPEN, "kl_vs_replaceme": NOT_MET,
                              "robust_vs_replaceme": OPEN}  # 1 above + 2 to run could still reach 3
    assert summarize(_doc("x", ["a", "b"], [], [], 0.7, [], []), cfg)[0]["status"]["robust_vs_replaceme"] == NOT_MET
    assert summarize(_doc("x", ["a", "b"], [], [], 0.9, [], []), cfg)[0]["status"]["robust"] == MET
    assert summarize(_doc("x", CRITERIA, [], [], 0.79, [], []), cfg)[0]["status"]["robust"] == NOT_MET
    # a table without rows on the counted text is left out, not shown as 0 of 0
    assert summarize(_doc("x", ["a"], [], [], 0.5, [], []), TargetsSummaryConfig(grid="wiki")) == []


def test_render_orders_by_model_and_names_a_missing_table(tmp_path):
    paths = []
    for repair in ("lra", "lra_auto"):
        p = tmp_path / f"{repair}.json"
        p.write_text(json.dumps(_doc(repair, CRITERIA, CRITERIA, ["c"], 0.81, CRITERIA, ["a"])))
        paths.append(str(p))
    out = render(TargetsSummaryConfig(tables=paths, out=str(tmp_path / "t"), default="lra"))
    md = out.with_suffix(".md").read_text()
    assert "| m | `lra` | 4 of 4 | 4 of 4 ✓ | 1 of 4 ✗ | 81.0 [71.0, 91.0] (a) ✓ | 4 of 4 ✓ | 1 of 4 ✗ | – |" in md
    assert [x["repair"] for x in json.loads(out.with_suffix(".json").read_text())["lines"]] == ["lra", "lra_auto"]
    with pytest.raises(FileNotFoundError, match="closeness_table --repair"):
        render(TargetsSummaryConfig(tables=[*paths, str(tmp_path / "nope.json")], out=str(tmp_path / "t")))


def test_the_committed_summary_is_the_committed_fidelity_tables(tmp_path, monkeypatch):
    """results/targets.* is re-rendered whenever a closeness table changes (the README quotes it)."""
    monkeypatch.chdir(ROOT)
    committed = json.loads((ROOT / "results" / "targets.json").read_text())
    out = render(TargetsSummaryConfig(out=str(tmp_path / "t")))
    assert json.loads(out.with_suffix(".json").read_text())["lines"] == committed["lines"]
    assert out.with_suffix(".md").read_text() == (ROOT / "results" / "targets.md").read_text()


def test_closer_than_the_default_counts_criteria_where_both_ran_and_every_set_is_lower(tmp_path):
    """The switch rules' first clause: lower KL than the default repair on every set, per criterion where both ran."""
    doc = _doc("joint", CRITERIA, CRITERIA, [], 0.7, CRITERIA, CRITERIA)

    def cell(*kl):
        return {"kl": dict(zip(("wiki", "lambada", "tasks"), kl))}

    rows = doc["models"][0]["rows"]
    rows[0]["cells"] = {"mixed:lra": cell(1.0, 1.0, 1.0), "mixed:joint": cell(0.9, 0.8, 0.9)}   # closer
    rows[1]["cells"] = {"mixed:lra": cell(1.0, 1.0, 1.0), "mixed:joint": cell(0.9, 1.01, 0.9)}  # one set further
    rows[2]["cells"] = {"mixed:lra": cell(1.0, 1.0, 1.0), "mixed:joint": cell(1.0, 0.5, 0.5)}   # a tie is not closer
    rows[3]["cells"] = {"mixed:joint": cell(0.1, 0.1, 0.1), "wiki:lra": cell(1.0, 1.0, 1.0)}    # default not run here
    line = summarize(doc, TargetsSummaryConfig(default="lra"))[0]
    assert line["closer_than_default"] == [1, 3]
    assert summarize(_doc("lra", CRITERIA, CRITERIA, [], 0.7, CRITERIA, CRITERIA),
                     TargetsSummaryConfig(default="lra"))[0]["closer_than_default"] is None
    p = tmp_path / "joint.json"
    p.write_text(json.dumps(doc))
    md = render(TargetsSummaryConfig(tables=[str(p)], out=str(tmp_path / "t"), default="lra")).with_suffix(".md").read_text()
    assert "| closer than `lra` |" in md and md.rstrip().endswith("| 4 of 4 ✓ | 4 of 4 ✗ | 1 of 3 |")


def test_each_significant_fall_is_listed_with_its_interval_and_the_task_that_fell_most(tmp_path):
    doc = _doc("lra", CRITERIA, CRITERIA, ["c"], 0.7, CRITERIA, CRITERIA)
    doc["models"][0]["rows"][2]["targets"] = {"mixed": {
        "vs_pruned": {"avg_diff": -0.03, "avg_diff_ci": [-0.046, -0.014], "robust_diff": 0.02,
                      "robust_diff_ci": [-0.1, 0.15]},
        "largest_task_drop": {"task": "boolq", "pruned": 0.565, "repaired": 0.345, "original": 0.36,
                              "avg_share": -0.031},
        "avg_towards_original": {"avg_diff": -0.03, "towards": -0.029, "towards_ci": [-0.04, -0.02], "rest": -0.001,
                                 "rest_ci": [-0.012, 0.009]}}}
    line = summarize(doc, TargetsSummaryConfig())[0]
    assert [f["criterion"] for f in line["falls"]] == ["c"]
    p = tmp_path / "lra.json"
    p.write_text(json.dumps(doc))
    md = render(TargetsSummaryConfig(tables=[str(p)], out=str(tmp_path / "t"))).with_suffix(".md").read_text()
    assert ("- m `lra`: c (Avg -3.0 [-4.6, -1.4]↓, Robust +2.0 [-10.0, +15.0]; boolq 56.5 → 34.5, original 36.0; "
            "Avg -2.9 back towards the original, -0.1 [-1.2, +0.9] the rest)" in md)
    # no falls, no section
    clean = _doc("lra", CRITERIA, CRITERIA, [], 0.7, CRITERIA, CRITERIA)
    p.write_text(json.dumps(clean))
    md = render(TargetsSummaryConfig(tables=[str(p)], out=str(tmp_path / "t"))).with_suffix(".md").read_text()
    assert "significantly below pruning (paired" not in md


def test_avg_change_splits_into_the_move_back_towards_the_original_and_the_rest():
    """Per task the change from pruning is clipped into [pruned, original]: that part is the repair undoing
    what pruning changed; a move past the original, or away from it, is the rest (paired intervals)."""
    import numpy as np

    from experiments.summary import Bootstrap, back_towards

    # boolq falls past the original (-0.205 back, -0.015 past), arc rises short of it (+0.02 back),
    # piqa falls away from it (-0.03 rest), hs moves where pruning had not moved it (+0.01 rest)
    assert back_towards(-0.22, 0.36 - 0.565) == pytest.approx(-0.205)
    assert back_towards(0.02, 0.07) == pytest.approx(0.02) and back_towards(-0.03, 0.05) == 0.0
    assert back_towards(0.01, 0.0) == 0.0
    assert np.allclose(back_towards(np.array([-0.22, 0.02, -0.03]), np.array([-0.205, 0.07, 0.05])),
                       [-0.205, 0.02, 0.0])

    n = 1000  # docs per task; accuracies k / n exactly

    def row(**acc):
        return {"tasks": {t: {"chance": 0.25, "metric": "acc", "value": v, "per_doc": {
            "doc_ids": list(range(n)), "acc": [1.0] * round(v * n) + [0.0] * (n - round(v * n))}}
            for t, v in acc.items()}}

    rows = {"original": row(boolq=0.36, arc=0.45, piqa=0.60, hs=0.40),
            "pruned": row(boolq=0.565, arc=0.38, piqa=0.55, hs=0.40),
            "lra": row(boolq=0.345, arc=0.40, piqa=0.52, hs=0.41)}
    x = Bootstrap(rows, "original", n_boot=200).towards("lra", "pruned")
    assert x["towards"] == pytest.approx((-0.205 + 0.02) / 4)
    assert x["rest"] == pytest.approx((-0.015 - 0.03 + 0.01) / 4)
    assert x["avg_diff"] == pytest.approx((-0.22 + 0.02 - 0.03 + 0.01) / 4)
    assert x["rest_ci"][0] <= x["rest"] <= x["rest_ci"][1] and x["towards_ci"][0] <= x["towards"] <= x["towards_ci"][1]
    same = Bootstrap(rows, "original", n_boot=50).towards("pruned", "pruned")
    assert same["avg_diff"] == same["towards"] == same["rest"] == 0.0 and same["rest_ci"] == [0.0, 0.0]


def test_a_refit_of_the_same_map_is_a_tie_not_closer():
    """Refits of one map differ in the 7th digit of their KL (float summation order): not closer, either way."""
    from experiments.tables.common import KL_TIE, lower_kl_everywhere

    ref = {"wiki": 0.8236103497, "lambada": 0.8456118737, "tasks": 0.5787038044}
    refit = {"wiki": 0.8236101742, "lambada": 0.8456118554, "tasks": 0.5787037303}  # Gemma magnitude-L2's two rows
    assert max(ref[s] - refit[s] for s in ref) < KL_TIE
    assert not lower_kl_everywhere(refit, ref) and not lower_kl_everywhere(ref, refit)
    assert lower_kl_everywhere({s: v - 1e-4 for s, v in ref.items()}, ref)


def test_the_refit_grid_is_counted_as_a_line_of_its_own_and_compared_with_the_default_on_the_mixed_text(tmp_path):
    """``mixed_refit`` (the joint map + the kept-block re-fit): its own line, labelled, whose last column compares
    it with the default repair's rows on the mixed text (not with itself, which would say nothing)."""
    doc = _doc("lra_replaceme", CRITERIA, CRITERIA, [], 0.7, CRITERIA, CRITERIA)
    m = doc["models"][0]
    m["targets"]["mixed_refit"] = {**m["targets"]["mixed"], "criteria": 2, "closer_of": 2, "harm": ["a"],
                                   "harm_of": 2, "closer": ["a", "b"]}
    kl = lambda v: {"kl": {"wiki": v, "tasks": v}}  # noqa: E731
    m["rows"][0]["cells"] = {"mixed:lra_replaceme": kl(1.0), "mixed_refit:lra_replaceme": kl(0.8)}
    m["rows"][1]["cells"] = {"mixed:lra_replaceme": kl(1.0), "mixed_refit:lra_replaceme": kl(1.0)}  # a tie
    cfg = TargetsSummaryConfig(default="lra_replaceme")
    plain, refit = summarize(doc, cfg)
    assert (plain["grid"], refit["grid"]) == ("mixed", "mixed_refit") and plain["closer_than_default"] is None
    assert refit["closer_than_default"] == [1, 2] and refit["harm"] == [1, 2]
    assert refit["status"]["no_harm"] == NOT_MET and refit["status"]["closer"] == OPEN
    p = tmp_path / "joint.json"
    p.write_text(json.dumps(doc))
    md = render(TargetsSummaryConfig(tables=[str(p)], out=str(tmp_path / "t"))).with_suffix(".md").read_text()
    assert "| m | `lra_replaceme` + kept-block re-fit | 2 of 4 | 2 of 2 … | 1 of 2 ✗ |" in md
    assert summarize(doc, TargetsSummaryConfig(also={})) == [plain]


def test_the_targets_compare_with_the_product_default():
    from shift_lightning.calibration import CalibrationConfig

    assert TargetsSummaryConfig().default == CalibrationConfig().solver
