#!/usr/bin/env bash
# From the curve to the cause with Megatron-LM's own pretrain_gpt.py (docs/locate.md): two BF16 runs that differ
# only in --adam-beta2 (0.999 vs 0.95), torch_dist checkpoints every 5 iterations, 40 iterations on mock data with a
# cosine schedule (4 layers x 512, seq 512). Then what a user runs: tensordiff runs, tensordiff config on the two
# logs, tensordiff locate --mode shared --run and --mode own --run. Each report is written as JSON beside the logs.
#
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/megatron_lm/beta2_gpu.sh OUT
#
# MEGATRON_LM: a checkout of NVIDIA/Megatron-LM at the tag matching the installed megatron-core (core_v0.16.1 for
# 0.16.1). Needs a CUDA GPU. No Transformer Engine, no Apex: --transformer-impl local, no fused kernels.
set -uo pipefail
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (tag core_v0.16.1 for megatron-core 0.16.1)}"
OUT=${1:?usage: beta2_gpu.sh OUT}
PY=${PYTHON:-python3}
TD=("$PY" -m tensordiff)
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
export CUDA_DEVICE_MAX_CONNECTIONS=1
export RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=${MASTER_PORT:-29583}

ARGS="--transformer-impl local --no-gradient-accumulation-fusion --no-rope-fusion --no-persist-layer-norm \
--no-masked-softmax-fusion --no-bias-swiglu-fusion \
--num-layers 4 --hidden-size 512 --ffn-hidden-size 1408 --num-attention-heads 8 --seq-length 512 \
--max-position-embeddings 512 --normalization RMSNorm --swiglu --disable-bias-linear --position-embedding-type rope \
--untie-embeddings-and-output-weights --hidden-dropout 0 --attention-dropout 0 \
--tokenizer-type NullTokenizer --vocab-size 8191 --make-vocab-size-divisible-by 128 --mock-data --split 1,0,0 \
--micro-batch-size 4 --global-batch-size 4 --train-iters 40 --seed 1234 --bf16 \
--lr 3e-4 --lr-decay-style cosine --min-lr 3e-5 --lr-warmup-iters 5 --weight-decay 0.1 --clip-grad 1.0 \
--adam-beta1 0.9 --adam-eps 1e-8 --ckpt-format torch_dist --save-interval 5 \
--eval-iters 0 --eval-interval 1000 --log-interval 1"

cmd() {  # the training command of one run: beta2, checkpoint folder
  echo "$PY $MEGATRON_LM/pretrain_gpt.py $ARGS --adam-beta2 $1 --save $2"
}
CMD_A=$(cmd 0.999 "$OUT/ckpt_a")
CMD_B=$(cmd 0.95 "$OUT/ckpt_b")
for side in a b; do
  c=CMD_${side^^}
  echo "== run $side: ${!c}"
  start=$(date +%s)
  (cd "$OUT" && PYTHONPATH="$MEGATRON_LM:${PYTHONPATH:-}" eval "${!c}") > "$OUT/$side.log" 2>&1
  echo "   exit $?, $(( $(date +%s) - start )) s, $(grep -c 'lm loss' "$OUT/$side.log") iterations logged"
done

echo "== tensordiff runs"
"${TD[@]}" runs "$OUT/a.log" "$OUT/b.log" --json "$OUT/runs.json" --no-color; echo "   exit $?"
echo "== tensordiff config"
"${TD[@]}" config "$OUT/a.log" "$OUT/b.log" --json "$OUT/config.json" --no-color; echo "   exit $?"
for mode in shared own; do
  echo "== tensordiff locate --mode $mode --run"
  start=$(date +%s)
  (cd "$OUT" && PYTHONPATH="$MEGATRON_LM:${PYTHONPATH:-}" "${TD[@]}" locate a.log b.log --ckpt-a ckpt_a --ckpt-b ckpt_b \
      --cmd-a "$CMD_A" --cmd-b "$CMD_B" --mode "$mode" --run --out "locate_$mode" --json "locate_$mode.json" \
      --no-color)
  echo "   exit $?, $(( $(date +%s) - start )) s"
done
