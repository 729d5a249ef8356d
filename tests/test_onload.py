"""Onloaded calibration (``--model.placement onload``): the model built on the meta device, each block read from
the folder's safetensors files when the block-major walk reaches it. The maps and the saved folder must be
those of the same run with the model in memory."""

import copy
import json
import os
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from safetensors.torch import load_file

from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.criteria import PruneConfig
from shift_lightning.data import TextDataConfig, build_windows
from shift_lightning.errors import ConfigError, ShiftError
from shift_lightning.models import ModelConfig, build_tiny_model, load_model
from shift_lightning.placement import Onloaded, placement_of, write_safetensors
from shift_lightning.recipes.calibrate import run_calibration
from test_gguf import fake_llama_cpp  # noqa: F401 (the stand-in converter, a fixture)

ROOT = Path(__file__).resolve().parents[1]
CORPUS = str(ROOT / "tests" / "data" / "tiny_corpus.txt")
HELDOUT = str(ROOT / "tests" / "data" / "tiny_heldout.txt")


def _trainer():
    return L.Trainer(accelerator="cpu", devices=1, inference_mode=False, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, use_distributed_sampler=False)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    """Tiny Llama and Gemma3 models saved as HF folders (sharded for Llama: the index is read too)."""
    root = tmp_path_factory.mktemp("models")
    out = {}
    for fam in ("llama", "gemma3", "llama_tied"):
        model, tok = build_tiny_model(fam.split("_")[0], num_hidden_layers=6, max_position_embeddings=512,
                                      **({"tie_word_embeddings": True} if fam == "llama_tied" else {}))
        model.save_pretrained(root / fam, max_shard_size="40KB" if fam == "llama" else "5GB")
        tok.save_pretrained(root / fam)
        out[fam] = root / fam
    assert (out["llama"] / "model.safetensors.index.json").exists()
    return out


def _maps(module: CalibrationModule) -> dict[str, torch.Tensor]:
    out = {}
    for name, sols in module.solutions.items():
        for key, sol in sols.items():
            for f in ("W", "b", "U", "V", "T"):
                t = getattr(sol, f, None)
                if t is not None:
                    out[f"{name}/{key}/{f}"] = t
    return out


CASES = [("lra", "independent", "block"), ("lra", "sequential", "block"), ("lra", "anchored", "span"),
         ("lra_replaceme", "independent", "block"), ("lra_replaceme", "sequential", "block"),
         ("lra_replaceme", "anchored", "block"), ("nobias", "independent", "block"),
         ("replaceme", "independent", "block"), ("replaceme_cosine", "independent", "block"),
         ("linearpatch", "independent", "block"), ("stock", "independent", "block")]


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_onloaded_maps_equal_in_memory_bit_for_bit(folders, family):
    """Every walk and every product solver (guarded and mode auto are refused onloaded: see below): the same
    maps, the same calibration and held-out errors, with the blocks read one at a time from the files."""
    mem, tok = load_model(ModelConfig(name_or_path=str(folders[family]), placement="memory"))
    w = build_windows(TextDataConfig(source=CORPUS, num_samples=8, seq_len=48), tok)
    h = build_windows(TextDataConfig(source=HELDOUT, num_samples=4, seq_len=48), tok)
    for solver, mode, gran in CASES:
        if family == "gemma3" and solver == "stock":
            continue  # Llama layout only
        cfg = CalibrationConfig(solver=solver, mode=mode, granularity=gran, replaceme_cosine={"epochs": 1})
        onl, _ = load_model(ModelConfig(name_or_path=str(folders[family]), placement="onload"))
        assert isinstance(placement_of(onl), Onloaded) and all(p.is_meta for p in onl.parameters())
        a = CalibrationModule(copy.deepcopy(mem), [1, 2, 4], cfg)
        a.calibrate(_trainer(), w, h, batch_size=3)
        b = CalibrationModule(onl, [1, 2, 4], cfg)
        b.calibrate(_trainer(), w, h, batch_size=3)
        ma, mb = _maps(a), _maps(b)
        assert ma.keys() == mb.keys() and ma, (solver, mode)
        for k in ma:
            assert torch.equal(ma[k], mb[k]), (solver, mode, k)
        assert a.site_reports() == b.site_reports(), (solver, mode)
        assert all(p.is_meta for p in onl.parameters())  # every block released after the walk
        # every block up to the last removed one read once per pass (calibration + held-out), the head never
        read, blocks = placement_of(onl).bytes_read, sum(p.numel() * 4 for p in decoder_layers_of(mem)[:5].parameters())
        assert blocks <= read, (solver, mode)


@pytest.mark.parametrize("placement", ["memory", "onload"])
def test_sites_are_solved_as_the_walk_passes_them(folders, placement):
    """``keep_statistics=False`` (the recipe's): each site's sums are allocated at its first block, solved and freed
    after its last, so a rank holds only the sums of the sites being walked. The maps and reports are bit for bit
    those of one solve after the walk."""
    mem, tok = load_model(ModelConfig(name_or_path=str(folders["llama"]), placement="memory"))
    w = build_windows(TextDataConfig(source=CORPUS, num_samples=8, seq_len=48), tok)
    h = build_windows(TextDataConfig(source=HELDOUT, num_samples=4, seq_len=48), tok)
    for solver, gran in [("lra", "block"), ("lra_replaceme", "block"), ("lra_replaceme", "span"), ("stock", "block"),
                         ("linearpatch", "block"), ("replaceme", "block")]:
        cfg = CalibrationConfig(solver=solver, granularity=gran, rank=4 if solver == "lra" else None)
        a = CalibrationModule(copy.deepcopy(mem), [0, 2, 3, 5], cfg)
        a.calibrate(_trainer(), w, h, batch_size=3)
        model = load_model(ModelConfig(name_or_path=str(folders["llama"]), placement="onload"))[0] \
            if placement == "onload" else copy.deepcopy(mem)
        b = CalibrationModule(model, [0, 2, 3, 5], cfg, keep_statistics=False)
        held, solve_sites = [], b._solve_sites

        def spy(keys, b=b, solve_sites=solve_sites):
            j = keys[0][1] - 1  # the block just walked
            live = [k for k, buf in b._collector.buffers.items() if k != "meters" and not buf.is_meta]
            held.append((j, sorted(keys), sorted(live)))
            solve_sites(keys)

        b._solve_sites = spy
        b.calibrate(_trainer(), w, h, batch_size=3)
        ma, mb = _maps(a), _maps(b)
        assert ma.keys() == mb.keys() and ma, solver
        for k in ma:
            assert torch.equal(ma[k], mb[k]), (solver, k)
        assert a.site_reports() == b.site_reports() and a.span_reports() == b.span_reports(), solver
        assert not b.statistics and sorted(k for _, keys, _ in held for k in keys) == sorted(s.key for s in b.sites)
        for j, keys, live in held:  # only the sites whose blocks are being walked hold sums
            assert all(start <= j < end for start, end in live) and set(keys) <= set(live), (solver, held)


def test_a_fold_changes_every_read_once(folders):
    """A fold changes the block's weights in place; the next read of the block must start from the file again (a
    tensor read in its stored dtype may be the mapped file's pages: changed in place, every later read saw the fold
    applied once more)."""
    onl, _ = load_model(ModelConfig(name_or_path=str(folders["llama"]), placement="onload"))
    pl = placement_of(onl)
    pl.after_load(pl.sources[1], lambda block: block.mlp.down_proj.weight.data.mul_(2.0))
    reads = []
    for _ in range(3):
        with pl.block(onl, 1) as block:
            reads.append(block.mlp.down_proj.weight.detach().clone())
    stored = load_file(str(next(p for p in folders["llama"].glob("*.safetensors")
                                if "model.layers.1.mlp.down_proj.weight" in load_file(str(p)))))
    assert torch.equal(reads[0], 2.0 * stored["model.layers.1.mlp.down_proj.weight"].float())
    assert torch.equal(reads[0], reads[1]) and torch.equal(reads[1], reads[2])


@pytest.mark.parametrize("family", ["llama", "gemma3", "llama_tied"])
def test_the_walk_reads_the_embedding_rows_it_looks_up(folders, family):
    """Caching a batch reads only the embedding rows of its token ids (a run of consecutive ids in one slice), and the
    state entering block 0 is the in-memory model's, bit for bit (Gemma3 scales the rows on lookup); afterwards the
    table is the skeleton's meta Parameter again (a tied head's too), the padding id the config's."""
    from shift_lightning.passes import BlockCache

    mem, _ = load_model(ModelConfig(name_or_path=str(folders[family]), placement="memory"))
    onl, _ = load_model(ModelConfig(name_or_path=str(folders[family]), placement="onload"))
    pl, emb = placement_of(onl), onl.model.embed_tokens
    table, pad = emb.weight, emb.padding_idx
    ids = torch.tensor([[5, 6, 7, 40, 3, 40, 258], [258, 258, 9, 5, 6, 200, 201]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids)}
    got = BlockCache(onl, 2).cache_batch(batch, batch["attention_mask"].bool())["h"]
    want = BlockCache(mem, 2).cache_batch(batch, batch["attention_mask"].bool())["h"]
    assert torch.equal(got, want)
    assert pl.bytes_read == ids.unique().numel() * mem.config.hidden_size * 4  # float32 files: 4 bytes a value
    assert emb.weight is table and emb.weight.is_meta and emb.padding_idx == pad
    if family == "llama_tied":
        assert onl.get_output_embeddings().weight is emb.weight


def decoder_layers_of(model):
    return model.model.layers


@pytest.mark.parametrize("criterion", ["angular", "block_influence", "magnitude_l2", "linear_fit", "linear_fit_kl"])
def test_onloaded_criteria_equal_in_memory(folders, criterion):
    """The criteria of hidden states (block by block over the cached windows) and of weights (block by block from
    the files) score an onloaded model as they score it in memory, bit for bit."""
    from shift_lightning.selection import select_blocks

    mem, tok = load_model(ModelConfig(name_or_path=str(folders["llama"]), placement="memory"))
    onl, _ = load_model(ModelConfig(name_or_path=str(folders["llama"]), placement="onload"))
    w = build_windows(TextDataConfig(source=CORPUS, num_samples=8, seq_len=48, packing=False), tok)
    cfg = PruneConfig(criterion=criterion, ratio=0.34, batch_size=3)
    a, b = select_blocks(cfg, mem, w, _trainer), select_blocks(cfg, onl, w, _trainer)
    assert a.layers == b.layers and a.scores == b.scores and a.scores
    assert a.details == b.details  # linear_fit: every span's cost; linear_fit_kl: every candidate's KL and top-1
    assert all(p.is_meta for p in onl.parameters())


def _run(folder, placement, out, solver="lra_replaceme", layers=(1, 2, 4), **kw):
    return run_calibration(model=ModelConfig(name_or_path=str(folder), placement=placement),
                           data=TextDataConfig(source=CORPUS, num_samples=8, seq_len=48),
                           heldout=TextDataConfig(source=HELDOUT, num_samples=4, seq_len=48),
                           prune=PruneConfig(layers=list(layers)), calibration=CalibrationConfig(solver=solver, **kw),
                           trainer=dict(accelerator="cpu", enable_progress_bar=False), output_dir=str(out))


def _assert_same_folder(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    for name in names:
        if name.endswith(".safetensors"):
            ta, tb = load_file(a / name), load_file(b / name)
            assert ta.keys() == tb.keys()
            for k in ta:
                assert torch.equal(ta[k], tb[k]), (name, k)
        elif name == "calibration_report.json":
            ra, rb = json.loads((a / name).read_text()), json.loads((b / name).read_text())
            ra.pop("seconds"), rb.pop("seconds")
            assert "heldout_closeness" not in ra and rb.pop("heldout_closeness")["repaired"]["kl"] >= 0  # onloaded
            assert ra == rb
        elif name not in (".shift_lightning.json", "calibration_report.md"):  # fingerprints, times
            assert (a / name).read_bytes() == (b / name).read_bytes(), name


@pytest.mark.parametrize("solver,scripted", [("lra_replaceme", False), ("lra_replaceme", True), ("stock", True)])
def test_onloaded_kept_block_refit_equals_in_memory(folders, tmp_path, monkeypatch, solver, scripted):
    """``--calibration.refit.kept`` onloaded: the original is a second skeleton over the same files (no copy), the
    fitting and held-out windows walk both models block by block, a re-fitted block's weights are put in place each
    time it is read, and the streamed save writes them. The held-out judgements, what is kept, and the folder equal
    the in-memory run's, bit for bit. Scripted: every re-fit kept (block 2 carries a folded map and a re-fit)."""
    import shift_lightning.maps.keptfit as K

    if scripted:
        real = K.heldout_kl
        scores = {}

        def judge(walk, refs, reduce=None):  # the real check runs; the verdict is "closer" every time
            real(walk, refs, reduce)
            n = scores[walk.placement.name] = scores.get(walk.placement.name, 0) + 1
            return 1.0 / n

        monkeypatch.setattr(K, "heldout_kl", judge)
    mem = _run(folders["llama"], "memory", tmp_path / "mem", solver, layers=(1, 3), refit={"kept": 1})
    onl = _run(folders["llama"], "onload", tmp_path / "onl", solver, layers=(1, 3), refit={"kept": 1})
    assert mem.report.refit == onl.report.refit and len(mem.report.refit["heldout_kl"]) == 3
    if scripted:
        assert onl.report.refit["kept"] == [2, 4]
    _assert_same_folder(tmp_path / "mem", tmp_path / "onl")
    assert all(p.is_meta for p in onl.model.parameters() if p.dim() > 1 and p.numel() > 32 * 32)  # nothing kept loaded


@pytest.mark.parametrize("family,solver", [("llama", "lra_replaceme"), ("llama", "stock"), ("gemma3", "lra_replaceme"),
                                           ("llama", "lra"), ("llama_tied", "lra_replaceme")])
def test_onloaded_run_saves_the_same_folder(folders, tmp_path, family, solver):
    """The whole calibrate job onloaded: the pruned model is written by streaming the kept blocks from the source
    files (ReplaceMe's map and the stock repair folded as each block is read): the folder equals the in-memory run's
    file for file (tensors equal, config and record byte for byte), and loads with the same logits."""
    from shift_lightning import load_pretrained

    _run(folders[family], "memory", tmp_path / "mem", solver)
    _run(folders[family], "onload", tmp_path / "onl", solver)
    _assert_same_folder(tmp_path / "mem", tmp_path / "onl")
    ids = torch.randint(0, 256, (2, 20))
    a, _ = load_pretrained(str(tmp_path / "mem"))
    b, _ = load_pretrained(str(tmp_path / "onl"))
    assert torch.equal(a(input_ids=ids).logits, b(input_ids=ids).logits)


def test_an_onloaded_stock_folder_exports_to_gguf(folders, tmp_path, fake_llama_cpp):
    """The stock repair with the kept-block re-fit, onloaded: the streamed folder is a plain Llama folder the GGUF
    export takes (the converter is tests/test_gguf.py's stand-in; llama.cpp's own: -m slow)."""
    from shift_lightning.export.gguf import check_layer_metadata, export_gguf

    _run(folders["llama"], "onload", tmp_path / "onl", "stock", layers=(1, 3), refit={"kept": 1})
    config = json.loads((tmp_path / "onl" / "config.json").read_text())
    assert config["model_type"] == "llama" and "auto_map" not in config and config["num_hidden_layers"] == 4
    out = export_gguf(tmp_path / "onl", tmp_path / "onl.f16.gguf", "f16", llama_cpp=fake_llama_cpp)
    assert check_layer_metadata(out, 4, original_num_layers=6).block_count == 4


def test_streamed_save_shards_a_large_model(folders, tmp_path):
    """Past the shard size the weights are written as HF shards with an index, a block never split, and
    ``from_pretrained`` reads them."""
    from transformers import AutoModelForCausalLM

    from shift_lightning.placement import save_streamed
    from shift_lightning.maps.surgery import remove_blocks

    onl, _ = load_model(ModelConfig(name_or_path=str(folders["llama"]), placement="onload"))
    remove_blocks(onl, [2, 3])
    save_streamed(onl, dict(onl.state_dict()), tmp_path, max_shard_bytes=60_000)
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2
    for p in range(4):  # each block in one file
        assert len({f for k, f in index["weight_map"].items() if k.startswith(f"model.layers.{p}.")}) == 1
    got = AutoModelForCausalLM.from_pretrained(tmp_path)
    ref = AutoModelForCausalLM.from_pretrained(folders["llama"])
    remove_blocks(ref, [2, 3])
    for (k, v), (k2, v2) in zip(got.state_dict().items(), ref.state_dict().items()):
        assert k == k2 and torch.equal(v, v2), k


def test_write_safetensors_refuses_a_tensor_out_of_order(tmp_path):
    layout = [("a", (2,), torch.float32), ("b", (3,), torch.float32)]
    with pytest.raises(RuntimeError, match="where the header has a"):
        write_safetensors(tmp_path / "x.safetensors", layout, iter([("b", torch.zeros(3)), ("a", torch.zeros(2))]), {})


@pytest.mark.parametrize("overrides,match", [
    (dict(prune=PruneConfig(criterion="ppl", ratio=0.3)), "--prune.criterion ppl scores blocks"),
    (dict(prune=PruneConfig(criterion="taylor", ratio=0.3)), "--prune.criterion taylor scores blocks"),
    (dict(calibration=CalibrationConfig(mode="auto")), "--calibration.mode auto judges"),
    (dict(calibration=CalibrationConfig(solver="guarded")), "--calibration.solver guarded judges"),
])
def test_what_an_onloaded_run_cannot_do_is_refused_before_any_pass(folders, tmp_path, overrides, match):
    kw = dict(model=ModelConfig(name_or_path=str(folders["llama"]), placement="onload"),
              data=TextDataConfig(source=CORPUS, num_samples=8, seq_len=48), prune=PruneConfig(layers=[1, 2]),
              trainer=dict(accelerator="cpu", enable_progress_bar=False), output_dir=str(tmp_path / "out"))
    with pytest.raises(ConfigError, match=match) as e:
        run_calibration(**{**kw, **overrides})
    assert "--model.placement memory" in str(e.value)
    assert not (tmp_path / "out").exists()


def test_onload_needs_a_safetensors_folder(tmp_path):
    with pytest.raises(ShiftError, match="a tiny model is built in memory"):
        load_model(ModelConfig(tiny={"family": "llama"}, placement="onload"))
    with pytest.raises(ShiftError, match="is not one"):
        load_model(ModelConfig(name_or_path=str(tmp_path / "m.gguf"), placement="onload")) if False else \
            __import__("shift_lightning.placement", fromlist=["resolve"]).resolve("onload", None, torch.float32)


@pytest.mark.parametrize("solver,mode", [
    ("lra_replaceme", "sequential"),
    pytest.param("lra", "independent", marks=pytest.mark.extended),
    pytest.param("lra", "anchored", marks=pytest.mark.extended),
    pytest.param("stock", "independent", marks=pytest.mark.extended),
    pytest.param("linearpatch", "independent", marks=pytest.mark.extended),
])
def test_ddp_two_onloaded_ranks_match_one_in_memory(folders, tmp_path, solver, mode):
    """2 processes over gloo, each onloading the blocks and walking its own windows, sum once: the maps of one
    in-memory process (up to the order of the cross-rank sum: relative 1e-6)."""
    def cli(out, placement, world):
        cmd = [sys.executable, "calibrate.py", "--model.name_or_path", str(folders["llama"]), "--model.placement",
               placement, "--data.source", CORPUS, "--data.num_samples", "8", "--data.seq_len", "48",
               "--heldout.source", HELDOUT, "--heldout.num_samples", "4", "--heldout.seq_len", "48",
               "--prune.criterion", "angular", "--prune.ratio", "0.5", "--calibration.mode", mode,
               "--calibration.solver", solver,
               "--trainer.accelerator", "cpu",
               "--trainer.devices", str(world), "--output_dir", str(out)]
        if world == 1:  # here: a subprocess adds only its start-up
            from shift_lightning.recipes import cli

            return cli.calibrate_main(cmd[2:])
        cmd += ["--trainer.strategy", "ddp"]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        r = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-3000:]

    cli(tmp_path / "one", "memory", 1)
    cli(tmp_path / "two", "onload", 2)
    r1 = json.loads((tmp_path / "one" / "calibration_report.json").read_text())
    r2 = json.loads((tmp_path / "two" / "calibration_report.json").read_text())
    assert r2["world_size"] == 2 and r1["calibration_tokens"] == r2["calibration_tokens"]
    assert r1["pruned_layers"] == r2["pruned_layers"] and r1["selection"]["criterion"] == "angular"
    for a, b in zip(r1["selection"]["scores"].values(), r2["selection"]["scores"].values()):
        assert b == pytest.approx(a, rel=1e-9)
    w1, w2 = load_file(str(tmp_path / "one" / "lra.safetensors")), load_file(str(tmp_path / "two" / "lra.safetensors"))
    assert w1.keys() == w2.keys() and (w1 or solver == "stock")  # stock: the maps are folded into the weights
    for k in w1:
        assert ((w1[k] - w2[k]).norm() / w1[k].norm().clamp_min(1e-12)).item() < 1e-6, k
    m1, m2 = load_file(str(tmp_path / "one" / "model.safetensors")), load_file(str(tmp_path / "two" / "model.safetensors"))
    for k in m1:
        assert ((m1[k] - m2[k]).norm() / m1[k].norm().clamp_min(1e-12)).item() < 1e-6, k


def test_every_mode_is_a_registered_walk():
    """``--calibration.mode`` lists exactly the walks of the registry (a new walk is one registered class)."""
    import typing

    from shift_lightning.calibration.walks import WALKS

    assert set(typing.get_args(CalibrationConfig.__annotations__["mode"]) or
               typing.get_args(typing.get_type_hints(CalibrationConfig)["mode"])) == set(WALKS)


@pytest.mark.slow
def test_real_model_onloaded_equals_in_memory(tmp_path):
    """SmolLM2-135M (real weights, real activations with their outliers), selected by angular distance and repaired
    by the default joint map: onloaded from its de-quantised safetensors folder, the run writes the same folder as
    in memory (tensors equal) and the same report."""
    def run(placement):
        run_calibration(model=ModelConfig(name_or_path="smollm2-135m", placement=placement),
                        data=TextDataConfig(source="wiki_summaries", num_samples=16, seq_len=256),
                        heldout=TextDataConfig(source="wiki_summaries", split="heldout", num_samples=4, seq_len=256),
                        prune=PruneConfig(criterion="angular", ratio=0.25), calibration=CalibrationConfig(),
                        trainer=dict(accelerator="cpu", enable_progress_bar=False), output_dir=str(tmp_path / placement))

    run("memory")
    run("onload")
    _assert_same_folder(tmp_path / "memory", tmp_path / "onload")


@pytest.mark.parametrize("family,solver,layers", [("llama", "lra_replaceme", [1, 2, 4]), ("llama", "stock", [0, 3]),
                                                  ("gemma3", "lra_replaceme", [2, 3])])
def test_heldout_closeness_block_major_equals_full_forwards(folders, family, solver, layers):
    """The onloaded run's held-out report (perplexity of the original / pruned / repaired model, KL to the original,
    top-1 agreement; block by block, three streams) equals whole-model forwards of the three models in memory; the
    same pass in memory equals the onloaded one."""
    import math

    from shift_lightning.closeness import window_closeness, window_references
    from shift_lightning.evaluation.heldout import HeldoutCloseness
    from shift_lightning.nll import token_nll
    from shift_lightning.maps.surgery import apply_maps, remove_blocks

    mem, tok = load_model(ModelConfig(name_or_path=str(folders[family]), placement="memory"))
    w = build_windows(TextDataConfig(source=CORPUS, num_samples=8, seq_len=48), tok)
    h = build_windows(TextDataConfig(source=HELDOUT, num_samples=5, seq_len=40, packing=False), tok)
    cal = CalibrationModule(copy.deepcopy(mem), layers, CalibrationConfig(solver=solver))
    cal.calibrate(_trainer(), w, batch_size=3)
    corr = cal.fitted_maps()
    got = {}
    for placement in ("memory", "onload"):
        model = mem if placement == "memory" else load_model(ModelConfig(name_or_path=str(folders[family]),
                                                                         placement="onload"))[0]
        rep = HeldoutCloseness(model, layers, corr)
        rep.run(_trainer(), h, 2)
        got[placement] = rep.results
    assert got["memory"] == got["onload"]
    pruned, repaired = copy.deepcopy(mem), copy.deepcopy(mem)
    remove_blocks(pruned, layers), remove_blocks(repaired, layers)
    apply_maps(repaired, corr, 6, layers)
    refs = window_references(mem, h.input_ids, h.attention_mask, k=256)
    for name, model in (("original", mem), ("pruned", pruned), ("repaired", repaired)):
        with torch.no_grad():
            nll, valid = token_nll(model(input_ids=h.input_ids, attention_mask=h.attention_mask).logits,
                                   h.input_ids, h.attention_mask)
        assert got["memory"][name]["ppl"] == pytest.approx(math.exp(nll[valid].double().mean().item()), rel=1e-5)
        if name != "original":
            kl, top1 = window_closeness(model, h.input_ids, h.attention_mask, refs)
            assert got["memory"][name]["kl"] == pytest.approx(kl, rel=1e-4, abs=1e-9)
            assert got["memory"][name]["top1"] == pytest.approx(top1, abs=1e-9)
    assert got["memory"]["repaired"]["kl"] < got["memory"]["pruned"]["kl"]
