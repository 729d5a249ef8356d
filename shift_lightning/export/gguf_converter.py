"""llama.cpp's own GGUF converter: where it comes from and how it runs (for :mod:`shift_lightning.export.gguf`).

By default the converter is the one vendored in the ``llama-cpp-python`` source archive (fetched once with
``pip download`` into the cache and extracted there); ``--llama_cpp`` names a llama.cpp checkout instead. It runs
as a subprocess with that checkout's own ``gguf-py`` first on ``PYTHONPATH``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from ..errors import ShiftError

#: The llama-cpp-python release whose sdist vendors the llama.cpp converter used by default.
LLAMA_CPP_PYTHON = "0.3.36"
SDIST = f"llama_cpp_python-{LLAMA_CPP_PYTHON}.tar.gz"
CONVERTER = "convert_hf_to_gguf.py"


class GGUFError(ShiftError):
    """A folder that cannot be exported, a converter that cannot be found or failed, or a GGUF whose
    layer metadata does not match its folder."""


def llama_cpp_cache() -> Path:
    """Where the llama-cpp-python sdist (and its extracted llama.cpp) and wheel are cached."""
    from ..assets import cache_root

    return cache_root() / "llama_cpp"


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


def check_converter_deps() -> None:
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
        if re.search(r"No space left on device|Errno 28\b|ENOSPC|Disk quota exceeded|Errno 122\b", out):
            free = shutil.disk_usage(outfile.parent).free
            raise GGUFError(f"The disk holding {outfile.parent} is full ({free / 1e6:.0f} MB free): llama.cpp's "
                            "converter could not write the GGUF (nothing was written). Free some space, or write --out "
                            "to another disk") from None
        hint = ""
        m = re.search(r"No module named '([\w.]+)'", out)
        if m:
            hint = f" (the converter needs the Python package {m.group(1).split('.')[0]!r}: pip install it)"
        raise GGUFError(f"llama.cpp's converter failed on {folder} (exit status {r.returncode}){hint}; "
                        f"its last lines:\n{_tail(out)}")
