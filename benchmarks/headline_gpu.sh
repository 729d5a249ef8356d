#!/usr/bin/env bash
# The headline job on ONE GPU at 8B scale, then the GPU benchmarks. A random-weight model of
# Llama-3.1-8B's exact shape (the hub is unreachable) goes through `train.py --config llama8b_lora.yaml`
# with the sizes cut to a few minutes: 25 % Reverse-order* selection, calibration on 16 x 2048 tokens
# with the config's accumulation default, 20 LoRA steps at bf16-mixed with the LRAs trained, validation
# (val/ppl, val/kl) and the zero-shot callback at step 0 and at the end on a few docs per task, export,
# load_pretrained and generate(); then benchmarks/gpu.sh. Each step fails loudly (its log's tail).
#
#   bash benchmarks/headline_gpu.sh           # CUDA: JSON + TensorBoard events in results/bench/gpu/
#   bash benchmarks/headline_gpu.sh --tiny    # the same steps on CPU, tiny shape, in a minute
#                                             # (what tests/test_benchmarks.py runs)
#   OUT=/some/dir PYTHON=/path/to/python DATA=<text source> bash benchmarks/headline_gpu.sh
#   BENCH=0 bash benchmarks/headline_gpu.sh   # the headline job and its check only
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python}
MODE=${1:-gpu}
if [[ "$MODE" == "--tiny" ]]; then
  OUT=${OUT:-results/bench/gpu_tiny}
  SHAPE='{"family": "llama", "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 8, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 512, "max_position_embeddings": 1024}'
  DATA=${DATA:-tests/data/tiny_corpus.txt}; HELD=${HELD:-tests/data/tiny_heldout.txt}
  SIZES=(--model.dtype float32 --data.seq_len 64 --heldout.seq_len 64 --train_data.seq_len 64 --val.seq_len 64
         --trainer.accelerator cpu --trainer.precision 32-true --trainer.max_steps 4 --trainer.val_check_interval 4)
  GPU_ARGS=(--tiny)
elif [[ "$MODE" == "gpu" ]]; then
  OUT=${OUT:-results/bench/gpu}
  # Llama-3.1-8B: 32 blocks, d = 4096, FFN 14336, GQA 32 / 8 heads (head_dim 128), vocab 128256, untied
  SHAPE='{"family": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "init_device": "cuda"}'
  DATA=${DATA:-wiki_summaries}; HELD=${HELD:-wiki_summaries}
  SIZES=(--model.dtype bfloat16 --data.seq_len 2048 --heldout.seq_len 2048 --train_data.seq_len 2048 --val.seq_len 2048
         --trainer.accelerator gpu --trainer.precision bf16-mixed --trainer.max_steps 20 --trainer.val_check_interval 20)
  GPU_ARGS=()
  "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'no CUDA device: use --tiny for the CPU run')"
else
  echo "usage: bash benchmarks/headline_gpu.sh [--tiny]" >&2
  exit 2
fi
mkdir -p "$OUT"
CMD=("$PY" train.py --config configs/llama8b_lora.yaml
     --model.name_or_path random-llama3.1-8b-shape --model.tiny "$SHAPE"
     --data.source "$DATA" --data.split calibration --data.num_samples 16 --data.batch_size 2
     --heldout.source "$HELD" --heldout.split heldout --heldout.num_samples 2 --heldout.batch_size 2
     --train_data.source "$DATA" --train_data.split calibration --train_data.num_samples 64 --train_data.batch_size 1
     --val.source "$HELD" --val.split heldout --val.num_samples 4 --val.batch_size 1
     --zeroshot.limit 4 --zeroshot.data_dir tests/data/eval_tiny --zeroshot.batch_size 8
     --recovery.warmup_steps 2 "${SIZES[@]}"
     --trainer.devices 1 --trainer.strategy auto --trainer.accumulate_grad_batches 1 --trainer.log_every_n_steps 1
     --trainer.logger.save_dir "$OUT/tb" --trainer.logger.name headline
     --output_dir "$OUT/headline_model" --overwrite)
step() {  # step NAME CMD...: run, log, and on failure print the log's tail and stop
  local name=$1; shift
  echo "== $name: $*"
  local t0=$SECONDS
  if "$@" > "$OUT/$name.log" 2>&1; then
    echo "   ok in $((SECONDS - t0)) s"
  else
    local rc=$?
    echo "   FAILED (exit $rc) after $((SECONDS - t0)) s; tail of $OUT/$name.log:"; tail -n 30 "$OUT/$name.log"
    exit $rc
  fi
}
T0=$SECONDS
step headline_train "${CMD[@]}"
TRAIN_S=$((SECONDS - T0))
step headline_check "$PY" benchmarks/headline_check.py --model_dir "$OUT/headline_model" --tb "$OUT/tb/headline" \
    --train_seconds "$TRAIN_S" --command "${CMD[*]}" --out "$OUT/headline.json"
if [[ "${BENCH:-1}" == 1 ]]; then  # BENCH=0: the headline job alone (e.g. while the GPU is shared, when timings mean little)
  step benchmarks env OUT="$OUT" PYTHON="$PY" bash benchmarks/gpu.sh "${GPU_ARGS[@]}"
fi
echo "JSON and TensorBoard events in $OUT/"
