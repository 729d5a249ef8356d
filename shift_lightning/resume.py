"""Training checkpoints belong to their run.

A training job keeps its checkpoints in ``<output_dir>.ckpt/`` (``last.ckpt``, overwritten in place,
never ``last-v1.ckpt`` beside it). Every checkpoint records the settings of the run that wrote it
(:func:`run_settings`: model, data, pruning, calibration, recovery and the trainer settings that
shape the trajectory) and its loss history. So:

* ``--ckpt_path last`` means ``<output_dir>.ckpt/last.ckpt`` and nothing else; without one the job
  starts from step 0 (with a warning);
* a checkpoint is resumed only by a run with the same settings (:func:`check_run`; the differences
  are named otherwise), and only if it holds plain tensors: it is read with
  ``torch.load(weights_only=True)`` and a pickle, a truncated or a foreign file is one error line
  (:func:`read_checkpoint`), before any compute;
* a fresh run refuses a checkpoint folder that holds an earlier run's checkpoints unless
  ``--overwrite`` is given, which deletes them: only what this tool wrote there, by name and digest
  (:data:`WRITTEN`), never another file, not even a copy of a checkpoint under another name
  (:func:`check_checkpoint_dir`, :func:`clear_checkpoints`);
* checkpoints are written atomically (:class:`AtomicCheckpointIO`: a temporary sibling renamed
  over the old file), so a kill or a full disk while saving leaves the previous one intact.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import pickle
import warnings
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import torch
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO

from .errors import ConfigError
from .finite import check_checkpoint
from .outputs.ownership import abandoned_file, is_our_checkpoint, work_file_name
from .outputs import OutputError, OutputExistsError, is_write_failure, write_failure_reason

log = logging.getLogger(__name__)

#: Trainer settings that change what a run computes (world_size: the global batch and the data order;
#: the rest, e.g. logging or the accelerator, does not).
TRAINER_KEYS = ("max_steps", "accumulate_grad_batches", "gradient_clip_val", "gradient_clip_algorithm", "precision",
                "world_size")


def run_settings(sections: dict[str, Any], trainer=None) -> dict[str, Any]:
    """``"section.option" -> value`` for the dataclasses in ``sections`` and ``trainer``'s :data:`TRAINER_KEYS`."""
    flat: dict[str, Any] = {}
    for name, cfg in sections.items():
        doc = asdict(cfg) if is_dataclass(cfg) else cfg
        if isinstance(doc, dict):
            for k, v in doc.items():
                flat[f"{name}.{k}"] = v
        else:
            flat[name] = doc
    if trainer is not None:
        for k in TRAINER_KEYS:
            flat[f"trainer.{k}"] = getattr(trainer, k, None)
    return json.loads(json.dumps(flat, default=str))


def run_key(settings: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16]


def read_checkpoint(path: str | Path) -> dict:
    """A training checkpoint as plain tensors and numbers (nothing is unpickled); one error naming
    the file when it is missing, truncated, a pickle of Python objects or not one of ours."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise ConfigError(f"--ckpt_path {path}: no such checkpoint file")
    try:
        with warnings.catch_warnings():  # torch warns about the pickle protocol before refusing it
            warnings.simplefilter("ignore")
            ck = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        why = str(e).strip().splitlines()[-1] if str(e).strip() else type(e).__name__
        raise ConfigError(f"{path} cannot be loaded as plain tensors ({why[:160]}): it is damaged or holds Python "
                          "objects that would have to be unpickled, which shift-lightning never does; remove it or "
                          "start afresh with --overwrite") from None
    except Exception as e:  # a cut zip archive, an empty file, not a torch file at all
        raise ConfigError(f"Cannot read the checkpoint {path} ({' '.join(str(e).split())[:160]}): it is truncated or "
                          "damaged; remove it or start afresh with --overwrite") from None
    if not isinstance(ck, dict) or not isinstance(ck.get("shift_lightning"), dict):
        raise ConfigError(f"{path} is not a checkpoint of shift-lightning's training (no run record); "
                          "resume only from <output_dir>.ckpt/last.ckpt of the same job")
    check_checkpoint(ck, path)
    return ck


def check_run(checkpoint: dict, path: str | Path, settings: dict[str, Any]) -> None:
    """Refuse to resume a checkpoint written by a run with other settings, naming what differs."""
    run = checkpoint["shift_lightning"].get("run")
    if not isinstance(run, dict) or not isinstance(run.get("settings"), dict):
        raise ConfigError(f"{path} does not say which run wrote it (written by an older version); start afresh "
                          "with --overwrite")
    if run.get("key") == run_key(settings):
        return
    old = run["settings"]
    diff = [k for k in sorted(set(old) | set(settings)) if old.get(k) != settings.get(k)]
    shown = "; ".join(f"{k}: {old.get(k)!r} there, {settings.get(k)!r} now" for k in diff[:4])
    raise ConfigError(f"{path} belongs to a run with other settings ({shown}{'; ...' if len(diff) > 4 else ''}): "
                      "resuming would mix two runs. Resume with that run's settings, or start afresh with --overwrite")


def check_state(saved: dict, own: dict, keep: set[str]) -> None:
    """A checkpoint holds the tensors this run trains (``keep``), with this run's shapes (a tampered or
    foreign one is named, not a traceback)."""
    if set(saved) != keep:
        raise ConfigError(f"The checkpoint trains {len(saved)} tensors, this run {len(keep)} "
                          f"(e.g. {sorted(set(saved) ^ keep)[:3]}): resume with the same --recovery.* settings")
    bad = [k for k in sorted(saved) if k in own and tuple(saved[k].shape) != tuple(own[k].shape)]
    if bad:
        k = bad[0]
        raise ConfigError(f"The checkpoint's {k} has shape {tuple(saved[k].shape)}, this run's {tuple(own[k].shape)}"
                          f"{f' ({len(bad)} tensors differ)' if len(bad) > 1 else ''}: the checkpoint is damaged or of "
                          "another model; start afresh with --overwrite")


def resolve_resume(ckpt_path: str | None, ckpt_dir: Path | None) -> Path | None:
    """The checkpoint to resume: ``last`` is ``<ckpt_dir>/last.ckpt`` (``None`` with a warning when
    there is none yet: the run starts at step 0), else the file given."""
    if ckpt_path is None:
        return None
    if ckpt_path == "last":
        if ckpt_dir is None:
            raise ConfigError("--ckpt_path last needs --output_dir (the checkpoints are in <output_dir>.ckpt/)")
        last = ckpt_dir / "last.ckpt"
        if not last.exists():
            from . import dist

            if dist.launch_rank() == 0:
                log.warning("--ckpt_path last: no checkpoint in %s yet; starting from step 0", ckpt_dir)
            return None
        return last
    if ckpt_path in ("best", "hpc", "registry"):
        raise ConfigError(f"--ckpt_path {ckpt_path} is not supported; use 'last' or a checkpoint file")
    return Path(ckpt_path).expanduser()


#: In a checkpoint folder: the name and digest of every checkpoint this tool wrote there (:class:`AtomicCheckpointIO`).
WRITTEN = ".shift_lightning.checkpoints.json"


def _digest(p: Path) -> str:
    h = hashlib.sha256()
    with open(p, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
    return h.hexdigest()


def _written(ckpt_dir: Path) -> dict[str, str] | None:
    """The folder's record of what this tool wrote (None: none, a folder written before the record existed)."""
    try:
        doc = json.loads((ckpt_dir / WRITTEN).read_text())
    except (OSError, ValueError):
        return None
    return {k: v for k, v in doc.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(doc, dict) else None


def _record_written(path: Path, digest: str | None) -> None:
    """Add (``digest``) or drop (None) ``path``'s entry in its folder's record, atomically."""
    folder = path.parent
    doc = _written(folder) or {}
    if digest is None:
        doc.pop(path.name, None)
    else:
        doc[path.name] = digest
    tmp = work_file_name(folder / WRITTEN)
    tmp.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, folder / WRITTEN)


def _ours(p: Path, written: dict[str, str] | None) -> bool:
    """What ``--overwrite`` may delete (:mod:`~shift_lightning.outputs.ownership`): a checkpoint this tool wrote under this
    name with these bytes (its folder's record, ``written``), the record itself, or an abandoned save. A copy of a
    checkpoint under another name is the user's, whatever it holds. A folder with no record (written by an older
    version) falls back on the run record inside the file."""
    if p.name == WRITTEN:
        return True
    if p.suffix != ".ckpt":
        return abandoned_file(p)
    if written is None:
        return is_our_checkpoint(p)
    return p.name in written and not p.is_symlink() and p.is_file() and _digest(p) == written[p.name]


def check_checkpoint_dir(ckpt_dir: Path | None, resuming: bool, overwrite: bool) -> None:
    """Before any compute: a fresh run needs ``--overwrite`` to replace an earlier run's checkpoints,
    and never deletes a file that is not a checkpoint."""
    if ckpt_dir is not None and (ckpt_dir.exists() or ckpt_dir.is_symlink()) and not ckpt_dir.is_dir():
        raise OutputExistsError(f"{ckpt_dir} is a file, but the run keeps its checkpoints in a folder of that name: "
                                "move the file away, or choose another --output_dir")
    if ckpt_dir is None or resuming or not ckpt_dir.is_dir():
        return
    entries, written = sorted(ckpt_dir.iterdir()), _written(ckpt_dir)
    ckpts = [p.name for p in entries if _ours(p, written) and p.name != WRITTEN]
    if (ckpt_dir / "last.ckpt").exists() and "last.ckpt" not in ckpts:
        raise OutputExistsError(f"{ckpt_dir / 'last.ckpt'} is not a checkpoint of a run (no run record), and this run "
                                "would write its own there: move it out first, or choose another --output_dir")
    if not ckpts:
        return
    if not overwrite:
        raise OutputExistsError(f"{ckpt_dir} holds the checkpoints of an earlier run ({', '.join(ckpts[:3])}); resume "
                                "it with --ckpt_path last, or pass --overwrite to start afresh (they are deleted)")
    foreign = [p.name for p in entries if not _ours(p, written)]
    if foreign:
        raise OutputExistsError(f"{ckpt_dir} holds files that are not checkpoints of a run ({', '.join(foreign[:5])}); "
                                "--overwrite would delete the checkpoints next to them: move them out first")


def clear_checkpoints(ckpt_dir: Path | None) -> list[str]:
    """Delete the checkpoints (and leftovers of interrupted saves) in ``ckpt_dir``; nothing else."""
    if ckpt_dir is None or not ckpt_dir.is_dir():
        return []
    gone, written = [], _written(ckpt_dir)
    for p in sorted(ckpt_dir.iterdir(), key=lambda p: p.name == WRITTEN):  # the record last
        if _ours(p, written):
            p.unlink()
            gone.append(p.name)
    if gone:
        log.info("Deleted the earlier run's checkpoints in %s (--overwrite): %s", ckpt_dir, ", ".join(gone))
    return gone


class AtomicCheckpointIO(TorchCheckpointIO):
    """Lightning's checkpoint writer, but into a temporary sibling renamed over the target: a kill or
    a full disk while saving leaves the previous checkpoint intact (one error line for the latter)."""

    def save_checkpoint(self, checkpoint: dict, path, storage_options=None) -> None:
        path = Path(path)
        tmp = work_file_name(path)
        try:
            super().save_checkpoint(checkpoint, tmp, storage_options)
            digest = _digest(tmp)
            os.replace(tmp, path)
            _record_written(path, digest)  # what --overwrite may delete later: this name with these bytes
        except BaseException as e:
            tmp.unlink(missing_ok=True)
            if is_write_failure(e):
                raise OutputError(f"Could not save the checkpoint {path}: {write_failure_reason(e)}; the previous "
                                  "checkpoint stays as it was. Free some space, then resume with --ckpt_path last") from e
            raise

    def remove_checkpoint(self, path) -> None:
        super().remove_checkpoint(path)
        _record_written(Path(path), None)
