"""The runtime table: does the corrected model keep the pruned model's speed?

Variants, all from one original model with ``--ratio`` of its blocks removed by ``--criterion``
(adapters calibrated in closed form on a few windows; their values do not change the speed):

=====================  ========================================================================
original               the unpruned model
pruned                 blocks removed, nothing in their place
+LRA per block         one full-rank LRA per removed block, applied one after the other
                       (``--calibration.merge false``)
+rank-64 per block     one rank-64 LRA per removed block (W = UVᵀ), one after the other
merged (default)       the per-block LRAs of a span merged exactly into ONE full-rank affine map
                       (``(I+W₂)(I+W₁) − I``; what ``calibrate.py`` saves by default)
span rank-64           one rank-64 LRA fitted to the whole span (``--calibration.granularity span
                       --calibration.rank 64``)
=====================  ========================================================================

(An LRA cannot be folded exactly into the next block's projections: the block's RMSNorm sits
between them. "Merged" therefore means one map per span, still a separate GEMM.)

Measured in one run, variants interleaved: prefill tokens/s (one forward over ``batch × prompt``
tokens, last-token logits only) and greedy generation of ``--new_tokens`` tokens after a
``--prompt_len``-token prompt (KV cache, ``min_new_tokens = max_new_tokens``) at batch 1 and 8.
Also the parameter / FLOP-per-token accounting: what pruning removed and the adapters' share of it
(analytic, with ``torch.utils.flop_counter`` as a cross-check).

    python benchmarks/inference.py --model smollm2-135m
    python benchmarks/inference.py --model random:llama3-8b --dtype bfloat16 --device cuda
"""

from __future__ import annotations

import argparse
import copy
import time
from pathlib import Path

import bench_common as C
import lightning as L
import torch
from torch import nn

from shift_lightning.arch import decoder_layers
from shift_lightning.calibration import CalibrationConfig, CalibrationModule
from shift_lightning.criteria import PruneConfig
from shift_lightning.maps.lra import LinearResidualAdapter
from shift_lightning.models import num_params
from shift_lightning.selection import select_blocks
from shift_lightning.maps.surgery import attach_adapters, detach_adapters, remove_blocks


def make_trainer(dev):
    acc, devices = ("gpu", [dev.index or 0]) if dev.type == "cuda" else ("cpu", 1)
    return L.Trainer(accelerator=acc, devices=devices, logger=False, enable_checkpointing=False,
                     enable_progress_bar=False, enable_model_summary=False, inference_mode=False,
                     use_distributed_sampler=False)


def adapter_variants(model, tok, dev, removed, a) -> dict[str, dict[int, nn.Module]]:
    """Adapters (pruned position -> module) of every corrected variant."""
    win = C.windows(model, tok, a.calib_samples, a.calib_seq_len)
    trainer = make_trainer(dev)

    def fit(**kw):
        mod = CalibrationModule(model, removed, CalibrationConfig(solver="lra", heldout=False, **kw))
        mod.calibrate(trainer, win, batch_size=4)
        return mod

    full = fit(merge=False)
    out = {"+LRA per block": full.adapters_by_position()}
    out[f"+rank-{a.rank} per block"] = fit(merge=False, rank=a.rank).adapters_by_position()
    full.cfg.merge = True
    out["merged"] = full.adapters_by_position()
    out[f"span rank-{a.rank}"] = fit(granularity="span", rank=a.rank).adapters_by_position()
    return out


# ------------------------------------------------------------------------------------------------
def accounting(original, pruned, adapters: dict[str, dict[int, nn.Module]], removed, context: int) -> dict:
    """Parameters and FLOPs per token (analytic): linear layers 2·in·out, attention scores and
    values 4·t·H·h_d at context position t (mean over a causal context of ``context`` tokens:
    2·(context+1)·H·h_d), LM head 2·d·V; an LRA costs 2·d² (full) or 4·d·r (rank r) + 2d (bias, residual)."""
    cfg = original.config
    d = cfg.hidden_size
    H = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", None) or d // H

    def block_flops(block):
        lin = sum(2 * m.in_features * m.out_features for m in block.modules() if isinstance(m, nn.Linear))
        return lin + 2 * (context + 1) * H * hd

    blocks = decoder_layers(original)
    removed_params = sum(num_params(blocks[i]) for i in removed)
    removed_flops = sum(block_flops(blocks[i]) for i in removed)
    head = 2 * d * cfg.vocab_size
    total = sum(block_flops(b) for b in blocks) + head
    rows = {"original": {"params": num_params(original), "flops_per_token": total},
            "pruned": {"params": num_params(pruned), "flops_per_token": total - removed_flops}}

    def adapter_flops(mod):
        chain = list(mod) if isinstance(mod, nn.Sequential) else [mod]
        f = 0
        for ad in chain:
            assert isinstance(ad, LinearResidualAdapter)
            f += (4 * d * ad.spec.rank if ad.spec.low_rank else 2 * d * d) + 2 * d
        return f

    for name, ads in adapters.items():
        p = sum(num_params(m) for m in ads.values())
        f = sum(adapter_flops(m) for m in ads.values())
        rows[name] = {"params": num_params(pruned) + p, "flops_per_token": total - removed_flops + f,
                      "adapter_params": p, "adapter_flops_per_token": f,
                      "share_of_removed_params": p / removed_params, "share_of_removed_flops": f / removed_flops}
    return {"context": context, "removed_blocks": len(removed), "removed_params": removed_params,
            "removed_flops_per_token": removed_flops, "lm_head_flops_per_token": head, "variants": rows}


def measured_flops(model, dev, T: int) -> float:
    """FLOPs per token of one forward over ``(1, T)`` tokens counted by ``torch.utils.flop_counter``
    (matmuls / linears; attention kernels only where the counter knows them)."""
    from torch.utils.flop_counter import FlopCounterMode

    ids = torch.randint(0, model.config.vocab_size, (1, T), device=dev)
    with torch.no_grad(), FlopCounterMode(display=False) as fc:
        model(input_ids=ids, use_cache=False)
    return fc.get_total_flops() / T


# ------------------------------------------------------------------------------------------------
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    ap.add_argument("--device", default="auto")
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--criterion", default="reverse_star")
    ap.add_argument("--rank", type=int, default=64)
    ap.add_argument("--calib_samples", type=int, default=8)
    ap.add_argument("--calib_seq_len", type=int, default=256)
    ap.add_argument("--prompt_len", type=int, default=128)
    ap.add_argument("--new_tokens", type=int, default=128)
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--prefill_repeats", type=int, default=5)
    ap.add_argument("--gen_repeats", type=int, default=2)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    argv_used = argv if argv is not None else __import__("sys").argv[1:]
    dev = C.pick_device(a.device)
    batches = [int(b) for b in a.batches.split(",")]
    t0 = time.time()
    original, tok = C.build_model(a.model, dev, C.dtype_of(a.dtype))
    removed = select_blocks(PruneConfig(ratio=a.ratio, criterion=a.criterion), original).layers
    adapters = adapter_variants(original, tok, dev, removed, a)
    pruned = copy.deepcopy(original)
    remove_blocks(pruned, removed)

    def use(name):  # the model object of a variant (the pruned one with that variant's adapters)
        if name == "original":
            return original
        detach_adapters(pruned)
        if name != "pruned":
            attach_adapters(pruned, adapters[name])
        return pruned

    names = ["original", "pruned", *adapters]
    g = torch.Generator().manual_seed(0)
    prompts = {b: torch.randint(0, original.config.vocab_size, (b, a.prompt_len), generator=g).to(dev) for b in batches}
    if tok is not None:  # real text prompts for a real model
        win = C.windows(original, tok, max(batches), a.prompt_len, split="heldout")
        prompts = {b: win.input_ids[:b].to(dev) for b in batches}

    # merged == the chain it replaces (the same function up to rounding)
    x = prompts[batches[0]]
    with torch.no_grad():
        chain_logits = use("+LRA per block")(input_ids=x, use_cache=False).logits.float()
        merged_logits = use("merged")(input_ids=x, use_cache=False).logits.float()
    merge_diff = ((merged_logits - chain_logits).abs().max() / chain_logits.abs().max()).item()

    from transformers import GenerationConfig

    eos = getattr(original.config, "eos_token_id", None)
    gcfg = GenerationConfig(max_new_tokens=a.new_tokens, min_new_tokens=a.new_tokens, do_sample=False,
                            pad_token_id=getattr(original.config, "pad_token_id", None) or 0, eos_token_id=eos)

    def prefill(name, b):
        @torch.no_grad()
        def run():
            use(name)(input_ids=prompts[b], use_cache=False, logits_to_keep=1)
        return run

    def generate(name, b, cfg=gcfg):
        @torch.no_grad()
        def run():
            out = use(name).generate(input_ids=prompts[b], attention_mask=torch.ones_like(prompts[b]),
                                     generation_config=cfg)
            assert out.shape[1] == a.prompt_len + cfg.max_new_tokens
        return run

    short = GenerationConfig(**{**gcfg.to_diff_dict(), "max_new_tokens": 4, "min_new_tokens": 4})

    results: dict = {n: {} for n in names}
    for b in batches:
        t = C.round_robin({n: prefill(n, b) for n in names}, dev, a.prefill_repeats)
        for n in names:
            results[n][f"prefill_b{b}_tok_s"] = b * a.prompt_len / t[n]["median"]
        for n in names:  # warm-up: a short generation per variant (kernels, KV-cache allocations)
            generate(n, b, short)()
        t = C.round_robin({n: generate(n, b) for n in names}, dev, a.gen_repeats, warmup=False)
        for n in names:
            results[n][f"generate_b{b}_seconds"] = t[n]["median"]
            results[n][f"generate_b{b}_new_tok_s"] = b * a.new_tokens / t[n]["median"]
    acct = accounting(original, use("pruned"), adapters, removed, a.prompt_len + a.new_tokens)
    meas = {}
    for n in names:
        meas[n] = measured_flops(use(n), dev, a.prompt_len)
    detach_adapters(pruned)

    headers = ["model", "params", "LRA share of removed params", "GFLOP/token", "LRA share of removed FLOPs"]
    for b in batches:
        headers += [f"prefill tok/s (b={b})", f"generate new tok/s (b={b})"]
    headers += [f"generate b={batches[-1]} ÷ pruned"]
    rows = []
    ref = results["pruned"][f"generate_b{batches[-1]}_seconds"]
    for n in names:
        ac = acct["variants"][n]
        row = [n, f"{ac['params'] / 1e6:.1f}M", f"{100 * ac.get('share_of_removed_params', 0):.2f}%" if n in adapters else "",
               ac["flops_per_token"] / 1e9, f"{100 * ac['share_of_removed_flops']:.2f}%" if n in adapters else ""]
        for b in batches:
            row += [results[n][f"prefill_b{b}_tok_s"], results[n][f"generate_b{b}_new_tok_s"]]
        row += [results[n][f"generate_b{batches[-1]}_seconds"] / ref]
        rows.append(row)
    table = C.md_table(headers, rows)
    r_merged = {f"b{b}": results["merged"][f"generate_b{b}_seconds"] / results["pruned"][f"generate_b{b}_seconds"]
                for b in batches}
    r_prefill = {f"b{b}": results["pruned"][f"prefill_b{b}_tok_s"] / results["merged"][f"prefill_b{b}_tok_s"]
                 for b in batches}
    doc = {"benchmark": "inference", "model": a.model, "dtype": a.dtype, "removed": removed,
           "machine": C.machine(dev), "command": "python benchmarks/inference.py " + " ".join(argv_used),
           "prompt_len": a.prompt_len, "new_tokens": a.new_tokens, "batches": batches,
           "results": results, "accounting": acct, "measured_flops_per_token": meas,
           "merged_vs_pruned_generate_time_ratio": r_merged, "merged_vs_pruned_prefill_time_ratio": r_prefill,
           "merged_vs_chain_max_rel_logit_diff": merge_diff, "seconds": time.time() - t0, "table": table}
    out = Path(a.out or C.ROOT / "results" / "bench" / f"inference_{a.model.replace(':', '_')}_{dev.type}.json")
    C.write_json(out, doc)
    print(f"\n## inference ({a.model}, {dev.type}, {a.dtype}, removed {removed})\n\n{table}\n")
    print("merged ÷ pruned generation time: " + ", ".join(f"{k} {v:.3f}" for k, v in r_merged.items()))
    print("merged ÷ pruned prefill time: " + ", ".join(f"{k} {v:.3f}" for k, v in r_prefill.items()))
    print(f"merged vs per-block chain: max relative logit difference {merge_diff:.1e}")
    if meas:
        print("FLOPs/token counted by torch.utils.flop_counter (T = prompt_len): "
              + ", ".join(f"{n} {v / 1e9:.4g} G" for n, v in meas.items()))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
