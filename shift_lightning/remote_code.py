"""A saved folder's opt-in ``from_pretrained`` path (the Hub's remote-code convention) and its refusal.

A model with adapters (or ReplaceMe maps on a post-MLP norm) is not a stock HF model: loaded as one,
it would silently lose them. So :func:`mark_folder` rewrites such a folder's ``config.json``:

* ``model_type: shift_<family>`` (``shift_llama``, ``shift_gemma3_text``, …): a type transformers does
  not know, so ``AutoModelForCausalLM.from_pretrained(folder)`` without ``trust_remote_code`` refuses
  ("contains custom code which must be executed … pass trust_remote_code=True") instead of loading a
  different model;
* ``auto_map`` naming the classes of :mod:`shift_lightning.modeling_shift`, copied next to it as
  ``modeling_shift.py``: with ``trust_remote_code=True`` the stock family class is loaded and the
  adapters put back (identical logits).

A folder without adapters or maps (no correction, ReplaceMe folded into ``down_proj``, LoRA merged
into the weights only) stays a stock HF folder. :func:`plain_config` is how
:func:`shift_lightning.load_pretrained` reads a marked folder without running any of its code.
"""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

log = logging.getLogger(__name__)

MODEL_TYPE_PREFIX = "shift_"
MODELING_FILE = "modeling_shift.py"
_MARKED_KEYS = ("auto_map",)


def mark_folder(out: str | Path) -> str:
    """Mark the HF folder ``out`` (``config.json`` written) as needing its modeling code; returns its
    new ``model_type``. Families without a class in :mod:`~shift_lightning.modeling_shift` are marked
    too (plain loading still refuses them) but get no ``auto_map``."""
    from .modeling_shift import FAMILIES

    out = Path(out)
    doc = json.loads((out / "config.json").read_text())
    base = doc["model_type"]
    if base.startswith(MODEL_TYPE_PREFIX):
        return base
    doc["model_type"] = MODEL_TYPE_PREFIX + base
    if base in FAMILIES:
        cfg_cls, model_cls = FAMILIES[base]
        doc["architectures"] = [model_cls]
        doc["auto_map"] = {"AutoConfig": f"modeling_shift.{cfg_cls}",
                           "AutoModelForCausalLM": f"modeling_shift.{model_cls}"}
        shutil.copyfile(Path(__file__).with_name(MODELING_FILE), out / MODELING_FILE)
    else:
        log.warning("%s: no remote-code class for the %r family; the folder loads with "
                    "shift_lightning.load_pretrained only", out, base)
    (out / "config.json").write_text(json.dumps(doc, indent=2, sort_keys=True) + "\n")
    return doc["model_type"]


def is_marked(config_doc: dict) -> bool:
    return str(config_doc.get("model_type", "")).startswith(MODEL_TYPE_PREFIX)


def plain_config(config_doc: dict):
    """The stock family config of a marked ``config.json`` (its ``model_type`` without the prefix,
    the stock architecture, no ``auto_map``): what ``load_pretrained`` builds the model from."""
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    base = config_doc["model_type"][len(MODEL_TYPE_PREFIX):]
    doc = {k: v for k, v in config_doc.items() if k not in _MARKED_KEYS}
    doc["model_type"] = base
    if base in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        doc["architectures"] = [MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[base]]
    return CONFIG_MAPPING[base].from_dict(doc)


# --------------------------------------------------------------------------------------------
# What a folder may ask for: the one place every load from a user folder takes trust_remote_code
# --------------------------------------------------------------------------------------------
def trust_kwargs(user_flag: bool = False) -> dict:
    """``trust_remote_code`` for a load from a folder: ``True`` only when the user's own flag
    (``--model.trust_remote_code true``, ``ModelConfig(trust_remote_code=True)``) asked, never
    because of something the folder says (an ``auto_map`` in ``tokenizer_config.json`` or
    ``config.json``, a ``base_model`` record saying ``trust_remote_code: true``). Always explicit:
    left unset, transformers would prompt "run the custom code? [y/N]"."""
    return {"trust_remote_code": user_flag is True}


def base_model_settings(base: dict, user_flag: bool = False) -> dict:
    """A folder's ``base_model`` record as load settings, with ``trust_remote_code`` the user's own flag
    (the record's value is ignored: a folder may not turn remote code on)."""
    return {**base, **trust_kwargs(user_flag)}


def load_tokenizer(path, user_flag: bool = False, **kw):
    """``AutoTokenizer.from_pretrained(path)`` that never runs the folder's code unless ``user_flag``;
    a tokenizer that exists only as the folder's code is one error naming the flag."""
    from transformers import AutoTokenizer

    from .arch import ModelLoadError

    try:
        return AutoTokenizer.from_pretrained(path, **kw, **trust_kwargs(user_flag))
    except ValueError as e:
        try:
            asks = "auto_map" in json.loads((Path(path) / "tokenizer_config.json").read_text())
        except (OSError, ValueError, TypeError):
            asks = False
        if asks and not user_flag:
            raise ModelLoadError(f"{path}: its tokenizer_config.json names code of the folder (auto_map), which "
                                 "shift-lightning does not run unless you ask: inspect it, then pass "
                                 "--model.trust_remote_code true") from None
        raise ModelLoadError(f"Could not load the tokenizer of {path}: {' '.join(str(e).split())[:300]}") from None
