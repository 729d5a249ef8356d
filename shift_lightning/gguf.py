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

A *marked* folder (``model_type: shift_<family>``, adapters or ReplaceMe maps, see
:mod:`shift_lightning.remote_code`) is refused: llama.cpp cannot run the adapters.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from .errors import ConfigError, ShiftError

#: The output types this export supports (llama.cpp's converter writes them without a quantize binary).
OUTTYPES = ("f32", "f16", "bf16", "q8_0")
#: The llama-cpp-python release whose sdist vendors the llama.cpp converter used by default.
LLAMA_CPP_PYTHON = "0.3.36"
SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
CONVERTER = "convert_hf_to_gguf.py"
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


class GGUFError(ShiftError):
    """A folder that cannot be exported, a converter that cannot be found or failed, or a GGUF whose
    layer metadata does not match its folder."""


def llama_cpp_cache() -> Path:
    """Where the llama-cpp-python sdist (and its extracted llama.cpp) and wheel are cached."""
    from .assets import cache_root

    return cache_root() / "llama_cpp"


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
    from .remote_code import is_marked

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
            "families) or prune without repair (shift_lightning.surgery.remove_blocks, then save_pretrained)")
    if not isinstance(doc.get("num_hidden_layers"), int):
        raise GGUFError(f"{cfg_file} has no integer num_hidden_layers; give a decoder-only causal LM folder")
    if not any((folder / f).is_file() for f in _TOKENIZER_FILES):
        raise GGUFError(f"{folder} has no tokenizer ({' or '.join(_TOKENIZER_FILES)}); save the tokenizer "
                        "with the model (save_pretrained(model, tokenizer, …)) and export again")
    if not any(folder.glob("model*.safetensors")):
        raise GGUFError(f"{folder} has no model*.safetensors; give a folder with the model's weights")
    return doc


def _check_outfile(outfile: Path, overwrite: bool) -> None:
    from .outputs import check_writable

    if outfile.is_dir():
        raise GGUFError(f"--out {outfile} is a folder; name the .gguf file to write")
    if outfile.exists() and not overwrite:
        raise GGUFError(f"--out {outfile} exists; choose another file or pass --overwrite to replace it")
    check_writable(outfile, "choose another --out")


# --------------------------------------------------------------------------------------------
# The converter
# --------------------------------------------------------------------------------------------
def _as_checkout(path: Path) -> Path | None:
    """``path`` itself or the vendored llama.cpp of an extracted sdist, if it holds the converter."""
    for cand in (path, path / "vendor" / "llama.cpp"):
        if (cand / CONVERTER).is_file():
            return cand
    return None


def _extract_sdist(sdist: Path, dest: Path) -> Path:
    """Extract ``sdist`` once into ``dest`` (atomically; another process may race us)."""
    root = dest / sdist.name[: -len(".tar.gz")]
    if _as_checkout(root):
        return root
    tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=dest))
    try:
        with tarfile.open(sdist) as tf:
            tf.extractall(tmp, filter="data")
        inner = tmp / root.name
        if not _as_checkout(inner):
            raise GGUFError(f"{sdist} holds no vendor/llama.cpp/{CONVERTER}; delete it and run again, "
                            "or pass --llama_cpp <a llama.cpp checkout>")
        try:
            os.rename(inner, root)
        except OSError:
            if not _as_checkout(root):
                raise
    except (tarfile.TarError, OSError) as e:
        raise GGUFError(f"Cannot extract {sdist} ({e}); delete it and run again, or pass --llama_cpp "
                        "<a llama.cpp checkout>") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return root


def find_converter(llama_cpp: str | Path | None = None) -> Path:
    """The llama.cpp folder holding ``convert_hf_to_gguf.py`` and ``gguf-py``: ``llama_cpp`` (a checkout
    or an extracted llama-cpp-python sdist), else the sdist cached in :func:`llama_cpp_cache`
    (extracted once), else that sdist fetched with ``pip download``."""
    if llama_cpp is not None:
        p = Path(llama_cpp).expanduser()
        found = _as_checkout(p)
        if found is None:
            raise GGUFError(f"--llama_cpp {p} holds no {CONVERTER} (nor vendor/llama.cpp/{CONVERTER}); give a "
                            "llama.cpp checkout or an extracted llama-cpp-python source archive")
        return found
    cache = llama_cpp_cache()
    cache.mkdir(parents=True, exist_ok=True)
    sdist = cache / SDIST
    if not sdist.is_file():
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
               "--disable-pip-version-check", "-d", str(cache), f"llama-cpp-python=={LLAMA_CPP_PYTHON}"]
        sys.stderr.write(f"shift-lightning: fetching llama.cpp's converter (llama-cpp-python=={LLAMA_CPP_PYTHON} "
                         f"source, ~50 MB) once into {cache}\n")
        try:
            r = subprocess.run(cmd, capture_output=True, text=True)
        except OSError as e:
            r = subprocess.CompletedProcess(cmd, 1, "", str(e))
        if r.returncode != 0 or not sdist.is_file():
            tail = " ".join((r.stderr or r.stdout or "").strip().splitlines()[-2:])
            raise GGUFError(f"Could not download llama-cpp-python=={LLAMA_CPP_PYTHON}'s source with pip "
                            f"({tail or 'no archive came back'}); pass --llama_cpp <a llama.cpp checkout>, or put "
                            f"{SDIST} into {cache}")
    found = _as_checkout(_extract_sdist(sdist, cache))
    assert found is not None
    return found


def _tail(text: str, n: int = 15) -> str:
    lines = [ln for ln in text.replace("\r", "\n").splitlines() if ln.strip()]
    return "\n".join(lines[-n:])


def _check_converter_deps() -> None:
    """The converter imports these whatever the tokenizer (``sentencepiece`` even for a BPE tokenizer)."""
    import importlib.util

    missing = [m for m in ("sentencepiece", "numpy", "safetensors") if importlib.util.find_spec(m) is None]
    if missing:
        raise GGUFError(f"llama.cpp's converter needs the Python package(s) {', '.join(missing)}: pip install "
                        f"{' '.join(missing)} (or pip install 'shift-lightning[gguf]')")


def run_converter(checkout: Path, folder: Path, outfile: Path, outtype: str) -> None:
    """``python convert_hf_to_gguf.py folder --outfile outfile --outtype outtype`` with the checkout's own
    ``gguf-py`` first on the path; its output's tail in the error if it fails."""
    env = dict(os.environ)
    gguf_py = str(checkout / "gguf-py")
    env["PYTHONPATH"] = gguf_py + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.pop("NO_LOCAL_GGUF", None)
    cmd = [sys.executable, str(checkout / CONVERTER), str(folder), "--outfile", str(outfile), "--outtype", outtype]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    except OSError as e:
        raise GGUFError(f"Cannot run {checkout / CONVERTER}: {e}") from None
    if r.returncode != 0:
        out = (r.stdout or "") + (r.stderr or "")
        hint = ""
        m = re.search(r"No module named '([\w.]+)'", out)
        if m:
            hint = f" (the converter needs the Python package {m.group(1).split('.')[0]!r}: pip install it)"
        raise GGUFError(f"llama.cpp's converter failed on {folder} (exit status {r.returncode}){hint}; "
                        f"its last lines:\n{_tail(out)}")


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


def _check_attention_pattern(path: Path, reader, arch: str, num_layers: int, layer_types: list[str]) -> None:
    from gguf import GGUFValueType

    if len(layer_types) != num_layers:
        raise GGUFError(f"config.json layer_types has {len(layer_types)} entries for {num_layers} blocks; the folder "
                        "is inconsistent")
    want = [t == "sliding_attention" for t in layer_types]
    if not any(want):
        return
    f = reader.fields.get(f"{arch}.attention.sliding_window_pattern")
    if f is not None and f.types and f.types[0] == GGUFValueType.ARRAY:
        got, how = [bool(x) for x in f.contents()], "its per-layer sliding_window_pattern"
    elif arch in SWA_DEFAULTS:
        n, dense_first = SWA_DEFAULTS[arch]
        if f is not None:
            n = int(f.contents())
        sw = reader.fields.get(f"{arch}.attention.sliding_window")
        if sw is None or int(sw.contents()) == 0:
            got, how = [False] * num_layers, f"no {arch}.attention.sliding_window (every block full attention)"
        else:
            got = [n == 0 or (i % n != 0 if dense_first else i % n < n - 1) for i in range(num_layers)]
            how = (f"no per-layer pattern: llama.cpp's {arch} loader assumes every {n}th block full attention "
                   "(the unpruned model's pattern)")
    else:
        return  # an architecture whose default pattern is not known here: not checked
    wrong = [i for i in range(num_layers) if got[i] != want[i]]
    if wrong:
        raise GGUFError(f"{path}: llama.cpp would run blocks {_ranges(wrong)} with the wrong attention (sliding vs full) "
                        f"for this pruned model: config.json layer_types differs from what the GGUF says ({how}); "
                        "the GGUF's layer metadata is wrong; do not use it (llama.cpp cannot run this pruned "
                        f"{arch} correctly from its converter's output)")


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
    llama-cpp-python's sdist, cached), check the written file's layer metadata against the folder and
    publish it atomically. Returns ``outfile``. Never replaces an existing file unless ``overwrite``."""
    check_outtype(outtype)
    folder = Path(folder).expanduser()
    outfile = Path(outfile).expanduser()
    doc = check_folder(folder)
    _check_outfile(outfile, overwrite)
    checkout = find_converter(llama_cpp)
    _check_converter_deps()
    original = None
    try:
        original = json.loads((folder / "shift_config.json").read_text()).get("original_num_layers")
    except (OSError, ValueError, AttributeError):
        pass
    outfile.parent.mkdir(parents=True, exist_ok=True)
    tmp = outfile.with_name(f".{outfile.name}.tmp-{os.getpid()}.gguf")
    try:
        run_converter(checkout, folder, tmp, outtype)
        if not tmp.is_file():
            raise GGUFError(f"llama.cpp's converter exited without writing {tmp}")
        check_layer_metadata(tmp, doc["num_hidden_layers"], original if isinstance(original, int) else None,
                             doc.get("layer_types") if isinstance(doc.get("layer_types"), list) else None)
        os.replace(tmp, outfile)
    except GGUFError as e:
        if "the GGUF's" in str(e):  # name the file the user asked for, not our temporary one
            raise GGUFError(str(e).replace(str(tmp), str(outfile)) + " (nothing was written)") from None
        raise
    finally:
        tmp.unlink(missing_ok=True)
    return outfile
