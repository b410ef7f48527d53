#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py (tag core_v0.16.1, one GPU, no Transformer Engine/Apex, mock data) saving --save
# folders in every checkpoint layout tensordiff reads (docs/checkpoints.md, tests/test_ckpt_megatron_lm_real.py):
# the same tiny GPT trained 6 iterations from one seed, saved at iterations 3 and 6, in these variants:
#   dist_do      --ckpt-format torch_dist --use-distributed-optimizer  (optimizer state: dp_reshardable, the default)
#   dist         --ckpt-format torch_dist                              (optimizer state per parameter)
#   torch_do     --ckpt-format torch --use-distributed-optimizer       (distrib_optim.pt, one bucket)
#   torch        --ckpt-format torch                                   (torch's optimizer state by index)
#   dist_do_buckets / torch_do_buckets: the same with --overlap-grad-reduce --ddp-bucket-size 10000 (several buckets)
#   dist_do_full --dist-ckpt-optim-fully-reshardable                   (optimizer state per parameter)
#   dist_do_bf16 --bf16                                                (bf16 weights, fp32 main params in the buckets)
# then resumes (--load --ckpt-step 3) of dist, torch, dist_do and torch_do to iteration 6, saved into NAME_resume.
# Seen with megatron-core 0.16.1 without Apex/TE (torch's AdamW): the two distributed-optimizer resumes stop inside
# megatron-core (torch_dist: `assert len(steps) == 1` in DistributedOptimizer.state_dict, the optimizer having no
# state yet; torch: "a view of a leaf Variable that requires grad is being used in an in-place operation" copying
# distrib_optim.pt into the FP32 parameters); the other two resume.
#
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/megatron_lm/ckpt_variants_gpu.sh OUT
set -uo pipefail
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (tag core_v0.16.1 for megatron-core 0.16.1)}"
OUT=${1:?usage: ckpt_variants_gpu.sh OUT}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
source "$(dirname "$0")/tiny_gpt.sh"
ARGS=("${TINY_GPT[@]}" --train-iters 6 --save-interval 3)
run() {  # run PORT NAME [flags...]: one pretrain_gpt.py in the background, its log in OUT/NAME.log
  local port=$1 name=$2; shift 2
  MASTER_PORT=$port "$PY" "$MEGATRON_LM/pretrain_gpt.py" "${ARGS[@]}" --save "$OUT/$name" "$@" \
    > "$OUT/$name.log" 2>&1 &
  PIDS+=($!); NAMES+=("$name")
}
wait_all() {
  local status=0 i
  for i in "${!PIDS[@]}"; do
    wait "${PIDS[$i]}"; local code=$?
    echo "== ${NAMES[$i]}: exit $code"
    grep -E "iteration +[0-9]+/|sharded state of type|saved checkpoint|loading (distributed )?checkpoint|successfully loaded" \
      "$OUT/${NAMES[$i]}.log" | sed 's/^/   /' | cut -c1-220
    [ $code -eq 0 ] || { tail -25 "$OUT/${NAMES[$i]}.log"; status=1; }
  done
  PIDS=(); NAMES=()
  return $status
}
PIDS=(); NAMES=()
BUCKETS=(--overlap-grad-reduce --ddp-bucket-size 10000)
run 29601 dist_do --ckpt-format torch_dist --use-distributed-optimizer
run 29602 dist --ckpt-format torch_dist
run 29603 torch_do --ckpt-format torch --use-distributed-optimizer
run 29604 torch --ckpt-format torch
run 29605 dist_do_buckets --ckpt-format torch_dist --use-distributed-optimizer "${BUCKETS[@]}"
run 29606 torch_do_buckets --ckpt-format torch --use-distributed-optimizer "${BUCKETS[@]}"
run 29607 dist_do_full --ckpt-format torch_dist --use-distributed-optimizer --dist-ckpt-optim-fully-reshardable
run 29608 dist_do_bf16 --ckpt-format torch_dist --use-distributed-optimizer --bf16
wait_all; status=$?
run 29613 dist_resume --ckpt-format torch_dist --load "$OUT/dist" --ckpt-step 3 --exit-on-missing-checkpoint
run 29614 torch_resume --ckpt-format torch --load "$OUT/torch" --ckpt-step 3 --exit-on-missing-checkpoint
run 29611 dist_do_resume --ckpt-format torch_dist --use-distributed-optimizer --load "$OUT/dist_do" --ckpt-step 3 \
  --exit-on-missing-checkpoint
run 29612 torch_do_resume --ckpt-format torch --use-distributed-optimizer --load "$OUT/torch_do" --ckpt-step 3 \
  --exit-on-missing-checkpoint
wait_all || status=1
exit $status
