# A user's script: Hugging Face Qwen2 trained two ways that compute the same loss: HF's own (labels=input_ids, shifted
# inside the model) or the user's cross-entropy of the shifted logits. SGD, random tokens, no tensordiff.
import argparse

import torch
import torch.nn.functional as F
from transformers import Qwen2Config, Qwen2ForCausalLM

p = argparse.ArgumentParser()
p.add_argument("--loss", choices=("inside", "outside"), default="inside")
args = p.parse_args()
torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=100, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, max_position_embeddings=32, tie_word_embeddings=True)
model = Qwen2ForCausalLM(cfg)
opt = torch.optim.SGD(model.parameters(), lr=0.05)
ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(2))
for step in range(2):
    if args.loss == "inside":
        loss = model(input_ids=ids, labels=ids).loss
    else:
        logits = model(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, 100).float(), ids[:, 1:].reshape(-1))
    loss.backward()
    opt.step()
    opt.zero_grad()
    print("step", step, loss.item())
