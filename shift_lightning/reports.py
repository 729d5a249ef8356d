"""The run reports as typed artefacts: ``calibration_report.json`` and ``recovery_report.json``.

Each is a dataclass whose fields are the JSON keys (spelt once, here), with :meth:`to_dict` for the
file and :meth:`from_dict` validating a file read back (a missing or mistyped field is a
:class:`~shift_lightning.errors.ConfigError` naming the file). The record of a saved model folder,
``shift_config.json``, is :class:`~shift_lightning.checkpoint.ShiftSpec`.
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

from .errors import ConfigError
from .maps.keptfit_knobs import refit_damping


def _check(cls, doc: dict, source) -> dict:
    if not isinstance(doc, dict):
        raise ConfigError(f"{source} must hold a JSON object")
    names = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    missing = sorted(required - set(doc))
    if missing:
        raise ConfigError(f"{source} lacks {missing}: not a {cls.__name__} (written by another version?)")
    layers = doc["pruned_layers"]
    if not isinstance(layers, list) or not all(isinstance(i, int) for i in layers):
        raise ConfigError(f"{source}: pruned_layers must be a list of block indices, got {layers!r}")
    return {k: v for k, v in doc.items() if k in names}


@dataclass
class CalibrationReport:
    """What ``calibrate.py`` (and the calibration stage of ``train.py``) did and measured."""

    model: Any
    """The model's name, or ``{"tiny": {...}}``."""
    model_type: str
    original_num_layers: int
    pruned_layers: list[int]
    """Original indices of the removed blocks."""
    selection: dict
    """The criterion's choice with every block's score (:meth:`~shift_lightning.criteria.Selection.to_dict`)."""
    calibration: dict
    """The :class:`~shift_lightning.calibration.CalibrationConfig` used."""
    data: dict
    heldout_data: dict | None
    calibration_tokens: int
    heldout_tokens: int
    world_size: int
    sites: list[dict]
    """Per site: blocks, per-solver calibration / held-out relative errors, λ."""
    spans: list[dict]
    """Per span: what each solver put there, held-out span errors, the guard's judgement."""
    adapters: list[dict]
    """Per pruned position: the blocks its adapter replaces and its parameters."""
    branch_maps: list[int]
    notes: list[str]
    params_before: int
    params_after: int
    seconds: dict
    evaluation: dict | None = None
    """original / pruned / corrected: tasks, perplexity, closeness (when asked for)."""
    refit: dict | None = None
    """``--calibration.refit.kept``: the held-out KL with no re-fit and after each block's (``heldout_kl``), the
    blocks kept (``kept``) and, per kept block, each linear layer's relative weight change (``blocks``)."""
    heldout_closeness: dict | None = None
    """Onloaded runs: perplexity of the original / pruned / repaired model on the held-out windows, KL to the original
    and top-1 agreement (:class:`~shift_lightning.evaluation.heldout.HeldoutCloseness`, block-major)."""

    @property
    def criterion(self) -> str:
        return self.selection.get("criterion", "explicit")

    def to_dict(self) -> dict:
        out = asdict(self)
        out["lambda_relative"], out["rank"] = self.calibration.get("damping"), self.calibration.get("rank")
        for key in ("evaluation", "heldout_closeness"):
            if out[key] is None:
                del out[key]
        return out

    @classmethod
    def from_dict(cls, doc: dict, source: str | Path = "calibration_report.json") -> "CalibrationReport":
        return cls(**_check(cls, doc, source))

    @classmethod
    def read(cls, path: str | Path) -> "CalibrationReport":
        return cls.from_dict(json.loads(Path(path).read_text()), path)

    def markdown(self) -> str:
        """A readable summary."""
        from .card import evaluation_table

        c = self.calibration
        granularity = f"`{c['granularity']}`"
        if c["granularity"] == "block" and any(len(s["blocks"]) > 1 for s in self.sites):
            granularity += " (this solver fits one map per contiguous span)"
        lines = [f"# Calibration report: {self.model}", "",
                 f"- pruned blocks ({len(self.pruned_layers)}/{self.original_num_layers}): {self.pruned_layers} "
                 f"(criterion `{self.criterion}`)",
                 f"- solver `{c['solver']}`, mode `{c['mode']}`, granularity {granularity}, rank "
                 f"{c['rank'] or 'full'}, relative damping {c['damping']:g}",
                 f"- calibration tokens {self.calibration_tokens:,}, held-out tokens {self.heldout_tokens:,}, "
                 f"world size {self.world_size}",
                 f"- parameters {self.params_before:,} → {self.params_after:,}; {self.seconds['total']:.1f} s"]

        def missing(v) -> bool:
            return v is None or v != v

        def cell(v, fmt: str) -> str:
            return "–" if missing(v) else format(v, fmt)

        keys = ("calib_rel_error", "heldout_rel_error", "lam")
        if not all(missing(s.get(k)) for s in self.sites for k in keys):  # per-span solvers fit no site
            lines += ["", "| site | blocks | calib rel. error | held-out rel. error | λ |", "|---|---|---|---|---|"]
            for s in self.sites:
                lines.append(f"| {s['index']} | {s['blocks']} | {cell(s.get('calib_rel_error'), '.4f')} | "
                             f"{cell(s.get('heldout_rel_error'), '.4f')} | {cell(s.get('lam'), '.3g')} |")
        guards = [s for s in self.spans if "guard" in s]
        if guards:
            lines += ["", "| span | guard's choice | KL of each candidate (held-out calibration windows) |", "|---|---|---|"]
            for s in guards:
                g = s["guard"]
                lines.append(f"| {s['blocks']} | {g['chosen']} | "
                             + ", ".join(f"{k} {v:.4f}" for k, v in g["kl"].items()) + " |")
        if self.refit:
            r = self.refit
            lines += ["", f"Kept blocks re-fitted after the maps (relative damping {refit_damping(c):g}): held-out KL "
                      + ", ".join(f"{k if k == 'none' else 'block ' + k} {v:.4f}" for k, v in r["heldout_kl"].items())
                      + f"; kept {r['kept'] or 'none'}"]
            if r["blocks"]:
                names = list(r["blocks"][0]["relative_change"])
                lines += ["", "| block | " + " | ".join(f"Δ‖W‖ {n.split('.')[-1]}" for n in names) + " |",
                          "|---|" + "---:|" * len(names)]
                for b in r["blocks"]:
                    lines.append(f"| {b['block']} | " + " | ".join(f"{v:.4f}" for v in b["relative_change"].values()) + " |")
        if self.evaluation:
            lines += ["", "## Evaluation", "", *evaluation_table(self.evaluation)]
        if self.heldout_closeness:
            h = self.heldout_closeness
            lines += ["", f"## Held-out closeness ({h['windows']} windows, {h['tokens']:,} predicted tokens)", "",
                      "| model | perplexity | KL to the original | top-1 agreement |", "|---|---:|---:|---:|"]
            for name in ("original", "pruned", "repaired"):
                r = h[name]
                lines.append(f"| {name} | {r['ppl']:.3f} | {cell(r.get('kl'), '.4f')} | {cell(r.get('top1'), '.3f')} |")
        return "\n".join(lines) + "\n"


@dataclass
class RecoveryReport:
    """What ``train.py``'s recovery did and measured."""

    model: Any
    pruned_layers: list[int]
    recovery: dict
    """The :class:`~shift_lightning.recovery.RecoveryConfig` used."""
    trainable_params: int
    train_windows: int
    train_tokens_per_window: int
    steps: int
    recovered: bool
    metrics_before: dict
    """val/ppl, val/kl, val/top1, zeroshot/* at step 0."""
    metrics_after: dict
    loss_history: list[float]
    world_size: int
    seconds: dict
    train_tokens_per_s: float | None = None
    peak_gpu_memory_bytes: int | None = None
    extra: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        out = asdict(self)
        extra = out.pop("extra")
        return {**extra, **out}

    @classmethod
    def from_dict(cls, doc: dict, source: str | Path = "recovery_report.json") -> "RecoveryReport":
        known = _check(cls, doc, source)
        return cls(**known, extra={k: v for k, v in doc.items() if k not in known})

    @classmethod
    def read(cls, path: str | Path) -> "RecoveryReport":
        return cls.from_dict(json.loads(Path(path).read_text()), path)


def read_scalars(logdir) -> dict[str, list[tuple[int, float]]]:
    """The scalars of a run's TensorBoard event files under ``logdir``: ``{tag: [(step, value), …]}``, sorted by step
    (what a recovery's curves are drawn and checked from)."""
    from pathlib import Path

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, list] = {}
    for f in sorted(Path(logdir).rglob("events.out.tfevents*")):
        ea = EventAccumulator(str(f))
        ea.Reload()
        for tag in ea.Tags()["scalars"]:
            out.setdefault(tag, []).extend((e.step, e.value) for e in ea.Scalars(tag))
    return {k: sorted(v) for k, v in out.items()}

