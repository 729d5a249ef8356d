"""What a run read, by content: a saved calibration is reused only for the same bytes.

:func:`input_digest` hashes the local files behind a model and data options (a data file or folder,
a model folder's weights and config, a ``.gguf``). Names that are no local path (``wiki_summaries``,
``hf:...``, embedded models, the tiny random models) stand for themselves. A file that is not a
regular file (a named pipe) is not read here; the data loader refuses it.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

_SUFFIXES = (".txt", ".json", ".jsonl", ".safetensors", ".gguf", ".arrow", ".model")


def _files(p: Path) -> list[Path]:
    if p.is_file():
        return [p]
    if p.is_dir():
        return sorted(f for f in p.rglob("*") if f.is_file() and f.suffix in _SUFFIXES)
    return []


def path_digest(source: str | None) -> str | None:
    """sha256 over the relative names and bytes of the files behind ``source`` (None: not a local path)."""
    if not source:
        return None
    p = Path(str(source)).expanduser()
    if not p.exists():
        return None
    h = hashlib.sha256()
    for f in _files(p):
        h.update(f.relative_to(p).as_posix().encode() if f != p else b".")
        with open(f, "rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 22), b""):
                h.update(chunk)
    return h.hexdigest()[:16]


def input_digest(model_cfg, sets: dict[str, Any]) -> dict[str, str]:
    """Option -> content digest for the local inputs of a calibration (model folder or file, data sets)."""
    out = {}
    if getattr(model_cfg, "tiny", None) is None:
        src = Path(model_cfg.name_or_path).expanduser()
        if getattr(model_cfg, "gguf_file", None):
            src = src / model_cfg.gguf_file
        d = path_digest(str(src))
        if d:
            out["model"] = d
    for name, cfg in sets.items():
        d = path_digest(getattr(cfg, "source", None))
        if d:
            out[name] = d
    return out


def read_key(folder: Path, name: str = "calibration_key.json"):
    """The key a saved calibration was made with; None when it is missing or damaged (then it is not
    reused: redone with --overwrite, else refused as a calibration with other settings)."""
    import json

    try:
        return json.loads((Path(folder) / name).read_text())
    except (OSError, ValueError):
        return None


#: Files up to this size are fingerprinted by content in a published folder's marker (an edited model
#: card is noticed); larger ones (weights) by their size.
_HASHED_MAX = 1 << 20


def _fingerprint(p: Path) -> str | int | None:
    if p.is_symlink() or not p.is_file():
        return None
    size = p.stat().st_size
    return hashlib.sha256(p.read_bytes()).hexdigest()[:16] if size <= _HASHED_MAX else size


def file_fingerprints(folder: Path, entries) -> dict:
    """Entry -> fingerprint, for the marker of a published folder."""
    return {e: _fingerprint(folder / e) for e in sorted(entries)}


def edited_entries(out: Path, marker: str = ".shift_lightning.json") -> list[str]:
    """Files of a published folder changed since they were written (e.g. a model card the user edited)."""
    import json

    try:
        prints = json.loads((out / marker).read_text()).get("fingerprints")
    except (OSError, ValueError, AttributeError):
        return []
    if not isinstance(prints, dict):
        return []
    return sorted(e for e, f in prints.items() if f is not None and (out / e).exists() and _fingerprint(out / e) != f)
