"""What the attention families (fwd_sm80, fwd_sm90 and the backwards) check and hand their kernels the
same way: element size and head-dim granularity, strides, the window bounds and the softmax constants,
and the names their parameter structs give them."""
from __future__ import annotations

import dataclasses
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


def sees_every_key(problem) -> bool:
    """Whether every query row of a dense problem sees every key through its causal mask or window
    (aligned bottom-right, row i sees keys i + seqlen_k - seqlen_q - left to i + seqlen_k - seqlen_q
    + right): the last row must see key 0 (left >= seqlen_k - 1) and the first the last key (right
    >= seqlen_q - 1). A decode step's one row under a causal mask does."""
    left, right = problem.window_left, problem.window_right
    return (left < 0 or left >= problem.seqlen_k - 1) and (right < 0 or right >= problem.seqlen_q - 1)


def query_heads_as_rows(problem):
    """A decode step with GQA as the kernels run it: the Problem with each kv head's `group` query
    heads as its query rows (nheads_kv heads of `group` rows), or None where that does not apply.

    With one query row every query head of a kv head reads the same keys, but as heads of their own
    each takes a tile of its own, which streams that kv head's K and V again (from L2 at best): a
    decode step with 4 query heads a kv head ran 2-8x slower than cuDNN's (H100,
    benchmarks/NOTES-sm90.md, "Decode shapes"). As rows of one tile they are loaded once. The rows
    of the view sit at different query positions, so it applies only where the one query row sees
    every key, as all of them then do: no left window bound inside the keys (a right bound or a
    causal mask hides no key from the last query row). q and out (batch, 1, nheads, headdim) are
    read as (batch, group, nheads_kv, headdim), lse (batch, nheads, 1) as (batch, nheads_kv, group):
    the same memory (heads_as_rows). FP8 attention too, its q descales then one a row (not
    attention(fp8=True), which quantizes q per head), and only where k's and v's descales are not
    per 192 rows: its split variants, which such problems run, take blocks of 128 keys."""
    group = problem.nheads // max(problem.nheads_kv, 1)
    if (problem.op not in ("attention_forward", "attention_fp8_forward") or problem.seqlen_q != 1 or group == 1
            or not sees_every_key(problem) or problem.wide_key_blocks):
        return None
    return dataclasses.replace(problem, seqlen_q=group, nheads=problem.nheads_kv, causal=False, window_left=-1,
                               window_right=-1, q_descale_per_row=problem.op == "attention_fp8_forward")


def heads_as_rows(arrays: dict, group: int) -> dict:
    """`arrays` (DeviceArrays of an attention_forward or attention_fp8_forward call: q, k, v, out,
    lse, descales, any of them) as query_heads_as_rows' problem reads them: q and out (batch, 1,
    nheads, d) as (batch, group, nheads // group, d), lse (batch, nheads, 1) and q_descale (batch,
    nheads[, 1]) as (batch, nheads // group, group): one descale a row. Query head kv * group + g
    is row g of head kv; k, v and their descales are as they were."""
    viewed = dict(arrays)
    for name in ("q", "out"):
        if name in arrays:
            x = arrays[name]
            (batch, _, nheads, headdim), (stride_b, _, stride_h, stride_d) = x.shape, x.strides
            viewed[name] = type(x)(x.ptr, (batch, group, nheads // group, headdim),
                                   (stride_b, stride_h, group * stride_h, stride_d))
    for name in ("lse", "q_descale"):
        if name in arrays:
            x = arrays[name]
            (batch, nheads), (stride_b, stride_h) = x.shape[:2], x.strides[:2]
            assert name != "lse" or stride_h == 1, "the kernels write a head's lse rows contiguously (outputs are so)"
            viewed[name] = type(x)(x.ptr, (batch, nheads // group, group), (stride_b, group * stride_h, stride_h))
    return viewed
