"""Shared helpers of the performance benchmarks (``calibration.py``, ``inference.py``, ``solve.py``).

Importing this module puts the repository root first on ``sys.path``, so ``python benchmarks/X.py``
measures the checkout it lives in (not another installed copy of ``shift_lightning``).

Models: ``smollm2-135m`` (or any name :func:`shift_lightning.load_pretrained` takes) with
real wiki-summaries windows, or a random model of a named shape (``random:llama3-8b``,
``random:tiny``) with uniformly random tokens, built directly on the target device.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from shift_lightning.recipes.cli import quiet_third_party  # noqa: E402

quiet_third_party()  # no Lightning tips in benchmark tables

#: Shapes of random models (Llama family): the real configs' sizes, random weights.
SHAPES: dict[str, dict] = {
    # Llama-3.1-8B: 32 blocks, d = 4096, FFN 14336, 32 query / 8 KV heads, vocab 128256, untied
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, head_dim=128, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # the same layout, small enough for a CPU smoke run in seconds
    "tiny": dict(hidden_size=64, intermediate_size=160, num_hidden_layers=8, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, vocab_size=512, max_position_embeddings=1024,
                 rope_theta=10000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
}


def pick_device(name: str) -> torch.device:
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(name)


def build_model(name: str, device: torch.device, dtype: torch.dtype = torch.float32, seed: int = 0):
    """``(model, tokenizer or None)`` in eval mode on ``device``."""
    if name.startswith("random:"):
        from transformers import AutoModelForCausalLM, LlamaConfig

        shape = name.split(":", 1)[1]
        if shape not in SHAPES:
            raise SystemExit(f"unknown random shape {shape!r}; choose one of {sorted(SHAPES)}")
        cfg = LlamaConfig(**SHAPES[shape])
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        return model.eval(), None
    from shift_lightning.checkpoint import load_pretrained

    model, tok = load_pretrained(name)
    return model.to(device=device, dtype=dtype).eval(), tok


def windows(model, tok, num: int, seq_len: int, split: str = "calibration", seed: int = 0):
    """``TokenWindows``: wiki-summaries windows for a real tokenizer, random tokens otherwise."""
    from shift_lightning.data import TextDataConfig, TokenWindows, build_windows

    if tok is not None:
        return build_windows(TextDataConfig(split=split, num_samples=num, seq_len=seq_len, seed=seed), tok,
                             model.config.model_type)
    g = torch.Generator().manual_seed(seed + (split != "calibration"))
    ids = torch.randint(0, model.config.vocab_size, (num, seq_len), generator=g)
    return TokenWindows(ids, torch.ones_like(ids))


def heldout_split(model, tok, num: int = 64, seq_len: int = 512):
    """The grids' held-out checks: ``num`` mixed calibration windows (random tokens for a random model), every
    4th held out. Returns ``(fit, judge, refs)``, ``refs`` the original's references on the held-out windows."""
    from shift_lightning.data import TextDataConfig, TokenWindows, build_windows
    from shift_lightning.closeness import window_references

    if tok is not None:
        win = build_windows(TextDataConfig(source="mixed", num_samples=num, seq_len=seq_len), tok, model.config.model_type)
    else:
        win = windows(model, None, num, seq_len)
    held = torch.arange(len(win)) % 4 == 3
    fit = TokenWindows(win.input_ids[~held], win.attention_mask[~held])
    judge = TokenWindows(win.input_ids[held], win.attention_mask[held])
    return fit, judge, window_references(model, judge.input_ids, judge.attention_mask)


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def timed(fn: Callable, device) -> float:
    """Wall seconds of ``fn()`` (CUDA synchronised before and after)."""
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    return time.perf_counter() - t0


def round_robin(variants: dict[str, Callable], device, repeats: int, warmup: bool = True) -> dict[str, dict]:
    """Time every variant ``repeats`` times, interleaved (A B C A B C …) so that a change of machine
    load hits all variants alike; ``{name: {"median": s, "min": s, "runs": [...]}}``."""
    if warmup:
        for fn in variants.values():
            fn()
    runs: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for k, fn in variants.items():
            runs[k].append(timed(fn, device))
    return {k: {"median": statistics.median(v), "min": min(v), "runs": v} for k, v in runs.items()}


def machine(device: torch.device) -> dict:
    """What a number was measured on."""
    info = {"python": platform.python_version(), "torch": torch.__version__, "device": str(device),
            "torch_threads": torch.get_num_threads(), "cpu_count": os.cpu_count(),
            "loadavg_1_5_15min": os.getloadavg() if hasattr(os, "getloadavg") else None}
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def write_json(path: str | Path, doc: dict) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2))
    return path


def md_table(headers: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.4g}" if abs(v) < 1e5 else f"{v:.3e}"
        return str(v)

    out = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    out += ["| " + " | ".join(fmt(v) for v in r) + " |" for r in rows]
    return "\n".join(out)


def dtype_of(name: str) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
            "float64": torch.float64}[name]
