"""Attention benchmark, forward or backward: cuflash against its peers, interleaved on one GPU.

FlashAttention-3 sizing: batch * seqlen = 16k tokens, nheads * headdim = 2048. Peers in the same
process, timed A B C A B C ... with CUDA events, median of many repetitions: torch SDPA's
FLASH_ATTENTION backend (FlashAttention-2 inside PyTorch) and its CUDNN_ATTENTION backend. JAX's
cuDNN attention runs in its own process (`--jax`), timed over back-to-back calls. Every row
records the SM clock, temperature and throttle reasons; a throttled row is marked.

  python benchmarks/bench_fwd.py --out DIR            # torch peers + cuflash -> DIR/fwd_torch.json
  python benchmarks/bench_fwd.py --out DIR --jax      # JAX cuDNN -> DIR/fwd_jax.json
  python benchmarks/bench_fwd.py --out DIR --backward # backward rows -> DIR/bwd_torch.json
  python benchmarks/report.py DIR                     # -> DIR/fwd.md (and DIR/bwd.md)

Backward rows time the backward alone (the forward's out and lse are inputs), FLOPs counted as
2.5x the forward's (five GEMMs against two), against torch SDPA's backward of the same backend.
"""
from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
import time
from pathlib import Path

TOKENS = 16384
HIDDEN = 2048
# Throttle reasons that make a timing unusable (nvidia-smi clocks_event_reasons bits): HW slowdown,
# SW thermal, HW thermal, HW power brake. Idle (0x1) and the SW power cap under load are normal.
BAD_THROTTLE = 0x8 | 0x20 | 0x40 | 0x80
MIN_SM_CLOCK_MHZ = 1200


def gpu_state() -> dict:
    fields = "name,clocks.sm,clocks.max.sm,temperature.gpu,clocks_event_reasons.active,driver_version"
    line = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                          capture_output=True, text=True, check=True).stdout.splitlines()[0]
    name, clock, max_clock, temp, reasons, driver = (x.strip() for x in line.split(","))
    reasons = int(reasons, 16)
    return dict(gpu=name, sm_clock_mhz=int(clock), max_sm_clock_mhz=int(max_clock), temperature_c=int(temp),
                throttle_reasons=hex(reasons), driver=driver,
                throttled=bool(reasons & BAD_THROTTLE) or int(clock) < MIN_SM_CLOCK_MHZ)


BACKWARD_FLOPS = 2.5  # per forward FLOP


def flops(batch, seqlen, nheads, headdim, causal, backward=False) -> float:
    f = 4.0 * batch * nheads * seqlen * seqlen * headdim * (BACKWARD_FLOPS if backward else 1.0)
    return f / 2 if causal else f


def configs(args):
    for dtype in args.dtypes:
        for headdim in args.headdims:
            for causal in args.causal:
                for seqlen in args.seqlens:
                    yield dtype, headdim, causal, seqlen, TOKENS // seqlen, HIDDEN // headdim


def host_overhead_us(torch, cuflash) -> float:
    """Microseconds of host time per cuflash.attention call on a tiny problem (launch-bound)."""
    q = torch.randn(1, 128, 1, 64, device="cuda", dtype=torch.bfloat16)
    for _ in range(10):
        cuflash.attention(q, q, q)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        cuflash.attention(q, q, q)
    torch.cuda.synchronize()
    return (time.perf_counter() - t0) / 200 * 1e6


def tiles_used(args, impl: str, headdim: int) -> str | None:
    """The overridden tile row this implementation ran with, if any."""
    table = args.sm90_tiles if impl == "cuflash" else args.tiles if impl == "cuflash-sm80" else None
    return str(table.get(headdim)) if table else None


def first_output(name: str, result, backward: bool):
    """out, or dq for the backward, as (batch, seqlen, heads, dim) (torch SDPA's are transposed)."""
    x = result[0] if backward else result
    return x if name.startswith("cuflash") else x.transpose(1, 2)


def run_torch(args) -> list[dict]:
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cuflash
    from cuflash.kernels import fwd_sm80, fwd_sm90

    if args.tiles:  # time other rows of the tile tables
        fwd_sm80.tiles_override = args.tiles
    if args.sm90_tiles:
        fwd_sm90.tiles_override = args.sm90_tiles
    fwd_sm90.persistent = args.sm90_grid == "sms"
    print(f"host time per cuflash.attention call (tiny problem): {host_overhead_us(torch, cuflash):.1f} us",
          flush=True)
    rows = []
    for dtype_name, headdim, causal, seqlen, batch, nheads in configs(args):
        dtype = getattr(torch, dtype_name)
        g = torch.Generator(device="cuda").manual_seed(seqlen * headdim)
        q, k, v = (torch.randn(batch, seqlen, nheads, headdim, device="cuda", dtype=dtype, generator=g)
                   for _ in range(3))
        qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # SDPA's (batch, heads, seq, dim) views

        def peer(backend):
            def call():
                with sdpa_kernel(backend):
                    return sdpa(qt, kt, vt, is_causal=causal)
            return call

        if args.backward:
            impls = backward_impls(q, k, v, causal, g)
        else:
            impls = {"cuflash": lambda: cuflash.attention(q, k, v, causal=causal),
                     "cuflash-sm80": lambda: cuflash.attention(q, k, v, causal=causal, backend="sm80"),
                     "torch-flash": peer(SDPBackend.FLASH_ATTENTION),
                     "torch-cudnn": peer(SDPBackend.CUDNN_ATTENTION)}
        errors, ref = {}, None
        for name, call in list(impls.items()):
            try:
                out = first_output(name, call(), args.backward)
                ref = out if ref is None else ref  # torch-flash's, or the first that ran
                errors[name] = out
            except (RuntimeError, NotImplementedError) as e:  # a peer that cannot run this configuration
                print(f"  {name} unavailable for {dtype_name} d={headdim} s={seqlen}: {str(e)[:120]}", flush=True)
                del impls[name]
        errors = {name: (out.float() - ref.float()).abs().max().item() for name, out in errors.items()}
        for _ in range(args.warmup):
            for call in impls.values():
                call()
        # Interleaved A B C A B C ..., events around each call and no synchronisation until the end:
        # host work overlaps the GPU as it would in a training step, and an implementation whose
        # host overhead exceeds its kernel time still shows it.
        events = {name: [] for name in impls}
        torch.cuda.synchronize()
        for _ in range(args.reps):
            for name, call in impls.items():
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                call()
                end.record()
                events[name].append((start, end))
        torch.cuda.synchronize()
        times = {name: [s.elapsed_time(e) for s, e in pairs] for name, pairs in events.items()}
        state = gpu_state()
        f = flops(batch, seqlen, nheads, headdim, causal, args.backward)
        for name, ts in times.items():
            ms = statistics.median(ts)
            spread = (statistics.quantiles(ts, n=10)[-1] - statistics.quantiles(ts, n=10)[0]) / ms
            rows.append(dict(impl=name, dtype=dtype_name, headdim=headdim, causal=causal, seqlen=seqlen, batch=batch,
                             nheads=nheads, ms=ms, tflops=f / ms / 1e9, spread_p10_p90=spread,
                             tiles=tiles_used(args, name, headdim),
                             max_abs_diff_vs_torch_flash=errors[name], backward=args.backward, **state))
        line = "  ".join(f"{r['impl']} {r['tflops']:6.1f}" for r in rows[-len(times):])
        print(f"{dtype_name} d={headdim:3d} causal={int(causal)} s={seqlen:5d}: {line}  "
              f"[{state['sm_clock_mhz']} MHz {state['temperature_c']} C{' THROTTLED' if state['throttled'] else ''}]",
              flush=True)
    return rows


def backward_impls(q, k, v, causal, g) -> dict:
    """The backward of each implementation, its forward done once up front (torch-flash first: the
    reference of the error column)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    import cuflash

    dout = torch.randn(q.shape, device="cuda", dtype=q.dtype, generator=g)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    impls = {}
    for name, backend in (("torch-flash", SDPBackend.FLASH_ATTENTION), ("torch-cudnn", SDPBackend.CUDNN_ATTENTION)):
        leaves = [x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v)]  # SDPA's layout
        try:
            with sdpa_kernel(backend):
                ot = sdpa(*leaves, is_causal=causal)
        except RuntimeError as e:
            print(f"  {name} unavailable: {str(e)[:120]}", flush=True)
            continue
        impls[name] = (lambda ot=ot, leaves=leaves: torch.autograd.grad(ot, leaves, dout.transpose(1, 2),
                                                                         retain_graph=True))
    impls["cuflash"] = lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    impls["cuflash-deterministic"] = lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                                        deterministic=True)
    return impls


def run_jax(args) -> list[dict]:
    import jax
    import jax.numpy as jnp

    rows = []
    for dtype_name, headdim, causal, seqlen, batch, nheads in configs(args):
        dtype = getattr(jnp, dtype_name)
        keys = jax.random.split(jax.random.PRNGKey(seqlen * headdim), 3)
        q, k, v = (jax.random.normal(key, (batch, seqlen, nheads, headdim), dtype) for key in keys)
        f = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"))
        try:
            f(q, k, v).block_until_ready()
        except Exception as e:  # cuDNN may not support a configuration
            print(f"  jax-cudnn unavailable for {dtype_name} d={headdim} s={seqlen}: {str(e)[:120]}", flush=True)
            continue
        samples = []
        for _ in range(args.reps // 5):
            t0 = time.perf_counter()
            for _ in range(5):  # back-to-back: XLA queues them, so dispatch overlaps the previous call
                out = f(q, k, v)
            out.block_until_ready()
            samples.append((time.perf_counter() - t0) * 1e3 / 5)
        ms = statistics.median(samples)
        state = gpu_state()
        rows.append(dict(impl="jax-cudnn", dtype=dtype_name, headdim=headdim, causal=causal, seqlen=seqlen,
                         batch=batch, nheads=nheads, ms=ms,
                         tflops=flops(batch, seqlen, nheads, headdim, causal) / ms / 1e9, **state))
        print(f"{dtype_name} d={headdim:3d} causal={int(causal)} s={seqlen:5d}: jax-cudnn {rows[-1]['tflops']:6.1f}",
              flush=True)
    return rows


def versions() -> dict:
    from importlib import metadata

    found = {}
    for dist in ("torch", "jax", "jaxlib", "cupy-cuda12x", "cupy-cuda13x", "nvidia-cudnn-cu12", "nvidia-cudnn-cu13"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    try:
        import torch

        found["torch.backends.cudnn"] = torch.backends.cudnn.version()
    except Exception:
        pass
    return found


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--jax", action="store_true", help="run the JAX cuDNN peer (its own process)")
    parser.add_argument("--backward", action="store_true", help="time the backward pass (torch peers)")
    parser.add_argument("--dtypes", default="bfloat16", type=lambda s: s.split(","))
    parser.add_argument("--headdims", default="64,128,256", type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--seqlens", default="512,1024,2048,4096,8192,16384",
                        type=lambda s: [int(x) for x in s.split(",")])
    parser.add_argument("--causal", default="0,1", type=lambda s: [bool(int(x)) for x in s.split(",")])
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--tiles", default=None, help="fwd_sm80 tiles to time instead of the table's, "
                        "e.g. 128:128x64x4x1,64:128x128x4x2 (headdim:block_m x block_n x warps x stages)",
                        type=lambda s: {int(hd): tuple(int(x) for x in t.split("x"))
                                        for hd, t in (item.split(":") for item in s.split(","))})
    parser.add_argument("--sm90-tiles", default=None, help="fwd_sm90 tiles to time instead of the table's, "
                        "e.g. 64:3x128x2x1 (headdim:consumers x block_n x stages x pingpong)",
                        type=lambda s: {int(hd): tuple(int(x) for x in t.split("x")[:3]) + (bool(int(t.split("x")[3])),)
                                        for hd, t in (item.split(":") for item in s.split(","))})
    parser.add_argument("--sm90-grid", choices=("sms", "tiles"), default="sms",
                        help="fwd_sm90's grid: one CTA per SM (persistent, the default) or one per tile")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run_jax(args) if args.jax else run_torch(args)
    name = "fwd_jax.json" if args.jax else "bwd_torch.json" if args.backward else "fwd_torch.json"
    meta = dict(date=time.strftime("%Y-%m-%d"), versions=versions(), tokens=TOKENS, hidden=HIDDEN,
                reps=args.reps, command=" ".join(sys.argv))
    (args.out / name).write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
