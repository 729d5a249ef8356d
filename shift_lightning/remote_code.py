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
