"""shift-lightning: depth-pruned LLMs corrected by closed-form Linear Residual Adapters (SHIFT-LLM)."""

__all__ = ["load_pretrained"]
__version__ = "0.1.0"


def __getattr__(name: str):  # imported on first use: ``import shift_lightning`` does not import torch
    if name == "load_pretrained":
        from .checkpoint import load_pretrained

        return load_pretrained
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
