"""One backward call per configuration, for a profiler (ncu) on the lent GPU: head dims 64 and 128,
seqlen 4k, FA3 sizing, bf16, non-causal, on the kernel dispatch chooses (bwd_sm90 on Hopper) or the
one `--backend sm80` forces. `ncu -k regex:bwd_sm python tests/profile_bwd.py [--backend sm80]`."""
import sys

import torch

import cuflash

for headdim in (64, 128):
    seqlen = 4096
    batch, nheads = 16384 // seqlen, 2048 // headdim
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    cuflash.attention_backward(dout, q, k, v, out, lse,
                               backend=sys.argv[sys.argv.index("--backend") + 1] if "--backend" in sys.argv else None)
    torch.cuda.synchronize()
