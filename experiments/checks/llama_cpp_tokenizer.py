"""llama.cpp's own tokenizer against transformers' on a folder with the embedded SmolLM2's tokenizer, per GGUF.

    python experiments/checks/llama_cpp_tokenizer.py            # results/llama_cpp/tokenizer_smollm2.json / .md

Three GGUF files, each read by llama.cpp with ``vocab_only=True`` (no weights are run): the embedded SmolLM2's own
GGUF, the tiny random Llama with SmolLM2's tokenizer (``llama_cpp_check.make_folder("tiny")``) converted by llama.cpp's
converter alone, and the same folder exported by :func:`shift_lightning.export.gguf.export_gguf`. Each is compared
with transformers' tokenizer of that folder on the texts of :func:`llama_cpp_check.tokenizer_probes` (the held-out
documents of the check's prompts, Python source, blank space before digits).
"""

from __future__ import annotations

import argparse
import glob
import shutil
import tempfile
from pathlib import Path

import _common as C  # noqa: F401 (the repository root on sys.path)

import llama_cpp_check as L

from shift_lightning.export.gguf import export_gguf, find_converter, run_converter
from shift_lightning.outputs import write_json_atomic, write_text_atomic

ROOT = Path(__file__).resolve().parents[2]


def _pre(path: Path) -> str | None:
    from gguf import GGUFReader

    f = GGUFReader(str(path)).fields.get("tokenizer.ggml.pre")
    return str(f.contents()) if f is not None else None


def run(out_dir: Path) -> dict:
    from transformers import AutoTokenizer

    lc = L.ensure_llama_cpp()
    work = Path(tempfile.mkdtemp(prefix="llama_cpp_tokenizer-"))
    try:
        folder, _ = L.make_folder("tiny", work / "tiny")
        tok = AutoTokenizer.from_pretrained(folder)
        _, texts = L.heldout_prompts(tok, 20, 32, False)
        probes = L.tokenizer_probes(texts)
        run_converter(find_converter(None), folder, work / "converter.gguf", "f16")
        export_gguf(folder, work / "export.gguf", "f16")
        files = {"the embedded SmolLM2's own GGUF": Path(glob.glob(str(Path.home() / ".cache" / "**" /
                                                                      "SmolLM2-135M-Instruct.Q4_1.gguf"),
                                                             recursive=True)[0]),
                 "llama.cpp's converter alone": work / "converter.gguf", "export_gguf": work / "export.gguf"}
        rows = {}
        for name, path in files.items():
            llm = lc.Llama(model_path=str(path), vocab_only=True, verbose=False)
            rows[name] = {"pre": _pre(path), **L.compare_tokenizers(llm, tok, probes)}
            del llm
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc = {"tokenizer": "the embedded SmolLM2's, as transformers rebuilds it from the GGUF (a bare ByteLevel)",
           "llama_cpp_python": getattr(lc, "__version__", "?"), "files": rows,
           "command": "python experiments/checks/llama_cpp_tokenizer.py"}
    write_json_atomic(out_dir / "tokenizer_smollm2.json", doc, indent=2)
    write_text_atomic(out_dir / "tokenizer_smollm2.md", render(doc))
    return doc


def render(doc: dict) -> str:
    groups = list(next(iter(doc["files"].values())))[1:]
    rows = [[name, f"`{r['pre']}`", *(f"{r[g]['identical']}/{r[g]['texts']}" for g in groups)]
            for name, r in doc["files"].items()]
    lines = ["# llama.cpp's tokenizer against transformers' (SmolLM2's tokenizer)", "",
             f"Tokenizer: {doc['tokenizer']}; llama-cpp-python {doc['llama_cpp_python']}, `vocab_only`. Texts with the "
             "same ids in both:", "", C.md_table(["GGUF", "tokenizer.ggml.pre", *groups], rows), ""]
    for name, r in doc["files"].items():
        for g in groups:
            for e in r[g]["examples"]:
                lines.append(f"- {name}, {g}: at {e['at']!r} transformers {e['hf']}, llama.cpp {e['llama_cpp']}")
    return "\n".join(lines + ["", f"Reproduce: `{doc['command']}`"]) + "\n"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(ROOT / "results" / "llama_cpp"))
    a = ap.parse_args(argv)
    doc = run(Path(a.out))
    print(render(doc))


if __name__ == "__main__":
    main()
