#!/usr/bin/env bash
# The performance benchmarks on ONE GPU with a Llama-3.1-8B-shaped model (random weights, bf16):
# calibration cost vs one forward pass, memory vs calibration-set size, accumulation schemes
# (speed + error), the ppl criterion, the runtime table, the ridge solve vs d, and the onloaded calibration
# (block by block from the safetensors files, device memory capped) beside the in-memory one.
# Sized to finish in about 8 minutes on an H100/H200-class GPU (estimated from FLOP counts, not
# yet measured); every step has its own time limit and writes its own JSON, so one slow step
# does not cost the others.
#
#   bash benchmarks/gpu.sh                  # CUDA; JSON + logs in results/bench/gpu/
#   bash benchmarks/gpu.sh --tiny           # the same steps on CPU with a tiny random shape, in
#                                           # seconds (what tests/test_benchmarks.py runs)
#   OUT=/some/dir PYTHON=/path/to/python bash benchmarks/gpu.sh
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MODE=${1:-gpu}

if [[ "$MODE" == "--tiny" ]]; then
  OUT=${OUT:-results/bench/gpu_tiny}
  COMMON=(--model random:tiny --dtype float32 --device cpu)
  CAL=(--samples 8 --seq_len 64 --batch_size 4 --repeats 1 --memory_sizes 4,16 --memory_seq_len 32 --memory_inprocess
       --ppl_samples 2 --ppl_seq_len 32 --accum float64,tf32,bfloat16 --sections timing,accum,ppl,memory)
  INF=(--prompt_len 16 --new_tokens 8 --batches 1,2 --rank 8 --calib_samples 4 --calib_seq_len 32
       --prefill_repeats 1 --gen_repeats 1)
  SOL=(--device cpu --dims 64,128 --rank 8 --repeats 1 --real_model "")
  ONL=(--shape tiny --in_process --device cpu --dtype float32 --num_samples 4 --seq_len 32 --heldout_samples 2)
  LIMITS=(300 300 300 300)   # seconds: calibration, inference, solve, onload
elif [[ "$MODE" == "gpu" ]]; then
  OUT=${OUT:-results/bench/gpu}
  COMMON=(--model random:llama3-8b --dtype bfloat16 --device cuda)
  # 16 x 2048 calibration tokens per timed pass; memory: 32 -> 1024 windows of 256 tokens
  CAL=(--samples 16 --seq_len 2048 --batch_size 4 --repeats 2 --memory_sizes 32,128,512,1024 --memory_seq_len 256
       --ppl_samples 4 --ppl_seq_len 512 --accum float64,tf32,bfloat16 --sections timing,accum,ppl,memory)
  INF=(--prompt_len 128 --new_tokens 128 --batches 1,8 --rank 64 --calib_samples 8 --calib_seq_len 256
       --prefill_repeats 5 --gen_repeats 2)
  SOL=(--device cuda --dims 576,1024,2048,4096,8192 --rank 64 --repeats 2 --real_model "")
  # the 8B shape written to disk (16 GB bf16), calibrated onloaded with the device memory capped at 8 GiB, then in
  # memory on the same card: the same maps, the time ratio, the peak device memory
  ONL=(--shape llama3-8b --in_process --device cuda --dtype bfloat16 --device_cap_gib 8 --num_samples 16 --seq_len 2048
       --heldout_samples 4)
  LIMITS=(200 150 60 170)    # seconds: calibration, inference, solve, onload (under 10 min in all)
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: use --tiny for the CPU smoke run')"
else
  echo "usage: bash benchmarks/gpu.sh [--tiny]" >&2
  exit 2
fi

mkdir -p "$OUT"
status=0
run() {  # run NAME LIMIT CMD...: one step, its own time limit and log; a failure is reported, not fatal
  local name=$1 limit=$2; shift 2
  echo "== $name (limit ${limit} s): $*"
  local t0=$SECONDS
  if timeout "$limit" "$@" > "$OUT/$name.log" 2>&1; then
    echo "   ok in $((SECONDS - t0)) s"
  else
    echo "   FAILED (exit $?) after $((SECONDS - t0)) s; tail of $OUT/$name.log:"; tail -n 20 "$OUT/$name.log"
    status=1
  fi
}
run calibration "${LIMITS[0]}" "$PY" benchmarks/calibration.py "${COMMON[@]}" "${CAL[@]}" --out "$OUT/calibration.json"
run inference   "${LIMITS[1]}" "$PY" benchmarks/inference.py "${COMMON[@]}" "${INF[@]}" --out "$OUT/inference.json"
run solve       "${LIMITS[2]}" "$PY" benchmarks/solve.py "${SOL[@]}" --out "$OUT/solve.json"
run onload      "${LIMITS[3]}" "$PY" benchmarks/onload.py "${ONL[@]}" --out "$OUT/onload.json"
echo "JSON in $OUT/"
exit $status
