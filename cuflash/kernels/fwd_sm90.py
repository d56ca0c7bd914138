"""fwd_sm90: the warp-specialised Hopper forward (cuda_src/fwd_sm90.cu): TMA producer, two or three
wgmma consumer warpgroups, for compute capability 9.0 (compiled for sm_90a). Two families share the
template: fwd_sm90 (fp16/bf16 attention) and fwd_fp8_sm90 (attention_fp8: e4m3 q, k, v with descales,
V transposed in shared memory by the producer warpgroup, or beforehand into a workspace by
cuda_src/transpose_v_fp8.cu)."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass
from functools import cached_property

import numpy as np

from .. import driver, jit, reference, tma
from . import (CXX_TYPES, MAX_GRID_YZ, ROW_ALIGN_BYTES, Family, ParamStruct, Variant, check_grid_yz,
               compiled_headdim, cxx_bool, fast_divisor, launch_nothing, require_rows_aligned)
from .forward import (CU_SEQLENS, ELEMENT_BYTES, check_headdim, mask_and_softmax_fields, row_stride_fields,
                      sees_every_key, token_stride_fields)

ROWS_PER_CONSUMER = 64  # query rows per consumer warpgroup (wgmma M)
SWIZZLE_ROW_BYTES = 128  # one 128-byte swizzle row: head dims are compiled in multiples of it
HEADDIMS = (64, 128, 192, 256)
FP8 = "float8_e4m3fn"
FP8_HEADDIMS = (64, 128, 256)  # e4m3 rows of 128-byte swizzle atoms (64: half of one, zero-filled)
CXX_ELEMENT_TYPES = {**CXX_TYPES, FP8: "cuflash::e4m3_t"}
ELEMENT_SIZE = {"float16": 2, "bfloat16": 2, FP8: 1}
# The wgmma N extents cuda_src/common/wgmma.cuh provides (tools/gen_wgmma.py generates exactly
# these): S = Q K^T has N = block_n, O += P V has N = the compiled head dim (e4m3 with the row sums
# on the tensor cores: + FP8_SUM_COLUMNS, or at head dim 256 the sums alone in a wgmma of their own).
WGMMA_N = (64, 80, 112, 128, 176, 192, 256)
FP8_WGMMA_N = (8, 64, 72, 128, 136, 160, 192, 256)
FP8_SUM_COLUMNS = 8

# Per compiled head dim, rows of (longest seqlen_k served, (consumers, block_n, stages, sync,
# schedule)):
# the first row whose bound covers the problem's seqlen_k is used (None: any). consumers: warpgroups
# of 64 query rows (block_m = 64 * consumers) with 240 registers each when 2, 160 when 3. block_n is
# bounded by those registers (O: headdim / 2, S: block_n / 2, P: block_n / 4 per thread; the
# offline report checks that nothing spills) and, with the stages, by 227 KiB of shared memory (Q
# and O: block_m rows, K and V: block_n rows per stage; a second Q buffer where it still fits,
# FwdSm90Variant.q_buffers). Long sequences take the widest block_n that
# fits; shorter ones a narrower one (fewer masked columns, less pipeline fill per tile). Head dim 128
# from 1k to 4k keys: three consumers of 80 keys (each K/V block serves 192 rows; version 27). Head
# dim 256 up to 512 keys: 128-key blocks, one stage, the serial schedule (512 keys are 4 blocks of
# 128, against 7 of 80 whose last has 32 keys; H100: +3% non-causal at 512, causal within 0.5%;
# from 1k 3-12% below the 80-key overlap; version 38).
# sync (SYNCS, the kernel's ConsumerSync): "pingpong", the consumers take turns issuing GEMMs;
# "tile", they start each tile together; "free", neither (H100: at head dim 64 up to 1k keys +7%
# non-causal at 512, +4% at 1k, +1% causal 512 but -1% at 1k, -2 to -3% from 2k; three consumers
# of 80 keys at head dim 128 +0.5 to +1.7% at 2k-4k; version 41). schedule (SCHEDULES, the
# kernel's Schedule):
# where a consumer issues and finishes P V of the block before. "overlap": issued beside the next
# block's S = Q K^T and finished where ptxas puts it, right after S's wait (before that softmax);
# "overlap_pv": finished after that softmax (measured on H100: +1.5-3% at head dim 128 from 4k keys,
# -1 to -2.5% at 128 up to 2k non-causal and at 192, -2-3% at 64 and in e4m3); "serial": issued in a
# ping-pong turn of its own and finished before that S is issued, so that S, P and O are never all
# live (128-key blocks at head dim 256), at the cost of a softmax that must hide behind one GEMM of
# the other consumer's instead of two (80-key blocks at 256 measured 5-8% below the overlap).
# Measurements: benchmarks/NOTES-sm90.md.
SCHEDULE_CXX = {"overlap": "cuflash::kScheduleOverlap", "overlap_pv": "cuflash::kScheduleOverlapPV",
                "serial": "cuflash::kScheduleSerial"}
SCHEDULES = tuple(SCHEDULE_CXX)  # in the order of the kernel's Schedule
SYNC_CXX = {"tile": "cuflash::kSyncTile", "pingpong": "cuflash::kSyncPingPong", "free": "cuflash::kSyncFree"}
SYNCS = tuple(SYNC_CXX)  # in the order of the kernel's ConsumerSync
TILES = {
    64: ((1024, (3, 128, 2, "free", "overlap")), (None, (3, 128, 2, "tile", "overlap"))),
    128: ((1024, (2, 128, 2, "pingpong", "overlap")), (4096, (3, 80, 2, "free", "overlap")),
          (None, (2, 192, 2, "pingpong", "overlap_pv"))),
    192: ((None, (2, 112, 2, "pingpong", "overlap")),),
    256: ((512, (2, 128, 1, "pingpong", "serial")), (None, (2, 80, 2, "tile", "overlap"))),
}
# Per compiled head dim, (unmasked, masked): whether each consumer warpgroup passes by the key
# blocks its own 64 rows do not see (above a causal or window diagonal, or all of them for rows past
# seqlen_q) instead of computing them masked. Measured on H100 (benchmarks/NOTES-sm90.md, versions
# 11 and 18): +12 points of cuDNN's speed at head dim 64 causal 1k and +3-6 at 256 (masked or not, a
# scheduling effect), +0.1-1.3 at 128 since version 13 (-1 to -2 before); at 64 unmasked +6 at
# 512-1k and +1.5 at 2k-4k since version 26 (version 28; -1 to -5 from 2k in version 18); at 192
# masked +1-1.5 at 2k-4k, unmasked ±0.5 (version 28).
PASS_BY = {64: (True, True), 128: (True, True), 192: (False, True), 256: (True, True)}
# Softcap keeps more registers live per score: its own row per head dim (two consumers at 64, the
# narrow blocks at 128), where nothing spills.
SOFTCAP_TILES = {64: (2, 128, 3, "pingpong", "overlap"), 128: (2, 128, 2, "pingpong", "overlap"),
                 192: (2, 112, 2, "pingpong", "overlap"), 256: (2, 80, 2, "tile", "overlap")}
# e4m3: per compiled head dim, rows of (longest seqlen_q served, (consumers, block_n, stages,
# sync, schedule, v_pretransposed)): the first row whose bound covers seqlen_q is used (None:
# any), but for FP8_SHORT_KEYS_PRETRANSPOSED and grids the V^T kernel cannot launch (_fp8_tiles).
# block_n is 128: V^T is one 128-key swizzle row, and block descales come per 128 keys (but
# FP8_PER_HEAD_TILES).
# v_pretransposed: V^T is written to a workspace by a kernel of its own (cuda_src/transpose_v_fp8.cu)
# before the attention kernel, which then loads it with TMA like K; otherwise the producer
# warpgroup transposes each block in shared memory. The pass over V (H100: 2.2-2.35 TB/s, 29 us for
# 32 MB) and a workspace of V's size buy, at head dim 256, +21-28% non-causal and +12-25% causal
# from 2k (FA3 sizing, 1,164 TFLOPs at 16k then); on H200 the pass was 21 us, 2-3% of the call at
# 256 8k (18 us since session 49, below), and writing V^T in the attention kernel instead (its producer warps, or all its threads
# before the roles split) won back at most 0.4-1.2 points of that (benchmarks/NOTES-fp8.md, session
# 48). It pays when V blocks serve enough query rows: at 8k keys and head dim 256, 1k and 2k query
# rows 6-17% faster, up to 512 rows 2-12% slower, GQA or not. At 128, beyond 2k query rows
# (session 24, FA3 sizing, three alternations; the producer's transposing warps had been taking a
# third of the issue samples): non-causal 4k-16k +3-5%, causal 16k +1-3%, 2k even, 1k -6%; the
# consumers run free there. (Two or four stages lose the loop counters' uniformity at 128
# pre-transposed: 26 R2UR, test_kernels_offline.) At 64, beyond 4k
# query rows, with ping-pong (session 25, two alternations): non-causal 8k-16k +4-5% (4k +3.5%),
# causal 16k +2-7%, 8k even (4k -2%), 1k -4%; without ping-pong +1-4%. Up to 4k the consumers
# run free there (session 25): +4-10% non-causal and +0-3% causal against tile sync (512 causal
# +8-26%), while beyond 4k free or ping-pong in the kernel lose 3-4% to V^T beforehand (H100,
# benchmarks/NOTES-fp8.md). Shared memory holds K, V^T and (transposed in the kernel) the staged V
# per stage: at 256, two stages of those take 224 KiB and O is stored straight from registers,
# while pre-transposed there is room to stage O, and there the consumers run free since the
# integer row maxima (H200, session 43, against ping-pong: +0.8-1.1% at 16k in four alternations,
# -0.5 to +1.9% at 1k-4k, causal +0-0.4%; tile sync -0.7 to +0.7%); at 128 a third stage
# measured +3-6% non-causal on H100, O still staged, and no ping-pong +1-5% from 2k (session 17:
# e4m3's GEMMs are half as long as 16-bit ones against the same softmax, and taking turns for them
# cost more than it hid); at 64 (half-filled 128-byte rows) three consumer warpgroups (160
# registers each, the producer 32) measured 1.02-1.15x bf16 against 0.80-0.93x with two.
# The bound at 128 moved down once the pass took 18 us instead of 21 and the attention kernel
# started during it (H200, session 49, FA3 sizing, two alternations, V^T beforehand over the
# in-kernel row): at 128, 2k query rows +4.4% non-causal (+4.0-4.7% with per-128-row descales and/or
# the LSE) but -2.5% causal, 1k +0.2-0.8% and -7%, 4k +8% (hence FP8_MASKED_IN_KERNEL_ROWS). At 64
# it stays: 4k +0.5-0.7% non-causal and +1-3.9% causal, but -6.4% per head with the LSE.
FP8_TILES = {64: ((4096, (3, 128, 2, "free", "overlap", False)),
                  (None, (3, 128, 2, "pingpong", "overlap", True))),
             128: ((1024, (2, 128, 3, "tile", "overlap", False)),
                   (None, (2, 128, 3, "free", "overlap", True))),
             256: ((512, (2, 128, 2, "pingpong", "overlap", False)),
                   (None, (2, 128, 2, "free", "overlap", True)))}
# Per compiled head dim: from this many query rows on, a problem whose keys are no more than its
# query rows takes the head dim's V^T-beforehand FP8_TILES row whatever its seqlen_q bound says.
# With few keys a tile has few blocks, and the in-kernel transpose of the first ones is not hidden
# behind GEMMs. Measured at 256 on H100 (CUDA-graph timing, session 25, two alternations, FA3
# sizing): 512 rows and keys +24% non-causal, +4% causal; 256 and 256 +22%, +1%; but with more keys
# than query rows the pass over V does not pay: 512 rows with 1k / 2k / 8k keys +10% / -3% / -6%
# non-causal (causal 1k -3%, 8k -12 to -17%), 256 rows with 1k keys -16%. At 128 and 64 it lost at
# 512 rows and keys (-12% and -16% non-causal).
FP8_SHORT_KEYS_PRETRANSPOSED = {256: 256}
# Per compiled head dim: problems whose mask hides keys from some rows (causal, windows) keep the
# in-kernel FP8_TILES row up to this many query rows, their V blocks serving fewer rows (above).
FP8_MASKED_IN_KERNEL_ROWS = {128: 2048}
# Where k's and v's descales are per head (one per batch and kv head), a pre-transposed FP8_TILES row
# of these head dims gives way to this one: wider blocks spread a block's fixed costs (the row
# maxima, the waits, O's rescale) over more scores. Per-128-key descales would straddle such a
# block, so they keep 128 keys. (V^T's second swizzle atom holds the block's last 32 or 64 keys; its
# TMA box brings 128.) Measured on H100 beside the 128-key row: 192 keys at 128 (three
# alternations, session 24) +2-4% non-causal 4k-16k, +3-5% causal 16k, causal 4k +1%; 160 keys at
# 64 (FA3's choice there; three consumers still fit their 160 registers, where 192 keys spill;
# graph timing, two alternations, session 26) +2% / +4% non-causal 8k / 16k, +5% / +4% causal
# (benchmarks/NOTES-fp8.md). (224 keys at 128, FA3's block there, fit but measured within the
# noise of 192: session 26.)
FP8_PER_HEAD_TILES = {64: (3, 160, 2, "pingpong", "overlap", True), 128: (2, 192, 2, "free", "overlap", True)}
# Calls that do not return the LSE sum P's rows on the tensor cores at these head dims (the
# kernel's kTensorRowSums: P V with FP8_SUM_COLUMNS more columns, of ones; no FADD a score, and each
# block's sums folded into fp32: the e4m3 accumulator alone lost 24% of a 16k-key row's sum), on
# every row where they fit (tensor_row_sums_fit: not the FP8_PER_HEAD_TILES row at 64, whose three
# consumers spill with four more accumulators). Measured on H100 against the fp32 sums: head dim 64
# +2-12% at 1k, +1.5-6% at 4k, +0.6-6% at 8k-16k (session 30; there on the 128-key row against the
# 160-key one), +3-6.5% at 4k-16k with the fold (session 40); head dim 128 alone -3 to +4% (session
# 30), but with more exponentials on the FMA pipe, which the FADDs gone leave room for
# (FP8_EXP_ON_FMA), +2-5% non-causal and +4-6% causal at 4k-16k on its rows, +3-5% end to end
# (session 40; benchmarks/NOTES-fp8.md). At 256, where N would pass 256, the sums take a wgmma of
# their own (N = 8) on one tile of ones all stages share, on the pre-transposed row only (not where
# the consumers take turns: not measured there): +0.6-1.0% at 4k-16k alone (H200, session 47), and
# with them that row may keep a stale maximum (FP8_STALE_MAX).
FP8_TENSOR_ROW_SUMS = (64, 128, 256)
# As PASS_BY, for e4m3: chosen like the 16-bit table's rows for 256; at 64 unmasked measured on H100
# (NOTES-fp8.md, session 16) +8% at 1k, +3.5% at 2k-4k, +1.7% at 16k; at 128 unmasked -0.5 to -2%.
FP8_PASS_BY = {64: (True, True), 128: (False, True), 256: (True, True)}


def pretransposed(tiles: tuple) -> tuple:
    """The e4m3 tile row `tiles` with V^T written beforehand (attention(fp8=True) quantizes v
    straight into V^T: quantized_sm90)."""
    return (*tiles[:5], True)


# e4m3, calls without the LSE, per (compiled head dim, tile row): (unmasked, masked) every this
# many-th exponential of a thread's row on the FMA pipe (the kernel's kExpOnFma; ex2_fma, a quadratic
# of six or seven FMA-pipe instructions against one MUFU.EX2), the others on the special-function
# unit; 0: all there. Why: taking every exponential away saved a sixth of head dim 128's time, and
# e4m3's GEMMs are half as long as 16-bit ones against the same softmax (NOTES-fp8.md, session 29).
# What pays follows which columns move more than how many, and how busy the FMA pipe already is:
# every count below is the best of a sweep (CUDA graphs interleaved, FA3 sizing; NOTES-fp8.md,
# sessions 39-43), each row beside its neighbours' counts:
# - head dim 128, per-head 192-key row: every 8th, masked 6th (H200, with integer maxima: +2.7% at
#   4k, +3.9-4.6% at 16k against every 4th; masked +1.2-2.7% against every 8th);
# - head dim 128, pretransposed 128-key rows (per-128-row descales, attention(fp8=True)): every 6th,
#   masked 8th (H200, with integer maxima: +0.5-1.1% at 4k-16k and +2.1-2.3% at attention(fp8=True)'s
#   2k against every 4th without them, masked +1.2-2.1% against every 12th);
# - head dim 128, in-kernel V^T row (up to 2k rows when measured; now 1k, masked 2k): every 8th,
#   masked too (H100: 0, 4 and 12 0.3-4% slower);
# - head dim 64: every 12th on the in-kernel rows (H100 +2-2.8% at 1k-4k, masked not taken), every
#   16th on the row-sums row beyond 4k, masked too (+5-6% at 8k-16k, masked +2-4%); on the H200
#   neither integer maxima nor other counts (8th-24th) beat these.
# Not taken: head dim 256 -1 to -13%; 16 bits -5 to -19%. The quadratic's relative error, up to
# 2.1e-3, is below e4m3's rounding of P (O's error against float64 measured the same with and
# without, session 40) but would reach the LSE of a row with few keys (whose bound is 1e-3), so
# calls that return the LSE take the unit's exponentials, or FP8_LSE_EXP_PAIRS' cubic.
FP8_EXP_ON_FMA = {(64, FP8_TILES[64][1][1]): (16, 16), (64, FP8_TILES[64][0][1]): (12, 0),
                  (64, pretransposed(FP8_TILES[64][0][1])): (12, 0),
                  (128, FP8_PER_HEAD_TILES[128]): (8, 6), (128, FP8_TILES[128][1][1]): (6, 8),
                  (128, FP8_TILES[128][0][1]): (8, 8), (128, pretransposed(FP8_TILES[128][0][1])): (6, 0)}
# e4m3, calls that return the LSE, per (compiled head dim, tile row): (unmasked, masked) every this
# many-th pair of a thread's row's columns with both exponentials on the FMA pipe in f16x2 arithmetic
# (the kernel's kExpOnFma with kExpFmaPairs; ex2x2_fma_f16: a cubic, relative error 5.5e-4 near the
# row's maximum, where ex2_fma's quadratic, 2.1e-3, would reach the LSE's bound, so these calls had
# every exponential on the unit). Measured on H200 against that (NOTES-fp8.md, session 46):
# - head dim 128, per-128-row descales beyond 2k rows: every 6th +3.5% at 4k, +4.2-4.6% at 16k,
#   masked +2.7-3.4% at 16k (every 3rd -2%, 4th, 5th and masked 4th and 8th less than every 6th);
# - head dim 64, per-128-row descales beyond 4k rows: every 8th +1.5% at 16k (every 4th ±0);
# - head dim 128, the per-head 192-key row (once its stale maximum was gone, session 47): every 6th
#   +2.1% at 4k, +1.5-1.7% at 16k (every 8th +1-1.9%, 4th -0.5 to -1.2% at 16k); masked -0.6%.
# Not taken: the in-kernel 128-key rows (-1 to -2%), the per-head row at 64 (-6 to -9%), head
# dim 256 (-2%). In place of ex2_fma on FP8_EXP_ON_FMA's rows the pairs measured -5% to +0.4% (-2.6
# to -3.5% on the per-head row at 128 at its count).
FP8_LSE_EXP_PAIRS = {(128, FP8_TILES[128][1][1]): (6, 6), (128, FP8_PER_HEAD_TILES[128]): (6, 0),
                     (64, FP8_TILES[64][1][1]): (8, 0)}
# e4m3 calls whose k and v descales are per head, without the LSE, per (compiled head dim, tile
# row): a warp skips O's rescale while no row's maximum rose by more than 2^this since the last one
# (FlashAttention-4's stale maximum, the kernel's kFp8StaleMax), P's exponent offset this much lower
# (P within 2^8, e4m3's 448). Only where O is divided by the sums of P as rounded (the row sums on
# the tensor cores), where a row's largest weight, no longer an exact power of two, cancels: divided
# by the sum of the unrounded P, 3-4 of 40 rows led by a few large keys broke the FP8 accuracy bound
# at 256 (1 of 40 with 2^1 at 128). Measured on H200 (NOTES-fp8.md, session 47), head dim 256's
# pre-transposed row, 2^3 with the sums against neither: +4.7% at 4k, +5.6-6.0% at 16k, +3.7-3.9%
# causal at 16k (without the sums 2^1 +0-3.5%, 2^2 +2.5-4.5%, 2^4 as 2^3); 0 of 40 such rows over
# the bound, their largest error 1.2-2x the exact maximum's (within the bound); O's RMS error on
# Gaussian inputs about 5% higher.
FP8_STALE_MAX = {(256, FP8_TILES[256][1][1]): 3}
# The transposing warps count a tile's key blocks in 16 bits (fwd_sm90.cu): longer key sequences
# are refused rather than wrapped.
FP8_MAX_KEY_BLOCKS = 2**16 - 1
# Set by benchmarks/bench_fwd.py --sm90-tiles (--fp8-tiles) before the first call, to time other
# table rows (dispatch remembers each choice); None in normal use.
tiles_override: dict[int, tuple[int, int, int, str, str]] | None = None
fp8_tiles_override: dict[int, tuple[int, int, int, str, str, bool]] | None = None
# The grid: one CTA per SM, each taking tiles until none is left (True), or one CTA per tile, each
# taking one and leaving the rest to the hardware's block scheduler (False: benchmarks/bench_fwd.py
# --sm90-grid tiles, to compare the two).
persistent = True
SMEM_LIMIT = 232448  # opt-in shared memory per block on sm_90


TILE_COUNTERS = 4096  # kTileCounters in the kernel


# Where the epilogue stages O (FwdSm90Variant.o_stage), as the kernel's OStage spells it.
O_STAGE_CXX = {"own": "cuflash::kOStageOwn", "in_q": "cuflash::kOStageInQ", "direct": "cuflash::kOStageDirect",
               "in_v": "cuflash::kOStageInV"}


def smem_bytes(dtype: str, headdim: int, block_m: int, block_n: int, stages: int, o_stage: str,
               v_pretransposed: bool, q_buffers: int = 1, tensor_row_sums: bool = False) -> int:
    fp8 = dtype == FP8
    transpose = fp8 and not v_pretransposed  # V is staged and transposed in shared memory
    barriers = 8 * (2 * q_buffers + (6 if transpose else 4) * stages) + 8  # and two tile-index slots
    row = math.ceil(headdim * ELEMENT_SIZE[dtype] / SWIZZLE_ROW_BYTES) * SWIZZLE_ROW_BYTES  # Q, K, V rows
    # Per stage: K, and V (16 bits), or V^T (headdim rows of block_n keys in whole 128-key swizzle
    # atoms, a byte a key, and with the row sums FP8_SUM_COLUMNS rows of ones; at head dim 256 those
    # are one tile all stages share) and the staged V (e4m3 transposed in the kernel).
    sums_apart = tensor_row_sums and headdim + FP8_SUM_COLUMNS > 256
    v_rows = headdim + (FP8_SUM_COLUMNS if tensor_row_sums and not sums_apart else 0)
    v_transposed = v_rows * math.ceil(block_n / SWIZZLE_ROW_BYTES) * SWIZZLE_ROW_BYTES
    per_stage = block_n * row + (v_transposed + (block_n * row if transpose else 0) if fp8 else block_n * row)
    o_bytes = block_m * headdim * ELEMENT_BYTES if o_stage == "own" else 0  # O in 16 bits
    # + 1 KiB: the kernel rounds the base up to the 1024-byte boundary swizzled tiles need
    ones = FP8_SUM_COLUMNS * SWIZZLE_ROW_BYTES if sums_apart else 0
    return q_buffers * block_m * row + stages * per_stage + ones + o_bytes + barriers + 1024


# The kernel's FwdSm90Params struct (cuda_src/fwd_sm90.cu), field for field (padded to its
# 64-byte alignment).
_FIELDS = ([(f"{t}_map", (np.void, tma.MAP_BYTES)) for t in ("q", "k", "v")]
           + [(name, np.uint64) for name in ("out", "lse", "cu_seqlens_q", "cu_seqlens_k")]
           + [("descale", (np.uint64, 3))]
           + [(f"o_stride_{d}", np.int64) for d in ("b", "s", "h")]
           + [("lse_stride_b", np.int64), ("lse_stride_h", np.int64)]
           + [(f"descale_stride_{d}", (np.int32, 3)) for d in ("b", "h", "block")]
           + [(name, np.int32) for name in ("seqlen_q", "seqlen_k", "group", "headdim", "window_left",
                                            "window_right")]
           + [(name, np.float32) for name in ("scale_log2", "softcap_exp2_scale", "softcap")]
           + [(name, np.int32) for name in ("nheads", "blocks_m", "num_tiles", "counter_slot")]
           + [(f"{name}_{part}", t) for name in ("blocks_m", "nheads", "group")  # FastDivisor pairs
              for part, t in (("mul", np.uint32), ("shift", np.int32))]
           + [("window_heads", np.int32), ("window_tiles", np.int32)]
           + [(f"window_{name}_{part}", t) for name in ("heads", "tiles")
              for part, t in (("mul", np.uint32), ("shift", np.int32))]
           + [("window_pair0", np.int32), ("num_splits", np.int32), ("split_blocks", np.int32),
              ("splits_mul", np.uint32), ("splits_shift", np.int32), ("q_descale_shift", np.int32),
              ("o_map", (np.void, tma.MAP_BYTES)), ("wait_for_inputs", np.int32)])  # o_map 64-byte aligned
FWD_SM90_PARAMS = np.dtype({"names": [n for n, _ in _FIELDS], "formats": [f for _, f in _FIELDS], "itemsize": 832})
assert FWD_SM90_PARAMS.fields["window_tiles_shift"][1] == 612, "keep in step with FwdSm90Params"
assert FWD_SM90_PARAMS.fields["o_map"][1] == 640, "keep in step with FwdSm90Params"
assert FWD_SM90_PARAMS.fields["wait_for_inputs"][1] == 768, "keep in step with FwdSm90Params"
PARAMS = ParamStruct(FWD_SM90_PARAMS)


@dataclass(frozen=True)
class FwdSm90Variant(Variant):
    family = "fwd_sm90"
    source = "fwd_sm90.cu"
    template = "cuflash::fwd_sm90"

    dtype: str  # of q, k and v
    out_dtype: str  # of out: dtype, or float16/bfloat16 for e4m3
    headdim: int  # compiled (padded) head dim
    consumers: int  # consumer warpgroups, 64 query rows each
    block_n: int
    stages: int
    sync: str  # how the consumers keep in step (SYNCS, TILES)
    schedule: str  # where P V is issued and finished (SCHEDULES, TILES)
    varlen: bool
    softcap: bool
    pass_by: bool  # a warpgroup skips the key blocks its rows do not see (PASS_BY)
    masked: bool  # compiled for a causal or window mask (mask_fields)
    v_pretransposed: bool  # e4m3: V^T comes from a workspace the launch writes first (FP8_TILES)
    tensor_row_sums: bool = False  # e4m3 without the LSE: P V sums P's rows too (FP8_TENSOR_ROW_SUMS)
    split_kv: bool = False  # tiles split by key blocks into float32 partials, then combine_splits (kv_splits)
    exp_on_fma: int = 0  # e4m3: every this many-th exponential of a row on the FMA pipe, 0: none (FP8_EXP_ON_FMA)
    exp_fma_pairs: bool = False  # exp_on_fma counts pairs of columns, each in f16x2 (FP8_LSE_EXP_PAIRS)
    stale_max: int = 0  # e4m3: the running maximum may be up to 2^stale_max stale (FP8_STALE_MAX)
    exp_codes: bool = False  # e4m3 with tensor_row_sums: P's codes straight from the scores, no exponential (fast_exp)

    def check(self) -> None:
        fp8 = self.dtype == FP8
        if self.dtype not in CXX_ELEMENT_TYPES or self.out_dtype not in CXX_TYPES or (
                not fp8 and self.out_dtype != self.dtype):
            raise ValueError(f"fwd_sm90: dtype {self.dtype} with out_dtype {self.out_dtype}: the inputs are one of "
                             f"{sorted(CXX_ELEMENT_TYPES)}, out is one of {sorted(CXX_TYPES)} and, for 16-bit "
                             "inputs, their dtype")
        if self.headdim not in (FP8_HEADDIMS if fp8 else HEADDIMS):
            raise ValueError(f"fwd_sm90: headdim {self.headdim} is not one of {FP8_HEADDIMS if fp8 else HEADDIMS} "
                             f"for {self.dtype}")
        if fp8 and (self.block_n not in (128, 160, 192) or (self.block_n != 128 and not self.v_pretransposed)
                    or self.varlen or self.softcap):
            raise ValueError("fwd_sm90: e4m3 takes block_n=128 (or 160 or 192 with v_pretransposed), dense inputs "
                             "and no softcap")
        if self.tensor_row_sums and (not fp8 or self.headdim not in FP8_TENSOR_ROW_SUMS):
            raise ValueError(f"fwd_sm90: tensor_row_sums is for e4m3 at head dims {sorted(FP8_TENSOR_ROW_SUMS)}")
        if self.v_pretransposed and not fp8:
            raise ValueError("fwd_sm90: v_pretransposed is for e4m3 (16-bit V is read as it is)")
        if self.split_kv and (self.varlen or self.tensor_row_sums or self.v_pretransposed):
            raise ValueError("fwd_sm90: split_kv is for dense attention with fp32 row sums (the LSE), e4m3 with V "
                             "transposed in the kernel")
        if self.exp_on_fma < 0 or (self.exp_on_fma and not fp8):
            raise ValueError(f"fwd_sm90: exp_on_fma={self.exp_on_fma}: every how many-th exponential goes to the FMA "
                             "pipe, 0 for none; e4m3 only")
        if self.stale_max and not (fp8 and 0 < self.stale_max < 8 and self.tensor_row_sums
                                   and self.sync != "pingpong" and not self.split_kv):
            raise ValueError(f"fwd_sm90: stale_max={self.stale_max} is for e4m3 (below 8) with P's sums on the "
                             "tensor cores, no ping-pong and no split")
        if self.exp_codes and not (self.tensor_row_sums and self.exp_on_fma == 0):
            raise ValueError("fwd_sm90: exp_codes (P's e4m3 codes without exponentials) needs tensor_row_sums (the "
                             "sums of P as coded) and takes no exp_on_fma")
        if self.exp_fma_pairs and not self.exp_on_fma:
            raise ValueError("fwd_sm90: exp_fma_pairs says how exp_on_fma's exponentials are taken: give exp_on_fma")
        for field, names in (("sync", SYNCS), ("schedule", SCHEDULES)):
            if getattr(self, field) not in names:
                raise ValueError(f"fwd_sm90: {field} {getattr(self, field)!r} is not one of {names}")
        if self.consumers not in (1, 2, 3) or (self.consumers == 1 and (not self.split_kv or self.sync == "pingpong")):
            raise ValueError(f"fwd_sm90: consumers={self.consumers} must be 2 or 3, or 1 for split_kv without "
                             "ping-pong turns")
        extents = FP8_WGMMA_N if fp8 else WGMMA_N
        if self.block_n not in extents or self.stages < 1:
            raise ValueError(f"fwd_sm90: block_n={self.block_n} must be one of the wgmma extents {extents} and "
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

    def _smem_bytes(self, o_stage: str, q_buffers: int = 1) -> int:
        return smem_bytes(self.dtype, self.headdim, self.block_m, self.block_n, self.stages, o_stage,
                          self.v_pretransposed, q_buffers, self.tensor_row_sums)

    @cached_property  # read at every launch
    def o_stage(self) -> str:
        """O is staged in a tile of its own when shared memory has room; otherwise (16 bits) in the
        last key block's V slot where that is as large (block_n >= block_m), so that Q is free for
        the next tile before the epilogue, or else in Q's tile; e4m3's 16-bit O, twice Q's size, is
        not staged; nor are split-KV's float32 partials."""
        if self.split_kv:
            return "direct"
        if self._smem_bytes("own") <= SMEM_LIMIT:
            return "own"
        if self.dtype == FP8:
            return "direct"
        return "in_v" if self.block_n >= self.block_m else "in_q"

    @property
    def o_store_tma(self) -> bool:
        """The epilogue stores O by TMA (the kernel's kOStoreTma: O staged, dense; a varlen box
        would spill into the next sequence), so the launch encodes a map of out."""
        return not self.varlen and self.o_stage != "direct"

    @cached_property
    def q_buffers(self) -> int:
        """Two Q buffers (a tile's Q loads while the tile before still reads its own) where shared
        memory has room beside O's own staging tile; otherwise one. Measured on H100: +2-7% at 512-1k
        query rows (head dims 64 and 128, 16-bit and e4m3), within -1% at 16k (NOTES-sm90.md,
        version 32)."""
        return 2 if self.o_stage == "own" and self._smem_bytes("own", 2) <= SMEM_LIMIT else 1

    @cached_property
    def dynamic_shared_bytes(self) -> int:
        return self._smem_bytes(self.o_stage, self.q_buffers)

    def template_args(self) -> tuple[str, ...]:
        return (CXX_ELEMENT_TYPES[self.dtype], CXX_TYPES[self.out_dtype], str(self.headdim), str(self.consumers),
                str(self.block_n), str(self.stages), SYNC_CXX[self.sync], SCHEDULE_CXX[self.schedule],
                O_STAGE_CXX[self.o_stage],
                cxx_bool(self.varlen), cxx_bool(self.softcap), cxx_bool(self.pass_by), cxx_bool(self.masked),
                cxx_bool(self.v_pretransposed), cxx_bool(self.tensor_row_sums), str(self.q_buffers),
                cxx_bool(self.split_kv), str(self.exp_on_fma), cxx_bool(self.exp_fma_pairs), str(self.stale_max),
                cxx_bool(self.exp_codes))


@dataclass(frozen=True)
class FwdFp8Sm90Variant(FwdSm90Variant):
    """The same template on e4m3 inputs, named after its family (fwd_fp8_sm90) in URIs and reports."""

    family = "fwd_fp8_sm90"


# The TransposeVFp8Params struct (cuda_src/transpose_v_fp8.cu), field for field.
TRANSPOSE_V_PARAMS = np.dtype([("v", np.uint64), ("vt", np.uint64)]
                              + [(f"v_stride_{d}", np.int64) for d in ("b", "s", "h")]
                              + [(name, np.int32) for name in ("seqlen", "seqlen_pad", "nheads", "headdim")])
assert TRANSPOSE_V_PARAMS.itemsize == 56, "keep in step with static_assert(sizeof(TransposeVFp8Params) == 56)"
TRANSPOSE_V_STRUCT = ParamStruct(TRANSPOSE_V_PARAMS)
# 128 threads, 4 lanes a chunk: 18.0-18.5 us for 32 MB of V on an H200, a copy of it 17.5 (the pass of
# 4-byte columns before: 21.0-21.2; 256 threads or 1, 2 or 8 lanes 18.4-20.9; NOTES-fp8, session 49).
TRANSPOSE_V_THREADS = 128
TRANSPOSE_V_GROUP_RUN = 4
V_TRANSPOSED_KEY_ALIGN = 16  # V^T's rows of keys are padded to this (TMA's 16-byte strides; a key group)


@dataclass(frozen=True)
class TransposeVFp8Variant(Variant):
    """e4m3 V to the V^T workspace of the pre-transposed FP8 forward (launched by its launcher)."""

    family = "fwd_fp8_sm90"
    source = "transpose_v_fp8.cu"
    template = "cuflash::transpose_v_fp8"

    threads: int = TRANSPOSE_V_THREADS
    group_run: int = TRANSPOSE_V_GROUP_RUN  # lanes on neighbouring key groups (kGroupRun)

    def template_args(self) -> tuple[str, ...]:
        return (str(self.threads), str(self.group_run))


# The CombineSplitsParams struct (cuda_src/combine_splits.cu), field for field.
COMBINE_PARAMS = np.dtype([(name, np.uint64) for name in ("o_partial", "lse_partial", "out", "lse")]
                          + [(f"o_stride_{d}", np.int64) for d in ("b", "s", "h")]
                          + [("lse_stride_b", np.int64), ("lse_stride_h", np.int64)]
                          + [(name, np.int32) for name in ("splits", "seqlen_q", "nheads", "headdim", "rows")],
                          align=True)
assert COMBINE_PARAMS.itemsize == 96, "keep in step with static_assert(sizeof(CombineSplitsParams) == 96)"
COMBINE_STRUCT = ParamStruct(COMBINE_PARAMS)
COMBINE_THREADS = 128  # four query rows a block, a warp each


@dataclass(frozen=True)
class CombineSplitsVariant(Variant):
    """Split-KV's merge of the float32 partials into out and lse (launched by the split variants' launcher)."""

    family = "fwd_sm90"
    source = "combine_splits.cu"
    template = "cuflash::combine_splits"

    out_dtype: str
    threads: int = COMBINE_THREADS

    def template_args(self) -> tuple[str, ...]:
        return (CXX_TYPES[self.out_dtype], str(self.threads))


# Split-KV (the kernel's kSplitKV): a decode step (a few query rows a head, long keys) has fewer
# tiles than the GPU has SMs, and each tile streams all its keys on one SM: at batch 1 with 8 kv heads
# and 32k keys, 8 CTAs (GQA's query heads as rows, kernels.forward.query_heads_as_rows) ran at a
# sixth of the memory's bandwidth. Split, each tile's key blocks go to kv_splits parts, a tile each,
# whose float32 partials (the `o_partial`, `lse_partial` workspace) combine_splits merges. The parts
# are counted for SPLIT_KV_SMS SMs (H100 SXM's and H200's; from the problem alone, as the workspace
# is declared): the fewest whose waves fill the SMs to within SPLIT_KV_FILL of the best count's,
# as FlashAttention's num_splits_heuristic counts them; none where the tiles fill 80% of the SMs.
# A part keeps at least SPLIT_KV_KEYS_PER_ROW keys per query row of its tile, so that its partials
# (8 bytes per row element written and read again, against 4 per key element of K and V) and its
# fixed costs (Q's load, the pipeline's fill, the epilogue, and combine_splits' launch) stay small
# beside its keys. Measured on H100 (CUDA graphs, us, split / whole): decode steps 57.6 / 397 (batch
# 1, 32k keys, 8 kv heads), 18.6 / 102 (8k keys), and 2k-4k keys with 4 or 2 heads 25 / 38 and 38 /
# 70; but with no such rule 1k keys with 8 heads at head dim 64 25 / 17 and 512 keys at 256 19.5 / 16,
# which it keeps whole. A rule of at least 4 key blocks a part also kept a decode step of 1k keys
# whole (16.8 / 14.8 then); since combine_splits merges in one round trip to memory (2.0-2.5 us a
# call instead of 4.3-6.4), it is gone: 1k keys in 6 parts 11.0 / 13.5, 8k keys in 15 parts instead
# of 9 15.7 / 19.9 (192-key blocks; 8 and 16 parts since SPLIT_TILES), every other decode shape of
# bench.DECODE_SHAPES in the same parts as with it
# (benchmarks/NOTES-sm90.md, "Decode shapes"). The split variants take the head dim's
# SPLIT_ONE_CONSUMER_TILES row (at most 64 rows a tile, few_rows) or SPLIT_TILES row, else its
# longest-key row of TILES (SOFTCAP_TILES), or e4m3 its FP8_SPLIT_ONE_CONSUMER_TILES or
# FP8_SPLIT_TILES row, else its first FP8_TILES row (_split_row, _fp8_split_row). A causal step of
# a few rows (speculative decoding's) splits as well, by masked split variants (split_masked):
# batch 1, 4 causal rows, 32k keys, 32 heads on 8 at head dim 128 102 us split against 400 whole.
SPLIT_KV_SMS = 132
SPLIT_KV_MAX = 128
SPLIT_KV_FILL = 0.95
SPLIT_KV_KEYS_PER_ROW = 8


def kv_splits(problem) -> int:
    """The parts split-KV cuts each tile's key blocks into (1: no split): for dense forwards (16-bit
    or e4m3) with fewer tiles than 80% of SPLIT_KV_SMS, by the rules above, where every row sees
    every key (as a causal decode step's one row does) or under a causal mask or right window bound
    with at most one row block a head (split_masked)."""
    fp8 = problem.op == "attention_fp8_forward"
    if (problem.op != "attention_forward" and not fp8) or problem.headdim > (FP8_HEADDIMS if fp8 else HEADDIMS)[-1]:
        return 1
    if not sees_every_key(problem) and not split_masked(problem):
        return 1
    block_m, block_n = split_block_m(problem), _split_tiles(problem)[1]
    tiles = problem.batch * problem.nheads * math.ceil(problem.seqlen_q / block_m)
    blocks = math.ceil(problem.seqlen_k / block_n)
    most = min(SPLIT_KV_MAX, blocks,
               problem.seqlen_k // (SPLIT_KV_KEYS_PER_ROW * max(min(problem.seqlen_q, block_m), 1)))
    if tiles == 0 or 5 * tiles >= 4 * SPLIT_KV_SMS or most < 2:
        return 1
    fill = {}  # parts -> the fraction of the SMs its waves keep busy
    for parts in range(1, most + 1):
        if math.ceil(blocks / math.ceil(blocks / parts)) == parts:  # (else some part would be empty)
            waves = tiles * parts / SPLIT_KV_SMS
            fill[parts] = waves / math.ceil(waves)
    best = max(fill.values())
    return next(parts for parts, f in fill.items() if f >= SPLIT_KV_FILL * best)


def split_masked(problem) -> bool:
    """Whether a masked problem may run split (kv_splits): a few query rows (at most split_block_m,
    one row block a head) under a causal mask or a right window bound, with no left bound hiding
    keys (a split part takes its share of every key block from 0 on: under a left window most parts
    would be empty). Speculative decoding's steps are such: each of a few new rows sees the cache and the
    new rows up to its own. The parts keep the mask (the masked split variants). (A part spans at
    least SPLIT_KV_KEYS_PER_ROW keys a row, more than the rows' ends differ by, so each row sees some
    key of every part; one that saw none would leave LSE -inf, which combine_splits weighs 0.)"""
    left = problem.window_left
    return problem.seqlen_q <= split_block_m(problem) and (left < 0 or left >= problem.seqlen_k - 1)


def split_parts(problem) -> int | None:
    """The parts the problem's split variant runs (kv_splits), or None where a whole variant runs
    it. FP8 decode steps with query heads as rows (q's descales one a row, which only the split
    variants read) run split, in one part if need be; FP8 with k and v descales per 192 rows never
    (the split variants take blocks of 128 keys)."""
    if problem.wide_key_blocks:
        return None
    parts = kv_splits(problem)
    return parts if parts > 1 or problem.q_descale_per_row else None


def split_workspace(problem) -> dict[str, tuple[tuple[int, ...], str]]:
    """Family.workspace of fwd_sm90: split-KV's float32 partials, (batch, parts, seqlen_q, nheads,
    headdim) and (batch, parts, nheads, seqlen_q); none without a split."""
    parts = split_parts(problem)
    if parts is None:
        return {}
    b, sq, h = problem.batch, problem.seqlen_q, problem.nheads
    return {"o_partial": ((b, parts, sq, h, problem.headdim), "float32"), "lse_partial": ((b, parts, h, sq), "float32")}


def _select_split(problem, headdim: int, forced: bool) -> FwdSm90Variant | None:
    """The split variant that runs this problem at its compiled head dim, or None: none without
    split_parts, nor where a table row is forced (benchmarks, tests), unless q's descales are one a
    row (only the split variants read them so)."""
    parts = split_parts(problem)
    if parts is None or (forced and not problem.q_descale_per_row):
        return None
    fp8 = problem.op == "attention_fp8_forward"
    masked, few = not sees_every_key(problem), few_rows(problem)
    variant = (_fp8_split_variant(problem.out_dtype, headdim, masked, few) if fp8
               else _split_variant(problem.dtype, headdim, problem.softcap > 0, masked, few))
    check_split_parts(problem, variant, parts)
    return variant


def check_split_parts(problem, variant, parts: int) -> None:
    """A split variant's limits for `parts` parts (ValueError): its tile indices in int32, and e4m3's
    key blocks per part, which the transposing warps count in 16 bits."""
    if variant.dtype == FP8:
        _check_transposed_blocks(variant, problem.seqlen_k, parts)
    check_tile_count(variant.family, problem, variant, parts)


# The unmasked split variants' tile rows where they are not the longest-key row of TILES (16-bit) or
# the first row of FP8_TILES (e4m3). A part's last key block is computed after its bytes have come,
# while the memory idles for that SM, so narrower blocks shorten each part's tail. Measured on H100
# at head dim 128 (decode rows of bench.DECODE_SHAPES, K and V from memory, graphs replayed
# interleaved, two alternations; benchmarks/NOTES-sm90.md, session 38): 128-key blocks in 2 stages
# against 192 in 2, 1-4% faster on every split row; in 3 stages 0-2% slower than in 2. Retuned on
# H200 (session 54, same rows, in-process A/B, then tree against tree in alternating processes): 16
# bits at 128, 64-key blocks in 3 stages 1-5% faster than 128 in 2 (64 in 2 or 4 stages and 80 in 2
# or 3 slower); e4m3 at 256 tile-synchronised 2-9% faster than ping-pong. Not taken: e4m3 at 128 two
# stages in ping-pong turns (-0.4% to +5% over the first row's three, tile-synchronised, but 41 R2UR
# in its main loop, test_kernels_offline's bound 16, and the rows of one query row, where it paid,
# since take the one-consumer row); 16 bits at 256 in ping-pong turns (+3.5-5% at 16k keys, -5% at
# 4k); other rows for the masked (speculative steps') variants (at 128, 192 keys in ping-pong turns
# without overlap_pv +4-6% with 4 causal rows but -1% with 8; 128 keys +1-4% where H100 had found
# -3-5% at 32k keys). Since then the decode rows themselves take the one-consumer rows below: these
# serve split parts of more query rows (up to a row block a head), where they were not measured.
SPLIT_TILES = {128: (2, 64, 3, "pingpong", "overlap")}
FP8_SPLIT_TILES = {256: (2, 128, 2, "tile", "overlap", False)}
# Unmasked split parts of at most ROWS_PER_CONSUMER query rows (few_rows: a decode step's one row a
# query head, or GQA's query heads as the rows of their kv head) take one consumer warpgroup, which
# holds them all, with no turns to take: with two, the second only waited for each block and arrived
# on its empty barriers. H200 (session 54, in-process A/B over the rows above, two alternations): 16
# bits at 128 64 keys x 2 stages +0.7-10% on every split row of one query row (batch 1, 8k keys, 64
# heads on 8, 16.6 -> 15.5 us; 1k keys 9.8 -> 8.9; MHA with 32k keys +0.7%), where 3 or 4 stages,
# 128 or 192 keys and the other schedules ranged 0.92-1.10; at 256 64 x 3 +1-4%; at 64 (the MQA
# step's 32 rows) 128 x 2 +4%; e4m3 at 128 128 x 2 +13-21% over two consumers in ping-pong turns
# (batch 1, 32k keys, 30.1 -> 25.0 us), +20-27% over the first FP8_TILES row; at 256 0.96 (not
# taken). Launched two an SM (__launch_bounds__(256, 2)) with the parts counted for 264 CTAs they
# were 3-5% slower on the long rows; counted for 132, as fast as one an SM.
SPLIT_ONE_CONSUMER_TILES = {64: (1, 128, 2, "free", "overlap"), 128: (1, 64, 2, "free", "overlap"),
                            256: (1, 64, 3, "free", "overlap")}
FP8_SPLIT_ONE_CONSUMER_TILES = {128: (1, 128, 2, "free", "overlap", False)}


def few_rows(problem) -> bool:
    """Whether a tile's query rows fit one consumer warpgroup (a decode step's, GQA's query heads as
    the rows of their kv head): its unmasked split variant then has one (SPLIT_ONE_CONSUMER_TILES)."""
    return problem.seqlen_q <= ROWS_PER_CONSUMER


def _split_row(headdim: int, softcap: bool, masked: bool, few: bool) -> tuple[int, int, int, str, str]:
    return _unmasked_split_row(SPLIT_ONE_CONSUMER_TILES, SPLIT_TILES, headdim, masked or softcap, few,
                               _rows(headdim, softcap)[-1][1])


def _fp8_split_row(headdim: int, masked: bool, few: bool) -> tuple[int, int, int, str, str, bool]:
    """e4m3's split variants take the head dim's FP8_SPLIT_ONE_CONSUMER_TILES or FP8_SPLIT_TILES row
    (unmasked) or else its first FP8_TILES row; V transposed in the kernel either way: a decode
    step's keys are read once, and a V^T pass would read them again."""
    return _unmasked_split_row(FP8_SPLIT_ONE_CONSUMER_TILES, FP8_SPLIT_TILES, headdim, masked, few,
                               FP8_TILES[headdim][0][1])


def _unmasked_split_row(one_consumer: dict, split: dict, headdim: int, masked: bool, few: bool, otherwise: tuple):
    """A split variant's row: unmasked, the head dim's one-consumer row (few rows) or split row, where
    the tables have one; else `otherwise`."""
    if not masked:
        if few and headdim in one_consumer:
            return one_consumer[headdim]
        if headdim in split:
            return split[headdim]
    return otherwise


def split_block_m(problem) -> int:
    """Query rows of a tile of the problem's split variant (its tile row's consumers' rows)."""
    return ROWS_PER_CONSUMER * _split_tiles(problem)[0]


def _split_tiles(problem) -> tuple:
    if problem.op == "attention_fp8_forward":
        return _fp8_split_row(compiled_headdim(problem.headdim, FP8_HEADDIMS), not sees_every_key(problem),
                              few_rows(problem))
    return _split_row(compiled_headdim(problem.headdim, HEADDIMS), problem.softcap > 0, not sees_every_key(problem),
                      few_rows(problem))


def _rows(headdim: int, softcap: bool):
    return ((None, SOFTCAP_TILES[headdim]),) if softcap else TILES[headdim]


def _tiles(headdim: int, seqlen_k: int, softcap: bool) -> tuple[int, int, int, str, str]:
    return next(tiles for bound, tiles in _rows(headdim, softcap) if bound is None or seqlen_k <= bound)


def mask_fields(table: dict, headdim: int, problem) -> tuple[bool, bool]:
    """(pass_by, masked) for this head dim and problem: whether a causal or window mask applies, and
    `table`'s pass-by choice (PASS_BY, FP8_PASS_BY) for it. Masked problems run variants of their own
    (the kernel's kMasked: a warpgroup's diagonal block at half width where it can), so that the
    unmasked ones keep their smaller code (benchmarks/NOTES-sm90.md, version 37)."""
    masked = problem.window_left >= 0 or problem.window_right >= 0
    return table[headdim][masked], masked


def mask_choices(table: dict, headdim: int) -> tuple[tuple[bool, bool], ...]:
    """Every (pass_by, masked) pair mask_fields makes for this head dim."""
    return tuple((table[headdim][masked], masked) for masked in (False, True))


def variants_for(compute_capability: tuple[int, int]) -> tuple[Variant, ...]:
    whole = tuple(FwdSm90Variant(dtype, dtype, hd, *tiles, varlen, softcap, *mask, False) for dtype in sorted(CXX_TYPES)
                  for hd in HEADDIMS for varlen in (False, True) for softcap in (False, True)
                  for _, tiles in _rows(hd, softcap) for mask in mask_choices(PASS_BY, hd))
    split = tuple(dict.fromkeys(_split_variant(dtype, hd, softcap, masked, few) for dtype in sorted(CXX_TYPES)
                                for hd in HEADDIMS for softcap in (False, True) for masked in (False, True)
                                for few in (False, True)))
    return whole + split + tuple(CombineSplitsVariant(dtype) for dtype in sorted(CXX_TYPES))


# Whether the masked split variants pass blocks by (a warpgroup whose rows see none of a part's keys, or
# that has no rows: a step's few rows are all in the first), per compiled head dim. Measured on H100
# (benchmarks/NOTES-sm90.md, session 37; causal steps of 4 rows): at 128 1-10% slower with it (GQA
# 32/8, 8k and 32k keys), at 256 even, and there it keeps ptxas' loop counters uniform (5 R2UR in
# the main loop against 32 without; test_kernels_offline bounds them). At 64 it would take the MQA
# step from 57 to 38 us, but ptxas then leaves 46 R2UR in the loop: not taken until that is fixed.
# 192 not measured: as 128.
SPLIT_MASKED_PASS_BY = {64: False, 128: False, 192: False, 256: True}
# As SPLIT_MASKED_PASS_BY, for the e4m3 masked split variants. At 64 ptxas keeps their counters
# uniform passing blocks by (offline: 0 R2UR, 2 without), unlike the 16-bit ones, and it pays as the
# 16-bit measurement said it would: H100, causal steps, K and V from memory (NOTES-fp8, session 38),
# 4 rows with 8 heads on 1 and 64k keys, or 32 on 8 and 16k, 53 -> 35 us; batch 2, 8 rows, 16 on 2,
# 8k keys 31 -> 21. At 128 and 256 the 16-bit choices, not timed in e4m3 (0 / 0 R2UR; 79 at 256
# without pass-by).
FP8_SPLIT_MASKED_PASS_BY = {64: True, 128: False, 256: True}


def _split_variant(dtype: str, headdim: int, softcap: bool, masked: bool, few: bool) -> FwdSm90Variant:
    """The split variant of this head dim (unmasked: every row sees every key; masked: split_masked;
    few: few_rows)."""
    pass_by = SPLIT_MASKED_PASS_BY[headdim] if masked else PASS_BY[headdim][False]
    return FwdSm90Variant(dtype, dtype, headdim, *_split_row(headdim, softcap, masked, few), False, softcap, pass_by,
                          masked, False, split_kv=True)


def fp8_tile_rows(headdim: int) -> list[tuple[int, int, int, str, str, bool]]:
    """Every tile row the e4m3 kernel may take at this compiled head dim: FP8_TILES' rows, then the
    FP8_PER_HEAD_TILES row (wider blocks: per-head k and v descales only, select_fp8)."""
    return [tiles for _, tiles in FP8_TILES[headdim]] + ([FP8_PER_HEAD_TILES[headdim]]
                                                         if headdim in FP8_PER_HEAD_TILES else [])


def fp8_variants_for(compute_capability: tuple[int, int]) -> tuple[Variant, ...]:
    attention = tuple(variant for out in sorted(CXX_TYPES) for hd in FP8_HEADDIMS for tiles in fp8_tile_rows(hd)
                      for variant in fp8_row_variants(out, hd, tiles))
    split = tuple(dict.fromkeys(_fp8_split_variant(out, hd, masked, few) for out in sorted(CXX_TYPES)
                                for hd in FP8_HEADDIMS for masked in (False, True)
                                for few in (False, True)))  # (their combine_splits is among fwd_sm90's variants)
    return attention + split + ((TransposeVFp8Variant(),) if any(v.v_pretransposed for v in attention) else ())


def _fp8_split_variant(out_dtype: str, headdim: int, masked: bool, few: bool) -> FwdSm90Variant:
    """The e4m3 split variant of this head dim (masked: split_masked; few: few_rows)."""
    tiles = _fp8_split_row(headdim, masked, few)
    pass_by = FP8_SPLIT_MASKED_PASS_BY[headdim] if masked else FP8_PASS_BY[headdim][False]
    return FwdFp8Sm90Variant(FP8, out_dtype, headdim, *tiles[:5], False, False, pass_by, masked, tiles[5], False,
                             split_kv=True)


def _token_strides(problem, array) -> tuple[int, ...]:
    """The strides TMA walks, in elements: heads, tokens (and batch when dense). TMA never steps
    along an axis of extent 1, so its stride (0 in an `x[None]` view, say) is replaced by the
    packed one over the next inner axis, which the driver accepts."""
    strides, packed = [], array.shape[-1]
    for axis in ((1, 0) if problem.varlen else (2, 1, 0)):
        strides.append(array.strides[axis] if array.shape[axis] > 1 else packed)
        packed = strides[-1] * array.shape[axis]
    return tuple(strides)


def check_loadable(family: str, problem, inputs, names=("q", "k", "v")) -> None:
    """The named inputs (q, k, v and, for the backward, dout) can be described by TMA descriptors
    (ValueError otherwise)."""
    if problem.seqlen_q == 0 or problem.seqlen_k == 0 or (problem.varlen and not (problem.total_q and problem.total_k)):
        raise ValueError(f"{family} loads through TMA descriptors, which cannot describe an empty {', '.join(names)}")
    size = ELEMENT_SIZE[problem.dtype]
    require_rows_aligned(family, inputs, names, size)
    for name in names:
        if not tma.strides_encodable([s * size for s in _token_strides(problem, inputs[name])]):
            raise ValueError(f"{family} loads {name} with TMA, which needs positive strides below 2^40 bytes; "
                             f"got strides {inputs[name].strides}")


def check_tile_count(family: str, problem, variant, parts: int = 1) -> None:
    # tile indices run up to num_tiles + gridDim.x (one CTA per SM) in int32
    if math.ceil(problem.seqlen_q / variant.block_m) * problem.nheads * problem.batch * parts >= 2**31 - 2**16:
        raise ValueError(f"{family} numbers its output tiles with int32: batch * nheads * seqlen_q / block_m is too "
                         "large")


def select(problem, inputs) -> FwdSm90Variant:
    check_headdim("fwd_sm90", problem.headdim, HEADDIMS[-1])
    check_loadable("fwd_sm90", problem, inputs)
    headdim = compiled_headdim(problem.headdim, HEADDIMS)
    split = _select_split(problem, headdim, bool(tiles_override and headdim in tiles_override))
    if split:
        return split
    tiles = (tiles_override[headdim] if tiles_override and headdim in tiles_override
             else _tiles(headdim, problem.seqlen_k, problem.softcap > 0))
    variant = FwdSm90Variant(problem.dtype, problem.dtype, headdim, *tiles, problem.varlen, problem.softcap > 0,
                             *mask_fields(PASS_BY, headdim, problem), False)
    check_tile_count("fwd_sm90", problem, variant)
    return variant


def fp8_forced_row(headdim: int) -> tuple[int, int, int, str, str, bool] | None:
    """The row fp8_tiles_override forces at this compiled head dim (benchmarks, tests), or None."""
    return fp8_tiles_override.get(headdim) if fp8_tiles_override else None


def fp8_tiles(problem) -> tuple[int, int, int, str, str, bool]:
    """The FP8_TILES row (or the override) for this problem's compiled head dim and seqlen_q, or its
    V^T-beforehand row where FP8_SHORT_KEYS_PRETRANSPOSED says so; but the in-kernel row where
    FP8_MASKED_IN_KERNEL_ROWS says so or the V^T kernel's grid (a block row per kv head and batch)
    cannot hold the problem."""
    headdim = compiled_headdim(problem.headdim, FP8_HEADDIMS)
    forced = fp8_forced_row(headdim)
    if forced is not None:
        return forced
    if problem.wide_key_blocks:  # k's and v's descales per block of its keys
        return FP8_PER_HEAD_TILES[headdim]
    rows = FP8_TILES[headdim]
    short_keys = FP8_SHORT_KEYS_PRETRANSPOSED.get(headdim)
    in_kernel = next(tiles for _, tiles in rows if not tiles[5])
    if short_keys is not None and short_keys <= problem.seqlen_q and problem.seqlen_k <= problem.seqlen_q:
        tiles = next(tiles for _, tiles in rows if tiles[5])
    elif not sees_every_key(problem) and problem.seqlen_q <= FP8_MASKED_IN_KERNEL_ROWS.get(headdim, 0):
        tiles = in_kernel
    else:
        tiles = next(tiles for bound, tiles in rows if bound is None or problem.seqlen_q <= bound)
    if tiles[5] and max(problem.batch, problem.nheads_kv) > MAX_GRID_YZ:
        tiles = in_kernel
    return tiles


def v_transposed_shape(batch: int, seqlen_k: int, nheads_kv: int, headdim: int) -> tuple[int, int, int, int]:
    """The V^T workspace of the pre-transposed FP8 forward: (batch, nheads_kv, headdim, seqlen_k
    padded to V_TRANSPOSED_KEY_ALIGN)."""
    return (batch, nheads_kv, headdim, -(-seqlen_k // V_TRANSPOSED_KEY_ALIGN) * V_TRANSPOSED_KEY_ALIGN)


def _v_transposed_shape(problem) -> tuple[int, int, int, int] | None:
    """v_transposed_shape when this FP8 problem runs pre-transposed, else None. From the problem alone
    (Family.workspace); None for a head dim the family refuses (select says why: above 256, or rows
    that are not 16-byte multiples)."""
    if problem.headdim > FP8_HEADDIMS[-1] or problem.headdim % ROW_ALIGN_BYTES or not fp8_tiles(problem)[5]:
        return None
    return v_transposed_shape(problem.batch, problem.seqlen_k, problem.nheads_kv, problem.headdim)


def tensor_row_sums_fit(headdim: int, tiles: tuple) -> bool:
    """Whether the e4m3 kernel at this compiled head dim and tile row sums P's rows on the tensor
    cores (FP8_TENSOR_ROW_SUMS: not where three consumers take more than 128 keys, whose four more
    accumulators spill there: the FP8_PER_HEAD_TILES row at 64; at 256 not on the ping-pong row)."""
    return (headdim in FP8_TENSOR_ROW_SUMS and (tiles[0] == 2 or tiles[1] <= 128)
            and (headdim <= 128 or tiles[3] != "pingpong"))


def fp8_variant(out_dtype: str, headdim: int, tiles: tuple, mask: tuple[bool, bool], with_lse: bool,
                kv_per_head: bool, fast_exp: bool = False) -> FwdSm90Variant:
    """The e4m3 (whole, not split) variant of this tile row for a call with this (pass_by, masked)
    (mask_fields) that returns the LSE or not, with k and v descales per head or not: without the
    LSE, P's row sums on the tensor cores where they fit (FP8_TENSOR_ROW_SUMS), on the rows
    FP8_EXP_ON_FMA names some exponentials on the FMA pipe, and with per-head descales where
    FP8_STALE_MAX says a stale running maximum, and with fast_exp (Problem.fast_exp) P's e4m3
    codes straight from the scores (the kernel's kExpCodes) instead of any exponential; with it, on
    FP8_LSE_EXP_PAIRS' rows, some pairs of exponentials on the FMA pipe in f16x2."""
    row = (headdim, tuple(tiles))
    exp_on_fma = (FP8_LSE_EXP_PAIRS if with_lse else FP8_EXP_ON_FMA).get(row, (0, 0))[mask[1]]
    sums = not with_lse and tensor_row_sums_fit(headdim, tiles)
    stale_max = FP8_STALE_MAX.get(row, 0) if kv_per_head and sums else 0
    codes = fast_exp and sums
    return FwdFp8Sm90Variant(FP8, out_dtype, headdim, *tiles[:5], False, False, *mask, tiles[5], sums,
                             exp_on_fma=0 if codes else exp_on_fma, exp_fma_pairs=with_lse and exp_on_fma > 0,
                             stale_max=stale_max, exp_codes=codes)


def fp8_row_variants(out_dtype: str, headdim: int, tiles: tuple,
                     kv_per_head: tuple[bool, ...] = (True, False)) -> tuple[FwdSm90Variant, ...]:
    """Every fp8_variant of this tile row: masked or not, with the LSE or not, for k and v descales
    per head or not (of `kv_per_head`'s kinds), with fast_exp or not (once each)."""
    return tuple(dict.fromkeys(fp8_variant(out_dtype, headdim, tiles, mask, with_lse, per_head, fast_exp)
                               for mask in mask_choices(FP8_PASS_BY, headdim) for with_lse in (True, False)
                               for per_head in kv_per_head for fast_exp in (False, True)))


def fp8_workspace(problem) -> dict[str, tuple[tuple[int, ...], str]]:
    shape = _v_transposed_shape(problem)
    return {**split_workspace(problem), **({} if shape is None else {"v_transposed": (shape, FP8)})}


def _check_transposed_blocks(variant, seqlen_k: int, parts: int = 1) -> None:
    """A tile's key blocks (a split part's: `parts` of them), which the transposing warps count in 16 bits."""
    if math.ceil(math.ceil(seqlen_k / variant.block_n) / parts) > FP8_MAX_KEY_BLOCKS:
        raise ValueError(f"fwd_fp8_sm90 takes at most {FP8_MAX_KEY_BLOCKS * variant.block_n * parts} keys per "
                         f"sequence here; got seqlen_k {seqlen_k}")


def _wider_row_pays(problem, headdim: int, tiles: tuple) -> bool:
    """Whether a call with per-head k and v descales gives the pre-transposed FP8_TILES row `tiles`
    up for its head dim's FP8_PER_HEAD_TILES row: not where a row is forced (fp8_forced_row), nor
    where the call, without the LSE, would lose P's row sums on the tensor cores, which `tiles`
    holds and the wider row has no room for (head dim 64: the sums measured the faster; a forced
    wide row keeps the fp32 sums)."""
    wider = FP8_PER_HEAD_TILES.get(headdim)
    if wider is None or not tiles[5] or fp8_forced_row(headdim) is not None:
        return False
    return problem.with_lse or not tensor_row_sums_fit(headdim, tiles) or tensor_row_sums_fit(headdim, wider)


def select_fp8(problem, inputs) -> FwdSm90Variant:
    check_headdim("fwd_fp8_sm90", problem.headdim, FP8_HEADDIMS[-1])
    check_loadable("fwd_fp8_sm90", problem, inputs)
    for name in ("q_descale", "k_descale", "v_descale"):
        if any(abs(s) >= 2**31 for s in inputs[name].strides):
            raise ValueError(f"fwd_fp8_sm90 indexes {name} with int32 strides; got {inputs[name].strides}")
    headdim = compiled_headdim(problem.headdim, FP8_HEADDIMS)
    split = _select_split(problem, headdim, fp8_forced_row(headdim) is not None)
    if split:
        return split
    tiles = fp8_tiles(problem)
    kv_per_head = all(len(inputs[name].shape) == 2 for name in ("k_descale", "v_descale"))
    if kv_per_head and _wider_row_pays(problem, headdim, tiles):
        tiles = FP8_PER_HEAD_TILES[headdim]
    kv_rows = problem.fp8_block or reference.FP8_BLOCK
    if not kv_per_head and tiles[1] != kv_rows:  # (a forced row)
        raise ValueError(f"fwd_fp8_sm90: blocks of {tiles[1]} keys need k_descale and v_descale per head "
                         f"(batch, nheads_kv) or per {tiles[1]} rows; got descales per {kv_rows} rows")
    variant = fp8_variant(problem.out_dtype, headdim, tiles, mask_fields(FP8_PASS_BY, headdim, problem),
                          problem.with_lse, kv_per_head, problem.fast_exp)
    if variant.v_pretransposed:  # V^T is written by a kernel of one block row per (kv head, batch) first
        # (with 192-row k and v descales, which only this row takes: elsewhere fp8_tiles gave way)
        check_grid_yz("fwd_fp8_sm90", problem.nheads_kv, problem.batch,
                      f"; k and v per {reference.FP8_BLOCK} rows (kv_block={reference.FP8_BLOCK}) avoid it"
                      if problem.wide_key_blocks else "")
    if not variant.v_pretransposed:
        _check_transposed_blocks(variant, problem.seqlen_k)
    check_tile_count("fwd_fp8_sm90", problem, variant)
    return variant


def map_layout(problem, array, nheads: int, rows: int, dtype: str | None = None) -> tuple:
    """(dims, strides in bytes, box) of the TMA descriptor of q, k, v (or dout, or out: of `dtype`
    when not the problem's) for boxes of one swizzle row by `rows` tokens of one head: everything
    tma.encode_tiled takes but the address."""
    size = ELEMENT_SIZE[dtype or problem.dtype]
    strides = tuple(s * size for s in _token_strides(problem, array))
    atom = SWIZZLE_ROW_BYTES // size  # elements of one swizzle row: the box's inner extent
    if problem.varlen:
        return (problem.headdim, nheads, array.shape[0]), strides, (atom, 1, rows)
    return (problem.headdim, nheads, array.shape[1], problem.batch), strides, (atom, 1, rows, 1)


def write_tensor_maps(struct: ParamStruct, params: bytearray, dtype: str, maps, arrays: dict) -> None:
    """The tensor maps `maps` describes ((field, array name, map_layout) triples, made once per
    layout) encoded at the addresses of `arrays` and written into `params` (tma.encode_tiled
    remembers each map by address)."""
    for field, name, (dims, strides, box) in maps:
        struct.write(params, field, tma.encode_tiled(dtype, arrays[name].ptr, dims, strides, box))


_DESCALES = ("q_descale", "k_descale", "v_descale")


def _descale_strides(inputs) -> tuple:
    """The (batch, head, block) strides of the three descales, as the kernel takes them: one triple
    per dimension; zeros without descales (16-bit)."""
    if _DESCALES[0] not in inputs:
        return (0, 0, 0), (0, 0, 0), (0, 0, 0)
    strides = [tuple(inputs[n].strides) + (0,) * (3 - len(inputs[n].strides)) for n in _DESCALES]  # (batch, heads): no block stride
    return tuple(tuple(s[d] for s in strides) for d in range(3))


def _q_descale_shift(problem) -> int:
    """The split variants' q_descale_shift: q's descales per 128 rows (or per head: the block stride
    is 0), or one a row, as kernels.forward.heads_as_rows views a decode step's."""
    return 0 if problem.q_descale_per_row else 7


# Successive launches take successive tile-counter slots (see tile_counters in the kernel).
_counter_slots = itertools.cycle(range(TILE_COUNTERS))


def _v_transposed_map_layout(variant: FwdSm90Variant, vt_shape: tuple[int, int, int, int]) -> tuple:
    """The layout of V^T's TMA descriptor over the V^T workspace (v_transposed_shape, contiguous):
    boxes of 128 keys (one swizzle row) by the compiled head dim's rows, of one kv head."""
    batch, nheads_kv, headdim, seqlen_pad = vt_shape
    return ((seqlen_pad, headdim, nheads_kv, batch),
            (seqlen_pad, headdim * seqlen_pad, nheads_kv * headdim * seqlen_pad),
            (SWIZZLE_ROW_BYTES, variant.headdim, 1, 1))


def _prepare_transpose_v(problem, v, vt):
    """launch(v, vt, stream) of the pass that writes e4m3 v (batch, seqlen_k, nheads_kv, headdim)
    into the V^T workspace vt (v_transposed_shape, contiguous). It moves 16-byte chunks of v's rows:
    select's check_loadable has made them (the head dim, in bytes) 16-byte aligned."""
    assert problem.headdim % 16 == 0 and v.ptr % 16 == 0, "v's rows are 16-byte aligned (check_loadable)"
    transpose = TransposeVFp8Variant()
    batch, nheads_kv, headdim, seqlen_pad = vt.shape
    runs = -(-seqlen_pad // (transpose.group_run * V_TRANSPOSED_KEY_ALIGN))
    units = runs * transpose.group_run * (headdim // 16)  # a key group by a 16-byte chunk each
    template = TRANSPOSE_V_STRUCT.template(v_stride_b=v.strides[0], v_stride_s=v.strides[1], v_stride_h=v.strides[2],
                                           seqlen=problem.seqlen_k, seqlen_pad=seqlen_pad, nheads=nheads_kv,
                                           headdim=headdim)
    function = jit.get_function(transpose, problem.device.index)
    grid = (math.ceil(units / transpose.threads), nheads_kv, batch)

    def launch(v, vt, stream) -> None:
        params = bytearray(template)
        TRANSPOSE_V_STRUCT.write(params, "v", v.ptr)
        TRANSPOSE_V_STRUCT.write(params, "vt", vt.ptr)
        function(grid, (transpose.threads,), (TRANSPOSE_V_STRUCT.argument(params),), stream=stream)

    return launch


# Masked problems from this many keys draw every tile in a window; with fewer, only the last
# wave's worth of heads: windows throughout measured -4% at head dim 256, causal 1k (and -1.5% at
# 512), where a window's K and V (32 MB) outgrow what head by head keeps in L2 while the problem is
# nearly memory-bound; from 2k they measured +3 to +8% (NOTES-sm90.md, version 45).
TILE_WINDOW_MIN_KEYS = 2048


def tile_window(pairs: int, blocks_m: int, ctas: int, seqlen_k: int) -> tuple[int, int]:
    """(window_pair0, window_heads) of the masked variants' tile order (tile_at in the kernel): the
    (batch, head) pairs before window_pair0 go head by head, those after in windows of window_heads,
    row block major within each. A window needs at least one tile per CTA. From
    TILE_WINDOW_MIN_KEYS keys every pair is in a window: the fewest pairs that divide `pairs`, up to
    twice that many (a window's K and V then stay in L2), else head by head. Below, one window of
    that many at the end, which balances the draw's last tiles and leaves the rest head by head.
    Head by head throughout where a head alone has a tile per CTA."""
    least = -(-ctas // blocks_m)
    if least <= 1:
        return 0, 1
    if seqlen_k < TILE_WINDOW_MIN_KEYS:
        heads = min(least, pairs)
        return pairs - heads, heads
    for heads in range(least, min(2 * least, pairs) + 1):
        if pairs % heads == 0:
            return 0, heads
    return 0, 1


def prepare(variant: FwdSm90Variant, function, problem, inputs, outputs, after_chain: bool = False):
    """Family.prepare: the grid, the parameter struct without addresses and the tensor maps' layouts,
    made once; each launch writes the addresses in, looks the maps up by address (tma.encode_tiled
    remembers them) and takes the next tile-counter slot. A pre-transposed e4m3 variant reads V^T
    from outputs["v_transposed"]: written from inputs["v"] by a pass the launch runs first, or
    already there. after_chain: the fwd_quantized_sm90 family's launch, the last of a chain of
    programmatic dependents (grid_dependency.cuh, ChainLink) whose kernels, launched just before,
    write all of its inputs (V^T among them; no v): it waits for them before reading any."""
    blocks_m = math.ceil(problem.seqlen_q / variant.block_m)
    # Split-KV: as many parts as the workspace holds. It was declared for the problem before JAX's
    # vmap folded more into its batch, and kv_splits may count the folded problem otherwise (never
    # splitting it where the unfolded one ran whole): select's checks, for these parts.
    parts = outputs["o_partial"].shape[1] if variant.split_kv else 1
    if variant.split_kv:
        check_split_parts(problem, variant, parts)
    num_tiles = blocks_m * problem.nheads * problem.batch * parts
    if num_tiles == 0:
        return launch_nothing
    extents = {"q": (problem.nheads, variant.block_m), "k": (problem.nheads_kv, variant.block_n),
               "v": (problem.nheads_kv, variant.block_n)}
    transpose_v = None  # the pass that writes V^T first, where the launch runs it
    if variant.v_pretransposed:  # V^T's map is of the workspace, written at each launch
        del extents["v"]
        vt_layout = _v_transposed_map_layout(variant, outputs["v_transposed"].shape)
        transpose_v = None if after_chain else _prepare_transpose_v(problem, inputs["v"], outputs["v_transposed"])
    maps = [(f"{name}_map", name, map_layout(problem, inputs[name], *extent)) for name, extent in extents.items()]
    # The epilogue's TMA stores of a consumer's rows.
    o_layout = (map_layout(problem, outputs["out"], problem.nheads, ROWS_PER_CONSUMER, variant.out_dtype)
                if variant.o_store_tma else None)
    group = problem.nheads // problem.nheads_kv
    split_blocks = math.ceil(math.ceil(problem.seqlen_k / variant.block_n) / parts)
    fields = dict(seqlen_q=problem.seqlen_q, seqlen_k=problem.seqlen_k, group=group, headdim=problem.headdim,
                  nheads=problem.nheads, blocks_m=blocks_m, num_tiles=num_tiles, num_splits=parts,
                  split_blocks=split_blocks, wait_for_inputs=int(after_chain), **mask_and_softmax_fields(problem))
    if variant.split_kv:  # the partials' strides, (batch, part) one index
        if not variant.masked:  # every row sees every key (kv_splits)
            fields.update(window_left=-1, window_right=-1)
        o_partial, lse_partial = outputs["o_partial"], outputs["lse_partial"]
        assert o_partial.strides[0] == parts * o_partial.strides[1] and lse_partial.strides[0] == parts * lse_partial.strides[1]
        fields.update(zip(("o_stride_b", "o_stride_s", "o_stride_h"), o_partial.strides[1:4]))
        fields.update(lse_stride_b=lse_partial.strides[1], lse_stride_h=lse_partial.strides[2])
        combine = _prepare_combine(problem, variant.out_dtype, parts, outputs)
    else:
        fields.update(token_stride_fields(problem, o=outputs["out"]))
        if "lse" in outputs:  # (e4m3: may be none)
            fields.update(row_stride_fields(problem, lse=outputs["lse"]))
    fields.update(zip(("descale_stride_b", "descale_stride_h", "descale_stride_block"), _descale_strides(inputs)))
    fields.update(q_descale_shift=_q_descale_shift(problem))
    sm_count = int(jit.device_properties(problem.device.index)["multiProcessorCount"])
    grid = (min(num_tiles, sm_count) if persistent else num_tiles,)
    # Varlen's tiles differ in cost by their sequence's length more than by row block: head by head.
    pair0, window = (tile_window(problem.batch * problem.nheads, blocks_m, grid[0], problem.seqlen_k)
                     if not problem.varlen else (0, 1))
    fields.update(window_heads=window, window_tiles=window * blocks_m, window_pair0=pair0)
    for name, divisor in (("blocks_m", blocks_m), ("nheads", problem.nheads), ("group", group),
                          ("window_heads", window), ("window_tiles", window * blocks_m), ("splits", parts)):
        fields.update(zip((f"{name}_mul", f"{name}_shift"), fast_divisor(divisor)))
    template = PARAMS.template(**fields)
    block, shared_mem, dtype, fp8 = (variant.threads,), variant.dynamic_shared_bytes, problem.dtype, _DESCALES[0] in inputs
    # Field -> output: out and lse (e4m3 without the LSE: no lse), or the partials, which
    # combine_splits then merges into them.
    addressed = ({"out": "o_partial", "lse": "lse_partial"} if variant.split_kv
                 else {name: name for name in ("out", "lse") if name in outputs})
    # After the V^T pass the kernel may start before the pass ends (its producer waits for the pass
    # before its first V^T load). Head dim 256, H200, over an ordinary launch: +1.5-2.7% at 1k keys,
    # +0.6-0.9% at 4k, +0.3% at 8k (within noise), +0.2% at 16k (NOTES-fp8, session 49). After the
    # chain of quantizers, its setup overlaps their tail.
    dependent = driver.DependentLaunch(function, grid, block, shared_mem) if transpose_v or after_chain else None

    def launch_prepared(inputs, outputs, stream) -> None:
        params = bytearray(template)
        write_tensor_maps(PARAMS, params, dtype, maps, inputs)
        if variant.v_pretransposed:
            vt = outputs["v_transposed"]  # contiguous, as fp8_workspace declares it
            if transpose_v:
                transpose_v(inputs["v"], vt, stream)
            PARAMS.write(params, "v_map", tma.encode_tiled(FP8, vt.ptr, *vt_layout))
        for field, name in addressed.items():
            PARAMS.write(params, field, outputs[name].ptr)
        if o_layout:
            PARAMS.write(params, "o_map", tma.encode_tiled(variant.out_dtype, outputs["out"].ptr, *o_layout))
        if problem.varlen:
            PARAMS.write_addresses(params, inputs, CU_SEQLENS)
        if fp8:
            PARAMS.write(params, "descale", *(inputs[name].ptr for name in _DESCALES))
        PARAMS.write(params, "counter_slot", next(_counter_slots))
        if dependent:
            dependent(params, stream)
        else:
            function(grid, block, (PARAMS.argument(params),), shared_mem=shared_mem, stream=stream)
        if variant.split_kv:
            combine(outputs, stream)

    return launch_prepared


def _prepare_combine(problem, out_dtype: str, parts: int, outputs):
    """launch(outputs, stream) of combine_splits: the partials of `parts` parts (the split
    variant's workspace, contiguous) into out and lse (e4m3 calls without the LSE: none), one warp
    a query row."""
    out, lse = outputs["out"], outputs.get("lse")
    assert lse is None or lse.strides[2] == 1, "lse rows are contiguous (outputs are allocated so)"
    rows = problem.batch * problem.nheads * problem.seqlen_q
    if rows >= 2**31:
        raise ValueError(f"combine_splits merges split-KV's parts one warp a query row, counted in int32: "
                         f"batch * nheads * seqlen_q = {rows} is too large")
    template = COMBINE_STRUCT.template(**dict(zip(("o_stride_b", "o_stride_s", "o_stride_h"), out.strides[:3])),
                                       **(dict(lse_stride_b=lse.strides[0], lse_stride_h=lse.strides[1]) if lse else {}),
                                       splits=parts, seqlen_q=problem.seqlen_q, nheads=problem.nheads,
                                       headdim=problem.headdim, rows=rows)
    addressed = ("o_partial", "lse_partial", "out") + (("lse",) if lse else ())
    variant = CombineSplitsVariant(out_dtype)
    function = jit.get_function(variant, problem.device.index)
    grid = (math.ceil(rows * 32 / variant.threads),)

    def launch(outputs, stream) -> None:
        params = bytearray(template)
        COMBINE_STRUCT.write_addresses(params, outputs, addressed)
        function(grid, (variant.threads,), (COMBINE_STRUCT.argument(params),), stream=stream)

    return launch


FAMILY = Family(
    name="fwd_sm90",
    backend="sm90",
    ops=("attention_forward", "attention_varlen_forward"),
    description="warp-specialised Hopper forward: TMA producer, wgmma consumers (sm_90a)",
    min_compute_capability=(9, 0),
    max_compute_capability=(9, 0),
    variants_for=variants_for,
    select=select,
    prepare=prepare,
    workspace=split_workspace,
)

FP8_FAMILY = Family(
    name="fwd_fp8_sm90",
    backend="sm90",
    ops=("attention_fp8_forward",),
    description="warp-specialised Hopper forward on e4m3 q, k, v with descales; V transposed in shared memory",
    min_compute_capability=(9, 0),
    max_compute_capability=(9, 0),
    variants_for=fp8_variants_for,
    select=select_fp8,
    prepare=prepare,
    dtypes=frozenset({FP8}),
    workspace=fp8_workspace,
)
