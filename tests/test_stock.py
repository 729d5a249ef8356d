"""The stock repair (``--calibration.solver stock``): maps folded into existing weights, known answers, a plain
HF folder that ``AutoModelForCausalLM`` loads without remote code to the same logits, and the refusals."""

from __future__ import annotations

import copy
import json

import lightning as L
import pytest
import torch
from torch import nn
from torch.testing import assert_close

from shift_lightning import load_pretrained
from shift_lightning.arch import decoder_layers
from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.checkpoint import save_pretrained
from shift_lightning.criteria import PruneConfig
from shift_lightning.data import TextDataConfig
from shift_lightning.errors import ConfigError
from shift_lightning.models import ModelConfig, build_tiny_model
from shift_lightning.recipes.calibrate import run_calibration
from shift_lightning.maps.surgery import apply_maps, remove_blocks

from test_calibration import CORPUS
from test_gguf import fake_llama_cpp  # noqa: F401 (the stand-in converter, a fixture)
from test_peers import BlockTap, Linear, _rand, _windows


def _trainer():
    return L.Trainer(accelerator="cpu", devices=1, inference_mode=False, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False)


def _fit(model, removed, solvers, windows, damping=1e-10):
    mod = CalibrationModule(model, removed, CalibrationConfig(damping=damping), solvers=solvers)
    mod.calibrate(_trainer(), windows, batch_size=4)
    return mod


class DownLinear(nn.Module):
    """A stand-in block adding ``u C0ᵀ + c0`` to the stream, ``u`` the down_proj input of an earlier block."""

    def __init__(self, shared, C0, c0):
        super().__init__()
        self.shared, self.C0, self.c0 = shared, C0, c0

    def forward(self, hidden_states, *args, **kwargs):
        return hidden_states + self.shared[hidden_states] @ self.C0.T.to(hidden_states) + self.c0.to(hidden_states)


def _down_span_model(family):
    """A tiny model whose blocks 2–3 add ``u C0ᵀ`` (``u``: block 1's down_proj input): exactly the stock map."""
    model, tok = build_tiny_model(family, num_hidden_layers=6, dtype=torch.float64)
    d, f = model.config.hidden_size, model.config.intermediate_size
    g = torch.Generator().manual_seed(11)
    C0 = 0.5 * torch.randn(d, f, generator=g, dtype=torch.float64)
    c0 = torch.zeros(d, dtype=torch.float64)
    blocks = decoder_layers(model)
    shared = BlockTap(blocks[1], blocks[1].mlp.down_proj, pre=True)
    blocks[2] = DownLinear(shared, C0, c0)
    blocks[3] = Linear(torch.eye(d, dtype=torch.float64))
    return model, tok


def _plain_reload(folder, ids):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float64)  # no trust_remote_code
    with torch.no_grad():
        return hf, hf(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_stock_recovers_a_span_linear_in_the_down_proj_input_and_writes_a_plain_folder(family, tmp_path):
    """Blocks 2–3 add exactly ``u C0ᵀ`` (no intercept: the stock map has none): the stock map folded into block 1's
    down_proj gives back the original. The folder is a plain one of its family, and ``AutoModelForCausalLM`` (no
    remote code) gives the same logits as ``load_pretrained``, bit for bit."""
    model, tok = _down_span_model(family)
    win = _windows(tok)
    ids = win.input_ids[:2, :24]
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    mod = _fit(model, [2, 3], {"stock": {}, "replaceme": {}}, win)
    errors = mod.reports[mod.spans[0].key]["solvers"]
    assert errors["stock"]["calib_rel_error"] < 1e-9 < 1e-3 < errors["replaceme"]["calib_rel_error"]
    corr = mod.fitted_maps("stock")
    assert list(corr.down_maps) == [1] and not corr.adapters and not corr.branch_maps
    remove_blocks(model, [2, 3])
    apply_maps(model, corr, 6, [2, 3])
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    assert_close(out, ref, rtol=1e-6, atol=1e-6)
    save_pretrained(model, tok, tmp_path, {"original_num_layers": 6, "pruned_layers": [2, 3], "solver": "stock"})
    cfg = json.loads((tmp_path / "config.json").read_text())
    assert cfg["model_type"] == family and "auto_map" not in cfg and cfg["num_hidden_layers"] == 4
    assert not (tmp_path / "modeling_shift.py").exists()
    assert f"A plain `{family}` folder" in (tmp_path / "README.md").read_text()  # the card says where it runs
    assert not cfg.get("mlp_bias", False)
    if "layer_types" in cfg:
        assert len(cfg["layer_types"]) == 4
    loaded, _ = load_pretrained(tmp_path)
    with torch.no_grad():
        mine = loaded(input_ids=ids, use_cache=False).logits
    hf, theirs = _plain_reload(tmp_path, ids)
    assert type(hf).__name__ == type(loaded).__name__
    assert torch.equal(mine, theirs)
    assert_close(theirs, out, rtol=0, atol=0)


def test_stock_contains_replaceme_so_its_calibration_error_is_never_above_it():
    """On a random model (no planted structure) the down_proj re-fit contains ReplaceMe's ``m ↦ m T``: its error on
    the calibration tokens is at most ReplaceMe's (same damping), on both spans."""
    model, tok = build_tiny_model("llama", num_hidden_layers=6, dtype=torch.float64)
    mod = _fit(model, [2, 4], {"stock": {}, "replaceme": {}}, _windows(tok), damping=1e-8)
    for sp in mod.spans:
        e = mod.reports[sp.key]["solvers"]
        assert e["stock"]["calib_rel_error"] <= e["replaceme"]["calib_rel_error"] + 1e-9


def test_stock_folds_a_span_at_block_0_into_an_untied_embedding_table(tmp_path):
    """Blocks 0–1 add ``x A0ᵀ + c0`` of the embedding ``x``: the span LRA folded into the table gives back the
    original; a tied lm_head is untied first and keeps the original table."""
    model, tok = build_tiny_model("llama", num_hidden_layers=6, dtype=torch.float64, tie_word_embeddings=True)
    d = model.config.hidden_size
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight.detach().clone()
    c0 = 0.1 * torch.randn(d, dtype=torch.float64, generator=torch.Generator().manual_seed(2))
    blocks = decoder_layers(model)
    blocks[0] = Linear(torch.eye(d, dtype=torch.float64) + _rand(d, 3, 0.3), c0)
    blocks[1] = Linear(torch.eye(d, dtype=torch.float64))
    win = _windows(tok)
    ids = win.input_ids[:2, :24]
    with torch.no_grad():
        ref = model(input_ids=ids, use_cache=False).logits
    mod = _fit(model, [0, 1], {"stock": {}}, win)
    corr = mod.fitted_maps("stock")
    assert corr.embedding is not None and not corr.down_maps and not corr.adapters
    assert any("embedding table" in n for n in corr.notes)
    remove_blocks(model, [0, 1])
    apply_maps(model, corr, 6, [0, 1])
    assert model.get_output_embeddings().weight is not model.get_input_embeddings().weight
    assert torch.equal(model.get_output_embeddings().weight, head)
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=False).logits
    assert_close(out, ref, rtol=1e-6, atol=1e-6)
    save_pretrained(model, tok, tmp_path, {"original_num_layers": 6, "pruned_layers": [0, 1], "solver": "stock"})
    assert json.loads((tmp_path / "config.json").read_text())["tie_word_embeddings"] is False
    _, theirs = _plain_reload(tmp_path, ids)
    assert_close(theirs, out, rtol=0, atol=0)


def test_stock_refuses_gemma3_in_one_line_naming_what_to_use():
    model, _ = build_tiny_model("gemma3", num_hidden_layers=6)
    with pytest.raises(ConfigError) as e:
        CalibrationModule(model, [2, 3], CalibrationConfig(solver="stock"))
    msg = str(e.value)
    assert "\n" not in msg and "gemma3" in msg and "lra_replaceme" in msg and "trust_remote_code" in msg


def test_stock_statistics_sum_the_same_on_a_second_pass():
    """``add_statistics`` carries the down_proj statistics: two passes over halves equal one pass over all."""
    model, tok = build_tiny_model("llama", num_hidden_layers=6, dtype=torch.float64)
    win = _windows(tok)
    whole = _fit(copy.deepcopy(model), [3], {"stock": {}}, win)
    a = _fit(copy.deepcopy(model), [3], {"stock": {}}, win.subset(range(0, 4)))
    b = _fit(copy.deepcopy(model), [3], {"stock": {}}, win.subset(range(4, 8)))
    a.add_statistics(b)
    a.solve()
    key = whole.spans[0].key
    assert_close(a.statistics[key].down.buffer, whole.statistics[key].down.buffer, rtol=1e-10, atol=1e-8)
    assert_close(a.solution(a.spans[0]).W, whole.solution(whole.spans[0]).W, rtol=1e-6, atol=1e-8)


@pytest.mark.parametrize("removed", [[2, 3], [0, 1]])
def test_stock_adapter_only_folder_folds_the_maps_again_bit_for_bit(removed, tmp_path):
    """The one-job recovery keeps its corrected base as an adapter-only folder: the stock updates are stored
    (float64, as fitted) and folded into the rebuilt base again, giving the in-memory weights bit for bit (the
    embedding fold is a product, ``E Wᵀ``, whose float64 rounding may differ with the buffers' alignment: there to
    1e-15)."""
    from dataclasses import asdict

    from shift_lightning.checkpoint import save_adapters

    mcfg = ModelConfig(tiny={"family": "llama"}, dtype="float64")
    model, tok = load_pretrained(mcfg)
    base_embedding = model.get_input_embeddings().weight.detach().clone()
    mod = _fit(model, removed, {"stock": {}}, _windows(tok), damping=1e-4)
    corr = mod.fitted_maps("stock")
    remove_blocks(model, removed)
    apply_maps(model, corr, 6, removed)
    kept = [i for i in range(6) if i not in removed]
    save_adapters(model, tok, tmp_path, {"original_num_layers": 6, "pruned_layers": removed, "solver": "stock"},
                  asdict(mcfg), down={kept.index(i): wb for i, wb in corr.down_maps.items()}, embedding=corr.embedding)
    loaded, _ = load_pretrained(tmp_path)
    mine, theirs = model.state_dict(), loaded.state_dict()
    assert mine.keys() == theirs.keys()
    assert [k for k in mine if not torch.equal(mine[k], theirs[k])] in ([], ["model.embed_tokens.weight"])
    assert_close(theirs["model.embed_tokens.weight"], mine["model.embed_tokens.weight"], rtol=1e-15, atol=1e-15)
    assert torch.equal(theirs["model.embed_tokens.weight"], base_embedding) == (0 not in removed)


def test_stock_with_the_kept_block_refit_stays_a_plain_folder(tmp_path, monkeypatch):
    """``--calibration.solver stock --calibration.refit.kept 1`` (the best stock repair): the re-fit changes only
    the kept block's own weights, so the folder is still a plain Llama folder — no ``auto_map``, no custom code,
    ``refit_blocks`` recorded — and ``AutoModelForCausalLM`` gives ``load_pretrained``'s logits, bit for bit,
    which are the in-memory model's. The re-fitted block differs from the same job without the re-fit."""
    import shift_lightning.maps.keptfit as K
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    kw = dict(model=ModelConfig(tiny={"family": "llama"}), data=TextDataConfig(source=CORPUS, num_samples=8, seq_len=48),
              heldout=TextDataConfig(num_samples=0), prune=PruneConfig(layers=[2, 3]),
              trainer={"accelerator": "cpu", "enable_progress_bar": False})
    plain = run_calibration(**kw, calibration=CalibrationConfig(solver="stock"), output_dir=None)
    scores = iter([1.0, 0.5])  # the guard keeps the re-fit of block 4
    monkeypatch.setattr(K, "heldout_kl", lambda *a, **k: next(scores))
    out = tmp_path / "run"
    res = run_calibration(**kw, calibration=CalibrationConfig(solver="stock", refit={"kept": 1}), output_dir=str(out))
    assert res.report.refit["kept"] == [4]
    a, b = plain.model.model.layers, res.model.model.layers
    for i in range(len(a)):  # pruned position 2 = original block 4, the first kept after the span
        assert all(torch.equal(p, q) for p, q in zip(a[i].parameters(), b[i].parameters())) == (i != 2), i
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["model_type"] == "llama" and "auto_map" not in cfg and cfg["num_hidden_layers"] == 4
    assert not (out / "modeling_shift.py").exists()
    assert load_file(str(out / "lra.safetensors")) == {}  # no adapter and no map: every weight is in model.safetensors
    spec = json.loads((out / "shift_config.json").read_text())
    assert spec["refit_blocks"] == [2] and spec["solver"] == "stock"
    assert "A plain `llama` folder" in (out / "README.md").read_text()
    ids = res.tokenizer("Round trip through a plain folder", return_tensors="pt").input_ids
    loaded, _ = load_pretrained(out)
    hf = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        mine, theirs, ref = (m(input_ids=ids, use_cache=False).logits for m in (loaded, hf, res.model))
    assert torch.equal(mine, theirs) and torch.equal(theirs, ref)


# ------------------------------------------------------------------------------------------------
# The recipe end to end: stock repair + LoRA recovery -> a plain folder, a PEFT adapter on the stock base, GGUF
# ------------------------------------------------------------------------------------------------
def _stock_lora_args(out, *extra):
    return ["--config", "tiny_lora.yaml", "--calibration.solver", "stock", "--output_dir", str(out),
            "--zeroshot.tasks", "", "--trainer.max_steps", "4", "--trainer.val_check_interval", "4",
            "--trainer.logger.save_dir", str(out.parent / "runs"), *extra]


@pytest.fixture(scope="module")
def stock_lora(tmp_path_factory):
    """``train.py --config tiny_lora.yaml --calibration.solver stock --recovery.train_lra false``: blocks 2-3 of a
    6-block tiny Llama pruned, block 1's down_proj re-fitted, LoRA r=4 on attention + MLP for 4 steps."""
    from shift_lightning.recipes import cli

    out = tmp_path_factory.mktemp("stock_lora") / "out"
    result = cli.train_main(_stock_lora_args(out, "--recovery.train_lra", "false"))
    assert result.report.steps == 4
    return out


def test_stock_lora_training_exports_a_plain_folder_of_its_family(stock_lora):
    from safetensors.torch import load_file

    for folder in (stock_lora, stock_lora / "base"):
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLM"], folder
        assert "auto_map" not in cfg and cfg["num_hidden_layers"] == 4, folder
        assert load_file(str(folder / "lra.safetensors")) == {}  # every weight is in model.safetensors
    assert not list(stock_lora.rglob("*.py"))  # no remote code anywhere in the export
    spec = json.loads((stock_lora / "shift_config.json").read_text())
    assert spec["solver"] == "stock" and spec["pruned_layers"] == [2, 3] and spec["recovered"] is True
    report = json.loads((stock_lora / "recovery_report.json").read_text())
    assert report["recovery"]["train_lra"] is False and report["trainable_params"] > 0


def test_stock_lora_folder_loads_in_transformers_to_the_projects_logits_bit_for_bit(stock_lora):
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[1, 5, 17, 42, 99, 3, 250, 7]])
    mine, _ = load_pretrained(stock_lora)
    theirs = AutoModelForCausalLM.from_pretrained(stock_lora)  # no trust_remote_code
    base, _ = load_pretrained(stock_lora / "base")
    with torch.no_grad():
        a, b, c = (m(input_ids=ids, use_cache=False).logits for m in (mine, theirs, base))
    assert type(theirs).__name__ == "LlamaForCausalLM"
    assert torch.equal(a, b)
    assert (a - c).abs().max() > 1e-4  # the merged LoRA changed the stock base: not the base compared with itself


def test_stock_lora_peft_adapter_sits_on_the_plain_stock_base(stock_lora):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    lora, base_dir = stock_lora / "lora", stock_lora / "base"
    cfg = json.loads((lora / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["r"] == 4 and not cfg["modules_to_save"]
    assert cfg["base_model_name_or_path"] == str(base_dir.resolve())
    assert (lora / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(base_dir)  # the stock base: plain too
    assert type(base).__name__ == "LlamaForCausalLM" and base.config.num_hidden_layers == 4
    ids = torch.tensor([[1, 5, 17, 42, 99, 3, 250, 7]])
    merged, _ = load_pretrained(stock_lora)
    with torch.no_grad():
        want = merged(input_ids=ids, use_cache=False).logits
        got = PeftModel.from_pretrained(base, lora)(input_ids=ids, use_cache=False).logits
    assert_close(got, want, rtol=0, atol=1e-5)


def test_stock_lora_folder_exports_to_gguf_with_the_converter(stock_lora, tmp_path, fake_llama_cpp):
    """The export's own checks (a plain folder, weights, tokenizer) pass and its layer metadata check agrees; the
    converter is tests/test_gguf.py's stand-in (llama.cpp's own one: tests/test_llama_cpp.py, -m slow)."""
    from shift_lightning.export.gguf import check_layer_metadata, export_gguf
    from shift_lightning.recipes import gguf as recipe

    out = export_gguf(stock_lora, tmp_path / "stock.q8_0.gguf", "q8_0", llama_cpp=fake_llama_cpp)
    assert check_layer_metadata(out, 4, original_num_layers=6).block_count == 4
    assert recipe.main(["--model", str(stock_lora / "base"), "--out", str(tmp_path / "base.gguf"),
                        "--llama_cpp", str(fake_llama_cpp)]).is_file()


def test_stock_lora_asked_to_train_the_maps_is_refused_before_any_pass_naming_the_fix(tmp_path, monkeypatch, capsys):
    from shift_lightning.recipes import calibrate as C, cli, train as T
    from shift_lightning.recovery import RecoveryConfig, RecoveryModule
    from shift_lightning.maps.surgery import attach_adapters

    def never(*a, **k):
        raise AssertionError("a model was loaded before the request was checked")

    for mod in (C, T):
        monkeypatch.setattr(mod, "load_pretrained", never)
    out = tmp_path / "o"
    for extra, fix in ([[], "set --recovery.train_lra false"],  # tiny_lora.yaml asks for train_lra: true
                       [["--recovery.method", "lra"], "use --recovery.method lora or partial"]):
        with pytest.raises(SystemExit) as e:
            cli.train_main(_stock_lora_args(out, *extra))
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and "Traceback" not in err, err
        line = err.splitlines()[0]
        assert "--calibration.solver stock folds its maps into the model's existing weights" in line, line
        assert fix in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == []  # no output, calibration, checkpoint or runs folder
    model, _ = build_tiny_model("llama", num_hidden_layers=4)
    attach_adapters(model, {})  # an injected stock model: an adapter set with nothing in it
    with pytest.raises(ConfigError, match="recovery.train_lra needs a model with adapters"):
        RecoveryModule(model, RecoveryConfig(train_lra=True))


def test_a_calibrated_stock_folder_asked_to_train_the_maps_is_refused_before_loading(stock_lora, tmp_path, monkeypatch,
                                                                                      capsys):
    from shift_lightning.recipes import cli, train as T

    def never(*a, **k):
        raise AssertionError("a model was loaded before the request was checked")

    monkeypatch.setattr(T, "load_pretrained", never)
    cal = stock_lora.with_name(stock_lora.name + ".calibration")  # the stock job's own calibrated folder
    with pytest.raises(SystemExit) as e:
        cli.train_main(_stock_lora_args(tmp_path / "o", "--model.tiny", "null", "--model.name_or_path", str(cal)))
    line = capsys.readouterr().err.splitlines()[0]
    assert e.value.code == 2 and f"the calibrated folder {cal} holds none (solver stock)" in line, line
    assert "set --recovery.train_lra false" in line and not list(tmp_path.iterdir())
