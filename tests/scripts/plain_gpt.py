"""Train a tiny GPT on random token ids: plain PyTorch, no tensordiff.

    python plain_gpt.py --iters 20 --eval-every 5
    python plain_gpt.py --gelu tanh          # the MLP's GELU with the tanh approximation

Test data for tests/test_autocapture.py: a training script written the way users write one, which
`tensordiff capture --auto` must record without any edit.
"""

import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).split(C, dim=2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, d_model, gelu):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.act = nn.GELU(approximate=gelu)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.proj(self.act(self.fc(x)))


class Block(nn.Module):
    def __init__(self, d_model, n_head, gelu):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model)
        self.mlp = MLP(d_model, gelu)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return x


class GPT(nn.Module):
    def __init__(self, vocab_size, block_size, d_model, n_layer, n_head, gelu="none"):
        super().__init__()
        self.tok_emb = nn.Embedding(vocab_size, d_model)
        self.pos_emb = nn.Embedding(block_size, d_model)
        self.blocks = nn.ModuleList([Block(d_model, n_head, gelu) for _ in range(n_layer)])
        self.ln_f = nn.LayerNorm(d_model)
        self.head = nn.Linear(d_model, vocab_size, bias=False)
        self.head.weight = self.tok_emb.weight  # tied
        self.apply(self._init_weights)

    def _init_weights(self, module):
        if isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        T = idx.shape[1]
        pos = torch.arange(T, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.head(self.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=8)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=96)
    p.add_argument("--d-model", type=int, default=32)
    p.add_argument("--n-layer", type=int, default=2)
    p.add_argument("--n-head", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--eval-every", type=int, default=4, help="evaluate at iteration 0 and every N (0: never)")
    p.add_argument("--eval-iters", type=int, default=2)
    p.add_argument("--gelu", choices=["none", "tanh"], default="none", help="GELU approximation of the MLP")
    args = p.parse_args()

    torch.manual_seed(args.seed)
    data = {"train": torch.randint(args.vocab_size, (4096,)), "val": torch.randint(args.vocab_size, (1024,))}
    gens = {"train": torch.Generator().manual_seed(args.seed), "val": torch.Generator().manual_seed(args.seed + 1)}

    def get_batch(split):
        d = data[split]
        ix = torch.randint(len(d) - args.block_size - 1, (args.batch_size,), generator=gens[split])
        x = torch.stack([d[i:i + args.block_size] for i in ix])
        y = torch.stack([d[i + 1:i + 1 + args.block_size] for i in ix])
        return x, y

    model = GPT(args.vocab_size, args.block_size, args.d_model, args.n_layer, args.n_head, args.gelu)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1)

    def evaluate():
        model.eval()
        losses = []
        with torch.no_grad():
            for _ in range(args.eval_iters):
                x, y = get_batch("val")
                _, loss = model(x, targets=y)
                losses.append(loss.item())
        model.train()
        return sum(losses) / len(losses)

    for it in range(args.iters):
        if args.eval_every and it % args.eval_every == 0:
            print(f"iter {it}: val loss {evaluate():.4f}")
        x, y = get_batch("train")
        _, loss = model(x, targets=y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        print(f"iter {it}: loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
