"""FP8 inference with cuflash: attention on e4m3 q, k and v, on Hopper GPUs.

Two ways in:
- `cuflash.attention(q, k, v, fp8=True, hadamard=True)`: bf16/fp16 in and out; q, k and v are
  quantized on the fly (one scale per 128 rows of each head; q and k first multiplied by the same
  random-sign Hadamard matrix, which cancels in q k^T and spreads outliers across the head dim).
- `cuflash.quantize_fp8` once, then `cuflash.attention_fp8` on the e4m3 tensors and their descales:
  what a server does with a KV cache, quantizing K and V when they are written and only each new
  query at every step (give q the seed k was transformed with). q takes one scale per 128 rows;
  at head dims 65-128 K and V one per 192 rows (block=192, then kv_block=192: the Hopper kernel's
  key block there, 7-17% faster than 128-row scales from 2k keys), elsewhere per 128. A block
  that is still filling is quantized again as rows are appended to it (or kept in 16 bits until
  it is full); per-head scales (block=None) need an amax known in advance.

The example draws a prompt with outliers (0.1% of the entries times 10, as in the FlashAttention-3
paper's test), runs both ways, and prints the relative RMS error of each against attention on the
bf16 inputs; on a GPU it also times the bf16 and the FP8 kernels (an illustration: the benchmark
harness, benchmarks/bench_fwd.py --extra fp8, makes the measured claims).

It runs on torch CUDA tensors where cuflash has an FP8 kernel (compute capability 9.0), else on
NumPy arrays through the reference (which simulates e4m3 exactly, in float64; slow, so small sizes).

  python examples/fp8_inference.py
  python examples/fp8_inference.py --framework numpy --seqlen 256
"""
from __future__ import annotations

import argparse

import numpy as np

import cuflash

SEED = 1234  # the Hadamard signs of q and k: any value, as long as both use it


def available_framework() -> str:
    """'torch' where torch sees a GPU cuflash has an FP8 kernel for, else 'numpy'."""
    try:
        import torch

        if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
            return "torch"
    except ImportError:
        pass
    return "numpy"


def prompt(framework: str, batch: int, seqlen: int, nheads: int, nheads_kv: int, headdim: int):
    """q, k, v in bf16 with outliers, as torch CUDA tensors or NumPy (ml_dtypes) arrays."""
    rng = np.random.default_rng(0)

    def draw(h):
        x = rng.standard_normal((batch, seqlen, h, headdim), dtype=np.float32)
        x[rng.random(x.shape) < 1e-3] *= 10
        return x

    q, k, v = draw(nheads), draw(nheads_kv), draw(nheads_kv)
    if framework == "numpy":
        import ml_dtypes

        return tuple(x.astype(ml_dtypes.bfloat16) for x in (q, k, v))
    import torch

    return tuple(torch.from_numpy(x).to("cuda", torch.bfloat16) for x in (q, k, v))


def _relative_rms(x, y) -> float:
    x, y = (np.asarray(_host(a), np.float64) for a in (x, y))
    return float(np.sqrt(np.mean((x - y) ** 2) / np.mean(y**2)))


def _host(x):
    return x.float().cpu().numpy() if hasattr(x, "cpu") else np.asarray(x, np.float32)


def run(framework: str, batch: int = 1, seqlen: int = 4096, nheads: int = 16, nheads_kv: int = 4,
        headdim: int = 128, causal: bool = True) -> dict:
    q, k, v = prompt(framework, batch, seqlen, nheads, nheads_kv, headdim)
    want = cuflash.attention(q, k, v, causal=causal)  # the bf16 result the FP8 ones are compared with

    # One line: quantize on the fly.
    on_the_fly = cuflash.attention(q, k, v, causal=causal, fp8=True, hadamard=True)

    # A KV cache: K and V quantized once (here, the whole prompt), each query quantized as it comes.
    kv_block = 192 if 64 < headdim <= 128 else 128
    k8, k_descale = cuflash.quantize_fp8(k, block=kv_block, hadamard=True, seed=SEED)
    v8, v_descale = cuflash.quantize_fp8(v, block=kv_block)  # never transform v
    q8, q_descale = cuflash.quantize_fp8(q, block=128, hadamard=True, seed=SEED)
    cached = cuflash.attention_fp8(q8, k8, v8, q_descale, k_descale, v_descale, causal=causal,
                                   out_dtype="bfloat16", kv_block=kv_block)
    result = dict(framework=framework, on_the_fly=_relative_rms(on_the_fly, want), cached=_relative_rms(cached, want))
    if framework == "torch":
        result.update(_times(q, k, v, (q8, k8, v8, q_descale, k_descale, v_descale), kv_block, causal))
    return result


def _times(q, k, v, quantized, kv_block: int, causal: bool, reps: int = 20) -> dict:
    """Median milliseconds of the bf16 kernel and of the FP8 kernel on pre-quantized inputs."""
    import torch

    def median_ms(call):
        for _ in range(3):
            call()
        times = []
        for _ in range(reps):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        return float(np.median(times))

    return dict(ms_bf16=median_ms(lambda: cuflash.attention(q, k, v, causal=causal)),
                ms_fp8=median_ms(lambda: cuflash.attention_fp8(*quantized, causal=causal, kv_block=kv_block)))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--framework", choices=("torch", "numpy"), default=None)
    parser.add_argument("--seqlen", type=int, default=None, help="default 4096 (torch) or 256 (numpy)")
    args = parser.parse_args(argv)
    framework = args.framework or available_framework()
    seqlen = args.seqlen or (4096 if framework == "torch" else 256)
    r = run(framework, seqlen=seqlen)
    print(f"{framework}: causal attention, seqlen {seqlen}, 16 query heads over 4 kv heads, head dim 128")
    print(f"  fp8=True, hadamard=True   relative RMS error vs bf16: {r['on_the_fly']:.2e}")
    print(f"  quantize_fp8 + attention_fp8 relative RMS error vs bf16: {r['cached']:.2e}")
    if "ms_fp8" in r:
        print(f"  bf16 kernel {r['ms_bf16']:.3f} ms, FP8 kernel {r['ms_fp8']:.3f} ms (pre-quantized inputs)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
