"""``make tables`` (``python -m experiments.render``): every committed table re-renders from its JSON into a copy of
``results/`` with the same bytes (``.md``, ``.json``; PNGs are rendered but not compared), every committed ``.md``
under ``results/`` is remade by some job or excused in ``NOT_RENDERED``, and no job runs a model."""

import sys

import pytest

from experiments import render

ROOT = render.ROOT


def test_every_exception_is_a_committed_file():
    """``NOT_RENDERED`` and ``FLOAT_NOISE`` name files that exist (a renamed or removed table leaves no stale
    excuse)."""
    missing = [p for p in (*render.NOT_RENDERED, *render.FLOAT_NOISE) if not (ROOT / p).is_file()]
    assert not missing
    assert all(render.NOT_RENDERED.values()) and all(render.FLOAT_NOISE.values())  # each with its reason


def test_grid_jobs_take_the_render_only_path():
    """The tools that would run a model without it are called with ``--render_only``."""
    runs_models = {"reproduce", "ablations", "closeness_sweep", "recovery_table", "checks/replaceme_cosine_check",
                   "checks/refit_check"}
    jobs = [j for j in render.jobs() if j.tool in runs_models]
    assert {j.tool for j in jobs} == runs_models
    assert all("--render_only" in j.args for j in jobs)


def test_close_compares_json_numbers():
    from experiments.harness import json_close

    assert json_close({"a": [1.0, 2, "x"]}, {"a": [1.0 + 1e-13, 2, "x"]})
    assert not json_close({"a": [1.0]}, {"a": [1.001]})
    assert not json_close({"a": 1.0, "b": 2.0}, {"b": 2.0, "a": 1.0})  # key order is part of the file
    assert not json_close({"a": "x"}, {"a": "y"})


@pytest.fixture
def no_model(monkeypatch):
    """A job that tried to build or load a model fails."""
    from experiments import harness

    def refuse(*a, **k):
        raise AssertionError("a render job tried to load a model")

    monkeypatch.setattr(harness, "open_grid", refuse)
    sys.path.insert(0, str(render.CHECKS))
    import _common

    monkeypatch.setattr(_common, "build_model", refuse)


def test_every_committed_table_rerenders_identically(tmp_path, no_model):
    """The whole of ``make tables`` into ``tmp_path/results``: no rendered ``.md`` / ``.json`` differs from the
    committed one, every committed ``.md`` table is rendered by a job or excused, and every job writes. Without the
    PNG plots: they are not compared, and drawing them is a third of the time."""
    problems = render.check(tmp_path, quiet=True, plots=False)
    assert not problems, "\n".join(problems)


def test_a_rerender_with_float_noise_leaves_the_committed_json_untouched(tmp_path):
    """``make tables`` on another machine: numpy's reductions differ in the last digits. A JSON whose numbers are
    the same within 1e-9 is not rewritten (a clean clone stays clean); a real change is written."""
    import json

    from experiments.harness import write_json_unless_close

    path = tmp_path / "t.json"
    path.write_text(json.dumps({"kappa": 0.123456789012345, "rows": [1, 2.5]}, indent=2))
    before = path.read_bytes(), path.stat().st_mtime_ns
    assert not write_json_unless_close(path, {"kappa": 0.123456789012346, "rows": [1, 2.5]})
    assert (path.read_bytes(), path.stat().st_mtime_ns) == before
    assert write_json_unless_close(path, {"kappa": 0.1235, "rows": [1, 2.5]})
    assert json.loads(path.read_text())["kappa"] == 0.1235
