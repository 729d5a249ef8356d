"""Weight files are checked around every load: nothing silently wrong, nothing unpickled. Framework-free.

* :func:`check_safetensors_files` reads only the headers of a folder's ``*.safetensors`` files
  (microseconds a file) and refuses one that is cut short or damaged, naming it, before
  ``from_pretrained`` fails somewhere inside with a bare ``SafetensorError``;
* :func:`refusing_pickles` turns the refusal of a pickle of Python objects (a planted
  ``pytorch_model.bin``: ``torch.load(weights_only=True)`` refuses it) into one error naming the file;
* :func:`check_finite` refuses a loaded model with a NaN or an infinity in any parameter, naming the
  tensor and the file that holds it (one pass over the weights, in chunks: seconds for 8B
  parameters, next to the minutes the load itself takes).
"""

from __future__ import annotations

import contextlib
import json
import pickle
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from .arch import ModelLoadError

PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".ckpt")
_CHUNK = 1 << 24


_ITEMSIZE = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "F8_E8M0": 1,
             "I64": 8, "U64": 8, "I32": 4, "U32": 4, "I16": 2, "U16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_FLOAT = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2", "F8_E8M0"}


def _check_layout(path: Path, meta: dict, float_only: bool, fix: str) -> None:
    """Each tensor's dtype, shape and byte range agree, and no two ranges overlap; in an unquantized
    model every tensor is floating point (an integer dtype there would load as garbage)."""
    spans = []
    for k, v in meta.items():
        if k == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = v["dtype"], [int(d) for d in v["shape"]], map(int, v["data_offsets"])
        except (TypeError, KeyError, ValueError) as e:
            raise ModelLoadError(f"{path} is damaged (tensor {k}: {e}); {fix}") from None
        if dtype not in _ITEMSIZE:
            raise ModelLoadError(f"{path} is damaged (tensor {k} has unknown dtype {dtype!r}); {fix}")
        numel = 1
        for d in shape:
            numel *= d
        if start < 0 or end - start != numel * _ITEMSIZE[dtype]:
            raise ModelLoadError(f"{path} is damaged (tensor {k}: {dtype} {shape} needs {numel * _ITEMSIZE[dtype]:,} "
                                 f"bytes, its header gives {end - start:,}); {fix}")
        if float_only and dtype not in _FLOAT:
            raise ModelLoadError(f"{path} is damaged: tensor {k} is stored as {dtype}, but the model is not quantized "
                                 f"(no quantization_config) and its weights are floating point; {fix}")
        spans.append((start, end, k))
    spans.sort()
    for (s0, e0, k0), (s1, e1, k1) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ModelLoadError(f"{path} is damaged: tensors {k0} and {k1} overlap in the file; {fix}")


def _check_one(path: Path, float_only: bool = False) -> list[str]:
    size = path.stat().st_size
    fix = "download or copy it again"
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 2 or 8 + n > size:
            raise ModelLoadError(f"{path} is truncated or not a safetensors file ({size:,} bytes; its header cannot be "
                                 f"read); {fix}")
        try:
            meta = json.loads(f.read(n))
            ends = [int(v["data_offsets"][1]) for k, v in meta.items() if k != "__metadata__"]
        except (ValueError, TypeError, KeyError, IndexError, AttributeError) as e:
            raise ModelLoadError(f"{path} is damaged (its header is not a safetensors header: {e}); {fix}") from None
    _check_layout(path, meta, float_only, fix)
    need = 8 + n + max(ends, default=0)
    if need > size:
        raise ModelLoadError(f"{path} is truncated: its tensors need {need:,} bytes, the file has {size:,}; {fix}")
    return [k for k in meta if k != "__metadata__"]


def check_safetensors_files(folder: str | Path) -> dict[str, Path]:
    """Refuse cut or damaged ``*.safetensors`` files in ``folder`` (headers only); tensor name -> file."""
    where: dict[str, Path] = {}
    folder = Path(folder)
    if folder.is_dir():
        try:
            quantized = "quantization_config" in json.loads((folder / "config.json").read_text())
        except (OSError, ValueError, TypeError):
            quantized = True  # unknown: no dtype rule
        for f in sorted(folder.glob("*.safetensors")):
            for key in _check_one(f, float_only=not quantized):
                where[key] = f
    return where


def check_weight_shapes(folder: str | Path, files: dict[str, Path], config=None) -> None:
    """Refuse a folder whose ``config.json`` does not match its weights (an edited ``vocab_size``, another model's
    config), naming the first tensor and both shapes, before transformers loads (and re-initialises) anything. The
    model of the config is built on the meta device (no memory); ``config``: the one to load with (default: the
    folder's)."""
    if not files:
        return
    from accelerate import init_empty_weights
    from transformers import AutoConfig, AutoModelForCausalLM

    folder = Path(folder)
    try:
        config = config or AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
        with init_empty_weights():
            want = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
    except Exception:  # what the config cannot build is for the loader to report
        return
    from safetensors import safe_open

    for name, path in sorted(files.items()):
        if name not in want or path.name == "lra.safetensors":
            continue
        with safe_open(str(path), framework="pt") as f:
            have = tuple(f.get_slice(name).get_shape())
        if have != want[name]:
            raise ModelLoadError(f"{folder}: config.json does not match the weights: {name} is stored as "
                                 f"{' × '.join(map(str, have))}, the config makes it {' × '.join(map(str, want[name]))}; "
                                 "the config was edited or belongs to another model: restore the folder's own "
                                 "config.json")


def pickles_in(folder: str | Path) -> list[str]:
    folder = Path(folder)
    return sorted(p.name for p in folder.iterdir() if p.suffix in PICKLE_SUFFIXES) if folder.is_dir() else []


@contextlib.contextmanager
def refusing_pickles(folder: str | Path) -> Iterator[None]:
    """One error naming the file when loading ``folder`` would have to unpickle Python objects."""
    try:
        yield
    except pickle.UnpicklingError:
        found = pickles_in(folder)
        what = str(Path(folder) / found[0]) if len(found) == 1 else f"{folder} ({', '.join(found) or 'a weight file'})"
        raise ModelLoadError(f"{what} cannot be loaded as plain tensors: it holds Python objects that would have to be "
                             "unpickled, which shift-lightning never does; use a safetensors copy of the model") from None


def check_finite(model: nn.Module, source: str | Path, files: dict[str, Path] | None = None) -> None:
    """Refuse a model with a non-finite parameter, naming the tensors (and the files holding them)."""
    bad = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.is_floating_point() or p.device.type == "meta":
                continue
            flat = p.detach().reshape(-1)
            if not all(bool(torch.isfinite(c).all()) for c in flat.split(_CHUNK)):
                bad.append(name)
    if bad:
        held = sorted({files[n].name for n in bad if files and n in files})
        raise ModelLoadError(f"{source}: non-finite weights (NaN or infinity) in {bad[:3]}"
                             f"{f' and {len(bad) - 3} more' if len(bad) > 3 else ''}"
                             f"{f' (in {held[0]})' if len(held) == 1 else f' (in {held})' if held else ''}; "
                             "the weights are damaged, refusing to load them")


def check_model_config(folder: str | Path) -> None:
    """A local model folder's ``config.json`` exists, is a JSON object and names a ``model_type`` this
    transformers knows (a marked ``shift_<type>`` one needs its ``shift_config.json``); hub ids pass."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        return
    cfg = folder / "config.json"
    if not cfg.is_file():
        raise ModelLoadError(f"{folder} has no config.json: it is not a model folder, or it is damaged (copy it again)")
    try:
        doc = json.loads(cfg.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelLoadError(f"{cfg} is malformed JSON ({e}); the folder is damaged (copy it again)") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("model_type"), str):
        raise ModelLoadError(f"{cfg} names no model_type; the folder is damaged (copy it again)")
    from transformers import CONFIG_MAPPING

    from .remote_code import MODEL_TYPE_PREFIX

    mt = doc["model_type"]
    if mt.startswith(MODEL_TYPE_PREFIX) and not (folder / "shift_config.json").is_file():
        raise ModelLoadError(f"{folder} is a shift-lightning folder (model_type {mt}) without its shift_config.json; "
                             "the folder is damaged (copy it again)")
    base = mt[len(MODEL_TYPE_PREFIX):] if mt.startswith(MODEL_TYPE_PREFIX) else mt
    if base not in CONFIG_MAPPING and (base != mt or "auto_map" not in doc):
        raise ModelLoadError(f"{cfg}: model_type {mt!r} is not one this transformers knows; check the folder, or "
                             "upgrade transformers")
    check_vocab(folder)


def check_vocab(folder: str | Path) -> None:
    """The special token ids of ``config.json`` fit the model's vocabulary (a damaged or mismatched config
    would otherwise fail inside the model's construction)."""
    try:
        doc = json.loads((Path(folder).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return
    doc = doc.get("text_config", doc) if isinstance(doc.get("text_config"), dict) and "vocab_size" not in doc else doc
    vocab = doc.get("vocab_size")
    if not isinstance(vocab, int):
        return
    ids = {k: doc.get(k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
    bad = {k: v for k, v in ids.items() if isinstance(v, int) and not 0 <= v < vocab}
    if bad:  # (the tokenizer's length is not compared: some tokenizers list ids the embedding does not hold)
        what = ", ".join(f"{k} {v}" for k, v in bad.items())
        raise ModelLoadError(f"{folder}: {what} do not fit the model's vocabulary (vocab_size {vocab} in config.json); "
                             "the tokenizer and the model do not belong together, or config.json is damaged")
