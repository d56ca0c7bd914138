"""One forward call per configuration for a profiler (ncu) on the lent GPU, FA3 sizing (batch * seqlen
= 16k tokens, heads * head dim = 2048): each argument is dtype:headdim:seqlen:causal, dtype bf16 or
fp8 (attention_fp8 on inputs quantized per head). The kernel runs three times; profile one launch:
`ncu --set full --import-source no -k regex:fwd_sm90 --launch-skip 1 --launch-count 1 -o OUT
python tests/profile_fwd.py bf16:128:4096:0`, then `ncu -i OUT.ncu-rep --page source --csv
--print-source sass` gives the warp-state samples of every SASS instruction."""
import sys

import torch

import cuflash

for spec in sys.argv[1:]:
    dtype, headdim, seqlen, causal = spec.split(":")
    headdim, seqlen, causal = int(headdim), int(seqlen), causal == "1"
    batch, nheads = 16384 // seqlen, 2048 // headdim
    q, k, v = (torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    if dtype == "fp8":
        (q8, qd), (k8, kd), (v8, vd) = (cuflash.quantize_fp8(x) for x in (q, k, v))
        for _ in range(3):
            cuflash.attention_fp8(q8, k8, v8, qd, kd, vd, causal=causal, out_dtype="bfloat16")
    else:
        for _ in range(3):
            cuflash.attention(q, k, v, causal=causal)
    torch.cuda.synchronize()
