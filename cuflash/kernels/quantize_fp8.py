"""quantize_fp8: fp16/bf16 attention inputs to e4m3 with amax scales per head or per block of 128 rows
(descale (batch, nheads) or (batch, nheads, ceil(seqlen / 128)), one scale per block), optionally
after the random-sign Hadamard transform (cuda_src/quantize_fp8.cu; the semantics are
reference.quantize_fp8's). A CTA per run of (block, head) items, each next one copied into shared
memory while the CTA converts one where that fits (LOAD_STAGED); scales per head take three
launches (each block's amax to a workspace, a head's descale from them, the codes). Blocks of 192
rows (reference.FP8_WIDE_KEY_BLOCK) at head dim 128 serve attention(..., fp8=True)'s k and v
(fwd_quantized_sm90). Needs the e4m3 conversion of sm_89 and newer."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .. import driver, jit, reference
from . import (CXX_TYPES, MAX_GRID_YZ, Family, ParamStruct, Variant, cxx_bool, launch_nothing,
               rows_aligned)

HEADDIMS = (64, 128, 256)  # compiled; a head dim below one (a multiple of 8) runs on it, zero-filled
ELEMENT_BYTES = 2  # x is fp16 or bf16

# The kernel's QuantizeFp8Params struct, field for field, and its `pass` values.
_FIELDS = ([(name, np.uint64) for name in ("x", "x8", "descale", "block_amax")]
           + [(f"{t}_stride_{d}", np.int64) for t in ("x", "x8") for d in ("b", "s", "h")]
           + [("signs", (np.uint64, (4,)))]
           + [(name, np.int32) for name in ("seqlen", "nheads", "headdim", "pass", "items_per_cta")])
QUANTIZE_FP8_PARAMS = np.dtype({"names": [n for n, _ in _FIELDS], "formats": [f for _, f in _FIELDS],
                                "itemsize": 136})  # (padded to its 8-byte alignment)
assert QUANTIZE_FP8_PARAMS.fields["items_per_cta"][1] == 128, "keep in step with QuantizeFp8Params"
PARAMS = ParamStruct(QUANTIZE_FP8_PARAMS)
BLOCK_SCALES, HEAD_AMAX, HEAD_SCALE, HEAD_CONVERT = 0, 1, 2, 3
ELEMENTS, CHUNK = 32, 8  # kElements (a thread's), kChunk
# How a thread's chunks of x reach it (the kernel's kLoads): element by element (rows not 16-byte
# aligned), one 16-byte load a chunk, or those through shared memory, copied STAGES - 1 items ahead
# (where STAGES items of each of the CTAs an SM holds fit its shared memory).
LOAD_ELEMENTS, LOAD_VECTORS, LOAD_STAGED = 0, 1, 2
STAGES = 2  # kStages
ITEMS_PER_CTA = 4  # (block, head) items a CTA, unless fewer or more spread them better (_items_split)
MAX_ITEMS = 2**31 - 1  # the kernels count a batch entry's (block, head) items in int, never past the last


# The compiled (block rows, head dim) pairs: FP8_BLOCK at every head dim, and
# reference.FP8_WIDE_KEY_BLOCK where reference.fp8_key_block gives it (compiled head dim 128).
BLOCK_ROWS = tuple((reference.FP8_BLOCK, hd) for hd in HEADDIMS) + tuple(
    (reference.FP8_WIDE_KEY_BLOCK, hd) for hd in HEADDIMS
    if reference.fp8_key_block(hd, reference.FP8_WIDE_KEYS_FROM) == reference.FP8_WIDE_KEY_BLOCK)


def threads(block_rows: int, headdim: int) -> int:
    """quantize_threads: a block of `block_rows` rows, ELEMENTS elements a thread."""
    return block_rows * headdim // ELEMENTS


def ctas_per_sm(block_rows: int, headdim: int) -> int:
    """The CTAs an SM holds: 1024 threads, as the kernels' launch bounds ask."""
    return max(1, 1024 // threads(block_rows, headdim))


def staged_bytes(block_rows: int, headdim: int) -> int:
    """Either kernel's shared memory with LOAD_STAGED: STAGES items of x."""
    return STAGES * block_rows * headdim * ELEMENT_BYTES


def _dynamic_shared_bytes(variant) -> int:
    """Variant.dynamic_shared_bytes of either kernel's variants."""
    return staged_bytes(variant.block_rows, variant.headdim) if variant.loads == LOAD_STAGED else 0


STATIC_SHARED_BYTES = 1024  # at least either kernel's own (warp maxima and sign words: 768 bytes at most)
RESERVED_SHARED_BYTES = 1024  # shared memory the driver keeps for each CTA (sm_80 and newer)


@dataclass(frozen=True)
class QuantizeFp8Variant(Variant):
    family = "quantize_fp8"
    source = "quantize_fp8.cu"
    template = "cuflash::quantize_fp8"

    dtype: str
    block_rows: int  # rows per block scale (scales per head: FP8_BLOCK-row items)
    headdim: int  # compiled
    hadamard: bool
    loads: int  # LOAD_ELEMENTS, LOAD_VECTORS or LOAD_STAGED (the latter two: x's rows 16-byte aligned)

    def check(self) -> None:
        if self.dtype not in CXX_TYPES:
            raise ValueError(f"quantize_fp8: dtype {self.dtype} is not one of {sorted(CXX_TYPES)}")
        if self.headdim not in HEADDIMS:
            raise ValueError(f"quantize_fp8: headdim {self.headdim} is not one of {HEADDIMS}")
        if (self.block_rows, self.headdim) not in BLOCK_ROWS:
            raise ValueError(f"quantize_fp8: blocks of {self.block_rows} rows at head dim {self.headdim} are not "
                             f"among the compiled {BLOCK_ROWS}")
        if self.loads not in (LOAD_ELEMENTS, LOAD_VECTORS, LOAD_STAGED):
            raise ValueError(f"quantize_fp8: loads {self.loads} is not one of LOAD_ELEMENTS, LOAD_VECTORS, LOAD_STAGED")

    def template_args(self) -> tuple[str, ...]:
        return (CXX_TYPES[self.dtype], str(self.block_rows), str(self.headdim), cxx_bool(self.hadamard),
                str(self.loads))

    dynamic_shared_bytes = property(_dynamic_shared_bytes)


VARIANTS = tuple(QuantizeFp8Variant(dtype, block_rows, headdim, hadamard, loads) for dtype in sorted(CXX_TYPES)
                 for block_rows, headdim in BLOCK_ROWS for hadamard in (False, True)
                 for loads in (LOAD_STAGED, LOAD_VECTORS, LOAD_ELEMENTS))


@dataclass(frozen=True)
class QuantizeFp8TransposedVariant(Variant):
    """V to e4m3 V^T with one descale per block of keys (cuda_src/quantize_fp8.cu, quantize_fp8_vt):
    attention(..., fp8=True)'s V, quantized straight into the layout of the pre-transposed FP8
    forward (launched by the fwd_quantized_sm90 family's launcher)."""

    family = "fwd_quantized_sm90"
    source = "quantize_fp8.cu"
    template = "cuflash::quantize_fp8_vt"

    dtype: str
    block_rows: int  # keys per descale (reference.fp8_key_block)
    headdim: int  # compiled
    loads: int  # as QuantizeFp8Variant's (LOAD_VECTORS: an 8-byte load per key and four columns)

    def check(self) -> None:
        QuantizeFp8Variant(self.dtype, self.block_rows, self.headdim, False, self.loads).check()

    def template_args(self) -> tuple[str, ...]:
        return CXX_TYPES[self.dtype], str(self.block_rows), str(self.headdim), str(self.loads)

    dynamic_shared_bytes = property(_dynamic_shared_bytes)


TRANSPOSED_VARIANTS = tuple(QuantizeFp8TransposedVariant(dtype, block_rows, headdim, loads)
                            for dtype in sorted(CXX_TYPES) for block_rows, headdim in BLOCK_ROWS
                            for loads in (LOAD_STAGED, LOAD_VECTORS, LOAD_ELEMENTS))


def _compiled_headdim(headdim: int) -> int:
    if headdim % 8 or not 0 < headdim <= HEADDIMS[-1]:
        raise ValueError(f"quantize_fp8 takes head dims that are multiples of 8 up to {HEADDIMS[-1]}; got {headdim}")
    return next(h for h in HEADDIMS if h >= headdim)


def select(problem, inputs) -> QuantizeFp8Variant:
    headdim = _compiled_headdim(problem.headdim)
    hadamard = problem.hadamard_seed is not None
    if hadamard and headdim != problem.headdim:  # zero-filled columns would join the transform
        raise ValueError(f"quantize_fp8 applies the Hadamard transform to head dims {HEADDIMS} on GPU; "
                         f"got {problem.headdim}")
    rows = problem.fp8_block or reference.FP8_BLOCK
    variant = QuantizeFp8Variant(problem.dtype, rows, headdim, hadamard,
                                 select_loads(problem.device.index, rows_aligned(inputs["x"], ELEMENT_BYTES), rows,
                                              headdim))
    variant.check()  # (blocks of 192 rows: attention(fp8=True)'s k and v, at the head dims that take them)
    return variant


def select_loads(device_index: int, aligned: bool, block_rows: int, headdim: int) -> int:
    """Either kernel's loads: LOAD_STAGED where x's rows are 16-byte aligned and the staged items of
    as many CTAs as the launch bounds ask fit an SM's shared memory (an sm_90's 228 KiB: every
    compiled block; sm_89's 100 KiB: 192-row blocks only), else LOAD_VECTORS or,
    unaligned, LOAD_ELEMENTS."""
    if not aligned:
        return LOAD_ELEMENTS
    properties = jit.device_properties(device_index)
    need = staged_bytes(block_rows, headdim) + STATIC_SHARED_BYTES
    fits = (need <= int(properties["sharedMemPerBlockOptin"]) and ctas_per_sm(block_rows, headdim)
            * (need + RESERVED_SHARED_BYTES) <= int(properties["sharedMemPerMultiprocessor"]))
    return LOAD_STAGED if fits else LOAD_VECTORS


@lru_cache(maxsize=64)  # drawing the signs costs more than the launch
def _sign_bits(headdim: int, seed: int | None) -> tuple[int, ...]:
    """Bit j set where the transform negates element j (four 64-bit words)."""
    words = [0] * 4
    if seed is not None:
        for j in np.flatnonzero(reference.hadamard_signs(headdim, seed) < 0):
            words[int(j) // 64] |= 1 << (int(j) % 64)
    return tuple(words)


def workspace(problem) -> dict[str, tuple[tuple[int, ...], str]]:
    """Family.workspace: scales per head keep each block's amax between their first two launches."""
    if problem.fp8_block is not None:
        return {}
    return {"block_amax": ((problem.batch, problem.nheads, reference.fp8_blocks(problem.seqlen_q)), "float32")}


def check_items(batch: int, nheads: int, seqlen: int, block_rows: int) -> None:
    """The passes over x launch a row of CTAs per batch entry (grid y) over every (block, head) item."""
    blocks = reference.fp8_blocks(seqlen, block_rows)
    if blocks * nheads > MAX_ITEMS or batch > MAX_GRID_YZ:
        raise ValueError(f"quantize_fp8 launches a row of CTAs per batch entry over the {block_rows}-row "
                         f"blocks of every head: batch {batch} must be at most {MAX_GRID_YZ} and nheads x "
                         f"ceil(seqlen / {block_rows}) ({nheads} x {blocks}) at most {MAX_ITEMS}")


def _items_split(device_index: int, batch: int, nheads: int, seqlen: int, block_rows: int,
                 headdim: int) -> tuple[int, tuple[int, int]]:
    """(items a CTA, grid) of a pass over x (either kernel): consecutive (block, head) items of a
    batch entry a CTA, batch on grid y. The items spread evenly over one wave of CTAs (each SM holds
    1024 / threads of them, as the kernels' launch bounds ask) where a CTA has its SM to itself or
    that leaves fewer on the busiest SM than ITEMS_PER_CTA a CTA, else ITEMS_PER_CTA. The 192-row
    blocks' 768-thread CTAs ran 2.6 waves of 4 items on a 16k x 2048 tensor, and 11 items a CTA in
    one wave measured 1.08x (H200, session 45); head dim 256's 1024-thread CTAs, on as many items a
    CTA either way, 1.04-1.06x (staged quantize_fp8; H200, session 52). On whole waves of CTAs that
    share their SM, 4 stays: spread over one wave, head dim 64 measured 0.96x (128 1.0x)."""
    items = reference.fp8_blocks(seqlen, block_rows) * nheads
    sharing = ctas_per_sm(block_rows, headdim)
    slots = int(jit.device_properties(device_index)["multiProcessorCount"]) * sharing
    spread = -(-batch * items // slots)  # the busiest SM's items, spread evenly
    busiest = ITEMS_PER_CTA * -(-batch * -(-items // ITEMS_PER_CTA) // slots)  # ITEMS_PER_CTA a CTA
    per_cta = ITEMS_PER_CTA if sharing > 1 and busiest <= spread else spread
    return per_cta, (-(-items // per_cta), batch)


def prepare(variant: QuantizeFp8Variant, function, problem, inputs, outputs, dependent: bool = False):
    """Family.prepare: the grid and the parameter structs without addresses, made once; each launch
    writes the arrays' addresses in. Scales per head take three launches, on sm_90 and newer the
    second and third each the programmatic dependent of the one before (driver.DependentLaunch; the
    kernel waits for it before reading what it wrote; below sm_90 the kernels cannot wait, so every
    launch is an ordinary one). dependent: the first too, as a link of fwd_quantized_sm90's chain
    (the kernel's ChainLink), which its caller may ask only where the launch before writes nothing
    this one reads or writes."""
    # A CTA per `per_cta` (block of variant.block_rows rows, head) items (a sequence shorter than a
    # block is one short block), the heads of a block next to each other; batch on grid y.
    # descale (batch, nheads, blocks) or (batch, nheads), contiguous, as api.quantize_fp8 allocates
    # it; x8 too (its 8-element chunks are stored 8 bytes at a time).
    rows = variant.block_rows
    blocks = reference.fp8_blocks(problem.seqlen_q, rows)
    assert problem.fp8_block in (None, rows) and (problem.fp8_block or rows == reference.FP8_BLOCK), problem.fp8_block
    if blocks * problem.nheads * problem.batch == 0:
        return launch_nothing
    check_items(problem.batch, problem.nheads, problem.seqlen_q, rows)
    x8 = outputs["x8"]
    assert x8.ptr % CHUNK == 0 and all(s % CHUNK == 0 for s in x8.strides[:3]), "x8 is cuflash's own, contiguous"
    per_cta, items = _items_split(problem.device.index, problem.batch, problem.nheads, problem.seqlen_q, rows,
                                  variant.headdim)
    fields = dict(signs=_sign_bits(problem.headdim, problem.hadamard_seed), seqlen=problem.seqlen_q,
                  nheads=problem.nheads, headdim=problem.headdim, items_per_cta=per_cta)
    for name, x in (("x", inputs["x"]), ("x8", x8)):
        fields.update(zip((f"{name}_stride_b", f"{name}_stride_s", f"{name}_stride_h"), x.strides[:3]))
    passes = ([(BLOCK_SCALES, items)] if problem.fp8_block else
              [(HEAD_AMAX, items), (HEAD_SCALE, (problem.nheads, problem.batch)), (HEAD_CONVERT, items)])
    block_dim = (threads(rows, variant.headdim),)
    waits = jit.device_compute_capability(problem.device.index) >= (9, 0)  # griddepcontrol is sm_90's
    launches = [(PARAMS.template(**fields, **{"pass": p}),
                 _launcher(function, grid, block_dim, 0 if p == HEAD_SCALE else variant.dynamic_shared_bytes,
                           dependent or (waits and i > 0)))  # (HEAD_SCALE reads no x)
                for i, (p, grid) in enumerate(passes)]
    written = ("x8", "descale") + (() if problem.fp8_block else ("block_amax",))

    def launch_prepared(inputs, outputs, stream) -> None:
        for template, launch in launches:
            params = bytearray(template)
            PARAMS.write_addresses(params, inputs, ("x",))
            PARAMS.write_addresses(params, outputs, written)
            launch(params, stream)

    return launch_prepared


def prepare_transposed(variant: QuantizeFp8TransposedVariant, function, device_index: int, batch: int, seqlen: int,
                       nheads: int, headdim: int, v, vt, dependent: bool = False):
    """launch(v, vt, descale, stream) of quantize_fp8_vt: v (batch, seqlen, nheads, headdim) laid out
    as `v`, into vt (batch, nheads, headdim, seqlen padded to 16; contiguous) with one descale per
    block of variant.block_rows keys (batch, nheads, blocks; contiguous). Items and grid as `prepare`'s;
    dependent as theirs."""
    blocks = reference.fp8_blocks(seqlen, variant.block_rows)
    if blocks * nheads * batch == 0:
        return lambda v, vt, descale, stream: None
    check_items(batch, nheads, seqlen, variant.block_rows)
    _, _, rows, seqlen_pad = vt.shape
    assert vt.strides == (nheads * rows * seqlen_pad, rows * seqlen_pad, seqlen_pad, 1) and seqlen_pad % 16 == 0
    per_cta, grid = _items_split(device_index, batch, nheads, seqlen, variant.block_rows, variant.headdim)
    template = PARAMS.template(seqlen=seqlen, nheads=nheads, headdim=headdim, x_stride_b=v.strides[0],
                               x_stride_s=v.strides[1], x_stride_h=v.strides[2], x8_stride_b=vt.strides[0],
                               x8_stride_s=vt.strides[2], x8_stride_h=vt.strides[1], items_per_cta=per_cta,
                               **{"pass": BLOCK_SCALES})
    launch_params = _launcher(function, grid, (threads(variant.block_rows, variant.headdim),),
                              variant.dynamic_shared_bytes, dependent)

    def launch(v, vt, descale, stream) -> None:
        params = bytearray(template)
        PARAMS.write_addresses(params, dict(x=v, x8=vt, descale=descale), ("x", "x8", "descale"))
        launch_params(params, stream)

    return launch


def _launcher(function, grid: tuple[int, int], block: tuple[int], shared_mem: int, dependent: bool):
    """launch(params, stream) of `function` (either kernel, with `shared_mem` bytes of dynamic shared
    memory): as a programmatic dependent (driver.DependentLaunch), or an ordinary launch."""
    if dependent:
        return driver.DependentLaunch(function, grid, block, shared_mem)
    return lambda params, stream: function(grid, block, (PARAMS.argument(params),), shared_mem=shared_mem,
                                           stream=stream)


FAMILY = Family(
    name="quantize_fp8",
    backend="sm89",
    ops=("quantize_fp8",),
    description="fp16/bf16 to e4m3 with amax scales per head or per 128-row block, optional Hadamard transform",
    min_compute_capability=(8, 9),
    variants_for=lambda compute_capability: VARIANTS,
    select=select,
    prepare=prepare,
    workspace=workspace,
)
