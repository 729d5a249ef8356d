"""GGUF export (shift_lightning.export.gguf) without llama.cpp: what is refused before the converter runs, the layer
metadata check on small GGUF files written with the ``gguf`` package, and the export's plumbing around a stand-in
converter (a script in a fake llama.cpp folder). The real converter and llama.cpp itself: tests/test_llama_cpp.py
(-m slow)."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from torch import nn

from shift_lightning.checkpoint import save_adapters, save_pretrained
from shift_lightning.export.gguf import GGUFError, check_layer_metadata, export_gguf
from shift_lightning.errors import ConfigError, ShiftError
from shift_lightning.maps.lra import AdapterSpec, LinearResidualAdapter
from shift_lightning.models import build_tiny_model
from shift_lightning.recipes import gguf as recipe
from shift_lightning.maps.surgery import attach_adapters, remove_blocks

ROOT = Path(__file__).resolve().parents[1]
SPEC = {"original_num_layers": 4, "pruned_layers": [2], "criterion": "explicit", "solver": "none"}


def _pruned(adapter: bool = False):
    model, tok = build_tiny_model("llama", num_hidden_layers=4)
    remove_blocks(model, [2])
    if adapter:
        attach_adapters(model, {2: LinearResidualAdapter(AdapterSpec(model.config.hidden_size))})
    return model, tok


@pytest.fixture(scope="module")
def stock(tmp_path_factory) -> Path:
    model, tok = _pruned()
    return save_pretrained(model, tok, tmp_path_factory.mktemp("stock") / "pruned", SPEC)


@pytest.fixture(scope="module")
def marked(tmp_path_factory) -> Path:
    model, tok = _pruned(adapter=True)
    return save_pretrained(model, tok, tmp_path_factory.mktemp("marked") / "lra", {**SPEC, "solver": "lra"})


@pytest.fixture
def no_converter(monkeypatch):
    """Any attempt to find or run llama.cpp's converter fails the test (refusals come first)."""
    import shift_lightning.export.gguf as g

    def never(*a, **k):
        raise AssertionError("the converter was reached")

    monkeypatch.setattr(g, "find_converter", never)
    monkeypatch.setattr(g, "run_converter", never)


def _error(argv, capsys) -> str:
    with pytest.raises(SystemExit) as e:
        recipe.main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err
    return err.splitlines()[0]


# ------------------------------------------------------------------------------------------------
# Refusals before the converter
# ------------------------------------------------------------------------------------------------
def test_stock_folder_is_plain_hf(stock, marked):
    assert json.loads((stock / "config.json").read_text())["model_type"] == "llama"
    assert json.loads((marked / "config.json").read_text())["model_type"] == "shift_llama"


def test_a_marked_folder_is_refused_naming_the_fix(marked, tmp_path, no_converter, capsys):
    out = tmp_path / "m.gguf"
    with pytest.raises(GGUFError, match="llama.cpp cannot run them.*--calibration.solver stock.*without repair"):
        export_gguf(marked, out)
    line = _error(["--model", str(marked), "--out", str(out)], capsys)
    assert line.startswith("error: ") and "trust_remote_code" in line and "--calibration.solver stock" in line
    assert not out.exists()


def test_an_adapter_only_folder_and_incomplete_folders_are_refused(stock, tmp_path, no_converter):
    model, tok = _pruned(adapter=True)
    only = save_adapters(model, tok, tmp_path / "only", {**SPEC, "solver": "lra"}, {"tiny": {"family": "llama"}})
    with pytest.raises(GGUFError, match="adapter-only folder"):
        export_gguf(only, tmp_path / "a.gguf")
    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        (bare / f).symlink_to(stock / f)
    with pytest.raises(GGUFError, match="has no tokenizer"):
        export_gguf(bare, tmp_path / "b.gguf")
    (bare / "tokenizer.json").symlink_to(stock / "tokenizer.json")
    (bare / "model.safetensors").unlink()
    with pytest.raises(GGUFError, match="no model.*safetensors"):
        export_gguf(bare, tmp_path / "b.gguf")
    with pytest.raises(GGUFError, match="has no config.json"):
        export_gguf(tmp_path, tmp_path / "c.gguf")
    with pytest.raises(GGUFError, match="is not a folder"):
        export_gguf(tmp_path / "missing", tmp_path / "c.gguf")


@pytest.mark.parametrize("outtype", ["q4_0", "Q8_0", "auto", "tq1_0", ""])
def test_an_unsupported_outtype_is_refused(stock, tmp_path, outtype, no_converter, capsys):
    with pytest.raises(ConfigError, match="f32, f16, bf16, q8_0"):
        export_gguf(stock, tmp_path / "x.gguf", outtype)
    line = _error(["--model", str(stock), "--out", str(tmp_path / "x.gguf"), "--outtype", outtype], capsys)
    assert "is not supported; choose one of f32, f16, bf16, q8_0" in line
    assert not (tmp_path / "x.gguf").exists()


def test_an_existing_file_is_never_replaced_without_overwrite(stock, tmp_path, no_converter, capsys):
    out = tmp_path / "exists.gguf"
    out.write_bytes(b"mine")
    with pytest.raises(GGUFError, match="exists; choose another file or pass --overwrite"):
        export_gguf(stock, out, "f16")
    assert "pass --overwrite" in _error(["--model", str(stock), "--out", str(out)], capsys)
    assert out.read_bytes() == b"mine"
    with pytest.raises(GGUFError, match="is a folder"):
        export_gguf(stock, tmp_path, "f16")


def test_help_answers_without_torch_or_transformers():
    code = ("import sys, contextlib, io\nfrom shift_lightning.recipes import gguf\nout = io.StringIO()\n"
            "with contextlib.redirect_stdout(out):\n    try:\n        gguf.main(['--help'])\n"
            "    except SystemExit as e:\n        assert e.code in (0, None)\n"
            "assert '--outtype' in out.getvalue() and '--llama_cpp' in out.getvalue()\n"
            "print('loaded:', sorted(m for m in ('torch', 'transformers', 'gguf') if m in sys.modules))\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "loaded: []" in r.stdout, r.stdout


# ------------------------------------------------------------------------------------------------
# The layer metadata check
# ------------------------------------------------------------------------------------------------
def write_gguf(path: Path, block_count: int, blocks, arrays: dict | None = None, arch: str = "llama") -> Path:
    """A small GGUF as llama.cpp's converter lays one out: ``<arch>.block_count`` and ``blk.N.*`` tensors."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    w.add_block_count(block_count)
    w.add_embedding_length(8)
    for k, v in (arrays or {}).items():
        w.add_array(f"{arch}.{k}", v)
    w.add_tensor("token_embd.weight", np.ones((16, 8), dtype=np.float32))
    for i in blocks:
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(8, dtype=np.float32))
        w.add_tensor(f"blk.{i}.ffn_down.weight", np.ones((8, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def test_a_correct_gguf_passes(tmp_path):
    s = check_layer_metadata(write_gguf(tmp_path / "ok.gguf", 3, range(3), {"attention.head_count": [4, 4, 4]}), 3, 4)
    assert (s.arch, s.block_count, s.blocks_with_tensors, s.tensors) == ("llama", 3, [0, 1, 2], 7)
    assert s.per_layer == {"llama.attention.head_count": 3}


def test_the_unpruned_block_count_is_refused_naming_the_file(tmp_path):
    """The layer-pruning metadata bug: the tensors of 3 blocks, the metadata of the unpruned 4."""
    p = write_gguf(tmp_path / "stale.gguf", 4, range(3))
    with pytest.raises(GGUFError, match=rf"{p}: llama.block_count is 4 but the model has 3 blocks"):
        check_layer_metadata(p, 3)


@pytest.mark.parametrize("blocks, what", [([0, 1], r"missing 2"), ([0, 1, 2, 3], r"beyond the last block: 3"),
                                          ([0, 2, 3], r"missing 1\).*beyond the last block: 3")])
def test_block_tensors_must_match_block_count(tmp_path, blocks, what):
    p = write_gguf(tmp_path / "t.gguf", 3, blocks)
    with pytest.raises(GGUFError, match=rf"{p}: tensors blk.N.\* exist for blocks .*{what}"):
        check_layer_metadata(p, 3)


def test_per_layer_arrays_must_have_block_count_entries(tmp_path):
    p = write_gguf(tmp_path / "a.gguf", 3, range(3), {"attention.head_count_kv": [2, 2, 2, 2]})
    with pytest.raises(GGUFError, match=rf"{p}: the per-layer metadata llama.attention.head_count_kv has 4 entries"):
        check_layer_metadata(p, 3)
    # an array of an unknown key is per-layer when it is as long as the unpruned model
    p = write_gguf(tmp_path / "b.gguf", 3, range(3), {"some.flags": [1, 0, 1, 0]})
    with pytest.raises(GGUFError, match="llama.some.flags has 4 entries"):
        check_layer_metadata(p, 3, original_num_layers=4)
    # ... and not when it is not (rope sections: always 4 entries)
    p = write_gguf(tmp_path / "c.gguf", 3, range(3), {"rope.dimension_sections": [8, 8, 0, 0]})
    assert check_layer_metadata(p, 3).per_layer == {}


def test_not_a_gguf_is_named(tmp_path):
    p = tmp_path / "x.gguf"
    p.write_bytes(b"nope" * 10)
    with pytest.raises(GGUFError, match=f"{p} cannot be read as GGUF"):
        check_layer_metadata(p, 3)


# ------------------------------------------------------------------------------------------------
# The export around a stand-in converter
# ------------------------------------------------------------------------------------------------
FAKE = textwrap.dedent("""
    import argparse, json, os, sys
    from pathlib import Path
    import numpy as np
    import gguf
    ap = argparse.ArgumentParser()
    ap.add_argument("model"); ap.add_argument("--outfile"); ap.add_argument("--outtype")
    a = ap.parse_args()
    assert gguf.__file__.startswith(os.path.join(os.path.dirname(__file__), "gguf-py")), gguf.__file__
    mode = os.environ.get("FAKE_CONVERTER", "ok")
    if mode == "fail":
        print("INFO:hf-to-gguf:Loading model", file=sys.stderr)
        print("KeyError: 'some tensor'", file=sys.stderr)
        sys.exit(1)
    if mode == "full":  # what the converter prints when the disk fills up under it
        print("Traceback (most recent call last):", file=sys.stderr)
        print('  File "convert_hf_to_gguf.py", line 1, in write', file=sys.stderr)
        print("OSError: [Errno 28] No space left on device", file=sys.stderr)
        sys.exit(1)
    n = json.loads((Path(a.model) / "config.json").read_text())["num_hidden_layers"]
    blocks = n + (1 if mode == "stale" else 0)
    w = gguf.GGUFWriter(a.outfile, "gemma3" if mode == "gemma3" else "llama")
    w.add_block_count(blocks)
    w.add_string("test.outtype", a.outtype)
    if os.environ.get("FAKE_PRE"):  # the pre-tokenizer the real converter names from its tokenizer hash
        w.add_tokenizer_pre(os.environ["FAKE_PRE"])
    if mode == "gemma3":  # what the real converter writes for Gemma3: a window, no per-layer pattern
        w.add_sliding_window(512)
        w.add_token_list(["<pad>", "a", "b"])
        w.add_float32("test.eps", 1e-6)
        w.add_array("test.ids", [3, 1, 2])
        w.add_tensor("token_embd.weight", np.arange(12, dtype=np.float16).reshape(3, 4))
    for i in range(blocks):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.full(4, i, dtype=np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
""")


@pytest.fixture
def fake_llama_cpp(tmp_path) -> Path:
    """A folder laid out like a llama.cpp checkout whose converter writes a small GGUF (its own gguf-py is the
    installed gguf package, linked: the export must put the checkout's gguf-py first on the path)."""
    import gguf

    root = tmp_path / "llama.cpp"
    (root / "gguf-py").mkdir(parents=True)
    (root / "gguf-py" / "gguf").symlink_to(Path(gguf.__file__).parent)
    (root / "convert_hf_to_gguf.py").write_text(FAKE)
    return root


def test_export_writes_checks_and_refuses_a_stale_file(stock, tmp_path, fake_llama_cpp, monkeypatch):
    from gguf import GGUFReader

    out = tmp_path / "out" / "p.gguf"
    assert export_gguf(stock, out, "q8_0", llama_cpp=fake_llama_cpp) == out
    assert GGUFReader(str(out)).fields["test.outtype"].contents() == "q8_0"
    assert check_layer_metadata(out, 3).block_count == 3
    monkeypatch.setenv("FAKE_CONVERTER", "stale")
    stale = tmp_path / "out" / "stale.gguf"
    with pytest.raises(GGUFError, match=rf"{stale}: llama.block_count is 4 but the model has 3 .*nothing was written"):
        export_gguf(stock, stale, "f16", llama_cpp=fake_llama_cpp)
    assert sorted(p.name for p in out.parent.iterdir()) == ["p.gguf"]  # no temporary file left behind
    with pytest.raises(GGUFError, match="exists"):
        export_gguf(stock, out, "f16", llama_cpp=fake_llama_cpp, overwrite=False)
    monkeypatch.setenv("FAKE_CONVERTER", "ok")
    export_gguf(stock, out, "f16", llama_cpp=fake_llama_cpp, overwrite=True)
    assert GGUFReader(str(out)).fields["test.outtype"].contents() == "f16"


def test_a_failing_converter_shows_its_last_lines(stock, tmp_path, fake_llama_cpp, monkeypatch):
    monkeypatch.setenv("FAKE_CONVERTER", "fail")
    with pytest.raises(GGUFError, match=r"converter failed on .*exit status 1.*\n.*Loading model\nKeyError"):
        export_gguf(stock, tmp_path / "f.gguf", llama_cpp=fake_llama_cpp)
    assert list(tmp_path.glob("*.gguf")) == [] and list(tmp_path.glob(".f.gguf*")) == []


def test_llama_cpp_must_hold_the_converter(stock, tmp_path):
    with pytest.raises(GGUFError, match=r"--llama_cpp .* holds no convert_hf_to_gguf.py"):
        export_gguf(stock, tmp_path / "x.gguf", llama_cpp=tmp_path)


def test_the_cli_prints_file_size_and_block_count(stock, tmp_path, fake_llama_cpp, capsys):
    out = tmp_path / "cli.gguf"
    assert recipe.main(["--model", str(stock), "--out", str(out), "--outtype", "f32",
                        "--llama_cpp", str(fake_llama_cpp)]) == out
    line = capsys.readouterr().out
    assert f"Wrote {out}" in line and "MB, f32" in line and "llama.block_count 3" in line


def _gemma3_gguf(path: Path, n: int, pattern=None, sliding_window: int | None = 512) -> Path:
    """A gemma3 GGUF of ``n`` blocks (with ``<arch>.attention.sliding_window`` unless None; ``pattern``: a
    per-layer sliding_window_pattern array)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(n)
    if sliding_window is not None:
        w.add_sliding_window(sliding_window)
    if pattern is not None:
        w.add_array("gemma3.attention.sliding_window_pattern", pattern)
    for i in range(n):
        w.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(8, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def _types(n: int, removed: list[int]) -> list[str]:
    """Gemma3's layer_types (every 6th block full attention) after removing ``removed``."""
    full = ["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(n)]
    return [t for i, t in enumerate(full) if i not in removed]


def test_a_pruned_gemma3_whose_attention_pattern_llama_cpp_would_get_wrong_is_refused(tmp_path):
    """llama.cpp's gemma3 loader assumes every 6th block is full attention unless the file has a per-layer
    pattern (its converter writes none): removing blocks 7-10 of 18 moves the full-attention blocks."""
    types = _types(18, [7, 8, 9, 10])
    p = _gemma3_gguf(tmp_path / "g.gguf", 14)
    with pytest.raises(GGUFError, match=rf"{p}: llama.cpp would run blocks 7, 11, 13 with the wrong attention .*every 6th block"):
        check_layer_metadata(p, 14, 18, types)
    # six consecutive blocks removed: the pattern survives
    assert check_layer_metadata(_gemma3_gguf(tmp_path / "six.gguf", 12), 12, 18, _types(18, list(range(6, 12))))
    # a per-layer pattern in the file is what llama.cpp reads: the folder's pattern passes, another one not
    ok = _gemma3_gguf(tmp_path / "arr.gguf", 14, [t == "sliding_attention" for t in types])
    assert check_layer_metadata(ok, 14, 18, types).per_layer == {"gemma3.attention.sliding_window_pattern": 14}
    bad = _gemma3_gguf(tmp_path / "bad.gguf", 14, [True] * 14)
    with pytest.raises(GGUFError, match=r"blocks 5, 7, 13 with the wrong attention .*per-layer sliding_window_pattern"):
        check_layer_metadata(bad, 14, 18, types)
    # no window at all: llama.cpp runs every block full attention
    with pytest.raises(GGUFError, match=r"no gemma3.attention.sliding_window"):
        check_layer_metadata(_gemma3_gguf(tmp_path / "nowin.gguf", 14, sliding_window=None), 14, 18, types)


def test_export_writes_the_folders_attention_pattern_where_llama_cpp_would_assume_another(stock, tmp_path,
                                                                                          fake_llama_cpp, monkeypatch):
    """A Gemma3 pruned across its every-6th-block pattern: the converter writes no per-layer pattern, so the export
    writes the folder's (one bool per block) and copies every other key and tensor unchanged."""
    import shutil

    from gguf import GGUFReader

    folder = tmp_path / "g3"
    shutil.copytree(stock, folder)
    cfg = json.loads((folder / "config.json").read_text())
    types = _types(6, [0, 1, 2])  # blocks 3, 4 sliding, 5 full; llama.cpp would assume 0, 1, 2 all sliding
    (folder / "config.json").write_text(json.dumps({**cfg, "layer_types": types}))
    monkeypatch.setenv("FAKE_CONVERTER", "gemma3")
    out = export_gguf(folder, tmp_path / "g3.gguf", "f16", llama_cpp=fake_llama_cpp)
    r = GGUFReader(str(out))
    assert [bool(x) for x in r.fields["gemma3.attention.sliding_window_pattern"].contents()] == [True, True, False]
    assert check_layer_metadata(out, 3, 6, types).per_layer == {"gemma3.attention.sliding_window_pattern": 3}
    assert r.fields["tokenizer.ggml.tokens"].contents() == ["<pad>", "a", "b"]
    assert r.fields["test.ids"].contents() == [3, 1, 2] and r.fields["test.outtype"].contents() == "f16"
    assert r.fields["gemma3.attention.sliding_window"].contents() == 512
    assert abs(r.fields["test.eps"].contents() - 1e-6) < 1e-12
    tensors = {t.name: t.data for t in r.tensors}
    assert tensors["token_embd.weight"].dtype.name == "float16"
    assert tensors["token_embd.weight"].ravel().tolist() == list(range(12))
    assert [tensors[f"blk.{i}.attn_norm.weight"].tolist() for i in range(3)] == [[float(i)] * 4 for i in range(3)]
    assert sorted(p.name for p in tmp_path.iterdir() if p.suffix == ".gguf" or ".tmp" in p.name) == ["g3.gguf"]
    # where llama.cpp's own pattern is the folder's (six consecutive blocks removed), nothing is added
    (folder / "config.json").write_text(json.dumps({**cfg, "layer_types": _types(9, [0, 1, 2, 3, 4, 5])}))
    kept = export_gguf(folder, tmp_path / "kept.gguf", "f16", llama_cpp=fake_llama_cpp)
    assert "gemma3.attention.sliding_window_pattern" not in GGUFReader(str(kept)).fields


def test_two_exports_into_one_new_file_never_replace_each_other(stock, tmp_path, fake_llama_cpp, monkeypatch):
    """Two exports started together into the same new file: the existence check before the conversion passes for
    both; the one that finishes second must not replace the first's file (the decision is made at the rename). Its
    file is kept beside, and the error says where."""
    from gguf import GGUFReader

    from shift_lightning.export import gguf as g
    from shift_lightning.outputs import PublishConflict

    out = tmp_path / "race.gguf"
    real = g.run_converter

    def converter_while_another_export_finishes(checkout, folder, tmp, outtype):
        real(checkout, folder, tmp, outtype)
        monkeypatch.setattr(g, "run_converter", real)
        export_gguf(stock, out, "q8_0", llama_cpp=fake_llama_cpp)  # the other export, done first

    monkeypatch.setattr(g, "run_converter", converter_while_another_export_finishes)
    with pytest.raises(PublishConflict, match=rf"Another run wrote {out} .* kept as {out}\.run-\d+ \(nothing was "):
        export_gguf(stock, out, "f16", llama_cpp=fake_llama_cpp)
    assert GGUFReader(str(out)).fields["test.outtype"].contents() == "q8_0"  # the first export's file, intact
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("race.gguf.run-")]
    assert len(kept) == 1 and GGUFReader(str(kept[0])).fields["test.outtype"].contents() == "f16"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".race")]  # no temporary file left


def test_a_full_disk_under_the_converter_is_named_not_its_traceback(stock, tmp_path, fake_llama_cpp, monkeypatch, capsys):
    from shift_lightning.recipes import gguf as cli

    monkeypatch.setenv("FAKE_CONVERTER", "full")
    out = tmp_path / "full.gguf"
    with pytest.raises(SystemExit) as e:
        cli.main(["--model", str(stock), "--out", str(out), "--llama_cpp", str(fake_llama_cpp)])
    err = capsys.readouterr().err
    assert e.value.code == 2 and "Traceback" not in err and "Errno 28" not in err, err
    assert f"error: The disk holding {tmp_path} is full" in err and "nothing was written" in err
    assert not out.exists() and not [p for p in tmp_path.iterdir() if p.name.startswith(".full")]


@pytest.mark.parametrize("pre_tokenizer, named, written", [
    ({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}, "smollm", "gpt-2"),
    ({"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}, "gpt-2", "gpt-2"),
    ({"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True},
                                            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True,
                                             "use_regex": True}]}, "smollm", "smollm"),
])
def test_the_export_names_gpt2s_pre_tokenizer_where_the_folder_splits_like_gpt2(stock, tmp_path, fake_llama_cpp,
                                                                                monkeypatch, pre_tokenizer, named,
                                                                                written):
    """The converter names llama.cpp's pre-tokenizer from a hash that cannot tell SmolLM2's digit splitting from
    GPT-2's regex: a folder whose tokenizer.json splits with GPT-2's regex alone gets ``gpt-2`` (llama.cpp then
    gives the folder's ids), one that splits digits first keeps the converter's name; every other key stays."""
    import shutil

    from gguf import GGUFReader

    folder = tmp_path / "f"
    shutil.copytree(stock, folder)
    tj = json.loads((folder / "tokenizer.json").read_text())
    (folder / "tokenizer.json").write_text(json.dumps({**tj, "pre_tokenizer": pre_tokenizer}))
    monkeypatch.setenv("FAKE_PRE", named)
    r = GGUFReader(str(export_gguf(folder, tmp_path / "f.gguf", "f16", llama_cpp=fake_llama_cpp)))
    assert r.fields["tokenizer.ggml.pre"].contents() == written
    assert r.fields["test.outtype"].contents() == "f16" and r.fields["llama.block_count"].contents() == 3
    assert len(r.tensors) == 3
