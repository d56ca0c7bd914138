"""check_cu_seqlens: the varlen calls' cu_seqlens checked on the GPU before the attention kernel that
reads them (cuda_src/check_cu_seqlens.cu). It serves no op of its own: dispatch launches it ahead of
every varlen kernel, on the same stream, so a call neither synchronises nor stops a CUDA graph's
capture to look at the values, and a jax.jit program checks them too. Host arrays are checked by
reference.check_cu_seqlens, whose rules and messages the kernel repeats."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from . import Family, Variant

THREADS = 256


@dataclass(frozen=True)
class CuSeqlensCheckVariant(Variant):
    family = "check_cu_seqlens"
    source = "check_cu_seqlens.cu"
    template = "cuflash::check_cu_seqlens"

    threads: int = THREADS

    def check(self) -> None:
        if self.threads % 32 or not 32 <= self.threads <= 1024:
            raise ValueError(f"check_cu_seqlens: threads={self.threads} must be whole warps, at most 1024")

    def template_args(self) -> tuple[str, ...]:
        return (str(self.threads),)


VARIANT = CuSeqlensCheckVariant()


def _serves_no_op(problem, inputs):
    raise ValueError("check_cu_seqlens runs before the varlen kernels (dispatch.launcher), not in their place")


def prepare(variant: CuSeqlensCheckVariant, function, problem, inputs, outputs):
    """Family.prepare: launch(inputs, outputs, stream) of the check of a varlen problem's inputs'
    cu_seqlens_q and cu_seqlens_k (outputs unused)."""
    assert problem.varlen, problem.op
    sizes = (np.int32(problem.batch), np.int32(problem.total_q), np.int32(problem.total_k),
             np.int32(problem.seqlen_q), np.int32(problem.seqlen_k), np.bool_(problem.op.endswith("backward")))

    def launch_prepared(inputs, outputs, stream) -> None:
        function((1,), (variant.threads,),
                 (np.uint64(inputs["cu_seqlens_q"].ptr), np.uint64(inputs["cu_seqlens_k"].ptr), *sizes), stream=stream)

    return launch_prepared


FAMILY = Family(
    name="check_cu_seqlens",
    backend="sm80",
    ops=(),
    description="the varlen calls' cu_seqlens checked on the GPU ahead of their kernel (a device-side assertion)",
    variants_for=lambda compute_capability: (VARIANT,),
    min_compute_capability=(8, 0),
    select=_serves_no_op,
    prepare=prepare,
)
