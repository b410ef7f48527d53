#!/usr/bin/env bash
# What capture costs on Megatron-LM's own pretrain_gpt.py (issue 31): GPT-2 small (12 layers, hidden 768, 12 heads,
# seq 1024, micro-batch 4), BF16, one GPU, mock data, no Transformer Engine or Apex; the iteration times are
# Megatron-LM's own ("elapsed time per iteration (ms)", --log-interval 1).
#
#   MEGATRON_LM=/path/to/Megatron-LM bash benchmarks/pretrain_gpt_overhead.sh [OUT_DIR] [ITERS]
#
# Runs, each ITERS iterations (default 10) in a fresh process:
#   plain    no capture
#   default  tensordiff capture --megatron (its defaults: --steps 2, full tensors of the first iteration)
#   stats    tensordiff capture --megatron --steps ITERS --tensors none (statistics every iteration)
# and prints each run's iteration times, their median over iterations 3.., and the file size.
set -euo pipefail
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (tag core_v0.16.1 for megatron-core 0.16.1)}"
OUT=${1:-pretrain_gpt_overhead}
ITERS=${2:-10}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
source "$(dirname "$0")/../examples/megatron_lm/local_mock.sh"  # LOCAL_MOCK: no Transformer Engine or Apex, mock data
ARGS=("${LOCAL_MOCK[@]}" --vocab-size 50257
      --num-layers 12 --hidden-size 768 --num-attention-heads 12 --seq-length 1024 --max-position-embeddings 1024
      --micro-batch-size 4 --global-batch-size 4 --train-iters "$ITERS" --lr 1e-4 --min-lr 1e-5 --seed 1234)
LAUNCH=("$PY" -m torch.distributed.run --standalone --nproc-per-node 1 "$MEGATRON_LM/pretrain_gpt.py" "${ARGS[@]}")
times() {  # NAME: the iteration times of its log, and their median from iteration 3 on (POSIX awk and sort)
  local all med
  all=$(grep -oE "elapsed time per iteration \(ms\): [0-9.]+" "$OUT/$1.log" | awk '{print $NF}' | tr '\n' ' ')
  med=$(echo "$all" | tr ' ' '\n' | awk 'NF' | tail -n +3 | sort -g |
        awk '{s[NR] = $1} END {print NR ? (NR % 2 ? s[(NR + 1) / 2] : (s[NR / 2] + s[NR / 2 + 1]) / 2) : 0}')
  printf "%-8s iterations (ms): %s| median of 3..: %.1f\n" "$1" "$all" "$med"
}
"${LAUNCH[@]}" > "$OUT/plain.log" 2>&1 || { tail -30 "$OUT/plain.log"; exit 1; }
times plain
"$PY" -m tensordiff capture --megatron -o "$OUT/default.h5" -- "${LAUNCH[@]}" > "$OUT/default.log" 2>&1 ||
  { tail -30 "$OUT/default.log"; exit 1; }
times default
ls -l "$OUT/default.h5" | awk '{printf "default  file %.2f GB\n", $5 / 1e9}'
"$PY" -m tensordiff capture --megatron -o "$OUT/stats.h5" --steps "$ITERS" --tensors none -- "${LAUNCH[@]}" \
  > "$OUT/stats.log" 2>&1 || { tail -30 "$OUT/stats.log"; exit 1; }
times stats
ls -l "$OUT/stats.h5" | awk '{printf "stats    file %.1f MB\n", $5 / 1e6}'
grep -h "^tensordiff" "$OUT"/*.log | sort | uniq -c | head -20
