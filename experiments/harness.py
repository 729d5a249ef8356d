"""One experiment harness for the result grids (``reproduce``, ``ablations``, ``recovery_table``).

A grid is *axes* (its own) + a *run function* (its own) + a *renderer* (``recipes/tables``); what
they share lives here, once:

* :class:`RunFolder` — plan → skip finished runs → write each run's JSON atomically; a run is one
  file, so a grid fills over several sittings, several processes or machines;
* :func:`open_grid` → :class:`GridContext` — the model on its device, its tokenizer, the evaluator
  (docs, perplexity windows and the original's closeness reference loaded once), one Trainer,
  token windows by source, the cache root (``$SHIFT_LIGHTNING_CACHE``) and what every run file
  records (model, configs, command, software, device);
* :func:`corrected` — the one way to put a calibration's correction on a pruned model and take it
  off again (adapters detached, ReplaceMe's folds undone);
* :func:`row_doc` — what a run file keeps of an evaluation (per-doc outcomes and per-window
  closeness, so tables get paired bootstrap intervals).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterator

import torch
from torch import nn

from shift_lightning import assets
from shift_lightning.arch import decoder_layers
from shift_lightning.data import TextDataConfig, TokenWindows, build_windows
from shift_lightning.errors import ConfigError, DataError
from shift_lightning.evaluation.runner import EvalConfig, Evaluator, evaluate_model, make_evaluator, record_reference
from experiments.trunk import TrunkCache
from shift_lightning.models import ModelConfig
from shift_lightning.outputs import write_json_atomic

log = logging.getLogger(__name__)


def json_close(a, b, rel: float = 1e-9) -> bool:
    """The same JSON up to floats within ``rel`` of each other."""
    import math

    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(json_close(a[k], b[k], rel) for k in a)
    if isinstance(a, list):
        return isinstance(b, list) and len(a) == len(b) and all(json_close(x, y, rel) for x, y in zip(a, b))
    if isinstance(a, float) and isinstance(b, (int, float)) and not isinstance(b, bool):
        return math.isclose(a, b, rel_tol=rel, abs_tol=1e-300) or (a != a and b != b)
    return a == b


def write_json_unless_close(path: Path, doc: dict, rel: float = 1e-9) -> bool:
    """Write ``doc`` as JSON unless the file holds the same up to floats within ``rel`` (numpy reductions differ in
    the last digits between machines: a re-render must not leave a clean clone modified); True when written."""
    path = Path(path)
    if path.is_file():
        try:
            if json_close(json.loads(path.read_text()), json.loads(json.dumps(doc)), rel):
                return False
        except ValueError:
            pass
    write_json_atomic(path, doc)
    return True


def model_key(name: str) -> str:
    """The folder name of a model's runs."""
    return Path(name).name.replace("/", "_")


def resolve_device(name: str) -> torch.device:
    """``auto`` → ``cuda`` when a GPU is visible, else ``cpu``. On a GPU, TF32 is switched off so
    float32 matmuls keep float32 precision (the CPU's)."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError("--device cuda: no GPU is visible to torch (torch.cuda.is_available() is False); "
                              "use --device cpu or auto")
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def software(device: torch.device | None = None) -> dict:
    """Versions and the machine a run was made on."""
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version(),
           "machine": f"{platform.machine()}, {torch.get_num_threads()} threads"}
    out["device"] = f"cuda: {torch.cuda.get_device_name(device)}, tf32 off"\
        if device is not None and device.type == "cuda" else "cpu"
    return out


def quiet_trainer_factory(device: torch.device | None = None) -> Callable:
    """One single-process Trainer on ``device``, reused for every pass: no logger, checkpoints or model
    summary; each pass's progress (criterion scores, calibration statistics, …) as a bar on a terminal
    and a line every 30 s in a log file."""
    import lightning as L

    from shift_lightning.progress import StageProgress

    cache: list = []
    gpu = device is not None and device.type == "cuda"

    def make():
        if not cache:
            cache.append(L.Trainer(accelerator="gpu" if gpu else "cpu", devices=[device.index or 0] if gpu else 1,
                                   inference_mode=False, logger=False, enable_checkpointing=False,
                                   enable_model_summary=False, use_distributed_sampler=False,
                                   callbacks=[StageProgress()]))
        return cache[0]

    return make


def row_doc(res: dict) -> dict:
    """What a run file keeps of an evaluation (per-doc outcomes and per-item closeness included)."""
    keep = ("metric", "value", "acc", "acc_norm", "n", "n_available", "chance", "split", "sampling", "per_doc")
    out = {"tasks": {t: {k: e[k] for k in keep if k in e} for t, e in res["tasks"].items()},
           "average": res["average"], "perplexity": res["perplexity"], "bos_added": res["bos_added"],
           "eval_seconds": res["seconds"]}
    if "closeness" in res:
        out.update(kl=res["kl"], top1=res["top1"], closeness=res["closeness"])
    return out


# ---------------------------------------------------------------------------------------------
# Runs on disk
# ---------------------------------------------------------------------------------------------
class RunFolder:
    """One JSON file per run (``<folder>/<name>.json``; ``/`` in a name becomes a subfolder)."""

    def __init__(self, folder: Path | str):
        self.folder = Path(folder)

    def path(self, name: str) -> Path:
        return self.folder / f"{name}.json"

    def done(self, name: str) -> bool:
        return self.path(name).exists()

    def pending(self, names: list[str]) -> list[str]:
        return [n for n in names if not self.done(n)]

    def read(self, name: str) -> dict:
        return read_run(self.path(name))

    def write(self, name: str, doc: dict) -> None:
        write_json_atomic(self.path(name), doc)

    def all(self, pattern: str = "**/*.json", skip: tuple[str, ...] = ("selection.json",)) -> dict[str, dict]:
        """Every run file under the folder: relative name (no suffix) -> document."""
        out = {}
        for f in sorted(self.folder.glob(pattern)):
            if f.name not in skip:
                out[str(f.relative_to(self.folder).with_suffix(""))] = read_run(f)
        return out


def read_run(path: Path) -> dict:
    """A run file's document; a damaged one (cut short, not JSON, not an object) is one line naming the file and the
    fix, not a traceback in the middle of a grid."""
    try:
        doc = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DataError(f"Run file {path} is damaged ({type(e).__name__}: {e}); delete it and run the grid again "
                        "to redo that cell (finished cells are kept)") from None
    if not isinstance(doc, dict):
        raise DataError(f"Run file {path} holds a {type(doc).__name__}, not a run's JSON object; delete it and run "
                        "the grid again to redo that cell")
    return doc


# ---------------------------------------------------------------------------------------------
# The shared context of a grid
# ---------------------------------------------------------------------------------------------
def reference_file(model: nn.Module, name: str, cfg: EvalConfig, device: torch.device) -> Path:
    """Where the original's closeness reference is cached: keyed by the model (name, size, a checksum
    of its weights), the evaluation settings and the device type."""
    import hashlib

    with torch.no_grad():
        check = [float(p.double().sum()) for p in list(model.parameters())[:3]] + [sum(p.numel() for p in
                                                                                     model.parameters())]
    # progress bars do not change the reference (kept at the value the caches were first keyed with)
    settings = {**asdict(cfg), "progress": False}
    key = json.dumps({"model": name, "weights": check, "eval": settings, "device": device.type}, sort_keys=True)
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return assets.cache_root() / "closeness" / f"{model_key(name)}-{digest}.safetensors"


def save_reference(evaluator: Evaluator, path: Path) -> None:
    """Cache the recorded reference (one process only: under DDP each rank holds its own units)."""
    import torch.distributed as tdist
    from safetensors.torch import save_file

    if tdist.is_available() and tdist.is_initialized():
        return
    tensors = {}
    for (name, i), ref in evaluator.reference.items():
        tensors[f"{name}\t{i}\tindex"], tensors[f"{name}\t{i}\tlogp"] = ref.index.contiguous(), ref.logp.contiguous()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.part-{os.getpid()}")  # grid processes started together may race here
    save_file(tensors, str(tmp))
    tmp.replace(path)


def load_reference(evaluator: Evaluator, path: Path) -> bool:
    """Use a cached reference when there is one (single process); returns whether it was used."""
    import torch.distributed as tdist
    from safetensors.torch import load_file

    from shift_lightning.closeness import TopK

    evaluator.reference_file = None
    if not path.exists() or (tdist.is_available() and tdist.is_initialized()):
        return False
    t = load_file(str(path))
    refs: dict = {}
    for key in t:
        name, i, part = key.split("\t")
        refs.setdefault((name, int(i)), {})[part] = t[key]
    evaluator.reference = {k: TopK(v["index"], v["logp"]) for k, v in refs.items()}
    evaluator.recorded, evaluator.reference_file = True, path
    return True


@dataclass
class GridContext:
    """What every run of a grid shares (see the module doc)."""

    model: nn.Module
    tokenizer: object
    device: torch.device
    eval_config: EvalConfig
    evaluator: Evaluator
    make_trainer: Callable
    meta: dict
    text_source: str = "wiki_summaries"
    _windows: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return len(decoder_layers(self.model))

    @property
    def cache(self) -> Path:
        return assets.cache_root()

    def windows(self, num_samples: int, seq_len: int, split: str = "calibration", source: str | None = None,
                seed: int = 0) -> TokenWindows:
        """Token windows of a text source (memoised)."""
        key = (source or self.text_source, split, num_samples, seq_len, seed)
        if key not in self._windows:
            cfg = TextDataConfig(source=key[0], split=split, num_samples=num_samples, seq_len=seq_len, seed=seed)
            self._windows[key] = build_windows(cfg, self.tokenizer, self.model.config.model_type)
        return self._windows[key]

    def evaluate(self, model: nn.Module, trunk: TrunkCache | None = None, record: bool = False,
                 tasks: bool = True) -> dict:
        """Evaluate ``model`` with the grid's evaluator; ``trunk``: record (``record=True``) or replay
        the shared blocks' states; ``tasks=False``: perplexity and closeness only."""
        if trunk is None:
            return evaluate_model(model, self.tokenizer, self.eval_config, self.evaluator, tasks=tasks)
        with (trunk.recording(model) if record else trunk.replaying(model)):
            return evaluate_model(model, self.tokenizer, self.eval_config, self.evaluator, tasks=tasks)


def open_grid(model: str, tiny: dict | None, device: str, eval_config: Callable[[int, torch.device], EvalConfig],
              meta: dict, text_source: str = "wiki_summaries") -> GridContext:
    """Load the model on its device, build the evaluator and record the original's closeness
    reference (when ``kl``); ``eval_config(vocab_size, device)`` gives the evaluation settings."""
    from shift_lightning.checkpoint import load_pretrained

    dev = resolve_device(device)
    lm, tokenizer = load_pretrained(ModelConfig(name_or_path=model, tiny=tiny), device=dev)
    ev_cfg = eval_config(lm.config.vocab_size, dev)
    evaluator = make_evaluator(lm, tokenizer, ev_cfg)
    if ev_cfg.kl:
        t0 = time.time()
        cached = reference_file(lm, model, ev_cfg, dev)
        if not load_reference(evaluator, cached):
            record_reference(lm, evaluator)
            save_reference(evaluator, cached)
        log.info("%s: the original's closeness reference %s (%d positions kept, top %d; %.0f s)", model,
                 "read from " + str(cached) if evaluator.reference_file else "recorded",
                 sum(len(r) for r in evaluator.reference.values()), ev_cfg.kl_topk, time.time() - t0)
    meta = {"model": model, "model_type": lm.config.model_type, "layers": len(decoder_layers(lm)), **meta,
            "eval": asdict(ev_cfg), "software": software(dev)}
    return GridContext(lm, tokenizer, dev, ev_cfg, evaluator, quiet_trainer_factory(dev), meta, text_source)


def add_closeness(ctx: GridContext, runs: RunFolder, name: str, res: dict) -> None:
    """Add closeness (``res``: a perplexity + closeness evaluation) to an older run file, if the
    rebuilt model is the one it describes: its perplexity must match the stored one to 1e-3."""
    doc = runs.read(name)
    check = {p: [doc["perplexity"][p]["ppl"], e["ppl"]] for p, e in res["perplexity"].items() if p in doc["perplexity"]}
    worst = max((abs(b - a) / abs(a) for a, b in check.values()), default=0.0)
    if worst > 1e-3:
        log.error("%s: the rebuilt model's perplexity differs from the stored run's by %.2g (relative): not the "
                  "same model; closeness NOT added (%s)", name, worst, check)
        return
    doc.update(kl=res["kl"], top1=res["top1"], closeness=res["closeness"])
    doc["closeness_added"] = {"eval": {k: getattr(ctx.eval_config, k) for k in ("kl_docs", "kl_topk")},
                              "software": ctx.meta["software"], "command": ctx.meta["command"],
                              "ppl_check": check, "max_ppl_rel_diff": worst, "seconds": res["seconds"]}
    runs.write(name, doc)
    log.info("%s: closeness added (KL %s; PPL reproduced to %.1e)", name,
             ", ".join(f"{k} {v:.3f}" for k, v in res["kl"].items()), worst)


@contextlib.contextmanager
def corrected(model: nn.Module, correction, num_layers: int, removed: list[int]) -> Iterator[nn.Module]:
    """``model`` (already pruned) with ``correction`` applied for the length of the ``with``;
    afterwards the adapters are detached and ReplaceMe's folded maps undone, exactly."""
    from shift_lightning.maps.surgery import apply_maps, detach_adapters

    if correction is None:
        yield model
        return
    blocks = decoder_layers(model)
    saved = {j: b.mlp.down_proj.weight.detach().clone() for j, b in enumerate(blocks)
             if (correction.branch_maps or correction.down_maps) and hasattr(b, "mlp")}
    stock = _stock_state(model) if correction.embedding is not None else None
    apply_maps(model, correction, num_layers, removed)
    try:
        yield model
    finally:
        detach_adapters(model)
        if correction.branch_maps or correction.down_maps:
            for j, block in enumerate(decoder_layers(model)):
                _unfold_replaceme(block, saved.get(j))
        if stock is not None:
            _restore_stock(model, stock)


def _stock_state(model: nn.Module) -> dict:
    """What the stock repair's embedding fold changes: the table, a tied head (untied) and the config's flag."""
    emb, head = model.get_input_embeddings(), model.get_output_embeddings()
    return {"emb": emb.weight, "head": head.weight if head is not None else None,
            "tie": model.config.tie_word_embeddings}


def _restore_stock(model: nn.Module, st: dict) -> None:
    """Undo :func:`_stock_state`'s changes exactly (the original parameter objects are put back)."""
    model.get_input_embeddings().weight = st["emb"]
    if st["head"] is not None:
        model.get_output_embeddings().weight = st["head"]
    model.config.tie_word_embeddings = st["tie"]


def _unfold_replaceme(block, original_down: torch.Tensor | None) -> None:
    """Undo :func:`shift_lightning.maps.peers.fold_replaceme` (``original_down``: the saved ``down_proj.weight``)."""
    from shift_lightning.maps.peers import BranchMap

    if isinstance(getattr(block, "post_feedforward_layernorm", None), BranchMap):
        block.post_feedforward_layernorm = block.post_feedforward_layernorm.norm
    elif original_down is not None:
        with torch.no_grad():
            block.mlp.down_proj.weight.copy_(original_down)
