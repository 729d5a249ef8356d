"""Issue 17: the bad inputs, faults and kills that once lost data, gave a silently wrong result, a
traceback or a hung process. One test per case: nothing the user made is deleted, every mistake is
one ``error:`` line (exit 2) found before any compute, checkpoints belong to their run, and every
process of a run exits on Ctrl-C or when a peer dies (bounded timeouts: the suite cannot hang)."""

from __future__ import annotations

import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import lightning as L
import pytest

from shift_lightning import stopping
from shift_lightning.outputs import MARKER, OutputError, OutputExistsError, prepare_output, publish_dir
from shift_lightning.recipes import cli

ROOT = Path(__file__).resolve().parents[1]
CORPUS = str(ROOT / "tests" / "data" / "tiny_corpus.txt")
HELDOUT = str(ROOT / "tests" / "data" / "tiny_heldout.txt")
FAST = ["--trainer.enable_progress_bar", "false"]


@pytest.fixture(autouse=True)
def _at_root(monkeypatch):
    monkeypatch.chdir(ROOT)  # the configs name their data relative to the repository


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """A calibrated tiny model folder (blocks 2, 3 removed)."""
    from shift_lightning.criteria import PruneConfig
    from shift_lightning.data import TextDataConfig
    from shift_lightning.models import ModelConfig
    from shift_lightning.recipes.calibrate import run_calibration

    out = tmp_path_factory.mktemp("saved") / "cal"
    run_calibration(model=ModelConfig(tiny={"family": "llama", "max_position_embeddings": 512}),
                    data=TextDataConfig(source=CORPUS, num_samples=4, seq_len=32),
                    heldout=TextDataConfig(num_samples=0), prune=PruneConfig(layers=[2, 3]),
                    trainer={"accelerator": "cpu", "enable_progress_bar": False}, output_dir=str(out))
    return out


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def _listing(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _error(main, argv, capsys) -> str:
    """The one ``error:`` line of a refused run (exit 2, no traceback)."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert err.startswith("error: ") and "Traceback" not in err, err
    return err.splitlines()[0]


def _never(*a, **k):
    raise AssertionError("compute started before the input was checked")


def _no_compute(monkeypatch):
    """Any model load means the check came too late."""
    from shift_lightning.recipes import calibrate as C, evaluate as E, train as T

    for mod in (C, E, T):
        monkeypatch.setattr(mod, "load_pretrained", _never)


def test_nan_damping_in_yaml_is_refused_before_any_compute(tmp_path, monkeypatch, capsys):
    y = tmp_path / "nan.yaml"
    y.write_text("calibration:\n  damping: .nan\n")
    _no_compute(monkeypatch)
    line = _error(cli.calibrate_main, ["--config", "tiny.yaml", "--config", str(y), "--output_dir", str(tmp_path / "o"),
                                       *FAST], capsys)
    assert "--calibration.damping must be a finite number > 0, got nan" in line


# ================================================================================================
# Data lost
# ================================================================================================
def test_case1_evaluate_never_overwrites_the_model_it_evaluates(saved, tmp_path, monkeypatch, capsys):
    model = _copy(saved, tmp_path / "model")
    before = _listing(model)
    _no_compute(monkeypatch)
    ev = ["--config", "eval_tiny.yaml", "--model.tiny", "null", "--model.name_or_path", str(model), "--overwrite"]
    line = _error(cli.evaluate_main, [*ev, "--output_dir", str(model)], capsys)
    assert f"--output_dir {model} is the input --model.name_or_path {model}" in line
    line = _error(cli.evaluate_main, [*ev, "--output_dir", str(model / "eval")], capsys)  # inside it
    assert "is inside the input --model.name_or_path" in line
    assert _listing(model) == before


def test_case2_train_never_replaces_its_input_folder(saved, tmp_path, monkeypatch, capsys):
    cal = _copy(saved, tmp_path / "cal")
    before = _listing(cal)
    _no_compute(monkeypatch)
    line = _error(cli.train_main, ["--config", "tiny_lora.yaml", "--model.tiny", "null", "--model.name_or_path", str(cal),
                                   "--output_dir", str(cal), "--overwrite"], capsys)
    assert f"is the input --model.name_or_path {cal}" in line
    assert _listing(cal) == before
    # an output that would contain an input (e.g. the data) is refused too
    data = tmp_path / "runs" / "corpus.txt"
    data.parent.mkdir()
    shutil.copy(CORPUS, data)
    with pytest.raises(OutputError, match="contains the input --data.source"):
        prepare_output(tmp_path / "runs", overwrite=True, inputs={"--data.source": str(data)})


def test_case3_overwrite_never_deletes_files_the_user_added(tmp_path, monkeypatch, capsys):
    out = publish_dir(tmp_path / "run", lambda t: (t / "calibration_report.json").write_text("{}"), kind="calibration")
    assert json.loads((out / MARKER).read_text())["files"] == ["calibration_report.json"]
    prepare_output(out, overwrite=True)  # only our files: may be replaced
    (out / "NOTES.txt").write_text("my notes")
    _no_compute(monkeypatch)
    line = _error(cli.calibrate_main, ["--config", "tiny.yaml", "--output_dir", str(out), "--overwrite", *FAST], capsys)
    assert "holds files shift-lightning did not write (NOTES.txt); --overwrite would delete them" in line
    assert (out / "NOTES.txt").read_text() == "my notes"
    # a folder of an older version (its marker lists nothing): what came after the marker is the user's
    doc = json.loads((out / MARKER).read_text())
    del doc["files"]
    (out / MARKER).write_text(json.dumps(doc))
    for name, age in (("calibration_report.json", 120), (MARKER, 60)):  # written by the run, the marker last
        os.utime(out / name, (time.time() - age, time.time() - age))
    with pytest.raises(OutputExistsError, match=r"\(NOTES.txt\)"):
        prepare_output(out, overwrite=True)


# ================================================================================================
# Silently wrong
# ================================================================================================
def test_case4_negative_heldout_samples_are_refused(monkeypatch, tmp_path, capsys):
    _no_compute(monkeypatch)
    line = _error(cli.calibrate_main, ["--config", "tiny.yaml", "--output_dir", str(tmp_path / "o"),
                                       "--heldout.num_samples", "-3", *FAST], capsys)
    assert "--heldout.num_samples must be an integer >= 0 (0 switches it off), got -3" in line


def test_case5_negative_learning_rate_is_refused_before_calibration(monkeypatch, tmp_path, capsys):
    _no_compute(monkeypatch)
    line = _error(cli.train_main, ["--config", "tiny_lora.yaml", "--output_dir", str(tmp_path / "o"),
                                   "--recovery.lr", "-1"], capsys)
    assert "--recovery.lr must be a finite number > 0, got -1" in line
    assert not (tmp_path / "o.calibration").exists()


def _train_args(tmp_path, name, *extra):
    return ["--config", "tiny_lora.yaml", "--output_dir", str(tmp_path / name), "--zeroshot.tasks", "",
            "--trainer.logger.save_dir", str(tmp_path / "runs"), *extra]


def test_case6_fewer_steps_than_the_validation_interval_still_validate_the_result(tmp_path, capsys, caplog):
    import logging

    with caplog.at_level(logging.WARNING):
        result = cli.train_main(_train_args(tmp_path, "short", "--trainer.max_steps", "2",
                                            "--trainer.val_check_interval", "4"))
    assert "--trainer.val_check_interval 4 is more than the 2 training batches" in caplog.text
    r = result.report
    assert r.steps == 2 and math.isfinite(r.metrics_after["val/ppl"])
    assert r.metrics_after["val/ppl"] != r.metrics_before["val/ppl"]  # validated after training
    summary = capsys.readouterr().out
    assert re.search(r"val/ppl [\d.]+ -> [\d.]+", summary) and "nan" not in summary, summary


# ---- case 8: checkpoints belong to their run --------------------------------------------------
class _CrashBeforeTheFirstStep(L.Callback):
    def on_train_batch_start(self, trainer, *args):
        raise RuntimeError("killed before the first checkpoint")


def _job(tmp_path, name="job", lr=2e-3, steps=4, callbacks=(), **kw):
    from shift_lightning.calibration import CalibrationConfig
    from shift_lightning.criteria import PruneConfig
    from shift_lightning.data import TextDataConfig
    from shift_lightning.models import ModelConfig
    from shift_lightning.recipes.train import run_training, training_callbacks
    from shift_lightning.recovery import RecoveryConfig

    out = tmp_path / name
    trainer = L.Trainer(accelerator="cpu", devices=1, max_steps=steps, val_check_interval=2,
                        check_val_every_n_epoch=None, inference_mode=False, use_distributed_sampler=False,
                        num_sanity_val_steps=0, enable_progress_bar=False, enable_model_summary=False, logger=False,
                        callbacks=[*training_callbacks(str(out), None, 2), *callbacks])
    return run_training(trainer, model=ModelConfig(tiny={"family": "llama"}),
                        data=TextDataConfig(source=CORPUS, num_samples=4, seq_len=32),
                        heldout=TextDataConfig(num_samples=0), prune=PruneConfig(layers=[2, 3]),
                        calibration=CalibrationConfig(), train_data=TextDataConfig(source=CORPUS, num_samples=8,
                                                                                   seq_len=32, batch_size=4),
                        val=TextDataConfig(source=HELDOUT, num_samples=2, seq_len=32),
                        recovery=RecoveryConfig(method="lora", lora_r=2, lr=lr), output_dir=str(out), **kw)


def test_case8_checkpoints_belong_to_their_run(tmp_path):
    from shift_lightning.resume import read_checkpoint

    ckpt = tmp_path / "job.ckpt"
    _job(tmp_path, lr=2e-3)  # run A: finished, its checkpoint stays
    shutil.rmtree(tmp_path / "job")  # as if A had been killed before its export
    a = read_checkpoint(ckpt / "last.ckpt")["shift_lightning"]["run"]["key"]
    with pytest.raises(OutputExistsError, match="holds the checkpoints of an earlier run.*--ckpt_path last.*--overwrite"):
        _job(tmp_path, lr=1e-3)  # run B, fresh: A's checkpoint is not silently kept around
    with pytest.raises(cli.ConfigError, match=r"belongs to a run with other settings \(recovery.lr: 0.002 there, "
                                               r"0.001 now\)"):
        _job(tmp_path, lr=1e-3, ckpt_path="last")  # B never resumes A
    with pytest.raises(RuntimeError, match="killed before the first checkpoint"):
        _job(tmp_path, lr=1e-3, overwrite=True, callbacks=[_CrashBeforeTheFirstStep()])
    assert not (ckpt / "last.ckpt").exists()  # --overwrite cleared A's checkpoints
    b = _job(tmp_path, lr=1e-3, ckpt_path="last")  # nothing of B's yet: starts at step 0, not from A
    assert b.report.steps == 4 and len(b.report.loss_history) == 4
    assert sorted(p.name for p in ckpt.iterdir()) == [".shift_lightning.checkpoints.json", "last.ckpt"]  # no last-v1
    assert read_checkpoint(ckpt / "last.ckpt")["shift_lightning"]["run"]["key"] != a


@pytest.mark.parametrize("damage", ["pickle", "truncated"])
def test_case8_a_planted_or_cut_checkpoint_is_one_line_before_any_compute(tmp_path, monkeypatch, capsys, damage):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "PWNED"),))

    ckpt = tmp_path / "o.ckpt"
    ckpt.mkdir()
    if damage == "pickle":
        (ckpt / "last.ckpt").write_bytes(pickle.dumps({"state_dict": Evil()}))
    else:
        import torch

        torch.save({"shift_lightning": {}, "x": torch.zeros(1000)}, ckpt / "full.ckpt")
        (ckpt / "last.ckpt").write_bytes((ckpt / "full.ckpt").read_bytes()[:500])
    _no_compute(monkeypatch)
    line = _error(cli.train_main, _train_args(tmp_path, "o", "--ckpt_path", "last"), capsys)
    assert str(ckpt / "last.ckpt") in line
    assert ("cannot be loaded as plain tensors" if damage == "pickle" else "it is truncated or damaged") in line
    assert not (tmp_path / "PWNED").exists() and not (tmp_path / "o.calibration").exists()


def test_case9_nan_in_the_model_weights_is_refused_at_load(saved, tmp_path, monkeypatch, capsys):
    from safetensors.torch import load_file, save_file

    from shift_lightning import load_pretrained
    from shift_lightning.models import ModelLoadError

    d = _copy(saved, tmp_path / "nan")
    w = load_file(str(d / "model.safetensors"))
    key = "model.layers.1.mlp.down_proj.weight"
    w[key] = w[key].clone()
    w[key].view(-1)[7] = float("nan")
    save_file(w, str(d / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match=rf"non-finite weights \(NaN or infinity\) in \['{key}'\] \(in model.safetensors\)"):
        load_pretrained(d)
    line = _error(cli.evaluate_main, ["--config", "eval_tiny.yaml", "--model.tiny", "null", "--model.name_or_path", str(d),
                                      "--output_dir", str(tmp_path / "e")], capsys)
    assert "non-finite weights" in line and not (tmp_path / "e").exists()


# ================================================================================================
# Tracebacks for user mistakes: now one line
# ================================================================================================
@pytest.mark.parametrize("entry,option,value,match", [
    ("calibrate", "--data.batch_size", "0", "--data.batch_size must be an integer >= 1, got 0"),
    ("train", "--train_data.batch_size", "0", "--train_data.batch_size must be an integer >= 1, got 0"),
    ("train", "--recovery.lora_r", "0", "--recovery.lora_r must be an integer >= 1, got 0"),
])
def test_bad_sizes_are_one_line_before_any_compute(entry, option, value, match, tmp_path, monkeypatch, capsys):
    _no_compute(monkeypatch)
    if entry == "calibrate":
        argv = ["--config", "tiny.yaml", "--output_dir", str(tmp_path / "o"), *FAST]
        main = cli.calibrate_main
    else:
        argv, main = _train_args(tmp_path, "o"), cli.train_main
    assert match in _error(main, [*argv, option, value], capsys)
    assert not (tmp_path / "o").exists() and not (tmp_path / "o.calibration").exists()


def test_disk_full_while_saving_is_one_line_and_the_previous_run_stays(tmp_path, monkeypatch, capsys):
    import safetensors.torch
    from safetensors import SafetensorError

    out = tmp_path / "o"
    argv = ["--config", "tiny.yaml", "--output_dir", str(out), *FAST]
    cli.calibrate_main(argv)
    before = _listing(out)
    capsys.readouterr()

    def full(*a, **k):
        raise SafetensorError('Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: '
                              '"No space left on device" })')

    monkeypatch.setattr(safetensors.torch, "save_file", full)
    line = _error(cli.calibrate_main, [*argv, "--overwrite"], capsys)
    assert line.startswith(f"error: Could not write {out}: No space left on device. Nothing was changed there")
    assert _listing(out) == before and sorted(p.name for p in tmp_path.iterdir()) == ["o"]  # no leftovers

    def enospc(tmp):
        raise OSError(28, "No space left on device")

    with pytest.raises(OutputError, match="No space left on device"):
        publish_dir(out, enospc)
    assert _listing(out) == before


def test_disk_full_while_saving_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch):
    import torch
    from lightning.fabric.plugins.io import torch_io

    from shift_lightning.resume import AtomicCheckpointIO

    path = tmp_path / "last.ckpt"
    AtomicCheckpointIO().save_checkpoint({"global_step": 1, "w": torch.ones(3)}, path)

    def enospc(checkpoint, filepath):
        Path(filepath).write_bytes(b"half")
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(torch_io, "_atomic_save", enospc)
    with pytest.raises(OutputError, match=f"Could not save the checkpoint {path}: No space left on device; the previous "
                                          "checkpoint stays as it was"):
        AtomicCheckpointIO().save_checkpoint({"global_step": 2, "w": torch.zeros(3)}, path)
    assert torch.load(path, weights_only=True)["global_step"] == 1
    assert sorted(os.listdir(tmp_path)) == [".shift_lightning.checkpoints.json", "last.ckpt"]  # no temporary file


@pytest.mark.parametrize("damage", ["truncated", "pickle_hf", "pickle_shift"])
def test_damaged_model_files_are_one_line(saved, tmp_path, capsys, damage):
    class Evil:
        def __reduce__(self):
            return (os.system, ("touch " + str(tmp_path / "PWNED"),))

    if damage == "pickle_hf":  # a plain HF folder whose weights are a pickle of Python objects
        from shift_lightning.models import build_tiny_model

        d = tmp_path / "hf"
        model, tok = build_tiny_model("llama")
        model.save_pretrained(d)
        tok.save_pretrained(d)
    else:
        d = _copy(saved, tmp_path / "m")
    weights = d / "model.safetensors"
    if damage == "truncated":
        weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        match = f"{weights} is truncated: its tensors need"
    else:
        weights.unlink()
        (d / "pytorch_model.bin").write_bytes(pickle.dumps({"model.embed_tokens.weight": Evil()}))
        match = (f"{d}/pytorch_model.bin cannot be loaded as plain tensors" if damage == "pickle_hf" else
                 f"{d} holds no model.safetensors (only ['pytorch_model.bin'], which is never unpickled)")
    line = _error(cli.evaluate_main, ["--config", "eval_tiny.yaml", "--model.tiny", "null", "--model.name_or_path",
                                      str(d), "--output_dir", str(tmp_path / "e")], capsys)
    assert match in line, line
    assert not (tmp_path / "PWNED").exists()


# ================================================================================================
# Hangs: every process exits (subprocesses, bounded)
# ================================================================================================
def _children(pid: int) -> list[int]:
    out = []
    for t in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            out += [int(x) for x in t.read_text().split()]
        except OSError:
            pass
    return out


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def _wait_gone(pids, timeout: float) -> float:
    t0 = time.time()
    while any(_alive(p) for p in pids):
        if time.time() - t0 > timeout:
            raise AssertionError(f"still alive after {timeout:g} s: {[p for p in pids if _alive(p)]}")
        time.sleep(0.1)
    return time.time() - t0


def _ddp(script: str, args: list[str], log: Path) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", stopping.GRACE_ENV: "15",
           "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, str(ROOT / script), *args, "--trainer.devices", "2",
                             "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu"], cwd=ROOT, env=env,
                            stdout=open(log.with_suffix(".out"), "w"), stderr=open(log, "w"), start_new_session=True,
                            preexec_fn=_sigint_default)


def _sigint_default() -> None:
    # A run launched from a background job (`nohup pytest … &`) inherits SIGINT ignored, and keeps it
    # ignored (stopping.guarded); these runs stand for one started in a terminal.
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.fixture
def ctrl_c_reaches_python():
    """Python's own Ctrl-C handler for the test (under `nohup … &` the caller ignores SIGINT)."""
    prior = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, prior)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _rank1(rank0: subprocess.Popen, script: str, timeout: float = 120) -> int:
    """The rank Lightning launched: a child running the same script (not, e.g., ``ldconfig -p``)."""
    t0 = time.time()
    while True:
        ranks = [c for c in _children(rank0.pid) if script in _cmdline(c)]
        if ranks:
            return ranks[0]
        assert rank0.poll() is None, "rank 0 ended before launching rank 1"
        assert time.time() - t0 < timeout, "rank 1 never started"
        time.sleep(0.02)


def _sockets(pid: int) -> int:
    n = 0
    for fd in Path(f"/proc/{pid}/fd").glob("*"):
        try:
            n += os.readlink(fd).startswith("socket:")
        except OSError:
            pass
    return n


@pytest.mark.parametrize("when", ["starting", pytest.param("guarded", marks=pytest.mark.extended)])
def test_rank1_exits_when_rank0_is_killed(tmp_path, when):
    """SIGKILL of rank 0 as soon as rank 1 exists (it is still importing: it finds its launcher gone
    when it starts) or once rank 1 runs guarded (its watch thread sees the launcher go)."""
    log = tmp_path / "err.txt"
    p = _ddp("calibrate.py", ["--config", "tiny.yaml", "--output_dir", str(tmp_path / "o"), *FAST], log)
    try:
        rank1 = _rank1(p, "calibrate.py")
        t0 = time.time()
        while when == "guarded" and _sockets(rank1) < 2:  # the signal watcher's socket pair: guarded() runs
            assert _alive(rank1) and time.time() - t0 < 120, log.read_text()[-2000:]
            time.sleep(0.01)
        p.kill()
        p.wait(timeout=30)
        took = _wait_gone([rank1], timeout=60)
        assert "rank 1: the process that launched it (rank 0, pid" in log.read_text(), log.read_text()[-2000:]
        # the watcher acts within ~2.5 s (0.5 s polls + 2 s grace); 20 s still tells it from a rank left
        # waiting for the collective timeout, and leaves room for a loaded 2-core machine (7 s seen)
        assert took < (60 if when == "starting" else 20) and not (tmp_path / "o").exists()
    finally:
        with _suppress():
            os.killpg(p.pid, signal.SIGKILL)


@pytest.mark.parametrize("sig", [signal.SIGINT, pytest.param(signal.SIGTERM, marks=pytest.mark.extended)],
                         ids=["ctrl_c", "sigterm"])
def test_ctrl_c_to_the_process_group_ends_every_rank_of_a_ddp_training(tmp_path, sig):
    """Ctrl-C in the terminal (or SIGTERM from a scheduler) reaches every rank: all exit, promptly, with
    a stop checkpoint that resumes (Lightning's own SIGTERM handling would hang the ranks)."""
    from shift_lightning.resume import read_checkpoint

    log = tmp_path / "err.txt"
    out = tmp_path / "o"
    p = _ddp("train.py", _train_args(tmp_path, "o", "--trainer.max_steps", "5000", "--trainer.val_check_interval", "2",
                                     "--train_data.batch_size", "2"), log)
    try:
        rank1 = _rank1(p, "train.py")
        t0 = time.time()
        while not (tmp_path / "o.ckpt" / "last.ckpt").exists():  # training has started
            assert p.poll() is None, log.read_text()[-3000:]
            assert time.time() - t0 < 240, "no checkpoint written"
            time.sleep(0.1)
        time.sleep(1.0)
        os.killpg(p.pid, sig)
        took = _wait_gone([p.pid, rank1], timeout=60)
        err = log.read_text()[-6000:]  # on a forced exit: where the run was stuck (every thread's stack)
        assert p.wait(timeout=5) == 128 + sig, err
        name = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
        assert f"interrupted: the run stopped on {name}" in err, err
        assert "exiting by force" not in err, err  # stopped by itself, not by the watchdog
        assert took < 15 and not out.exists()
        ck = read_checkpoint(tmp_path / "o.ckpt" / "last.ckpt")  # intact and resumable (atomic writes)
        assert ck["global_step"] >= 2 and len(ck["shift_lightning"]["loss_history"]) == ck["global_step"]
    finally:
        with _suppress():
            os.killpg(p.pid, signal.SIGKILL)


def test_a_stopping_group_is_not_killed_by_lightnings_process_observer(monkeypatch):
    """Lightning's process observer SIGKILLs rank 0 when a rank exits non-zero, also while every rank is
    stopping on the same Ctrl-C (a rank that stopped first: 130; one Lightning's interrupt handling killed:
    -9). Once rank 0 saw the signal the observer leaves the group to its stop; before that it acts."""
    from lightning.fabric.strategies.launchers.subprocess_script import _ChildProcessObserver

    class Rank:
        def __init__(self, code):
            self.returncode, self.pid, self.sent = code, 0, []

        def poll(self):
            return self.returncode

        def send_signal(self, sig):
            self.sent.append(sig)

    killed = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    for code in (130, 143, -signal.SIGKILL, 1):
        for stopping_now in (False, True):
            killed.clear()
            rank = Rank(code)
            observer = _ChildProcessObserver(main_pid=12345, child_processes=[rank])
            if stopping_now:
                stopping.spare_stopping_group(observer)
            assert observer._run() is True  # the observer is done either way
            assert killed == ([] if stopping_now else [(12345, signal.SIGKILL)]), (code, stopping_now)
            assert rank.sent == ([] if stopping_now else [signal.SIGKILL])


class _suppress:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is None or issubclass(exc[0], OSError)


def test_ctrl_c_held_back_during_the_update_then_raised(ctrl_c_reaches_python):
    with stopping.guarded():
        stopping.enter_critical()
        signal.raise_signal(signal.SIGINT)  # arrives during the update: held back
        with pytest.raises(KeyboardInterrupt):
            stopping.leave_critical()  # the step is counted: raised now
        t0 = time.time()
        while not stopping.armed() and time.time() - t0 < 5:  # the watcher saw it: forced exit pending
            time.sleep(0.01)
        assert stopping.armed()
        stopping.disarm()
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the caller's handler is back


def test_a_run_started_with_ctrl_c_ignored_keeps_ignoring_it():
    """A script's background job (`nohup python train.py … &`) starts with SIGINT ignored, so that a
    Ctrl-C for the foreground leaves it running; the guard must not take SIGINT back."""
    prior = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        with stopping.guarded():
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
            signal.raise_signal(signal.SIGINT)  # ignored: nothing raised, nothing armed
            time.sleep(0.3)
            assert not stopping.interrupted() and not stopping.armed()
            stopping.rearm()  # after Lightning's shutdown: still ignored
            assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, prior)


def test_a_run_that_does_not_stop_within_the_grace_exits_by_force_saying_where_it_was_stuck(tmp_path):
    """A run that does not stop (here: Ctrl-C swallowed, as Lightning does during its shutdown, and a loop
    standing for a collective that never returns) is ended ``SHIFT_LIGHTNING_STOP_GRACE`` seconds after
    Ctrl-C with status 130, one line saying why, and every thread's stack, so that the hang can be reported."""
    script = tmp_path / "stuck.py"
    script.write_text(
        "import signal, time\n"
        "from shift_lightning import stopping\n"
        "def stuck_in_a_collective():\n"
        "    while True:\n"
        "        time.sleep(0.05)\n"
        "with stopping.guarded():\n"
        "    signal.signal(signal.SIGINT, lambda *_: print('swallowed', flush=True))\n"
        "    print('ready', flush=True)\n"
        "    stuck_in_a_collective()\n")
    env = {**os.environ, stopping.GRACE_ENV: "1", "PYTHONPATH": str(ROOT)}
    p = subprocess.Popen([sys.executable, str(script)], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True, preexec_fn=_sigint_default)
    try:
        assert p.stdout.readline().strip() == "ready"
        t0 = time.time()
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=60)
        assert p.returncode == 130 and time.time() - t0 < 30
        assert "swallowed" in out  # the Ctrl-C reached the main thread, which went on
        assert "error: the run did not stop within 1 s of SIGINT; exiting by force" in err
        assert "stuck_in_a_collective" in err and "most recent call first" in err
    finally:
        if p.poll() is None:
            p.kill()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl_c", "sigterm"])
def test_ctrl_c_or_sigterm_during_calibration_is_one_line_and_its_status(tmp_path, monkeypatch, capsys,
                                                                       ctrl_c_reaches_python, sig):
    """In one process too: Lightning's prediction loop only notes a SIGTERM, so before the guard took it
    in predict passes a `kill` ran the calibration on until the grace timer ended it by force."""
    from shift_lightning import passes

    def stop(self, batch, batch_idx):
        signal.raise_signal(sig)

    monkeypatch.setattr(passes.DataPass, "predict_step", stop)
    monkeypatch.setenv(stopping.GRACE_ENV, "600")  # a run that did not stop must fail here, not exit pytest
    try:
        with pytest.raises(SystemExit) as e:
            cli.calibrate_main(["--config", "tiny.yaml", "--output_dir", str(tmp_path / "o"), *FAST])
        assert e.value.code == 128 + sig
        err = capsys.readouterr().err
        name = "Ctrl-C" if sig == signal.SIGINT else "SIGTERM"
        assert f"interrupted: the run stopped on {name}" in err and "Traceback" not in err
        assert not (tmp_path / "o").exists()
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # the Trainer gave SIGTERM back
    finally:
        t0 = time.time()
        while not stopping.armed() and time.time() - t0 < 5:
            time.sleep(0.01)
        stopping.disarm()


# ================================================================================================
# Rough edges
# ================================================================================================
def test_too_short_heldout_text_names_the_heldout_options(tmp_path, capsys):
    line = _error(cli.calibrate_main, ["--config", "tiny.yaml", "--output_dir", str(tmp_path / "o"),
                                       "--heldout.num_samples", "5000", *FAST], capsys)
    assert "lower --heldout.num_samples / --heldout.seq_len" in line and "--data." not in line


def test_empty_yaml_and_parser_errors_are_one_line_with_a_pointer_to_help(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("# nothing here\n")
    for argv, match in [(["--config", str(empty)], f"Config file {empty} is empty"),
                        (["--nope", "1"], "unrecognized arguments: --nope 1"),
                        (["--data.batch_size", "x"], 'Parser key "data.batch_size"')]:
        with pytest.raises(SystemExit) as e:
            cli.calibrate_main(["--config", "tiny.yaml", *argv, "--output_dir", str(tmp_path / "o")])
        err = capsys.readouterr().err
        assert e.value.code == 2 and err.startswith("error: ") and match in err.splitlines()[0], err
        assert len(err.splitlines()) == 2 and "--help" in err and "usage:" not in err, err


def test_resuming_into_a_foreign_output_folder_is_refused_before_any_compute(tmp_path, monkeypatch, capsys):
    args = _train_args(tmp_path, "o", "--trainer.max_steps", "2", "--trainer.val_check_interval", "2")
    cli.train_main(args)  # a run with its checkpoint ...
    shutil.rmtree(tmp_path / "o")
    (tmp_path / "o").mkdir()  # ... whose output folder is now someone else's
    (tmp_path / "o" / "thesis.tex").write_text("mine")
    capsys.readouterr()
    _no_compute(monkeypatch)
    line = _error(cli.train_main, [*args, "--ckpt_path", "last"], capsys)
    assert "was not written by shift-lightning" in line and (tmp_path / "o" / "thesis.tex").read_text() == "mine"


def test_a_writer_that_will_not_close_on_stop_cannot_hold_the_process(capfd):
    """On a stop the loggers' writers are closed with a bounded wait before Lightning's ``finalize``
    (rank 0 was seen waiting for good in the TensorBoard writer's close); one that closes is closed, one
    that hangs is left to the process exit with one line, and ``finalize`` then has nothing to close."""
    from types import SimpleNamespace

    class Writer:
        def __init__(self, hang):
            self.hang, self.closed, self.flushed = hang, threading.Event(), False

        def flush(self):
            self.flushed = True

        def close(self):
            if self.hang:
                threading.Event().wait()  # never returns
            self.closed.set()

    class Logger:
        def __init__(self, hang):
            self._experiment = self.writer = Writer(hang)

    good, stuck, none = Logger(False), Logger(True), SimpleNamespace(_experiment=None)
    cb = stopping.LoggersCloseOnStop(timeout=0.5)
    t0 = time.time()
    cb.on_exception(SimpleNamespace(loggers=[good, stuck, none]), None, KeyboardInterrupt())
    assert time.time() - t0 < 3
    assert good.writer.closed.is_set() and good.writer.flushed and good._experiment is None
    assert stuck._experiment is None and not stuck.writer.closed.is_set()
    err = capfd.readouterr().err
    assert "the Logger's writer did not close within 0.5 s of the stop" in err and err.count("warning:") == 1
    # a writer that closes late does not vouch for the next one
    class Slow(Writer):
        def close(self):
            time.sleep(0.8)
            self.closed.set()

    slow, stuck2 = Logger(False), Logger(True)
    slow._experiment = slow.writer = Slow(False)
    cb.on_exception(SimpleNamespace(loggers=[slow, stuck2]), None, KeyboardInterrupt())
    assert capfd.readouterr().err.count("did not close within") == 2
    # every Trainer the entry points build carries it
    kw = stopping.with_signal_guard({"callbacks": []})
    assert sum(isinstance(c, stopping.LoggersCloseOnStop) for c in kw["callbacks"]) == 1
    assert stopping.with_signal_guard(kw)["callbacks"] == kw["callbacks"]


def test_sigterm_outside_a_trainer_stops_like_ctrl_c():
    """Loading, a plain evaluation loop: SIGTERM raises ``KeyboardInterrupt`` there too (the entry points
    then print the one line and exit 143); the caller's SIGTERM handling is back afterwards."""
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    try:
        with pytest.raises(KeyboardInterrupt):
            with stopping.guarded():
                assert signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL
                signal.raise_signal(signal.SIGTERM)
                time.sleep(1)  # not reached
        assert stopping.stop_signal() == signal.SIGTERM
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        t0 = time.time()
        while not stopping.armed() and time.time() - t0 < 5:
            time.sleep(0.01)
        stopping.disarm()


def test_overwrite_deletes_only_the_checkpoints_it_wrote_not_a_copy_under_another_name(tmp_path):
    """A byte copy of ``last.ckpt`` under another name carries the run's record (it is a copy), yet it is the user's:
    ``--overwrite`` decides by what the tool recorded when it wrote (name and digest), not by what a file holds."""
    import shutil

    import torch

    from shift_lightning.outputs import OutputExistsError
    from shift_lightning.resume import WRITTEN, AtomicCheckpointIO, check_checkpoint_dir, clear_checkpoints

    ck = tmp_path / "out.ckpt"
    ck.mkdir()
    io = AtomicCheckpointIO()
    io.save_checkpoint({"shift_lightning": {"run": {"key": "k"}}, "state_dict": {"w": torch.ones(3)}}, ck / "last.ckpt")
    io.save_checkpoint({"shift_lightning": {"run": {"key": "k"}}, "state_dict": {"w": torch.zeros(3)}},
                       ck / "step=2.ckpt")
    io.remove_checkpoint(ck / "step=2.ckpt")  # Lightning rotating its checkpoints
    shutil.copyfile(ck / "last.ckpt", ck / "mine.ckpt")  # the user's copy: the same bytes, another name
    with pytest.raises(OutputExistsError, match=r"holds files that are not checkpoints of a run \(mine.ckpt\)"):
        check_checkpoint_dir(ck, resuming=False, overwrite=True)
    assert sorted(p.name for p in ck.iterdir()) == sorted([WRITTEN, "last.ckpt", "mine.ckpt"])
    (ck / "mine.ckpt").rename(tmp_path / "mine.ckpt")  # moved out, as the error says: now --overwrite clears
    check_checkpoint_dir(ck, resuming=False, overwrite=True)
    assert clear_checkpoints(ck) == ["last.ckpt", WRITTEN] and not list(ck.iterdir())
    (ck / "x.ckpt").write_bytes((tmp_path / "mine.ckpt").read_bytes())  # no record left: legacy rule, still ours
    io.save_checkpoint({"shift_lightning": {"run": {}}, "state_dict": {}}, ck / "last.ckpt")
    (ck / "last.ckpt").write_bytes((tmp_path / "mine.ckpt").read_bytes())  # ours replaced by other bytes
    with pytest.raises(OutputExistsError, match="last.ckpt is not a checkpoint of a run"):
        check_checkpoint_dir(ck, resuming=False, overwrite=True)


def test_an_adapter_only_folder_refuses_a_base_whose_weights_changed(tmp_path):
    """An adapter-only folder names its base by path; when that folder is replaced by a same-shape model with other
    weights, its maps no longer fit: loading is refused (the record carries the base's fingerprint), unless asked."""
    import torch

    from shift_lightning import load_pretrained
    from shift_lightning.calibration import CalibrationConfig
    from shift_lightning.criteria import PruneConfig
    from shift_lightning.data import TextDataConfig
    from shift_lightning.models import ModelConfig, build_tiny_model
    from shift_lightning.recipes.calibrate import run_calibration
    from shift_lightning.maps.surgery import SurgeryError

    base = tmp_path / "base"
    model, tok = build_tiny_model("llama", num_hidden_layers=4, seed=0)
    model.save_pretrained(base), tok.save_pretrained(base)
    corpus = CORPUS
    run_calibration(model=ModelConfig(name_or_path=str(base)), prune=PruneConfig(layers=[2]),
                    data=TextDataConfig(source=corpus, num_samples=4, seq_len=32), calibration=CalibrationConfig(),
                    heldout=TextDataConfig(source=corpus, num_samples=0), trainer=dict(accelerator="cpu",
                    enable_progress_bar=False), output_dir=str(tmp_path / "out.calibration"), save_model="adapters")
    ids = torch.tensor([[5, 9, 33, 100, 7]])
    before = load_pretrained(str(tmp_path / "out.calibration"))[0](ids).logits
    other, _ = build_tiny_model("llama", num_hidden_layers=4, seed=1)  # same shape, other weights
    other.save_pretrained(base)
    with pytest.raises(SurgeryError, match=r"fitted on a base model with other weights .* accept_other_base=True"):
        load_pretrained(str(tmp_path / "out.calibration"))
    swapped = load_pretrained(str(tmp_path / "out.calibration"), accept_other_base=True)[0](ids).logits
    assert not torch.allclose(before, swapped)
    model.save_pretrained(base)  # the base restored: loads as before
    assert torch.equal(load_pretrained(str(tmp_path / "out.calibration"))[0](ids).logits, before)


@pytest.mark.parametrize("cmd,delays", [
    (["calibrate.py", "--config", "configs/tiny.yaml", "--trainer.enable_progress_bar", "false"], (0.5, 1.0, 1.5)),
    (["-m", "shift_lightning.recipes.gguf", "--model", "/nonexistent", "--out", "x.gguf"], (0.1, 0.2, 0.3)),
])
def test_ctrl_c_while_an_entry_point_starts_is_one_line_and_130(tmp_path, cmd, delays):
    """Ctrl-C during the imports of torch and Lightning (or of the GGUF export's command line): one line, status
    130, no traceback, as the docs promise from the first second on."""
    for d in delays:
        args = [sys.executable, *cmd] + (["--output_dir", str(tmp_path / f"o{d}")] if "calibrate.py" in cmd else [])
        p = subprocess.Popen(args, cwd=tmp_path if "-m" in cmd else ROOT, stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)},
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # a shell may ignore it
        time.sleep(d)
        p.send_signal(signal.SIGINT)
        _, err = p.communicate(timeout=120)
        if p.returncode == 2 and "error:" in err:  # it was already past start-up and refused the input: fine
            continue
        if p.returncode == -signal.SIGINT and "shift_lightning" not in err:  # still in the interpreter's own start-up
            continue  # (before any line of the program: no program can answer there)
        assert p.returncode == 130 and "Traceback" not in err, (d, p.returncode, err[-1500:])
        assert err.strip().splitlines()[-1].startswith("interrupted:"), err[-500:]


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has a GPU")
def test_asking_for_a_gpu_on_a_machine_without_one_is_one_line():
    r = subprocess.run([sys.executable, "calibrate.py", "--config", "configs/tiny.yaml", "--trainer.accelerator", "gpu",
                        "--output_dir", "/nonexistent/out"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert "error: --trainer.accelerator gpu: this machine has no usable GPU" in r.stderr
    assert "--trainer.accelerator cpu" in r.stderr


def test_an_edited_vocab_size_in_config_json_is_one_line(tmp_path):
    """``config.json``'s ``vocab_size`` edited: named with the tensor and both shapes, before transformers re-initialises
    anything (``load_pretrained`` and ``evaluate.py`` alike)."""
    from shift_lightning import load_pretrained
    from shift_lightning.arch import ModelLoadError
    from shift_lightning.models import build_tiny_model

    m, t = build_tiny_model("llama", num_hidden_layers=3)
    m.save_pretrained(tmp_path / "m"), t.save_pretrained(tmp_path / "m")
    cfg = json.loads((tmp_path / "m" / "config.json").read_text())
    (tmp_path / "m" / "config.json").write_text(json.dumps({**cfg, "vocab_size": 300}))
    with pytest.raises(ModelLoadError, match=r"config.json does not match the weights: \S+ is stored as 259 × 32, the "
                                             r"config makes it 300 × 32"):
        load_pretrained(str(tmp_path / "m"))
    r = subprocess.run([sys.executable, "evaluate.py", "--model.name_or_path", str(tmp_path / "m"), "--tasks", "",
                        "--ppl", HELDOUT, "--output_dir", str(tmp_path / "e")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "ignore_mismatched_sizes" not in r.stderr, r.stderr
    assert "error:" in r.stderr and "restore the folder's own config.json" in r.stderr


def test_a_base_that_needs_custom_code_is_one_line_and_runs_nothing(tmp_path):
    """A folder whose config.json names a custom architecture (auto_map), loaded directly or as the base of an
    adapter-only folder whose record asks for remote code: one error naming the flag, and its code never runs."""
    from shift_lightning import load_pretrained
    from shift_lightning.arch import ModelLoadError
    from shift_lightning.models import build_tiny_model

    m, t = build_tiny_model("llama", num_hidden_layers=3)
    base = tmp_path / "custom"
    m.save_pretrained(base), t.save_pretrained(base)
    cfg = json.loads((base / "config.json").read_text())
    cfg.update(model_type="xllama", auto_map={"AutoConfig": "modeling_x.XConfig",
                                              "AutoModelForCausalLM": "modeling_x.XModel"})
    (base / "config.json").write_text(json.dumps(cfg))
    (base / "modeling_x.py").write_text(f"open({str(tmp_path / 'ran')!r}, 'w').write('ran')\n")
    with pytest.raises(ModelLoadError, match="needs Python code of its own .* --model.trust_remote_code true"):
        load_pretrained(str(base))
    folder = tmp_path / "maps.calibration"
    folder.mkdir()
    (folder / "shift_config.json").write_text(json.dumps({
        "original_num_layers": 3, "pruned_layers": [1], "weights": "adapters", "adapters": [],
        "base_model": {"name_or_path": str(base), "trust_remote_code": True}}))
    from safetensors.torch import save_file

    save_file({}, str(folder / "lra.safetensors"))
    with pytest.raises(ModelLoadError, match="needs Python code of its own"):
        load_pretrained(str(folder))
    assert not (tmp_path / "ran").exists()


def test_a_save_to_disk_folder_with_the_wrong_layout_is_one_line(tmp_path):
    """``--data.source`` a folder that looks like ``datasets``' ``save_to_disk`` output but is not whole (no state,
    no arrow file), or lacks the text column: one line, exit 2, naming the folder and the fix."""
    bad = tmp_path / "ds"
    bad.mkdir()
    (bad / "dataset_info.json").write_text("{}")
    r = subprocess.run([sys.executable, "calibrate.py", "--config", "configs/tiny.yaml", "--data.source", str(bad),
                        "--output_dir", str(tmp_path / "o")], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr[-2000:]
    assert f"error: {bad} has the layout of a datasets save_to_disk folder but cannot be loaded" in r.stderr

    import datasets

    from shift_lightning.errors import DataError
    from shift_lightning.sources import load_texts

    datasets.Dataset.from_dict({"body": ["some text"]}).save_to_disk(str(tmp_path / "ok"))
    with pytest.raises(DataError, match=r"has no column 'text' \(its columns: body\); set --data.text_field"):
        load_texts(str(tmp_path / "ok"))
    assert load_texts(str(tmp_path / "ok"), text_field="body") == ["some text"]


def test_a_rank_killed_under_ddp_is_one_line_naming_it(tmp_path):
    """2-process DDP training, rank 1 killed (SIGKILL, as the OOM killer does): rank 0's collective fails; it says
    which rank ended and how in one line (exit 1), not gloo's traceback, and every process is gone within seconds."""
    err_path = tmp_path / "err.txt"
    cmd = [sys.executable, "train.py", "--config", "configs/tiny_lora.yaml", "--output_dir", str(tmp_path / "o"),
           "--trainer.devices", "2", "--trainer.strategy", "ddp", "--trainer.accelerator", "cpu",
           "--trainer.max_steps", "400", "--trainer.enable_progress_bar", "false"]
    with open(err_path, "w") as err:
        p = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err,
                             env={**os.environ, "OMP_NUM_THREADS": "1"})
    try:
        child, t0 = None, time.time()
        while child is None and time.time() - t0 < 180 and p.poll() is None:
            kids = subprocess.run(["pgrep", "-P", str(p.pid)], capture_output=True, text=True).stdout.split()
            child = next((int(k) for k in kids if "train.py" in Path(f"/proc/{k}/cmdline").read_text()), None)
            time.sleep(0.5)
        assert child is not None, err_path.read_text()[-2000:]
        while not (tmp_path / "o.calibration").exists() and p.poll() is None and time.time() - t0 < 180:
            time.sleep(0.5)  # calibrated: training starts
        time.sleep(3)
        os.kill(child, signal.SIGKILL)
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
    err = err_path.read_text()
    assert p.returncode == 1 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1].startswith("error: rank 1 (killed by SIGKILL) ended while rank 0 waited"), err
