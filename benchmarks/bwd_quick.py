"""A quick backward tile sweep: cuflash.attention_backward (with --tiles, other rows than the
table's) against torch SDPA's flash backward (FlashAttention-2), interleaved, median of CUDA-event
timings, backward FLOPs counted as 2.5x the forward's. No clocks recorded: the numbers to report
come from the harness, `benchmarks/bench_fwd.py --backward`.
On Hopper bwd_sm80 (backend="sm80") is timed beside the default (bwd_sm90).
`python benchmarks/bwd_quick.py [--headdims 64,128] [--seqlens 1024,4096] [--tiles 128:64:64:8:1,...]`."""
import statistics
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuflash
from cuflash.kernels import bwd_sm80

if "--tiles" in sys.argv:  # time other tiles than the table's: --tiles hd:block_m:block_n:warps:stages,...
    bwd_sm80.tiles_override = {int(hd): tuple(tiles) for hd, *tiles in (
        map(int, item.split(":")) for item in sys.argv[sys.argv.index("--tiles") + 1].split(","))}

headdims = [int(x) for x in sys.argv[sys.argv.index("--headdims") + 1].split(",")] if "--headdims" in sys.argv else [64, 128]
for headdim in headdims:
    for causal in (False, True):
        for seqlen in [int(x) for x in sys.argv[sys.argv.index("--seqlens") + 1].split(",")] if "--seqlens" in sys.argv else (1024, 4096):
            batch, nheads = 16384 // seqlen, 2048 // headdim
            q, k, v, do = (torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=torch.bfloat16)
                           for _ in range(4))
            out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
            qt, kt, vt = (x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                ot = sdpa(qt, kt, vt, is_causal=causal)
            dot = do.transpose(1, 2)
            calls = {"cuflash": lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=causal),
                     "torch-flash": lambda: torch.autograd.grad(ot, (qt, kt, vt), dot, retain_graph=True)}
            if torch.cuda.get_device_capability() == (9, 0):  # the portable kernel beside bwd_sm90
                calls["cuflash-sm80"] = lambda: cuflash.attention_backward(do, q, k, v, out, lse, causal=causal,
                                                                           backend="sm80")
            times = {n: [] for n in calls}
            for _ in range(3):
                for c in calls.values():
                    c()
            for _ in range(20):
                for n, c in calls.items():
                    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    s.record(); c(); e.record(); times[n].append((s, e))
            torch.cuda.synchronize()
            flops = 2.5 * 4 * batch * nheads * seqlen * seqlen * headdim / (2 if causal else 1)
            row = {n: flops / statistics.median(a.elapsed_time(b) for a, b in ts) / 1e9 for n, ts in times.items()}
            print(f"bf16 d={headdim} causal={int(causal)} s={seqlen}: " + "  ".join(f"{n} {t:.0f}" for n, t in row.items())
                  + f"  ratio {row['cuflash'] / row['torch-flash']:.2f}", flush=True)
