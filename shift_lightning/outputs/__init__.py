"""Output folders: checked before any compute, written atomically, never clobbering foreign files.

Used by every writer (calibration, evaluation, training, benchmarks, the paper grid, caches):

* :func:`prepare_output` runs first, before a model is loaded: it refuses a path that is a file,
  an output that is one of the run's inputs, contains one or lies inside one (``inputs``), an
  existing non-empty folder without ``--overwrite``, and, even with ``--overwrite``, a folder that
  this project did not write (no :data:`MARKER` file inside) or one that holds files it did not
  write (the marker lists what was written; anything else was added by someone): we only ever
  replace our own outputs, never a file a person put there. It checks that the location is
  writable (read-only file systems, permissions) without creating any folder, and cleans the
  hidden leftovers of earlier crashed runs (``.<name>.tmp-*``, ``.<name>.old-*``), restoring an
  old result whose replacement never arrived.
* :func:`publish_dir` writes into a temporary sibling folder and swaps it in: with an atomic
  exchange (``renameat2(RENAME_EXCHANGE)``) where the OS has one, otherwise two renames whose
  interruption :func:`prepare_output` repairs on the next start. A crash never leaves half a
  result, and an old result is only removed once the new one is complete. A write that fails for
  lack of space (or any other OS error) is one :class:`OutputError`; the old result stays.

Single result files (benchmarks, the paper grid's runs and tables) are checked with
:func:`prepare_file` before the compute and written with :func:`write_text_atomic` /
:func:`write_json_atomic` (temporary sibling + atomic rename); a file that must never replace another
run's (the GGUF export) is published with :func:`publish_file` (the check made at the rename).

Folders and files follow the process umask (``tempfile.mkdtemp`` alone would make them 0700).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import json
import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from ..errors import ShiftError
from .fingerprints import edited_entries, file_fingerprints
from .ownership import OWNER, abandoned_folder, claim

#: The longest --output_dir name (255 bytes less the suffixes of its siblings: ``.<name>.tmp-XXXXXXXX``,
#: ``<name>.calibration``, ``.<name>.probe-XXXXXXXX``, ``<name>.run-<pid>``).
_NAME_MAX = 200

#: Written into every folder this project publishes; ``--overwrite`` replaces only such folders.
MARKER = ".shift_lightning.json"


class OutputError(ShiftError, OSError):
    """The output location cannot or must not be written."""


class OutputExistsError(OutputError, FileExistsError):
    """The output folder exists and may not be replaced."""


def _umask() -> int:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def is_ours(path: Path) -> bool:
    return (path / MARKER).is_file()


def _leftovers(out: Path) -> tuple[list[Path], list[Path]]:
    """The abandoned work folders of ``out`` (:func:`~shift_lightning.outputs.ownership.abandoned_folder`: an
    owner file inside and a dead owner; a folder merely named like one is not)."""
    if not out.parent.is_dir():
        return [], []
    tmps = sorted(p for p in out.parent.glob(f".{out.name}.tmp-*") if abandoned_folder(p))
    olds = sorted((p for p in out.parent.glob(f".{out.name}.old-*") if abandoned_folder(p)),
                  key=lambda p: p.stat().st_mtime)
    return tmps, olds


def recover_leftovers(out: Path) -> list[str]:
    """Repair an interrupted swap and delete hidden leftovers of crashed runs; returns what was done."""
    done = []
    tmps, olds = _leftovers(out)
    if olds and not out.exists() and not out.is_symlink():  # crashed between "out -> old" and "tmp -> out"
        os.rename(olds[-1], out)
        (out / OWNER).unlink(missing_ok=True)
        done.append(f"restored {out} from {olds[-1].name}")
        olds = olds[:-1]
    for p in tmps + olds:
        shutil.rmtree(p, ignore_errors=True)
        done.append(f"removed leftover {p.name}")
    return done


def check_writable(path: Path, fix: str) -> None:
    """Write (then delete) a probe file in the nearest existing folder above ``path``: a read-only
    file system, missing permissions or a parent that is a file fail here, before any compute.
    No folder is created (a run that fails later leaves nothing behind)."""
    base = path.parent
    while not base.exists() and base != base.parent:
        base = base.parent
    try:
        if not base.is_dir():
            raise NotADirectoryError(20, f"{base} is a file, not a folder")
        with tempfile.NamedTemporaryFile(dir=base, prefix=f".{path.name}.probe-"):
            pass
    except OSError as e:
        raise OutputError(f"Cannot write next to {path} ({e.strerror or e}); {fix}") from e


def check_not_input(out: str | Path, inputs: dict[str, str | Path | None] | None) -> None:
    """Refuse an output that is one of the run's inputs, contains one or lies inside one
    (``inputs``: option name -> path; names that are no local path, e.g. hub ids, are skipped):
    writing it would replace, or mix with, what the run reads."""
    o = Path(out).expanduser().resolve()
    for option, given in (inputs or {}).items():
        if not given:
            continue
        q = Path(given).expanduser()
        if not q.exists():
            continue
        q = q.resolve()
        rel = "is" if o == q else "contains" if o in q.parents else "is inside" if q in o.parents else None
        if rel:
            raise OutputError(f"--output_dir {out} {rel} the input {option} {given}: the output would replace or mix "
                              "with what the run reads; choose another --output_dir")


def _entries(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")} - {MARKER, OWNER}


def foreign_entries(out: Path) -> list[str]:
    """What a folder of ours holds that this project did not write (a person added it): entries
    not listed in the marker (markers of older versions list nothing: then entries newer than
    the marker)."""
    try:
        listed = json.loads((out / MARKER).read_text()).get("files")
    except (OSError, ValueError, AttributeError):
        listed = None
    if isinstance(listed, list):
        return sorted(_entries(out) - set(listed))
    stamp = (out / MARKER).stat().st_mtime + 1.0
    return sorted(e for e in _entries(out) if (out / e).lstat().st_mtime > stamp)


def prepare_output(output_dir: str | Path | None, overwrite: bool = False,
                   inputs: dict[str, str | Path | None] | None = None) -> Path | None:
    """Check ``output_dir`` before any work (see the module docstring); returns it as a Path.
    ``inputs``: the run's local inputs by option name (the output may not be, contain or lie in one).
    What the folder is now is remembered: this process's publish replaces only that (a result another
    run published meanwhile is never replaced; see :class:`PublishConflict`)."""
    out = _check_output(output_dir, overwrite, inputs)
    if out is not None:
        _AT_START[str(out.absolute())] = _identity(out)
    return out


def _version() -> str:
    """The installed shift-lightning's version (read from its metadata: the package root is not imported here)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("shift-lightning")
    except PackageNotFoundError:
        return "unknown (not installed)"


def _check_output(output_dir: str | Path | None, overwrite: bool = False,
                  inputs: dict[str, str | Path | None] | None = None) -> Path | None:
    if output_dir is None:
        return None
    out = Path(output_dir).expanduser()
    if str(output_dir).strip() in ("", ".", "..") or out.resolve() == Path.cwd().resolve() \
            or out.resolve() == Path.home().resolve() or out.resolve() == Path(out.anchor):
        raise OutputError(f"--output_dir {str(output_dir)!r} is not a folder of its own; name a new folder, "
                          "e.g. --output_dir outputs/run1")
    if len(os.fsencode(out.name)) > _NAME_MAX:  # room for the run's siblings (.tmp-*, .calibration, .ckpt)
        raise OutputError(f"--output_dir name {out.name[:40]}… is {len(os.fsencode(out.name))} bytes long; file systems "
                          f"allow 255 and the run adds suffixes: use at most {_NAME_MAX}")
    if out.is_symlink():
        raise OutputError(f"--output_dir {out} is a symbolic link (to {os.readlink(out)}); name the folder itself "
                          "or another --output_dir")
    if out.exists() and not out.is_dir():
        raise OutputError(f"--output_dir {out} is a file, not a folder; choose another --output_dir")
    check_not_input(out, inputs)
    check_writable(out, "choose a writable --output_dir")
    recover_leftovers(out)
    if out.exists() and any(out.iterdir()):
        if not overwrite:
            raise OutputExistsError(f"Output folder {out} already exists and is not empty; pass --overwrite to "
                                    "replace it or choose another --output_dir.")
        if not is_ours(out):
            raise OutputExistsError(
                f"Output folder {out} was not written by shift-lightning (no {MARKER} inside), so --overwrite "
                "will not replace it; choose another --output_dir or remove the folder yourself.")
        added = foreign_entries(out)
        if added:
            shown = ", ".join(added[:5]) + (f" and {len(added) - 5} more" if len(added) > 5 else "")
            raise OutputExistsError(
                f"Output folder {out} holds files shift-lightning did not write ({shown}); --overwrite would delete "
                "them: move them out of the folder, or choose another --output_dir.")
        edited = edited_entries(out)
        if edited:
            raise OutputExistsError(
                f"Output folder {out} holds files edited since shift-lightning wrote them ({', '.join(edited[:5])}); "
                "--overwrite would replace them: copy them elsewhere (or remove them), or choose another --output_dir.")
    return out


def _renameat2(a: Path, b: Path, flag: int) -> bool | None:
    """Linux renameat2: 2 = RENAME_EXCHANGE (swap two paths atomically), 1 = RENAME_NOREPLACE (rename
    unless ``b`` exists). True done, False ``b`` exists (NOREPLACE), None unsupported or failed."""
    import errno

    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if fn(-100, os.fsencode(a), -100, os.fsencode(b), flag) == 0:  # -100: AT_FDCWD
        return True
    return False if ctypes.get_errno() == errno.EEXIST and flag == 1 else None


def _renameat2_exchange(a: Path, b: Path) -> bool:
    """Atomically exchange two paths (Linux renameat2 RENAME_EXCHANGE); False where unsupported."""
    return _renameat2(a, b, 2) is True


def _identity(out: Path) -> tuple | None:
    """What ``out`` is now (None: absent or empty), to notice another run publishing there meanwhile."""
    try:
        st = out.stat()
        if not any(out.iterdir()):
            return None
    except OSError:
        return None
    return st.st_dev, st.st_ino


#: path -> what it was when this process's run checked it (:func:`prepare_output`): a publish replaces
#: only that, never a result another run published meanwhile.
_AT_START: dict[str, tuple | None] = {}


class PublishConflict(OutputExistsError):
    """Another run published the same output while this one ran; this run's result was kept aside."""


def _conflict(tmp: Path, out: Path) -> None:
    keep = out.with_name(f"{out.name}.run-{os.getpid()}")
    os.rename(tmp, keep)
    (keep / OWNER).unlink(missing_ok=True)
    raise PublishConflict(f"Another run published {out} while this one was running; this run's result was kept as "
                          f"{keep} (nothing was replaced): compare the two, then rename the one you keep")


def _swap_in(tmp: Path, out: Path, expected=...) -> None:
    if expected is not ... and _identity(out) != expected:
        _conflict(tmp, out)
    if not out.exists():
        done = _renameat2(tmp, out, 1)
        if done is False:  # appeared just now: another run's
            _conflict(tmp, out)
        if done is None:
            os.rename(tmp, out)
        return
    if _renameat2_exchange(tmp, out):  # tmp now holds the old result
        shutil.rmtree(tmp, ignore_errors=True)
        return
    old = out.with_name(f".{out.name}.old-{os.getpid()}")
    claim(out)  # while it is aside, it is an abandoned work folder once this process dies
    os.rename(out, old)
    os.rename(tmp, out)  # a crash before this line is repaired by recover_leftovers()
    shutil.rmtree(old, ignore_errors=True)


def publish_file(tmp: Path, path: Path, overwrite: bool = False) -> Path:
    """Move the finished ``tmp`` to ``path``: with ``overwrite`` over what is there; else only if ``path`` still does not
    exist (renameat2 NOREPLACE, else a hard link): a file another run published meanwhile is never replaced."""
    if overwrite:
        os.replace(tmp, path)
        return path
    done = _renameat2(tmp, path, 1)
    if done is None:  # no renameat2 here: a hard link fails the same way when path exists
        try:
            os.link(tmp, path)
            tmp.unlink()
            done = True
        except FileExistsError:
            done = False
    if not done:
        keep = path.with_name(f"{path.name}.run-{os.getpid()}")
        os.rename(tmp, keep)
        raise PublishConflict(f"Another run wrote {path} while this one was running; this run's file was kept as {keep} "
                              "(nothing was replaced): compare the two, then rename the one you keep")
    return path


def _follow_umask(folder: Path) -> None:
    """Files and folders written into ``folder`` get the modes the umask gives (some writers, e.g.
    safetensors, create their files 0600)."""
    mask = _umask()
    for p in folder.rglob("*"):
        if not p.is_symlink():
            os.chmod(p, (0o777 if p.is_dir() else 0o666) & ~mask)


def make_temp_dir(parent: Path, prefix: str) -> Path:
    """``tempfile.mkdtemp`` whose mode follows the umask (mkdtemp alone makes it 0700)."""
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=prefix))
    os.chmod(tmp, 0o777 & ~_umask())
    return tmp


def publish_dir(output_dir: str | Path, write: Callable[[Path], None], kind: str = "output",
                overwrite: bool = True) -> Path:
    """Write into a temporary sibling folder with ``write(tmp)``, add the marker, then swap it in.

    ``overwrite=False`` refuses to replace an existing non-empty folder (checked again here, since
    the world may have changed during the compute).
    """
    out = Path(output_dir).expanduser()
    expected = _AT_START.get(str(out.absolute()), ...)
    if expected is ... or _identity(out) == expected:
        _check_output(out, overwrite)
    # else another run published here meanwhile: this run's result is written, then kept aside (_swap_in)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_temp_dir(out.parent, f".{out.name}.tmp-")
        claim(tmp)  # an abandoned temp folder is recognised by this file and a dead owner, never by name
    except OSError as e:
        raise OutputError(f"Cannot write {out} ({e.strerror or e}); choose a writable --output_dir") from e
    try:
        write(tmp)
        _follow_umask(tmp)
        (tmp / MARKER).write_text(json.dumps({"written_by": "shift-lightning", "version": _version(),
                                              "kind": kind, "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
                                              "files": sorted(_entries(tmp)),
                                              "fingerprints": file_fingerprints(tmp, _entries(tmp))}) + "\n")
        _swap_in(tmp, out, expected)
        (out / OWNER).unlink(missing_ok=True)
        _AT_START[str(out.absolute())] = _identity(out)
    except PublishConflict:
        raise
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_write_failure(e):
            raise OutputError(f"Could not write {out}: {write_failure_reason(e)}. Nothing was changed there (an earlier result "
                              "stays as it was); free some space or choose another --output_dir") from e
        raise
    return out


def is_write_failure(e: BaseException) -> bool:
    """An OS error while writing (no space, quota, permissions, I/O), also as safetensors reports it."""
    if isinstance(e, OSError):
        return True
    return type(e).__name__ == "SafetensorError" and ("IoError" in str(e) or "I/O error" in str(e))


def write_failure_reason(e: BaseException) -> str:
    """What went wrong in a failed write, in a few words ("No space left on device")."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    m = re.search(r'message: "([^"]+)"', str(e))  # safetensors: IoError(Os { code: 28, ..., message: "..." })
    if m:
        return m.group(1)
    m = re.search(r"I/O error: (.+?)(?: \(os error \d+\))?$", str(e).strip())  # newer: "I/O error: File too large (os error 27)"
    return m.group(1) if m else " ".join(str(e).split())


def prepare_file(path: str | Path) -> Path:
    """Check, before any compute, that a result file can be written at ``path`` (its folder is
    created and writable, ``path`` is not a folder); returns it as a Path."""
    path = Path(path).expanduser()
    if path.is_dir():
        raise OutputError(f"{path} is a folder; name a file for the results")
    check_writable(path, "choose a writable location")
    return path


def write_file_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """``write(tmp)`` into a temporary sibling of ``path``, then rename it over ``path`` atomically:
    a reader (or a crash) never sees half a file."""
    path = Path(path).expanduser()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}{path.suffix}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        os.replace(tmp, path)
    except BaseException as e:
        tmp.unlink(missing_ok=True)
        if is_write_failure(e):
            raise OutputError(f"Could not write {path}: {write_failure_reason(e)} (an earlier version of it stays as it was)") from e
        raise
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    """Write ``text`` to ``path`` atomically (see :func:`write_file_atomic`)."""
    return write_file_atomic(path, lambda tmp: tmp.write_text(text))


def write_json_atomic(path: str | Path, doc, indent: int = 1) -> Path:
    """Write ``doc`` as JSON to ``path`` atomically (see :func:`write_file_atomic`)."""
    return write_text_atomic(path, json.dumps(doc, indent=indent, default=str) + "\n")
