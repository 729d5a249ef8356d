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


def weights_fingerprint(model) -> str:
    """Tells two models of the same shape apart without reading them whole: sha256 over every parameter's name and
    shape and the first 256 values of its first and last rows, rounded to bfloat16 (so loading the same weights in
    another float dtype gives the same fingerprint); 16 hex digits. An onloaded skeleton's rows are read from its
    files (:mod:`~shift_lightning.placement`), a few kB each."""
    import torch

    from ..placement import placement_of

    placement = placement_of(model)
    h = hashlib.sha256()
    seen = set()
    for name, p in model.named_parameters():
        if id(p) in seen:  # a tied head is the embedding once more
            continue
        seen.add(id(p))
        if p.is_meta:
            first, last = placement.rows(name, 0), placement.rows(name, p.shape[0] - 1) if p.dim() else None
        else:
            t = p.detach().reshape(p.shape[0], -1) if p.dim() else p.detach().reshape(1, 1)
            first, last = t[0], t[-1]
        h.update(f"{name}{tuple(p.shape)}".encode())
        for row in (first, last):
            if row is not None:
                h.update(row.reshape(-1)[:256].to(torch.bfloat16).view(torch.int16).cpu().numpy().tobytes())
    return h.hexdigest()[:16]
