"""shift-lightning: depth-pruned LLMs corrected by closed-form Linear Residual Adapters (SHIFT-LLM)."""

from .checkpoint import load_pretrained

__all__ = ["load_pretrained"]
__version__ = "0.1.0"
