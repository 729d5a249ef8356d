"""The prepared GPU benchmark script, run in its CPU/tiny mode: every step runs and writes its JSON.

(Performance is measured by the benchmarks, never asserted here; this checks that the script and
the three benchmarks it calls work end to end, and the invariants of their outputs.)
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.tiny_runs
def test_headline_and_gpu_scripts_tiny_cpu_mode(tmp_path):
    """``headline_gpu.sh --tiny``: the headline job (train.py with llama8b_lora.yaml on a tiny random
    shape: selection, calibration, LoRA + trained LRAs, validation and zero-shot at step 0 and at the
    end, export), the reload + generate check, then ``gpu.sh --tiny``."""
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    r = subprocess.run(["bash", str(ROOT / "benchmarks" / "headline_gpu.sh"), "--tiny"], env=env, capture_output=True,
                       text=True, timeout=1200, cwd=ROOT)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
    head = json.loads((tmp_path / "headline.json").read_text())
    assert head["steps"] == 4 and head["pruned_layers"] == [5, 6] and head["train_tokens_per_s"] > 0
    for tag in ("val/ppl", "val/kl", "zeroshot/avg", "train/loss"):
        assert tag in head["curves"], tag
    assert [s for s, _ in head["curves"]["val/ppl"]] == [0, 4] and [s for s, _ in head["curves"]["zeroshot/avg"]] == [0, 4]
    assert 0 <= head["curves"]["val/kl"][0][1] < 0.1  # the corrected model starts close to the original
    assert head["generate_tokens_per_s"] > 0 and list((tmp_path / "tb" / "headline").rglob("events.out.tfevents*"))

    cal = json.loads((tmp_path / "calibration.json").read_text())
    assert cal["removed"] == [5, 6]  # 25% of 8 blocks, reverse_star
    v = cal["timing"]["variants"]
    assert {"forward", "trunk", "independent/float64", "independent/tf32", "sequential/auto"} <= set(v)
    assert v["independent/float64"]["scheme"] == "float64" and v["sequential/auto"]["scheme"] == "float64"  # CPU
    acc = cal["accum"]["schemes"]
    assert acc["float64"]["W_rel_err_max"] == 0.0 and acc["tf32"]["emulated"] and not acc["float32"]["emulated"]
    assert 0 < acc["float32"]["W_rel_err_max"] < acc["bfloat16"]["W_rel_err_max"] < 0.1
    assert cal["ppl"]["max_rel_score_diff"] == 0.0  # replay == L+1 full passes
    assert cal["ppl"]["block_calls_replay"] == 8 + 28 and cal["ppl"]["block_calls_full"] == 72
    assert [s["windows"] for s in cal["memory"]["sizes"]] == [4, 16]

    inf = json.loads((tmp_path / "inference.json").read_text())
    names = {"original", "pruned", "+LRA per block", "+rank-8 per block", "merged", "span rank-8"}
    assert set(inf["results"]) == names
    acct = inf["accounting"]["variants"]
    d = 64
    assert acct["merged"]["adapter_params"] == d * d + d  # one full-rank map for the span of 2 blocks
    assert acct["+LRA per block"]["adapter_params"] == 2 * (d * d + d)
    assert acct["span rank-8"]["adapter_params"] == 2 * d * 8 + d
    assert acct["original"]["params"] - acct["pruned"]["params"] == inf["accounting"]["removed_params"]
    assert inf["merged_vs_chain_max_rel_logit_diff"] < 1e-4  # merging is exact up to rounding

    sol = json.loads((tmp_path / "solve.json").read_text())
    assert [r["d"] for r in sol["results"]] == [64, 128]
    assert all({"float64", "float32", "float64 rank 8"} <= set(r["seconds"]) for r in sol["results"])


def test_gram_benchmark_rows(tmp_path):
    """``benchmarks/gram.py``: one row per width and statistics, every block width timed and checked against
    the one GEMM."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gram

    gram.main(["--dims", "24,40", "--blocks", "8,16", "--repeats", "1", "--tokens", "64", "--out", str(tmp_path / "g")])
    doc = json.loads((tmp_path / "g.json").read_text())
    assert [(r["d"], r["p"], r["q"]) for r in doc["results"]] == [(24, 25, 49), (24, 49, 73), (40, 41, 81), (40, 81, 121)]
    for r in doc["results"]:
        assert set(r["ratio"]) == set(r["max_rel_err"]) == {"8", "16"}  # JSON keys
        assert max(r["max_rel_err"].values()) < 1e-12
    assert "| 40 | [x, m, 1] (joint) |" in (tmp_path / "g.md").read_text()
