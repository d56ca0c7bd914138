"""Train a tiny transformer with cuflash attention in PyTorch, or with torch's own, and compare.

The task needs attention: each sequence repeats a random block of `period` tokens, so after the
first block the next token is the one `period` places back (the loss can fall from log(vocab) to
log(vocab) * (period - 1) / (seqlen - 1), the unpredictable first block). The model is pre-norm, with
grouped-query attention (GQA) through `cuflash.torch.attention` (bf16, causal) or through
`torch.nn.functional.scaled_dot_product_attention` on the same bf16 q, k, v; everything else is
float32 and identical, so the two loss curves differ only by the attention's rounding.

  python examples/train_torch.py --steps 300                 # both, on the GPU if there is one
  python examples/train_torch.py --attention cuflash --steps 5 --device cpu   # the reference, slow
"""
from __future__ import annotations

import argparse
import math

import torch
import torch.nn.functional as F
from torch import nn

import cuflash.torch as ct


class Attention(nn.Module):
    """Causal self-attention with nheads_kv <= nheads key/value heads (GQA), in bf16."""

    def __init__(self, dim: int, nheads: int, nheads_kv: int, impl: str):
        super().__init__()
        self.nheads, self.nheads_kv, self.headdim, self.impl = nheads, nheads_kv, dim // nheads, impl
        self.qkv = nn.Linear(dim, (nheads + 2 * nheads_kv) * self.headdim, bias=False)
        self.proj = nn.Linear(dim, dim, bias=False)

    def forward(self, x):
        batch, seqlen, _ = x.shape
        q, k, v = self.qkv(x).to(torch.bfloat16).split(
            [self.nheads * self.headdim, self.nheads_kv * self.headdim, self.nheads_kv * self.headdim], dim=-1)
        q = q.reshape(batch, seqlen, self.nheads, self.headdim)
        k, v = (t.reshape(batch, seqlen, self.nheads_kv, self.headdim) for t in (k, v))
        if self.impl == "cuflash":  # (batch, seqlen, heads, headdim) in and out, no transposes
            out = ct.attention(q, k, v, causal=True)
        else:
            out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                 is_causal=True, enable_gqa=True).transpose(1, 2)
        return self.proj(out.reshape(batch, seqlen, -1).float())


class Block(nn.Module):
    def __init__(self, dim: int, nheads: int, nheads_kv: int, impl: str):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = Attention(dim, nheads, nheads_kv, impl)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class TinyTransformer(nn.Module):
    def __init__(self, vocab: int, seqlen: int, dim: int, layers: int, nheads: int, nheads_kv: int, impl: str):
        super().__init__()
        self.embed, self.pos = nn.Embedding(vocab, dim), nn.Parameter(0.02 * torch.randn(seqlen, dim))
        nn.init.normal_(self.embed.weight, std=0.02)  # as the positions: small next to the residual stream
        self.blocks = nn.ModuleList(Block(dim, nheads, nheads_kv, impl) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(dim), nn.Linear(dim, vocab)

    def forward(self, tokens):
        x = self.embed(tokens) + self.pos[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def batch_of_repeats(generator, batch: int, seqlen: int, vocab: int, period: int, device) -> torch.Tensor:
    block = torch.randint(vocab, (batch, period), generator=generator, device="cpu")
    return block.repeat(1, seqlen // period).to(device)


def loss_floor(vocab: int, seqlen: int, period: int) -> float:
    """The task's lowest mean loss: the first block's next tokens cannot be predicted."""
    return math.log(vocab) * (period - 1) / (seqlen - 1)


def train(impl: str, steps: int, *, device: str = "cuda", seed: int = 0, batch: int = 16, seqlen: int = 256,
          period: int = 16, vocab: int = 16, dim: int = 256, layers: int = 2, nheads: int = 4, nheads_kv: int = 2,
          lr: float = 1e-3, log_every: int = 0) -> list[float]:
    """The loss of every step. Same seed, same initial weights and batches for either attention."""
    torch.manual_seed(seed)
    model = TinyTransformer(vocab, seqlen, dim, layers, nheads, nheads_kv, impl).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    data = torch.Generator().manual_seed(seed)
    losses = []
    for step in range(steps):
        tokens = batch_of_repeats(data, batch, seqlen, vocab, period, device)
        logits = model(tokens[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, vocab), tokens[:, 1:].reshape(-1))
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
        if log_every and (step % log_every == 0 or step == steps - 1):
            print(f"{impl:8s} step {step:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", choices=("cuflash", "torch", "both"), default="both")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    impls = ("cuflash", "torch") if args.attention == "both" else (args.attention,)
    curves = {impl: train(impl, args.steps, device=args.device, log_every=max(1, args.steps // 10)) for impl in impls}
    floor = loss_floor(16, 256, 16)
    for impl, losses in curves.items():
        tail = losses[-min(50, len(losses)):]
        print(f"{impl}: loss {losses[0]:.3f} -> {sum(tail) / len(tail):.3f} (mean of the last {len(tail)} steps; "
              f"the task's floor is {floor:.3f})")


if __name__ == "__main__":
    main()
