"""The on-disk format of a pruned + corrected model: save, load, cross-check. One public loader.

Layout of a folder written by :func:`save_pretrained`::

    out/config.json, model.safetensors, tokenizer files   the pruned HF model (no adapter weights)
    out/lra.safetensors                                   adapter weights, keys "<position>.<param>";
                                                          ReplaceMe maps on a post-MLP norm "branch.<block>.weight"
    out/shift_config.json                                 a :class:`ShiftSpec`: what was pruned, where maps sit
    out/README.md                                         the model card (:mod:`shift_lightning.card`)
    out/modeling_shift.py                                 with adapters or maps: the opt-in ``from_pretrained(...,
                                                          trust_remote_code=True)`` path (:mod:`~shift_lightning.remote_code`);
                                                          config.json's ``model_type`` is then ``shift_<family>``

An *adapter-only* folder (:func:`save_adapters`, ``weights: adapters``) names its base model instead
of copying it; :func:`load_pretrained` rebuilds the pruned model from the base (ReplaceMe maps stored in float64
as fitted and folded again: the same weights bit for bit; re-fitted kept blocks as ``kept.<position>.<layer>.*``).

:func:`load_pretrained` is the one public loader: a saved folder (checked before any weight is
read: the record must be well formed, agree with ``config.json``, list exactly the adapters the
weights hold; every weight file must be complete safetensors, and every weight, of the model and of
the adapters, finite), or, unpruned, anything
:func:`shift_lightning.models.load_model` reads (HF id or folder, ``.gguf``, an embedded name, a
tiny random config). Nothing is unpickled or executed (safetensors + JSON; a folder's
``modeling_shift.py`` is never run by it).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from .arch import decoder_layers
from .card import CardFacts, model_card
from .maps.keptfit import KeptFitError, kept_tensors, put_kept_tensors
from .maps.lra import AdapterSpec, LinearResidualAdapter
from .maps.peers import fold_replaceme
from .maps.surgery import SurgeryError, adapter_set, attach_adapters, branch_maps, fold_down, fold_embedding, remove_blocks
from .maps.record import LRA_WEIGHTS, SHIFT_CONFIG, ShiftSpec  # noqa: F401  (ShiftSpec: re-exported for the recipes)
from .weightfiles import (check_finite, check_model_config, check_safetensors_files, check_weight_shapes, pickles_in,
                          refusing_pickles)


def _adapter_entries(model: nn.Module) -> tuple[list[dict], dict[str, torch.Tensor]]:
    entries, tensors = [], {}
    container = adapter_set(model)
    if container is not None:
        for key, mod in container.sites.items():
            chain = list(mod) if isinstance(mod, nn.Sequential) else [mod]
            entries.append({"position": int(key), "chain": [a.spec.to_dict() for a in chain]})
            for name, t in mod.state_dict().items():
                tensors[f"{key}.{name}"] = t.detach().contiguous().cpu()
    return entries, tensors


def _as_spec(spec: ShiftSpec | dict) -> ShiftSpec:
    return spec if isinstance(spec, ShiftSpec) else ShiftSpec.from_dict(dict(spec), "the spec to save")


# --------------------------------------------------------------------------------------------
# Save
# --------------------------------------------------------------------------------------------
def save_pretrained(model: nn.Module, tokenizer, out_dir: str | Path, spec: ShiftSpec | dict,
                    card: CardFacts | None = None) -> Path:
    """Write the pruned HF model, the adapter weights, ``shift_config.json`` and the model card into
    ``out_dir`` (``spec``: at least ``original_num_layers`` and ``pruned_layers``; adapters are filled
    in here; ``card``: what the card says besides the model and its record). A model with adapters or
    maps gets ``modeling_shift.py`` and a marked ``config.json`` (:func:`~shift_lightning.remote_code.mark_folder`)."""
    from safetensors.torch import save_file

    from .placement import placement_of, save_streamed
    from .remote_code import MODELING_FILE, mark_folder

    spec = _as_spec(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    prefix = "model.shift_adapters."
    state = {k: v for k, v in model.state_dict().items() if not k.startswith(prefix)}
    entries, tensors = _adapter_entries(model)
    branches = branch_maps(model)
    for i, bm in branches.items():  # the HF folder keeps the plain norm; the map goes to lra.safetensors
        key = f"model.layers.{i}.post_feedforward_layernorm."
        for name in list(state):
            if name.startswith(key + "norm."):
                state[key + name[len(key + "norm."):]] = state.pop(name)
            elif name.startswith(key + "map."):
                state.pop(name)
        tensors[f"branch.{i}.weight"] = bm.map.weight.detach().contiguous().cpu()
    if placement_of(model).onloaded:  # a skeleton: the kept blocks streamed from the source files
        save_streamed(model, state, out)
    else:
        model.save_pretrained(out, state_dict=state)
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    save_file(tensors, str(out / LRA_WEIGHTS), metadata={"format": "pt"})
    spec.adapters, spec.weights = entries, "full"
    spec.branch_maps = [{"block": i, "after": "post_feedforward_layernorm"} for i in sorted(branches)]
    (out / SHIFT_CONFIG).write_text(json.dumps(spec.to_dict(), indent=2))
    if entries or branches:
        mark_folder(out)
    (out / "README.md").write_text(model_card(spec.to_dict(), model, card, loads_remotely=(out / MODELING_FILE).exists()))
    return out


def save_adapters(model: nn.Module, tokenizer, out_dir: str | Path, spec: ShiftSpec | dict, base_model: dict,
                  maps: dict[int, torch.Tensor] | None = None, card: CardFacts | None = None,
                  down: dict[int, tuple] | None = None, embedding: tuple | None = None) -> Path:
    """Write an *adapter-only* folder: ``shift_config.json`` (with the base model's
    :class:`~shift_lightning.models.ModelConfig` as ``base_model``), ``lra.safetensors`` and the
    tokenizer, but no model weights; ``maps``: ReplaceMe's ``T`` by pruned block index; ``down`` /
    ``embedding``: the stock repair's ``(W, b)`` updates (by pruned block index). Megabytes instead of the
    model's gigabytes."""
    from safetensors.torch import save_file

    spec = _as_spec(spec)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    entries, tensors = _adapter_entries(model)
    blocks = decoder_layers(model)
    spec.branch_maps = []
    for i, T in sorted((maps or {}).items()):
        # float64, as fitted: folding the stored T again gives the in-memory weights bit for bit (d² · 8 bytes)
        tensors[f"branch.{i}.weight"] = T.T.detach().to(torch.float64).contiguous().cpu()
        after = "post_feedforward_layernorm" if hasattr(blocks[i], "post_feedforward_layernorm") else "down_proj"
        spec.branch_maps.append({"block": i, "after": after})
    spec.folds = []
    for i, (W, b) in sorted((down or {}).items()):
        tensors[f"fold.down.{i}.weight"], tensors[f"fold.down.{i}.bias"] = _f64(W), _f64(b)
        spec.folds.append({"into": "down_proj", "block": i})
    if embedding is not None:
        tensors["fold.embedding.weight"], tensors["fold.embedding.bias"] = _f64(embedding[0]), _f64(embedding[1])
        spec.folds.append({"into": "embedding"})
    tensors.update(kept_tensors(model, spec.refit_blocks or []))  # re-fitted kept blocks differ from the base
    save_file(tensors, str(out / LRA_WEIGHTS), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(out)
    spec.adapters, spec.weights, spec.base_model = entries, "adapters", base_model
    (out / SHIFT_CONFIG).write_text(json.dumps(spec.to_dict(), indent=2))
    role = "adapter-only: the base model is named, not copied; `shift_lightning.load_pretrained` rebuilds it"
    (out / "README.md").write_text(model_card(spec.to_dict(), model, replace(card or CardFacts(), role=role)))
    return out


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to(torch.float64).contiguous().cpu()


def _fold_names(spec: ShiftSpec) -> set[str]:
    return {f"fold.down.{f['block']}" if f["into"] == "down_proj" else "fold.embedding" for f in spec.folds}


# --------------------------------------------------------------------------------------------
# Load
# --------------------------------------------------------------------------------------------
def is_shift_folder(path: str | Path) -> bool:
    """Whether ``path`` is a folder written by :func:`save_pretrained` / :func:`save_adapters`."""
    return (Path(path).expanduser() / SHIFT_CONFIG).is_file()


def read_json(file: Path) -> dict:
    try:
        doc = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError) as e:  # missing, unreadable, not text
        raise SurgeryError(f"{file} is {'not UTF-8 text' if isinstance(e, UnicodeDecodeError) else 'missing or unreadable'} "
                           f"({getattr(e, 'reason', None) or e.strerror}); the folder is damaged (copy it again)") from e
    except json.JSONDecodeError as e:
        raise SurgeryError(f"{file} is malformed JSON ({e.msg} at line {e.lineno}); the folder is damaged") from e
    if not isinstance(doc, dict):
        raise SurgeryError(f"{file} must hold a JSON object")
    return doc


def read_shift_config(path: str | Path) -> ShiftSpec:
    """The validated :class:`ShiftSpec` of a saved folder."""
    file = Path(path).expanduser() / SHIFT_CONFIG
    return ShiftSpec.from_dict(read_json(file), file)


def _rebuild_from_base(path: Path, spec: ShiftSpec, dtype, trust: bool = False, accept_other_base: bool = False):
    """The pruned model of an adapter-only folder (``trust``: the user's own trust_remote_code flag only)."""
    from .models import ModelConfig, load_model
    from .remote_code import base_model_settings, load_tokenizer

    try:
        base = ModelConfig(**base_model_settings(spec.base_model, trust))
    except TypeError as e:
        raise SurgeryError(f"{path / SHIFT_CONFIG}: bad base_model {spec.base_model!r}: {e}") from e
    if dtype is not None:
        base = ModelConfig(**{**base.__dict__, "dtype": str(dtype).replace("torch.", "")})
    model, tokenizer = load_model(base)
    if spec.base_fingerprint is not None and not accept_other_base:
        from .outputs.fingerprints import weights_fingerprint

        now = weights_fingerprint(model)
        if now != spec.base_fingerprint:
            raise SurgeryError(f"{path}: its maps were fitted on a base model with other weights than "
                               f"{base.name_or_path!r} holds now (fingerprint {spec.base_fingerprint}, now {now}): the "
                               "maps would not fit it. Restore that base, or pass accept_other_base=True to "
                               "load_pretrained to load them anyway")
    n = len(decoder_layers(model))
    if n != spec.original_num_layers:
        raise SurgeryError(f"{path / SHIFT_CONFIG}: the base model {base.name_or_path!r} has {n} blocks, the record "
                           f"says {spec.original_num_layers}")
    dim = model.config.hidden_size
    for a in spec.adapters:
        if any(not isinstance(sp, dict) or sp.get("dim") != dim for sp in a["chain"]):
            raise SurgeryError(f"{path / SHIFT_CONFIG}: adapter at position {a['position']} does not match the base "
                               f"model's hidden size {dim}")
    remove_blocks(model, spec.pruned_layers)
    if (path / "tokenizer_config.json").exists():
        tokenizer = load_tokenizer(path, trust)
    return model, tokenizer


def _check_against_config(path: Path, spec: ShiftSpec) -> None:
    cfg = read_json(path / "config.json")
    depth = cfg.get("num_hidden_layers", cfg.get("text_config", {}).get("num_hidden_layers"))
    dim = cfg.get("hidden_size", cfg.get("text_config", {}).get("hidden_size"))
    if depth != spec.num_layers:
        raise SurgeryError(f"{path / 'config.json'}: num_hidden_layers is {depth}, but {SHIFT_CONFIG} records "
                           f"{spec.original_num_layers} blocks minus {len(spec.pruned_layers)} pruned = {spec.num_layers}")
    for a in spec.adapters:
        if not 0 <= a["position"] <= spec.num_layers:
            raise SurgeryError(f"{path / SHIFT_CONFIG}: adapter position {a['position']} outside 0..{spec.num_layers}")
        for s in a["chain"]:
            if not isinstance(s, dict) or s.get("dim") != dim:
                raise SurgeryError(f"{path / SHIFT_CONFIG}: adapter at position {a['position']} has dim "
                                   f"{s.get('dim') if isinstance(s, dict) else s!r}, the model's hidden size is {dim}")


def load_pretrained(source, dtype: str | torch.dtype | None = None, device=None, accept_other_base: bool = False):
    """Load ``(model, tokenizer)``: a saved folder with its adapters in place (see the module doc),
    or, unpruned, anything :func:`~shift_lightning.models.load_model` accepts (an HF id or folder, a
    ``.gguf``, an embedded name such as ``smollm2-135m``, or a ``ModelConfig``). An adapter-only folder is refused
    when its base now holds other weights than the maps were fitted on (``accept_other_base``: load anyway)."""
    from .models import ModelConfig, load_model

    cfg = source if isinstance(source, ModelConfig) else ModelConfig(name_or_path=str(source))
    if cfg.tiny is not None or not is_shift_folder(cfg.name_or_path):
        if dtype is not None:
            cfg = ModelConfig(**{**cfg.__dict__, "dtype": str(dtype).replace("torch.", "")})
        model, tokenizer = load_model(cfg)
        return (model.to(device) if device is not None else model), tokenizer
    if dtype is None and isinstance(source, ModelConfig):
        dtype = cfg.dtype
    return _load_shift_folder(Path(cfg.name_or_path).expanduser(), dtype, device, cfg.trust_remote_code,
                              accept_other_base)


def _read_weights(path: Path, spec: ShiftSpec) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    wfile = path / LRA_WEIGHTS
    listed = {str(a["position"]) for a in spec.adapters}
    try:
        with safe_open(str(wfile), framework="pt") as f:
            keys = list(f.keys())
            present = {k.split(".", 1)[0] for k in keys if not k.startswith(("branch.", "kept.", "fold."))}
            held_folds = {k.rsplit(".", 1)[0] for k in keys if k.startswith("fold.")}
            if held_folds != _fold_names(spec):
                raise SurgeryError(f"{wfile} holds folded maps {sorted(held_folds)} but {SHIFT_CONFIG} lists "
                                   f"{sorted(_fold_names(spec))}: refusing to load a model whose weights do not match "
                                   "its record")
            held_branches = {int(k.split(".")[1]) for k in keys if k.startswith("branch.")}
            held_kept = {int(k.split(".")[1]) for k in keys if k.startswith("kept.")}
            want_kept = set(spec.refit_blocks or []) if spec.weights == "adapters" else set()
            if held_kept != want_kept:
                raise SurgeryError(f"{wfile} holds re-fitted weights of kept blocks {sorted(held_kept)} but "
                                   f"{SHIFT_CONFIG} expects {sorted(want_kept)}: refusing to load a model whose "
                                   "weights do not match its record")
            if held_branches != {b["block"] for b in spec.branch_maps}:
                raise SurgeryError(f"{wfile} holds MLP-branch maps for blocks {sorted(held_branches)} but "
                                   f"{SHIFT_CONFIG} lists {sorted(b['block'] for b in spec.branch_maps)}")
            if present != listed:
                raise SurgeryError(
                    f"{wfile} holds adapters at positions {sorted(present, key=int)} but {SHIFT_CONFIG} lists "
                    f"{sorted(listed, key=int)}: refusing to load a model whose corrections do not match its record")
            weights = {k: f.get_tensor(k) for k in keys}
    except SurgeryError:
        raise
    except Exception as e:  # missing or truncated safetensors
        raise SurgeryError(f"Cannot read {wfile}: {e}") from e
    bad = [k for k, t in weights.items() if not torch.isfinite(t).all()]
    if bad:
        raise SurgeryError(f"{wfile}: non-finite adapter weights in {bad[:3]}; the folder is damaged")
    return weights


def _load_shift_folder(path: Path, dtype, device, trust: bool = False, accept_other_base: bool = False):
    spec = read_shift_config(path)
    adapter_only = spec.weights == "adapters"
    if not adapter_only:
        _check_against_config(path, spec)
        check_model_config(path)
    weights = _read_weights(path, spec)
    if adapter_only:
        model, tokenizer = _rebuild_from_base(path, spec, dtype, trust, accept_other_base)
    else:
        model, tokenizer = _load_full_folder(path, dtype, trust)
    attach_adapters(model, _adapters(path, spec, weights, next(model.parameters()).dtype))
    _fold_maps(model, path, spec, weights, adapter_only)
    if adapter_only:  # last: a re-fitted block's weights are final (a map folded into it before the re-fit)
        try:
            put_kept_tensors(model, {k: t for k, t in weights.items() if k.startswith("kept.")})
        except KeptFitError as e:
            raise SurgeryError(f"{path / LRA_WEIGHTS}: {e}") from e
    if device is not None:
        model.to(device)
    model.eval()
    return model, tokenizer


def _load_full_folder(path: Path, dtype, trust: bool):
    """A folder with the pruned model's weights: ``(model, tokenizer)`` through transformers, its checks first."""
    from transformers import AutoModelForCausalLM
    from .remote_code import is_marked, load_tokenizer, plain_config

    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    files = check_safetensors_files(path)
    if not any(f.name != LRA_WEIGHTS for f in files.values()):
        found = pickles_in(path)
        raise SurgeryError(f"{path} holds no model.safetensors{f' (only {found}, which is never unpickled)' if found else ''}"
                           "; the folder is damaged")
    doc = read_json(path / "config.json")  # a marked folder: its stock config, none of its code
    config = plain_config(doc) if is_marked(doc) else None
    check_weight_shapes(path, files, config)  # an edited config.json: named before transformers re-initialises
    with refusing_pickles(path):
        model = AutoModelForCausalLM.from_pretrained(path, config=config, dtype=dtype or "auto",
                                                     trust_remote_code=False, use_safetensors=True)
    check_finite(model, path, files)
    tokenizer = load_tokenizer(path, trust, **({"config": config} if config is not None else {})) \
        if (path / "tokenizer_config.json").exists() else None
    return model, tokenizer


def _adapters(path: Path, spec, weights: dict, dtype) -> dict[int, nn.Module]:
    """The folder's adapters (pruned position -> module), built from their specs and loaded strictly."""
    adapters = {}
    for entry in spec.adapters:
        try:
            chain = [LinearResidualAdapter(AdapterSpec(**s), dtype=dtype) for s in entry["chain"]]
        except (TypeError, ValueError) as e:
            raise SurgeryError(f"{path / SHIFT_CONFIG}: bad adapter spec at position {entry['position']}: {e}") from e
        mod = chain[0] if len(chain) == 1 else nn.Sequential(*chain)
        key = str(entry["position"])
        sd = {k[len(key) + 1:]: v for k, v in weights.items() if k.startswith(key + ".")}
        try:
            mod.load_state_dict(sd, strict=True)
        except RuntimeError as e:
            raise SurgeryError(f"{path / LRA_WEIGHTS}: adapter at position {key} does not match its spec: {e}") from e
        adapters[entry["position"]] = mod
    return adapters


def _fold_maps(model, path: Path, spec, weights: dict, adapter_only: bool) -> None:
    """The maps stored apart from the weights folded in: ReplaceMe's branch maps (Gemma3's, after a post-MLP norm;
    any in an adapter-only folder) and, in an adapter-only folder, the stock repair exactly as in memory."""
    blocks = decoder_layers(model)
    for b in spec.branch_maps:
        i = b["block"]
        post_norm = 0 <= i < len(blocks) and hasattr(blocks[i], "post_feedforward_layernorm")
        if not 0 <= i < len(blocks) or (not post_norm and not adapter_only):
            raise SurgeryError(f"{path / SHIFT_CONFIG}: MLP-branch map for block {i}, which has no post-MLP norm")
        fold_replaceme(blocks[i], weights[f"branch.{i}.weight"].to(torch.float64).T)
    for f in spec.folds:
        if f["into"] == "embedding":
            fold_embedding(model, weights["fold.embedding.weight"], weights["fold.embedding.bias"])
        elif 0 <= f["block"] < len(blocks):
            fold_down(model, blocks[f["block"]], weights[f"fold.down.{f['block']}.weight"],
                      weights[f"fold.down.{f['block']}.bias"])
        else:
            raise SurgeryError(f"{path / SHIFT_CONFIG}: a folded down_proj map for block {f['block']}, which the pruned "
                               f"model ({len(blocks)} blocks) does not have")
