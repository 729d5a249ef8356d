"""Model surgery: remove blocks, place adapters, save and reload a pruned + corrected model.

After :func:`remove_blocks` the model is an ordinary, smaller HF model: ``model.model.layers``,
``config.num_hidden_layers``, ``config.layer_types`` and every attention's ``layer_idx`` agree, so
``forward``, ``generate()`` with a KV cache and ``save_pretrained``/``from_pretrained`` all work.

Adapters live in one container, ``model.model.shift_adapters`` (an :class:`AdapterSet`), keyed by
*position*: the adapter at position ``p`` transforms the hidden state entering pruned block ``p``
(``p == num_hidden_layers`` means: entering the final norm). A forward pre-hook on that block (or
on the norm) looks the adapter up by key at call time, so wrappers placed by PEFT
(``modules_to_save``) are honoured and ``copy.deepcopy`` keeps working.

Saved layout (``save_pretrained``)::

    out/config.json, model.safetensors, tokenizer files   the pruned HF model (no adapter weights)
    out/lra.safetensors                                   adapter weights, keys "<position>.<param>"
    out/shift_config.json                                 what was pruned and where adapters sit
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from .arch import block_input, decoder_layers, final_norm, with_block_input
from .calibration.sites import contiguous_spans, pruned_positions  # noqa: F401 (re-exported)
from .errors import ShiftError
from .lra import AdapterSpec, LinearResidualAdapter
from .peers import BranchMap, fold_replaceme

SHIFT_CONFIG = "shift_config.json"
LRA_WEIGHTS = "lra.safetensors"
FORMAT_VERSION = 1


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
    for pos in sorted(adapters):
        container.sites[str(pos)] = adapters[pos].to(device=p.device)
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


def apply_correction(model: nn.Module, correction, original_num_layers: int, removed: list[int]) -> None:
    """Put a calibration ``correction`` (:class:`~shift_lightning.calibration.maps.Correction`) into the
    already pruned ``model``: attach its adapters and fold its ReplaceMe maps (``branch_maps``,
    keyed by original block index) into the kept blocks they belong to."""
    attach_adapters(model, correction.adapters)
    if correction.branch_maps:
        kept = [i for i in range(original_num_layers) if i not in set(removed)]
        blocks = decoder_layers(model)
        for orig, T in sorted(correction.branch_maps.items()):
            if orig not in kept:
                raise SurgeryError(f"ReplaceMe map for block {orig}, which was removed")
            fold_replaceme(blocks[kept.index(orig)], T)


def _branch_maps(model: nn.Module) -> dict[int, BranchMap]:
    return {i: b.post_feedforward_layernorm for i, b in enumerate(decoder_layers(model))
            if isinstance(getattr(b, "post_feedforward_layernorm", None), BranchMap)}


# --------------------------------------------------------------------------------------------
# Save / load
# --------------------------------------------------------------------------------------------
def _adapter_specs(mod: nn.Module) -> list[dict]:
    chain = list(mod) if isinstance(mod, nn.Sequential) else [mod]
    return [a.spec.to_dict() for a in chain]


def save_pretrained(model: nn.Module, tokenizer, out_dir: str | Path, spec: dict) -> Path:
    """Write the pruned HF model, the adapter weights and ``shift_config.json`` into ``out_dir``.

    ``spec`` must hold ``original_num_layers`` and ``pruned_layers`` (original indices) and may
    hold anything else worth recording (base model, criterion, …).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    container = adapter_set(model)
    prefix = "model.shift_adapters."
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(prefix)}
    tensors = {}
    branches = _branch_maps(model)
    for i, bm in branches.items():  # the HF folder keeps the plain norm; the map goes to lra.safetensors
        key = f"model.layers.{i}.post_feedforward_layernorm."
        for name in list(state):
            if name.startswith(key + "norm."):
                state[key + name[len(key + "norm."):]] = state.pop(name)
            elif name.startswith(key + "map."):
                state.pop(name)
        tensors[f"branch.{i}.weight"] = bm.map.weight.detach().contiguous().cpu()
    model.save_pretrained(out, state_dict=state)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    adapters = []
    if container is not None:
        for key, mod in container.sites.items():
            adapters.append({"position": int(key), "chain": _adapter_specs(mod)})
            for name, t in mod.state_dict().items():
                tensors[f"{key}.{name}"] = t.detach().contiguous().cpu()
    save_file(tensors, str(out / LRA_WEIGHTS), metadata={"format": "pt"})
    doc = {"format_version": FORMAT_VERSION, **spec, "adapters": adapters}
    if branches:
        doc["branch_maps"] = [{"block": i, "after": "post_feedforward_layernorm"} for i in sorted(branches)]
    (out / SHIFT_CONFIG).write_text(json.dumps(doc, indent=2))
    return out


def save_adapters(model: nn.Module, tokenizer, out_dir: str | Path, spec: dict, base_model: dict,
                  branch_maps: dict[int, torch.Tensor] | None = None) -> Path:
    """Write an *adapter-only* folder: ``shift_config.json`` (with the base model's
    :class:`~shift_lightning.models.ModelConfig` as ``base_model``), ``lra.safetensors`` and the
    tokenizer, but no model weights. :func:`load_pretrained` rebuilds the corrected model from the
    base model: load, remove ``pruned_layers``, attach the adapters, fold ``branch_maps``
    (pruned block index -> ReplaceMe's ``T``). Megabytes instead of the model's gigabytes.
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    container = adapter_set(model)
    tensors, adapters = {}, []
    if container is not None:
        for key, mod in container.sites.items():
            adapters.append({"position": int(key), "chain": _adapter_specs(mod)})
            for name, t in mod.state_dict().items():
                tensors[f"{key}.{name}"] = t.detach().contiguous().cpu()
    blocks = decoder_layers(model)
    entries = []
    for i, T in sorted((branch_maps or {}).items()):
        tensors[f"branch.{i}.weight"] = T.T.detach().to(torch.float32).contiguous().cpu()
        after = "post_feedforward_layernorm" if hasattr(blocks[i], "post_feedforward_layernorm") else "down_proj"
        entries.append({"block": i, "after": after})
    save_file(tensors, str(out / LRA_WEIGHTS), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    doc = {"format_version": FORMAT_VERSION, **spec, "weights": "adapters", "base_model": base_model,
           "adapters": adapters, "branch_maps": entries}
    (out / SHIFT_CONFIG).write_text(json.dumps(doc, indent=2))
    return out


def is_shift_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by :func:`save_pretrained`."""
    return (Path(path).expanduser() / SHIFT_CONFIG).is_file()


def _read_json(file: Path) -> dict:
    try:
        doc = json.loads(file.read_text())
    except UnicodeDecodeError as e:
        raise SurgeryError(f"{file} is not UTF-8 text ({e.reason}); the folder is damaged") from e
    except json.JSONDecodeError as e:
        raise SurgeryError(f"{file} is malformed JSON ({e.msg} at line {e.lineno}); the folder is damaged") from e
    if not isinstance(doc, dict):
        raise SurgeryError(f"{file} must hold a JSON object")
    return doc


def read_shift_config(path: str | Path) -> dict:
    """``shift_config.json`` of a saved folder, checked for shape (see :func:`load_pretrained`)."""
    file = Path(path).expanduser() / SHIFT_CONFIG
    doc = _read_json(file)
    if doc.get("format_version") != FORMAT_VERSION:
        raise SurgeryError(f"{file}: unsupported format_version {doc.get('format_version')!r} (expected {FORMAT_VERSION})")
    n, pruned = doc.get("original_num_layers"), doc.get("pruned_layers")
    if not isinstance(n, int) or n < 1 or not isinstance(pruned, list) \
            or not all(isinstance(i, int) and 0 <= i < n for i in pruned) or len(set(pruned)) != len(pruned):
        raise SurgeryError(f"{file}: original_num_layers / pruned_layers are missing or inconsistent "
                           f"({n!r}, {pruned!r})")
    adapters = doc.get("adapters")
    if not isinstance(adapters, list) or not all(isinstance(a, dict) and isinstance(a.get("position"), int)
                                                 and isinstance(a.get("chain"), list) and a["chain"]
                                                 for a in adapters):
        raise SurgeryError(f"{file}: 'adapters' must be a list of {{position, chain}} entries")
    positions = [a["position"] for a in adapters]
    if len(set(positions)) != len(positions):
        raise SurgeryError(f"{file}: duplicate adapter positions {sorted(positions)}")
    return doc


def _rebuild_from_base(path: Path, doc: dict, dtype):
    """The pruned model of an adapter-only folder: base model, blocks removed (adapters come after)."""
    from transformers import AutoTokenizer

    from .models import ModelConfig, load_model

    try:
        base = ModelConfig(**doc["base_model"])
    except TypeError as e:
        raise SurgeryError(f"{path / SHIFT_CONFIG}: bad base_model {doc['base_model']!r}: {e}") from e
    if dtype is not None:
        base = ModelConfig(**{**base.__dict__, "dtype": str(dtype).replace("torch.", "")})
    model, tok = load_model(base)
    n = len(decoder_layers(model))
    if n != doc["original_num_layers"]:
        raise SurgeryError(f"{path / SHIFT_CONFIG}: the base model {base.name_or_path!r} has {n} blocks, the record "
                           f"says {doc['original_num_layers']}")
    dim = model.config.hidden_size
    for a in doc["adapters"]:
        if any(not isinstance(sp, dict) or sp.get("dim") != dim for sp in a["chain"]):
            raise SurgeryError(f"{path / SHIFT_CONFIG}: adapter at position {a['position']} does not match the base "
                               f"model's hidden size {dim}")
    remove_blocks(model, doc["pruned_layers"])
    if (path / "tokenizer_config.json").exists():
        tok = AutoTokenizer.from_pretrained(path)
    return model, tok


def _check_against_config(path: Path, doc: dict) -> dict:
    cfg = _read_json(path / "config.json")
    depth = cfg.get("num_hidden_layers", cfg.get("text_config", {}).get("num_hidden_layers"))
    dim = cfg.get("hidden_size", cfg.get("text_config", {}).get("hidden_size"))
    expected = doc["original_num_layers"] - len(doc["pruned_layers"])
    if depth != expected:
        raise SurgeryError(f"{path / 'config.json'}: num_hidden_layers is {depth}, but {SHIFT_CONFIG} records "
                           f"{doc['original_num_layers']} blocks minus {len(doc['pruned_layers'])} pruned = {expected}")
    for a in doc["adapters"]:
        if not 0 <= a["position"] <= expected:
            raise SurgeryError(f"{path / SHIFT_CONFIG}: adapter position {a['position']} outside 0..{expected}")
        for spec in a["chain"]:
            if not isinstance(spec, dict) or spec.get("dim") != dim:
                raise SurgeryError(f"{path / SHIFT_CONFIG}: adapter at position {a['position']} has dim "
                                   f"{spec.get('dim') if isinstance(spec, dict) else spec!r}, the model's hidden size is {dim}")
    return cfg


def load_pretrained(source, dtype: str | torch.dtype | None = None, device=None):
    """Load ``(model, tokenizer)``: a folder written by :func:`save_pretrained` with its adapters in
    place, or, unpruned, anything :func:`~shift_lightning.models.load_model` accepts (an HF id or
    folder, a ``.gguf``, an embedded name such as ``smollm2-135m``, or a ``ModelConfig``).

    A saved folder is checked before any weight is read: ``shift_config.json`` must be well formed,
    agree with ``config.json`` (depth, hidden size), list every adapter ``lra.safetensors`` holds
    (no more, no fewer), without duplicate positions, and the adapter weights must be finite;
    otherwise :class:`SurgeryError` names the file. Nothing is unpickled or executed
    (safetensors + JSON; no remote code).
    """
    from .models import ModelConfig, load_model

    cfg = source if isinstance(source, ModelConfig) else ModelConfig(name_or_path=str(source))
    if cfg.tiny is not None or not is_shift_folder(cfg.name_or_path):
        if dtype is not None:
            cfg = ModelConfig(**{**cfg.__dict__, "dtype": str(dtype).replace("torch.", "")})
        model, tok = load_model(cfg)
        return (model.to(device) if device is not None else model), tok
    if dtype is None and isinstance(source, ModelConfig):
        dtype = cfg.dtype
    return _load_shift_folder(Path(cfg.name_or_path).expanduser(), dtype, device)


def _load_shift_folder(path: Path, dtype, device):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    doc = read_shift_config(path)
    adapter_only = doc.get("weights") == "adapters"
    if adapter_only:
        if not isinstance(doc.get("base_model"), dict):
            raise SurgeryError(f"{path / SHIFT_CONFIG}: an adapter-only folder must name its base_model")
    else:
        _check_against_config(path, doc)
    wfile = path / LRA_WEIGHTS
    listed = {str(a["position"]) for a in doc["adapters"]}
    branches = doc.get("branch_maps", [])
    if not isinstance(branches, list) or not all(isinstance(b, dict) and isinstance(b.get("block"), int)
                                                 for b in branches):
        raise SurgeryError(f"{path / SHIFT_CONFIG}: 'branch_maps' must be a list of {{block, after}} entries")
    try:
        with safe_open(str(wfile), framework="pt") as f:
            keys = list(f.keys())
            held = {k.split(".", 1)[0] for k in keys if not k.startswith("branch.")}
            held_branches = {int(k.split(".")[1]) for k in keys if k.startswith("branch.")}
            if held_branches != {b["block"] for b in branches}:
                raise SurgeryError(f"{wfile} holds MLP-branch maps for blocks {sorted(held_branches)} but "
                                   f"{SHIFT_CONFIG} lists {sorted(b['block'] for b in branches)}")
            if held != listed:
                raise SurgeryError(
                    f"{wfile} holds adapters at positions {sorted(held, key=int)} but {SHIFT_CONFIG} lists "
                    f"{sorted(listed, key=int)}: refusing to load a model whose corrections do not match its record")
            weights = {k: f.get_tensor(k) for k in keys}
    except SurgeryError:
        raise
    except Exception as e:  # missing or truncated safetensors
        raise SurgeryError(f"Cannot read {wfile}: {e}") from e
    bad = [k for k, t in weights.items() if not torch.isfinite(t).all()]
    if bad:
        raise SurgeryError(f"{wfile}: non-finite adapter weights in {bad[:3]}; the folder is damaged")
    if adapter_only:
        model, tok = _rebuild_from_base(path, doc, dtype)
    else:
        if isinstance(dtype, str):
            dtype = getattr(torch, dtype)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or "auto", trust_remote_code=False)
        tok = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").exists() else None
    pdtype = next(model.parameters()).dtype
    adapters = {}
    for entry in doc["adapters"]:
        try:
            chain = [LinearResidualAdapter(AdapterSpec(**s), dtype=pdtype) for s in entry["chain"]]
        except (TypeError, ValueError) as e:
            raise SurgeryError(f"{path / SHIFT_CONFIG}: bad adapter spec at position {entry['position']}: {e}") from e
        mod = chain[0] if len(chain) == 1 else nn.Sequential(*chain)
        key = str(entry["position"])
        sd = {k[len(key) + 1:]: v for k, v in weights.items() if k.startswith(key + ".")}
        try:
            mod.load_state_dict(sd, strict=True)
        except RuntimeError as e:
            raise SurgeryError(f"{wfile}: adapter at position {key} does not match its spec: {e}") from e
        adapters[entry["position"]] = mod
    attach_adapters(model, adapters)
    blocks = decoder_layers(model)
    for b in branches:
        i = b["block"]
        post_norm = 0 <= i < len(blocks) and hasattr(blocks[i], "post_feedforward_layernorm")
        if not 0 <= i < len(blocks) or (not post_norm and not adapter_only):
            raise SurgeryError(f"{path / SHIFT_CONFIG}: MLP-branch map for block {i}, which has no post-MLP norm")
        fold_replaceme(blocks[i], weights[f"branch.{i}.weight"].to(torch.float64).T)
    if device is not None:
        model.to(device)
    model.eval()
    return model, tok
