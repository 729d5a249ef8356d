"""Which blocks each layer-selection criterion removes from SmolLM2-135M, and what it costs.

Every criterion of :mod:`shift_lightning.criteria` at ratio 0.25 (k = ⌊0.25·30⌋ = 7 of 30 blocks)
on the embedded SmolLM2-135M (fp32, CPU), scored on wiki-summaries ``calibration`` windows; the
pruned model (blocks deleted, no correction) is measured on wiki-summaries ``heldout`` windows:
perplexity = exp(mean next-token NLL over all predicted tokens of the packed windows).
The guarded variants ``taylor+``/``ppl+`` reuse the same scores with the reference code's "+"
heuristic (keep the first 4 and the last 2 blocks).

    python experiments/checks/criteria_table.py            # ~10-15 min on 2 CPU cores

Writes ``results/criteria_smollm2.json`` (selections with every block's score) and
``results/criteria_smollm2.md`` (the table).
"""

from __future__ import annotations

import argparse
import copy
import math
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from shift_lightning.criteria import CRITERIA, PruneConfig, Selection, candidates, lowest  # noqa: E402
from shift_lightning.data import TextDataConfig, build_windows  # noqa: E402
from shift_lightning.models import ModelConfig, decoder_layers, load_model  # noqa: E402
from shift_lightning.outputs import prepare_file, write_json_atomic, write_text_atomic  # noqa: E402
from shift_lightning.selection import select_blocks  # noqa: E402


def delete_blocks(model, layers: list[int]):
    """A deep copy of ``model`` without the given blocks (cache-free evaluation only)."""
    pruned = copy.deepcopy(model)
    blocks = decoder_layers(pruned)
    for i in sorted(layers, reverse=True):
        del blocks[i]
    pruned.config.num_hidden_layers = len(blocks)
    if getattr(pruned.config, "layer_types", None) is not None:
        pruned.config.layer_types = [t for i, t in enumerate(pruned.config.layer_types) if i not in set(layers)]
    return pruned


@torch.no_grad()
def perplexity(model, windows, batch_size: int = 4) -> tuple[float, int]:
    """exp(Σ NLL / N) over every predicted non-padding token of ``windows``."""
    nll_sum, n = 0.0, 0
    for s in range(0, len(windows), batch_size):
        ids = windows.input_ids[s: s + batch_size]
        mask = windows.attention_mask[s: s + batch_size]
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits[:, :-1].float()
        valid = mask[:, 1:].bool() & mask[:, :-1].bool()
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none").view(valid.shape)
        nll_sum += nll.double()[valid].sum().item()
        n += int(valid.sum())
    return math.exp(nll_sum / n), n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ratio", type=float, default=0.25)
    ap.add_argument("--calib-samples", type=int, default=16)
    ap.add_argument("--calib-seq-len", type=int, default=256)
    ap.add_argument("--heldout-samples", type=int, default=32)
    ap.add_argument("--heldout-seq-len", type=int, default=512)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0, help="seed of the random criterion")
    ap.add_argument("--criteria", default="all", help="comma-separated subset of the criteria")
    ap.add_argument("--out", default=str(ROOT / "results" / "criteria_smollm2"))
    args = ap.parse_args()
    for f in (Path(args.out).with_suffix(".json"), Path(args.out).with_suffix(".md")):
        prepare_file(f)  # writable, before any compute
    command = "python experiments/checks/criteria_table.py" + "".join(f" {a}" for a in sys.argv[1:])
    t_start = time.time()

    model, tok = load_model(ModelConfig(name_or_path="smollm2-135m", dtype="float32"))
    num_layers = len(decoder_layers(model))
    calib_cfg = TextDataConfig(source="wiki_summaries", split="calibration", num_samples=args.calib_samples,
                               seq_len=args.calib_seq_len, packing=True)
    held_cfg = TextDataConfig(source="wiki_summaries", split="heldout", num_samples=args.heldout_samples,
                              seq_len=args.heldout_seq_len, packing=True)
    calib = build_windows(calib_cfg, tok, model.config.model_type)
    held = build_windows(held_cfg, tok, model.config.model_type)

    ppl_cache: dict[tuple, float] = {}

    def heldout_ppl(layers: list[int]) -> float:
        key = tuple(sorted(layers))
        if key not in ppl_cache:
            t = time.time()
            m = delete_blocks(model, list(key)) if key else model
            ppl_cache[key] = perplexity(m, held, args.batch_size)[0]
            print(f"  held-out ppl without {list(key)}: {ppl_cache[key]:.2f} ({time.time() - t:.0f}s)", flush=True)
        return ppl_cache[key]

    base = heldout_ppl([])
    runs = [(c, {}) for c in CRITERIA if c != "angular"] + [("angular", {"angular_tokens": "last"}),
                                                          ("angular", {"angular_tokens": "all"})]
    if args.criteria != "all":
        wanted = set(args.criteria.split(","))
        runs = [r for r in runs if r[0] in wanted]
    rows, selections = [], {}
    for name, extra in runs:
        label = name + (f" ({extra['angular_tokens']} token{'s' if extra['angular_tokens'] == 'all' else ''})"
                        if extra else "")
        cfg = PruneConfig(criterion=name, ratio=args.ratio, seed=args.seed, batch_size=args.batch_size, **extra)
        print(f"{label} ...", flush=True)
        t = time.time()
        sel = select_blocks(cfg, model, calib)
        dt = time.time() - t
        rows.append({"criterion": label, "layers": sel.layers, "heldout_ppl": heldout_ppl(sel.layers),
                     "select_s": round(dt, 1)})
        selections[label] = sel.to_dict()
        print(f"  {label}: removes {sel.layers} in {dt:.0f}s", flush=True)
        if name in ("taylor", "ppl"):  # the "+" heuristic of the reference code, same scores
            plus = PruneConfig(criterion=name, ratio=args.ratio, keep_first=4, keep_last=2)
            k = len(sel.layers)
            layers = lowest(sel.scores, candidates(num_layers, plus), k)
            plus_label = f"{name}+ (keep_first=4, keep_last=2)"
            rows.append({"criterion": plus_label, "layers": layers, "heldout_ppl": heldout_ppl(layers),
                         "select_s": round(dt, 1)})
            selections[plus_label] = Selection(layers, name, sel.scores,
                                               {"keep_first": 4, "keep_last": 2, "k": k}).to_dict()

    total = time.time() - t_start
    setup = {
        "model": "SmolLM2-135M-Instruct (embedded GGUF Q4_1, de-quantised to fp32), 30 blocks",
        "ratio": args.ratio, "k": int(math.floor(args.ratio * num_layers)),
        "calibration": f"wiki-summaries calibration split, {args.calib_samples} packed windows x "
                       f"{args.calib_seq_len} tokens ({calib.num_tokens} tokens), batch {args.batch_size}",
        "heldout": f"wiki-summaries heldout split, {args.heldout_samples} packed windows x {args.heldout_seq_len} "
                   f"tokens ({held.num_tokens} tokens); ppl = exp(mean next-token NLL over all predicted tokens)",
        "pruning": "blocks deleted, no correction (no LRA, no fine-tuning)",
        "random_seed": args.seed, "machine": f"{platform.machine()}, {torch.get_num_threads()} threads, CPU",
        "torch": torch.__version__, "total_s": round(total, 1), "command": command,
    }
    out = Path(args.out)
    write_json_atomic(out.with_suffix(".json"),
                      {"setup": setup, "base_heldout_ppl": base, "rows": rows, "selections": selections})

    lines = [f"# Layer-selection criteria on SmolLM2-135M, ratio {args.ratio} (k = {setup['k']} of {num_layers} blocks)",
             "", f"Command: `{command}` ({total / 60:.1f} min, 2 CPU cores)", "",
             f"- Calibration: {setup['calibration']}.",
             f"- Held-out: {setup['heldout']}.",
             f"- Pruned = blocks deleted, no correction. Unpruned held-out perplexity: **{base:.2f}**.",
             "", "| criterion | removed blocks | held-out PPL | scoring time (s) |", "|---|---|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['criterion']} | {', '.join(map(str, r['layers']))} | {r['heldout_ppl']:.4g} | {r['select_s']} |")
    lines += ["", "Every block's score is in `criteria_smollm2.json` (`selections`). Times are wall-clock "
              "seconds of `select_blocks` (the `+` rows reuse the unguarded scores) on a machine that may be "
              "shared with other jobs."]
    write_text_atomic(out.with_suffix(".md"), "\n".join(lines) + "\n")
    print("\n".join(lines), flush=True)


if __name__ == "__main__":
    main()
