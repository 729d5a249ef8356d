"""Safety rules: nothing runs that should not, nothing the user made is lost, nothing silently wrong.

One test per case (grouped where one rule covers several). The three rules:

* what a folder may ask for (:func:`shift_lightning.remote_code.trust_kwargs`): nothing a folder says
  turns remote code on;
* what the tool may delete (:mod:`shift_lightning.outputs.ownership`): a leftover is recognised by an owner
  file written inside it and a dead owner, never by its name alone;
* non-finite is never success (:mod:`shift_lightning.finite`): a non-finite metric or weight ends
  the run with one error line and exit 2.
"""

from __future__ import annotations

import builtins
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from test_faults import _error  # the one error line of a refused run (exit 2, no traceback)

from shift_lightning.recipes import cli

ROOT = Path(__file__).resolve().parents[1]
CORPUS = str(ROOT / "tests" / "data" / "tiny_corpus.txt")
FAST = ["--trainer.enable_progress_bar", "false"]


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)


def _calibrate(out: Path, model=None, save_model=True) -> Path:
    from shift_lightning.criteria import PruneConfig
    from shift_lightning.data import TextDataConfig
    from shift_lightning.models import ModelConfig
    from shift_lightning.recipes.calibrate import run_calibration

    run_calibration(model=model or ModelConfig(tiny={"family": "llama", "max_position_embeddings": 512}),
                    data=TextDataConfig(source=CORPUS, num_samples=4, seq_len=32),
                    heldout=TextDataConfig(num_samples=0), prune=PruneConfig(layers=[2, 3]),
                    trainer={"accelerator": "cpu", "enable_progress_bar": False}, output_dir=str(out),
                    save_model=save_model)
    return out


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    return _calibrate(tmp_path_factory.mktemp("saved") / "cal")


def _edit_json(path: Path, change) -> None:
    doc = json.loads(path.read_text())
    change(doc)
    path.write_text(json.dumps(doc))


def _evil_code(folder: Path, module: str, pwned: Path) -> None:
    (folder / f"{module}.py").write_text(f"open({str(pwned)!r}, 'w').write('ran')\n")


# ================================================================================================
# Code runs that should not (rule: what a folder may ask for)
# ================================================================================================
def test_a_tokenizer_auto_map_in_a_folder_never_runs_its_code(saved, tmp_path, monkeypatch, capsys):
    from shift_lightning import load_pretrained
    from shift_lightning.models import ModelLoadError

    monkeypatch.setattr(builtins, "input", lambda *a, **k: "y")  # a user answering "y" to the prompt
    pwned = tmp_path / "PWNED"
    d = tmp_path / "m"
    shutil.copytree(saved, d)
    _evil_code(d, "evil_tok", pwned)
    _edit_json(d / "tokenizer_config.json", lambda doc: doc.update(
        tokenizer_class="EvilTokenizer", auto_map={"AutoTokenizer": ["evil_tok.EvilTokenizer", "evil_tok.EvilTokenizer"]}))
    with pytest.raises(ModelLoadError, match="names code of the folder .auto_map.*--model.trust_remote_code true"):
        load_pretrained(d)
    assert not pwned.exists()
    line = _error(cli.evaluate_main, ["--config", "eval_tiny.yaml", "--model.tiny", "null", "--model.name_or_path",
                                      str(d), "--output_dir", str(tmp_path / "e")], capsys)  # evaluate.py: the same
    assert "auto_map" in line and not pwned.exists()


def test_an_adapter_only_record_cannot_turn_on_the_base_folders_code(tmp_path, monkeypatch):
    from shift_lightning import load_pretrained
    from shift_lightning.models import ModelConfig, build_tiny_model

    monkeypatch.setattr(builtins, "input", lambda *a, **k: "y")
    base = tmp_path / "base"
    model, tok = build_tiny_model("llama")
    model.save_pretrained(base)
    tok.save_pretrained(base)
    d = _calibrate(tmp_path / "ad", model=ModelConfig(name_or_path=str(base)), save_model="adapters")
    pwned = tmp_path / "PWNED"
    _evil_code(base, "evil_model", pwned)
    _edit_json(base / "config.json", lambda doc: doc.update(
        auto_map={"AutoConfig": "evil_model.C", "AutoModelForCausalLM": "evil_model.M"}))
    _edit_json(d / "shift_config.json", lambda doc: doc["base_model"].update(trust_remote_code=True))
    load_pretrained(d)  # the base folder's stock classes, none of its code
    assert not pwned.exists()
    from shift_lightning.recipes.train import base_model_config

    assert base_model_config(json.loads((d / "shift_config.json").read_text())).trust_remote_code is False


# ================================================================================================
# Lost work (rule: what the tool may delete)
# ================================================================================================
def _live_owner(folder: Path, proc: subprocess.Popen) -> None:
    import socket

    from shift_lightning.outputs.ownership import OWNER, _start_time

    (folder / OWNER).write_text(json.dumps({"pid": proc.pid, "host": socket.gethostname(),
                                            "started": _start_time(proc.pid)}))


def test_start_up_cleanup_removes_only_abandoned_work_folders(tmp_path):
    from shift_lightning.outputs import prepare_output, publish_dir

    out = tmp_path / "out"
    mine = tmp_path / ".out.tmp-mybackup"  # a user's folder merely named like a leftover
    mine.mkdir()
    (mine / "notes.txt").write_text("keep")
    live = tmp_path / ".out.tmp-live1"  # another run's, still computing
    live.mkdir()
    proc = subprocess.Popen(["sleep", "60"])
    try:
        _live_owner(live, proc)
        prepare_output(out)
        publish_dir(out, lambda t: (t / "r.json").write_text("{}"))
        assert (mine / "notes.txt").read_text() == "keep" and live.is_dir()
    finally:
        proc.kill()
        proc.wait()
    prepare_output(out, overwrite=True)  # its owner is dead now: an abandoned leftover
    assert not live.exists() and mine.is_dir()


def test_two_runs_into_the_same_new_output_keep_both_results(tmp_path):
    from shift_lightning import outputs
    from shift_lightning.outputs import PublishConflict, make_temp_dir, prepare_output, publish_dir

    out = tmp_path / "out"
    prepare_output(out)  # run B starts: the folder is new
    b_tmp = make_temp_dir(tmp_path, ".out.tmp-")  # B's temp folder while it computes
    outputs.claim(b_tmp)
    publish_dir(out, lambda t: (t / "r.json").write_text('"A"'))  # run A (started meanwhile) publishes first
    assert b_tmp.is_dir()  # A's publish left B's temp folder alone
    outputs._AT_START[str(out.absolute())] = None  # back to what B saw at its start
    with pytest.raises(PublishConflict, match=rf"Another run published {out} while this one was running; this run's "
                                              rf"result was kept as {out}.run-\d+"):
        publish_dir(out, lambda t: (t / "r.json").write_text('"B"'), overwrite=True)
    assert (out / "r.json").read_text() == '"A"'
    kept = next(tmp_path.glob("out.run-*"))
    assert (kept / "r.json").read_text() == '"B"'


def test_overwrite_keeps_a_users_own_checkpoint_and_an_edited_model_card(tmp_path, capsys):
    import torch

    from shift_lightning.outputs import OutputExistsError, prepare_output, publish_dir
    from shift_lightning.resume import check_checkpoint_dir, clear_checkpoints

    ck = tmp_path / "o.ckpt"
    ck.mkdir()
    torch.save({"shift_lightning": {"run": {}}, "state_dict": {}}, ck / "last.ckpt")
    torch.save({"w": torch.ones(2)}, ck / "mine.ckpt")  # the user's own
    with pytest.raises(OutputExistsError, match=r"holds files that are not checkpoints of a run \(mine.ckpt\)"):
        check_checkpoint_dir(ck, resuming=False, overwrite=True)
    (ck / "last.ckpt").unlink()
    (ck / "last.ckpt").write_bytes((ck / "mine.ckpt").read_bytes())  # a user's file where ours would go
    with pytest.raises(OutputExistsError, match="last.ckpt is not a checkpoint of a run"):
        check_checkpoint_dir(ck, resuming=False, overwrite=True)
    assert clear_checkpoints(ck) == [] and sorted(p.name for p in ck.iterdir()) == ["last.ckpt", "mine.ckpt"]

    out = publish_dir(tmp_path / "m", lambda t: (t / "README.md").write_text("card"))
    prepare_output(out, overwrite=True)
    (out / "README.md").write_text("card, with my notes")
    with pytest.raises(OutputExistsError, match=r"holds files edited since shift-lightning wrote them \(README.md\)"):
        prepare_output(out, overwrite=True)
    assert (out / "README.md").read_text() == "card, with my notes"


def test_an_output_dir_that_is_a_symlink_is_refused(tmp_path):
    from shift_lightning.outputs import OutputError, prepare_output, publish_dir

    real = publish_dir(tmp_path / "real", lambda t: (t / "r.json").write_text("{}"))
    link = tmp_path / "link"
    link.symlink_to(real)
    with pytest.raises(OutputError, match=f"--output_dir {link} is a symbolic link"):
        prepare_output(link, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]


def test_model_files_follow_the_umask(tmp_path):
    import stat

    old = os.umask(0o022)
    try:
        out = _calibrate(tmp_path / "cal")
    finally:
        os.umask(old)
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in out.iterdir()}
    assert modes["model.safetensors"] == modes["lra.safetensors"] == modes["config.json"] == 0o644, modes


# ================================================================================================
# Hang: a named pipe as a data source
# ================================================================================================
def test_a_named_pipe_as_data_source_is_refused_not_read(tmp_path):
    import threading

    from shift_lightning.data import DataError, load_texts

    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    got = []

    def read():
        try:
            load_texts(str(fifo))
        except DataError as e:
            got.append(str(e))

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(20)
    if t.is_alive():  # the old behaviour: blocked on the pipe; unblock it so the test can end
        os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(5)
    assert got and "is not a regular file (a named pipe" in got[0]


def test_an_unreachable_hf_source_is_one_line(monkeypatch):
    import datasets

    from shift_lightning.data import DataError, load_texts

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach 'nobody/nothing' on the Hub (LocalEntryNotFoundError)")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(DataError, match=r"Could not load hf:nobody/nothing \(ConnectionError: Couldn't reach"):
        load_texts("hf:nobody/nothing")


# ================================================================================================
# Silently wrong
# ================================================================================================
def test_a_missing_or_empty_data_dir_never_falls_back_to_the_built_in_copies(tmp_path):
    from shift_lightning.evaluation.tasks import TaskError, load_docs

    with pytest.raises(TaskError, match=f"--data_dir {tmp_path / 'nope'} is not a folder"):
        load_docs("piqa", data_dir=str(tmp_path / "nope"))
    with pytest.raises(TaskError, match=r"not found at .*piqa.jsonl. \(--data_dir was given, so the built-in copies"):
        load_docs("piqa", data_dir=str(tmp_path))


# ---- non-finite is never success ----------------------------------------------------------------
def _no_compute(monkeypatch):
    from shift_lightning.recipes import calibrate as C, evaluate as E, train as T

    def never(*a, **k):
        raise AssertionError("compute started before the input was checked")

    for mod in (C, E, T):
        monkeypatch.setattr(mod, "load_pretrained", never)


EV = ["--config", "eval_tiny.yaml"]


@pytest.mark.parametrize("option,value,match", [
    ("--ppl_max_windows", "0", "--ppl_max_windows must be an integer >= 1 (or null: no limit), got 0"),
    ("--ppl_max_windows", "-2", "--ppl_max_windows must be an integer >= 1 (or null: no limit), got -2"),
    ("--ppl_batch_size", "0", "--ppl_batch_size must be an integer >= 1, got 0"),
])
def test_evaluation_sizes_that_give_nan_or_a_traceback_are_one_line_before_loading(option, value, match, tmp_path,
                                                                                    monkeypatch, capsys):
    _no_compute(monkeypatch)
    line = _error(cli.evaluate_main, [*EV, "--ppl", "wiki_summaries", option, value, "--output_dir",
                                      str(tmp_path / "e")], capsys)
    assert match in line and not (tmp_path / "e").exists()


def test_nothing_to_evaluate_is_one_line(tmp_path, monkeypatch, capsys):
    _no_compute(monkeypatch)
    line = _error(cli.evaluate_main, [*EV, "--tasks", "", "--ppl", "", "--output_dir", str(tmp_path / "e")], capsys)
    assert "Nothing to evaluate: --tasks and --ppl are both empty" in line


def test_a_non_finite_evaluation_result_is_an_error_not_exit_0(tmp_path, monkeypatch, capsys):
    from shift_lightning.evaluation import perplexity as P

    real = P.window_nll

    def nan_nll(*a, **k):
        nll, n = real(*a, **k)
        return float("nan"), n

    monkeypatch.setattr(P, "window_nll", nan_nll)
    line = _error(cli.evaluate_main, [*EV, "--tasks", "", "--ppl", str(ROOT / "tests" / "data" / "tiny_heldout.txt"),
                                      "--ppl_seq_len", "32", "--output_dir", str(tmp_path / "e")], capsys)
    assert "evaluation: ppl" in line and "(not finite); nothing was written" in line
    assert not (tmp_path / "e").exists()


def _train_args(tmp_path, name, *extra):
    return ["--config", "tiny_lora.yaml", "--output_dir", str(tmp_path / name), "--zeroshot.tasks", "",
            "--trainer.logger.save_dir", str(tmp_path / "runs"), *extra]


def test_a_diverged_training_exports_nothing_and_exits_2(tmp_path, capsys):
    line = _error(cli.train_main, _train_args(tmp_path, "o", "--recovery.lr", "1e30", "--trainer.max_steps", "2"), capsys)
    assert "after 2 training steps: non-finite weights (NaN or infinity)" in line and "The training diverged" in line
    assert not (tmp_path / "o").exists()


def test_a_nan_planted_in_last_ckpt_is_refused_before_resuming(tmp_path, monkeypatch, capsys):
    import torch

    cli.train_main(_train_args(tmp_path, "o", "--trainer.max_steps", "2"))
    capsys.readouterr()
    last = tmp_path / "o.ckpt" / "last.ckpt"
    ck = torch.load(last, weights_only=True)
    key = next(k for k, v in ck["state_dict"].items() if v.is_floating_point())
    ck["state_dict"][key].view(-1)[0] = float("nan")
    torch.save(ck, last)
    _no_compute(monkeypatch)
    line = _error(cli.train_main, _train_args(tmp_path, "o", "--trainer.max_steps", "4", "--ckpt_path", "last"), capsys)
    assert f"checkpoint {last}: non-finite weights (NaN or infinity) in ['{key}']" in line


# ---- the calibration is reused only for the same content ----------------------------------------
def test_the_calibration_is_not_reused_after_its_data_file_changed(tmp_path, caplog, capsys):
    import logging

    data = tmp_path / "corpus.txt"
    shutil.copy(CORPUS, data)
    args = _train_args(tmp_path, "o", "--trainer.max_steps", "1", "--data.source", str(data))
    cli.train_main(args)
    key = json.loads((tmp_path / "o.calibration" / "calibration_key.json").read_text())
    data.write_text(data.read_text().replace("the", "a"))  # same name, other text
    with caplog.at_level(logging.INFO):
        cli.train_main([*args, "--overwrite"])
    assert "Reusing the calibration" not in caplog.text
    assert json.loads((tmp_path / "o.calibration" / "calibration_key.json").read_text()) != key


def test_the_calibration_key_follows_the_base_weights(saved, tmp_path):
    from shift_lightning.data import TextDataConfig
    from shift_lightning.outputs.fingerprints import input_digest
    from shift_lightning.models import ModelConfig, build_tiny_model

    base = tmp_path / "base"
    model, tok = build_tiny_model("llama")
    model.save_pretrained(base)
    tok.save_pretrained(base)
    cfg, sets = ModelConfig(name_or_path=str(base)), {"data": TextDataConfig(source=CORPUS)}
    before = input_digest(cfg, sets)
    model, _ = build_tiny_model("llama", seed=1)
    model.save_pretrained(base)  # the same folder, other weights
    assert input_digest(cfg, sets)["model"] != before["model"] and input_digest(cfg, sets)["data"] == before["data"]


# ---- weight files -------------------------------------------------------------------------------
def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def _write_header(path: Path, meta: dict, body: bytes) -> None:
    head = json.dumps(meta).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + body)


@pytest.mark.parametrize("damage,match", [
    ("dtype", "is stored as I32, but the model is not quantized"),
    ("overlap", "overlap in the file"),
])
def test_a_tampered_safetensors_header_is_refused(saved, tmp_path, damage, match):
    from shift_lightning import load_pretrained
    from shift_lightning.models import ModelLoadError

    d = tmp_path / "m"
    shutil.copytree(saved, d)
    meta, body = _header(d / "model.safetensors")
    key = "model.layers.1.mlp.down_proj.weight"
    if damage == "dtype":
        meta[key]["dtype"] = "I32"  # same size: only the header says otherwise
    else:
        other = "model.layers.1.mlp.up_proj.weight"
        meta[key]["data_offsets"] = list(meta[other]["data_offsets"])
    _write_header(d / "model.safetensors", meta, body)
    with pytest.raises(ModelLoadError, match=match):
        load_pretrained(d)


def test_nan_weights_are_refused_by_the_remote_code_path_too(saved, tmp_path):
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    d = tmp_path / "nan"
    shutil.copytree(saved, d)
    w = load_file(str(d / "model.safetensors"))
    key = "model.layers.1.mlp.down_proj.weight"
    w[key] = w[key].clone()
    w[key].view(-1)[3] = float("nan")
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"non-finite weights \(NaN or infinity\)"):
        AutoModelForCausalLM.from_pretrained(d, trust_remote_code=True)


# ================================================================================================
# Tracebacks for user mistakes: now one line
# ================================================================================================
def test_a_file_size_limit_while_saving_is_one_line(tmp_path, monkeypatch, capsys):
    import safetensors.torch
    from safetensors import SafetensorError

    def too_large(*a, **k):  # what safetensors says today (no "IoError" in it any more)
        raise SafetensorError("Error while serializing: I/O error: File too large (os error 27)")

    monkeypatch.setattr(safetensors.torch, "save_file", too_large)
    out = tmp_path / "o"
    line = _error(cli.calibrate_main, ["--config", "tiny.yaml", "--output_dir", str(out), *FAST], capsys)
    assert line.startswith(f"error: Could not write {out}: File too large. Nothing was changed there")
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def _train_no_compute(tmp_path, monkeypatch, capsys, *extra):
    _no_compute(monkeypatch)
    return _error(cli.train_main, _train_args(tmp_path, "o", *extra), capsys)


def test_the_checkpoint_folder_existing_as_a_file_is_one_line_before_any_compute(tmp_path, monkeypatch, capsys):
    (tmp_path / "o.ckpt").write_text("mine")
    line = _train_no_compute(tmp_path, monkeypatch, capsys)
    assert f"{tmp_path / 'o.ckpt'} is a file, but the run keeps its checkpoints in a folder of that name" in line
    assert (tmp_path / "o.ckpt").read_text() == "mine"


def test_a_corrupt_calibration_key_is_not_a_traceback(tmp_path, capsys, caplog):
    import logging

    args = _train_args(tmp_path, "o", "--trainer.max_steps", "1")
    cli.train_main(args)
    (tmp_path / "o.calibration" / "calibration_key.json").write_text("{not json")
    capsys.readouterr()
    shutil.rmtree(tmp_path / "o")
    shutil.rmtree(tmp_path / "o.ckpt")
    line = _error(cli.train_main, args, capsys)
    assert "o.calibration holds a calibration with other settings; pass --overwrite to redo it" in line


@pytest.mark.parametrize("task,doc,match", [
    ("arc_easy", {"id": "1", "question": "Q?", "choices": {"text": ["a", "b"], "label": ["A", "B"]}, "answerKey": "C"},
     r"doc 0 in .* is malformed \(ValueError"),
    ("arc_easy", {"id": "1", "question": "Q?", "choices": {"text": [], "label": []}, "answerKey": "A"},
     "needs at least two text choices, got \\[\\]"),
    ("piqa", {"goal": "g", "sol1": "a", "sol2": "b", "label": "first"}, r"doc 0 in .* is malformed \(ValueError"),
    ("hellaswag", {"ctx_a": "a", "ctx_b": "b", "activity_label": "x", "endings": ["1", "2", "3", "4"], "label": "x"},
     r"a document in .* is malformed \(ValueError"),
    ("winogrande", {"sentence": "no blank here", "option1": "a", "option2": "b", "answer": "1"},
     r"doc 0 in .* is malformed \(ValueError"),
])
def test_malformed_task_documents_are_one_line(task, doc, match, tmp_path):
    from shift_lightning.evaluation.tasks import TaskError, load_docs

    (tmp_path / f"{task}.jsonl").write_text(json.dumps(doc) + "\n")
    with pytest.raises(TaskError, match=match):
        load_docs(task, data_dir=str(tmp_path))


@pytest.mark.parametrize("tiny,match", [
    ('{"family": "llama", "hidden_size": 30, "num_attention_heads": 4}',
     r"--model.tiny: impossible shape \(The hidden size \(30\) is not a multiple of the number of attention heads"),
    ('{"family": "llama", "hidden_size": -1}', "--model.tiny: hidden_size must be an integer >= 1, got -1"),
])
def test_impossible_tiny_shapes_are_one_line(tiny, match, tmp_path, capsys):
    line = _error(cli.calibrate_main, ["--config", "tiny.yaml", "--model.tiny", tiny, "--output_dir",
                                       str(tmp_path / "o"), *FAST], capsys)
    assert re.search(match, line), line


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> Path:
    from shift_lightning.models import build_tiny_model

    d = tmp_path_factory.mktemp("hf") / "hf"
    model, tok = build_tiny_model("llama")
    model.save_pretrained(d)
    tok.save_pretrained(d)
    return d


def _unlink(name):
    return lambda d: (d / name).unlink()


def _set(name, **kw):
    return lambda d: _edit_json(d / name, lambda doc: doc.update(kw))


@pytest.mark.parametrize("which,damage,match", [
    ("saved", _unlink("shift_config.json"), "is a shift-lightning folder (model_type shift_llama) without its shift_config.json"),
    ("saved", _unlink("config.json"), "config.json is missing or unreadable (No such file or directory)"),
    ("hf", _unlink("config.json"), "has no config.json: it is not a model folder, or it is damaged"),
    ("saved", lambda d: (d / "tokenizer.json").write_text("{garbage"), "Could not load the tokenizer of"),
    ("hf", _set("config.json", vocab_size=100), "pad_token_id 258, bos_token_id 256, eos_token_id 257 do not fit the "
                                                "model's vocabulary (vocab_size 100 in config.json)"),
    ("hf", _set("config.json", model_type="frobnicator"), "model_type 'frobnicator' is not one this transformers knows"),
    ("saved", _set("config.json", model_type="shift_frobnicator"), "model_type 'shift_frobnicator' is not one"),
])
def test_missing_or_damaged_files_in_a_model_folder_are_one_line(which, damage, match, saved, hf_folder, tmp_path, capsys):
    d = tmp_path / "m"
    shutil.copytree(saved if which == "saved" else hf_folder, d)
    damage(d)
    line = _error(cli.evaluate_main, ["--config", "eval_tiny.yaml", "--model.tiny", "null", "--model.name_or_path",
                                      str(d), "--output_dir", str(tmp_path / "e")], capsys)
    assert match in line, line


def test_a_config_section_that_is_not_a_mapping_is_one_line(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("model: [1, 2]\n")
    line = _error(cli.calibrate_main, ["--config", str(cfg), "--output_dir", str(tmp_path / "o")], capsys)
    assert "section 'model' holds a list, not a mapping of options" in line


def test_a_yaml_alias_bomb_is_refused_before_the_parser_expands_it(tmp_path):
    from shift_lightning.errors import UsageError

    text, prev = 'a: &a ["x","x","x","x","x","x","x","x","x"]\n', "a"
    for i in range(8):
        text += f"b{i}: &b{i} [" + ",".join(["*" + prev] * 9) + "]\n"
        prev = f"b{i}"
    cfg = tmp_path / "bomb.yaml"
    cfg.write_text(text + f"data:\n  source: *{prev}\n")
    with pytest.raises(UsageError, match="expands to more than 100,000 values"):
        cli.check_config_file(str(cfg))


def test_a_300_character_output_name_is_one_line(tmp_path, monkeypatch, capsys):
    _no_compute(monkeypatch)
    line = _error(cli.calibrate_main, ["--config", "tiny.yaml", "--output_dir", str(tmp_path / ("x" * 300)), *FAST],
                  capsys)
    assert "is 300 bytes long; file systems allow 255" in line


@pytest.mark.parametrize("extra,match", [
    (["--zeroshot.tasks", "arc_hard"], "Unknown task 'arc_hard'"),
    (["--recovery.target_modules", '["q_proj", "nope_proj"]'], "--recovery.target_modules ['nope_proj'] name no module of "
                                                               "the model (its projections: down_proj, gate_proj"),
    (["--recovery.target_modules", '["nope_proj"]'], "--recovery.target_modules ['nope_proj'] name no module"),
    (["--train_data.format", "alpaca", "--train_data.source", CORPUS], "not a UTF-8 JSON/JSONL file of Alpaca records"),
])
def test_training_checks_run_before_the_calibration(extra, match, tmp_path, monkeypatch, capsys):
    line = _train_no_compute(tmp_path, monkeypatch, capsys, *extra)  # any model load fails the test
    assert match in line, line
    assert not (tmp_path / "o.calibration").exists()


@pytest.mark.parametrize("model_args,match", [
    ("pretrained={missing}", "Model folder not found"),
    pytest.param("pretrained={saved},revision=v2", "--model shift does not support ['revision']", marks=pytest.mark.extended),
    pytest.param("pretrained={saved},peft={missing}", "no such adapter folder", marks=pytest.mark.extended),
])
def test_the_lm_eval_entry_points_bad_arguments_are_one_line(model_args, match, saved, tmp_path, capsys):
    pytest.importorskip("lm_eval")
    from shift_lightning import lmeval

    args = model_args.format(missing=tmp_path / "nope", saved=saved)
    with pytest.raises(SystemExit) as e:
        lmeval.main(["--model", "shift", "--model_args", args, "--tasks", "arc_easy", "--device", "cpu", "--limit", "1"])
    last = capsys.readouterr().err.strip().splitlines()[-1]  # (lm-eval's log handlers may hold a closed stream)
    assert e.value.code == 2 and last.startswith("error: ") and match in last, last


@pytest.mark.parametrize("script", ["calibrate.py", "evaluate.py", "train.py"])
def test_ctrl_c_during_the_imports_is_one_line(script):
    code = ("import builtins, runpy\n"
            "real = builtins.__import__\n"
            "def imp(name, *a, **k):\n"
            "    if name == 'shift_lightning.recipes.cli':\n"
            "        raise KeyboardInterrupt  # Ctrl-C while torch and Lightning load\n"
            "    return real(name, *a, **k)\n"
            "builtins.__import__ = imp\n"
            f"runpy.run_path({script!r}, run_name='__main__')\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 130 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.startswith("interrupted: stopped on Ctrl-C while starting")


def test_a_checkpoint_with_a_tampered_shape_is_one_line(tmp_path, capsys):
    import torch

    cli.train_main(_train_args(tmp_path, "o", "--trainer.max_steps", "2"))
    capsys.readouterr()
    last = tmp_path / "o.ckpt" / "last.ckpt"
    ck = torch.load(last, weights_only=True)
    key = next(k for k, v in ck["state_dict"].items() if v.dim() == 2)
    ck["state_dict"][key] = torch.zeros(3, 3)
    torch.save(ck, last)
    line = _error(cli.train_main, _train_args(tmp_path, "o", "--trainer.max_steps", "2", "--ckpt_path", "last"), capsys)
    assert f"The checkpoint's {key} has shape (3, 3)" in line and "start afresh with --overwrite" in line


def test_deeply_nested_json_data_is_one_line(tmp_path):
    from shift_lightning.data import DataError, TextDataConfig, load_records, load_texts
    from shift_lightning.evaluation.tasks import TaskError, load_docs

    deep = "[" * 100_000 + "]" * 100_000
    for name in ("corpus.json", "alpaca.json", "piqa.json"):
        (tmp_path / name).write_text(deep)
    with pytest.raises(DataError, match="nested too deeply"):
        load_texts(str(tmp_path / "corpus.json"))
    with pytest.raises(DataError, match="nested too deeply"):
        load_records(str(tmp_path / "alpaca.json"))
    with pytest.raises(TaskError, match="nested too deeply"):
        load_docs("piqa", data_dir=str(tmp_path))


def test_unreachable_hub_task_and_instruction_data_are_one_line(monkeypatch):
    import datasets

    from shift_lightning.data import DataError, load_records
    from shift_lightning.evaluation.tasks import TaskError, load_docs

    def offline(*a, **k):
        raise ConnectionError("Couldn't reach the Hub")

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(TaskError, match=r"Could not load task 'piqa' from the hub \(baber/piqa: ConnectionError"):
        load_docs("piqa", source="hf")
    with pytest.raises(DataError, match=r"Could not load hf:tatsu-lab/alpaca \(ConnectionError"):
        load_records("hf:tatsu-lab/alpaca")


def test_a_read_only_working_folder_is_one_line_before_any_compute(tmp_path, capsys):
    """``train.py`` run from a read-only folder: the TensorBoard logs (``runs/`` there by default) cannot be written.
    One line naming the option, before any compute, instead of a traceback from inside Lightning. (Root ignores
    permissions, so the folder is a read-only bind mount; skipped where mounting is not allowed.)"""
    ro, here = tmp_path / "ro", os.getcwd()
    ro.mkdir()
    if subprocess.run(["mount", "--bind", str(ro), str(ro)], capture_output=True).returncode != 0:
        pytest.skip("a read-only folder needs a bind mount here (root ignores permissions)")
    try:
        if subprocess.run(["mount", "-o", "remount,ro,bind", str(ro)], capture_output=True).returncode != 0:
            pytest.skip("cannot remount read-only")
        os.chdir(ro)
        data = ROOT / "tests" / "data"
        line = _error(cli.train_main, ["--config", str(ROOT / "configs" / "tiny_lora.yaml"),
                                       "--data.source", str(data / "tiny_corpus.txt"),
                                       "--train_data.source", str(data / "tiny_corpus.txt"),
                                       "--output_dir", str(tmp_path / "o")], capsys)
        assert "Cannot write next to runs/recovery (Read-only file system)" in line, line
        assert "--trainer.logger.save_dir" in line and not (tmp_path / "o").exists()
    finally:
        os.chdir(here)  # out of the mount first: a busy mount cannot be unmounted
        assert subprocess.run(["umount", str(ro)], capture_output=True).returncode == 0
