#!/usr/bin/env bash
# Megatron-LM's own pretrain_gpt.py (mock data, no Transformer Engine, no Apex), captured by tensordiff with no edit
# to it: two identical runs that must agree, and one with another norm epsilon that must not (docs/megatron-lm.md).
#
#   MEGATRON_LM=/path/to/Megatron-LM bash examples/megatron_lm/pretrain_gpt.sh [OUT_DIR] [NPROC]
#
# MEGATRON_LM: a checkout of NVIDIA/Megatron-LM at the tag matching the installed megatron-core (core_v0.16.1 for
# 0.16.1). Needs a CUDA GPU (pretrain_gpt.py asserts one).
set -euo pipefail
: "${MEGATRON_LM:?set MEGATRON_LM to a Megatron-LM checkout (tag core_v0.16.1 for megatron-core 0.16.1)}"
OUT=${1:-megatron_lm_runs}
NPROC=${2:-1}
PY=${PYTHON:-python3}
mkdir -p "$OUT"
source "$(dirname "$0")/local_mock.sh"  # LOCAL_MOCK: no Transformer Engine or Apex, mock data
ARGS=("${LOCAL_MOCK[@]}" --vocab-size 1024
      --num-layers 2 --hidden-size 256 --num-attention-heads 4 --seq-length 256 --max-position-embeddings 256
      --micro-batch-size 2 --global-batch-size $((2 * NPROC)) --train-iters 3 --lr 1e-4 --min-lr 1e-5 --seed 1234
      --use-distributed-optimizer)
run() {  # run NAME [extra pretrain_gpt.py flags...]
  local name=$1; shift
  "$PY" -m tensordiff capture --megatron -o "$OUT/$name.h5" --steps 2 -- \
    "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$MEGATRON_LM/pretrain_gpt.py" \
    "${ARGS[@]}" "$@" > "$OUT/$name.log" 2>&1 || { tail -30 "$OUT/$name.log"; return 1; }
  grep -E "iteration +[0-9]+/|^tensordiff" "$OUT/$name.log"
}
plain() {  # the same run without tensordiff: the step times to compare with
  "$PY" -m torch.distributed.run --standalone --nproc-per-node "$NPROC" "$MEGATRON_LM/pretrain_gpt.py" "${ARGS[@]}" \
    > "$OUT/plain.log" 2>&1 || { tail -30 "$OUT/plain.log"; return 1; }
  grep -E "iteration +[0-9]+/" "$OUT/plain.log"
}
files() { [ "$NPROC" = 1 ] && echo "$OUT/$1.h5" || echo "$OUT/$1.rank*.h5"; }
plain
run ref
run rerun
run eps --norm-epsilon 1e-2
"$PY" -m tensordiff ls "$(files ref | sed 's/\*/0/')" | head -30
set +e
"$PY" -m tensordiff diff "$(files ref)" "$(files rerun)"; echo "diff ref rerun: exit $?"
"$PY" -m tensordiff diff "$(files ref)" "$(files eps)" --first-divergence; echo "diff ref eps: exit $?"
"$PY" -m tensordiff runs "$OUT/ref.log" "$(files rerun | sed 's/\*/0/')"; echo "runs ref.log rerun.h5: exit $?"
