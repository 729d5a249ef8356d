"""What the tool may delete: the one place that decides. Framework-free leaf.

shift-lightning deletes only what it can prove is its own and abandoned:

* a hidden work folder (``.<out>.tmp-*`` of a publish, ``.<out>.old-*`` of an interrupted swap) is
  deleted only when it holds an :data:`OWNER` file written by the process that made it, and that
  process is dead (same host, its pid gone or reused). A folder of the same name without the file
  (a user's ``.out.tmp-mybackup``), or one whose owner still runs (a second run into the same
  output), or one made on another host, is left alone;
* a single work file (``.<name>.tmp-<host>-<pid>``, e.g. a checkpoint being saved) carries its owner
  in its name and is deleted only when that owner is dead;
* a training checkpoint is deleted by ``--overwrite`` only when it holds shift-lightning's run
  record (:func:`is_our_checkpoint`); a ``*.ckpt`` a person put there is not.
"""

from __future__ import annotations

import json
import os
import re
import socket
from pathlib import Path

#: Written inside every work folder at its creation: who owns it.
OWNER = ".shift_lightning.owner"


def _start_time(pid: int) -> str | None:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_doc() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "started": _start_time(os.getpid())}


def claim(folder: Path) -> None:
    """Mark ``folder`` (a work folder just created) as this process's."""
    (Path(folder) / OWNER).write_text(json.dumps(owner_doc()) + "\n")


def alive(pid: int, started: str | None = None) -> bool:
    """Whether process ``pid`` (started at ``started``, when known) still runs on this host."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    now = _start_time(pid)
    return started is None or now is None or now == started


def _dead(doc) -> bool:
    if not isinstance(doc, dict) or doc.get("host") != socket.gethostname() or not isinstance(doc.get("pid"), int):
        return False  # another host, or unreadable: we cannot know, so it is not ours to delete
    return not alive(doc["pid"], doc.get("started"))


def abandoned_folder(folder: Path) -> bool:
    """A work folder whose owner file says its (local) owner is dead."""
    folder = Path(folder)
    if folder.is_symlink() or not folder.is_dir():
        return False
    try:
        return _dead(json.loads((folder / OWNER).read_text()))
    except (OSError, ValueError):
        return False


def work_file_name(path: Path, tag: str = "tmp") -> Path:
    """``.<name>.<tag>-<host>-<pid>``: a work file's name that says who writes it."""
    path = Path(path)
    return path.with_name(f".{path.name}.{tag}-{socket.gethostname()}-{os.getpid()}")


def abandoned_file(path: Path, tag: str = "tmp") -> bool:
    """A work file (see :func:`work_file_name`) whose owner is dead."""
    path = Path(path)
    m = re.fullmatch(rf"\..+\.{tag}-(.+)-(\d+)", path.name)
    if not m or path.is_symlink() or not path.is_file():
        return False
    return _dead({"host": m.group(1), "pid": int(m.group(2))})


def is_our_checkpoint(path: Path) -> bool:
    """A ``.ckpt`` file that holds shift-lightning's run record (read as plain tensors, memory-mapped)."""
    import warnings

    import torch

    path = Path(path)
    if path.is_symlink() or not path.is_file():
        return False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ck = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:
        return False
    return isinstance(ck, dict) and isinstance(ck.get("shift_lightning"), dict)
