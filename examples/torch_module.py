"""A drop-in PyTorch self-attention module on `cuflash.torch.attention`, checked against SDPA.

`CuflashSelfAttention(dim, nheads, nheads_kv, causal=True, window=(-1, -1))` maps (batch, seqlen, dim)
to (batch, seqlen, dim): one fused q/k/v projection with grouped-query heads (nheads_kv <= nheads),
cuflash's attention, an output projection. `SdpaSelfAttention` is the same module with the attention
computed by `torch.nn.functional.scaled_dot_product_attention(..., enable_gqa=True)`; loaded with
the same weights, both must give the same output and the same gradients (up to rounding), which is
what "drop-in" means here. cuflash takes (batch, seqlen, heads, headdim) as the projection lays it
out; SDPA wants the heads before the sequence, hence its transposes.

On a GPU the modules run in bf16 on cuflash's kernels (and the module is also run through
`torch.compile`); on the CPU in float32 on cuflash's NumPy reference (slow at scale, fine here).

  python examples/torch_module.py                 # cuda if there is a GPU, else cpu
  python examples/torch_module.py --device cpu
"""
from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from torch import nn

import cuflash.torch as ct
from cuflash.reference import visible_mask


class CuflashSelfAttention(nn.Module):
    """Self-attention over (batch, seqlen, dim) with nheads query heads and nheads_kv key/value heads.

    causal and window=(left, right) are cuflash's: query i sees key j iff i - left <= j <= i + right
    (-1: unbounded; causal means right = 0)."""

    def __init__(self, dim: int, nheads: int, nheads_kv: int | None = None, *, causal: bool = True,
                 window: tuple[int, int] = (-1, -1), bias: bool = False):
        super().__init__()
        nheads_kv = nheads if nheads_kv is None else nheads_kv
        if dim % nheads or nheads % nheads_kv:
            raise ValueError(f"dim ({dim}) must be a multiple of nheads ({nheads}), "
                             f"and nheads a multiple of nheads_kv ({nheads_kv})")
        self.nheads, self.nheads_kv, self.headdim = nheads, nheads_kv, dim // nheads
        self.causal, self.window = causal, tuple(window)
        self.qkv = nn.Linear(dim, (nheads + 2 * nheads_kv) * self.headdim, bias=bias)  # fused projection
        self.out = nn.Linear(dim, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seqlen, dim = x.shape
        q, k, v = self.qkv(x).split(
            [self.nheads * self.headdim, self.nheads_kv * self.headdim, self.nheads_kv * self.headdim], dim=-1)
        # Views, no copies: (batch, seqlen, heads, headdim) is the layout cuflash reads.
        q = q.unflatten(-1, (self.nheads, self.headdim))
        k = k.unflatten(-1, (self.nheads_kv, self.headdim))
        v = v.unflatten(-1, (self.nheads_kv, self.headdim))
        return self.out(self.attend(q, k, v).reshape(batch, seqlen, dim))

    def attend(self, q, k, v):
        return ct.attention(q, k, v, causal=self.causal, window=self.window)


class SdpaSelfAttention(CuflashSelfAttention):
    """The same module with torch's scaled_dot_product_attention: the one to compare against."""

    def attend(self, q, k, v):
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))  # SDPA: (batch, heads, seqlen, headdim)
        if self.window == (-1, -1):
            out = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=True)
        else:  # SDPA has no sliding window: pass the visibility as a boolean mask (True = attend)
            mask = visible(seqlen_q, seqlen_k, self.causal, self.window, q.device)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return out.transpose(1, 2)


def visible(seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int], device) -> torch.Tensor:
    """cuflash's mask (aligned to the bottom-right corner) as a (seqlen_q, seqlen_k) bool tensor,
    taken from the NumPy reference, the specification of what each query sees."""
    return torch.from_numpy(visible_mask(seqlen_q, seqlen_k, causal=causal, window=window)).to(device)


def _max_diff(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    """(max |a - b|, max |b|), in float32."""
    a, b = a.float(), b.float()
    return (a - b).abs().max().item(), b.abs().max().item()


def _run(module: nn.Module, x: torch.Tensor, grad_out: torch.Tensor):
    """Output, and the gradients of sum(out * grad_out) for x and every weight."""
    x = x.detach().requires_grad_()
    module.zero_grad(set_to_none=True)
    out = module(x)
    out.backward(grad_out)
    grads = {"x": x.grad, **{name: p.grad for name, p in module.named_parameters()}}
    return out.detach(), grads


def compare(device: str = "cpu", dtype: torch.dtype | None = None, *, batch: int = 2, seqlen: int = 128,
            dim: int = 256, nheads: int = 8, nheads_kv: int = 2, causal: bool = True,
            window: tuple[int, int] = (-1, -1), seed: int = 0) -> dict[str, tuple[float, float]]:
    """Run CuflashSelfAttention and SdpaSelfAttention with the same weights, input and upstream
    gradient. Returns {"out" | "grad_x" | "grad_qkv.weight" | "grad_out.weight":
    (max |cuflash - sdpa|, max |sdpa|)}. dtype: bf16 on cuda, float32 on cpu unless given."""
    dtype = dtype or (torch.bfloat16 if device.startswith("cuda") else torch.float32)
    torch.manual_seed(seed)
    ours = CuflashSelfAttention(dim, nheads, nheads_kv, causal=causal, window=window).to(device, dtype)
    theirs = SdpaSelfAttention(dim, nheads, nheads_kv, causal=causal, window=window).to(device, dtype)
    theirs.load_state_dict(ours.state_dict())
    x = torch.randn(batch, seqlen, dim, device=device, dtype=dtype)
    grad_out = torch.randn(batch, seqlen, dim, device=device, dtype=dtype)
    out_a, grads_a = _run(ours, x, grad_out)
    out_b, grads_b = _run(theirs, x, grad_out)
    result = {"out": _max_diff(out_a, out_b)}
    result.update({f"grad_{name}": _max_diff(grads_a[name], grads_b[name]) for name in grads_a})
    return result


def compiled_difference(*, batch: int = 2, seqlen: int = 256, dim: int = 256, nheads: int = 8, nheads_kv: int = 2,
                        seed: int = 0) -> dict[str, tuple[float, float]]:
    """CUDA only: the module under torch.compile(fullgraph=True) (cuflash's op is a custom op, so no
    graph break) against the same module run eagerly. Returns {"out" | "grad_x": (max |compiled -
    eager|, max |eager|)}."""
    torch.manual_seed(seed)
    module = CuflashSelfAttention(dim, nheads, nheads_kv).to("cuda", torch.bfloat16)
    compiled = torch.compile(module, fullgraph=True)
    x = torch.randn(batch, seqlen, dim, device="cuda", dtype=torch.bfloat16)
    grad_out = torch.randn_like(x)
    out_eager, grads_eager = _run(module, x, grad_out)
    out_compiled, grads_compiled = _run(compiled, x, grad_out)
    return {"out": _max_diff(out_compiled, out_eager), "grad_x": _max_diff(grads_compiled["x"], grads_eager["x"])}


def _print(title: str, result: dict[str, tuple[float, float]], ours: str, theirs: str) -> None:
    print(title)
    for name, (diff, scale) in result.items():
        print(f"  {name:16s} max |{ours} - {theirs}| = {diff:.1e}   (max |{theirs}| = {scale:.2f})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    for window in ((-1, -1), (32, 0)):
        what = "causal" if window == (-1, -1) else f"causal, sliding window {window}"
        _print(f"{args.device} {dtype}, GQA 8/2 heads, {what}: CuflashSelfAttention vs SdpaSelfAttention",
               compare(args.device, window=window), "cuflash", "sdpa")
    if args.device.startswith("cuda"):
        _print("torch.compile(fullgraph=True) vs eager, cuda bfloat16", compiled_difference(), "compiled", "eager")
    else:
        print("(torch.compile is shown on cuda only: on cpu the attention is the NumPy reference)")


if __name__ == "__main__":
    main()
