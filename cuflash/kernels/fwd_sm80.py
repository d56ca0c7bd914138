"""fwd_sm80: the FlashAttention-2 forward on mma.sync (cuda_src/fwd_sm80.cu), for every GPU of
compute capability 8.0 or newer; the fallback on Hopper."""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from .. import jit
from . import (CXX_TYPES, Family, ParamStruct, Variant, check_grid_yz, compiled_headdim, cxx_bool, launch_nothing,
               require_rows_aligned)
from .forward import (CU_SEQLENS, ELEMENT_BYTES, check_headdim, mask_and_softmax_fields, row_stride_fields,
                      token_stride_fields)

# Head dims are compiled in multiples of 32; a head dim that is a multiple of 8 in between runs on
# the next one up, its extra columns zero-filled on load and never stored.
HEADDIMS = (32, 64, 96, 128, 160, 192, 224, 256)

# The tile table: per compiled head dim, (block_m, block_n, warps, stages) in order of preference; the
# first whose shared memory fits the GPU is used. block_m / warps rows per warp: 32 rows (two m16
# tiles, so each K/V fragment read from shared memory feeds two MMAs) where the O and S accumulators
# fit the register file without spilling, 16 where the head dim is large (there 4 warps of 64 rows
# beat 8 warps of 128 rows by 7-20% on H100). block_n is as large as
# the 255 registers allow without a spill on sm_80 and sm_90a (the offline report checks it).
# stages = 2 double-buffers K/V where the registers leave room for it (hdim 64); at hdim 128 it
# spills and at 160-256 it halves the CTAs per SM. The sweeps behind these choices are in
# benchmarks/NOTES-sm80.md.
TILES = {
    32: ((128, 128, 4, 1),),
    64: ((128, 64, 4, 2), (128, 64, 4, 1)),
    96: ((128, 64, 4, 1), (64, 64, 4, 1)),
    128: ((128, 64, 4, 1), (64, 64, 4, 1)),
    160: ((64, 64, 4, 1), (64, 32, 4, 1)),
    192: ((64, 64, 4, 1), (64, 32, 4, 1)),
    224: ((64, 64, 4, 1), (64, 32, 4, 1)),
    256: ((64, 64, 4, 1), (64, 32, 4, 1)),
}
# Varlen's per-sequence offsets cost a few registers more: where that tips a tile into spilling.
VARLEN_TILES = {128: ((128, 48, 4, 1), (64, 64, 4, 1))}

# P V fused with the softmax's exponentials, a 16-key slice at a time (kFusedPV in the kernel): S's
# registers free as P V runs. Measured on H100 only (hdim 128: 0.95-0.98 -> 1.00-1.04x FA2, hdim 64
# +0.5-1%; benchmarks/NOTES-sm80.md), so only there; and not where ptxas then spills on sm_90a
# (hdim 128 with varlen or softcap; the offline report checks every variant).
def _fused_pv(compute_capability: tuple[int, int], headdim: int, varlen: bool, softcap: bool) -> bool:
    return tuple(compute_capability) == (9, 0) and not (headdim == 128 and (varlen or softcap))


# Opt-in shared memory per block by compute capability (CUDA programming guide); a GPU not listed
# gets the smallest, and at run time the device's own attribute decides.
SMEM_OPTIN = {(8, 0): 166912, (8, 7): 166912, (9, 0): 232448, (10, 0): 232448}
SMEM_OPTIN_DEFAULT = 101376  # sm_86, sm_89, sm_120


# The kernel's FwdParams struct (cuda_src/fwd_sm80.cu), field for field: 8-byte fields, then 4-byte.
FWD_PARAMS = np.dtype(
    [(name, np.uint64) for name in ("q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k")]
    + [(f"{t}_stride_{d}", np.int64) for t in ("q", "k", "v", "o") for d in ("b", "s", "h")]
    + [("lse_stride_b", np.int64), ("lse_stride_h", np.int64)]
    + [(name, np.int32) for name in ("seqlen_q", "seqlen_k", "group", "headdim", "window_left", "window_right")]
    + [(name, np.float32) for name in ("scale_log2", "softcap_exp2_scale", "softcap")]
    + [("reserved", np.int32)],
    align=True)
assert FWD_PARAMS.itemsize == 208, "keep in step with static_assert(sizeof(FwdParams) == 208)"
PARAMS = ParamStruct(FWD_PARAMS)


@dataclass(frozen=True)
class FwdSm80Variant(Variant):
    family = "fwd_sm80"
    source = "fwd_sm80.cu"
    template = "cuflash::fwd_sm80"

    dtype: str
    headdim: int  # compiled (padded) head dim
    block_m: int
    block_n: int
    warps: int
    stages: int  # K/V buffers: 1 (loads overlap half a block each) or 2 (a whole block, 2x shared memory)
    varlen: bool
    softcap: bool
    fused_pv: bool  # each 16-key slice's exponentials taken right before its P V (see _fused_pv)

    def check(self) -> None:
        if self.dtype not in CXX_TYPES:
            raise ValueError(f"fwd_sm80: dtype {self.dtype} is not one of {sorted(CXX_TYPES)}")
        if self.headdim not in HEADDIMS:
            raise ValueError(f"fwd_sm80: headdim {self.headdim} is not one of {HEADDIMS}")
        if self.stages not in (1, 2):
            raise ValueError(f"fwd_sm80: stages={self.stages} must be 1 or 2")
        if self.block_m % (16 * self.warps) or self.block_n % 16:
            raise ValueError(f"fwd_sm80: block_m={self.block_m} must be whole m16 tiles per warp "
                             f"({self.warps} warps) and block_n={self.block_n} a multiple of 16")

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def dynamic_shared_bytes(self) -> int:
        # Q, and K and V tiles per stage, each row padded by 16 bytes (see the kernel).
        return smem_bytes(self.headdim, self.block_m, self.block_n, self.stages)

    def template_args(self) -> tuple[str, ...]:
        return (CXX_TYPES[self.dtype], str(self.headdim), str(self.block_m), str(self.block_n), str(self.warps),
                str(self.stages), cxx_bool(self.varlen), cxx_bool(self.softcap), cxx_bool(self.fused_pv))


# Set by benchmarks/bench_fwd.py --tiles, before the first call, to time other rows of the table
# (dispatch remembers each choice); None in normal use.
tiles_override: dict[int, tuple[int, int, int, int]] | None = None


def smem_bytes(headdim: int, block_m: int, block_n: int, stages: int) -> int:
    return (block_m + 2 * stages * block_n) * (headdim + 8) * ELEMENT_BYTES


def _tiles(headdim: int, varlen: bool, smem_limit: int) -> tuple[int, int, int, int]:
    if tiles_override and headdim in tiles_override:
        return tiles_override[headdim]
    for tiles in (VARLEN_TILES if varlen and headdim in VARLEN_TILES else TILES)[headdim]:
        if smem_bytes(headdim, *tiles[:2], tiles[3]) <= smem_limit:
            return tiles
    raise ValueError(f"fwd_sm80 has no tile for headdim {headdim} within {smem_limit} bytes of shared memory")


def variants_for(compute_capability: tuple[int, int]) -> tuple[FwdSm80Variant, ...]:
    limit = SMEM_OPTIN.get(tuple(compute_capability), SMEM_OPTIN_DEFAULT)
    return tuple(FwdSm80Variant(dtype, hd, *_tiles(hd, varlen, limit), varlen, softcap,
                                _fused_pv(compute_capability, hd, varlen, softcap))
                 for dtype in sorted(CXX_TYPES) for hd in HEADDIMS for varlen in (False, True)
                 for softcap in (False, True))


def select(problem, inputs) -> FwdSm80Variant:
    check_headdim("fwd_sm80", problem.headdim, HEADDIMS[-1])
    require_rows_aligned("fwd_sm80", inputs, ("q", "k", "v"), ELEMENT_BYTES)
    check_grid_yz("fwd_sm80", problem.nheads, problem.batch)
    headdim = compiled_headdim(problem.headdim, HEADDIMS)
    tiles = _tiles(headdim, problem.varlen, int(jit.device_properties(problem.device.index)["sharedMemPerBlockOptin"]))
    softcap = problem.softcap > 0
    fused_pv = _fused_pv(jit.device_compute_capability(problem.device.index), headdim, problem.varlen, softcap)
    return FwdSm80Variant(problem.dtype, headdim, *tiles, problem.varlen, softcap, fused_pv)


def prepare(variant: FwdSm80Variant, function, problem, inputs, outputs):
    """Family.prepare: the grid and the parameter struct without addresses, made once; each launch
    writes the addresses in."""
    blocks_m = math.ceil(problem.seqlen_q / variant.block_m)
    if blocks_m * problem.nheads * problem.batch == 0:
        return launch_nothing
    template = PARAMS.template(
        seqlen_q=problem.seqlen_q, seqlen_k=problem.seqlen_k, group=problem.nheads // problem.nheads_kv,
        headdim=problem.headdim, **mask_and_softmax_fields(problem), **row_stride_fields(problem, lse=outputs["lse"]),
        **token_stride_fields(problem, q=inputs["q"], k=inputs["k"], v=inputs["v"], o=outputs["out"]))
    grid, block = (blocks_m, problem.nheads, problem.batch), (variant.threads,)

    def launch_prepared(inputs, outputs, stream) -> None:
        params = bytearray(template)
        PARAMS.write_addresses(params, inputs, ("q", "k", "v", *(CU_SEQLENS if problem.varlen else ())))
        PARAMS.write_addresses(params, outputs, ("out", "lse"))
        function(grid, block, (PARAMS.argument(params),), shared_mem=variant.dynamic_shared_bytes, stream=stream)

    return launch_prepared


FAMILY = Family(
    name="fwd_sm80",
    backend="sm80",
    ops=("attention_forward", "attention_varlen_forward"),
    description="FlashAttention-2 forward on mma.sync m16n8k16 (sm_80+; the fallback on Hopper)",
    min_compute_capability=(8, 0),
    variants_for=variants_for,
    select=select,
    prepare=prepare,
)
