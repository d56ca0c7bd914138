"""bwd_sm80: the FlashAttention-2 backward on mma.sync (cuda_src/bwd_sm80.cu), for every GPU of
compute capability 8.0 or newer: bwd_preprocess for delta, the main kernel (one CTA per key block
and kv head; dK, dV in registers, dQ added to a float32 buffer with atomics), then dQ converted to
the input dtype."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import jit
from ..arrays import DeviceArray
from . import CXX_TYPES, Family, Variant, bwd_preprocess, check_grid_yz, cxx_bool, require_rows_aligned
from .forward import ELEMENT_BYTES, kernel_window, softmax_constants

# dK, dV and dQ accumulators share the registers with Sᵀ and dPᵀ: head dims up to 64 fit without
# spilling (the offline report checks it); larger ones are not served yet. Exact head dims only:
# bwd_preprocess computes delta for its own list.
HEADDIMS = (32, 64)
BLOCK_M = 64
# Warps per CTA by head dim, 16 keys each (block_n = 16 * warps): 8 warps read each Q and dO tile
# for twice the keys (+12-18% at head dim 64 on H100) but at head dim 64 spill on sm_80 (24 bytes),
# so 64 keeps 4 for now. benchmarks/bwd_quick.py --warps overrides it to time the other choice.
# Measurements: benchmarks/NOTES-bwd_sm80.md.
WARPS = {32: 8, 64: 4}
warps_override: int | None = None

BWD_PARAMS = np.dtype(
    [(name, np.uint64) for name in ("q", "k", "v", "dout", "lse", "delta", "dq_accum", "dk", "dv")]
    + [(f"{t}_stride_{d}", np.int64) for t in ("q", "k", "v", "do", "dk", "dv") for d in ("b", "s", "h")]
    + [("lse_stride_b", np.int64), ("lse_stride_h", np.int64)]
    + [(name, np.int32) for name in ("seqlen_q", "seqlen_k", "nheads", "group", "headdim", "window_left",
                                     "window_right")]
    + [(name, np.float32) for name in ("scale", "scale_log2", "softcap_exp2_scale", "softcap")],
    align=True)
assert BWD_PARAMS.itemsize == 280, "keep in step with static_assert(sizeof(BwdParams) == 280)"
PARAMS_BYTES = np.dtype((np.void, BWD_PARAMS.itemsize))


@dataclass(frozen=True)
class BwdSm80Variant(Variant):
    family = "bwd_sm80"
    source = "bwd_sm80.cu"
    template = "cuflash::bwd_sm80"

    dtype: str
    headdim: int
    warps: int  # 4 or 8, 16 keys each
    softcap: bool

    def check(self) -> None:
        if self.dtype not in CXX_TYPES:
            raise ValueError(f"bwd_sm80: dtype {self.dtype} is not one of {sorted(CXX_TYPES)}")
        if self.headdim not in HEADDIMS:
            raise ValueError(f"bwd_sm80: headdim {self.headdim} is not one of {HEADDIMS}")
        if self.warps not in (4, 8):
            raise ValueError(f"bwd_sm80: warps={self.warps} must be 4 or 8")

    @property
    def block_n(self) -> int:
        return 16 * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def dynamic_shared_bytes(self) -> int:
        # K and V (block_n rows), Q and dO (64 rows), padded; dSᵀ; lse and delta of a query block
        rows = 2 * self.block_n + 2 * BLOCK_M
        return (rows * (self.headdim + 8) + self.block_n * (BLOCK_M + 8)) * ELEMENT_BYTES + 2 * BLOCK_M * 4

    def template_args(self) -> tuple[str, ...]:
        return (CXX_TYPES[self.dtype], str(self.headdim), str(self.warps), cxx_bool(self.softcap))


@dataclass(frozen=True)
class BwdSm80DqVariant(Variant):
    """dq = the float32 dQ buffer in the input dtype (launched by bwd_sm80's launcher)."""

    family = "bwd_sm80"
    source = "bwd_sm80.cu"
    template = "cuflash::bwd_sm80_dq"

    dtype: str
    headdim: int

    def template_args(self) -> tuple[str, ...]:
        return (CXX_TYPES[self.dtype], str(self.headdim))


def variants_for(compute_capability: tuple[int, int]) -> tuple[Variant, ...]:
    return tuple(v for dtype in sorted(CXX_TYPES) for hd in HEADDIMS
                 for v in (BwdSm80Variant(dtype, hd, WARPS[hd], False), BwdSm80Variant(dtype, hd, WARPS[hd], True),
                           BwdSm80DqVariant(dtype, hd)))


def select(problem, inputs) -> BwdSm80Variant:
    if problem.varlen:
        raise ValueError("bwd_sm80 does not take varlen problems yet")
    if problem.headdim not in HEADDIMS:
        raise ValueError(f"bwd_sm80 takes head dims {HEADDIMS} for now; got {problem.headdim}")
    require_rows_aligned("bwd_sm80", inputs, ("q", "k", "v", "dout"), ELEMENT_BYTES)
    check_grid_yz("bwd_sm80", problem.nheads_kv, problem.batch)
    return BwdSm80Variant(problem.dtype, problem.headdim, warps_override or WARPS[problem.headdim], problem.softcap > 0)


def launch(variant: BwdSm80Variant, function, problem, inputs, outputs, stream) -> None:
    import cupy

    if problem.batch * problem.nheads * problem.seqlen_q * problem.seqlen_k == 0:
        # no query sees a key (or there are none): zero gradients; the outputs are contiguous
        for x in (outputs["dq"], outputs["dk"], outputs["dv"]):
            if math.prod(x.shape):
                cupy.cuda.runtime.memsetAsync(x.ptr, 0, math.prod(x.shape) * ELEMENT_BYTES, stream.ptr)
        return
    device = problem.device.index
    q, k, v, dout, out, lse = (inputs[n] for n in ("q", "k", "v", "dout", "out", "lse"))
    dq, dk, dv = outputs["dq"], outputs["dk"], outputs["dv"]
    with stream:
        delta = cupy.empty((problem.batch, problem.nheads, problem.seqlen_q), np.float32)
        dq_accum = cupy.zeros((problem.batch, problem.seqlen_q, problem.nheads, variant.headdim), np.float32)
    pre_variant = bwd_preprocess.select(problem, dict(out=out, dout=dout))
    bwd_preprocess.launch(pre_variant, jit.get_function(pre_variant, device), problem, dict(out=out, dout=dout),
                          dict(delta=DeviceArray(delta.data.ptr, delta.shape, tuple(s // 4 for s in delta.strides))),
                          stream)
    scale_log2, softcap_exp2_scale, softcap = softmax_constants(problem)
    params = np.empty(1, BWD_PARAMS)
    params[0] = (q.ptr, k.ptr, v.ptr, dout.ptr, lse.ptr, delta.data.ptr, dq_accum.data.ptr, dk.ptr, dv.ptr,
                 *q.strides[:3], *k.strides[:3], *v.strides[:3], *dout.strides[:3], *dk.strides[:3],
                 *dv.strides[:3], *lse.strides[:2], problem.seqlen_q, problem.seqlen_k, problem.nheads,
                 problem.nheads // problem.nheads_kv, problem.headdim, *kernel_window(problem),
                 problem.softmax_scale, scale_log2, softcap_exp2_scale, softcap)
    grid = (math.ceil(problem.seqlen_k / variant.block_n), problem.nheads_kv, problem.batch)
    with stream:
        function(grid, (variant.threads,), (params.view(PARAMS_BYTES),), shared_mem=variant.dynamic_shared_bytes)
    dq_variant = BwdSm80DqVariant(problem.dtype, variant.headdim)
    rows = problem.batch * problem.seqlen_q * problem.nheads
    pairs = rows * (variant.headdim // 2)
    with stream:
        jit.get_function(dq_variant, device)((math.ceil(pairs / 256),), (256,), (
            np.uint64(dq_accum.data.ptr), np.uint64(dq.ptr), np.int32(rows), np.int32(problem.nheads),
            np.int32(problem.seqlen_q), np.int32(problem.headdim), *(np.int64(s) for s in dq.strides[:3])))


FAMILY = Family(
    name="bwd_sm80",
    backend="sm80",
    ops=("attention_backward",),
    description="FlashAttention-2 backward on mma.sync (sm_80+): dK/dV per key block, dQ by float32 atomics",
    min_compute_capability=(8, 0),
    variants_for=variants_for,
    select=select,
    launch=launch,
)
