"""A saved folder works where a Hugging Face model works: ``from_pretrained(..., trust_remote_code=True)``
(and a refusal without it), lm-evaluation-harness (``--model shift``), PEFT (the recovery's adapter
folder) and a model card. Tiny random models; the SmolLM2 / Gemma3 checks are in
``tests/test_lm_eval_parity.py`` (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from harness_data import write_local_tasks
from shift_lightning import load_pretrained
from shift_lightning.arch import decoder_layers
from shift_lightning.calibration import CalibrationConfig
from shift_lightning.checkpoint import save_pretrained
from shift_lightning.maps.lra import AdapterSpec, LinearResidualAdapter
from shift_lightning.models import build_tiny_model
from shift_lightning.maps.peers import fold_replaceme
from shift_lightning.maps.surgery import attach_adapters, remove_blocks

ROOT = Path(__file__).resolve().parents[1]
TINY_DATA = ROOT / "tests" / "data" / "eval_tiny"
CORPUS = str(ROOT / "tests" / "data" / "tiny_corpus.txt")
HELDOUT = str(ROOT / "tests" / "data" / "tiny_heldout.txt")
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore",
       "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


def _adapter(spec: AdapterSpec, seed: int) -> LinearResidualAdapter:
    a = LinearResidualAdapter(spec)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in a.parameters():
            p.copy_(p + 0.1 * torch.randn(p.shape, generator=g))
    return a


def _pruned_corrected(family: str, **kw):
    """Blocks 1, 2 of 6 removed; a full-rank LRA, a chain (affine + no-bias residual) and a low-rank LRA
    at the final norm; Gemma3 also a ReplaceMe map on a post-MLP norm."""
    model, tok = build_tiny_model(family, **kw)
    remove_blocks(model, [1, 2])
    d = model.config.hidden_size
    attach_adapters(model, {1: _adapter(AdapterSpec(d), 1),
                            2: nn.Sequential(_adapter(AdapterSpec(d, "affine"), 2), _adapter(AdapterSpec(d, bias=False), 3)),
                            4: _adapter(AdapterSpec(d, rank=4), 4)})
    if family == "gemma3":
        T = torch.eye(d, dtype=torch.float64) + 0.05 * torch.randn(d, d, generator=torch.Generator().manual_seed(5),
                                                                   dtype=torch.float64)
        fold_replaceme(decoder_layers(model)[0], T)
    spec = {"original_num_layers": 6, "pruned_layers": [1, 2], "base_model": {"tiny": {"family": family}},
            "criterion": "explicit", "solver": "lra"}
    return model, tok, spec


# ------------------------------------------------------------------------------------------------
# from_pretrained: opt-in remote code, identical logits; refused without it
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_from_pretrained_with_remote_code_equals_load_pretrained(family, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    model, tok, spec = _pruned_corrected(family)
    folder = tmp_path / f"pruned_{family}"
    save_pretrained(model, tok, folder, spec)
    cfg = json.loads((folder / "config.json").read_text())
    base_type = "gemma3_text" if family == "gemma3" else family
    assert cfg["model_type"] == f"shift_{base_type}" and "AutoModelForCausalLM" in cfg["auto_map"]
    assert (folder / "modeling_shift.py").is_file()

    ids = tok("The pruned model keeps its adapters, also here.", return_tensors="pt").input_ids
    ref_model, _ = load_pretrained(folder)
    assert type(ref_model.config).model_type == base_type  # the stock family config, none of the folder's code
    ref = ref_model(ids).logits
    assert torch.equal(ref, model(ids).logits)

    remote = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    diff = (remote(ids).logits - ref).abs().max().item()
    print(f"\n{family}: max |logits(from_pretrained, trust_remote_code) - logits(load_pretrained)| = {diff:.3e}")
    assert diff <= 1e-6
    greedy = dict(max_new_tokens=8, do_sample=False)
    assert torch.equal(remote.generate(ids, **greedy), ref_model.generate(ids, **greedy))
    rtok = AutoTokenizer.from_pretrained(folder, trust_remote_code=True)
    assert rtok("same ids").input_ids == tok("same ids").input_ids

    # without trust_remote_code: a refusal, never the stock model without its adapters
    for kw in ({}, {"trust_remote_code": False}):
        with pytest.raises(ValueError, match="trust_remote_code=True"):
            AutoModelForCausalLM.from_pretrained(folder, **kw)
        with pytest.raises(ValueError, match="trust_remote_code=True"):
            AutoConfig.from_pretrained(folder, **kw)

    # the remote model saves the same layout back
    remote.save_pretrained(tmp_path / "resaved")
    tok.save_pretrained(tmp_path / "resaved")
    assert torch.equal(load_pretrained(tmp_path / "resaved")[0](ids).logits, ref)

    # load_pretrained never runs the folder's code
    (folder / "modeling_shift.py").write_text("raise RuntimeError('this file must not run')\n")
    assert torch.equal(load_pretrained(folder)[0](ids).logits, ref)


def test_auto_map_alone_would_be_ignored_silently(tmp_path):
    """Why the model_type changes: with a stock ``model_type``, transformers 5.x uses its own class when
    ``trust_remote_code`` is False or unset and ignores ``auto_map``, i.e. drops the adapters silently."""
    from transformers import AutoModelForCausalLM

    model, tok, spec = _pruned_corrected("llama")
    save_pretrained(model, tok, tmp_path / "m", spec)
    doc = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**doc, "model_type": "llama"}))
    for kw in ({}, {"trust_remote_code": False}):
        plain = AutoModelForCausalLM.from_pretrained(tmp_path / "m", **kw)
        assert type(plain).__name__ == "LlamaForCausalLM" and not hasattr(plain.model, "shift_adapters")
    assert hasattr(AutoModelForCausalLM.from_pretrained(tmp_path / "m", trust_remote_code=True).model, "shift_adapters")


def test_a_folder_without_adapters_stays_a_stock_hf_folder(tmp_path):
    from transformers import AutoModelForCausalLM

    model, tok = build_tiny_model("llama")
    remove_blocks(model, [2])
    save_pretrained(model, tok, tmp_path / "plain", {"original_num_layers": 6, "pruned_layers": [2]})
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["model_type"] == "llama"
    assert not (tmp_path / "plain" / "modeling_shift.py").exists()
    ids = tok("no adapters", return_tensors="pt").input_ids
    plain = AutoModelForCausalLM.from_pretrained(tmp_path / "plain")
    assert torch.equal(plain(ids).logits, load_pretrained(tmp_path / "plain")[0](ids).logits)


# ------------------------------------------------------------------------------------------------
# lm-evaluation-harness: --model shift == evaluate.py
# ------------------------------------------------------------------------------------------------
@pytest.mark.extended
def test_lm_eval_shift_model_scores_like_evaluate_py(tmp_path):
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    import shift_lightning.lmeval  # noqa: F401  (registers --model shift)

    model, tok, spec = _pruned_corrected("llama", max_position_embeddings=2048)
    folder = tmp_path / "pruned"
    save_pretrained(model, tok, folder, spec)
    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    names = write_local_tasks(tasks_dir, data_dir=str(TINY_DATA), prefix="tiny")
    ours_tasks = [n[len("tiny_"):] for n in names]

    # evaluate.py on the folder (float64: ties cannot flip between the two batchings)
    r = subprocess.run([sys.executable, "evaluate.py", "--model.name_or_path", str(folder), "--model.dtype", "float64",
                        "--tasks", ",".join(ours_tasks), "--data_dir", str(tasks_dir), "--kl", "false",
                        "--progress", "false", "--trainer.accelerator", "cpu", "--trainer.enable_progress_bar", "false",
                        "--output_dir", str(tmp_path / "ours")], cwd=ROOT, env=ENV, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    ours = json.loads((tmp_path / "ours" / "eval_results.json").read_text())["tasks"]

    # the documented command line: python -m shift_lightning.lmeval --model shift ...
    r = subprocess.run([sys.executable, "-m", "shift_lightning.lmeval", "--model", "shift", "--model_args",
                        f"pretrained={folder},dtype=float64", "--tasks", ",".join(names), "--include_path",
                        str(tasks_dir), "--device", "cpu", "--batch_size", "4", "--output_path",
                        str(tmp_path / "harness")], cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    cli = json.loads(next((tmp_path / "harness").rglob("results_*.json")).read_text())["results"]

    # the Python API, by name, with per-doc samples
    api = simple_evaluate(model="shift", model_args=f"pretrained={folder},dtype=float64", tasks=names,
                          task_manager=TaskManager(include_path=str(tasks_dir)), num_fewshot=0, log_samples=True,
                          bootstrap_iters=0, device="cpu", batch_size=4)
    # lm-eval's own `--model hf` runs the folder's remote code when allowed, and refuses it otherwise
    hf = simple_evaluate(model="hf", model_args=f"pretrained={folder},dtype=float64,trust_remote_code=True",
                         tasks=names, task_manager=TaskManager(include_path=str(tasks_dir)), num_fewshot=0,
                         bootstrap_iters=0, device="cpu", batch_size=4)
    with pytest.raises(ValueError, match="trust_remote_code=True"):
        simple_evaluate(model="hf", model_args=f"pretrained={folder}", tasks=names[:1], device="cpu",
                        task_manager=TaskManager(include_path=str(tasks_dir)))
    lines = []
    for name, t in zip(names, ours_tasks):
        mine = ours[t]
        for res in (cli[name], api["results"][name], hf["results"][name]):
            assert res["acc,none"] == pytest.approx(mine["acc"], abs=1e-12), t
            if "acc_norm,none" in res:
                assert res["acc_norm,none"] == pytest.approx(mine["acc_norm"], abs=1e-12), t
        samples = sorted(api["samples"][name], key=lambda s: s["doc_id"])
        per_doc = dict(zip(mine["per_doc"]["doc_ids"], mine["per_doc"]["acc"]))
        assert [s["acc"] for s in samples] == [per_doc[s["doc_id"]] for s in samples], t
        lines.append(f"{t}: n={mine['n']} acc {mine['acc']:.4f}" + (f" acc_norm {mine['acc_norm']:.4f}"
                                                                      if "acc_norm,none" in cli[name] else ""))
    print("\n" + "\n".join(lines))


# ------------------------------------------------------------------------------------------------
# PEFT: the recovery's adapter folder on top of the corrected base == the merged model
# ------------------------------------------------------------------------------------------------
def test_peft_adapter_folder_reproduces_the_merged_model(tmp_path):
    import lightning as L
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shift_lightning.criteria import PruneConfig
    from shift_lightning.data import TextDataConfig
    from shift_lightning.lmeval import ShiftLM
    from shift_lightning.models import ModelConfig
    from shift_lightning.recipes.calibrate import run_calibration
    from shift_lightning.recipes.train import run_training
    from shift_lightning.recovery import RecoveryConfig

    run_calibration(model=ModelConfig(tiny={"family": "llama"}), data=TextDataConfig(source=CORPUS, num_samples=8, seq_len=48),
                    heldout=TextDataConfig(num_samples=0), prune=PruneConfig(layers=[2, 3]),
                    trainer={"accelerator": "cpu", "enable_progress_bar": False}, output_dir=str(tmp_path / "cal"))
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=4, val_check_interval=2, check_val_every_n_epoch=None,
                        inference_mode=False, use_distributed_sampler=False, enable_checkpointing=False,
                        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False, logger=False)
    out = tmp_path / "out"
    run_training(trainer, model=ModelConfig(name_or_path=str(tmp_path / "cal")),
                 train_data=TextDataConfig(source=CORPUS, num_samples=16, seq_len=48, batch_size=4),
                 val=TextDataConfig(source=HELDOUT, num_samples=4, seq_len=48),
                 recovery=RecoveryConfig(method="lora", train_lra=True, lora_r=4, lr=5e-3, lora_dropout=0.0),
                 output_dir=str(out))
    adapter_cfg = json.loads((out / "lora" / "adapter_config.json").read_text())
    assert adapter_cfg["peft_type"] == "LORA" and adapter_cfg["modules_to_save"] == ["shift_adapters.sites.2"]
    assert adapter_cfg["base_model_name_or_path"] == str((out / "base").resolve())
    assert (out / "lora" / "adapter_model.safetensors").is_file() and (out / "lora" / "README.md").is_file()
    base_spec, spec = (json.loads((d / "shift_config.json").read_text()) for d in (out / "base", out))
    assert base_spec["recovered"] is False and spec["recovered"] and spec["base_model"] == {"tiny": {"family": "llama"}}
    assert "recovery metric" in (out / "README.md").read_text()
    assert "recovery metric" not in (out / "base" / "README.md").read_text()  # the base is before recovery

    merged, tok = load_pretrained(out)
    ids = tok("After recovery the model", return_tensors="pt").input_ids
    want = merged(ids).logits
    base, _ = load_pretrained(out / "base")
    assert (base(ids).logits - want).abs().max() > 1e-2  # recovery changed the model
    before = {k: v.clone() for k, v in base.model.shift_adapters.state_dict().items()}
    peft_model = PeftModel.from_pretrained(base, out / "lora")
    got = peft_model(ids).logits
    diff = (got - want).abs().max().item()
    print(f"\nmax |logits(PeftModel(base, lora)) - logits(merged)| = {diff:.3e}")
    assert diff <= 1e-5
    trained = base.model.shift_adapters.sites["2"].modules_to_save["default"].state_dict()
    assert any(not torch.equal(before[f"sites.2.{k}"], v) for k, v in trained.items())  # the trained LRA came along
    assert (peft_model.merge_and_unload()(ids).logits - want).abs().max() <= 1e-5
    # the same on a base loaded by transformers alone, and through --model shift with peft=
    remote = AutoModelForCausalLM.from_pretrained(out / "base", trust_remote_code=True)
    assert (PeftModel.from_pretrained(remote, out / "lora")(ids).logits - want).abs().max() <= 1e-5
    lm = ShiftLM(pretrained=str(out / "base"), peft=str(out / "lora"), device="cpu")
    assert (lm.model(ids).logits - want).abs().max() <= 1e-5
    # the documented command line with peft= scores like the merged folder
    from lm_eval import simple_evaluate
    from lm_eval.tasks import TaskManager

    tasks_dir = tmp_path / "tasks"
    tasks_dir.mkdir()
    names = write_local_tasks(tasks_dir, tasks=["arc_easy", "piqa"], data_dir=str(TINY_DATA), prefix="tiny")
    r = subprocess.run([sys.executable, "-m", "shift_lightning.lmeval", "--model", "shift", "--model_args",
                        f"pretrained={out / 'base'},peft={out / 'lora'}", "--tasks", ",".join(names), "--include_path",
                        str(tasks_dir), "--device", "cpu", "--output_path", str(tmp_path / "harness")],
                       cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    cli = json.loads(next((tmp_path / "harness").rglob("results_*.json")).read_text())["results"]
    merged_res = simple_evaluate(model="shift", model_args=f"pretrained={out}", tasks=names, device="cpu",
                                 task_manager=TaskManager(include_path=str(tasks_dir)), bootstrap_iters=0)["results"]
    for n in names:
        assert (cli[n]["acc,none"], cli[n]["acc_norm,none"]) == (merged_res[n]["acc,none"], merged_res[n]["acc_norm,none"])


# ------------------------------------------------------------------------------------------------
# Model card
# ------------------------------------------------------------------------------------------------
def _front_matter(text: str) -> dict:
    import yaml

    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---", 2)[1])


def test_model_card_says_what_was_done_and_measured(tmp_path):
    from shift_lightning.criteria import PruneConfig
    from shift_lightning.data import TextDataConfig
    from shift_lightning.evaluation.runner import EvalConfig
    from shift_lightning.models import ModelConfig
    from shift_lightning.recipes.calibrate import run_calibration

    res = run_calibration(model=ModelConfig(tiny={"family": "llama", "max_position_embeddings": 2048}),
                          data=TextDataConfig(source=CORPUS, num_samples=8, seq_len=48),
                          heldout=TextDataConfig(num_samples=0), prune=PruneConfig(layers=[2, 3]),
                          trainer={"accelerator": "cpu", "enable_progress_bar": False},
                          evaluate=EvalConfig(tasks="arc_easy,piqa", data_dir=str(TINY_DATA), ppl=HELDOUT,
                                              ppl_seq_len=64, ppl_max_windows=2, progress=False),
                          evaluate_baselines=True, output_dir=str(tmp_path / "m"),
                          command="python calibrate.py --config tiny.yaml --output_dir m")
    card = (tmp_path / "m" / "README.md").read_text()
    meta = _front_matter(card)
    assert meta["license"] == "other" and meta["library_name"] == "transformers" and "depth-pruning" in meta["tags"]
    params = sum(p.numel() for p in res.model.model.shift_adapters.parameters())
    solver = CalibrationConfig().solver  # the default map
    for needle in ("2 of 6: `[2, 3]`", "chosen by `explicit`", f"`{solver}`", f"{params:,} parameters",
                   "8 × 48 tokens", "`python calibrate.py --config tiny.yaml --output_dir m`",
                   "| arc_easy (acc, n=6) |", "| PPL ", "KL(original ‖ model)", "top-1 agreement", "original", f"pruned+{solver}",
                   "trust_remote_code=True", "a randomly initialised test model"):
        assert needle in card, needle
    # an adapter-only folder has a card too, saying so
    run_calibration(model=ModelConfig(tiny={"family": "llama"}), data=TextDataConfig(source=CORPUS, num_samples=8, seq_len=48),
                    heldout=TextDataConfig(num_samples=0), prune=PruneConfig(layers=[2]), save_model="adapters",
                    trainer={"accelerator": "cpu", "enable_progress_bar": False}, output_dir=str(tmp_path / "a"))
    card = (tmp_path / "a" / "README.md").read_text()
    assert _front_matter(card)["license"] == "other" and "adapter-only" in card and "no zero-shot" in card
    # --model shift takes an adapter-only folder too (whatever load_pretrained loads)
    from shift_lightning.lmeval import ShiftLM

    ref, tok = load_pretrained(tmp_path / "a")
    ids = tok("adapter-only", return_tensors="pt").input_ids
    assert torch.equal(ShiftLM(pretrained=str(tmp_path / "a"), device="cpu").model(ids).logits, ref(ids).logits)


def test_card_says_what_a_built_in_calibration_corpus_is():
    from shift_lightning.card import CardFacts, model_card

    def row(source):
        card = model_card({"original_num_layers": 4, "pruned_layers": [1], "base_model": "smollm2-135m"}, None,
                          CardFacts(calibration={"data": {"source": source, "num_samples": 2, "seq_len": 8},
                                                 "calibration_tokens": 16}))
        return next(line for line in card.splitlines() if "calibration data" in line)

    assert "CoQA stories" in row("mixed") and "Wikipedia" in row("wiki_summaries")
    assert row("my.txt") == "| calibration data | `my.txt`: 2 × 8 tokens (16 tokens) |"  # a file speaks for itself


def test_license_is_inherited_from_the_base_model(tmp_path):
    from shift_lightning.card import base_model_info

    assert (base_model_info("smollm2-135m").license, base_model_info("smollm2-135m").hub_id) == \
        ("apache-2.0", "HuggingFaceTB/SmolLM2-135M-Instruct")
    assert base_model_info("gemma3-270m").license == "gemma"
    assert base_model_info("meta-llama/Llama-3.1-8B").license == "llama3.1"
    assert base_model_info("HuggingFaceTB/SmolLM2-1.7B").license == "apache-2.0"
    (tmp_path / "README.md").write_text("---\nlicense: mit\ntags: [x]\n---\n# a model\n")
    assert base_model_info(str(tmp_path)).license == "mit"
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")  # a GGUF's general.license
    w.add_license("bsd-3-clause")
    w.add_tensor("x", np.zeros(4, dtype=np.float32))
    w.write_header_to_file(), w.write_kv_data_to_file(), w.write_tensors_to_file(), w.close()
    assert base_model_info(str(tmp_path / "m.gguf")).license == "bsd-3-clause"
    unknown = base_model_info("someone/some-model")
    assert unknown.license == "other" and "could not be determined" in unknown.note
    assert base_model_info({"tiny": {"family": "qwen2"}}).license == "other"


@pytest.fixture(scope="module")
def folder_with_maps(tmp_path_factory):
    from shift_lightning.calibration import CalibrationConfig
    from shift_lightning.criteria import PruneConfig
    from shift_lightning.data import TextDataConfig
    from shift_lightning.models import ModelConfig
    from shift_lightning.recipes.calibrate import run_calibration

    out = tmp_path_factory.mktemp("lmeval") / "maps"
    corpus = str(ROOT / "tests" / "data" / "tiny_corpus.txt")
    run_calibration(model=ModelConfig(tiny={"family": "llama", "num_hidden_layers": 4}), prune=PruneConfig(layers=[2]),
                    data=TextDataConfig(source=corpus, num_samples=4, seq_len=32), calibration=CalibrationConfig(),
                    heldout=TextDataConfig(source=corpus, num_samples=0),
                    trainer=dict(accelerator="cpu", enable_progress_bar=False), output_dir=str(out))
    return out


@pytest.mark.parametrize("argv,match", [
    (["--model", "shift"], "--model shift needs --model_args pretrained="),
    (["--model", "shift", "--model_args", "pretrained={maps},dtype=float13"], "dtype=float13: not a dtype here"),
    (["--model", "shift", "--model_args", "pretrained={maps},peft={pickled}"], "(only adapter_model.bin: a pickle"),
    (["--model", "hf", "--model_args", "pretrained={maps}"], "which --model hf cannot run"),
])
def test_the_lm_eval_entry_point_gives_one_line_for_ours(argv, match, folder_with_maps, tmp_path, capsys,
                                                         monkeypatch):
    """Mistakes about our models through ``python -m shift_lightning.lmeval`` (no model arguments, an unknown
    dtype, a PEFT adapter saved as a pickle, ``--model hf`` on a folder with maps): one ``error:`` line, exit 2,
    before the harness indexes its tasks (seconds); the harness's own errors keep its conventions."""
    pytest.importorskip("lm_eval")
    import lm_eval.tasks

    from shift_lightning import lmeval

    def indexed(*a, **k):
        raise AssertionError("the harness indexed its tasks before the error")

    monkeypatch.setattr(lm_eval.tasks.TaskManager, "__init__", indexed)

    (tmp_path / "lora").mkdir()
    (tmp_path / "lora" / "adapter_model.bin").write_bytes(b"\\x80\\x04N.")  # a pickle: never unpickled
    args = [a.format(maps=folder_with_maps, pickled=tmp_path / "lora") for a in argv]
    with pytest.raises(SystemExit) as e:
        lmeval.main([*args, "--tasks", "arc_easy", "--device", "cpu", "--limit", "1"])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # (lm-eval's log handlers may hold a closed stream)
    assert e.value.code == 2 and last.startswith("error: ") and match in last, last
