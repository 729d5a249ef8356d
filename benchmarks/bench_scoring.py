"""Throughput of the batched log-likelihood scorer vs one request per forward pass.

Same model, same requests (the first ``--docs`` docs of each task, lm-eval prompts), in one run;
the two methods alternate ``--repeats`` times so machine load affects both alike; the best time of
each is kept. Also checks the two agree (max |Δ loglik|). Writes JSON to ``--out``.

    python benchmarks/bench_scoring.py --docs 16 --out results/bench_scoring_smollm2.json
"""

from __future__ import annotations

import argparse
import json
import platform
import time

import torch

from shift_lightning.evaluation import scoring as S
from shift_lightning.evaluation.tasks import DEFAULT_TASKS, load_docs
from shift_lightning.models import ModelConfig, load_model
from shift_lightning.outputs import prepare_file, write_json_atomic


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--tasks", default=",".join(DEFAULT_TASKS))
    ap.add_argument("--docs", type=int, default=16, help="docs per task (first N)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--batch_size", type=int, default=32)
    ap.add_argument("--max_batch_tokens", type=int, default=8192)
    ap.add_argument("--out", default="results/bench_scoring.json")
    a = ap.parse_args()
    prepare_file(a.out)  # writable, before any compute

    model, tok = load_model(ModelConfig(name_or_path=a.model))
    reqs = []
    for t in a.tasks.split(","):
        for d in load_docs(t, limit=a.docs).docs:
            reqs += [S.Request(*map(tuple, S.encode_pair(tok, c, x))) for c, x in zip(d.contexts, d.continuations)]
    n_tok = sum(len(r.inputs()) for r in reqs)
    methods = {
        "one_request_per_forward": lambda: S.score_one_by_one(model, reqs),
        "batched_no_sharing": lambda: S.score_requests(model, reqs, share_prefix=False, batch_size=a.batch_size,
                                                       max_batch_tokens=a.max_batch_tokens),
        "batched_shared_prefix": lambda: S.score_requests(model, reqs, batch_size=a.batch_size,
                                                          max_batch_tokens=a.max_batch_tokens),
    }
    times: dict[str, list[float]] = {k: [] for k in methods}
    outs = {}
    for _ in range(a.repeats):
        for k, f in methods.items():
            t0 = time.perf_counter()
            outs[k] = f()
            times[k].append(time.perf_counter() - t0)
    best = {k: min(v) for k, v in times.items()}
    ref = outs["one_request_per_forward"]
    rows = S.pack_rows(reqs)
    res = {
        "model": a.model, "tasks": a.tasks, "docs_per_task": a.docs, "requests": len(reqs),
        "input_tokens_unshared": n_tok, "trie_tokens_shared": sum(len(r) for r in rows),
        "repeats": a.repeats, "torch_threads": torch.get_num_threads(), "device": "cpu",
        "machine": platform.processor() or platform.machine(),
        "seconds_best": best, "seconds_all": times,
        "requests_per_s": {k: len(reqs) / v for k, v in best.items()},
        "speedup_vs_one_per_forward": {k: best["one_request_per_forward"] / v for k, v in best.items()},
        "max_abs_loglik_diff_vs_one_per_forward": {
            k: max(abs(x[0] - y[0]) for x, y in zip(o, ref)) for k, o in outs.items()},
        "greedy_flags_equal": {k: [x[1] for x in o] == [y[1] for y in ref] for k, o in outs.items()},
        "command": "python benchmarks/bench_scoring.py " + " ".join(
            f"--{k} {v}" for k, v in vars(a).items()),
    }
    write_json_atomic(a.out, res, indent=2)
    print(json.dumps({k: res[k] for k in ("requests", "input_tokens_unshared", "trie_tokens_shared",
                                          "requests_per_s", "speedup_vs_one_per_forward",
                                          "max_abs_loglik_diff_vs_one_per_forward")}, indent=2))


if __name__ == "__main__":
    main()
