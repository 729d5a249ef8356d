"""Adapters (exact merging) and surgery (consistent pruning, generate, save → load)."""

import copy

import pytest
import torch
from torch import nn
from torch.testing import assert_close

from shift_lightning import load_pretrained
from shift_lightning.maps.lra import AdapterSpec, LinearResidualAdapter, merge_adapters
from shift_lightning.models import ModelLoadError, build_tiny_model, decoder_layers, load_model, ModelConfig
from shift_lightning.maps import contiguous_spans, pruned_positions
from shift_lightning.checkpoint import save_pretrained
from shift_lightning.maps.surgery import SurgeryError, attach_adapters, detach_adapters, remove_blocks

D = 16


def _rand_adapter(kind="residual", rank=None, seed=0, d=D):
    g = torch.Generator().manual_seed(seed)
    a = LinearResidualAdapter(AdapterSpec(d, kind, rank), dtype=torch.float64)
    for p in a.parameters():  # non-trivial init: identity must not hide a bug
        with torch.no_grad():
            p.copy_(0.3 * torch.randn(p.shape, generator=g, dtype=torch.float64))
    return a


def test_forward_formulas():
    x = torch.randn(5, D, dtype=torch.float64)
    a = _rand_adapter()
    assert_close(a(x), x + x @ a.linear.weight.T + a.linear.bias)
    lr = _rand_adapter(rank=3, seed=1)
    U, V = lr.up.weight, lr.down.weight.T
    assert_close(lr(x), x + x @ (U @ V.T).T + lr.up.bias)
    aff = _rand_adapter("affine", seed=2)
    assert_close(aff(x), x @ aff.linear.weight.T + aff.linear.bias)
    assert sum(p.numel() for p in lr.parameters()) == 2 * D * 3 + D
    assert sum(p.numel() for p in a.parameters()) == D * D + D


def test_fresh_adapter_is_identity_and_keeps_dtype():
    x = torch.randn(2, 3, D, dtype=torch.bfloat16)
    for spec in (AdapterSpec(D), AdapterSpec(D, rank=4), AdapterSpec(D, "affine")):
        a = LinearResidualAdapter(spec)
        y = a(x)
        assert y.dtype == torch.bfloat16
        assert_close(y, x)


@pytest.mark.parametrize("k1,r1,k2,r2", [
    ("residual", None, "residual", None),
    ("residual", 3, "residual", 2),
    ("residual", 3, "residual", None),
    ("residual", None, "affine", None),
    ("affine", None, "affine", None),
])
def test_merge_is_exact(k1, r1, k2, r2):
    a1, a2 = _rand_adapter(k1, r1, seed=1), _rand_adapter(k2, r2, seed=2)
    m = merge_adapters(a1, a2)
    x = torch.randn(7, D, dtype=torch.float64)
    assert_close(m(x), a2(a1(x)), rtol=1e-12, atol=1e-12)
    if k1 == k2 == "residual" and r1 and r2:
        assert m.spec.rank == r1 + r2  # stays factorised


def test_merge_formula_closed_form():
    a1, a2 = _rand_adapter(seed=3), _rand_adapter(seed=4)
    m = merge_adapters(a1, a2)
    I = torch.eye(D, dtype=torch.float64)
    W1, b1, W2, b2 = a1.linear.weight, a1.linear.bias, a2.linear.weight, a2.linear.bias
    assert_close(m.linear.weight, (I + W2) @ (I + W1) - I)
    assert_close(m.linear.bias, (I + W2) @ b1 + b2)


def test_spans_and_positions():
    assert contiguous_spans([7, 2, 3, 5, 6]) == [(2, 4), (5, 8)]
    assert pruned_positions(8, [2, 3, 5, 6]) == {2: 2, 3: 2, 5: 3, 6: 3}
    assert pruned_positions(4, [3]) == {3: 3}  # last block: before the final norm


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3"]


@pytest.mark.parametrize("family", FAMILIES)
def test_prune_generate_roundtrip(family, tmp_path):
    model, tok = build_tiny_model(family, num_hidden_layers=6)
    types = list(getattr(model.config, "layer_types", None) or [])
    keep = remove_blocks(model, [1, 2, 5])
    assert keep == [0, 3, 4]
    assert model.config.num_hidden_layers == 3 == len(decoder_layers(model))
    if types:
        assert model.config.layer_types == [types[i] for i in keep]
    for new, blk in enumerate(decoder_layers(model)):
        assert blk.self_attn.layer_idx == new
    # adapters at a middle position and at the end (before the final norm), non-trivial
    attach_adapters(model, {1: _rand_adapter(seed=5, d=32).float(), 3: _rand_adapter(rank=4, seed=6, d=32).float()})
    ids = tok(["The cat sat on the mat", "Hi"], return_tensors="pt", padding=True)
    out_cache = model.generate(**ids, max_new_tokens=6, do_sample=False, use_cache=True)
    out_nocache = model.generate(**ids, max_new_tokens=6, do_sample=False, use_cache=False)
    assert torch.equal(out_cache, out_nocache)
    logits = model(**ids).logits
    save_pretrained(model, tok, tmp_path, {"original_num_layers": 6, "pruned_layers": [1, 2, 5]})
    m2, t2 = load_pretrained(tmp_path)
    assert torch.equal(m2(**ids).logits, logits)
    assert torch.equal(m2.generate(**ids, max_new_tokens=6, do_sample=False), out_cache)
    assert t2("Hi").input_ids == tok("Hi").input_ids
    m3, _ = load_pretrained(ModelConfig(name_or_path=str(tmp_path)))  # the generic loader knows the format
    assert torch.equal(m3(**ids).logits, logits)


def test_adapters_apply_where_the_blocks_were():
    """Pruned model with adapters == original model with the removed blocks replaced by the adapters."""
    model, tok = build_tiny_model("llama", num_hidden_layers=6, dtype=torch.float64)
    ids = tok("A quick test of surgery", return_tensors="pt").input_ids
    a_mid, a_end = _rand_adapter(seed=7, d=32), _rand_adapter(rank=2, seed=8, d=32)
    ref_model = copy.deepcopy(model)

    class Replace(nn.Module):
        def __init__(self, fn):
            super().__init__()
            self.fn = fn

        def forward(self, h, *a, **k):
            return self.fn(h)

    blocks = ref_model.model.layers
    blocks[1], blocks[2] = Replace(a_mid), Replace(lambda h: h)
    blocks[5] = Replace(a_end)
    ref = ref_model(ids, use_cache=False).logits
    remove_blocks(model, [1, 2, 5])
    attach_adapters(model, {1: a_mid, 3: a_end})
    assert_close(model(ids).logits, ref, rtol=1e-12, atol=1e-12)


def test_deepcopy_and_detach():
    model, tok = build_tiny_model("llama")
    ids = tok("copy me", return_tensors="pt").input_ids
    remove_blocks(model, [2])
    attach_adapters(model, {2: _rand_adapter(seed=9, d=32).float()})
    ref = model(ids).logits
    clone = copy.deepcopy(model)
    with torch.no_grad():  # changing the clone's adapter must not touch the original
        clone.model.shift_adapters.sites["2"].linear.weight.zero_()
    assert torch.equal(model(ids).logits, ref)
    assert not torch.equal(clone(ids).logits, ref)
    assert detach_adapters(model) is not None
    assert not torch.equal(model(ids).logits, ref)
    assert not hasattr(model.model, "shift_adapters")


def test_surgery_errors():
    model, _ = build_tiny_model("llama", num_hidden_layers=4)
    with pytest.raises(SurgeryError, match="invalid layer indices"):
        remove_blocks(model, [4])
    with pytest.raises(SurgeryError, match="all 4 blocks"):
        remove_blocks(model, [0, 1, 2, 3])
    attach_adapters(model, {1: _rand_adapter(d=32).float()})
    with pytest.raises(SurgeryError, match="before attaching"):
        remove_blocks(model, [0])


def test_unsupported_architecture_is_named():
    from transformers import GPT2Config, GPT2LMHeadModel

    m = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, vocab_size=50))
    with pytest.raises(ModelLoadError, match=r"Unsupported model architecture 'gpt2'.*llama, mistral, qwen2"):
        decoder_layers(m)
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(ModelConfig(name_or_path="./does/not/exist"))


def test_peft_lora_trains_the_adapters_through_modules_to_save():
    """The core is shaped for recovery: PEFT wraps the corrected model, the LRA copy PEFT trains is
    the one the forward pass uses, and LoRA stays off the LRA's own linear layers."""
    from peft import LoraConfig, get_peft_model

    from shift_lightning.maps.surgery import adapter_module_names

    model, tok = build_tiny_model("llama")
    remove_blocks(model, [2, 3])
    attach_adapters(model, {2: _rand_adapter(seed=11, d=32).float()})
    ids = tok("recover me", return_tensors="pt").input_ids
    ref = model(ids).logits
    names = adapter_module_names(model)
    assert names == ["shift_adapters.sites.2"]
    pm = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=names))
    assert_close(pm(ids).logits, ref)  # LoRA B = 0 at init: same function
    trainable = [n for n, p in pm.named_parameters() if p.requires_grad]
    assert any("shift_adapters.sites.2.modules_to_save" in n for n in trainable)
    assert not any("shift_adapters" in n and "lora_" in n for n in trainable)
    pm(ids, labels=ids).loss.backward()
    site = pm.base_model.model.model.shift_adapters.sites["2"]
    assert site.modules_to_save["default"].linear.weight.grad.abs().sum() > 0
    assert site.original_module.linear.weight.grad is None


def test_a_folder_written_with_the_old_key_loads_as_before(tmp_path):
    """``shift_config.json`` names the maps' solver ``solver``; a folder written before, with ``correction``,
    loads unchanged (the same logits and record) and is not rewritten."""
    import json

    from shift_lightning.maps.record import SHIFT_CONFIG, ShiftSpec

    model, tok = build_tiny_model("llama", num_hidden_layers=6)
    remove_blocks(model, [2, 3])
    attach_adapters(model, {2: _rand_adapter(seed=7, d=32).float()})
    save_pretrained(model, tok, tmp_path, {"original_num_layers": 6, "pruned_layers": [2, 3], "solver": "lra"})
    doc = json.loads((tmp_path / SHIFT_CONFIG).read_text())
    assert doc["solver"] == "lra" and "correction" not in doc
    ids = tok(["The cat sat on the mat"], return_tensors="pt").input_ids
    ref = load_pretrained(tmp_path)[0](ids).logits
    old = {("correction" if k == "solver" else k): v for k, v in doc.items()}  # as folders were written before
    (tmp_path / SHIFT_CONFIG).write_text(json.dumps(old))
    assert torch.equal(load_pretrained(tmp_path)[0](ids).logits, ref)
    assert json.loads((tmp_path / SHIFT_CONFIG).read_text()) == old  # read, never rewritten
    spec = ShiftSpec.from_dict(old)
    assert spec.solver == "lra" and "correction" not in spec.extra and spec.to_dict()["solver"] == "lra"
    assert ShiftSpec.from_dict({**old, "solver": "stock"}).solver == "stock"  # both keys: the new one wins
