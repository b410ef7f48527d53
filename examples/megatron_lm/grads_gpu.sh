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
source "$(dirname "$0")/tiny_gpt.sh"
ARGS=("${TINY_GPT[@]}" --train-iters 2 --save-interval 1000 --save-wgrads-interval 1)
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
