"""Training checks that need no weights, run before any compute (and before the calibration a
training job may run first): the instruction data's format, and that every LoRA target module
exists in the model's architecture (built on the meta device from its config: no weights, no memory).
"""

from __future__ import annotations

import json
from pathlib import Path

from .errors import ConfigError


def _config_of(model_cfg):
    """The HF config of the model to be trained, when it can be had without loading weights."""
    from .models import tiny_config

    if model_cfg.tiny is not None:
        tiny = dict(model_cfg.tiny)
        return tiny_config(tiny.pop("family", "llama"), **tiny)
    p = Path(model_cfg.name_or_path).expanduser()
    if not (p / "config.json").is_file():
        return None  # hub ids, GGUF files, embedded models: checked when loaded
    from transformers import AutoConfig

    from .remote_code import is_marked, plain_config

    try:
        doc = json.loads((p / "config.json").read_text())
        return plain_config(doc) if is_marked(doc) else AutoConfig.from_pretrained(p, trust_remote_code=False)
    except Exception:
        return None  # the load names what is wrong with the folder


def module_names(model_cfg) -> set[str] | None:
    """Qualified names of the model's modules (meta device), or None when unknown before loading."""
    import torch
    from transformers import AutoModelForCausalLM

    cfg = _config_of(model_cfg)
    if cfg is None:
        return None
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg)
    except Exception:
        return None
    return {n for n, _ in model.named_modules()}


def check_lora_targets(model_cfg, recovery) -> None:
    if recovery.method != "lora" or model_cfg is None:
        return
    names = module_names(model_cfg)
    if names is None:
        return
    missing = [t for t in recovery.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        linear = sorted({n.rsplit(".", 1)[-1] for n in names if ".layers." in n and n.rsplit(".", 1)[-1].endswith("proj")})
        raise ConfigError(f"--recovery.target_modules {missing} name no module of the model (its projections: "
                          f"{', '.join(linear)}); LoRA would leave them out")


def check_train_data(train_data) -> None:
    """Alpaca records are read and checked now (local files; a few MB at most)."""
    if train_data.format == "alpaca" and not str(train_data.source).startswith("hf:"):
        from .data import load_records

        load_records(train_data.source, train_data.split)


def check_training(model_cfg, train_data, recovery) -> None:
    """Every training check that needs no weights (see the module docstring)."""
    check_train_data(train_data)
    check_lora_targets(model_cfg, recovery)
