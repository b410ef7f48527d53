# Sourced by the GPU scripts here: the tiny GPT they train with Megatron-LM's pretrain_gpt.py (no Transformer Engine,
# no Apex, mock data, one GPU) and the single-process launch environment. Each script adds its iterations and saves.
export CUDA_DEVICE_MAX_CONNECTIONS=1 RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1
TINY_GPT=(
  --transformer-impl local --no-gradient-accumulation-fusion --no-rope-fusion --no-persist-layer-norm
  --no-masked-softmax-fusion --no-bias-swiglu-fusion
  --num-layers 2 --hidden-size 64 --ffn-hidden-size 128 --num-attention-heads 4 --seq-length 16
  --max-position-embeddings 16 --hidden-dropout 0 --attention-dropout 0
  --tokenizer-type NullTokenizer --vocab-size 127 --make-vocab-size-divisible-by 128 --mock-data --split 1,0,0
  --micro-batch-size 2 --global-batch-size 2 --seed 1234
  --lr 1e-3 --lr-decay-style constant --min-lr 0 --lr-warmup-iters 0
  --eval-iters 0 --eval-interval 1000 --log-interval 1
)
