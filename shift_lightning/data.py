"""Token windows for calibration, criteria, perplexity and training (the text comes from
:mod:`shift_lightning.sources`: wiki-summaries, the mixed corpus, local files, the hub)."""

from __future__ import annotations

import json
import logging
import random
from pathlib import Path

import torch
from torch.utils.data import Dataset

from .config import TextDataConfig  # noqa: F401 (user-facing: beside build_windows)
from .sources import DataError, load_texts  # noqa: F401 (user-facing: beside build_windows)

log = logging.getLogger(__name__)


# --------------------------------------------------------------------------------------------
# Windows
# --------------------------------------------------------------------------------------------
def check_seq_len(model, seq_len: int, option: str = "--data.seq_len") -> None:
    """Refuse windows longer than the model's maximum positions: the model would run past what it
    was trained on (or fail) without a word."""
    from .arch import max_positions

    n = max_positions(model)
    if n is not None and seq_len > n:
        raise DataError(f"{option} {seq_len} exceeds the model's maximum positions ({n}, "
                        f"config.max_position_embeddings); set {option} {n} or lower")


def check_windows(model, windows: "TokenWindows", option: str = "--data", fitting: bool = True) -> None:
    """Before any pass: refuse windows longer than the model's maximum positions, and warn when
    ``fitting`` windows give a site fewer tokens than the ``d + 1`` unknowns of each output of its
    map (the fit is then underdetermined: only the damping makes it unique)."""
    longest = int(windows.attention_mask.sum(1).max()) if len(windows) else 0  # padding has no position
    check_seq_len(model, longest, f"{option}.seq_len")
    d = model.config.hidden_size
    if fitting and windows.num_tokens < d + 1:
        log.warning("Calibration gives each site %d tokens, fewer than the d + 1 = %d unknowns per output of its "
                    "map: the fit is underdetermined (only the damping makes it unique). Raise %s.num_samples / "
                    "%s.seq_len to at least %d tokens (ideally many times more).", windows.num_tokens, d + 1,
                    option, option, d + 1)


def wants_bos(tokenizer, model_type: str | None = None, add_bos: str | bool = "auto") -> bool:
    """Whether windows should start with BOS: the tokenizer adds it itself, or the model is Gemma."""
    if isinstance(add_bos, bool) or add_bos in ("true", "false"):
        return add_bos in (True, "true")
    if tokenizer.bos_token_id is None:
        return False
    if model_type and model_type.removeprefix("shift_").startswith("gemma"):  # shift_: a folder's remote-code type
        return True
    ids = tokenizer("a")["input_ids"]
    return len(ids) > 0 and ids[0] == tokenizer.bos_token_id


class TokenWindows(Dataset):
    """Fixed token windows: item = ``{"input_ids": (T,), "attention_mask": (T,)}`` (long), plus
    ``"loss_mask": (T,)`` when only some tokens are targets (Alpaca: the response)."""

    def __init__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, loss_mask: torch.Tensor | None = None):
        assert input_ids.shape == attention_mask.shape and input_ids.ndim == 2
        assert loss_mask is None or loss_mask.shape == input_ids.shape
        self.input_ids, self.attention_mask, self.loss_mask = input_ids, attention_mask, loss_mask

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, i):
        item = {"input_ids": self.input_ids[i], "attention_mask": self.attention_mask[i], "index": i}
        if self.loss_mask is not None:
            item["loss_mask"] = self.loss_mask[i]
        return item

    @property
    def num_tokens(self) -> int:
        return int(self.attention_mask.sum())

    def subset(self, indices: list[int]) -> "TokenWindows":
        """The windows at ``indices`` (in that order), re-indexed from 0."""
        lm = None if self.loss_mask is None else self.loss_mask[indices]
        return TokenWindows(self.input_ids[indices], self.attention_mask[indices], lm)


def make_windows(texts: list[str], tokenizer, cfg: TextDataConfig, model_type: str | None = None,
                 option: str = "--data") -> TokenWindows:
    """Cut documents into ``cfg.num_samples`` windows of ``cfg.seq_len`` tokens (see TextDataConfig);
    ``option`` names the set in errors (``--heldout``, ``--train_data``, ...)."""
    if cfg.seq_len < 2 or cfg.num_samples < 1:
        raise DataError(f"seq_len must be >= 2 and num_samples >= 1 (got {cfg.seq_len}, {cfg.num_samples})")
    bos = wants_bos(tokenizer, model_type, cfg.add_bos)
    body = cfg.seq_len - int(bos)
    order = list(range(len(texts)))
    random.Random(cfg.seed).shuffle(order)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    rows, masks = [], []
    if cfg.packing:
        sep = tokenizer.eos_token_id
        buf: list[int] = []
        for i in order:
            ids = tokenizer(texts[i], add_special_tokens=False)["input_ids"]
            buf.extend(ids + ([sep] if sep is not None else []))
            while len(buf) >= body and len(rows) < cfg.num_samples:
                rows.append(([tokenizer.bos_token_id] if bos else []) + buf[:body])
                buf = buf[body:]
            if len(rows) >= cfg.num_samples:
                break
        masks = [[1] * cfg.seq_len for _ in rows]
    else:
        for i in order[: cfg.num_samples]:
            ids = ([tokenizer.bos_token_id] if bos else []) + tokenizer(texts[i], add_special_tokens=False)["input_ids"]
            ids = ids[: cfg.seq_len]
            masks.append([1] * len(ids) + [0] * (cfg.seq_len - len(ids)))
            rows.append(ids + [pad_id] * (cfg.seq_len - len(ids)))
    if len(rows) < cfg.num_samples:
        raise DataError(
            f"Only {len(rows)} windows of {cfg.seq_len} tokens fit in the text (asked for {cfg.num_samples}); "
            f"lower {option}.num_samples / {option}.seq_len or give more text."
        )
    return TokenWindows(torch.tensor(rows, dtype=torch.long), torch.tensor(masks, dtype=torch.long))


def build_windows(cfg: TextDataConfig, tokenizer, model_type: str | None = None,
                  option: str = "--data") -> TokenWindows:
    """``load_texts`` + ``make_windows`` in one call (``alpaca``: ``load_records`` + ``make_alpaca_windows``);
    ``option`` names the set in errors."""
    if cfg.format == "alpaca":
        return make_alpaca_windows(load_records(cfg.source, cfg.split), tokenizer, cfg, model_type, option)
    return make_windows(load_texts(cfg.source, cfg.split, cfg.text_field), tokenizer, cfg, model_type, option)


# --------------------------------------------------------------------------------------------
# Instruction data (Alpaca format)
# --------------------------------------------------------------------------------------------
#: The Stanford Alpaca prompts (tatsu-lab/stanford_alpaca, train.py).
ALPACA_PROMPT = ("Below is an instruction that describes a task, paired with an input that provides further "
                 "context. Write a response that appropriately completes the request.\n\n"
                 "### Instruction:\n{instruction}\n\n### Input:\n{input}\n\n### Response:\n")
ALPACA_PROMPT_NO_INPUT = ("Below is an instruction that describes a task. Write a response that appropriately "
                          "completes the request.\n\n### Instruction:\n{instruction}\n\n### Response:\n")


def load_records(source: str, split: str = "calibration") -> list[dict]:
    """Instruction records ``{"instruction", "input", "output"}`` from a local .json/.jsonl file
    (the Alpaca release is one JSON list) or ``hf:<dataset>`` (e.g. ``hf:tatsu-lab/alpaca``)."""
    if source.startswith("hf:"):
        import datasets

        name, _, config = source[3:].partition(":")
        try:
            ds = datasets.load_dataset(name, config or None, split=split if split not in ("calibration",) else "train")
            records = [dict(r) for r in ds]
        except Exception as e:  # unreachable, unknown name, offline
            raise DataError(f"Could not load {source} ({type(e).__name__}: {' '.join(str(e).split())[:200]}); check the "
                            "dataset name and network access, or use a local .json/.jsonl file") from None
    else:
        p = Path(source).expanduser()
        if not p.is_file():
            raise DataError(f"Instruction data not found: {p} (an Alpaca-format .json or .jsonl file, or hf:<name>)")
        try:
            text = p.read_text(encoding="utf-8")
            records = [json.loads(l) for l in text.splitlines() if l.strip()] if p.suffix == ".jsonl" \
                else json.loads(text)
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise DataError(f"{p}: not a UTF-8 JSON/JSONL file of Alpaca records ({e})") from e
        except RecursionError:
            raise DataError(f"{p}: JSON nested too deeply to be Alpaca records") from None
    bad = next((i for i, r in enumerate(records) if not isinstance(r, dict) or not isinstance(r.get("instruction"), str)
                or not isinstance(r.get("output"), str)), None)
    if bad is not None:
        raise DataError(f"{source}: record {bad} is not an Alpaca record with string 'instruction' and 'output' fields")
    return records


def alpaca_prompt(record: dict) -> str:
    inp = (record.get("input") or "").strip()
    return (ALPACA_PROMPT if inp else ALPACA_PROMPT_NO_INPUT).format(instruction=record["instruction"], input=inp)


def make_alpaca_windows(records: list[dict], tokenizer, cfg: TextDataConfig, model_type: str | None = None,
                        option: str = "--data") -> TokenWindows:
    """One window per record: ``[BOS] prompt response EOS``, truncated to ``seq_len`` and right-padded;
    ``loss_mask`` marks the response and EOS tokens (the prompt is context, not target)."""
    if cfg.seq_len < 2 or cfg.num_samples < 1:
        raise DataError(f"seq_len must be >= 2 and num_samples >= 1 (got {cfg.seq_len}, {cfg.num_samples})")
    bos = wants_bos(tokenizer, model_type, cfg.add_bos)
    order = list(range(len(records)))
    random.Random(cfg.seed).shuffle(order)
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else (tokenizer.eos_token_id or 0)
    rows, masks, targets = [], [], []
    for i in order:
        prompt = ([tokenizer.bos_token_id] if bos else []) + tokenizer(alpaca_prompt(records[i]),
                                                                       add_special_tokens=False)["input_ids"]
        answer = tokenizer(records[i]["output"], add_special_tokens=False)["input_ids"]
        answer += [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        ids = (prompt + answer)[: cfg.seq_len]
        tgt = ([0] * len(prompt) + [1] * len(answer))[: cfg.seq_len]
        if sum(tgt) == 0:  # the prompt alone fills the window: nothing to learn from this record
            continue
        n = len(ids)
        rows.append(ids + [pad_id] * (cfg.seq_len - n))
        masks.append([1] * n + [0] * (cfg.seq_len - n))
        targets.append(tgt + [0] * (cfg.seq_len - n))
        if len(rows) == cfg.num_samples:
            break
    if len(rows) < cfg.num_samples:
        raise DataError(f"Only {len(rows)} Alpaca records have a response within {cfg.seq_len} tokens (asked for "
                        f"{cfg.num_samples}); lower {option}.num_samples or raise {option}.seq_len.")
    as_long = lambda x: torch.tensor(x, dtype=torch.long)  # noqa: E731
    return TokenWindows(as_long(rows), as_long(masks), as_long(targets))


class RankShard(torch.utils.data.Sampler):
    """Indices ``rank, rank + world, …``: every sample on exactly one rank, none repeated.

    (Lightning's ``validate``/``test`` samplers pad by repeating samples, which would count
    tokens twice in the calibration statistics.)
    """

    def __init__(self, n: int, rank: int, world: int):
        self.idx = list(range(rank, n, world))

    def __iter__(self):
        return iter(self.idx)

    def __len__(self):
        return len(self.idx)
