"""Architecture access: where the decoder blocks and the final norm are, and how a block is called.

A leaf module (imports nothing from the project but :mod:`errors`). Every other module reaches the
blocks through :func:`decoder_layers` and handles a block's call through the helpers below, so the
conventions of HF decoder layers live in one place:

* a block is called as ``block(hidden_states, *args, **kwargs)`` with the hidden state either the
  first positional argument or the ``hidden_states`` keyword (:func:`block_input`);
* it returns the new hidden state either as a tensor or as the first item of a tuple/list
  (:func:`block_output`, :func:`with_block_output`);
* a removed block can be stood in for by :class:`Bypass` (identity or an adapter), and a block can
  be made an identity for the length of a ``with`` (:func:`skip_block`).
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator

import torch
from torch import nn

from .errors import ShiftError

#: Families whose block structure (``model.model.layers`` + ``model.model.norm``) we support and test.
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text")


class StopForward(Exception):
    """Raised to end a forward early, once a pass has what it needs from it (a hook, a stand-in block)."""


class ModelLoadError(ShiftError, ValueError):
    """A model could not be located, loaded or is of an unsupported architecture."""


def base_model(model: nn.Module) -> nn.Module:
    """The wrapped HF model of a PEFT model (the model itself otherwise)."""
    getter = getattr(model, "get_base_model", None)
    return getter() if callable(getter) else model


def max_positions(model: nn.Module) -> int | None:
    """The model's maximum positions (``config.max_position_embeddings``), or None if it has none."""
    n = getattr(getattr(base_model(model), "config", None), "max_position_embeddings", None)
    return n if isinstance(n, int) and n > 0 else None


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """Return the ``nn.ModuleList`` of decoder blocks of a causal LM (``model.model.layers``).

    Raises :class:`ModelLoadError` naming the supported families for anything else.
    """
    inner = getattr(model, "model", None)
    layers = getattr(inner, "layers", None)
    if not isinstance(layers, nn.ModuleList) or not hasattr(inner, "norm"):
        mt = getattr(getattr(model, "config", None), "model_type", type(model).__name__)
        raise ModelLoadError(
            f"Unsupported model architecture {mt!r}: expected a causal LM with decoder blocks at "
            f"`model.model.layers` and a final norm at `model.model.norm`. Supported families: "
            f"{', '.join(SUPPORTED_FAMILIES)} (and others with the same layout)."
        )
    return layers


def final_norm(model: nn.Module) -> nn.Module:
    """The norm applied after the last block (``model.model.norm``)."""
    decoder_layers(model)
    return model.model.norm


# --------------------------------------------------------------------------------------------
# Block-call conventions
# --------------------------------------------------------------------------------------------
def block_input(args: tuple, kwargs: dict) -> torch.Tensor:
    """The hidden state ``(B, T, d)`` a block (or the final norm) is called with."""
    return args[0] if args else kwargs["hidden_states"]


def with_block_input(args: tuple, kwargs: dict, h: torch.Tensor) -> tuple[tuple, dict]:
    """``(args, kwargs)`` with the hidden state replaced by ``h`` (for forward pre-hooks)."""
    if args:
        return (h,) + tuple(args[1:]), kwargs
    kwargs = dict(kwargs)
    kwargs["hidden_states"] = h
    return args, kwargs


def block_output(output) -> torch.Tensor:
    """The hidden state a block returns (a tensor, or the first item of a tuple/list)."""
    return output[0] if isinstance(output, (tuple, list)) else output


def with_block_output(output, h: torch.Tensor):
    """``output`` with its hidden state replaced by ``h`` (same container type)."""
    if isinstance(output, tuple):
        return (h,) + output[1:]
    if isinstance(output, list):
        return [h] + output[1:]
    return h


class Bypass(nn.Module):
    """Stands in for a removed block: returns ``adapter(h)``, or ``h`` when there is no adapter."""

    def __init__(self, adapter: nn.Module | None = None):
        super().__init__()
        self.adapter = adapter

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states if self.adapter is None else self.adapter(hidden_states)


@contextlib.contextmanager
def swapped_blocks(model: nn.Module, replacements: dict[int, nn.Module]) -> Iterator[None]:
    """Temporarily replace blocks ``i -> module`` (e.g. :class:`Bypass`) in ``decoder_layers(model)``."""
    blocks = decoder_layers(model)
    saved = {i: blocks[i] for i in replacements}
    try:
        for i, m in replacements.items():
            blocks[i] = m
        yield
    finally:
        for i, m in saved.items():
            blocks[i] = m


@contextlib.contextmanager
def block_hooks(layers: nn.ModuleList, fn: Callable[[int, torch.Tensor, torch.Tensor], None]) -> Iterator[None]:
    """Call ``fn(i, x_in, x_out)`` after every block ``i`` runs; ``x_in``, ``x_out``: ``(B, T, d)``
    hidden states entering and leaving block ``i`` (pre-norm residual stream)."""

    def make(i):
        def hook(module, args, kwargs, out):
            fn(i, block_input(args, kwargs), block_output(out))

        return hook

    handles = [layer.register_forward_hook(make(i), with_kwargs=True) for i, layer in enumerate(layers)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def skip_block(layer: nn.Module) -> Iterator[None]:
    """Make ``layer`` an identity map: its output is replaced by its input (the block still runs)."""

    def hook(module, args, kwargs, out):
        return with_block_output(out, block_input(args, kwargs))

    h = layer.register_forward_hook(hook, with_kwargs=True)
    try:
        yield
    finally:
        h.remove()


def mlp_branch(block: nn.Module) -> nn.Module:
    """The module whose output a block adds to the residual stream after its attention: the MLP, or
    the norm after it where the family has one (Gemma3's ``post_feedforward_layernorm``)."""
    if hasattr(block, "post_feedforward_layernorm"):
        return block.post_feedforward_layernorm
    if not hasattr(block, "mlp"):
        raise ModelLoadError(f"{type(block).__name__} has no `mlp`: cannot locate its MLP branch")
    return block.mlp
