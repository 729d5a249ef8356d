"""Modeling code of a pruned + corrected shift-lightning folder, for ``transformers``' remote-code loading.

Self-contained on purpose: it imports torch, transformers and safetensors, never shift_lightning.
:func:`shift_lightning.checkpoint.save_pretrained` copies this file into every folder whose model
carries Linear Residual Adapters or ReplaceMe maps on a post-MLP norm, and marks the folder's
``config.json`` (``model_type: shift_<family>``, ``auto_map`` naming the classes below), so::

    AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)

returns the family's stock model class (``LlamaForCausalLM``, ``Gemma3ForCausalLM``, …) loaded from
``model.safetensors``, with, from ``shift_config.json`` and ``lra.safetensors``:

* the adapter at position ``p`` (``y = x + x Wᵀ + b``, low rank ``W = U Vᵀ``, the affine ablation
  ``y = x Aᵀ + c``, or a chain of them) applied to the hidden state entering block ``p`` by a
  forward pre-hook (``p == num_hidden_layers``: entering the final norm);
* ReplaceMe's map ``T`` on a post-MLP norm (Gemma3): the norm's output times ``T`` (a forward hook).

Same parameter names (``model.shift_adapters.sites.<p>.…``, what PEFT's ``modules_to_save`` names),
same arithmetic and dtypes as ``shift_lightning.load_pretrained``: identical logits. Without
``trust_remote_code`` transformers refuses the folder (its ``model_type`` is not a stock one) rather
than load the model without its adapters. ``save_pretrained`` writes the same layout back.
"""

from __future__ import annotations

import json
import os
import shutil

import torch
from torch import nn
from transformers import (Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM, MistralConfig,
                          MistralForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM)

SHIFT_CONFIG = "shift_config.json"
LRA_WEIGHTS = "lra.safetensors"
MODEL_TYPE_PREFIX = "shift_"
_HUB_KWARGS = ("cache_dir", "force_download", "proxies", "local_files_only", "token", "revision", "subfolder")


class LinearResidualAdapter(nn.Module):
    """``y = x + x Wᵀ + b`` (residual) or ``y = x Aᵀ + c`` (affine); ``W = U Vᵀ`` when ``rank < dim``."""

    def __init__(self, dim: int, kind: str = "residual", rank: int | None = None, bias: bool = True,
                 dtype=None, device=None):
        super().__init__()
        if kind not in ("residual", "affine"):
            raise ValueError(f"adapter kind must be 'residual' or 'affine', got {kind!r}")
        self.kind, self.low_rank = kind, rank is not None and rank < dim
        kw = dict(dtype=dtype, device=device)
        if self.low_rank:
            self.down = nn.Linear(dim, rank, bias=False, **kw)
            self.up = nn.Linear(rank, dim, bias=bias, **kw)
        else:
            self.linear = nn.Linear(dim, dim, bias=bias, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.to((self.up if self.low_rank else self.linear).weight.dtype)
        y = self.up(self.down(h)) if self.low_rank else self.linear(h)
        if self.kind == "residual":
            y = h + y
        return y.to(dtype)


class ShiftAdapters(nn.Module):
    """``sites[str(position)]``: the adapters; ``branches[str(block)]``: ReplaceMe maps ``m ↦ m T``
    (``nn.Linear`` without bias, weight ``Tᵀ``) applied to a block's post-MLP norm output ``m``."""

    def __init__(self):
        super().__init__()
        self.sites = nn.ModuleDict()
        self.branches = nn.ModuleDict()


class _ApplyAdapter:
    """Forward pre-hook: the hidden state entering the module becomes ``adapter(hidden)``. The adapter
    is looked up at call time, so a PEFT ``modules_to_save`` wrapper placed later is honoured."""

    def __init__(self, container: ShiftAdapters, key: str):
        self.container, self.key = container, key

    def __call__(self, module, args, kwargs):
        adapter = self.container.sites[self.key]
        if args:
            return (adapter(args[0]),) + tuple(args[1:]), kwargs
        kwargs = dict(kwargs)
        kwargs["hidden_states"] = adapter(kwargs["hidden_states"])
        return args, kwargs


class _ApplyBranchMap:
    """Forward hook on a post-MLP norm: its output ``m`` becomes ``m T`` (the block's ReplaceMe map)."""

    def __init__(self, container: ShiftAdapters, key: str):
        self.container, self.key = container, key

    def __call__(self, module, args, output):
        return self.container.branches[self.key](output)


def _resolve(path, filename: str, kwargs: dict) -> str:
    """A file of the folder (local) or of the hub repository (through transformers' cache)."""
    sub = kwargs.get("subfolder") or ""
    local = os.path.join(str(path), sub, filename)
    if os.path.isfile(local):
        return local
    from transformers.utils import cached_file

    return cached_file(path, filename, **{k: kwargs[k] for k in _HUB_KWARGS if k in kwargs})


class ShiftMixin:
    """Adds the adapters and maps of a shift-lightning folder to a stock causal LM class."""

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path, *model_args, **kwargs):
        out = super().from_pretrained(pretrained_model_name_or_path, *model_args, **kwargs)
        model = out[0] if isinstance(out, tuple) else out
        with open(_resolve(pretrained_model_name_or_path, SHIFT_CONFIG, kwargs)) as f:
            record = json.load(f)
        from safetensors.torch import load_file

        weights = load_file(_resolve(pretrained_model_name_or_path, LRA_WEIGHTS, kwargs))
        model.attach_shift(record, weights, source=str(pretrained_model_name_or_path))
        bad = [n for n, p in model.named_parameters() if p.is_floating_point() and not bool(torch.isfinite(p).all())]
        if bad:  # as shift_lightning.load_pretrained: damaged weights are never loaded
            raise ValueError(f"{pretrained_model_name_or_path}: non-finite weights (NaN or infinity) in {bad[:3]}; "
                             "the weights are damaged, refusing to load them")
        return out

    @torch.no_grad()
    def attach_shift(self, record: dict, weights: dict[str, torch.Tensor], source: str = "the folder") -> None:
        """Place the adapters / maps of ``record`` (shift_config.json) with ``weights`` (lra.safetensors)."""
        blocks, n = self.model.layers, len(self.model.layers)
        if record.get("weights", "full") != "full":
            raise ValueError(f"{source} is an adapter-only folder (no model weights): load it with "
                             "shift_lightning.load_pretrained")
        if record.get("original_num_layers", n) - len(record.get("pruned_layers", [])) != n:
            raise ValueError(f"{source}: {SHIFT_CONFIG} and config.json disagree on the depth ({n} blocks)")
        listed = {str(a["position"]) for a in record.get("adapters", [])}
        held = {k.split(".", 1)[0] for k in weights if not k.startswith("branch.")}
        if held != listed:
            raise ValueError(f"{source}: {LRA_WEIGHTS} holds adapters at positions {sorted(held)}, {SHIFT_CONFIG} "
                             f"lists {sorted(listed)}")
        bad = [k for k, t in weights.items() if not torch.isfinite(t).all()]
        if bad:
            raise ValueError(f"{source}: non-finite adapter weights in {bad[:3]}")
        first = next(self.parameters())
        container = ShiftAdapters().to(first.device)
        for entry in record.get("adapters", []):
            p, key = entry["position"], str(entry["position"])
            if not 0 <= p <= n:
                raise ValueError(f"{source}: adapter position {p} outside 0..{n}")
            chain = [LinearResidualAdapter(s["dim"], s.get("kind", "residual"), s.get("rank"), s.get("bias", True),
                                           dtype=first.dtype, device=first.device) for s in entry["chain"]]
            mod = chain[0] if len(chain) == 1 else nn.Sequential(*chain)
            mod.load_state_dict({k[len(key) + 1:]: v for k, v in weights.items() if k.startswith(key + ".")},
                                strict=True)
            container.sites[key] = mod
        for b in record.get("branch_maps", []):
            i = b["block"]
            if b.get("after", "post_feedforward_layernorm") != "post_feedforward_layernorm" or not 0 <= i < n \
                    or not hasattr(blocks[i], "post_feedforward_layernorm"):
                raise ValueError(f"{source}: a ReplaceMe map on block {i} that has no post-MLP norm")
            ref = next(blocks[i].post_feedforward_layernorm.parameters())
            W = weights[f"branch.{i}.weight"]
            lin = nn.Linear(W.shape[1], W.shape[0], bias=False, dtype=ref.dtype, device=ref.device)
            lin.weight.copy_(W)
            container.branches[str(i)] = lin
        container.train(self.training)
        self.model.shift_adapters = container
        for key in container.sites:
            target = self.model.norm if int(key) == n else blocks[int(key)]
            target.register_forward_pre_hook(_ApplyAdapter(container, key), with_kwargs=True)
        for key in container.branches:
            blocks[int(key)].post_feedforward_layernorm.register_forward_hook(_ApplyBranchMap(container, key))
        self.shift_record = record

    def save_pretrained(self, save_directory, *args, state_dict=None, **kwargs):
        """The folder layout shift-lightning writes: stock weights, ``lra.safetensors``, ``shift_config.json``
        and this file (``config.json`` keeps the ``shift_`` model type and ``auto_map``)."""
        container = getattr(self.model, "shift_adapters", None)
        if container is None:
            return super().save_pretrained(save_directory, *args, state_dict=state_dict, **kwargs)
        from safetensors.torch import save_file

        state = state_dict if state_dict is not None else self.state_dict()
        prefix = "model.shift_adapters."
        plain = {k: v for k, v in state.items() if not k.startswith(prefix)}
        tensors = {}
        for k, v in state.items():
            if k.startswith(prefix + "sites."):
                tensors[k[len(prefix + "sites."):]] = v.detach().contiguous().cpu()
            elif k.startswith(prefix + "branches."):
                tensors["branch." + k[len(prefix + "branches."):]] = v.detach().contiguous().cpu()
        out = super().save_pretrained(save_directory, *args, state_dict=plain, **kwargs)
        save_file(tensors, os.path.join(save_directory, LRA_WEIGHTS), metadata={"format": "pt"})
        with open(os.path.join(save_directory, SHIFT_CONFIG), "w") as f:
            json.dump(self.shift_record, f, indent=2)
        target = os.path.join(save_directory, os.path.basename(__file__))
        if not os.path.exists(target):
            shutil.copyfile(__file__, target)
        return out


# One config and one model class per supported family: the stock ones, plus the adapters.
class ShiftLlamaConfig(LlamaConfig):
    model_type = MODEL_TYPE_PREFIX + "llama"


class ShiftLlamaForCausalLM(ShiftMixin, LlamaForCausalLM):
    config_class = ShiftLlamaConfig


class ShiftMistralConfig(MistralConfig):
    model_type = MODEL_TYPE_PREFIX + "mistral"


class ShiftMistralForCausalLM(ShiftMixin, MistralForCausalLM):
    config_class = ShiftMistralConfig


class ShiftQwen2Config(Qwen2Config):
    model_type = MODEL_TYPE_PREFIX + "qwen2"


class ShiftQwen2ForCausalLM(ShiftMixin, Qwen2ForCausalLM):
    config_class = ShiftQwen2Config


class ShiftQwen3Config(Qwen3Config):
    model_type = MODEL_TYPE_PREFIX + "qwen3"


class ShiftQwen3ForCausalLM(ShiftMixin, Qwen3ForCausalLM):
    config_class = ShiftQwen3Config


class ShiftGemma3TextConfig(Gemma3TextConfig):
    model_type = MODEL_TYPE_PREFIX + "gemma3_text"


class ShiftGemma3ForCausalLM(ShiftMixin, Gemma3ForCausalLM):
    config_class = ShiftGemma3TextConfig


#: base model_type -> (config class name, model class name) written into ``auto_map``.
FAMILIES = {"llama": ("ShiftLlamaConfig", "ShiftLlamaForCausalLM"),
            "mistral": ("ShiftMistralConfig", "ShiftMistralForCausalLM"),
            "qwen2": ("ShiftQwen2Config", "ShiftQwen2ForCausalLM"),
            "qwen3": ("ShiftQwen3Config", "ShiftQwen3ForCausalLM"),
            "gemma3_text": ("ShiftGemma3TextConfig", "ShiftGemma3ForCausalLM")}
