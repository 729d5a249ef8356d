"""``shift_config.json``: the record of what a saved folder's model is (what was pruned, how it was repaired).

Validated on read (:meth:`ShiftSpec.from_dict`), written by :mod:`shift_lightning.checkpoint`.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Literal

from .surgery import SurgeryError

SHIFT_CONFIG = "shift_config.json"
LRA_WEIGHTS = "lra.safetensors"
FORMAT_VERSION = 1
#: Keys a folder written before may use -> their name now (read on load; a folder is never rewritten).
RENAMED_KEYS = {"correction": "solver"}


# --------------------------------------------------------------------------------------------
# The record
# --------------------------------------------------------------------------------------------
@dataclass
class ShiftSpec:
    """``shift_config.json``: what was pruned and how it was repaired (validated in :meth:`from_dict`)."""

    original_num_layers: int
    """Depth of the unpruned model."""
    pruned_layers: list[int]
    """Original indices of the removed blocks."""
    base_model: Any = None
    """The unpruned model: its name (full folders) or its ``ModelConfig`` fields (adapter-only folders)."""
    criterion: str | None = None
    """How the blocks were chosen."""
    solver: str | None = None
    """The calibration solver that fitted the maps (``lra``, ``stock``, …) or ``none``; saved before as
    ``correction`` (:data:`RENAMED_KEYS`: such folders load as they are)."""
    adapters: list[dict] = field(default_factory=list)
    """``{"position": p, "chain": [AdapterSpec dicts]}``: the adapter entering pruned block ``p``."""
    branch_maps: list[dict] = field(default_factory=list)
    """``{"block": i, "after": "post_feedforward_layernorm" | "down_proj"}``: ReplaceMe maps by pruned block."""
    weights: Literal["full", "adapters"] = "full"
    """``adapters``: the folder holds no model weights (the base model is rebuilt)."""
    folds: list[dict] = field(default_factory=list)
    """Adapter-only folders: the stock repair's updates folded into the base's weights again on load,
    ``{"into": "down_proj", "block": i}`` (pruned block index) or ``{"into": "embedding"}``; their tensors are
    ``fold.down.<i>.weight`` / ``.bias`` and ``fold.embedding.weight`` / ``.bias`` (float64, as fitted)."""
    refit_blocks: list[int] | None = None
    """Pruned positions of kept blocks whose linear layers were re-fitted (``--calibration.refit.kept``); an
    adapter-only folder stores their weights in ``lra.safetensors`` as ``kept.<position>.<layer>.weight``."""
    recovered: bool | None = None
    recovery_steps: int | None = None
    base_fingerprint: str | None = None
    """Adapter-only folders: :func:`~shift_lightning.outputs.fingerprints.weights_fingerprint` of the base the maps were fitted
    on; loading them onto a base with other weights is refused."""
    format_version: int = FORMAT_VERSION
    extra: dict = field(default_factory=dict)
    """Anything else the writer recorded."""

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "extra"}
        if out["weights"] == "full":
            del out["weights"]
        if not out["folds"]:
            del out["folds"]
        return {**self.extra, **{k: v for k, v in out.items() if v is not None}}

    @classmethod
    def from_dict(cls, doc: dict, source: str | Path = SHIFT_CONFIG) -> "ShiftSpec":
        """Validated record; :class:`~shift_lightning.maps.surgery.SurgeryError` names ``source`` otherwise."""
        if not isinstance(doc, dict):
            raise SurgeryError(f"{source} must hold a JSON object")
        doc = {RENAMED_KEYS.get(k, k) if RENAMED_KEYS.get(k) not in doc else k: v for k, v in doc.items()}
        if doc.get("format_version", FORMAT_VERSION) != FORMAT_VERSION:
            raise SurgeryError(f"{source}: unsupported format_version {doc.get('format_version')!r} "
                               f"(expected {FORMAT_VERSION})")
        n, pruned = doc.get("original_num_layers"), doc.get("pruned_layers")
        if not isinstance(n, int) or n < 1 or not isinstance(pruned, list)\
                or not all(isinstance(i, int) and 0 <= i < n for i in pruned) or len(set(pruned)) != len(pruned):
            raise SurgeryError(f"{source}: original_num_layers / pruned_layers are missing or inconsistent "
                               f"({n!r}, {pruned!r})")
        adapters = doc.get("adapters", [])
        if not isinstance(adapters, list) or not all(isinstance(a, dict) and isinstance(a.get("position"), int)
                                                     and isinstance(a.get("chain"), list) and a["chain"]
                                                     for a in adapters):
            raise SurgeryError(f"{source}: 'adapters' must be a list of {{position, chain}} entries")
        positions = [a["position"] for a in adapters]
        if len(set(positions)) != len(positions):
            raise SurgeryError(f"{source}: duplicate adapter positions {sorted(positions)}")
        branches = doc.get("branch_maps", [])
        if not isinstance(branches, list) or not all(isinstance(b, dict) and isinstance(b.get("block"), int)
                                                     for b in branches):
            raise SurgeryError(f"{source}: 'branch_maps' must be a list of {{block, after}} entries")
        weights = doc.get("weights", "full")
        if weights not in ("full", "adapters"):
            raise SurgeryError(f"{source}: 'weights' must be 'full' or 'adapters', got {weights!r}")
        if weights == "adapters" and not isinstance(doc.get("base_model"), dict):
            raise SurgeryError(f"{source}: an adapter-only folder must name its base_model")
        folds = doc.get("folds", [])
        if not isinstance(folds, list) or not all(
                isinstance(f, dict) and (f.get("into") == "embedding" or (f.get("into") == "down_proj" and isinstance(
                    f.get("block"), int) and not isinstance(f.get("block"), bool))) for f in folds):
            raise SurgeryError(f"{source}: 'folds' must be a list of {{into: down_proj, block}} / {{into: embedding}} "
                               "entries")
        refit = doc.get("refit_blocks")
        if refit is not None and (not isinstance(refit, list) or len(set(refit)) != len(refit) or not all(
                isinstance(i, int) and not isinstance(i, bool) and 0 <= i < n - len(pruned) for i in refit)):
            raise SurgeryError(f"{source}: 'refit_blocks' must list distinct positions of the pruned model's "
                               f"{n - len(pruned)} blocks, got {refit!r}")
        fp = doc.get("base_fingerprint")
        if fp is not None and not (isinstance(fp, str) and fp):
            raise SurgeryError(f"{source}: 'base_fingerprint' must be a string, got {fp!r}")
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: doc[k] for k in known if k in doc},
                   extra={k: v for k, v in doc.items() if k not in known})

    @property
    def num_layers(self) -> int:
        """Depth of the pruned model."""
        return self.original_num_layers - len(self.pruned_layers)


