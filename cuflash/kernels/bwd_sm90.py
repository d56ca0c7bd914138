"""bwd_sm90: the Hopper backward (cuda_src/bwd_sm90.cu): a TMA producer and two wgmma consumer
warpgroups, for compute capability 9.0 (compiled for sm_90a). Up to head dim 128 each consumer owns
64 of a CTA's 128 keys; at 256 a CTA owns 64 keys and each consumer half the head dim of their dK,
dV and dQ (the kernel's "split head"). It shares bwd_sm80's preprocess (delta) and dQ conversion;
dense and varlen, causal, window, softcap, GQA. Deterministic gradients are bwd_sm80's (dispatch
falls back to it). Its float32 dQ buffer keeps each (batch, head)'s rows contiguous, so that a
tile's staged rows reach it in one bulk reduction (cp.reduce.async.bulk; DQ_BUFFERS)."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import tma
from . import CXX_TYPES, Family, ParamStruct, Variant, check_grid_yz, compiled_headdim, cxx_bool, fwd_sm90
from .bwd_sm80 import backward_steps, query_sequences, workspace
from .forward import (CU_SEQLENS, ELEMENT_BYTES, check_headdim, mask_and_softmax_fields, row_stride_fields,
                      token_stride_fields)
from .fwd_sm90 import SMEM_LIMIT, check_loadable

# Whole 128-byte swizzle rows; a consumer's dK and dV (64 keys: head dim / 2 registers each) fit up
# to 128, and at 256 with the head dim split between the consumers.
HEADDIMS = (64, 128, 256)
BLOCK_M = 64  # queries per tile: the kernel's kBlockM
# wgmma N extents beyond fwd_sm90's that the kernel instantiates (tools/gen_wgmma.py writes both):
# Sᵀ and dPᵀ of half a tile's queries with the split head.
WGMMA_N = (BLOCK_M // 2,)
THREADS = 384  # producer and two consumer warpgroups
# A tile's LSE and D values load by TMA in boxes that start on a 16-byte boundary (the hardware's
# rule for the innermost coordinate): up to 3 values before the tile's first.
ROWS_BOX = BLOCK_M + 4
ROWS_BOX_BYTES = math.ceil(ROWS_BOX * 4 / 128) * 128  # each box on a 128-byte boundary (TMA's rule)
# Q/dO slots in the ring, per compiled head dim.
STAGES = {64: 2, 128: 2, 256: 1}
# How dQ reaches the float32 buffer, per compiled head dim: staged in shared memory (1 or 2 buffers)
# for the producer's bulk reduction, one per tile, or (0) by the consumers' own two-float
# reductions. Measured on H100 (benchmarks/NOTES-bwd_sm90.md); at 256 the staging needs the second
# slot's room.
DQ_BUFFERS = {64: 1, 128: 1, 256: 1}


def split_head(headdim: int) -> bool:
    """The kernel's kSplitHead: the consumers split the head dim, not the keys (dK and dV of 64 keys
    do not fit a consumer's registers beyond 128)."""
    return headdim > 128


def block_n(headdim: int) -> int:
    """Keys per CTA (the kernel's kBlockN): 64 per consumer, or 64 shared by both with the split head."""
    return 64 if split_head(headdim) else 128


def dq_row_floats(headdim: int) -> int:
    """Floats per row of dQ's staging (the kernel's kDqRowBytes / 4): padded by 8 (4 with the split
    head, where 8 do not fit) so that a half-warp's stores spread over the banks."""
    return headdim + (4 if split_head(headdim) else 8)


_FIELDS = ([(f"{t}_map", (np.void, tma.MAP_BYTES)) for t in ("q", "k", "v", "do", "lse", "delta", "dk", "dv")]
           + [(name, np.uint64) for name in ("dq_accum", "dk", "dv", "cu_seqlens_q", "cu_seqlens_k")]
           + [(f"{t}_stride_{d}", np.int64) for t in ("dk", "dv") for d in ("s", "h")]
           + [(f"{t}_stride_{d}", np.int64) for t in ("lse", "delta") for d in ("b", "h")]
           + [("dq_accum_stride_b", np.int64), ("dq_accum_stride_h", np.int64)]
           + [(name, np.int32) for name in ("dq_accum_stride_s", "seqlen_q", "seqlen_k", "group", "headdim",
                                            "window_left", "window_right")]
           + [(name, np.float32) for name in ("scale", "scale_log2", "softcap_exp2_scale", "softcap")])
# The kernel's BwdSm90Params, field for field (its size padded to the maps' 64-byte alignment).
BWD_SM90_PARAMS = np.dtype({"names": [n for n, _ in _FIELDS], "formats": [f for _, f in _FIELDS], "itemsize": 1216})
assert BWD_SM90_PARAMS.fields["softcap"][1] == 1184, "keep in step with BwdSm90Params"
PARAMS = ParamStruct(BWD_SM90_PARAMS)


def smem_bytes(headdim: int, stages: int, dq_buffers: int) -> int:
    """K and V (block_n rows), per stage Q, dO (BLOCK_M rows) and their LSE and D (ROWS_BOX_BYTES
    each), two tiles' dSᵀ (block_n x BLOCK_M; with the split head Pᵀ as well), dQ's float32 staging
    rows (dq_row_floats) per buffer, the mbarriers; + 1 KiB to round the base up to 1024 bytes."""
    row, keys = headdim * ELEMENT_BYTES, block_n(headdim)
    tile_buffers = 2 if split_head(headdim) else 1
    return (2 * keys * row + stages * (2 * BLOCK_M * row + 2 * ROWS_BOX_BYTES)
            + 2 * tile_buffers * keys * BLOCK_M * ELEMENT_BYTES
            + dq_buffers * BLOCK_M * dq_row_floats(headdim) * 4 + 8 * (1 + 2 * stages + 2 * dq_buffers) + 1024)


@dataclass(frozen=True)
class BwdSm90Variant(Variant):
    family = "bwd_sm90"
    source = "bwd_sm90.cu"
    template = "cuflash::bwd_sm90"

    dtype: str
    headdim: int  # compiled (padded) head dim
    stages: int
    dq_buffers: int  # DQ_BUFFERS
    varlen: bool
    softcap: bool

    def check(self) -> None:
        if self.dtype not in CXX_TYPES:
            raise ValueError(f"bwd_sm90: dtype {self.dtype} is not one of {sorted(CXX_TYPES)}")
        if self.headdim not in HEADDIMS:
            raise ValueError(f"bwd_sm90: headdim {self.headdim} is not one of {HEADDIMS}")
        if self.stages < 1 or self.dq_buffers not in (0, 1, 2) or self.dynamic_shared_bytes > SMEM_LIMIT:
            raise ValueError(f"bwd_sm90: stages={self.stages} (at least 1) and dq_buffers={self.dq_buffers} (0, 1 "
                             f"or 2) must fit {SMEM_LIMIT} bytes of shared memory (need {self.dynamic_shared_bytes})")

    @property
    def threads(self) -> int:
        return THREADS

    @property
    def dynamic_shared_bytes(self) -> int:
        return smem_bytes(self.headdim, self.stages, self.dq_buffers)

    def template_args(self) -> tuple[str, ...]:
        return (CXX_TYPES[self.dtype], str(self.headdim), str(self.stages), str(self.dq_buffers),
                cxx_bool(self.varlen), cxx_bool(self.softcap))


def variants_for(compute_capability: tuple[int, int]) -> tuple[BwdSm90Variant, ...]:
    return tuple(BwdSm90Variant(dtype, hd, STAGES[hd], DQ_BUFFERS[hd], varlen, softcap) for dtype in sorted(CXX_TYPES)
                 for hd in HEADDIMS for varlen in (False, True) for softcap in (False, True))


def select(problem, inputs) -> BwdSm90Variant:
    if problem.deterministic:
        raise ValueError("bwd_sm90 adds dQ in no fixed order: deterministic=True runs on bwd_sm80")
    check_headdim("bwd_sm90", problem.headdim, HEADDIMS[-1])
    check_loadable("bwd_sm90", problem, inputs, ("q", "k", "v", "dout"))
    lse = inputs["lse"]
    # the rank-1 maps index lse, and delta (laid out like lse, contiguous), by b * stride_b + h * stride_h + row
    # in int32 from the array's start
    if (lse.strides[-1] != 1 or any(s < 0 for s in lse.strides) or lse.ptr % tma.STRIDE_ALIGN_BYTES
            or max(_rows_extent(lse), math.prod(lse.shape)) >= 2**31):
        raise ValueError(f"bwd_sm90 loads lse with TMA as one row of fewer than 2^31 floats: it needs unit stride "
                         f"along the queries, no negative strides and a 16-byte aligned start; got strides "
                         f"{lse.strides} at {lse.ptr:#x}")
    check_grid_yz("bwd_sm90", problem.nheads_kv, problem.batch)
    headdim = compiled_headdim(problem.headdim, HEADDIMS)
    return BwdSm90Variant(problem.dtype, headdim, STAGES[headdim], DQ_BUFFERS[headdim], problem.varlen,
                          problem.softcap > 0)


def accumulator_strides(problem) -> tuple[int, int, int]:
    """(batch, row, head) strides in floats of this family's layout of the dQ buffer (bwd_sm80's
    workspace): every (batch, head)'s query rows contiguous, each of dq_row_floats (the staging's
    layout, so that a tile adds in one bulk reduction); varlen sequences are one batch of total_q
    rows."""
    row_floats = dq_row_floats(compiled_headdim(problem.headdim, HEADDIMS))
    _, seqlen = query_sequences(problem)
    return problem.nheads * seqlen * row_floats, row_floats, seqlen * row_floats


def accumulator_floats(problem) -> int:
    """The dQ buffer's floats in this family's layout: every batch's rows (varlen: one), and BLOCK_M
    spare rows for the last tile's rows past the end."""
    (batch, _), (stride_b, stride_s, _) = query_sequences(problem), accumulator_strides(problem)
    return batch * stride_b + BLOCK_M * stride_s


def _rows_extent(array) -> int:
    """Elements from the first of a per-query-row float32 array (lse, delta) to one past its last."""
    return 1 + sum((n - 1) * s for n, s in zip(array.shape, array.strides)) if math.prod(array.shape) else 0


def _rows_layout(array) -> tuple:
    """A rank-1 TMA map over `array`'s whole extent, boxes of one tile's rows (ROWS_BOX floats): what
    tma.encode_tiled takes after the address."""
    return (_rows_extent(array),), (), (ROWS_BOX,)


def prepare(variant: BwdSm90Variant, function, problem, inputs, outputs):
    """Family.prepare: the steps around the kernel (bwd_sm80.backward_steps), its grid, its tensor maps'
    layouts and its parameter struct without addresses, made once; each launch writes the addresses
    in and looks the maps up by address."""
    accum_strides = accumulator_strides(problem)  # dq_accum is contiguous (workspace)
    before, after = backward_steps(problem, inputs, outputs, accum_strides)
    if after is None:
        return before
    keys = block_n(variant.headdim)
    maps = [(f"{name}_map", name, fwd_sm90.map_layout(problem, inputs[name], heads, rows)) for name, heads, rows in
            (("q", problem.nheads, BLOCK_M), ("k", problem.nheads_kv, keys), ("v", problem.nheads_kv, keys))]
    maps.append(("do_map", "dout", fwd_sm90.map_layout(problem, inputs["dout"], problem.nheads, BLOCK_M)))
    # How the epilogue writes dK and dV: dense, by TMA (dk_map, dv_map); varlen, from the accumulators
    # at dk and dv through their token strides (a TMA box would spill into the next sequence's keys;
    # varlen's tokens are one batch, so no batch stride)
    if problem.varlen:
        output_maps, output_addresses = [], ("dk", "dv")
        output_strides = {name: stride for name, stride in
                          token_stride_fields(problem, dk=outputs["dk"], dv=outputs["dv"]).items() if not name.endswith("_b")}
    else:
        output_maps = [(f"{name}_map", name, fwd_sm90.map_layout(problem, outputs[name], problem.nheads_kv, keys))
                       for name in ("dk", "dv")]
        output_addresses, output_strides = (), {}
    lse_layout, delta_layout = _rows_layout(inputs["lse"]), _rows_layout(outputs["delta"])
    template = PARAMS.template(
        **dict(zip(("dq_accum_stride_b", "dq_accum_stride_s", "dq_accum_stride_h"), accum_strides)),
        seqlen_q=problem.seqlen_q, seqlen_k=problem.seqlen_k, group=problem.nheads // problem.nheads_kv,
        headdim=problem.headdim, scale=problem.softmax_scale, **mask_and_softmax_fields(problem),
        **output_strides,
        **row_stride_fields(problem, lse=inputs["lse"], delta=outputs["delta"]))
    grid = (math.ceil(problem.seqlen_k / keys), problem.nheads_kv, problem.batch)
    dtype = problem.dtype

    def launch_prepared(inputs, outputs, stream) -> None:
        before(inputs, outputs, stream)
        dq_accum, delta = outputs["dq_accum"], outputs["delta"]
        # TMA and the bulk reductions take 16-byte aligned workspace (every framework's allocator aligns more)
        assert dq_accum.ptr % 16 == 0 and delta.ptr % 16 == 0, "bwd_sm90's workspace is not 16-byte aligned"
        params = bytearray(template)
        fwd_sm90.write_tensor_maps(PARAMS, params, dtype, maps, inputs)
        fwd_sm90.write_tensor_maps(PARAMS, params, dtype, output_maps, outputs)
        PARAMS.write(params, "lse_map", tma.encode_tiled("float32", inputs["lse"].ptr, *lse_layout,
                                                         swizzle=tma.SWIZZLE_NONE))
        PARAMS.write(params, "delta_map", tma.encode_tiled("float32", delta.ptr, *delta_layout,
                                                           swizzle=tma.SWIZZLE_NONE))
        PARAMS.write_addresses(params, outputs, ("dq_accum",) + output_addresses)
        if problem.varlen:
            PARAMS.write_addresses(params, inputs, CU_SEQLENS)
        function(grid, (THREADS,), (PARAMS.argument(params),), shared_mem=variant.dynamic_shared_bytes, stream=stream)
        after(outputs, stream)

    return launch_prepared


FAMILY = Family(
    name="bwd_sm90",
    backend="sm90",
    ops=("attention_backward", "attention_varlen_backward"),
    description="Hopper backward: TMA producer, two wgmma consumer warpgroups (64 keys each, or half the "
                "head dim each at 256), dQ by one float32 bulk reduction a tile (sm_90a)",
    min_compute_capability=(9, 0),
    max_compute_capability=(9, 0),
    variants_for=variants_for,
    select=select,
    prepare=prepare,
    workspace=workspace,
    max_headdim=HEADDIMS[-1],
    deterministic=False,
)
