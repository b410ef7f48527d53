#!/usr/bin/env bash
# Megatron-LM's own gradient files (pretrain_gpt.py, tag core_v0.16.1, one GPU, no Transformer Engine/Apex, mock data)
# read as captures (docs/megatron-lm.md): the tiny GPT trained 2 iterations with --save-wgrads-interval 1 while
# `tensordiff capture --megatron` records the same run; then
#   diff capture files   -> exit 0 (every parameter gradient compared)
#   diff files files_eps -> exit 1 (another --norm-epsilon)
# --save-dgrads-interval is not used: without Transformer Engine, core_v0.16.1's dgrad_logging.py puts None into its
# tuple of linear layer types and `isinstance` raises TypeError in register_hooks.
#
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/megatron_lm/grads_gpu.sh OUT
set -uo pipefail
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (tag core_v0.16.1 for megatron-core 0.16.1)}"
OUT=${1:?usage: grads_gpu.sh OUT}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export CUDA_DEVICE_MAX_CONNECTIONS=1 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1
ARGS=(
  --transformer-impl local --no-gradient-accumulation-fusion --no-rope-fusion --no-persist-layer-norm
  --no-masked-softmax-fusion --no-bias-swiglu-fusion
  --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 16
  --max-position-embeddings 16 --hidden-dropout 0 --attention-dropout 0
  --tokenizer-type NullTokenizer --vocab-size 127 --make-vocab-size-divisible-by 128 --mock-data --split 1,0,0
  --micro-batch-size 2 --global-batch-size 2 --train-iters 2 --seed 1234
  --lr 1e-3 --lr-decay-style constant --min-lr 0 --lr-warmup-iters 0
  --save-interval 1000 --eval-iters 0 --eval-interval 1000 --log-interval 1
  --save-wgrads-interval 1
)
MASTER_PORT=29511 "$PY" -m tensordiff capture --megatron -o "$OUT/capture.h5" --steps 2 --tensors all -- \
  "$PY" "$MEGATRON_LM/pretrain_gpt.py" "${ARGS[@]}" --save "$OUT/files" > "$OUT/run.log" 2>&1
echo "capture run: exit $?"; grep -E "iteration +[0-9]+/|^tensordiff|Error" "$OUT/run.log" | tail -8
MASTER_PORT=29512 "$PY" "$MEGATRON_LM/pretrain_gpt.py" "${ARGS[@]}" --save "$OUT/files_eps" --norm-epsilon 1e-2 \
  > "$OUT/eps.log" 2>&1
echo "eps run: exit $?"
find "$OUT/files" "$OUT/files_eps" -name "*.pth" | sort
"$PY" -m tensordiff ls "$OUT/files" | head -12
"$PY" -m tensordiff diff "$OUT/capture.h5" "$OUT/files" --json "$OUT/capture_files.json" | tail -8
echo "diff capture files: exit ${PIPESTATUS[0]}"
"$PY" -m tensordiff diff "$OUT/files" "$OUT/files_eps" --first-divergence | tail -12
echo "diff files files_eps: exit ${PIPESTATUS[0]}"
