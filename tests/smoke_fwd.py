"""Quick look at one forward backend on a few shapes: max error against the float32 torch
reference and a plain low-precision one. `python tests/smoke_fwd.py sm90`; a debugging aid."""
import sys

import torch

import cuflash
from gpu_attention_reference import attention

backend = sys.argv[1] if len(sys.argv) > 1 else None
for (b, sq, sk, h, hkv, d, kw) in [(1, 128, 128, 1, 1, 128, {}), (2, 300, 517, 4, 2, 128, {}),
                                    (2, 300, 517, 4, 2, 128, dict(causal=True)), (1, 1000, 1000, 2, 1, 64, {}),
                                    (1, 777, 333, 2, 2, 256, dict(window=(50, 20))), (1, 200, 200, 2, 2, 192, dict(softcap=5.0)),
                                    (1, 65, 1, 2, 2, 96, dict(causal=True))]:
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(b, sq, h, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(b, sk, hkv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(b, sk, hkv, d, device="cuda", generator=g).bfloat16()
    out, lse = cuflash.attention(q, k, v, return_lse=True, backend=backend, **kw)
    torch.cuda.synchronize()
    ref, ref_lse = attention(q, k, v, compute_dtype=torch.float32, **kw)
    low, _ = attention(q, k, v, compute_dtype=torch.bfloat16, **kw)
    fin = torch.isfinite(ref_lse)
    print((b, sq, sk, h, hkv, d), kw, "err", (out.float() - ref).abs().max().item(), "plain",
          (low.float() - ref).abs().max().item(), "lse", (lse[fin] - ref_lse[fin]).abs().max().item(), flush=True)
