"""What the attention families (fwd_sm80, fwd_sm90 and the backwards) check and hand their kernels the
same way: element size and head-dim granularity, strides, the window bounds and the softmax constants,
and the names their parameter structs give them."""
from __future__ import annotations

import math

HEADDIM_ALIGN = 8  # one 16-byte chunk: the unit of loads, stores and zero fill
ELEMENT_BYTES = 2  # fp16 / bf16
LOG2E = 1.0 / math.log(2.0)


def check_headdim(family: str, headdim: int, largest: int) -> None:
    """The forward kernels pad a head dim up to a compiled one in whole 16-byte chunks."""
    if headdim % HEADDIM_ALIGN or headdim > largest:
        raise ValueError(f"{family} takes head dims that are multiples of {HEADDIM_ALIGN} up to {largest}; "
                         f"got {headdim}")


def token_strides(problem, x) -> tuple[int, int, int]:
    """(batch, sequence, head) strides in elements of q, k, v, out or their gradients, as the sm80
    kernels' parameter structs take them: varlen arrays are (total, heads, dim), with no batch
    stride (sequences start at cu_seqlens)."""
    return (0, *x.strides[:2]) if problem.varlen else tuple(x.strides[:3])


def row_strides(problem, x) -> tuple[int, int]:
    """(batch, head) strides of a per-query-row float32 array (lse, delta): (batch, heads, seqlen),
    or (heads, total) for varlen."""
    return (0, x.strides[0]) if problem.varlen else tuple(x.strides[:2])


CU_SEQLENS = ("cu_seqlens_q", "cu_seqlens_k")  # varlen inputs whose addresses the parameter structs take


def token_stride_fields(problem, **arrays) -> dict:
    """token_strides of each named array as the parameter structs name them: {name}_stride_b, _s, _h."""
    return {f"{name}_stride_{d}": s for name, x in arrays.items() for d, s in zip("bsh", token_strides(problem, x))}


def row_stride_fields(problem, **arrays) -> dict:
    """row_strides of each named array as the parameter structs name them: {name}_stride_b, _h."""
    return {f"{name}_stride_{d}": s for name, x in arrays.items() for d, s in zip("bh", row_strides(problem, x))}


def mask_and_softmax_fields(problem) -> dict:
    """kernel_window and softmax_constants as the parameter structs name them."""
    return dict(zip(("window_left", "window_right", "scale_log2", "softcap_exp2_scale", "softcap"),
                    (*kernel_window(problem), *softmax_constants(problem))))


def kernel_window(problem) -> tuple[int, int]:
    """(left, right) as the kernels take them: a bound that reaches past every key of every row
    (left >= seqlen_k, right >= seqlen_q; the maxima for varlen) is unbounded, -1. The same
    semantics, and the kernels' int32 index arithmetic never sees values near 2^31."""
    left, right = problem.window_left, problem.window_right
    return (-1 if left >= problem.seqlen_k else left), (-1 if right >= problem.seqlen_q else right)


def softmax_constants(problem) -> tuple[float, float, float]:
    """(scale_log2, softcap_exp2_scale, softcap). With softcap the kernels cap
    softcap * tanh(s * scale / softcap) first (tanh through exp2 of s * softcap_exp2_scale), then
    scale by log2(e)."""
    softcap = problem.softcap
    if softcap:
        return LOG2E, 2 * LOG2E * problem.softmax_scale / softcap, softcap
    return problem.softmax_scale * LOG2E, 0.0, 0.0
