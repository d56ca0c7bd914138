"""Host time per call on a tiny problem (launch-bound): cuflash.attention against torch SDPA, and
where cuflash's time goes (cProfile, top entries by own time).

  python benchmarks/host_overhead.py
"""
import cProfile
import pstats
import time

import torch
from torch.nn.functional import scaled_dot_product_attention as sdpa

import cuflash


def per_call_us(call, n=2000) -> float:
    for _ in range(20):
        call()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        call()
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / n * 1e6


def main():
    q = torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16)
    qt = q.transpose(1, 2)
    print(f"cuflash.attention: {per_call_us(lambda: cuflash.attention(q, q, q)):.1f} us per call")
    print(f"torch SDPA:        {per_call_us(lambda: sdpa(qt, qt, qt)):.1f} us per call")
    profiler = cProfile.Profile()
    profiler.enable()
    per_call_us(lambda: cuflash.attention(q, q, q), n=2000)
    profiler.disable()
    pstats.Stats(profiler).sort_stats("tottime").print_stats(18)


if __name__ == "__main__":
    main()
