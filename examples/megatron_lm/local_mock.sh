# Sourced by the pretrain_gpt.py scripts: the flags that run Megatron-LM's pretrain_gpt.py without Transformer Engine
# or Apex, on mock data (BF16, logging every iteration, no evaluation); each script adds its model and iterations.
export CUDA_DEVICE_MAX_CONNECTIONS=1
LOCAL_MOCK=(--transformer-impl local --no-gradient-accumulation-fusion --no-rope-fusion --no-persist-layer-norm
            --no-masked-softmax-fusion --mock-data --tokenizer-type NullTokenizer --split 1,0,0
            --eval-iters 0 --eval-interval 100000 --log-interval 1 --bf16)
