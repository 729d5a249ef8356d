"""Makes ``retired_solver_maps.safetensors``: the maps the seven retired solver names fitted on a tiny float64 Llama,
before they became knob combinations (run once, at commit b9624b4, where the names still existed:
``python experiments/tests/data/retired_solver_maps.py``). ``experiments/tests/test_variants.py``
fits the same maps under the new spelling and compares them exactly."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from shift_lightning.calibration import CalibrationConfig, CalibrationModule  # noqa: E402
from shift_lightning.maps.fitted import as_affine  # noqa: E402
from shift_lightning.data import TextDataConfig, build_windows  # noqa: E402
from shift_lightning.models import build_tiny_model  # noqa: E402

REMOVED = [1, 2, 5]
#: (setting, mode, the solvers fitted together in one module): one module per retired name, and the grid's way,
#: several variants from one pass.
SETTINGS = [
    ("lra_span", "independent", ["lra_span"]),
    ("lra_anchored", "anchored", ["lra_anchored"]),
    ("lra_auto", "auto", ["lra_auto"]),
    ("lra_replaceme_anchored", "anchored", ["lra_replaceme_anchored"]),
    ("lra_replaceme_auto", "auto", ["lra_replaceme_auto"]),
    ("guarded_span", "independent", ["guarded_span"]),
    ("guarded_joint", "independent", ["guarded_joint"]),
    ("grid", "independent", ["lra", "lra_span", "guarded", "guarded_span", "guarded_joint", "lra_replaceme"]),
]


def model_and_windows():
    model, tok = build_tiny_model("llama", num_hidden_layers=8, dtype=torch.float64)
    windows = build_windows(TextDataConfig(source=str(ROOT / "tests" / "data" / "tiny_corpus.txt"), num_samples=16,
                                           seq_len=48), tok)
    return model, windows


def trainer():
    import lightning as L

    return L.Trainer(accelerator="cpu", devices=1, inference_mode=False, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def maps_of(module: CalibrationModule, name: str) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Per span of ``name``'s correction: its adapter as ``(M, c)`` and its branch map ``T``; and each span's source."""
    tensors, sources = {}, []
    for i, m in enumerate(module.fitted_maps(name).spans):
        if m.adapter is not None:
            M, c = as_affine(m.adapter)
            tensors[f"{i}.M"], tensors[f"{i}.c"] = M.contiguous(), c.contiguous()
        if m.branch is not None:
            tensors[f"{i}.T"] = m.branch.to(torch.float64).contiguous()
        sources.append(m.source)
    return tensors, sources


def main() -> None:
    from safetensors.torch import save_file

    out, meta = {}, {}
    for setting, mode, names in SETTINGS:
        model, windows = model_and_windows()
        mod = CalibrationModule(model, REMOVED, CalibrationConfig(solver=names[0], mode=mode), solvers=names)
        mod.calibrate(trainer(), windows, batch_size=4)
        for name in names:
            tensors, sources = maps_of(mod, name)
            out.update({f"{setting}/{name}/{k}": v for k, v in tensors.items()})
            meta[f"{setting}/{name}"] = sources
    save_file(out, str(Path(__file__).with_suffix(".safetensors")), metadata={"sources": json.dumps(meta)})


if __name__ == "__main__":
    main()
