"""quantize_fp8: fp16/bf16 attention inputs to e4m3 with amax scales per head or per block of 128 rows
(descale (batch, nheads) or (batch, nheads, ceil(seqlen / 128)), one scale per block), optionally
after the random-sign Hadamard transform (cuda_src/quantize_fp8.cu; the semantics are
reference.quantize_fp8's). Needs the e4m3 conversion of sm_89 and newer."""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .. import reference
from . import CXX_TYPES, Family, ParamStruct, Variant, check_grid_yz, cxx_bool, launch_nothing

HEADDIMS = (64, 128, 256)  # compiled; a head dim below one (a multiple of 8) runs on it, zero-filled
WARPS = 4

# The kernel's QuantizeFp8Params struct, field for field.
QUANTIZE_FP8_PARAMS = np.dtype([(name, np.uint64) for name in ("x", "x8", "descale")]
                  + [(f"{t}_stride_{d}", np.int64) for t in ("x", "x8") for d in ("b", "s", "h")]
                  + [("signs", np.uint64, (4,))]
                  + [(name, np.int32) for name in ("seqlen", "nheads", "headdim", "block")])
assert QUANTIZE_FP8_PARAMS.itemsize == 120, "keep in step with static_assert(sizeof(QuantizeFp8Params) == 120)"
PARAMS = ParamStruct(QUANTIZE_FP8_PARAMS)


@dataclass(frozen=True)
class QuantizeFp8Variant(Variant):
    family = "quantize_fp8"
    source = "quantize_fp8.cu"
    template = "cuflash::quantize_fp8"

    dtype: str
    headdim: int  # compiled
    hadamard: bool
    warps: int = WARPS

    def check(self) -> None:
        if self.dtype not in CXX_TYPES:
            raise ValueError(f"quantize_fp8: dtype {self.dtype} is not one of {sorted(CXX_TYPES)}")
        if self.headdim not in HEADDIMS:
            raise ValueError(f"quantize_fp8: headdim {self.headdim} is not one of {HEADDIMS}")

    def template_args(self) -> tuple[str, ...]:
        return CXX_TYPES[self.dtype], str(self.headdim), cxx_bool(self.hadamard), str(self.warps)


VARIANTS = tuple(QuantizeFp8Variant(dtype, headdim, hadamard)
                 for dtype in sorted(CXX_TYPES) for headdim in HEADDIMS for hadamard in (False, True))


def select(problem, inputs) -> QuantizeFp8Variant:
    if problem.headdim % 8 or not 0 < problem.headdim <= HEADDIMS[-1]:
        raise ValueError(f"quantize_fp8 takes head dims that are multiples of 8 up to {HEADDIMS[-1]}; "
                         f"got {problem.headdim}")
    headdim = next(h for h in HEADDIMS if h >= problem.headdim)
    hadamard = problem.hadamard_seed is not None
    if hadamard and headdim != problem.headdim:  # zero-filled columns would join the transform
        raise ValueError(f"quantize_fp8 applies the Hadamard transform to head dims {HEADDIMS} on GPU; "
                         f"got {problem.headdim}")
    return QuantizeFp8Variant(problem.dtype, headdim, hadamard)


@lru_cache(maxsize=64)  # drawing the signs costs more than the launch
def _sign_bits(headdim: int, seed: int | None) -> tuple[int, ...]:
    """Bit j set where the transform negates element j (four 64-bit words)."""
    words = [0] * 4
    if seed is not None:
        for j in np.flatnonzero(reference.hadamard_signs(headdim, seed) < 0):
            words[int(j) // 64] |= 1 << (int(j) % 64)
    return tuple(words)


def prepare(variant: QuantizeFp8Variant, function, problem, inputs, outputs):
    """Family.prepare: the grid and the parameter struct without addresses, made once; each launch
    writes x's, x8's and descale's addresses in."""
    # One CTA per group of rows (the whole head, or a block of reference.FP8_BLOCK rows; a sequence
    # shorter than a block is one short block), each writing its group's descale: descale
    # (batch, nheads, groups) or (batch, nheads), contiguous, as api.quantize_fp8 allocates it.
    block = problem.fp8_block or 0
    groups = reference.fp8_blocks(problem.seqlen_q) if block else 1
    assert block in (0, reference.FP8_BLOCK), block
    if groups * problem.nheads * problem.batch == 0:
        return launch_nothing
    check_grid_yz("quantize_fp8", problem.nheads, problem.batch)
    fields = dict(signs=_sign_bits(problem.headdim, problem.hadamard_seed), seqlen=problem.seqlen_q,
                  nheads=problem.nheads, headdim=problem.headdim, block=block)
    for name, x in (("x", inputs["x"]), ("x8", outputs["x8"])):
        fields.update(zip((f"{name}_stride_b", f"{name}_stride_s", f"{name}_stride_h"), x.strides[:3]))
    template = PARAMS.template(**fields)
    grid, block_dim = (groups, problem.nheads, problem.batch), (32 * variant.warps,)

    def launch_prepared(inputs, outputs, stream) -> None:
        params = bytearray(template)
        PARAMS.write_addresses(params, inputs, ("x",))
        PARAMS.write_addresses(params, outputs, ("x8", "descale"))
        function(grid, block_dim, (PARAMS.argument(params),), stream=stream)

    return launch_prepared


FAMILY = Family(
    name="quantize_fp8",
    backend="sm89",
    ops=("quantize_fp8",),
    description="fp16/bf16 to e4m3 with amax scales per head or per 128-row block, optional Hadamard transform",
    min_compute_capability=(8, 9),
    variants_for=lambda compute_capability: VARIANTS,
    select=select,
    prepare=prepare,
)
