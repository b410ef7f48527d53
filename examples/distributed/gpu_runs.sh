#!/usr/bin/env bash
# The GPU runs of issues 12 and 16 (examples/distributed/gpu_gpt.py) on a two-GPU machine, in one go:
#
#   examples/distributed/gpu_runs.sh A B3 B1    # then: examples/distributed/gpu_runs.sh B2   (default: A B1 B2 B3)
#
#   A   megatron-core GPT, BF16 in Float16Module, TP=1 on one GPU, captured, diffed against the CPU FP32 TP=2
#       reference in .gpuref/ (made on the CPU, see gpu_gpt.py's docstring)
#   B1  250M-parameter GPT, BF16, megatron DDP: TP=2 (2 GPUs) vs TP=1 (1 GPU), same weights and batch
#   B2  DP=2 with grad_reduce_in_fp32 True vs False (one step): merged diff as is, and with --rtol 1e-3 merged and
#       rank 0 vs rank 0 (side by side)
#   B3  step time without capture vs a statistics-only capture, DP=1 on 1 GPU vs DP=2 on 2 GPUs
#
# Logs, diff tables and JSON reports go to $OUT/<parts>.tar.gz, one line per command and its exit code to
# $OUT/summary.txt; the capture files stay in $WORK (default /tmp/gpu_work) and are removed once diffed.
# Megatron-core is taken from .whl/ when it is not importable. GPT_ARGS / A_ARGS add arguments to every gpu_gpt.py
# call of part B / A (GPT_ARGS="--device cpu --size tiny" A_ARGS="--device cpu" runs it all on the CPU with gloo).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-/tmp/gpu_runs_out}
WORK=${WORK:-/tmp/gpu_work}
PARTS=${*:-A B1 B2 B3}
TAG=$(echo "$PARTS" | tr -c 'A-Za-z0-9\n' '_' | tr -d '\n')
RES=$WORK/res_$TAG
mkdir -p "$OUT" "$WORK" "$RES"
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
export PYTHONUNBUFFERED=1 PYTHONWARNINGS=ignore
PY=${PY:-python3}
if ! $PY -c 'import megatron.core' 2>/dev/null && ls .whl/*.whl >/dev/null 2>&1; then
  $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
  export PYTHONPATH=/tmp/site
fi
export PYTHONPATH=${PYTHONPATH:+$PYTHONPATH:}$PWD
G=examples/distributed/gpu_gpt.py
GPT_ARGS=${GPT_ARGS:-}
A_ARGS=${A_ARGS:-}

run() {  # run NAME TIMEOUT CMD...: CMD's output to $RES/NAME.log, its exit code to summary.txt
  local name=$1 limit=$2; shift 2
  local t0=$SECONDS
  timeout "$limit" "$@" > "$RES/$name.log" 2>&1
  local rc=$?
  echo "$name: exit $rc in $((SECONDS - t0)) s: $*" | tee -a "$OUT/summary.txt"
  tail -4 "$RES/$name.log" | sed 's/^/    /' | tee -a "$OUT/summary.txt"
  return $rc
}
TRUN="$PY -m torch.distributed.run --standalone --nproc_per_node"  # never --master_port 0
TDIFF="$PY -m tensordiff diff --no-color --width 200"

{
  date; hostname; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | head -4
  $PY -c 'import sys, torch, numpy, h5py, ml_dtypes, megatron.core as m; print(sys.version.split()[0], "torch",
torch.__version__, "cuda", torch.version.cuda, torch.cuda.device_count(), "GPUs; numpy", numpy.__version__, "h5py",
h5py.__version__, "ml_dtypes", ml_dtypes.__version__, "megatron-core", m.__version__)' 2>&1
} > "$RES/env.txt"
cat "$RES/env.txt" >> "$OUT/summary.txt"

for part in $PARTS; do
  case $part in
  A)
    run A_capture 300 $TRUN 1 $G --size small --dtype bf16 --ddp none --capture "$WORK/a_gpu_bf16.h5" $A_ARGS
    run A_diff 300 $TDIFF '.gpuref/ref_small_tp2.rank*.h5' "$WORK/a_gpu_bf16.h5" --max-rows 0 --json "$RES/A_diff.json"
    cp "$WORK/a_gpu_bf16.h5" "$OUT/" 2>/dev/null
    ;;
  B1)
    run B1_tp1 400 $TRUN 1 $G --capture "$WORK/b1_tp1.h5" $GPT_ARGS
    run B1_tp2 400 $TRUN 2 $G --tp 2 --capture "$WORK/b1_tp2.h5" $GPT_ARGS
    ls -la "$WORK"/b1_* >> "$RES/B1_files.txt"
    run B1_diff 500 $TDIFF "$WORK/b1_tp1.h5" "$WORK/b1_tp2.rank*.h5" --json "$RES/B1_diff.json"
    rm -f "$WORK"/b1_*.h5
    ;;
  B2)  # one step: the reduction shows at step 0, and a DP run stores its local gradients in full at every step
    run B2_fp32 400 $TRUN 2 $G --dp 2 --batch 2 --steps 1 --grad-reduce fp32 --capture "$WORK/b2_fp32.h5" $GPT_ARGS
    run B2_bf16 400 $TRUN 2 $G --dp 2 --batch 2 --steps 1 --grad-reduce bf16 --capture "$WORK/b2_bf16.h5" $GPT_ARGS
    ls -la "$WORK"/b2_* >> "$RES/B2_files.txt"
    # the three diffs read the same files: run side by side
    run B2_diff 450 $TDIFF "$WORK/b2_fp32.rank*.h5" "$WORK/b2_bf16.rank*.h5" --json "$RES/B2_diff.json" &
    run B2_diff_rtol 450 $TDIFF "$WORK/b2_fp32.rank*.h5" "$WORK/b2_bf16.rank*.h5" --rtol 1e-3 \
      --first-divergence --json "$RES/B2_diff_rtol.json" &
    run B2_diff_rank0_rtol 450 $TDIFF "$WORK/b2_fp32.rank0.h5" "$WORK/b2_bf16.rank0.h5" --rtol 1e-3 \
      --first-divergence --json "$RES/B2_diff_rank0_rtol.json" &
    wait
    rm -f "$WORK"/b2_*.h5
    ;;
  B3)
    run B3_dp1 300 $TRUN 1 $G --batch 4 --time 10 --warmup 3 --capture "$WORK/t_dp1.h5" --report "$RES/B3_dp1.json" $GPT_ARGS
    run B3_dp2 300 $TRUN 2 $G --batch 8 --dp 2 --time 10 --warmup 3 --capture "$WORK/t_dp2.h5" \
      --report "$RES/B3_dp2.json" $GPT_ARGS
    rm -f "$WORK"/t_dp*.h5
    ;;
  *) echo "unknown part $part (A B1 B2 B3)" | tee -a "$OUT/summary.txt" ;;
  esac
  tar -C "$WORK" -czf "$OUT/$TAG.tar.gz" "res_$TAG"  # after each part: a call stopped at its limit keeps the rest
done
echo "wrote $OUT/$TAG.tar.gz" | tee -a "$OUT/summary.txt"
