"""bwd_sm80: the FlashAttention-2 backward on mma.sync (cuda_src/bwd_sm80.cu), for every GPU of
compute capability 8.0 or newer: bwd_preprocess for delta, the main kernel (one CTA per key block
and kv head; dK, dV in registers, dQ added to a float32 buffer with atomics, in a fixed order when
deterministic), then dQ converted to the input dtype. Dense and varlen."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from .. import jit
from ..arrays import DeviceArray
from . import (CXX_TYPES, Family, ParamStruct, Variant, bwd_preprocess, check_grid_yz, compiled_headdim, cxx_bool,
               require_rows_aligned, rows_aligned)
from .forward import (CU_SEQLENS, ELEMENT_BYTES, check_headdim, mask_and_softmax_fields, row_stride_fields,
                      token_stride_fields, token_strides)
from .fwd_sm80 import SMEM_OPTIN, SMEM_OPTIN_DEFAULT

# Compiled head dims: another multiple of 8 runs on the next one up (its extra columns zero-filled
# on load, never stored). 200-256 all run on 256: 224's own kernel only fits the registers with
# 32 x 32 tiles, and 256's 64 x 64 one is faster even with the padding (H100: 0.60-0.71x FA2 for
# 224's own, ~0.8x for 224 on 256's counting 224's FLOPs).
HEADDIMS = (32, 64, 96, 128, 160, 192, 256)

# The tile table: per compiled head dim, (block_m, block_n, warps, stages) in order of preference;
# the first whose shared memory fits the GPU is used. Warps own 16 keys each; where there are more
# warps than 16-key groups, the warps of a group split Sᵀ's queries and then dK/dV's head dim (Pᵀ
# and dSᵀ pass through shared memory), which is what keeps the dK and dV accumulators of the large
# head dims in registers (kHeadDim / split of them per thread). stages = 2 loads the next Q and dO
# tiles while one computes. The offline report checks every row is spill-free on sm_80 and sm_90a.
# Measurements: benchmarks/NOTES-bwd_sm80.md.
TILES = {
    32: ((64, 128, 8, 2),),
    64: ((64, 128, 8, 2),),
    96: ((64, 128, 8, 2), (64, 64, 8, 2)),  # 128 keys: +20-24% on H100
    # 128 keys halve the dQ reductions per FLOP: +17-20% on H100 over 128 x 64 (the 177 KB fit
    # sm_90 only; with one stage it spills on sm_80)
    128: ((64, 128, 8, 2), (64, 64, 8, 2), (64, 64, 8, 1)),
    160: ((64, 64, 8, 2), (64, 64, 8, 1), (64, 32, 4, 1)),
    192: ((64, 64, 8, 2), (64, 64, 8, 1), (64, 32, 8, 1)),
    # 64 keys: +45-55% on H100 over 64 x 32; on sm_86 only 16-key blocks fit (32 x 32 x 4 spills)
    256: ((64, 64, 8, 2), (64, 64, 8, 1), (64, 16, 4, 1)),
}
# Set by benchmarks to time another row (dispatch remembers each choice): {headdim: (bm, bn, warps, stages)}.
tiles_override: dict[int, tuple[int, int, int, int]] | None = None

BWD_PARAMS = np.dtype(
    [(name, np.uint64) for name in ("q", "k", "v", "dout", "lse", "delta", "dq_accum", "dk", "dv", "cu_seqlens_q",
                                    "cu_seqlens_k", "dq_semaphore")]
    + [(f"{t}_stride_{d}", np.int64) for t in ("q", "k", "v", "do", "dk", "dv") for d in ("b", "s", "h")]
    + [(f"{t}_stride_{d}", np.int64) for t in ("lse", "delta") for d in ("b", "h")]
    + [(name, np.int32) for name in ("seqlen_q", "seqlen_k", "nheads", "group", "headdim", "window_left",
                                     "window_right")]
    + [(name, np.float32) for name in ("scale", "scale_log2", "softcap_exp2_scale", "softcap")],
    align=True)
assert BWD_PARAMS.itemsize == 320, "keep in step with static_assert(sizeof(BwdParams) == 320)"
PARAMS = ParamStruct(BWD_PARAMS)


@dataclass(frozen=True)
class BwdSm80Variant(Variant):
    family = "bwd_sm80"
    source = "bwd_sm80.cu"
    template = "cuflash::bwd_sm80"

    dtype: str
    headdim: int  # compiled (padded) head dim
    block_m: int
    block_n: int
    warps: int
    stages: int  # Q/dO buffers: 1, or 2 (the next tile loads while one computes)
    softcap: bool

    def check(self) -> None:
        if self.dtype not in CXX_TYPES:
            raise ValueError(f"bwd_sm80: dtype {self.dtype} is not one of {sorted(CXX_TYPES)}")
        if self.stages not in (1, 2):
            raise ValueError(f"bwd_sm80: stages={self.stages} must be 1 or 2")
        if self.headdim not in HEADDIMS:
            raise ValueError(f"bwd_sm80: headdim {self.headdim} is not one of {HEADDIMS}")
        groups = self.block_n // 16
        if self.block_n % 16 or self.warps % groups or self.block_m % (16 * self.split):
            raise ValueError(f"bwd_sm80: block_n={self.block_n} must be whole 16-key groups, one or more warps "
                             f"each ({self.warps} warps), splitting block_m={self.block_m} in 16s")
        if (self.headdim // 8) % (2 * self.split) or self.warps % (self.block_m // 16):
            raise ValueError(f"bwd_sm80: {self.warps} warps cannot split headdim {self.headdim} or "
                             f"block_m {self.block_m} evenly")

    @property
    def split(self) -> int:
        """Warps per 16 keys: they split Sᵀ's queries, then dK and dV's head dim."""
        return self.warps // (self.block_n // 16)

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def dynamic_shared_bytes(self) -> int:
        return smem_bytes(self.headdim, self.block_m, self.block_n, self.warps, self.stages)

    def template_args(self) -> tuple[str, ...]:
        return (CXX_TYPES[self.dtype], str(self.headdim), str(self.block_m), str(self.block_n), str(self.warps),
                str(self.stages), cxx_bool(self.softcap))


def smem_bytes(headdim: int, block_m: int, block_n: int, warps: int, stages: int) -> int:
    """K and V tiles, Q and dO tiles per stage (rows padded by 16 bytes); dSᵀ, and Pᵀ when the warps
    split the keys' work; lse and delta of a query block per stage."""
    split = warps // (block_n // 16)
    p_tiles = 1 if split == 1 and headdim // 8 < 12 else 2  # Pᵀ in registers (the kernel's kPInRegisters) or not
    return ((2 * block_n + 2 * stages * block_m) * (headdim + 8) + p_tiles * block_n * (block_m + 8)) \
        * ELEMENT_BYTES + 2 * stages * block_m * 4


@dataclass(frozen=True)
class BwdSm80DqVariant(Variant):
    """dq = the float32 dQ buffer in the input dtype (launched by bwd_sm80's launcher)."""

    family = "bwd_sm80"
    source = "bwd_sm80.cu"
    template = "cuflash::bwd_sm80_dq"

    dtype: str
    headdim: int

    THREADS = 256

    @property
    def lanes(self) -> int:
        """Threads per row (8 columns each): a power of two, so that they divide the block."""
        return 1 << (self.headdim // 8 - 1).bit_length()

    @property
    def rows_per_block(self) -> int:
        return self.THREADS // self.lanes

    def template_args(self) -> tuple[str, ...]:
        return (CXX_TYPES[self.dtype], str(self.headdim), str(self.lanes))


def _tiles(headdim: int, smem_limit: int) -> tuple[int, int, int, int]:
    if tiles_override and headdim in tiles_override:
        return tiles_override[headdim]
    for tiles in TILES[headdim]:
        if smem_bytes(headdim, *tiles) <= smem_limit:
            return tiles
    raise ValueError(f"bwd_sm80 has no tile for headdim {headdim} within {smem_limit} bytes of shared memory")


def variants_for(compute_capability: tuple[int, int]) -> tuple[Variant, ...]:
    limit = SMEM_OPTIN.get(tuple(compute_capability), SMEM_OPTIN_DEFAULT)
    return tuple(v for dtype in sorted(CXX_TYPES) for hd in HEADDIMS
                 for v in (BwdSm80Variant(dtype, hd, *_tiles(hd, limit), False),
                           BwdSm80Variant(dtype, hd, *_tiles(hd, limit), True), BwdSm80DqVariant(dtype, hd)))


def select(problem, inputs) -> BwdSm80Variant:
    check_headdim("bwd_sm80", problem.headdim, HEADDIMS[-1])
    require_rows_aligned("bwd_sm80", inputs, ("q", "k", "v", "dout"), ELEMENT_BYTES)
    check_grid_yz("bwd_sm80", problem.nheads_kv, problem.batch)
    headdim = compiled_headdim(problem.headdim, HEADDIMS)
    smem_limit = int(jit.device_properties(problem.device.index)["sharedMemPerBlockOptin"])
    tiles = _tiles(headdim, smem_limit)
    return BwdSm80Variant(problem.dtype, headdim, *tiles, problem.softcap > 0)


def query_sequences(problem) -> tuple[int, int]:
    """(batch, rows) of the queries as the dQ buffer and its conversion see them: varlen sequences
    are one batch of total_q rows."""
    return (1, problem.total_q) if problem.varlen else (problem.batch, problem.seqlen_q)


def _query_rows(problem) -> int:
    """Query rows over all sequences: the dQ accumulator's first dimension."""
    return math.prod(query_sequences(problem))


def dq_accum_spec(problem) -> tuple[tuple[int, ...], str]:
    """The float32 dQ buffer, which both backward families take (kernels.workspace keeps one buffer
    per name) and lay out each its own way (accumulator_strides here, bwd_sm90's there): as many
    floats as the larger layout needs, bwd_sm90's only where it may run (its GPU and backend, not
    deterministic)."""
    from . import bwd_sm90  # (which builds on this module)

    floats = _query_rows(problem) * problem.nheads * accumulator_headdim(problem)
    sm90 = bwd_sm90.FAMILY
    if (not problem.deterministic and problem.backend in (None, sm90.backend)
            and sm90.runs_on(jit.device_compute_capability(problem.device.index))):
        floats = max(floats, bwd_sm90.accumulator_floats(problem))
    return (floats,), "float32"


def workspace(problem) -> dict[str, tuple[tuple[int, ...], str]]:
    """Family.workspace of both backward families: delta (laid out like lse), the float32 dQ buffer
    (dq_accum_spec) and, when deterministic, the per-query-block semaphores (for 16-query blocks,
    the smallest)."""
    lse_shape = (problem.nheads, problem.total_q) if problem.varlen else (problem.batch, problem.nheads,
                                                                         problem.seqlen_q)
    buffers = dict(delta=(lse_shape, "float32"), dq_accum=dq_accum_spec(problem))
    if problem.deterministic:
        buffers["dq_semaphore"] = ((problem.batch, problem.nheads, math.ceil(problem.seqlen_q / 16)), "int32")
    return buffers


def _zero(stream, *arrays_: DeviceArray, itemsize: int) -> None:
    import cupy

    for x in arrays_:
        if math.prod(x.shape):
            cupy.cuda.runtime.memsetAsync(x.ptr, 0, math.prod(x.shape) * itemsize, stream.ptr)


def backward_steps(problem, inputs, outputs, accum_strides: tuple[int, int, int]):
    """The steps around a backward kernel (bwd_sm80's and bwd_sm90's), prepared for arrays laid out
    as these: (before, after). before(inputs, outputs, stream) zeroes the float32 dQ buffer (and the
    semaphores) and computes delta = rowsum(dout * out); after(outputs, stream) writes dq from the
    dQ buffer, whose (batch, row, head) strides in floats are accum_strides (after the main kernel).
    When there is nothing to compute, before zeroes the gradients (the outputs are contiguous) and
    after is None: the kernel must not run."""
    if _query_rows(problem) * problem.nheads == 0 or math.prod(outputs["dk"].shape) == 0:
        def nothing(inputs, outputs, stream) -> None:  # no query sees a key (or there are none)
            _zero(stream, outputs["dq"], outputs["dk"], outputs["dv"], itemsize=ELEMENT_BYTES)
        return nothing, None
    zeroed = ("dq_accum", "dq_semaphore") if problem.deterministic else ("dq_accum",)
    # The preprocess sees varlen rows as one sequence of total_q rows.
    pre_problem = problem if not problem.varlen else _as_one_sequence(problem)

    def pre_inputs(inputs):
        if not problem.varlen:
            return dict(out=inputs["out"], dout=inputs["dout"])
        return {n: DeviceArray(inputs[n].ptr, (1, *inputs[n].shape), (0, *inputs[n].strides)) for n in ("out", "dout")}

    pre_variant = bwd_preprocess.select(pre_problem, pre_inputs(inputs))
    preprocess = bwd_preprocess.prepare(pre_variant, jit.get_function(pre_variant, problem.device.index), pre_problem,
                                        pre_inputs(inputs), dict(delta=outputs["delta"]))

    def before(inputs, outputs, stream) -> None:
        _zero(stream, *(outputs[n] for n in zeroed), itemsize=4)
        preprocess(pre_inputs(inputs), dict(delta=outputs["delta"]), stream)

    return before, _convert_dq(problem, outputs, accum_strides)


def accumulator_headdim(problem) -> int:
    """The head dim of the dQ buffer's rows (workspace): this family's compiled head dim. bwd_sm90
    shares the buffer with its own compiled head dim, writing only the problem's columns."""
    return compiled_headdim(problem.headdim, HEADDIMS)


def accumulator_strides(problem) -> tuple[int, int, int]:
    """(batch, row, head) strides in floats of this family's dQ buffer (workspace); varlen sequences
    are one batch of total_q rows."""
    headdim, (_, seqlen) = accumulator_headdim(problem), query_sequences(problem)
    return seqlen * problem.nheads * headdim, problem.nheads * headdim, headdim


def _convert_dq(problem, outputs, accum_strides):
    """after(outputs, stream): dq = the float32 dQ buffer (strides accum_strides) in the input dtype
    (after the main kernel)."""
    # 16-byte stores: dq is dispatch's own allocation, contiguous, its head dim a multiple of 8.
    assert rows_aligned(outputs["dq"], ELEMENT_BYTES), outputs["dq"].strides
    variant = BwdSm80DqVariant(problem.dtype, accumulator_headdim(problem))
    function = jit.get_function(variant, problem.device.index)
    batch, seqlen = query_sequences(problem)
    check_grid_yz("bwd_sm80_dq", problem.nheads, batch)
    grid = (math.ceil(seqlen / variant.rows_per_block), problem.nheads, batch)
    sizes = (np.int32(seqlen), np.int32(problem.headdim), *(np.int64(s) for s in accum_strides),
             *(np.int64(s) for s in token_strides(problem, outputs["dq"])))

    def after(outputs, stream) -> None:
        function(grid, (variant.THREADS,), (np.uint64(outputs["dq_accum"].ptr), np.uint64(outputs["dq"].ptr), *sizes),
                 stream=stream)

    return after


def prepare(variant: BwdSm80Variant, function, problem, inputs, outputs):
    """Family.prepare: the steps around the kernel (backward_steps), its grid and its parameter struct
    without addresses, made once; each launch writes the addresses in."""
    before, after = backward_steps(problem, inputs, outputs, accumulator_strides(problem))
    if after is None:
        return before
    template = PARAMS.template(
        seqlen_q=problem.seqlen_q, seqlen_k=problem.seqlen_k, nheads=problem.nheads,
        group=problem.nheads // problem.nheads_kv, headdim=problem.headdim, scale=problem.softmax_scale,
        **mask_and_softmax_fields(problem), **row_stride_fields(problem, lse=inputs["lse"], delta=outputs["delta"]),
        **token_stride_fields(problem, q=inputs["q"], k=inputs["k"], v=inputs["v"], do=inputs["dout"],
                              dk=outputs["dk"], dv=outputs["dv"]))
    grid = (math.ceil(problem.seqlen_k / variant.block_n), problem.nheads_kv, problem.batch)
    ins = ("q", "k", "v", "dout", "lse", *(CU_SEQLENS if problem.varlen else ()))
    outs = ("delta", "dq_accum", "dk", "dv", *(("dq_semaphore",) if problem.deterministic else ()))

    def launch_prepared(inputs, outputs, stream) -> None:
        before(inputs, outputs, stream)
        if grid[0]:
            params = bytearray(template)
            PARAMS.write_addresses(params, inputs, ins)
            PARAMS.write_addresses(params, outputs, outs)  # contiguous, as workspace() declares them
            function(grid, (variant.threads,), (PARAMS.argument(params),), shared_mem=variant.dynamic_shared_bytes,
                     stream=stream)
        after(outputs, stream)

    return launch_prepared


def _as_one_sequence(problem):
    """A varlen problem's rows as one dense sequence (for the row-wise preprocess)."""
    return dataclasses.replace(problem, op="backward_preprocess", batch=1, seqlen_q=problem.total_q,
                               seqlen_k=problem.total_q, total_q=0, total_k=0)


FAMILY = Family(
    name="bwd_sm80",
    backend="sm80",
    ops=("attention_backward", "attention_varlen_backward"),
    description="FlashAttention-2 backward on mma.sync (sm_80+): dK/dV per key block, dQ by float32 atomics "
                "(ordered when deterministic)",
    min_compute_capability=(8, 0),
    variants_for=variants_for,
    select=select,
    prepare=prepare,
    workspace=workspace,
)
