"""What a recovery writes: the merged model, and for LoRA also PEFT's own format.

    <out>/          the merged model: LoRA merged into the weights, trained LRAs in place
                    (a normal shift-lightning folder: ``load_pretrained``, ``from_pretrained(...,
                    trust_remote_code=True)``, ``--model shift``)
    <out>/base/     the corrected base: pruned + repaired, before recovery (closed-form LRAs)
    <out>/lora/     the LoRA as a PEFT adapter folder (``adapter_config.json`` +
                    ``adapter_model.safetensors``); LRAs trained with it are its ``modules_to_save``

so ``PeftModel.from_pretrained(load_pretrained("<out>/base")[0], "<out>/lora")`` is the recovered
model (``merge_and_unload()`` gives ``<out>/``; the adapter can be swapped, disabled or stacked with
PEFT's API). The merged model is produced from the saved adapter itself, so every export also
checks the PEFT folder's round trip.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from torch import nn

from ..arch import base_model
from ..card import CardFacts, peft_card
from ..checkpoint import save_pretrained
from ..maps.surgery import adapter_set

BASE_DIR, LORA_DIR = "base", "lora"


def _frozen(model: nn.Module) -> nn.Module:
    for p in model.parameters():
        p.requires_grad_(False)
    return model.eval()


def export_peft(peft_model, tokenizer, out: Path, spec: dict, card: CardFacts | None = None,
                base_ref: str | None = None) -> nn.Module:
    """Write ``out/lora`` (the adapter) and ``out/base`` (the corrected base); return the merged model,
    built by loading ``out/lora`` onto the base (``peft_model`` is consumed: its base becomes the
    merged model). ``base_ref``: what ``adapter_config.json`` names as the base (default ``out/base``)."""
    from peft import PeftModel
    from peft.utils import ModulesToSaveWrapper

    card = card or CardFacts()
    lora, base_dir = out / LORA_DIR, out / BASE_DIR
    sites = adapter_set(base_model(peft_model))
    originals = {k: w.original_module for k, w in (sites.sites.items() if sites is not None else [])
                 if isinstance(w, ModulesToSaveWrapper)}  # the closed-form LRAs, before their training
    peft_cfg = peft_model.peft_config[peft_model.active_adapter]
    peft_cfg.base_model_name_or_path = base_ref or str(base_dir)
    peft_model.save_pretrained(str(lora), save_embedding_layers=False)  # the vocabulary is never resized
    base = peft_model.unload()  # LoRA layers out, not merged; wrapped LRAs replaced by their trained copies
    for k, module in originals.items():
        adapter_set(base).sites[k] = module
    _frozen(base)
    save_pretrained(base, tokenizer, base_dir, {**spec, "recovered": False, "recovery_steps": 0},
                    replace(card, recovery=None,
                            role=f"the corrected base of the PEFT adapter in `{LORA_DIR}/` (before recovery)"))
    (lora / "README.md").write_text(peft_card(peft_cfg.to_dict(), base_ref or str(base_dir), spec, card))
    return PeftModel.from_pretrained(base, str(lora)).merge_and_unload()


def export_recovered(model: nn.Module, tokenizer, out_dir: str | Path, spec: dict, card: CardFacts | None = None,
                     peft: bool = True, base_ref: str | None = None) -> nn.Module:
    """Write the recovered model into ``out_dir`` (see the module doc; ``peft=False`` or a model that
    is not a PEFT model: the merged model only). Returns the merged plain model."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if hasattr(model, "merge_and_unload"):
        model = export_peft(model, tokenizer, out, spec, card, base_ref) if peft else model.merge_and_unload()
    _frozen(model)
    save_pretrained(model, tokenizer, out, spec, card)
    return model
