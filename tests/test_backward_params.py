"""bwd_sm90's float32 dQ buffer, checked on the CPU against the kernel's own walk of the tiles: each
tile's single bulk reduction (64 rows of dq_row_floats from row m0 of its (batch, head), or of its
sequence's first row for varlen) stays inside the buffer, the spare rows included, and the rows the
kernel adds to are the ones the dQ conversion reads (accumulator_strides). A layout or sizing slip
here would add past the allocation with zeros, which no numerical GPU test can see."""
from hypothesis import given, settings
from hypothesis import strategies as st

from cuflash import arrays, reference
from cuflash.kernels import bwd_sm90, compiled_headdim
from cuflash.problem import Problem

BLOCK_M = bwd_sm90.BLOCK_M


def _tile_rows(keys: int, seqlen_q: int, seqlen_k: int, left: int, right: int):
    """The first query row of every tile every key block of `keys` walks, as bwd_sm90.cu does:
    query_rows (reference._query_range is its mirror), then m_first up to m_hi in steps of BLOCK_M."""
    for n0 in range(0, seqlen_k, keys):
        lo, hi = reference._query_range(n0, min(n0 + keys, seqlen_k), seqlen_q, seqlen_k, left, right)
        if hi > lo:
            yield from range(lo // BLOCK_M * BLOCK_M, hi, BLOCK_M)


@settings(max_examples=300, deadline=None)
@given(varlen=st.booleans(),
       lens=st.lists(st.tuples(st.integers(0, 600), st.integers(1, 600)), min_size=1, max_size=4),
       nheads_kv=st.integers(1, 3), group=st.sampled_from([1, 2, 4]), headdim=st.sampled_from(range(8, 257, 8)),
       causal=st.booleans(), left=st.sampled_from([-1, 0, 30, 200]), right=st.sampled_from([-1, 0, 9]))
def test_each_tile_reduction_stays_in_the_dq_buffer(varlen, lens, nheads_kv, group, headdim, causal, left, right):
    if not varlen:
        lens = [lens[0]] * len(lens)  # dense: one length for the batch
    right = 0 if causal else right
    nheads = nheads_kv * group
    problem = Problem(op="attention_varlen_backward" if varlen else "attention_backward", framework="torch",
                      device=arrays.Device("cuda", 0), dtype="bfloat16", batch=len(lens),
                      seqlen_q=max(q for q, _ in lens), seqlen_k=max(k for _, k in lens), nheads=nheads,
                      nheads_kv=nheads_kv, headdim=headdim, causal=causal, window_left=left, window_right=right,
                      total_q=sum(q for q, _ in lens) if varlen else 0, total_k=sum(k for _, k in lens) if varlen else 0)
    compiled = compiled_headdim(headdim, bwd_sm90.HEADDIMS)
    keys, row = bwd_sm90.block_n(compiled), bwd_sm90.dq_row_floats(compiled)
    floats = bwd_sm90.accumulator_floats(problem)
    stride_b, stride_s, stride_h = bwd_sm90.accumulator_strides(problem)
    assert stride_s == row  # the staging's row: a tile is one contiguous block of both
    q_row0 = 0
    for b, (seqlen_q, seqlen_k) in enumerate(lens):
        first = q_row0 * stride_s if varlen else b * stride_b  # the kernel's dq_rows
        for h in range(nheads):
            for m0 in _tile_rows(keys, seqlen_q, seqlen_k, left, right):
                start = first + h * stride_h + m0 * stride_s
                assert 0 <= start and start + BLOCK_M * row <= floats, (b, h, m0, start, floats)
            for i in {0, seqlen_q - 1} if seqlen_q else ():
                # the conversion sees varlen rows as one batch of total_q
                read = (q_row0 + i) * stride_s + h * stride_h if varlen else b * stride_b + i * stride_s + h * stride_h
                assert first + h * stride_h + i * stride_s == read and read + headdim <= floats
        q_row0 += seqlen_q
