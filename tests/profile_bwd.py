"""One backward call per configuration, for a profiler (ncu) on the lent GPU: head dims 64 and 128,
seqlen 4k, FA3 sizing, bf16, non-causal. `ncu -k regex:bwd_sm80 python tests/profile_bwd.py`."""
import torch

import cuflash

for headdim in (64, 128):
    seqlen = 4096
    batch, nheads = 16384 // seqlen, 2048 // headdim
    q, k, v, dout = (torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16)
                     for _ in range(4))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    cuflash.attention_backward(dout, q, k, v, out, lse)
    torch.cuda.synchronize()
