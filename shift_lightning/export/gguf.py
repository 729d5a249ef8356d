"""Export a stock pruned folder to GGUF with llama.cpp's own converter, and check its layer metadata.

A folder without adapters (pruned and not repaired, or repaired with ``--calibration.solver stock``
where the family has it) is a plain Hugging Face folder: ``config.json`` with a stock ``model_type``
(``llama``, …), ``model.safetensors`` and the tokenizer; ``shift_config.json``, ``README.md`` and an
empty ``lra.safetensors`` sit beside them and change nothing (llama.cpp's converter reads only
``model*.safetensors``; it takes the card's license and tags as GGUF metadata). :func:`export_gguf`
runs ``convert_hf_to_gguf.py`` of a llama.cpp checkout (by default the one vendored in the
``llama-cpp-python`` sdist, fetched once into the cache) on it, with that checkout's own ``gguf-py``:

    python -m shift_lightning.recipes.gguf --model outputs/pruned --out pruned-q8_0.gguf --outtype q8_0

and then reads the file back (:func:`check_layer_metadata`): ``<arch>.block_count`` must equal the
folder's ``num_hidden_layers``, the ``blk.N.*`` tensors must exist for exactly ``N < block_count``,
and every per-layer array in the metadata must hold ``block_count`` entries. A GGUF whose metadata
still describes the unpruned depth (the layer-pruning metadata bug) is refused, naming the file.

Sliding-window families (Gemma2, Gemma3): the converter writes no per-layer attention pattern, and
llama.cpp's loader then assumes the unpruned model's fixed one (every 6th block full attention for
Gemma3), which is wrong once blocks are removed across it. Where the folder's ``layer_types`` differs
from what llama.cpp would run, the export writes the folder's pattern into the file
(``<arch>.attention.sliding_window_pattern``, one bool per block: :func:`rewrite_metadata`),
the array those loaders read first; the check then confirms every block gets the folder's attention.

The tokenizer: the converter names llama.cpp's pre-tokenizer (``tokenizer.ggml.pre``) by hashing the folder
tokenizer's ids on one fixed text, which cannot tell every difference apart. Where the folder splits text with
GPT-2's regex alone and the converter named a pre-tokenizer llama.cpp runs otherwise, the export names GPT-2's
(:func:`pre_tokenizer_to_write`), so that llama.cpp's own tokenizer gives the folder's ids.

A *marked* folder (``model_type: shift_<family>``, adapters or ReplaceMe maps, see
:mod:`shift_lightning.remote_code`) is refused: llama.cpp cannot run the adapters.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ConfigError, ShiftError
from .gguf_converter import GGUFError, check_converter_deps, find_converter, run_converter  # noqa: F401 (GGUFError: user-facing)

#: The output types this export supports (llama.cpp's converter writes them without a quantize binary).
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
#: Per-layer hyper-parameters llama.cpp reads as "a scalar or one value per layer" (``get_key_or_arr``) or
#: as a per-layer array (the sliding-window pattern); suffixes after ``<arch>.``.
PER_LAYER_KEYS = ("feed_forward_length", "attention.head_count", "attention.head_count_kv",
                  "expert_feed_forward_length", "expert_used_count", "attention.sliding_window_pattern",
                  "xielu.alpha_n", "xielu.alpha_p", "xielu.beta", "xielu.eps", "swiglu_clamp_exp",
                  "swiglu_clamp_shexp")
#: Architectures whose llama.cpp loader, without a per-layer ``<arch>.attention.sliding_window_pattern`` array in the
#: file, assumes a fixed pattern (``load_swa_pattern(ml, n, dense_first)`` in llama.cpp's ``src/models/<arch>.cpp``):
#: block ``i`` is full attention when ``i % n == n - 1`` (``dense_first``: when ``i % n == 0``).
SWA_DEFAULTS = {"gemma3": (6, False), "gemma2": (2, False)}
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
#: ``tokenizer.ggml.pre`` names llama.cpp runs with GPT-2's regex alone (``LLAMA_VOCAB_PRE_TYPE_GPT2`` in its
#: ``src/llama-vocab.cpp``).
GPT2_PRE = ("gpt-2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
            "modern-bert")


# --------------------------------------------------------------------------------------------
# The folder and the options
# --------------------------------------------------------------------------------------------
def check_outtype(outtype: str) -> str:
    if outtype not in OUTTYPES:
        raise ConfigError(f"--outtype {outtype!r} is not supported; choose one of {', '.join(OUTTYPES)} "
                          "(other quantisations: run llama.cpp's llama-quantize on the f16 file)")
    return outtype


def check_folder(folder: str | Path) -> dict:
    """The folder's ``config.json`` if it is a stock HF folder llama.cpp can convert; one line naming
    the fix otherwise (a marked folder, an adapter-only folder, missing weights or tokenizer)."""
    from ..remote_code import is_marked

    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise GGUFError(f"--model {folder} is not a folder; give a saved model folder (config.json, "
                        "model.safetensors, the tokenizer)")
    shift_cfg = folder / "shift_config.json"
    spec = {}
    if shift_cfg.is_file():
        try:
            spec = json.loads(shift_cfg.read_text())
        except (OSError, ValueError) as e:
            raise GGUFError(f"{shift_cfg} cannot be read ({e}); the folder is damaged") from None
        spec = spec if isinstance(spec, dict) else {}
    if spec.get("weights") == "adapters":
        raise GGUFError(f"{folder} is an adapter-only folder (no model weights); write a full folder first "
                        "(shift_lightning.load_pretrained, then save_pretrained) or export the folder it was made from")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise GGUFError(f"{folder} has no config.json; give a Hugging Face model folder")
    try:
        doc = json.loads(cfg_file.read_text())
    except (OSError, ValueError) as e:
        raise GGUFError(f"{cfg_file} cannot be read as JSON ({e}); the folder is damaged") from None
    if not isinstance(doc, dict):
        raise GGUFError(f"{cfg_file} does not hold a JSON object; the folder is damaged")
    if is_marked(doc) or "auto_map" in doc or spec.get("adapters") or spec.get("branch_maps"):
        raise GGUFError(
            f"{folder} carries adapters (config.json model_type {doc.get('model_type')!r}, needs trust_remote_code): "
            "llama.cpp cannot run them; for a GGUF recalibrate with --calibration.solver stock (Llama-layout "
            "families) or prune without repair (shift_lightning.maps.surgery.remove_blocks, then save_pretrained)")
    if not isinstance(doc.get("num_hidden_layers"), int):
        raise GGUFError(f"{cfg_file} has no integer num_hidden_layers; give a decoder-only causal LM folder")
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        raise GGUFError(f"{folder} has no tokenizer ({' or '.join(_TOKENIZER_FILES)}); save the tokenizer "
                        "with the model (save_pretrained(model, tokenizer, …)) and export again")
    if not any(folder.glob("model*.safetensors")):
        raise GGUFError(f"{folder} has no model*.safetensors; give a folder with the model's weights")
    return doc


def _check_outfile(outfile: Path, overwrite: bool) -> None:
    from ..outputs import check_writable

    if outfile.is_dir():
        raise GGUFError(f"--out {outfile} is a folder; name the .gguf file to write")
    if outfile.exists() and not overwrite:
        raise GGUFError(f"--out {outfile} exists; choose another file or pass --overwrite to replace it")
    check_writable(outfile, "choose another --out")


# --------------------------------------------------------------------------------------------
# The layer metadata
# --------------------------------------------------------------------------------------------
@dataclass
class GGUFSummary:
    """What :func:`check_layer_metadata` read from a GGUF file."""

    path: Path
    arch: str
    block_count: int
    tensors: int
    blocks_with_tensors: list[int]
    per_layer: dict[str, int] = field(default_factory=dict)
    """Per-layer array keys and their lengths."""
    file_type: int | None = None


_BLK = re.compile(r"^blk\.(\d+)\.")


def check_layer_metadata(path: str | Path, num_layers: int, original_num_layers: int | None = None,
                         layer_types: list[str] | None = None) -> GGUFSummary:
    """Read ``path`` and refuse it, naming the file, unless ``<arch>.block_count == num_layers``, the
    ``blk.N.*`` tensors exist for exactly ``N < num_layers``, every per-layer metadata array
    (:data:`PER_LAYER_KEYS`, or any ``<arch>.*`` array as long as the unpruned depth
    ``original_num_layers``) holds ``num_layers`` entries, and, given the folder's ``layer_types``
    (``config.json``), the sliding / full attention llama.cpp will run each block with is the folder's
    (the file's per-layer pattern, or the fixed one llama.cpp assumes without it: :data:`SWA_DEFAULTS`)."""
    from gguf import GGUFReader, GGUFValueType

    path = Path(path)
    try:
        reader = GGUFReader(str(path))
    except Exception as e:
        raise GGUFError(f"{path} cannot be read as GGUF ({type(e).__name__}: {e})") from None
    arch_field = reader.fields.get("general.architecture")
    if arch_field is None:
        raise GGUFError(f"{path} has no general.architecture; it is not a model GGUF")
    arch = str(arch_field.contents())
    bc_field = reader.fields.get(f"{arch}.block_count")
    if bc_field is None:
        raise GGUFError(f"{path} has no {arch}.block_count; llama.cpp cannot load it")
    block_count = int(bc_field.contents())
    if block_count != num_layers:
        raise GGUFError(f"{path}: {arch}.block_count is {block_count} but the model has {num_layers} blocks "
                        "(config.json num_hidden_layers): the GGUF's layer metadata is wrong; do not use it")
    blocks = sorted({int(m.group(1)) for t in reader.tensors if (m := _BLK.match(t.name))})
    if blocks != list(range(num_layers)):
        missing = sorted(set(range(num_layers)) - set(blocks))
        extra = sorted(set(blocks) - set(range(num_layers)))
        raise GGUFError(f"{path}: tensors blk.N.* exist for blocks {_ranges(blocks)} but {arch}.block_count is "
                        f"{num_layers}" + (f" (missing {_ranges(missing)})" if missing else "")
                        + (f" (beyond the last block: {_ranges(extra)})" if extra else "")
                        + ": the GGUF's layers do not match its metadata; do not use it")
    per_layer = {}
    for key, f in reader.fields.items():
        if not key.startswith(arch + ".") or not f.types or f.types[0] != GGUFValueType.ARRAY:
            continue
        n = len(f.data)
        suffix = key[len(arch) + 1:]
        if suffix in PER_LAYER_KEYS or (original_num_layers is not None and original_num_layers != num_layers
                                        and n == original_num_layers):
            per_layer[key] = n
            if n != num_layers:
                raise GGUFError(f"{path}: the per-layer metadata {key} has {n} entries but {arch}.block_count is "
                                f"{num_layers}: the GGUF's layer metadata is wrong; do not use it")
    if layer_types is not None:
        _check_attention_pattern(path, reader, arch, num_layers, layer_types)
    ft = reader.fields.get("general.file_type")
    return GGUFSummary(path, arch, block_count, len(reader.tensors), blocks, per_layer,
                       int(ft.contents()) if ft is not None else None)


def attention_pattern_llama_cpp_runs(reader, arch: str, num_layers: int) -> tuple[list[bool], str] | None:
    """Which blocks llama.cpp will run with sliding-window attention (True) for the GGUF ``reader`` reads, and
    where that comes from: the file's per-layer ``<arch>.attention.sliding_window_pattern``, else the fixed
    pattern the arch's loader assumes (:data:`SWA_DEFAULTS`); None for an arch whose default is not known here."""
    from gguf import GGUFValueType

    f = reader.fields.get(f"{arch}.attention.sliding_window_pattern")
    if f is not None and f.types and f.types[0] == GGUFValueType.ARRAY:
        return [bool(x) for x in f.contents()], "its per-layer sliding_window_pattern"
    if arch not in SWA_DEFAULTS:
        return None
    n, dense_first = SWA_DEFAULTS[arch]
    if f is not None:
        n = int(f.contents())
    sw = reader.fields.get(f"{arch}.attention.sliding_window")
    if sw is None or int(sw.contents()) == 0:
        return [False] * num_layers, f"no {arch}.attention.sliding_window (every block full attention)"
    return ([n == 0 or (i % n != 0 if dense_first else i % n < n - 1) for i in range(num_layers)],
            f"no per-layer pattern: llama.cpp's {arch} loader assumes every {n}th block full attention "
            "(the unpruned model's pattern)")


def _check_attention_pattern(path: Path, reader, arch: str, num_layers: int, layer_types: list[str]) -> None:
    if len(layer_types) != num_layers:
        raise GGUFError(f"config.json layer_types has {len(layer_types)} entries for {num_layers} blocks; the folder "
                        "is inconsistent")
    want = [t == "sliding_attention" for t in layer_types]
    if not any(want):
        return
    runs = attention_pattern_llama_cpp_runs(reader, arch, num_layers)
    if runs is None:
        return  # an architecture whose default pattern is not known here: not checked
    got, how = runs
    wrong = [i for i in range(num_layers) if got[i] != want[i]]
    if wrong:
        raise GGUFError(f"{path}: llama.cpp would run blocks {_ranges(wrong)} with the wrong attention (sliding vs full) "
                        f"for this pruned model: config.json layer_types differs from what the GGUF says ({how}); "
                        "the GGUF's layer metadata is wrong; do not use it (export the folder with python -m "
                        "shift_lightning.recipes.gguf, which writes the folder's per-layer pattern)")


def rewrite_metadata(src: str | Path, dst: str | Path, layer_types: list[str] | None = None,
                     pre: str | None = None) -> None:
    """Copy the GGUF ``src`` to ``dst`` with, where given, ``<arch>.attention.sliding_window_pattern`` set to the
    folder's per-layer pattern (``layer_types``: True where a block is sliding-window attention; the array llama.cpp's
    Gemma2/Gemma3 loaders read before falling back to their fixed every-nth pattern) and ``tokenizer.ggml.pre`` set
    to ``pre`` (:func:`pre_tokenizer_to_write`). Every other key and every tensor is copied unchanged."""
    from gguf import GGUFReader, GGUFValueType, GGUFWriter

    reader = GGUFReader(str(src))
    arch = str(reader.fields["general.architecture"].contents())
    key = f"{arch}.attention.sliding_window_pattern"
    replaced = {"general.architecture"} | ({key} if layer_types is not None else set()) \
        | ({"tokenizer.ggml.pre"} if pre is not None else set())
    writer = GGUFWriter(str(dst), arch, endianess=reader.endianess)
    for f in reader.fields.values():
        # the writer adds general.architecture and the GGUF.* header fields itself
        if f.name in replaced or f.name.startswith("GGUF."):
            continue
        vtype = f.types[0]
        writer.add_key_value(f.name, f.contents(), vtype,
                             sub_type=f.types[-1] if vtype == GGUFValueType.ARRAY else None)
    if layer_types is not None:
        writer.add_array(key, [t == "sliding_attention" for t in layer_types])
    if pre is not None:
        writer.add_tokenizer_pre(pre)
    for t in reader.tensors:
        writer.add_tensor_info(t.name, t.data.shape, t.data.dtype, t.data.nbytes, t.tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for t in reader.tensors:
        writer.write_tensor_data(t.data, tensor_endianess=reader.endianess)
    writer.close()


def pre_tokenizer_to_write(folder: Path, path: Path) -> str | None:
    """``"gpt-2"`` where the folder's ``tokenizer.json`` splits text with GPT-2's regex alone (a bare ``ByteLevel``
    pre-tokenizer) but the converter named a pre-tokenizer that llama.cpp runs differently; else None.

    The converter recognises a tokenizer by hashing its ids on one fixed text, and that text cannot tell a
    digit-splitting pre-tokenizer from GPT-2's where digits have no merges: SmolLM2's tokenizer as transformers
    rebuilds it from a GGUF (a bare ``ByteLevel``) hashes as ``smollm``, whose llama.cpp regex first splits off
    every digit, so a blank line before ``0.`` became one token in llama.cpp and two in transformers. The folder's
    tokenizer is what was calibrated and evaluated; the GGUF is made to tokenize as it does."""
    from gguf import GGUFReader

    try:
        pre_tok = json.loads((folder / "tokenizer.json").read_text()).get("pre_tokenizer")
    except (OSError, ValueError):
        return None
    if not (isinstance(pre_tok, dict) and pre_tok.get("type") == "ByteLevel" and pre_tok.get("use_regex", True)):
        return None
    f = GGUFReader(str(path)).fields.get("tokenizer.ggml.pre")
    got = str(f.contents()) if f is not None else None
    return None if got is None or got in GPT2_PRE else "gpt-2"


def _pattern_to_write(path: Path, num_layers: int, layer_types) -> bool:
    """Whether llama.cpp would run the converter's file with another attention pattern than the folder's
    (an arch of :data:`SWA_DEFAULTS` pruned across its every-nth pattern)."""
    from gguf import GGUFReader

    if not isinstance(layer_types, list) or len(layer_types) != num_layers \
            or "sliding_attention" not in layer_types:
        return False
    reader = GGUFReader(str(path))
    arch = str(reader.fields["general.architecture"].contents()) if "general.architecture" in reader.fields else ""
    if arch not in SWA_DEFAULTS:
        return False
    runs = attention_pattern_llama_cpp_runs(reader, arch, num_layers)
    return runs is not None and runs[0] != [t == "sliding_attention" for t in layer_types]


def _ranges(ids: list[int]) -> str:
    if not ids:
        return "none"
    out, start, prev = [], ids[0], ids[0]
    for i in ids[1:] + [None]:
        if i is not None and i == prev + 1:
            prev = i
            continue
        out.append(f"{start}" if start == prev else f"{start}-{prev}")
        if i is not None:
            start = prev = i
    return ", ".join(out)


# --------------------------------------------------------------------------------------------
# The export
# --------------------------------------------------------------------------------------------
def export_gguf(folder: str | Path, outfile: str | Path, outtype: str = "f16", llama_cpp: str | Path | None = None,
                overwrite: bool = False) -> Path:
    """Convert the stock HF ``folder`` to ``outfile`` (``outtype``: f32, f16, bf16 or q8_0) with llama.cpp's
    ``convert_hf_to_gguf.py`` (``llama_cpp``: a llama.cpp checkout; default: the converter vendored in
    llama-cpp-python's sdist, cached), write the folder's per-layer attention pattern where llama.cpp would
    otherwise assume another and GPT-2's pre-tokenizer where the converter named another
    (:func:`rewrite_metadata`), check the written file's layer metadata
    against the folder and publish it atomically. Returns ``outfile``. Never replaces an existing file unless ``overwrite``."""
    from ..outputs import is_write_failure, publish_file, write_failure_reason

    check_outtype(outtype)
    folder = Path(folder).expanduser()
    outfile = Path(outfile).expanduser()
    doc = check_folder(folder)
    _check_outfile(outfile, overwrite)
    checkout = find_converter(llama_cpp)
    check_converter_deps()
    original = None
    try:
        original = json.loads((folder / "shift_config.json").read_text()).get("original_num_layers")
    except (OSError, ValueError, AttributeError):
        pass
    outfile.parent.mkdir(parents=True, exist_ok=True)
    tmp = outfile.with_name(f".{outfile.name}.tmp-{os.getpid()}-{os.urandom(4).hex()}.gguf")  # one per export
    try:
        run_converter(checkout, folder, tmp, outtype)
        if not tmp.is_file():
            raise GGUFError(f"llama.cpp's converter exited without writing {tmp}")
        # the converter writes no per-layer pattern and llama.cpp's fixed one is the unpruned model's: write it;
        # a tokenizer the converter mistook for one llama.cpp splits otherwise: name GPT-2's (one copy for both)
        pattern = doc["layer_types"] if _pattern_to_write(tmp, doc["num_hidden_layers"], doc.get("layer_types")) \
            else None
        pre = pre_tokenizer_to_write(folder, tmp)
        if pattern is not None or pre is not None:
            rewritten = tmp.with_name(tmp.name + ".meta")
            try:
                rewrite_metadata(tmp, rewritten, pattern, pre)
                os.replace(rewritten, tmp)
            finally:
                rewritten.unlink(missing_ok=True)
        check_layer_metadata(tmp, doc["num_hidden_layers"], original if isinstance(original, int) else None,
                             doc.get("layer_types") if isinstance(doc.get("layer_types"), list) else None)
        publish_file(tmp, outfile, overwrite)  # decides at the rename: an export that finished first keeps its file
    except GGUFError as e:
        if "the GGUF's" in str(e):  # name the file the user asked for, not our temporary one
            raise GGUFError(str(e).replace(str(tmp), str(outfile)) + " (nothing was written)") from None
        raise
    except OSError as e:  # our own writes (the attention pattern, the publish): a full disk is named as such
        if is_write_failure(e) and not isinstance(e, ShiftError):
            raise GGUFError(f"Could not write {outfile}: {write_failure_reason(e)} (nothing was written); free some "
                            "space, or write --out to another disk") from None
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return outfile
