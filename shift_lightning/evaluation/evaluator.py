"""The framework-free evaluator: what to evaluate (:class:`EvalConfig`) and :class:`Evaluator`, which
splits the work into *units* (a chunk of one task's docs, of perplexity windows, or of the tasks'
prompts for closeness), scores a unit, and writes each doc's metrics into dense float64 per-doc
vectors (identical doc order on every rank). Each doc is scored on exactly one rank, so a plain sum
across ranks gives every rank the full per-doc vectors: the results equal a 1-process run, and the
per-doc outcomes (paired across models scored on the same docs) feed bootstrap intervals
(the research tables' `experiments/summary.py`). Driving it over ranks: :mod:`.runner`."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..arch import base_model
from ..closeness import topk_reference
from ..config import EvalConfig  # noqa: F401 (re-exported)
from ..data import check_seq_len, wants_bos
from ..errors import ConfigError
from . import closeness as F
from . import perplexity as P
from . import scoring as S
from .tasks import TASKS, Doc, load_docs, parse_tasks

def _bool_opt(v: str) -> bool | None:
    if v in ("auto", None):
        return None
    if str(v).lower() in ("true", "1", "yes"):
        return True
    if str(v).lower() in ("false", "0", "no"):
        return False
    raise ConfigError(f"BOS option must be auto, true or false (got {v!r})")


def _ppl_names(ppl: str | list[str] | None) -> list[str]:
    if not ppl:
        return []
    return [p.strip() for p in (ppl.split(",") if isinstance(ppl, str) else ppl) if p.strip()]


class TokenizerMissing(ConfigError):
    """The model to evaluate came without a usable tokenizer."""


def check_tokenizer(tokenizer) -> None:
    if tokenizer is None or not callable(getattr(tokenizer, "encode", None)):
        raise TokenizerMissing(
            "Evaluation needs the model's tokenizer (got "
            f"{type(tokenizer).__name__}). Load it with the model (shift_lightning.models.load_model) "
            "or save it next to the weights (tokenizer.save_pretrained(folder))."
        )


@dataclass
class Unit:
    """A piece of work: ``kind="task"`` (docs of one task) or ``"ppl"`` (windows of one set)."""

    kind: str
    name: str
    items: list = field(default_factory=list)
    start: int = 0
    """Index of the first item in its set (perplexity windows, prompt windows)."""


class Evaluator:
    """Builds the work units and accumulates per-doc metrics. Identical on every rank (same data,
    same units); each rank scores its own units; ``state()`` is summed across ranks before
    ``compute()``."""

    def __init__(self, tokenizer, cfg: EvalConfig, model_type: str | None = None, wants_bos_ppl: bool = False):
        check_tokenizer(tokenizer)
        self.tok, self.cfg = tokenizer, cfg
        self.add_bos = _bool_opt(cfg.add_bos)
        self.task_names = parse_tasks(cfg.tasks) if cfg.tasks else []
        self.task_data = {
            t: load_docs(t, cfg.source, cfg.data_dir, cfg.data_files, cfg.limit, cfg.sample_seed)
            for t in self.task_names
        }
        self.ppl_names = _ppl_names(cfg.ppl)
        self.ppl_windows = {
            name: P.ppl_windows(tokenizer, P.load_ppl_texts(name), cfg.ppl_seq_len, cfg.ppl_stride,
                                  wants_bos_ppl, cfg.ppl_max_windows)
            for name in self.ppl_names
        }
        self.ppl_bos = wants_bos_ppl
        self.prompts: list[F.PromptWindow] = []
        self.prompt_labels: list[str] = []
        if cfg.kl and cfg.kl_docs > 0 and self.task_names:
            self.prompts, self.prompt_labels = F.prompt_windows(
                {t: td.docs for t, td in self.task_data.items()}, tokenizer, self.add_bos, cfg.kl_docs, cfg.max_length)
        self.reference: dict[tuple[str, int], "F.TopK"] = {}
        """The original's top-k distributions per (set, window), recorded on this rank's units."""
        self.recorded = False
        self.reference_file = None
        """Where the reference was read from, when it was cached rather than recorded."""
        self._softcap = None
        # Dense per-doc float64 vectors in the (rank-independent) doc order of task_data.
        self.pos = {t: {d.idx: i for i, d in enumerate(td.docs)} for t, td in self.task_data.items()}
        self.sums: dict[str, dict[str, torch.Tensor]] = {}
        self.n_requests = 0
        self.reset()

    def reset(self, device=None) -> None:
        dev = device if device is not None else torch.device("cpu")
        f64 = dict(dtype=torch.float64, device=dev)
        self.sums = {}
        for t, td in self.task_data.items():
            keys = ("acc", "ll") if TASKS[t].output_type == "loglikelihood" else ("acc", "acc_norm")
            self.sums[t] = {k: torch.zeros(len(td.docs), **f64) for k in keys + ("seen",)}
        for p in self.ppl_names:
            self.sums[f"ppl/{p}"] = {"nll": torch.zeros(1, **f64), "tokens": torch.zeros(1, **f64)}
        self.closeness_sums = {name: F.ClosenessSums(n, dev) for name, n in self.closeness_sets().items()}
        self.n_requests = 0

    def closeness_sets(self) -> dict[str, int]:
        """Set name -> number of items (windows, or docs for the prompts) of the closeness measure."""
        if not self.cfg.kl:
            return {}
        out = {p: len(w) for p, w in self.ppl_windows.items()}
        if self.prompts:
            out[F.TASKS_SET] = len(self.prompt_labels)
        return out

    def state(self) -> list[torch.Tensor]:
        """Every sum, in a fixed order (what is summed across ranks)."""
        return [v for group in self.sums.values() for v in group.values()] + \
            [t for f in self.closeness_sums.values() for t in f.tensors()]

    # ---------------------------------------------------------------- units
    def units(self) -> list[Unit]:
        out: list[Unit] = []
        k = max(1, self.cfg.docs_per_unit)
        for t, td in self.task_data.items():
            # Longest docs first: similar lengths share a unit (little padding).
            docs = sorted(td.docs, key=lambda d: -max(len(c) + len(x) for c, x in zip(d.contexts, d.continuations)))
            out += [Unit("task", t, docs[i:i + k]) for i in range(0, len(docs), k)]
        for p, wins in self.ppl_windows.items():
            step = max(1, self.cfg.ppl_batch_size)
            out += [Unit("ppl", p, wins[i:i + step], start=i) for i in range(0, len(wins), step)]
        step = max(1, self.cfg.docs_per_unit)
        out += [Unit("prompts", F.TASKS_SET, self.prompts[i:i + step], start=i)
                for i in range(0, len(self.prompts), step)]
        return out


    # ---------------------------------------------------------------- scoring
    def _closeness(self, model: nn.Module, name: str, record: bool):
        """``(i, logits)`` -> record the original's distributions, or add KL / top-1 against them."""
        if not self.cfg.kl or not (record or self.recorded):
            return None
        softcap = getattr(getattr(model, "config", None), "final_logit_softcapping", None)

        def on_logits(i: int, logits: torch.Tensor, item: int | None = None) -> None:
            ref = topk_reference(logits, self.cfg.kl_topk, softcap) if record else self.reference[(name, i)]
            if record:
                self.reference[(name, i)] = ref
            self.closeness_sums[name].add(i if item is None else item, logits, ref, softcap)  # the original: KL 0

        return on_logits

    def score_unit(self, model: nn.Module, unit: Unit, record: bool = False) -> None:
        """Score ``unit``; with ``record`` (the original model) also keep its distributions as the
        reference of every later evaluation (its own closeness is then KL 0, top-1 100 %)."""
        if unit.kind == "ppl":
            hook = self._closeness(model, unit.name, record)
            cb = None if hook is None else (lambda i, lg: hook(unit.start + i, lg))
            nll, n = P.window_nll(model, unit.items, self.cfg.ppl_batch_size, on_logits=cb)
            self.sums[f"ppl/{unit.name}"]["nll"] += nll
            self.sums[f"ppl/{unit.name}"]["tokens"] += n
            return
        if unit.kind == "prompts":
            hook = self._closeness(model, unit.name, record)
            if hook is not None:
                pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
                for i, lg in F.prompt_logits(model, unit.items, self.cfg.max_batch_tokens, pad):
                    hook(unit.start + i, lg, unit.items[i].item)
            return
        docs: list[Doc] = unit.items
        reqs, spans = [], []
        for d in docs:
            spans.append((len(reqs), len(d.contexts)))
            for c, x in zip(d.contexts, d.continuations):
                ctx, cont = S.encode_pair(self.tok, c, x, self.add_bos)
                reqs.append(S.Request(tuple(ctx), tuple(cont)))
        cfg = self.cfg
        max_len = cfg.max_length or getattr(getattr(model, "config", None), "max_position_embeddings", None)
        pad = self.tok.pad_token_id if self.tok.pad_token_id is not None else 0
        res = S.score_requests(model, reqs, batch_size=cfg.batch_size, max_batch_tokens=cfg.max_batch_tokens,
                               max_row_tokens=cfg.max_row_tokens, share_prefix=cfg.share_prefix,
                               max_length=max_len, pad_id=pad)
        self.n_requests += len(reqs)
        sums, pos = self.sums[unit.name], self.pos[unit.name]
        for d, (s, n) in zip(docs, spans):
            lls = [r[0] for r in res[s:s + n]]
            if TASKS[unit.name].output_type == "loglikelihood":
                vals = {"acc": float(res[s][1]), "ll": lls[0]}
            else:
                vals = S.choice_metrics(lls, d.gold, d.norm_lens)
            i = pos[d.idx]
            for k, v in vals.items():
                sums[k][i] += v
            sums["seen"][i] += 1.0

    # ---------------------------------------------------------------- results
    def compute(self, tasks: bool = True) -> dict:
        """Results from the (already summed across ranks) per-doc vectors (``tasks=False``: the
        perplexity and closeness sets only, when the task units were not run)."""
        res: dict[str, Any] = {"tasks": {}, "perplexity": {}}
        for t in (self.task_names if tasks else []):
            task, td, sums = TASKS[t], self.task_data[t], self.sums[t]
            seen = sums["seen"].cpu()
            if not bool((seen == 1).all()):
                raise RuntimeError(f"{t}: {int((seen != 1).sum())} docs were not scored exactly once "
                                   "(build the Trainer with use_distributed_sampler=False)")
            n = len(td.docs)
            per_doc = {k: v.cpu() for k, v in sums.items() if k != "seen"}
            entry: dict[str, Any] = {k: float(v.mean()) if n else float("nan") for k, v in per_doc.items() if k != "ll"}
            if "ll" in per_doc:
                entry["ppl"] = math.exp(-float(per_doc["ll"].mean()))
            entry.update(metric=task.metric, value=entry[task.metric], n=n, n_available=td.n_available,
                         sampling=self._sampling(), split=td.split, data=td.origin)
            if task.output_type == "multiple_choice":
                entry["chance"] = chance_level(td.docs)
            entry["per_doc"] = {"doc_ids": [d.idx for d in td.docs],
                                **{k: [round(float(x), 6) if k == "ll" else int(x) for x in v]
                                   for k, v in per_doc.items()}}
            res["tasks"][t] = entry
        for p in self.ppl_names:
            nll, n = float(self.sums[f"ppl/{p}"]["nll"].item()), int(self.sums[f"ppl/{p}"]["tokens"].item())
            res["perplexity"][p] = {"ppl": S.perplexity(nll, n), "nll_per_token": nll / max(n, 1), "tokens": n,
                                    "windows": len(self.ppl_windows[p]), "seq_len": self.cfg.ppl_seq_len,
                                    "stride": self.cfg.ppl_stride or self.cfg.ppl_seq_len - 1,
                                    "bos": self.ppl_bos}
        if self.cfg.kl and (self.recorded or self.reference):
            res["closeness"] = {name: F.summarize(f) for name, f in self.closeness_sums.items()}
            res["kl"] = {name: e["kl"] for name, e in res["closeness"].items()}
            res["top1"] = {name: e["top1"] for name, e in res["closeness"].items()}
        mc = [e["value"] for t, e in res["tasks"].items() if TASKS[t].output_type == "multiple_choice"]
        res["average"] = sum(mc) / len(mc) if mc else None
        res["bos_added"] = S.bos_added(self.tok, self.add_bos)
        return res

    def _sampling(self) -> str:
        c = self.cfg
        if c.limit is None:
            return "all"
        return f"first {c.limit}" if c.sample_seed is None else f"random {c.limit} (seed {c.sample_seed})"



def chance_level(docs: list[Doc]) -> float:
    """Accuracy of the best answer-blind strategy on these docs: guessing uniformly
    (mean of 1/#choices) or always picking the same choice index (e.g. BoolQ's "yes")."""
    if not docs:
        return float("nan")
    uniform = sum(1.0 / len(d.contexts) for d in docs) / len(docs)
    counts: dict[int, int] = {}
    for d in docs:
        counts[d.gold] = counts.get(d.gold, 0) + 1
    return max(uniform, max(counts.values()) / len(docs))


def _model_type(model: nn.Module) -> str | None:
    return getattr(getattr(base_model(model), "config", None), "model_type", None)


def make_evaluator(model: nn.Module, tokenizer, cfg: EvalConfig) -> Evaluator:
    check_tokenizer(tokenizer)
    if _ppl_names(cfg.ppl):
        check_seq_len(model, cfg.ppl_seq_len, "--ppl_seq_len")
    bos = wants_bos(tokenizer, _model_type(model), cfg.ppl_add_bos) if _ppl_names(cfg.ppl) else False
    return Evaluator(tokenizer, cfg, _model_type(model), bos)
