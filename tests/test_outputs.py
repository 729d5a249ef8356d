"""Nothing lost: output folders are checked before any compute, replaced only when this project wrote
them, swapped in atomically (a crash between the renames is repaired), leftovers cleaned, umask
followed; single result files are written atomically."""

from __future__ import annotations

import errno
import json
import os
import stat
from pathlib import Path

import pytest

from shift_lightning import outputs as O
from shift_lightning.outputs import MARKER, OutputError, OutputExistsError, prepare_output, publish_dir

ROOT = Path(__file__).resolve().parents[1]


def _write(text: str):
    def write(tmp: Path):
        (tmp / "result.txt").write_text(text)
        (tmp / "sub").mkdir()
        (tmp / "sub" / "more.txt").write_text(text)
    return write


def _hidden(parent: Path) -> list[str]:
    return sorted(p.name for p in parent.iterdir() if p.name.startswith("."))


def test_publish_marks_and_replaces_only_our_folders(tmp_path):
    out = tmp_path / "run"
    publish_dir(out, _write("v1"), kind="test", overwrite=False)
    assert (out / "result.txt").read_text() == "v1" and json.loads((out / MARKER).read_text())["kind"] == "test"
    with pytest.raises(OutputExistsError, match="--overwrite"):
        publish_dir(out, _write("v2"), overwrite=False)
    publish_dir(out, _write("v2"), overwrite=True)
    assert (out / "result.txt").read_text() == "v2" and _hidden(tmp_path) == []


def test_overwrite_refuses_a_folder_this_project_did_not_write(tmp_path):
    mine = tmp_path / "photos"
    mine.mkdir()
    (mine / "holiday.jpg").write_bytes(b"precious")
    with pytest.raises(OutputExistsError, match=f"not written by shift-lightning.*{MARKER}"):
        prepare_output(mine, overwrite=True)
    with pytest.raises(OutputExistsError):
        publish_dir(mine, _write("x"), overwrite=True)
    assert (mine / "holiday.jpg").read_bytes() == b"precious" and sorted(os.listdir(mine)) == ["holiday.jpg"]
    assert _hidden(tmp_path) == []


@pytest.mark.parametrize("bad", [".", "..", "", "~"])
def test_refuses_folders_that_are_not_of_their_own(bad, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(OutputError, match="not a folder of its own"):
        prepare_output(bad, overwrite=True)


def test_refuses_a_file_and_an_unwritable_location_before_any_work(tmp_path, monkeypatch):
    f = tmp_path / "report.txt"
    f.write_text("keep")
    with pytest.raises(OutputError, match="is a file"):
        prepare_output(f, overwrite=True)
    assert f.read_text() == "keep"
    with pytest.raises(OutputError, match="Cannot write next to"):  # the parent is a file: cannot be created
        prepare_output(f / "out")

    def read_only(*a, **k):  # a read-only file system (root ignores permission bits, so inject the errno)
        raise OSError(errno.EROFS, os.strerror(errno.EROFS))

    monkeypatch.setattr(O.tempfile, "NamedTemporaryFile", read_only)
    with pytest.raises(OutputError, match="Read-only file system.*writable --output_dir"):
        prepare_output(tmp_path / "new")
    with pytest.raises(OutputError, match="Read-only file system"):
        O.prepare_file(tmp_path / "table.json")


@pytest.mark.parametrize("exchange", [True, False])
def test_crash_between_the_renames_is_repaired_on_the_next_start(tmp_path, monkeypatch, exchange):
    """Fault injection: the process dies after "out -> .old" and before "tmp -> out" (the two-rename
    path used where the OS has no atomic exchange). The next start restores the old result."""
    out = tmp_path / "run"
    publish_dir(out, _write("old"))
    monkeypatch.setattr(O, "_renameat2_exchange", lambda a, b: False)
    real_rename = os.rename
    calls = []

    def dying_rename(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == 2:
            raise KeyboardInterrupt("killed between the renames")
        return real_rename(src, dst)

    monkeypatch.setattr(O.os, "rename", dying_rename)
    with pytest.raises(KeyboardInterrupt):
        publish_dir(out, _write("new"))
    monkeypatch.setattr(O.os, "rename", real_rename)
    assert not out.exists() and any(n.startswith(".run.old-") for n in _hidden(tmp_path))  # what a kill leaves
    if exchange:
        monkeypatch.undo()  # the next start may have the atomic exchange again
    monkeypatch.setattr("shift_lightning.outputs.ownership.alive", lambda *a: False)  # the killed process is gone
    prepare_output(out, overwrite=True)  # the next start
    assert (out / "result.txt").read_text() == "old" and _hidden(tmp_path) == []
    publish_dir(out, _write("new"))
    assert (out / "result.txt").read_text() == "new" and _hidden(tmp_path) == []


def test_atomic_exchange_never_leaves_the_output_missing(tmp_path, monkeypatch):
    out = tmp_path / "run"
    publish_dir(out, _write("old"))
    seen = []
    real = O._renameat2_exchange

    def spy(a, b):
        ok = real(a, b)
        seen.append((ok, (b / "result.txt").read_text()))  # right after the swap: the new result is in place
        return ok

    monkeypatch.setattr(O, "_renameat2_exchange", spy)
    publish_dir(out, _write("new"))
    assert seen == [(True, "new")] and (out / "result.txt").read_text() == "new" and _hidden(tmp_path) == []


def test_leftovers_of_crashed_runs_are_cleaned(tmp_path):
    out = tmp_path / "run"
    publish_dir(out, _write("current"))
    import socket
    import subprocess

    from shift_lightning.outputs.ownership import OWNER

    dead = subprocess.Popen(["true"])
    dead.wait()  # a process that made them and is gone
    for name in (".run.tmp-abc", ".run.old-123", ".run.tmp-def"):  # hidden leftovers of earlier kills
        (tmp_path / name).mkdir()
        (tmp_path / name / "half.bin").write_bytes(b"x")
        (tmp_path / name / OWNER).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname()}))
    (tmp_path / ".other.tmp-1").mkdir()  # someone else's: not touched
    (tmp_path / ".run.tmp-mine").mkdir()  # named like a leftover, but no owner file: a person's, not touched
    done = O.recover_leftovers(out)
    assert len(done) == 3 and _hidden(tmp_path) == [".other.tmp-1", ".run.tmp-mine"]
    assert (out / "result.txt").read_text() == "current"  # the live result is never replaced by an old one


def test_a_failing_writer_leaves_the_old_result_and_no_temp(tmp_path):
    out = tmp_path / "run"
    publish_dir(out, _write("old"))

    def broken(tmp: Path):
        (tmp / "result.txt").write_text("half")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        publish_dir(out, broken)
    assert (out / "result.txt").read_text() == "old" and _hidden(tmp_path) == []


@pytest.mark.parametrize("umask", [0o022, 0o027, 0o002])
def test_folders_and_files_follow_the_umask(tmp_path, umask):
    old = os.umask(umask)
    try:
        out = publish_dir(tmp_path / "run", _write("x"))
        f = O.write_json_atomic(tmp_path / "t" / "table.json", {"a": 1})
    finally:
        os.umask(old)
    mode = lambda p: stat.S_IMODE(p.stat().st_mode)  # noqa: E731
    assert mode(out) == mode(out / "sub") == 0o777 & ~umask
    assert mode(out / "result.txt") == mode(out / MARKER) == mode(f) == 0o666 & ~umask


def test_single_files_are_written_atomically(tmp_path):
    p = tmp_path / "table.md"
    O.write_text_atomic(p, "v1")

    def broken(tmp: Path):
        tmp.write_text("half")
        raise RuntimeError("killed")

    with pytest.raises(RuntimeError):
        O.write_file_atomic(p, broken)
    assert p.read_text() == "v1" and _hidden(tmp_path) == []
    with pytest.raises(OutputError, match="is a folder"):
        O.prepare_file(tmp_path)


# ------------------------------------------------------------------------------------------------
# Entry points: the output is checked before the model is loaded
# ------------------------------------------------------------------------------------------------
def _no_model(*a, **k):
    raise AssertionError("the model was loaded before the output location was checked")


@pytest.mark.parametrize("entry", ["calibrate", "evaluate"])
def test_entry_points_refuse_the_output_before_loading_the_model(entry, tmp_path, monkeypatch, capsys):
    from shift_lightning.recipes import calibrate as C, cli, evaluate as E

    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(C, "load_pretrained", _no_model)
    monkeypatch.setattr(E, "load_pretrained", _no_model)
    main = cli.calibrate_main if entry == "calibrate" else cli.evaluate_main
    config = "tiny.yaml" if entry == "calibrate" else "eval_tiny.yaml"
    f = tmp_path / "results.json"
    f.write_text("{}")
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("mine")
    cases = [(f, "is a file"), (foreign, "not written by shift-lightning"), (f / "x", "Cannot write next to")]
    for out, match in cases:
        with pytest.raises(SystemExit) as e:
            main(["--config", config, "--output_dir", str(out), "--overwrite"])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and match in err and "Traceback" not in err
    assert f.read_text() == "{}" and (foreign / "notes.txt").read_text() == "mine"
