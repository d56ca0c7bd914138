"""fwd_sm90: the warp-specialised Hopper forward (cuda_src/fwd_sm90.cu): TMA producer, two or three
wgmma consumer warpgroups, for compute capability 9.0 (compiled for sm_90a)."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .. import jit, tma
from . import CXX_TYPES, Family, Variant, cxx_bool, require_rows_aligned
from .forward import ELEMENT_BYTES, check_headdim, kernel_window, output_strides, softmax_constants

ROWS_PER_CONSUMER = 64  # query rows per consumer warpgroup (wgmma M)
ATOM = 64  # elements per 128-byte swizzle row: head dims are compiled in multiples of this
HEADDIMS = (64, 128, 192, 256)
# The wgmma N extents cuda_src/common/wgmma.cuh provides (tools/gen_wgmma.py generates exactly
# these): S = Q K^T has N = block_n, O += P V has N = the compiled head dim.
WGMMA_N = (64, 80, 112, 128, 176, 192, 256)

# Per compiled head dim, rows of (longest seqlen_k served, (consumers, block_n, stages, pingpong)):
# the first row whose bound covers the problem's seqlen_k is used (None: any). consumers: warpgroups
# of 64 query rows (block_m = 64 * consumers) with 240 registers each when 2, 160 when 3. block_n is
# bounded by those registers (O: headdim / 2, S: block_n / 2, P: block_n / 4 per thread; the
# offline report checks that nothing spills) and, with the stages, by 227 KiB of shared memory (Q
# and O: block_m rows, K and V: block_n rows per stage). Long sequences take the widest block_n that
# fits; up to 2k keys a narrower one wins (fewer masked columns, less pipeline fill per tile).
# pingpong: the consumers take turns issuing GEMMs. Measurements: benchmarks/NOTES-sm90.md.
TILES = {
    64: ((None, (3, 128, 2, False)),),
    128: ((2048, (2, 128, 2, True)), (None, (2, 176, 2, True))),
    192: ((None, (2, 112, 2, True)),),
    256: ((None, (2, 80, 2, False)),),
}
# Per compiled head dim, (unmasked, masked): whether each consumer warpgroup passes by the key
# blocks its own 64 rows do not see (above a causal or window diagonal, or all of them for rows past
# seqlen_q) instead of computing them masked. Measured on H100 (benchmarks/NOTES-sm90.md, version
# 11): +12 points of cuDNN's speed at head dim 64 causal 1k and +3-6 at 256 (masked or not, a
# scheduling effect), but -3 at 64 unmasked 2k-4k and -1 to -2 at 128; 192 unmeasured.
PASS_BY = {64: (False, True), 128: (False, False), 192: (False, False), 256: (True, True)}
# Softcap keeps more registers live per score: its own row per head dim (two consumers at 64, the
# narrow blocks at 128), where nothing spills.
SOFTCAP_TILES = {64: (2, 128, 3, True), 128: (2, 128, 2, True), 192: (2, 112, 2, True), 256: (2, 80, 2, False)}
# Set by benchmarks/bench_fwd.py --sm90-tiles before the first call, to time other table rows
# (dispatch remembers each choice); None in normal use.
tiles_override: dict[int, tuple[int, int, int, bool]] | None = None
# The grid: one CTA per SM, each taking tiles until none is left (True), or one CTA per tile, each
# taking one and leaving the rest to the hardware's block scheduler (False: benchmarks/bench_fwd.py
# --sm90-grid tiles, to compare the two).
persistent = True
SMEM_LIMIT = 232448  # opt-in shared memory per block on sm_90


TILE_COUNTERS = 4096  # kTileCounters in the kernel


def smem_bytes(headdim: int, block_m: int, block_n: int, stages: int, o_in_q: bool) -> int:
    barriers = 8 * (2 + 4 * stages) + 8  # and two tile-index slots
    o_rows = 0 if o_in_q else block_m  # the O staging tile, unless it shares Q's
    # + 1 KiB: the kernel rounds the base up to the 1024-byte boundary swizzled tiles need
    return (block_m + o_rows + 2 * stages * block_n) * headdim * ELEMENT_BYTES + barriers + 1024


# The kernel's FwdSm90Params struct (cuda_src/fwd_sm90.cu), field for field.
FWD_SM90_PARAMS = np.dtype(
    [(f"{t}_map", (np.void, tma.MAP_BYTES)) for t in ("q", "k", "v")]
    + [(name, np.uint64) for name in ("out", "lse", "cu_seqlens_q", "cu_seqlens_k")]
    + [(f"o_stride_{d}", np.int64) for d in ("b", "s", "h")]
    + [("lse_stride_b", np.int64), ("lse_stride_h", np.int64)]
    + [(name, np.int32) for name in ("seqlen_q", "seqlen_k", "group", "headdim", "window_left", "window_right")]
    + [(name, np.float32) for name in ("scale_log2", "softcap_exp2_scale", "softcap")]
    + [(name, np.int32) for name in ("nheads", "blocks_m", "num_tiles", "counter_slot", "reserved")])
assert FWD_SM90_PARAMS.itemsize == 512, "keep in step with static_assert(sizeof(FwdSm90Params) == 512)"
PARAMS_BYTES = np.dtype((np.void, FWD_SM90_PARAMS.itemsize))


@dataclass(frozen=True)
class FwdSm90Variant(Variant):
    family = "fwd_sm90"
    source = "fwd_sm90.cu"
    template = "cuflash::fwd_sm90"

    dtype: str
    headdim: int  # compiled (padded) head dim
    consumers: int  # consumer warpgroups, 64 query rows each
    block_n: int
    stages: int
    pingpong: bool  # consumers take turns issuing their GEMMs
    varlen: bool
    softcap: bool
    pass_by: bool  # a warpgroup skips the key blocks its rows do not see (PASS_BY)

    def check(self) -> None:
        if self.dtype not in CXX_TYPES:
            raise ValueError(f"fwd_sm90: dtype {self.dtype} is not one of {sorted(CXX_TYPES)}")
        if self.headdim not in HEADDIMS:
            raise ValueError(f"fwd_sm90: headdim {self.headdim} is not one of {HEADDIMS}")
        if self.consumers not in (2, 3):
            raise ValueError(f"fwd_sm90: consumers={self.consumers} must be 2 or 3")
        if self.block_n not in WGMMA_N or self.stages < 1:
            raise ValueError(f"fwd_sm90: block_n={self.block_n} must be one of the wgmma extents {WGMMA_N} and "
                             f"stages={self.stages} at least 1")
        if self.dynamic_shared_bytes > SMEM_LIMIT:
            raise ValueError(f"fwd_sm90: headdim {self.headdim}, block_n {self.block_n}, {self.stages} stages need "
                             f"{self.dynamic_shared_bytes} bytes of shared memory; sm_90 has {SMEM_LIMIT}")

    @property
    def block_m(self) -> int:
        return ROWS_PER_CONSUMER * self.consumers

    @property
    def threads(self) -> int:
        return 128 * (self.consumers + 1)  # and the producer warpgroup

    @cached_property  # read at every launch
    def o_in_q(self) -> bool:
        """O is staged in Q's tile when shared memory has no room for a tile of its own."""
        return smem_bytes(self.headdim, self.block_m, self.block_n, self.stages, o_in_q=False) > SMEM_LIMIT

    @cached_property
    def dynamic_shared_bytes(self) -> int:
        return smem_bytes(self.headdim, self.block_m, self.block_n, self.stages, self.o_in_q)

    def template_args(self) -> tuple[str, ...]:
        return (CXX_TYPES[self.dtype], str(self.headdim), str(self.consumers), str(self.block_n), str(self.stages),
                cxx_bool(self.pingpong), cxx_bool(self.o_in_q), cxx_bool(self.varlen), cxx_bool(self.softcap),
                cxx_bool(self.pass_by))


def _rows(headdim: int, softcap: bool):
    return ((None, SOFTCAP_TILES[headdim]),) if softcap else TILES[headdim]


def _tiles(headdim: int, seqlen_k: int, softcap: bool) -> tuple[int, int, int, bool]:
    return next(tiles for bound, tiles in _rows(headdim, softcap) if bound is None or seqlen_k <= bound)


def variants_for(compute_capability: tuple[int, int]) -> tuple[FwdSm90Variant, ...]:
    return tuple(FwdSm90Variant(dtype, hd, *tiles, varlen, softcap, pass_by) for dtype in sorted(CXX_TYPES)
                 for hd in HEADDIMS for varlen in (False, True) for softcap in (False, True)
                 for _, tiles in _rows(hd, softcap) for pass_by in sorted(set(PASS_BY[hd])))


def _token_strides(problem, array) -> tuple[int, ...]:
    """The strides TMA walks, in elements: heads, tokens (and batch when dense). TMA never steps
    along an axis of extent 1, so its stride (0 in an `x[None]` view, say) is replaced by the
    packed one over the next inner axis, which the driver accepts."""
    strides, packed = [], array.shape[-1]
    for axis in ((1, 0) if problem.varlen else (2, 1, 0)):
        strides.append(array.strides[axis] if array.shape[axis] > 1 else packed)
        packed = strides[-1] * array.shape[axis]
    return tuple(strides)


def select(problem, inputs) -> FwdSm90Variant:
    check_headdim("fwd_sm90", problem.headdim, HEADDIMS[-1])
    if problem.seqlen_q == 0 or problem.seqlen_k == 0 or (problem.varlen and not (problem.total_q and problem.total_k)):
        raise ValueError("fwd_sm90 loads through TMA descriptors, which cannot describe an empty q, k or v")
    require_rows_aligned("fwd_sm90", inputs, ("q", "k", "v"), ELEMENT_BYTES)
    for name in ("q", "k", "v"):
        if not tma.strides_encodable([s * ELEMENT_BYTES for s in _token_strides(problem, inputs[name])]):
            raise ValueError(f"fwd_sm90 loads {name} with TMA, which needs positive strides below 2^40 bytes; "
                             f"got strides {inputs[name].strides}")
    headdim = ATOM * math.ceil(problem.headdim / ATOM)
    tiles = (tiles_override[headdim] if tiles_override and headdim in tiles_override
             else _tiles(headdim, problem.seqlen_k, problem.softcap > 0))
    masked = problem.window_left >= 0 or problem.window_right >= 0
    variant = FwdSm90Variant(problem.dtype, headdim, *tiles, problem.varlen, problem.softcap > 0,
                             PASS_BY[headdim][masked])
    # tile indices run up to num_tiles + gridDim.x (one CTA per SM) in int32
    if math.ceil(problem.seqlen_q / variant.block_m) * problem.nheads * problem.batch >= 2**31 - 2**16:
        raise ValueError("fwd_sm90 numbers its output tiles with int32: batch * nheads * seqlen_q / block_m is too large")
    return variant


def _tensor_map(problem, array, nheads: int, rows: int) -> bytes:
    strides = tuple(s * ELEMENT_BYTES for s in _token_strides(problem, array))
    if problem.varlen:
        dims = (problem.headdim, nheads, array.shape[0])
        box = (ATOM, 1, rows)
    else:
        dims = (problem.headdim, nheads, array.shape[1], problem.batch)
        box = (ATOM, 1, rows, 1)
    return tma.encode_tiled(problem.dtype, array.ptr, dims, strides, box)


# Successive launches take successive tile-counter slots (see tile_counters in the kernel).
_counter_slots = itertools.cycle(range(TILE_COUNTERS))


def launch(variant: FwdSm90Variant, function, problem, inputs, outputs, stream) -> None:
    blocks_m = math.ceil(problem.seqlen_q / variant.block_m)
    num_tiles = blocks_m * problem.nheads * problem.batch
    if num_tiles == 0:
        return
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    out, lse = outputs["out"], outputs["lse"]
    o_strides, lse_strides, cu_q, cu_k = output_strides(problem, inputs, out, lse)
    params = np.empty(1, FWD_SM90_PARAMS)
    params[0] = (_tensor_map(problem, q, problem.nheads, variant.block_m),
                 _tensor_map(problem, k, problem.nheads_kv, variant.block_n),
                 _tensor_map(problem, v, problem.nheads_kv, variant.block_n),
                 out.ptr, lse.ptr, cu_q, cu_k, *o_strides, *lse_strides, problem.seqlen_q, problem.seqlen_k,
                 problem.nheads // problem.nheads_kv, problem.headdim, *kernel_window(problem),
                 *softmax_constants(problem), problem.nheads, blocks_m, num_tiles, next(_counter_slots), 0)
    sm_count = int(jit.device_properties(problem.device.index)["multiProcessorCount"])
    grid = min(num_tiles, sm_count) if persistent else num_tiles
    with stream:  # as raw bytes: CuPy inspects a structured dtype field by field on every launch
        function((grid,), (variant.threads,), (params.view(PARAMS_BYTES),), shared_mem=variant.dynamic_shared_bytes)


FAMILY = Family(
    name="fwd_sm90",
    backend="sm90",
    ops=("attention_forward", "attention_varlen_forward"),
    description="warp-specialised Hopper forward: TMA producer, wgmma consumers (sm_90a)",
    min_compute_capability=(9, 0),
    max_compute_capability=(9, 0),
    variants_for=variants_for,
    select=select,
    launch=launch,
)
