"""Export a stock pruned folder to GGUF with llama.cpp's own converter (layer metadata checked).

    python -m shift_lightning.recipes.gguf --model outputs/pruned --out pruned-q8_0.gguf --outtype q8_0
    python -m shift_lightning.recipes.gguf --model outputs/pruned --out pruned-f16.gguf --llama_cpp ~/llama.cpp

``--model``: a folder without adapters (pruned and not repaired, or repaired with
``--calibration.solver stock``): a plain Hugging Face folder. A folder with adapters is refused
(llama.cpp cannot run them). The converter is ``convert_hf_to_gguf.py`` of ``--llama_cpp`` (a llama.cpp
checkout) or, by default, of the llama.cpp vendored in llama-cpp-python's source archive (fetched once
into ``~/.cache/shift_lightning/llama_cpp``). The written file's ``<arch>.block_count``, ``blk.N.*``
tensors and per-layer metadata arrays are checked against the folder's ``num_hidden_layers``
(:mod:`shift_lightning.export.gguf`). ``python -m shift_lightning.recipes.gguf --help`` lists the options.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass


@dataclass
class GGUFExportConfig:
    """What to export and where."""

    model: str = ""
    """The saved folder to export (config.json with a stock model_type, model*.safetensors, the tokenizer)."""
    out: str = ""
    """The .gguf file to write (refused if it exists, unless --overwrite)."""
    outtype: str = "f16"
    """f32, f16, bf16 or q8_0 (what llama.cpp's converter writes by itself)."""
    llama_cpp: str | None = None
    """A llama.cpp checkout (or an extracted llama-cpp-python source archive) whose convert_hf_to_gguf.py runs;
    default: llama-cpp-python 0.3.36's, fetched once into ~/.cache/shift_lightning/llama_cpp."""
    overwrite: bool = False
    """Replace an existing --out file."""


def check(cfg: GGUFExportConfig) -> None:
    """Everything that can be refused before the converter runs (no framework imported)."""
    from pathlib import Path

    from ..errors import UsageError
    from ..export.gguf import GGUFError, check_folder, check_outtype

    if not cfg.model:
        raise UsageError("--model is required: the saved folder to export")
    if not cfg.out:
        raise UsageError("--out is required: the .gguf file to write")
    check_outtype(cfg.outtype)
    check_folder(cfg.model)
    out = Path(cfg.out).expanduser()
    if out.exists() and not out.is_dir() and not cfg.overwrite:
        raise GGUFError(f"--out {out} exists; choose another file or pass --overwrite to replace it")


def run(cfg: GGUFExportConfig):
    """Export, then print the file, its size and its block count."""
    import json
    from pathlib import Path

    from ..export.gguf import check_layer_metadata, export_gguf

    sys.stderr.write(f"Converting {cfg.model} to {cfg.outtype} with llama.cpp's convert_hf_to_gguf.py …\n")
    path = export_gguf(cfg.model, cfg.out, cfg.outtype, cfg.llama_cpp, cfg.overwrite)
    n = json.loads((Path(cfg.model).expanduser() / "config.json").read_text())["num_hidden_layers"]
    s = check_layer_metadata(path, n)
    size = path.stat().st_size
    sys.stdout.write(f"Wrote {path} ({size / 1e6:.1f} MB, {cfg.outtype}): {s.arch}.block_count {s.block_count}, "
                     f"blk.N tensors for N = 0-{s.block_count - 1}, {s.tensors} tensors\n")
    return path


def main(argv: list[str] | None = None):
    import dataclasses

    try:  # the command line's imports take a second: Ctrl-C then is one line, as in every entry point
        from .cli import dataclass_parser, entry, parse_args
    except KeyboardInterrupt:
        sys.stderr.write("interrupted: stopped on Ctrl-C while starting (nothing was run)\n")
        raise SystemExit(130) from None

    def parse(args: list[str]) -> GGUFExportConfig:
        p = dataclass_parser(GGUFExportConfig, __doc__.splitlines()[0])
        ns = parse_args(p, args)
        cfg = GGUFExportConfig(**{f.name: ns[f.name] for f in dataclasses.fields(GGUFExportConfig)})
        check(cfg)
        return cfg

    return entry(run, argv, parse)


if __name__ == "__main__":
    main()
