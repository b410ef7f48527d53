#!/usr/bin/env bash
# The GPU half of Megatron-LM's own pretrain_gpt.py against the MindFormers Trainer (docs/launchers.md): the tiny Llama
# of examples/launchers (2 layers, hidden 64, 4 heads in 2 query groups, SwiGLU 128, vocab 128, seq 16, RMSNorm 1e-6,
# RoPE 10000, untied output layer, no biases, FP32) trained by pretrain_gpt.py for 3 iterations from a release
# checkpoint (release_ckpt.py), on mock data, captured by tensordiff; then the same with one fault on this side.
#
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/megatron_lm/vs_mindformers_gpu.sh CKPT OUT [FAULT...]
#
# CKPT: the release checkpoint folder (python examples/megatron_lm/release_ckpt.py init.safetensors CKPT).
# FAULT: none (default), norm-eps (--norm-epsilon 1e-2), rope-base (--rotary-base 500000); each is one captured run,
# OUT/megatron.h5 for none, OUT/megatron-FAULT.h5 for the others, with its log beside it.
# Back on the CPU (examples/megatron_lm/vs_mindformers.py compare): tensordiff batch --from-capture OUT/megatron.h5 gives
# the MindFormers Trainer the very token ids pretrain_gpt.py trained on.
#
# MEGATRON_LM: a checkout of NVIDIA/Megatron-LM at the tag matching the installed megatron-core (core_v0.16.1 for
# 0.16.1). Needs a CUDA GPU (pretrain_gpt.py asserts one).
set -uo pipefail
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (tag core_v0.16.1 for megatron-core 0.16.1)}"
CKPT=${1:?usage: vs_mindformers_gpu.sh CKPT OUT [FAULT...]}
OUT=${2:?usage: vs_mindformers_gpu.sh CKPT OUT [FAULT...]}
shift 2
FAULTS=("$@")
[ ${#FAULTS[@]} -eq 0 ] && FAULTS=(none)
PY=${PYTHON:-python3}
mkdir -p "$OUT"
export CUDA_DEVICE_MAX_CONNECTIONS=1
# one process, no torchrun: the variables torchrun would set
export RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-29581}

ARGS=(
  # no Transformer Engine, no Apex (docs/megatron-lm.md); no fused kernels at all
  --transformer-impl local --no-gradient-accumulation-fusion --no-rope-fusion --no-persist-layer-norm
  --no-masked-softmax-fusion --no-bias-swiglu-fusion
  # the model of examples/launchers/llama_tiny.yaml
  --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4
  --group-query-attention --num-query-groups 2 --seq-length 16 --max-position-embeddings 16
  --normalization RMSNorm --norm-epsilon 1e-6 --swiglu --disable-bias-linear
  --position-embedding-type rope --rotary-base 10000 --untie-embeddings-and-output-weights
  --hidden-dropout 0 --attention-dropout 0
  # vocabulary: NullTokenizer adds one id (eod = 127) to --vocab-size 127, and 128 is already a multiple of
  # --make-vocab-size-divisible-by 128: the embedding and the output layer have exactly 128 rows
  --tokenizer-type NullTokenizer --vocab-size 127 --make-vocab-size-divisible-by 128
  --mock-data --split 1,0,0
  # training: FP32 (no --bf16), Adam as the Trainer's AdamW (no weight decay), constant lr, clipping at 1.0
  --micro-batch-size 2 --global-batch-size 2 --train-iters 3 --seed 1234
  --lr 1e-3 --lr-decay-style constant --min-lr 0 --lr-warmup-iters 0
  --weight-decay 0 --adam-beta1 0.9 --adam-beta2 0.999 --adam-eps 1e-8 --clip-grad 1.0
  --use-distributed-optimizer
  # the starting weights
  --load "$CKPT" --finetune --no-load-optim --no-load-rng --ckpt-format torch
  --eval-iters 0 --eval-interval 1000 --log-interval 1
)

fault_flags() {
  case $1 in
    none) ;;
    norm-eps) echo --norm-epsilon 1e-2 ;;   # later flags win in argparse
    rope-base) echo --rotary-base 500000 ;;
    *) echo "vs_mindformers_gpu.sh: unknown fault $1 (none, norm-eps, rope-base)" >&2; return 2 ;;
  esac
}

"$PY" - <<'EOF' | tee "$OUT/env.txt"
import os, torch
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {torch.cuda.get_device_name(0)}")
print(f"torch.backends.cuda.matmul.allow_tf32 = {torch.backends.cuda.matmul.allow_tf32}, "
      f"float32 matmul precision = {torch.get_float32_matmul_precision()}, "
      f"cudnn.allow_tf32 = {torch.backends.cudnn.allow_tf32}, "
      f"NVIDIA_TF32_OVERRIDE = {os.environ.get('NVIDIA_TF32_OVERRIDE')}")
EOF

status=0
for fault in "${FAULTS[@]}"; do
  flags=$(fault_flags "$fault") || exit 2
  name=megatron; [ "$fault" = none ] || name=megatron-$fault
  # shellcheck disable=SC2086  # the fault's flags are words
  "$PY" -m tensordiff capture --megatron -o "$OUT/$name.h5" --steps 2 --tensors all -- \
    "$PY" "$MEGATRON_LM/pretrain_gpt.py" "${ARGS[@]}" $flags > "$OUT/$name.log" 2>&1
  code=$?
  echo "== $name (fault: $fault, exit $code)"
  grep -E "padded vocab|loading release|checkpoint version|load_return|Missing key|Unexpected key|could not load|iteration +[0-9]+/|^tensordiff" \
    "$OUT/$name.log"
  if [ $code -ne 0 ] || grep -qE "load_return|could not load the checkpoint" "$OUT/$name.log"; then
    tail -40 "$OUT/$name.log"; status=1
  fi
done
exit $status
