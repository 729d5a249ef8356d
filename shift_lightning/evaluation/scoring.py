"""Batched continuation log-likelihood scoring, lm-evaluation-harness compatible. Framework-free.

A request is a ``(context, continuation)`` pair of strings. Its score is

    ll = Σ_t log p(cont_t | context, cont_<t)          (summed over continuation tokens, fp32+)
    is_greedy = all_t argmax p(· | …) == cont_t

Tokenisation follows ``lm_eval.api.model.TemplateLM`` (0.4.13): trailing whitespace of the context
moves to the continuation; ``whole = enc(context + continuation)``, ``ctx = enc(context)``,
``cont = whole[len(ctx):]`` (joint tokenisation, then split); an empty context is replaced by the
BOS (else EOS) token. BOS: ``add_bos=None`` ("auto") keeps the tokenizer's default
(``add_special_tokens=True``; HFLM's default since 0.4.10: SmolLM2 adds none, Gemma adds ``<bos>``),
``True``/``False`` force it; a string that already starts with the BOS text never gets a second one.

Efficiency (results equal to one request per forward pass, see tests):

* **prefix sharing**: the model input of a request is ``inp = (ctx + cont)[:-1]``; the inputs of a
  batch are inserted into a token *trie* (sorted lexicographically), so a shared context, a shared
  question prefix or an identical request is run once. A trie row is flattened in DFS order and run
  with a 4-D "ancestor" attention mask (token j sees token i iff i is on j's root path) and
  ``position_ids = depth``; a causal LM then gives every node exactly the logits it would get in its
  own sequence. With ``share_prefix=False`` every request is its own row (plain causal, right-padded).
* rows are sorted by length and several go in one forward pass (``batch_size`` rows,
  ``max_batch_tokens`` padded tokens); only the positions that are scored go through the LM head
  (``logits_to_keep``), and log-softmax runs on those positions only, in float32 (or float64).

Prefix sharing needs an attention implementation that takes a custom 4-D mask (``sdpa``, ``eager``)
and, for sliding-window models (Gemma3, Qwen2), trie depth within the window; otherwise requests
fall back to plain rows automatically.
"""

from __future__ import annotations

import inspect
import math
from dataclasses import dataclass, field
from typing import Iterable, Sequence

import numpy as np
import torch
from torch import nn

from ..arch import base_model
from ..errors import ConfigError


# --------------------------------------------------------------------------------------------
# Tokenisation (lm-eval TemplateLM / HFLM semantics)
# --------------------------------------------------------------------------------------------
def tok_encode(tokenizer, text: str, add_bos: bool | None = None) -> list[int]:
    """``HFLM.tok_encode``: tokenizer default unless ``add_bos`` is given; never a second BOS."""
    kw = {} if add_bos is None else {"add_special_tokens": add_bos}
    bos = tokenizer.bos_token_id
    if bos is not None and text.startswith(tokenizer.decode(bos)) and tokenizer.decode(bos):
        kw["add_special_tokens"] = False
    return tokenizer.encode(text, **kw)


def prefix_token_id(tokenizer) -> int:
    """Token that stands in for an empty context (HFLM: BOS, else EOS)."""
    tid = tokenizer.bos_token_id if tokenizer.bos_token_id is not None else tokenizer.eos_token_id
    if tid is None:
        raise ConfigError("The tokenizer has neither a BOS nor an EOS token: cannot score an empty context; give the "
                          "tokenizer a bos_token or eos_token")
    return tid


def encode_pair(tokenizer, context: str, continuation: str, add_bos: bool | None = None) -> tuple[list[int], list[int]]:
    """Token ids ``(context, continuation)`` of one request, exactly as lm-eval builds them."""
    if context == "":
        cont = tokenizer.encode(continuation, add_special_tokens=False)
        p = prefix_token_id(tokenizer)
        return ([p], cont) if p != cont[0] else (cont[:1], cont[1:])
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok_encode(tokenizer, context + continuation, add_bos)
    ctx = tok_encode(tokenizer, context, add_bos)
    return ctx, whole[len(ctx):]


def bos_added(tokenizer, add_bos: bool | None = None) -> bool:
    """Whether requests start with BOS under this setting (recorded in results)."""
    ids = tok_encode(tokenizer, "a", add_bos)
    return tokenizer.bos_token_id is not None and len(ids) > 0 and ids[0] == tokenizer.bos_token_id


@dataclass(frozen=True)
class Request:
    """Token ids of one request. ``context`` and ``continuation`` are non-empty."""

    context: tuple[int, ...]
    continuation: tuple[int, ...]

    def inputs(self, max_length: int | None = None) -> tuple[int, ...]:
        """Model input ``(ctx + cont)[:-1]``, left-truncated to ``max_length`` tokens (HFLM)."""
        full = self.context + self.continuation
        if max_length is not None:
            full = full[-(max_length + 1):]
        return full[:-1]


# --------------------------------------------------------------------------------------------
# Packing requests into trie rows and rows into batches
# --------------------------------------------------------------------------------------------
@dataclass
class Row:
    """One model input row: a flattened trie (or a single plain sequence).

    tokens/positions/parents: (L,) lists; ``parents[j] = -1`` for a root.
    scored: ``(request index, node indices (c,))``: node k's logits predict ``continuation[k]``.
    """

    tokens: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    scored: list[tuple[int, list[int]]] = field(default_factory=list)
    tree: bool = True

    def __len__(self) -> int:
        return len(self.tokens)


def _lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def pack_rows(requests: Sequence[Request], *, share_prefix: bool = True, max_row_tokens: int = 512,
              max_length: int | None = None, max_tree_depth: int | None = None) -> list[Row]:
    """Cover ``requests`` with rows. Shared prefixes are stored once per row (see module doc).

    Requests longer than ``max_tree_depth`` (a sliding window) or ``max_row_tokens`` get a plain row.
    """
    rows: list[Row] = []
    inps = [r.inputs(max_length) for r in requests]
    for i, r in enumerate(requests):
        if len(r.continuation) == 0 or len(inps[i]) == 0:
            raise ConfigError(f"Request {i} has an empty context or continuation after tokenisation: check the task data")
        if len(r.continuation) > len(inps[i]):
            raise ConfigError(f"Request {i}: continuation ({len(r.continuation)} tokens) longer than max_length "
                              f"({max_length}); raise --max_length")

    def scored_nodes(path: list[int], i: int) -> list[int]:
        c = len(requests[i].continuation)
        return path[len(inps[i]) - c: len(inps[i])]

    plain = [i for i in range(len(requests))
             if not share_prefix or len(inps[i]) > max_row_tokens
             or (max_tree_depth is not None and len(inps[i]) > max_tree_depth)]
    for i in plain:
        n = len(inps[i])
        rows.append(Row(list(inps[i]), list(range(n)), list(range(-1, n - 1)),
                        [(i, scored_nodes(list(range(n)), i))], tree=False))
    plain_set = set(plain)
    order = sorted((i for i in range(len(requests)) if i not in plain_set), key=lambda i: inps[i])
    row, path, prev = None, [], ()
    for i in order:
        s = inps[i]
        k = _lcp(prev, s) if row is not None else 0
        if row is not None and len(row) + len(s) - k > max_row_tokens:
            row, k = None, 0
        if row is None:
            row, path = Row(), []
            rows.append(row)
        del path[k:]
        for depth in range(k, len(s)):
            row.parents.append(path[depth - 1] if depth else -1)
            row.tokens.append(s[depth])
            row.positions.append(depth)
            path.append(len(row.tokens) - 1)
        row.scored.append((i, scored_nodes(path, i)))
        prev = s
    return rows


def plan_batches(rows: Sequence[Row], batch_size: int, max_batch_tokens: int) -> list[list[Row]]:
    """Group rows (sorted longest first, plain and trie rows apart) into batches of at most
    ``batch_size`` rows and ``max_batch_tokens`` padded tokens (a longer single row still runs)."""
    batches: list[list[Row]] = []
    for kind in (False, True):
        cur: list[Row] = []
        for r in sorted((r for r in rows if r.tree == kind), key=len, reverse=True):
            width = len(cur[0]) if cur else len(r)
            if cur and (len(cur) >= batch_size or (len(cur) + 1) * width > max_batch_tokens):
                batches.append(cur)
                cur = []
            cur.append(r)
        if cur:
            batches.append(cur)
    return batches


def ancestor_mask(parents: Sequence[int], width: int) -> torch.Tensor:
    """(width, width) bool: ``M[j, i]`` iff node i is j or an ancestor of j. Padding sees itself."""
    m = torch.zeros(width, width, dtype=torch.bool)
    for j, p in enumerate(parents):
        if p >= 0:
            m[j] = m[p]
        m[j, j] = True
    for j in range(len(parents), width):
        m[j, j] = True
    return m


# --------------------------------------------------------------------------------------------
# Model calls
# --------------------------------------------------------------------------------------------
def _base(model: nn.Module) -> nn.Module:
    return base_model(model)  # PEFT-wrapped or plain


def _accepts(model: nn.Module, name: str) -> bool:
    try:
        return name in inspect.signature(_base(model).forward).parameters
    except (TypeError, ValueError):
        return False


def tree_mask_support(model: nn.Module) -> tuple[bool, int | None]:
    """(custom 4-D masks usable, max trie depth or None). Sliding-window layers ignore a custom mask's
    window, so trie depth must stay within ``sliding_window`` for exact results."""
    cfg = getattr(_base(model), "config", None)
    impl = getattr(cfg, "_attn_implementation", None) or "eager"
    ok = impl in ("sdpa", "eager") and _accepts(model, "position_ids")
    window = None
    types = getattr(cfg, "layer_types", None) or []
    if any("sliding" in t for t in types) or getattr(cfg, "use_sliding_window", False):
        window = getattr(cfg, "sliding_window", None)
    return ok, window


def _param_device(model: nn.Module) -> torch.device:
    try:
        return next(model.parameters()).device
    except StopIteration:
        return torch.device("cpu")


def _lp_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


@torch.no_grad()
def _score_batch(model: nn.Module, batch: list[Row], requests: Sequence[Request], out: list, *,
                 pad_id: int, logits_to_keep: bool, eager: bool, chunk: int = 512) -> None:
    """Run one batch and write ``(ll, is_greedy)`` into ``out[request index]``."""
    dev = _param_device(model)
    width = max(len(r) for r in batch)
    B = len(batch)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    for b, r in enumerate(batch):
        ids[b, : len(r)] = torch.tensor(r.tokens, dtype=torch.long)
    kwargs: dict = {"use_cache": False}
    if batch[0].tree:
        pos = torch.zeros(B, width, dtype=torch.long)
        mask = torch.empty(B, 1, width, width, dtype=torch.bool)
        for b, r in enumerate(batch):
            pos[b, : len(r)] = torch.tensor(r.positions, dtype=torch.long)
            mask[b, 0] = ancestor_mask(r.parents, width)
        if eager:  # eager attention adds the mask: 0 where seen, dtype-min elsewhere
            dt = next(model.parameters()).dtype
            mask = torch.zeros(mask.shape, dtype=dt).masked_fill_(~mask, torch.finfo(dt).min)
        kwargs.update(attention_mask=mask.to(dev), position_ids=pos.to(dev))
    # (b, node) of every scored position, its target token, and the request it belongs to.
    bs, nodes, targets, owner = [], [], [], []
    for b, r in enumerate(batch):
        for i, ns in r.scored:
            bs += [b] * len(ns)
            nodes += ns
            targets += list(requests[i].continuation)
            owner += [i] * len(ns)
    b_t, n_t = torch.tensor(bs), torch.tensor(nodes)
    if logits_to_keep:
        keep = torch.unique(n_t)  # sorted node columns needed by any row
        kwargs["logits_to_keep"] = keep.to(dev)
        col = torch.searchsorted(keep, n_t)
    else:
        col = n_t
    logits = model(input_ids=ids.to(dev), **kwargs).logits  # (B, K, V)
    tgt = torch.tensor(targets, device=dev)
    lls, greedy = [], []
    for s in range(0, len(bs), chunk):  # bounded memory for large vocabularies
        sel = logits[b_t[s:s + chunk].to(dev), col[s:s + chunk].to(dev)]  # (n, V)
        lp = torch.log_softmax(sel.to(_lp_dtype(sel.dtype)), dim=-1)
        t = tgt[s:s + chunk]
        lls.append(lp.gather(-1, t[:, None])[:, 0].double().cpu())
        greedy.append((lp.argmax(-1) == t).cpu())
    ll_all, g_all = torch.cat(lls), torch.cat(greedy)
    start = 0
    for b, r in enumerate(batch):
        for i, ns in r.scored:
            n = len(ns)
            out[i] = (float(ll_all[start:start + n].sum()), bool(g_all[start:start + n].all()))
            start += n


def score_requests(model: nn.Module, requests: Sequence[Request], *, batch_size: int = 32,
                   max_batch_tokens: int = 8192, max_row_tokens: int = 512, share_prefix: bool = True,
                   max_length: int | None = None, pad_id: int = 0, progress: bool = False,
                   desc: str = "loglikelihood") -> list[tuple[float, bool]]:
    """``[(ll, is_greedy)]`` for ``requests`` (same order), batched as described in the module doc.

    ``max_batch_tokens`` bounds ``rows × width`` per forward; for very large vocabularies the logits
    tensor is ``rows × kept positions × V`` floats, so lower it (e.g. 2048 for Gemma's 262k vocab).
    """
    if not requests:
        return []
    ok, window = tree_mask_support(model)
    rows = pack_rows(requests, share_prefix=share_prefix and ok, max_row_tokens=max_row_tokens,
                     max_length=max_length, max_tree_depth=window)
    batches = plan_batches(rows, batch_size, max_batch_tokens)
    impl = getattr(getattr(_base(model), "config", None), "_attn_implementation", None) or "eager"
    keep = _accepts(model, "logits_to_keep")
    out: list = [None] * len(requests)
    bar = None
    if progress:
        from tqdm.auto import tqdm

        bar = tqdm(total=len(requests), desc=desc, unit="req", dynamic_ncols=True)
    for batch in batches:
        _score_batch(model, batch, requests, out, pad_id=pad_id, logits_to_keep=keep, eager=impl == "eager")
        if bar is not None:
            bar.update(sum(len(r.scored) for r in batch))
    if bar is not None:
        bar.close()
    return out


@torch.no_grad()
def score_one_by_one(model: nn.Module, requests: Iterable[Request], max_length: int | None = None
                     ) -> list[tuple[float, bool]]:
    """Reference: one request per forward pass, full logits, no mask, no sharing."""
    dev = _param_device(model)
    out = []
    for r in requests:
        inp = torch.tensor([r.inputs(max_length)], device=dev)
        logits = model(input_ids=inp, use_cache=False).logits[0]  # (L, V)
        c = len(r.continuation)
        lp = torch.log_softmax(logits[-c:].to(_lp_dtype(logits.dtype)), dim=-1)  # (c, V)
        tgt = torch.tensor(r.continuation, device=dev)
        out.append((float(lp.gather(-1, tgt[:, None]).sum()), bool((lp.argmax(-1) == tgt).all())))
    return out


# --------------------------------------------------------------------------------------------
# Metrics (lm_eval.api.task.ConfigurableTask.process_results)
# --------------------------------------------------------------------------------------------
def choice_metrics(lls: Sequence[float], gold: int, norm_lens: Sequence[int]) -> dict[str, float]:
    """``acc``: argmax of summed log-likelihoods; ``acc_norm``: argmax of ``ll / len(choice chars)``.
    Ties go to the first choice (``np.argmax``)."""
    ll = np.asarray(lls, dtype=np.float64)
    with np.errstate(divide="ignore", invalid="ignore"):
        norm = ll / np.asarray(norm_lens, dtype=np.float64)
    return {"acc": float(int(np.argmax(ll)) == gold), "acc_norm": float(int(np.argmax(norm)) == gold)}


def perplexity(nll_sum: float, count: int) -> float:
    return math.exp(nll_sum / count) if count else float("nan")
