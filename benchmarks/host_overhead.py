"""Host time per call on a tiny problem (launch-bound): cuflash's forward, FP8 forward and backward
against torch SDPA's forward, and where cuflash.attention's time goes (cProfile, top entries by own
time). A call with arrays laid out as an earlier call's skips the argument checks (dispatch.run_checked):
that is what is timed here, as in a training step or a decode loop.

  python benchmarks/host_overhead.py
"""
import cProfile
import pstats
import time

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuflash


def per_call_us(call, n=1000, repeats=5) -> float:
    """The least mean time per call over `repeats` runs of `n` calls: lent hosts are noisy, and noise
    only adds."""
    for _ in range(20):
        call()
    best = float("inf")
    for _ in range(repeats):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(n):
            call()
        torch.cuda.synchronize()
        best = min(best, (time.perf_counter() - t0) / n)
    return best * 1e6


def main():
    q = torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16)
    qt = q.transpose(1, 2)
    out, lse = cuflash.attention(q, q, q, return_lse=True)
    q8, descale = cuflash.quantize_fp8(q)
    calls = {"cuflash.attention": lambda: cuflash.attention(q, q, q),
             "cuflash.attention_fp8": lambda: cuflash.attention_fp8(q8, q8, q8, descale, descale, descale),
             "cuflash.quantize_fp8": lambda: cuflash.quantize_fp8(q, block=128),
             "cuflash.attention(fp8=True)": lambda: cuflash.attention(q, q, q, fp8=True),
             "cuflash.attention_backward": lambda: cuflash.attention_backward(q, q, q, q, out, lse),
             "torch SDPA (forward)": lambda: sdpa(qt, qt, qt)}
    for name, call in calls.items():
        print(f"{name + ':':29s} {per_call_us(call):6.1f} us per call")
    profiler = cProfile.Profile()
    profiler.enable()
    per_call_us(calls["cuflash.attention"], repeats=2)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
