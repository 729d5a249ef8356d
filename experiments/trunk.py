"""Evaluate several variants of one model at the cost of their differing blocks only.

Variants of a pruned model (pruned only, + LRA, + the peers' maps) share every block before the
first place where they differ. :class:`TrunkCache` records, while the first variant is evaluated,
the hidden state entering block ``depth`` for every forward call, keyed by the call's inputs
(token ids, positions, attention mask); while the next variants are evaluated on the same
inputs, blocks ``0 … depth−1`` are skipped and the recorded state is handed to block ``depth``.
Everything after (the embedding call, masks and rotary tables the decoder prepares, the
remaining blocks, the norm and LM head) runs as usual, so the results are bit-for-bit those of a
full run (tested). A call whose key was not recorded simply runs the real blocks.

    cache = TrunkCache(depth=21)
    with cache.recording(pruned):  results["pruned"] = evaluate_model(pruned, tok, cfg)
    with cache.replaying(lra):     results["lra"] = evaluate_model(lra, tok, cfg)

Memory: the recorded states, ``(tokens run) × d`` floats (about 0.6 GB for 250k tokens at d = 576).
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator

import torch
from torch import nn

from shift_lightning.arch import base_model, decoder_layers, swapped_blocks


def _key(kwargs: dict, args: tuple) -> str:
    h = hashlib.sha1()
    for name in ("input_ids", "position_ids", "attention_mask", "inputs_embeds"):
        t = kwargs.get(name)
        if t is None and name == "input_ids" and args:
            t = args[0]
        if isinstance(t, torch.Tensor):
            t = t.detach()
            h.update(name.encode() + str(tuple(t.shape)).encode() + str(t.dtype).encode())
            h.update(t.contiguous().cpu().numpy().tobytes())
    return h.hexdigest()


class _Skip(nn.Module):
    """Block ``j < depth`` during a replay: skipped on a hit (the last one returns the recorded
    state), the real block otherwise."""

    def __init__(self, block: nn.Module, cache: "TrunkCache", last: bool):
        super().__init__()
        self.block, self.cache, self.last = block, cache, last

    def forward(self, hidden_states, *args, **kwargs):
        hit = self.cache._current
        if hit is None:
            return self.block(hidden_states, *args, **kwargs)
        return hit.to(hidden_states.device) if self.last else hidden_states


class TrunkCache:
    """Hidden states entering block ``depth``, recorded per forward call (see the module docstring)."""

    def __init__(self, depth: int):
        self.depth = depth
        self.states: dict[str, torch.Tensor] = {}
        self.hits = self.misses = 0
        self._current: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.states.values())

    def _decoder(self, model: nn.Module) -> nn.Module:
        return base_model(model).model

    @contextlib.contextmanager
    def recording(self, model: nn.Module) -> Iterator["TrunkCache"]:
        """Record while ``model`` runs (its blocks ``0 … depth−1`` must be the shared ones)."""
        if self.depth < 1:
            yield self
            return
        key: list[str] = []

        def on_call(mod, args, kwargs):
            key[:] = [_key(kwargs, args)]

        def on_block(mod, args, kwargs):
            self.states[key[0]] = (args[0] if args else kwargs["hidden_states"]).detach().clone()

        h1 = self._decoder(model).register_forward_pre_hook(on_call, with_kwargs=True)
        h2 = decoder_layers(model)[self.depth].register_forward_pre_hook(on_block, with_kwargs=True)
        try:
            yield self
        finally:
            h1.remove(), h2.remove()

    @contextlib.contextmanager
    def replaying(self, model: nn.Module) -> Iterator["TrunkCache"]:
        """Skip blocks ``0 … depth−1`` of ``model`` for every recorded call."""
        if self.depth < 1:
            yield self
            return
        blocks = decoder_layers(model)

        def on_call(mod, args, kwargs):
            self._current = self.states.get(_key(kwargs, args))
            if self._current is None:
                self.misses += 1
            else:
                self.hits += 1

        stubs = {j: _Skip(blocks[j], self, j == self.depth - 1) for j in range(self.depth)}
        h = self._decoder(model).register_forward_pre_hook(on_call, with_kwargs=True)
        try:
            with swapped_blocks(model, stubs):
                yield self
        finally:
            h.remove()
            self._current = None
