"""The benchmark harness: cuflash against its peers, interleaved on one GPU.

FlashAttention-3 sizing: batch * seqlen = 16k tokens, nheads * headdim = 2048. The implementations
of one configuration are timed A B C A B C ... with CUDA events and no synchronisation until the
end (host work overlaps the GPU as in a training step, and an implementation whose host time
exceeds its kernel time still shows it); each gets the median of many repetitions. With graph
timing (`graph_calls`), each implementation's calls are captured in a CUDA graph and the graphs are
replayed A B C A B C ...: the host's time per call drops out, which settles rows of ~100 us whose
eager timing is host-bound. Long rows read lower in graphs under the SM's power cap (each
implementation then runs many calls back to back; benchmarks/NOTES-fp8.md, session 26), so graph
timing is for short rows. Peers in the
same process: torch SDPA's FLASH_ATTENTION backend (FlashAttention-2 inside PyTorch) and its
CUDNN_ATTENTION backend. JAX's cuDNN attention runs in its own process (JAX takes most of the GPU's
memory when it starts), timed over programs of back-to-back calls; so does cuDNN's FP8 forward,
which only JAX reaches (`run_jax(fp8=True)`). Every row records the SM clock, temperature
and throttle reasons; a throttled row is marked.

Backward rows time the backward alone (the forward's out and lse are inputs), FLOPs counted as
2.5x the forward's (five GEMMs against two), against torch SDPA's backward of the same backend.

Used by `python -m cuflash` (a quick set of sizes) and `benchmarks/bench_fwd.py` (the full grid and
tuning options). Without PyTorch, cuflash is timed alone on CuPy arrays.
"""
from __future__ import annotations

import functools
import itertools
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

TOKENS = 16384
HIDDEN = 2048
HEADDIMS = (64, 128, 256)
SEQLENS = (512, 1024, 2048, 4096, 8192, 16384)  # the full grid
QUICK_SEQLENS = (1024, 4096, 16384)  # what `python -m cuflash` measures
BACKWARD_FLOPS = 2.5  # per forward FLOP
# Throttle reasons that make a timing unusable (nvidia-smi clocks_event_reasons bits): HW slowdown,
# SW thermal, HW thermal, HW power brake. Idle (0x1) and the SW power cap under load are normal.
BAD_THROTTLE = 0x8 | 0x20 | 0x40 | 0x80
MIN_SM_CLOCK_MHZ = 1200


@dataclass(frozen=True)
class Config:
    dtype: str
    headdim: int
    causal: bool
    seqlen: int  # keys (and, but for decode rows, query rows) a sequence
    batch: int
    nheads: int
    seqlen_q: int | None = None  # decode rows: query rows a sequence (None: seqlen)
    nheads_kv: int | None = None  # decode rows: kv heads (None: nheads)

    @property
    def query_rows(self) -> int:
        return self.seqlen if self.seqlen_q is None else self.seqlen_q

    @property
    def kv_heads(self) -> int:
        return self.nheads if self.nheads_kv is None else self.nheads_kv

    def flops(self, backward: bool = False) -> float:
        """FlashAttention-3's count: a causal square problem counts half its pairs; a causal decode row
        counts the pairs its bottom-right mask leaves (each draft row sees the cache and the rows up to it)."""
        rows, keys = self.query_rows, self.seqlen
        if not self.causal or self.seqlen_q is None:
            pairs = rows * keys / (2 if self.causal else 1)
        elif rows <= keys:  # row i sees keys - rows + i + 1 keys
            pairs = rows * (keys - rows) + rows * (rows + 1) / 2
        else:  # the first rows - keys rows see none
            pairs = keys * (keys + 1) / 2
        return 4.0 * self.batch * self.nheads * pairs * self.headdim * (BACKWARD_FLOPS if backward else 1.0)

    def kv_bytes(self) -> int:
        """The bytes of K and V in the configuration's dtype: what a decode step must read."""
        return 2 * self.batch * self.seqlen * self.kv_heads * self.headdim * 2

    def label(self) -> str:
        if self.seqlen_q is not None:
            return (f"{self.dtype} d={self.headdim:3d} decode b={self.batch} q={self.seqlen_q} k={self.seqlen} "
                    f"heads={self.nheads}/{self.kv_heads}{' causal' if self.causal else ''}")
        return f"{self.dtype} d={self.headdim:3d} causal={int(self.causal)} s={self.seqlen:5d}"


def configs(dtypes, headdims, causal, seqlens) -> list[Config]:
    """The FA3-sized grid, in the order it is run (seqlen fastest)."""
    return [Config(dtype, headdim, c, seqlen, TOKENS // seqlen, HIDDEN // headdim)
            for dtype in dtypes for headdim in headdims for c in causal for seqlen in seqlens]


# Decode steps (an LLM's generation: a few query rows a sequence against a long key cache), as
# (batch, query rows, keys, query heads, kv heads, head dim): GQA at 4 and 8 query heads a kv head,
# MQA, MHA, batch 1 to 32, 2k to 64k keys. Non-causal: one query row sees every key either way
# (bottom-right aligned), and SDPA's is_causal aligns top-left.
DECODE_SHAPES = ((1, 1, 32768, 32, 8, 128), (8, 1, 8192, 32, 8, 128), (32, 1, 2048, 32, 8, 128),
                 (16, 1, 4096, 32, 4, 128), (1, 1, 8192, 64, 8, 128), (1, 1, 32768, 32, 32, 128),
                 (8, 1, 8192, 16, 16, 64), (2, 1, 16384, 16, 16, 256), (1, 4, 65536, 8, 1, 64),
                 (4, 16, 8192, 32, 32, 128))
# Speculative decoding's verification steps: a few draft rows, causal, aligned bottom-right (each sees
# the cache and the drafts up to itself), same fields. The peers take torch's causal_lower_right:
# FlashAttention-2 natively, cuDNN as a dense mask made each call (SDPA's cuDNN backend has only the
# top-left causal), so its time there is not its causal kernel's.
SPECULATIVE_SHAPES = ((1, 4, 32768, 32, 8, 128), (1, 4, 8192, 32, 8, 128), (8, 4, 8192, 32, 8, 128),
                      (1, 8, 32768, 32, 32, 128))


def decode_configs(dtypes) -> list[Config]:
    """DECODE_SHAPES, then SPECULATIVE_SHAPES (causal), in each dtype."""
    return [Config(dtype, headdim, causal, keys, batch, heads, seqlen_q=rows, nheads_kv=kv_heads)
            for dtype in dtypes for causal, shapes in ((False, DECODE_SHAPES), (True, SPECULATIVE_SHAPES))
            for batch, rows, keys, heads, kv_heads, headdim in shapes]


def gpu_state() -> dict:
    """SM clock, temperature, throttle reasons (nvidia-smi); `throttled` marks an unusable timing."""
    fields = "name,clocks.sm,clocks.max.sm,temperature.gpu,clocks_event_reasons.active,driver_version"
    try:
        line = subprocess.run(["nvidia-smi", f"--query-gpu={fields}", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, check=True).stdout.splitlines()[0]
    except (OSError, subprocess.CalledProcessError, IndexError):
        return dict(gpu=_gpu_name(), sm_clock_mhz=None, max_sm_clock_mhz=None, temperature_c=None,
                    throttle_reasons=None, driver=None, throttled=None)
    name, clock, max_clock, temp, reasons, driver = (x.strip() for x in line.split(","))
    reasons = int(reasons, 16)
    return dict(gpu=name, sm_clock_mhz=int(clock), max_sm_clock_mhz=int(max_clock), temperature_c=int(temp),
                throttle_reasons=hex(reasons), driver=driver,
                throttled=bool(reasons & BAD_THROTTLE) or int(clock) < MIN_SM_CLOCK_MHZ)


def _gpu_name() -> str:
    from . import jit

    return jit.device_properties(0)["name"].decode()


def versions() -> dict:
    from importlib import metadata

    from . import __version__

    found = {"cuflash": __version__}
    for dist in ("torch", "jax", "jaxlib", "cupy-cuda12x", "cupy-cuda13x", "nvidia-cudnn-cu12", "nvidia-cudnn-cu13"):
        try:
            found[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            pass
    if "torch" in sys.modules:
        found["torch.backends.cudnn"] = sys.modules["torch"].backends.cudnn.version()
    return found


def progress(items, desc: str):
    """`items` with a progress bar (tqdm) where tqdm is installed, else as they are."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(f"{desc} ({len(items)})", flush=True)
        return items
    return tqdm(items, desc=desc, unit="config", dynamic_ncols=True)


def say(message: str) -> None:
    """Print a line without breaking a progress bar."""
    try:
        from tqdm import tqdm
    except ImportError:
        print(message, flush=True)
        return
    tqdm.write(message)


class _Torch:
    """Arrays and timing through PyTorch (peers: torch SDPA's flash and cuDNN backends)."""

    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch

    def randn(self, shape, dtype: str, generator):
        return self.torch.randn(shape, device="cuda", dtype=getattr(self.torch, dtype), generator=generator)

    def generator(self, seed: int):
        return self.torch.Generator(device="cuda").manual_seed(seed)

    def event(self):
        return self.torch.cuda.Event(enable_timing=True)

    def elapsed_ms(self, start, end) -> float:
        return start.elapsed_time(end)

    def synchronize(self):
        self.torch.cuda.synchronize()

    def l2_bytes(self) -> int:
        return self.torch.cuda.get_device_properties(self.torch.cuda.current_device()).L2_cache_size

    def graph(self, call, calls: int):
        """`calls` calls of `call` captured in one CUDA graph; returns what replays it."""
        graph = self.torch.cuda.CUDAGraph()
        with self.torch.cuda.graph(graph):
            for _ in range(calls):
                call()
        return graph.replay

    def max_abs_diff(self, a, b) -> float:
        return (a.float() - b.float()).abs().max().item()

    def peers(self, q, k, v, causal: bool, backward: bool, dout=None) -> dict:
        """torch SDPA's FlashAttention-2 and cuDNN backends, forward or backward (their outputs in
        cuflash's (batch, seqlen, heads, dim) layout). A backend that cannot run the configuration
        is left out with a message."""
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right
        from torch.nn.functional import scaled_dot_product_attention as sdpa

        impls = {}
        for name, backend in (("torch-flash", SDPBackend.FLASH_ATTENTION), ("torch-cudnn", SDPBackend.CUDNN_ATTENTION)):
            if backward:
                leaves = [x.transpose(1, 2).detach().requires_grad_() for x in (q, k, v)]  # SDPA's layout
                try:
                    with sdpa_kernel(backend):
                        ot = sdpa(*leaves, is_causal=causal, enable_gqa=q.shape[2] != k.shape[2])
                except RuntimeError as e:
                    say(f"  {name} unavailable: {str(e)[:120]}")
                    continue
                impls[name] = (lambda ot=ot, leaves=leaves: tuple(
                    g.transpose(1, 2) for g in self.torch.autograd.grad(ot, leaves, dout.transpose(1, 2),
                                                                          retain_graph=True)))
            else:
                qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))
                # SDPA's is_causal aligns top-left; cuflash's causal bottom-right, which
                # causal_lower_right gives where the rows are fewer than the keys (FlashAttention-2
                # runs it natively; cuDNN's backend takes it as a dense mask, as SDPA passes it)
                mask = dict(is_causal=causal) if not causal or q.shape[1] == k.shape[1] else dict(
                    attn_mask=causal_lower_right(q.shape[1], k.shape[1]))

                def call(backend=backend):
                    with sdpa_kernel(backend):
                        return sdpa(qt, kt, vt, **mask, enable_gqa=qt.shape[1] != kt.shape[1]).transpose(1, 2)
                impls[name] = call
        return impls


class _CuPy:
    """Arrays and timing through CuPy: cuflash alone (no peer runs on CuPy arrays)."""

    name = "cupy"

    def __init__(self):
        import cupy

        self.cupy = cupy

    def randn(self, shape, dtype: str, generator):
        import numpy as np

        from .arrays import numpy_dtype

        # On the host: CuPy's own generators do not produce bfloat16.
        x = generator.standard_normal(shape, dtype=np.float32)
        return self.cupy.asarray(x.astype(numpy_dtype(dtype)))

    def generator(self, seed: int):
        import numpy as np

        return np.random.default_rng(seed)

    def event(self):
        return self.cupy.cuda.Event()

    def elapsed_ms(self, start, end) -> float:
        return self.cupy.cuda.get_elapsed_time(start, end)

    def synchronize(self):
        self.cupy.cuda.Device().synchronize()

    def l2_bytes(self) -> int:
        return self.cupy.cuda.Device().attributes["L2CacheSize"]

    def max_abs_diff(self, a, b) -> float:
        return float(abs(a.astype(self.cupy.float32) - b.astype(self.cupy.float32)).max())

    def peers(self, q, k, v, causal: bool, backward: bool, dout=None) -> dict:
        return {}


def array_backend():
    """PyTorch when it has CUDA (so its peers run), else CuPy."""
    try:
        import torch

        if torch.cuda.is_available():
            return _Torch()
    except ImportError:
        pass
    return _CuPy()


def host_overhead_us(xp) -> float:
    """Microseconds of host time per cuflash.attention call on a tiny problem (launch-bound)."""
    import cuflash

    q = xp.randn((1, 128, 1, 64), "bfloat16", xp.generator(0))
    for _ in range(10):
        cuflash.attention(q, q, q)
    xp.synchronize()
    t0 = time.perf_counter()
    for _ in range(200):
        cuflash.attention(q, q, q)
    xp.synchronize()
    return (time.perf_counter() - t0) / 200 * 1e6


# A decode row's calls cycle through copies of its inputs, so many that the K and V of the other
# copies (read between two calls on one copy) come to EVICT_L2_TIMES the GPU's L2: each call then
# reads its K and V from memory, as a serving step reads a layer's cache after every other layer's
# has gone through the L2 since. With one copy, a step whose K and V fit in the L2 (H100: 50 MB)
# reads them from there on every call but the first (batch 1 with 8k keys at head dim 128, 33.5 MB:
# cuDNN's kernel 8.9 us, 3.8 TB/s, above what the HBM gives; benchmarks/NOTES-sm90.md, session 38).
EVICT_L2_TIMES = 2


def input_copies(config: Config, l2_bytes: int, element_bytes: int = 2) -> int:
    """Copies of the inputs `config`'s calls cycle through: one but for decode rows, counted for the
    smallest K and V an implementation reads (element_bytes: 1 where e4m3 ones are timed)."""
    if config.seqlen_q is None:
        return 1
    return 1 + -(-EVICT_L2_TIMES * l2_bytes // (config.kv_bytes() // 2 * element_bytes))


def _cycling(calls: list):
    """One call that makes the next of `calls` in turn (the first first)."""
    turn = itertools.cycle(calls)
    return lambda: next(turn)()


def implementations(xp, config: Config, backward: bool, extra=(), copies: int = 1) -> dict:
    """name -> call for one configuration: the peers first (torch-flash is the error column's
    reference), then cuflash and `extra` cuflash variants: "sm80" (the portable forward forced),
    "fp8" (attention_fp8 on inputs quantized beforehand, one scale per head as FlashAttention-3
    times it, and one per 128-row block; per head again returning the LSE, whose kernel sums P's
    rows in fp32 and takes every exponential on the special-function unit; per head with
    fast_exp=True, P's codes without exponentials; and attention(fp8=True, hadamard=True), which
    quantizes q, k and v each call: FP8 end to end; torch arrays only) and
    "deterministic" (the backward with deterministic=True). With `copies` > 1 each call cycles
    through that many sets of inputs (input_copies), every implementation starting on the first."""
    g = xp.generator(config.seqlen * config.headdim)
    sets = [_implementations_on(xp, config, backward, extra, g) for _ in range(copies)]
    return {name: (_cycling([s[name] for s in sets]) if copies > 1 else call) for name, call in sets[0].items()
            if all(name in s for s in sets)}


def _implementations_on(xp, config: Config, backward: bool, extra, g) -> dict:
    """implementations' calls on one set of inputs drawn from generator `g`."""
    import cuflash

    shape = (config.batch, config.query_rows, config.nheads, config.headdim)
    q = xp.randn(shape, config.dtype, g)
    k, v = (xp.randn((config.batch, config.seqlen, config.kv_heads, config.headdim), config.dtype, g) for _ in range(2))
    causal = config.causal
    if not backward:
        impls = xp.peers(q, k, v, causal, backward=False)
        impls["cuflash"] = lambda: cuflash.attention(q, k, v, causal=causal)
        if "sm80" in extra:
            impls["cuflash-sm80"] = lambda: cuflash.attention(q, k, v, causal=causal, backend="sm80")
        if "fp8" in extra:
            quantized = {block: [cuflash.quantize_fp8(x, block=block) for x in (q, k, v)] for block in (None, 128)}
            for name, block, with_lse, fast_exp in (("cuflash-fp8", None, False, False),
                                                    ("cuflash-fp8-block", 128, False, False),
                                                    ("cuflash-fp8-lse", None, True, False),
                                                    ("cuflash-fp8-fastexp", None, False, True)):
                impls[name] = functools.partial(_attention_fp8_out, quantized[block], causal, config.dtype, with_lse,
                                                fast_exp)
            impls["cuflash-fp8-e2e"] = lambda: cuflash.attention(q, k, v, causal=causal, fp8=True, hadamard=True)
        return impls
    dout = xp.randn(shape, config.dtype, g)
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    impls = xp.peers(q, k, v, causal, backward=True, dout=dout)
    impls["cuflash"] = lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal)
    if "sm80" in extra:
        impls["cuflash-sm80"] = lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                                   backend="sm80")
    if "deterministic" in extra:
        impls["cuflash-deterministic"] = lambda: cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal,
                                                                            deterministic=True)
    return impls


def _attention_fp8_out(quantized, causal: bool, out_dtype: str, with_lse: bool, fast_exp: bool):
    """attention_fp8 on quantize_fp8's (x8, descale) pairs of q, k and v: its out (for the error
    column; with_lse: the LSE written beside it, then dropped)."""
    import cuflash

    (q8, qd), (k8, kd), (v8, vd) = quantized
    result = cuflash.attention_fp8(q8, k8, v8, qd, kd, vd, causal=causal, out_dtype=out_dtype, return_lse=with_lse,
                                   fast_exp=fast_exp)
    return result[0] if with_lse else result


def time_interleaved(xp, impls: dict, reps: int, warmup: int, calls_per_timing: int = 1) -> dict[str, list[float]]:
    """Milliseconds of one call of each implementation, A B C A B C ..., one synchronisation at the end;
    each entry of `impls` makes `calls_per_timing` calls (a graph replay makes many)."""
    for _ in range(warmup):
        for call in impls.values():
            call()
    events = {name: [] for name in impls}
    xp.synchronize()
    for _ in range(reps):
        for name, call in impls.items():
            start, end = xp.event(), xp.event()
            start.record()
            call()
            end.record()
            events[name].append((start, end))
    xp.synchronize()
    return {name: [xp.elapsed_ms(s, e) / calls_per_timing for s, e in pairs] for name, pairs in events.items()}


def time_graphs(xp, impls: dict, reps: int, warmup: int, calls: int) -> dict[str, list[float]]:
    """As time_interleaved, with each implementation's `calls` calls captured in one CUDA graph and each
    repetition one replay (PyTorch only: torch.cuda.graph). A peer whose calls cannot be captured is
    left out with a message."""
    if xp.name != "torch":
        raise NotImplementedError("graph timing is built on torch.cuda.graph: it needs PyTorch with CUDA")
    replays = {}
    for name, call in impls.items():
        try:
            replays[name] = xp.graph(call, calls)
        except RuntimeError as e:
            if name.startswith("cuflash"):
                raise  # cuflash's launches must capture
            say(f"  {name} cannot be captured in a CUDA graph: {str(e)[:120]}")
    return time_interleaved(xp, replays, reps, warmup, calls_per_timing=calls)


def run(grid: list[Config], *, backward=False, reps=30, warmup=5, extra=(), xp=None, annotate=None,
        graph_calls=0) -> list[dict]:
    """Time cuflash and the peers on every configuration of `grid`; one row per implementation.
    `annotate(impl, config)` may add fields to a row (e.g. the tile row a tuning run forced);
    `graph_calls` > 0 times CUDA graphs of that many calls (time_graphs) instead of eager calls."""
    xp = xp or array_backend()
    rows = []
    for config in progress(grid, "backward" if backward else "forward"):
        copies = input_copies(config, xp.l2_bytes(), 1 if "fp8" in extra else 2)
        impls = implementations(xp, config, backward, extra, copies)
        outputs = {}
        for name, call in list(impls.items()):
            try:
                result = call()
                for _ in range(copies - 1):  # each copy once before a graph captures it (cuDNN plans per
                    call()  # address), and back to the first
            except (RuntimeError, NotImplementedError) as e:  # a peer that cannot run this configuration
                if name.startswith("cuflash"):
                    raise  # cuflash's own failure is an error, not a missing peer
                say(f"  {name} unavailable for {config.label()}: {str(e)[:120]}")
                del impls[name]
                continue
            outputs[name] = result[0] if backward else result  # out, or dq
        ref = next(iter(outputs.values()))
        errors = {name: xp.max_abs_diff(out, ref) for name, out in outputs.items()}
        times = (time_graphs(xp, impls, reps, warmup, graph_calls) if graph_calls
                 else time_interleaved(xp, impls, reps, warmup))
        state = gpu_state()
        for name, ts in times.items():
            ms = statistics.median(ts)
            deciles = statistics.quantiles(ts, n=10)
            rows.append(dict(impl=name, **asdict(config), ms=ms, tflops=config.flops(backward) / ms / 1e9,
                             spread_p10_p90=(deciles[-1] - deciles[0]) / ms, backward=backward,
                             max_abs_diff_vs_first=errors[name], graph_calls=graph_calls, input_copies=copies,
                             **(annotate(name, config) if annotate else {}),
                             **state))
        line = "  ".join(f"{r['impl']} {r['tflops']:6.1f}" for r in rows[-len(times):])
        clock = f"{state['sm_clock_mhz']} MHz {state['temperature_c']} C" if state["sm_clock_mhz"] else "clock unknown"
        say(f"{config.label()}: {line}  [{clock}{' THROTTLED' if state['throttled'] else ''}]")
    return rows


def _jax_cudnn_bf16(qs, k, v, causal: bool):
    """JAX's cuDNN attention (`jax.nn.dot_product_attention(implementation="cudnn")`): (call, one
    argument tuple per q)."""
    import jax

    call = jax.jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=causal, implementation="cudnn"))
    return call, [(q, k, v) for q in qs]


def _jax_cudnn_fp8(qs, k, v, causal: bool):
    """cuDNN's FP8 forward through JAX (`use_fp8=True` of jax._src.cudnn.fused_attention_stablehlo's
    dot_product_attention: JAX has no public entry to it, so a JAX release may move it; then this
    raises NotImplementedError): q, k and v rounded to e4m3 with one scale per tensor (amax / 448;
    cuDNN takes per-tensor descales), P scaled by 2^8 before its rounding to e4m3 (as cuflash's
    kernel does), out in e4m3 with unit scale (cuDNN's FP8 forward writes e4m3 and the amaxes of P
    and O; cuflash writes bf16). (call, one argument tuple per q; k and v rounded once)."""
    import jax
    import jax.numpy as jnp

    try:
        from jax._src.cudnn import fused_attention_stablehlo as cudnn

        fp8_params_keys, mask_types, sdpa = cudnn.fp8_params_keys, cudnn.MaskType, cudnn.dot_product_attention
    except (ImportError, AttributeError) as e:
        raise NotImplementedError(f"this JAX ({jax.__version__}) has no cuDNN FP8 entry where cuflash looks: {e}")

    def quantized(x):
        descale = jnp.max(jnp.abs(x.astype(jnp.float32))) / 448.0
        return (x.astype(jnp.float32) / descale).astype(jnp.float8_e4m3fn), descale.reshape(1, 1, 1, 1)

    (k8, k_descale), (v8, v_descale) = quantized(k), quantized(v)
    one = jnp.ones((1, 1, 1, 1), jnp.float32)
    mask = mask_types.CAUSAL if causal else mask_types.NO_MASK
    scale = k.shape[-1] ** -0.5
    call = jax.jit(lambda q8, k8, v8, params: sdpa(q8, k8, v8, fp8_params=params, scale=scale, mask_type=mask,
                                                   qkv_layout="BTNH", use_fp8=True)[0])
    arg_tuples = []
    for q in qs:
        q8, q_descale = quantized(q)
        params = dict.fromkeys(fp8_params_keys, one)  # the backward's scales: unused by the forward
        params.update(descale_q=q_descale, descale_k=k_descale, descale_v=v_descale, scale_s=one * 2.0**8,
                      descale_s=one * 2.0**-8, scale_o=one)
        arg_tuples.append((q8, k8, v8, params))
    return call, arg_tuples


JAX_CALLS = 5  # calls of a JAX peer per timed XLA program (_jax_repeated)


def _jax_repeated(call):
    """One jitted program that makes a call of `call` on each argument tuple it is given, back to back
    on the GPU with no host work between them, so that JAX's dispatch of each call drops out of the
    timing (cuDNN's bf16 forward at head dim 128 causal 512, H100: 202 TFLOPs timed call by call, 226
    in programs of 5; 328 through torch). run_jax gives each call a q of its own, so that no call
    finds its q in L2 from the call before (an FA3-sized q in e4m3 is 32 MB, H100's L2 50 MB)."""
    import jax

    return jax.jit(lambda arg_tuples: [call(*args) for args in arg_tuples])


def run_jax(grid: list[Config], reps: int = 30, fp8: bool = False) -> list[dict]:
    """JAX's cuDNN attention (jax-cudnn, _jax_cudnn_bf16), forward, in this process: call it in a
    process of its own (run_jax_process). With fp8, cuDNN's FP8 forward beside it (jax-cudnn-fp8,
    _jax_cudnn_fp8), the two timed in turn, each timing one program of JAX_CALLS calls
    (_jax_repeated). A peer that cannot run a configuration (cuDNN's refusal, an XLA error) is left
    out with a message; each row's max_abs_diff_vs_first is against the first peer's out (jax-cudnn's
    where it ran)."""
    import jax
    import jax.numpy as jnp

    rows = []
    for config in grid:
        keys = jax.random.split(jax.random.PRNGKey(config.seqlen * config.headdim), JAX_CALLS + 2)
        shape = (config.batch, config.seqlen, config.nheads, config.headdim)
        k, v, *qs = (jax.random.normal(key, shape, getattr(jnp, config.dtype)) for key in keys)
        makers = {"jax-cudnn": _jax_cudnn_bf16, **({"jax-cudnn-fp8": _jax_cudnn_fp8} if fp8 else {})}
        programs, outputs = {}, {}
        for name, make in makers.items():
            try:
                call, arg_tuples = make(qs, k, v, config.causal)
                program = _jax_repeated(call)
                # compiled and run once before the timing; its first call's out is the row's
                outputs[name] = program(arg_tuples)[0].astype(jnp.float32).block_until_ready()
                programs[name] = (program, arg_tuples)
            except (RuntimeError, NotImplementedError, ValueError) as e:  # cuDNN's refusals, XLA's errors
                print(f"  {name} unavailable for {config.label()}: {str(e)[:120]}", file=sys.stderr, flush=True)
        if not programs:
            continue
        samples = {name: [] for name in programs}
        for _ in range(max(reps // JAX_CALLS, 1)):
            for name, (program, arg_tuples) in programs.items():
                t0 = time.perf_counter()
                jax.block_until_ready(program(arg_tuples))
                samples[name].append((time.perf_counter() - t0) * 1e3 / JAX_CALLS)
        state = gpu_state()
        first = next(iter(outputs.values()))
        for name, ts in samples.items():
            ms = statistics.median(ts)
            rows.append(dict(impl=name, **asdict(config), ms=ms, tflops=config.flops() / ms / 1e9, backward=False,
                             max_abs_diff_vs_first=float(jnp.max(jnp.abs(outputs[name] - first))),
                             jax_calls=JAX_CALLS, **state))
            print(f"{config.label()}: {name} {rows[-1]['tflops']:6.1f}", file=sys.stderr, flush=True)
    return rows


def run_jax_process(grid: list[Config], reps: int = 30) -> tuple[list[dict], str | None]:
    """run_jax in a child process: (rows, None), or ([], why not) when JAX or its GPU backend is missing."""
    script = ("import json, sys; from cuflash import bench; "
              "grid = [bench.Config(**c) for c in json.loads(sys.argv[1])]; "
              "print(json.dumps(bench.run_jax(grid, int(sys.argv[2]))))")
    # This process's framework keeps its memory: JAX must not try to take 75% of the GPU up front.
    env = dict(os.environ, XLA_PYTHON_CLIENT_PREALLOCATE="false")
    probe = subprocess.run([sys.executable, "-c", "import jax; print(jax.default_backend())"],
                           capture_output=True, text=True, env=env)
    if probe.returncode != 0:
        last = (probe.stderr.strip().splitlines() or ["?"])[-1]
        return [], "JAX is not installed" if "ModuleNotFoundError" in last else f"JAX failed to start: {last}"
    if probe.stdout.strip() != "gpu":
        return [], f"JAX's backend here is {probe.stdout.strip()!r}, not gpu"
    # Its progress lines (stderr) show as they come; the rows come back on stdout.
    child = subprocess.run([sys.executable, "-c", script, json.dumps([asdict(c) for c in grid]), str(reps)],
                           stdout=subprocess.PIPE, text=True, env=env)
    if child.returncode != 0:
        return [], f"the JAX process failed with exit code {child.returncode} (its messages are above)"
    return json.loads(child.stdout.strip().splitlines()[-1]), None


def save(path, rows: list[dict], *, reps: int, command: str, graph_calls: int = 0) -> None:
    """Write a run's JSON (what cuflash.report reads): its rows and what they were measured with."""
    meta = dict(date=time.strftime("%Y-%m-%d"), versions=versions(), tokens=TOKENS, hidden=HIDDEN, reps=reps,
                graph_calls=graph_calls, command=command)
    path.write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
