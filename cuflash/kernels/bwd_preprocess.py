"""bwd_preprocess: delta = rowsum(dout * out) in fp32, the first step of the FlashAttention
backward (cuda_src/bwd_preprocess.cu). Memory-bound: it reads dout and out once and writes
4 bytes per row."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import CXX_TYPES, Family, Variant, check_grid_yz, compiled_headdim, launch_nothing, rows_aligned

# Compiled head dims; a smaller one runs on the next one up, reading only its own columns.
HEADDIMS = (32, 64, 96, 128, 160, 192, 224, 256)
THREADS = 128


@dataclass(frozen=True)
class BwdPreprocessVariant(Variant):
    family = "bwd_preprocess"
    source = "bwd_preprocess.cu"
    template = "cuflash::bwd_preprocess"

    dtype: str
    headdim: int
    vec: int  # elements per load: 8 (16-byte loads, needs 16-byte aligned rows) or 1
    threads: int = THREADS

    def check(self) -> None:
        if self.dtype not in CXX_TYPES:
            raise ValueError(f"bwd_preprocess: dtype {self.dtype} is not one of {sorted(CXX_TYPES)}")
        if self.vec not in (1, 8) or self.headdim % self.vec:
            raise ValueError(f"bwd_preprocess: vec={self.vec} must be 1 or 8 and divide headdim={self.headdim}")
        if self.threads % 32 or self.threads % self.lanes_per_row:
            raise ValueError(f"bwd_preprocess: threads={self.threads} must be whole warps")

    @property
    def lanes_per_row(self) -> int:
        """Lanes sharing one row: enough to cover the row's vectors, a power of two, at most a warp."""
        vectors = self.headdim // self.vec
        return min(32, 1 << (vectors - 1).bit_length())

    @property
    def rows_per_block(self) -> int:
        return self.threads // self.lanes_per_row

    def template_args(self) -> tuple[str, ...]:
        return (CXX_TYPES[self.dtype], str(self.headdim), str(self.vec), str(self.lanes_per_row), str(self.threads))


VARIANTS = tuple(BwdPreprocessVariant(dtype, headdim, vec)
                 for dtype in sorted(CXX_TYPES) for headdim in HEADDIMS for vec in (8, 1))


def select(problem, inputs) -> BwdPreprocessVariant:
    if not 0 < problem.headdim <= HEADDIMS[-1]:
        raise ValueError(f"bwd_preprocess takes head dims up to {HEADDIMS[-1]}; got {problem.headdim}")
    headdim = compiled_headdim(problem.headdim, HEADDIMS)
    vec = 8 if problem.headdim % 8 == 0 and all(rows_aligned(inputs[n], 2) for n in ("out", "dout")) else 1
    return BwdPreprocessVariant(problem.dtype, headdim, vec)


def prepare(variant: BwdPreprocessVariant, function, problem, inputs, outputs):
    """Family.prepare: the grid and every argument but the three addresses, made once."""
    if problem.batch * problem.nheads * problem.seqlen_q == 0:
        return launch_nothing
    check_grid_yz("bwd_preprocess", problem.nheads, problem.batch)
    grid = ((problem.seqlen_q + variant.rows_per_block - 1) // variant.rows_per_block, problem.nheads, problem.batch)
    sizes = (np.int32(problem.seqlen_q), np.int32(problem.nheads), np.int32(problem.headdim),
             *(np.int64(s) for s in inputs["out"].strides[:3]), *(np.int64(s) for s in inputs["dout"].strides[:3]))

    def launch_prepared(inputs, outputs, stream) -> None:
        function(grid, (variant.threads,),
                 (np.uint64(inputs["out"].ptr), np.uint64(inputs["dout"].ptr), np.uint64(outputs["delta"].ptr), *sizes),
                 stream=stream)

    return launch_prepared


FAMILY = Family(
    name="bwd_preprocess",
    backend="sm80",
    ops=("backward_preprocess",),
    description="delta = rowsum(dout * out) in fp32, the FlashAttention backward's first step",
    variants_for=lambda compute_capability: VARIANTS,
    min_compute_capability=(8, 0),
    select=select,
    prepare=prepare,
)
