"""Model surgery in memory: remove blocks, place adapters, apply a calibration's correction.

After :func:`remove_blocks` the model is an ordinary, smaller HF model: ``model.model.layers``,
``config.num_hidden_layers``, ``config.layer_types`` and every attention's ``layer_idx`` agree, so
``forward``, ``generate()`` with a KV cache and ``save_pretrained``/``from_pretrained`` all work.

Adapters live in one container, ``model.model.shift_adapters`` (an :class:`AdapterSet`), keyed by
*position*: the adapter at position ``p`` transforms the hidden state entering pruned block ``p``
(``p == num_hidden_layers`` means: entering the final norm). A forward pre-hook on that block (or
on the norm) looks the adapter up by key at call time, so wrappers placed by PEFT
(``modules_to_save``) are honoured and ``copy.deepcopy`` keeps working.

Saving and loading (the on-disk format, its checks): :mod:`shift_lightning.checkpoint`.
"""

from __future__ import annotations

from torch import nn

from ..arch import block_input, decoder_layers, final_norm, with_block_input
from ..errors import ShiftError
from .peers import BranchMap, fold_replaceme


class SurgeryError(ShiftError, ValueError):
    """Inconsistent pruning request or saved folder."""


# --------------------------------------------------------------------------------------------
# Removing blocks
# --------------------------------------------------------------------------------------------
def remove_blocks(model: nn.Module, layers: list[int]) -> list[int]:
    """Delete decoder blocks ``layers`` (current indices) in place; return the kept original indices.

    Updates ``model.model.layers``, ``config.num_hidden_layers``, ``config.layer_types`` and the
    ``layer_idx`` of every block and its attention so the KV cache stays consistent.
    Call before :func:`attach_adapters`.
    """
    blocks = decoder_layers(model)
    n = len(blocks)
    drop = set(layers)
    if len(drop) != len(layers) or any(not 0 <= i < n for i in drop):
        raise SurgeryError(f"invalid layer indices {layers} for a model with {n} blocks")
    if len(drop) >= n:
        raise SurgeryError(f"cannot remove all {n} blocks")
    if getattr(model.model, "shift_adapters", None) is not None and len(model.model.shift_adapters.sites):
        raise SurgeryError("remove blocks before attaching adapters (adapter positions would go stale)")
    keep = [i for i in range(n) if i not in drop]
    model.model.layers = nn.ModuleList([blocks[i] for i in keep])
    cfg = model.config
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [cfg.layer_types[i] for i in keep]
    cfg.num_hidden_layers = len(keep)
    placement = getattr(model, "shift_placement", None)
    if placement is not None and placement.onloaded:  # the kept blocks' weights stay under their original names
        placement.pruned(keep)
    for new_idx, block in enumerate(model.model.layers):
        for mod in block.modules():
            if hasattr(mod, "layer_idx"):
                mod.layer_idx = new_idx
    return keep


# --------------------------------------------------------------------------------------------
# Adapters
# --------------------------------------------------------------------------------------------
class AdapterSet(nn.Module):
    """Container of the model's adapters: ``sites[str(position)]``, each a LinearResidualAdapter
    or a chain (``nn.Sequential``) of them when merging was switched off."""

    def __init__(self):
        super().__init__()
        self.sites = nn.ModuleDict()

    def adapter_params(self) -> list[nn.Parameter]:
        """Every adapter parameter (what ``--recovery.train_lra`` unfreezes)."""
        return list(self.sites.parameters())


class _ApplyAdapter:
    """Forward pre-hook: replace the hidden state entering a module by ``adapter(hidden)``."""

    def __init__(self, container: AdapterSet, key: str):
        self.container, self.key = container, key

    def __call__(self, module, args, kwargs):
        adapter = self.container.sites[self.key]
        return with_block_input(args, kwargs, adapter(block_input(args, kwargs)))


def _hook_target(model: nn.Module, position: int) -> nn.Module:
    blocks = decoder_layers(model)
    if position == len(blocks):
        return final_norm(model)
    if not 0 <= position < len(blocks):
        raise SurgeryError(f"adapter position {position} outside 0..{len(blocks)}")
    return blocks[position]


def detach_adapters(model: nn.Module) -> AdapterSet | None:
    """Remove the adapter hooks and container; return the container (or None)."""
    for mod in model.modules():
        for hid, hook in list(mod._forward_pre_hooks.items()):
            if isinstance(hook, _ApplyAdapter):
                del mod._forward_pre_hooks[hid]
                mod._forward_pre_hooks_with_kwargs.pop(hid, None)
    container = getattr(model.model, "shift_adapters", None)
    if container is not None:
        del model.model.shift_adapters
    return container


def attach_adapters(model: nn.Module, adapters: dict[int, nn.Module]) -> AdapterSet:
    """Place ``adapters`` (position -> module) into the (already pruned) model; returns the container."""
    detach_adapters(model)
    container = AdapterSet()
    p = next(model.parameters())
    for pos in sorted(adapters):  # on the model's device (an onloaded skeleton's are meta: the adapters stay real)
        container.sites[str(pos)] = adapters[pos] if p.is_meta else adapters[pos].to(device=p.device)
    model.model.shift_adapters = container
    for pos in sorted(adapters):
        _hook_target(model, pos).register_forward_pre_hook(_ApplyAdapter(container, str(pos)), with_kwargs=True)
    return container


def adapter_set(model: nn.Module) -> AdapterSet | None:
    return getattr(getattr(model, "model", None), "shift_adapters", None)


def adapter_module_names(model: nn.Module) -> list[str]:
    """Names that select exactly the adapters, e.g. for PEFT ``LoraConfig(modules_to_save=...)``.

    PEFT wraps each site in a ``ModulesToSaveWrapper``; the hooks look sites up by key at call
    time, so the trainable copy is the one used in the forward pass.
    """
    container = adapter_set(model)
    return [] if container is None else [f"shift_adapters.sites.{k}" for k in container.sites.keys()]


def apply_maps(model: nn.Module, correction, original_num_layers: int, removed: list[int]) -> None:
    """Put a calibration ``correction`` (:class:`~shift_lightning.maps.fitted.FittedMaps`) into the
    already pruned ``model``: attach its adapters and fold its ReplaceMe maps (``branch_maps``,
    keyed by original block index) into the kept blocks they belong to."""
    from ..placement import placement_of

    attach_adapters(model, correction.adapters)
    kept = [i for i in range(original_num_layers) if i not in set(removed)]
    blocks = decoder_layers(model)
    placement = placement_of(model)

    def fold(pos: int, fn) -> None:  # onloaded: the skeleton's weights are meta; fold each time the block is read
        if placement.onloaded:
            placement.after_load(placement.sources[pos], fn)
        else:
            fn(blocks[pos])

    for orig, T in sorted(correction.branch_maps.items()):
        if orig not in kept:
            raise SurgeryError(f"ReplaceMe map for block {orig}, which was removed")
        if hasattr(blocks[kept.index(orig)], "post_feedforward_layernorm"):  # a map around the norm: structural
            fold_replaceme(blocks[kept.index(orig)], T)
        else:
            fold(kept.index(orig), lambda block, T=T: fold_replaceme(block, T))
    for orig, (W, b) in sorted(getattr(correction, "down_maps", {}).items()):
        if orig not in kept:
            raise SurgeryError(f"down_proj map for block {orig}, which was removed")
        fold(kept.index(orig), lambda block, W=W, b=b: fold_down(model, block, W, b))
    if getattr(correction, "embedding", None) is not None:
        if placement.onloaded:
            raise SurgeryError("the stock repair of a span at block 0 folds into the embedding table, which an onloaded "
                               "run does not rewrite: use --model.placement memory, or keep block 0")
        fold_embedding(model, *correction.embedding)


def fold_down(model: nn.Module, block: nn.Module, W, b) -> None:
    """Add the stock repair's update to ``block``'s ``down_proj``: weight ``+= W`` ``(d, d_ff)``, bias ``+= b``
    (computed in float64; a nonzero ``b`` needs the layer to have a bias already)."""
    import torch

    lin = block.mlp.down_proj
    if tuple(W.shape) != tuple(lin.weight.shape):
        raise SurgeryError(f"down_proj map of shape {tuple(W.shape)} for a down_proj of {tuple(lin.weight.shape)}")
    with torch.no_grad():
        lin.weight.copy_((lin.weight.double() + W.to(lin.weight.device, torch.float64)).to(lin.weight.dtype))
        if bool((b != 0).any()):
            if lin.bias is None:
                raise SurgeryError("a down_proj map with a bias for a down_proj without one")
            lin.bias.copy_((lin.bias.double() + b.to(lin.bias.device, torch.float64)).to(lin.bias.dtype))


def fold_embedding(model: nn.Module, W, b) -> None:
    """Fold ``x ↦ x + x Wᵀ + b`` into the input embedding table (a span at block 0); a tied ``lm_head`` is
    untied first and keeps the original table."""
    import torch

    emb = model.get_input_embeddings()
    if hasattr(emb, "embed_scale") and float(getattr(emb, "embed_scale", 1.0)) != 1.0:
        raise SurgeryError("the embedding table is scaled on lookup; the stock fold supports unscaled tables")
    head = model.get_output_embeddings()
    with torch.no_grad():
        if head is not None and head.weight is emb.weight:
            head.weight = nn.Parameter(emb.weight.detach().clone(), requires_grad=emb.weight.requires_grad)
            model.config.tie_word_embeddings = False
            if getattr(model.config, "get_text_config", None) is not None:
                model.config.get_text_config().tie_word_embeddings = False
        E = emb.weight.double()
        W = W.to(E.device, torch.float64)
        emb.weight = nn.Parameter((E + E @ W.T + b.to(E.device, torch.float64)).to(emb.weight.dtype),
                                  requires_grad=emb.weight.requires_grad)


def branch_maps(model: nn.Module) -> dict[int, BranchMap]:
    """ReplaceMe maps wrapped around a post-MLP norm (Gemma3), by pruned block index."""
    return {i: b.post_feedforward_layernorm for i, b in enumerate(decoder_layers(model))
            if isinstance(getattr(b, "post_feedforward_layernorm", None), BranchMap)}


# --------------------------------------------------------------------------------------------
# Save / load
