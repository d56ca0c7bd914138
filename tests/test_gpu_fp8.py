"""FP8 attention on the GPU (fwd_fp8_sm90, Hopper): e4m3 q, k, v from the GPU quantizer, against
the float64 reference of the dequantized inputs (reference.attention_fp8's semantics). The
criterion in the spirit of FlashAttention's: cuflash's max abs error is at most 2x that of a
plain FP8 implementation (scores in fp32, P = exp(s - rowmax) * 2^8 rounded to e4m3 before P V,
the row sum unrounded, out rounded to out_dtype: what any e4m3 P V does) plus 1e-4. The LSE within
1e-3 plus 2^-11 of the largest |q||k| dot product of its row (times the softmax scale): Hopper's
tensor cores add e4m3 products with fewer mantissa bits than fp32 (DeepSeek-V3's report: about 14),
an error of that order on each score, which the LSE passes on (measured: 2.1e-3 at |lse| 1.1, head
dim 64, one key). Outputs are poisoned before every call, and a second identical call must give the
same bits."""
import contextlib
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import arrays, dispatch, kernels, reference
from cuflash.kernels import fwd_sm90
from cuflash.kernels.forward import heads_as_rows, query_heads_as_rows
from cuflash.problem import Problem

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
gpu_attention = pytest.importorskip("gpu_attention_reference")

SEQLENS = st.one_of(st.sampled_from([1, 2, 63, 127, 128, 129, 255, 256, 257, 1000, 1024]), st.integers(1, 1100))
MAX_SCORES = 2**24


def _hopper():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


hopper_only = pytest.mark.skipif(not _hopper(), reason="fwd_fp8_sm90 needs compute capability 9.0")


def _dequantize(x8, descale, block: int = reference.FP8_BLOCK):
    """x8 * descale in float64 on the GPU, descale per (batch, head) or per `block` rows."""
    x = x8.to(torch.float64)
    if descale.dim() == 2:
        return x * descale.double()[:, None, :, None]
    rows = torch.arange(x.shape[1], device=x.device) // block
    return x * descale.double()[:, :, rows].transpose(1, 2)[..., None]


def _quantize(x, block: int, hadamard: bool):
    """quantize_fp8's GPU kernel with one scale per `block` rows (128, or 192 at head dims 65-128),
    seed 0."""
    return cuflash.quantize_fp8(x, block=block, hadamard=hadamard, seed=0)


def _codes(s, m):
    """P as fast_exp's e4m3 codes (masking.cuh, online_softmax_codes) of float64 scores s, natural
    units, against each row's maximum m: the codes of round(8 log2 P) with the row's largest at 2^8
    (its maximum rounded up to an eighth in log2 units, as the kernel's), clamped at 0, decoded."""
    decoded = torch.arange(127, dtype=torch.uint8).view(torch.float8_e4m3fn).to(s.device, torch.float64)
    top = torch.ceil(8 * m * math.log2(math.e)) / 8
    code = torch.round(8 * (s * math.log2(math.e) - top)) + 120  # (ties to even, as the kernel's FFMA)
    return decoded[code.nan_to_num(0.0, neginf=0.0).clamp(0, 126).long()]


def _plain_fp8(q, k, v, kw, out_dtype, codes: bool = False):
    """The yardstick: attention of float32 q, k, v with P in e4m3 as described above; reference.
    forward_p_e4m3 on the GPU, in torch (the hypothesis examples reach 1100 x 1100 scores per head).
    codes: P as fast_exp's codes instead (_codes), divided by their sum, as the kernel's tensor-core
    row sums do."""
    batch, seqlen_q, nheads, headdim = q.shape
    seqlen_k, group = k.shape[1], nheads // k.shape[2]
    left, right = reference.window_bounds(kw["causal"], kw["window"])
    scale = kw["softmax_scale"] if kw["softmax_scale"] is not None else 1 / math.sqrt(headdim)
    qt = q.float().transpose(1, 2)
    kt = k.float().transpose(1, 2).repeat_interleave(group, dim=1)
    vt = v.float().transpose(1, 2).repeat_interleave(group, dim=1)
    s = torch.matmul(qt, kt.transpose(-1, -2)) * scale
    s = s.masked_fill(~gpu_attention.visible(seqlen_q, seqlen_k, left, right, q.device), float("-inf"))
    m = s.amax(dim=-1, keepdim=True).nan_to_num(0.0, neginf=0.0)
    if codes:
        p8 = _codes(s.double(), m.double()).float()
        total = p8.sum(dim=-1, keepdim=True)
    else:
        p = torch.exp(s - m) * 256.0
        p8 = p.to(torch.float8_e4m3fn).float()
        total = p.sum(dim=-1, keepdim=True)
    out = torch.where(total > 0, torch.matmul(p8, vt) / total, 0.0)
    return out.transpose(1, 2).to(out_dtype)


def _problem(q8, k8, kw, out_dtype, with_lse=True, **fields):
    """The attention_fp8_forward Problem of q8 and k8 (`fields` replace any, e.g. op and dtype)."""
    left, right = reference.window_bounds(kw["causal"], kw["window"])
    scale = kw["softmax_scale"] if kw["softmax_scale"] is not None else 1 / math.sqrt(q8.shape[-1])
    return Problem(**{**dict(op="attention_fp8_forward", framework="torch",
                             device=arrays.Device("cuda", q8.device.index or 0), dtype="float8_e4m3fn",
                             batch=q8.shape[0], seqlen_q=q8.shape[1], seqlen_k=k8.shape[1], nheads=q8.shape[2],
                             nheads_kv=k8.shape[2], headdim=q8.shape[-1], causal=kw["causal"], window_left=left,
                             window_right=right, softmax_scale=scale, softcap=0.0, backend="sm90",
                             out_dtype=str(out_dtype).removeprefix("torch."), with_lse=with_lse), **fields})


def _quantized_inputs(q, k, v, block, hadamard: bool = False, seed: int = 0):
    """quantize_fp8 of q, k and v with `block` (the transform on q and k only), and the inputs of an
    attention_fp8_forward problem made of them: (quantized, inputs)."""
    quantized = (cuflash.quantize_fp8(q, block=block, hadamard=hadamard, seed=seed),
                 cuflash.quantize_fp8(k, block=block, hadamard=hadamard, seed=seed), cuflash.quantize_fp8(v, block=block))
    (q8, qd), (k8, kd), (v8, vd) = quantized
    return quantized, dict(q=q8, k=k8, v=v8, q_descale=qd, k_descale=kd, v_descale=vd)


def _assert_same_again(problem, inputs, out, lse):
    """A second poisoned run of `problem` gives out's (and lse's) bits: what moves between identical
    runs is a race."""
    again, lse_again = gpu_attention.run_poisoned(problem, inputs, out.shape, None if lse is None else lse.shape,
                                                  out.dtype)
    assert torch.equal(again, out) and (lse is None or torch.equal(lse_again, lse)), \
        "results moved between identical runs: a race"


def _assert_graph_replays_give(call, want):
    """call() captured in a CUDA graph (programmatic dependent launches become programmatic edges),
    replayed three times with its output filled with NaN first, gives want's bits each time."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    for _ in range(3):
        captured.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, want)


def _check(out, lse, quantized, kw, key_block: int = reference.FP8_BLOCK, codes: bool = False):
    """out (and lse, unless None: a call without it) against float64 attention of the dequantized
    inputs (k's and v's block scales per `key_block` rows): out within twice the error of the plain
    implementation above (with P as fast_exp's codes where the kernel took them: `codes`), lse within
    its bound."""
    blocks = (reference.FP8_BLOCK, key_block, key_block)
    q, k, v = (_dequantize(x8, d, block) for (x8, d), block in zip(quantized, blocks))
    ref_out, ref_lse = gpu_attention.attention(q, k, v, compute_dtype=torch.float64, **kw, softcap=0.0)
    plain = _plain_fp8(q, k, v, kw, out.dtype, codes)
    assert not torch.isnan(out).any(), "NaN (or an unwritten, poisoned element) in out"
    scale = kw["softmax_scale"] if kw["softmax_scale"] is not None else 1 / math.sqrt(q.shape[-1])
    group = q.shape[2] // k.shape[2]
    magnitude = torch.matmul(q.abs().transpose(1, 2), k.abs().transpose(1, 2).repeat_interleave(group, 1).transpose(-1, -2))
    magnitude = magnitude.amax(dim=-1)  # (batch, heads, seqlen_q): the largest sum of |q||k| a score adds up
    # The e4m3 wgmma accumulates S = Q K^T with ~14 bits kept (measured in the LSE: 5e-5 to 9e-5 of
    # the scores; DeepSeek-V3's report says the same of FP8 GEMMs on Hopper), where the plain
    # implementation's scores are exact: a row's weights may move by a factor e^(+-2 eps), eps =
    # 2^-13 scale * magnitude, and P's e4m3 rounding then lands elsewhere (NOTES-fp8, session 30).
    eps = 2.0**-13 * scale * magnitude
    mean_abs_v = gpu_attention.attention(q, k, v.abs(), compute_dtype=torch.float64, **kw, softcap=0.0)[0]
    slack = 2 * eps * mean_abs_v.amax(dim=-1).transpose(1, 2)  # (batch, heads, seqlen_q)
    row_err = (out.double() - ref_out).abs().amax(dim=-1).transpose(1, 2)
    plain_err = (plain.double() - ref_out).abs().max().item()
    excess = row_err - (2 * plain_err + slack + 1e-4)
    assert (excess <= 0).all(), (f"max error {row_err.max().item():.3g} vs plain FP8 implementation {plain_err:.3g} "
                                 f"(worst row {excess.max().item():.3g} over its bound)")
    err = row_err.max().item()
    if lse is None:
        return err, plain_err
    assert not torch.isnan(lse).any(), "NaN (or an unwritten, poisoned element) in lse"
    dead = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), dead), "rows without keys must have lse -inf, and only those"
    bound = 1e-3 + 2.0**-11 * scale * magnitude
    lse_err = (lse.double() - ref_lse).abs()
    assert (lse_err[~dead] <= bound[~dead]).all(), f"lse error {lse_err[~dead].max().item():.3g}"
    return err, plain_err


def _takes_codes(problem, inputs) -> bool:
    """Whether the kernel dispatch runs `problem` on (as dispatch.launcher plans it: a decode step's
    query heads as rows) takes P's codes from the scores (fast_exp, where it sums P on the tensor
    cores)."""
    device_inputs = {name: arrays.device_array(x) for name, x in inputs.items()}
    as_rows = query_heads_as_rows(problem)
    if as_rows:
        problem, device_inputs = as_rows, heads_as_rows(device_inputs, problem.nheads // problem.nheads_kv)
    return dispatch.plan(problem, device_inputs)[1].exp_codes


def fp8_rows(compiled: int, block: int | None) -> list:
    """The tile rows the FP8 kernel may take at this compiled head dim (fwd_sm90.fp8_tile_rows) with k
    and v descales per head (block None), or per `block` rows: only those of `block`-key blocks."""
    return [tiles for tiles in fwd_sm90.fp8_tile_rows(compiled) if block is None or tiles[1] == block]


# (head dim, row index in fp8_rows, block): every row the kernel may take, with per-128-row (block
# 128) and per-head (None) descales.
EVERY_ROW = [(hd, i, block) for hd in fwd_sm90.FP8_HEADDIMS for block in (128, None)
             for i in range(len(fp8_rows(hd, block)))]


@contextlib.contextmanager
def fp8_row(headdim: int, row: int, block: int | None):
    """Run the FP8 kernel with row `row` (modulo their number) of the rows it may take at this head
    dim with k and v descales per head (block None) or per `block` rows (fp8_rows: V transposed in
    the kernel, or beforehand into a workspace), whatever its seqlen_q bound."""
    compiled = next(h for h in fwd_sm90.FP8_HEADDIMS if h >= headdim)
    rows = fp8_rows(compiled, block)
    saved = fwd_sm90.fp8_tiles_override
    fwd_sm90.fp8_tiles_override = {compiled: rows[row % len(rows)]}
    dispatch.clear_plans()
    try:
        yield
    finally:
        fwd_sm90.fp8_tiles_override = saved
        dispatch.clear_plans()


@st.composite
def features(draw):
    causal = draw(st.booleans())
    side = st.one_of(st.just(-1), st.integers(0, 64), st.integers(0, 1100))
    window = (draw(side), draw(st.sampled_from([-1, 0]) if causal else side))
    return dict(causal=causal, window=window, softmax_scale=draw(st.one_of(st.none(), st.floats(0.02, 0.5))))


@hopper_only
@settings(max_examples=120, deadline=None)
@given(headdim=st.sampled_from([64, 128, 256, 32, 96, 192]), batch=st.integers(1, 3), seqlen_q=SEQLENS,
       seqlen_k=SEQLENS, nheads_kv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]), kw=features(),
       block=st.sampled_from([None, 128]), hadamard=st.booleans(),
       out_dtype=st.sampled_from([torch.bfloat16, torch.float16]), row=st.integers(0, 3),
       with_lse=st.booleans(), fast_exp=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_fp8_attention_matches_reference(headdim, batch, seqlen_q, seqlen_k, nheads_kv, group, kw, block, hadamard,
                                         out_dtype, row, with_lse, fast_exp, seed):
    nheads = nheads_kv * group
    assume(batch * nheads * seqlen_q * seqlen_k <= MAX_SCORES)
    hadamard = hadamard and headdim in (64, 128, 256)  # the GPU quantizer's transform sizes
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(batch, s, h, headdim, device="cuda", generator=g, dtype=torch.bfloat16)
               for s, h in ((seqlen_q, nheads), (seqlen_k, nheads_kv), (seqlen_k, nheads_kv)))
    k[:, ::7] *= 4  # key blocks with different scales
    v[:, 1::5] *= 3
    quantized, inputs = _quantized_inputs(q, k, v, block, hadamard, seed=3)
    # (without the LSE: P's row sums may come from the tensor cores, and with fast_exp P's codes from the scores)
    problem = _problem(inputs["q"], inputs["k"], kw, out_dtype, with_lse, fast_exp=fast_exp and not with_lse)
    lse_shape = (batch, nheads, seqlen_q) if with_lse else None
    with fp8_row(headdim, row, block):  # which of the head dim's rows (row modulo their number)
        out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, lse_shape, out_dtype)
        _check(out, lse, quantized, kw, codes=_takes_codes(problem, inputs))
        _assert_same_again(problem, inputs, out, lse)


def test_ex2_fma_matches_exp2_within_its_stated_error():
    """cuda_src/common/sm80.cuh's ex2_fma (the FMA-pipe exponentials of FP8_EXP_ON_FMA's rows) on
    every float32 step of [-130, 9] at 2^-12 and the edges, beside the unit's ex2: relative error at
    most 2.1e-3 with mean within 1e-4 (a biased quadratic would shift every row's weights), never
    negative or above 2^9; exactly 0 from -127 down (and -inf, and NaN, which the clamp maps there)."""
    cupy = pytest.importorskip("cupy")
    from cuflash import jit

    source = """#include "common/sm80.cuh"
extern "C" __global__ void both(const float* x, float* fma, float* unit, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < n) { fma[i] = cuflash::ex2_fma(x[i]); unit[i] = cuflash::ex2(x[i]); }
}"""
    arch = jit.arch_for(jit.device_compute_capability(cupy.cuda.Device().id))
    kernel = cupy.RawModule(code=source, options=jit.compile_options(arch)).get_function("both")
    edges = [-np.inf, np.nan, -1e30, -200.0, -127.0, -126.99, -126.5, -126.0, -125.5, -1e-7, -0.0, 0.0, 1e-7,
             np.nextafter(np.float32(1), np.float32(0)), 1.0, 7.999, 8.0, 8.5, 9.0]
    x = np.concatenate([np.arange(-130 * 4096, 9 * 4096 + 1) / 4096.0, edges]).astype(np.float32)
    xs = cupy.asarray(x)
    fma, unit = cupy.full(x.shape, np.nan, np.float32), cupy.full(x.shape, np.nan, np.float32)
    kernel(((x.size + 255) // 256,), (256,), (xs, fma, unit, np.int32(x.size)))
    fma, unit = cupy.asnumpy(fma).astype(np.float64), cupy.asnumpy(unit).astype(np.float64)
    assert np.isfinite(fma).all() and (fma >= 0).all() and fma.max() <= 2.0**9
    dead = ~(x > -127)  # -127 and below, -inf and NaN
    assert (fma[dead] == 0).all(), x[dead][fma[dead] != 0]
    normal = x >= -126  # results in the normal range (between -127 and -126: ftz's denormals, or 0)
    exact = np.exp2(x[normal].astype(np.float64))
    rel = fma[normal] / exact - 1
    assert np.abs(rel).max() <= 2.1e-3 and abs(rel.mean()) <= 1e-4, (np.abs(rel).max(), rel.mean())
    assert (fma[(x > -127) & ~normal] <= 2.0**-126).all()
    assert np.abs(unit[normal] / exact - 1).max() <= 1e-6  # (the yardstick: the unit's own)


def test_ex2x2_fma_f16_matches_exp2_within_its_stated_error():
    """cuda_src/common/sm80.cuh's ex2x2_fma_f16<8> (2^(x + 8) of two floats in f16x2 arithmetic, the
    FMA-pipe exponentials of FP8_LSE_EXP_PAIRS' rows) on every float32 step of [-24, 7] at 2^-12,
    both halves of a pair differing, and the edges: relative error at most 6e-4 (the cubic: 5.5e-4)
    plus what rounding x to a half costs (ln 2 times half its spacing, at most 2^-11 |x|), mean within 1e-4
    over [-8, 0] (P from 1 to 2^8, the weights that count); exactly 0 below -22.5, and for -inf and
    NaN; never above 2^15."""
    cupy = pytest.importorskip("cupy")
    from cuflash import jit

    source = """#include "common/sm80.cuh"
extern "C" __global__ void pairs(const float* x, float* out, int n) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (2 * i + 1 < n) {
    const float2 both = cuflash::ex2x2_fma_f16<8>(x[2 * i], x[2 * i + 1]);
    out[2 * i] = both.x;
    out[2 * i + 1] = both.y;
  }
}"""
    arch = jit.arch_for(jit.device_compute_capability(cupy.cuda.Device().id))
    kernel = cupy.RawModule(code=source, options=jit.compile_options(arch)).get_function("pairs")
    steps = np.arange(-24 * 4096, 7 * 4096 + 1) / 4096.0
    edges = [-np.inf, np.nan, -1e30, -23.0, -22.51, -22.5, -22.49, -22.0, -14.5, -8.0, -1e-7, -0.0, 0.0, 1e-7, 7.0]
    # pairs of different values: each step beside its mirror in the range
    x = np.stack([steps, steps[::-1]], axis=1).ravel()
    x = np.concatenate([x, edges, edges[::-1]]).astype(np.float32)
    out = cupy.full(x.shape, np.nan, np.float32)
    kernel(((x.size // 2 + 255) // 256,), (256,), (cupy.asarray(x), out, np.int32(x.size)))
    out = cupy.asnumpy(out).astype(np.float64)
    assert np.isfinite(out).all() and (out >= 0).all() and out.max() <= 2.0**15
    dead = ~(x >= -22.5)  # below -22.5, -inf and NaN
    assert (out[dead] == 0).all(), x[dead][out[dead] != 0]
    normal = x >= -22  # results at least 2^-14: fp16's normal range
    exact = np.exp2(x[normal].astype(np.float64) + 8)
    rel = out[normal] / exact - 1
    bound = 6e-4 + math.log(2) * 2.0**-11 * np.abs(x[normal])
    assert (np.abs(rel) <= bound).all(), (x[normal][np.abs(rel) > bound][:5], rel[np.abs(rel) > bound][:5])
    weighty = (x[normal] >= -8) & (x[normal] <= 0)
    assert abs(rel[weighty].mean()) <= 1e-4, rel[weighty].mean()


def test_softmax_codes_are_round_8_log2_p_and_within_their_stated_error():
    """cuda_src/common/masking.cuh's online_softmax_codes with pack4_low_bytes (fast_exp's P, as P V
    reads it): each score x's code is round(8 (x scale - base) + 56) (ties to even, as the FFMA
    rounds), clamped at 0 (-inf and NaN too), for base a multiple of 1/8 and codes up to 120; the
    value it stands for within [2^-1/16, 2^1/16 * 1.0615] of 2^(x scale - base) in e4m3's normal
    range (rounding 8 log2 to an integer, times 1 + f against 2^f); packed four to a word in order."""
    cupy = pytest.importorskip("cupy")
    from cuflash import jit

    source = """#include "common/masking.cuh"
extern "C" __global__ void codes(const float* x, float scale, float base, unsigned* packed, int words) {
  const int i = blockIdx.x * blockDim.x + threadIdx.x;
  if (i < words) {
    float s[4] = {x[4 * i], x[4 * i + 1], x[4 * i + 2], x[4 * i + 3]};
    cuflash::online_softmax_codes<4>([&](int c) -> float& { return s[c]; }, scale, base);
    packed[i] = cuflash::pack4_low_bytes(__float_as_uint(s[0]), __float_as_uint(s[1]), __float_as_uint(s[2]),
                                         __float_as_uint(s[3]));
  }
}"""
    arch = jit.arch_for(jit.device_compute_capability(cupy.cuda.Device().id))
    kernel = cupy.RawModule(code=source, options=jit.compile_options(arch)).get_function("codes")
    decoded = np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    # scales of few mantissa bits, so that y = x scale - base is exact in float64 (powers of two:
    # y on a grid of 1/64, with ties); bases of eighths near 0 and far (the FFMA's addend still exact)
    for scale, base in ((0.125, 0.0), (181 / 2048, -3.375), (1.0, 1000.125), (0.0625, -5000.5)):
        x = ((np.arange(-30 * 64, 8 * 64 + 1) / 64 + base) / scale).astype(np.float32)  # y over [-30, 8]
        y = x.astype(np.float64) * scale - base
        x, y = x[y <= 8], y[y <= 8]  # (codes up to 120)
        x = np.concatenate([x, np.float32([-np.inf, np.nan, -1e30])])
        x = np.concatenate([x, np.full(-x.size % 4, -np.inf, np.float32)])  # (whole words)
        packed = cupy.zeros(x.size // 4, np.uint32)
        kernel(((packed.size + 127) // 128,), (128,), (cupy.asarray(x), np.float32(scale), np.float32(base), packed,
                                                       np.int32(packed.size)))
        got = cupy.asnumpy(packed).view(np.uint8)
        want = np.clip(np.nan_to_num(np.round(8 * (x.astype(np.float64) * scale - base) + 56), nan=0.0, neginf=0.0),
                       0, 255)
        assert np.array_equal(got, want.astype(np.uint8)), np.nonzero(got != want)[0][:5]
        assert got[:y.size].max() <= 120  # (P at most 2^8)
        normal = got[:y.size] >= 8  # (e4m3's normal range)
        ratio = decoded[got[:y.size][normal]] / np.exp2(y[normal])
        assert ratio.min() >= 2 ** (-1 / 16) - 1e-12 and ratio.max() <= 2 ** (1 / 16) * 1.0615, (ratio.min(), ratio.max())


@hopper_only
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("with_lse, fast_exp", [(True, False), (False, False), (False, True)])
@pytest.mark.parametrize("headdim,row,block", EVERY_ROW)
def test_fp8_every_table_row(headdim, row, block, with_lse, fast_exp, causal):
    """Each row the kernel may take (fp8_rows) on a shape with ragged tails (keys not a multiple of
    16 or of a block), GQA, causal or not, with per-block and per-head descales, returning the LSE
    or not (then, where they fit, P's row sums come from the tensor cores and, on FP8_EXP_ON_FMA's
    rows, some exponentials from the FMA pipe, or with fast_exp P's codes from the scores; with it,
    on FP8_LSE_EXP_PAIRS' rows, some pairs of them in f16x2)."""
    g = torch.Generator(device="cuda").manual_seed(headdim + row)
    q = torch.randn(2, 333, 4, headdim, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(2, 1043, 2, headdim, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    quantized, inputs = _quantized_inputs(q, k, v, block)
    kw = dict(causal=causal, window=(-1, -1), softmax_scale=None)
    problem = _problem(inputs["q"], inputs["k"], kw, torch.bfloat16, with_lse, fast_exp=fast_exp)
    with fp8_row(headdim, row, block):
        _, variant = dispatch.plan(problem, {name: arrays.device_array(x) for name, x in inputs.items()})
        tiles = fp8_rows(headdim, block)[row]
        assert variant.tensor_row_sums == (not with_lse and fwd_sm90.tensor_row_sums_fit(headdim, tiles))
        assert variant.exp_codes == (fast_exp and variant.tensor_row_sums)
        every = (fwd_sm90.FP8_LSE_EXP_PAIRS if with_lse else fwd_sm90.FP8_EXP_ON_FMA).get((headdim, tiles), (0, 0))
        if variant.exp_codes:
            every = (0, 0)  # no exponential
        assert (variant.exp_on_fma, variant.exp_fma_pairs) == (every[causal], with_lse and every[causal] > 0)
        stale = block is None and variant.tensor_row_sums  # (per head, O divided by the sums of P as rounded)
        assert variant.stale_max == (fwd_sm90.FP8_STALE_MAX.get((headdim, tiles), 0) if stale else 0)
        out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, (2, 4, 333) if with_lse else None,
                                              torch.bfloat16)
    _check(out, lse, quantized, kw, codes=variant.exp_codes)


@hopper_only
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads_kv, group, kw, with_lse, headdim, k_per_head", [
    (1, 300, 4300, 2, 2, dict(causal=False, window=(-1, -1)), False, 128, False),
    (2, 700, 2100, 1, 4, dict(causal=True, window=(-1, -1)), True, 128, False),
    (1, 1, 5000, 2, 4, dict(causal=True, window=(-1, -1)), False, 128, False),  # a decode step: not split
    (1, 130, 200, 2, 1, dict(causal=False, window=(100, 20)), False, 96, False),
    (1, 2048, 2048, 2, 1, dict(causal=False, window=(-1, -1)), True, 112, True)])
def test_fp8_k_and_v_descales_per_192_rows_match_reference(batch, seqlen_q, seqlen_k, nheads_kv, group, kw,
                                                           with_lse, headdim, k_per_head):
    """attention_fp8(..., kv_block=192): k's and v's descales per 192 rows run the 192-key row
    (FP8_PER_HEAD_TILES', V^T beforehand; a decode step neither split nor with its query heads as
    rows), poisoned outputs against the reference (_check with 192-row blocks); k per head and v
    per block too. The public call gives the same bits, as do torch.compile and jax.jit."""
    g = torch.Generator(device="cuda").manual_seed(seqlen_k + headdim)
    q = torch.randn(batch, seqlen_q, nheads_kv * group, headdim, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", generator=g, dtype=torch.bfloat16)
            for _ in range(2))
    k[:, ::7] *= 4
    hadamard = headdim in (64, 128, 256)
    quantized = (_quantize(q, 128, hadamard), cuflash.quantize_fp8(k, hadamard=hadamard) if k_per_head else
                 _quantize(k, 192, hadamard), _quantize(v, 192, False))
    (q8, qd), (k8, kd), (v8, vd) = quantized
    inputs = dict(q=q8, k=k8, v=v8, q_descale=qd, k_descale=kd, v_descale=vd)
    kw = dict(kw, softmax_scale=None)
    problem = _problem(q8, k8, kw, torch.bfloat16, with_lse, fp8_block=reference.FP8_WIDE_KEY_BLOCK)
    dispatch.clear_plans()
    lse_shape = (batch, q.shape[2], seqlen_q) if with_lse else None
    out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, lse_shape, torch.bfloat16)
    ((_, variant),) = dispatch._plans.values()
    assert variant.block_n == 192 and variant.v_pretransposed and not variant.split_kv
    _check(out, lse, quantized, kw, reference.FP8_WIDE_KEY_BLOCK)
    _assert_same_again(problem, inputs, out, lse)
    args = (q8, k8, v8, qd, kd, vd)
    public = cuflash.attention_fp8(*args, **kw, kv_block=192, return_lse=with_lse)
    assert torch.equal(public[0], out) and torch.equal(public[1], lse) if with_lse else torch.equal(public, out)
    if headdim != 128 or with_lse:
        return
    import cuflash.torch as ct

    compiled = torch.compile(lambda: ct.attention_fp8(*args, **kw, kv_block=192), fullgraph=True)()
    assert torch.equal(compiled, out)
    jax = pytest.importorskip("jax")
    if jax.default_backend() == "gpu":
        got = jax.jit(lambda *a: cuflash.attention_fp8(*a, **kw, kv_block=192))(
            *(jax.dlpack.from_dlpack(x.contiguous()) for x in args))
        assert torch.equal(torch.from_dlpack(got), out)


@hopper_only
@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("headdim", [64, 128])
def test_fp8_long_rows_match_reference(headdim, block, with_lse):
    """Rows of 16k keys (two heads: enough tiles not to split), with and without the LSE: without
    it P's row sums come from the tensor cores where FP8_TENSOR_ROW_SUMS says, whose e4m3
    accumulation keeps ~14 bits below the accumulator's leading one; summed over all 16k keys in
    the accumulator the sums came out 24% low (the kernel now folds each block's into fp32). The
    ragged shapes of the other tests have ~1k keys, where that did not show."""
    g = torch.Generator(device="cuda").manual_seed(headdim)
    q, k, v = (torch.randn(1, 16384, 2, headdim, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    quantized, inputs = _quantized_inputs(q, k, v, block)
    kw = dict(causal=False, window=(-1, -1), softmax_scale=None)
    problem = _problem(inputs["q"], inputs["k"], kw, torch.bfloat16, with_lse)
    dispatch.clear_plans()
    out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, (1, 2, 16384) if with_lse else None,
                                          torch.bfloat16)
    ((_, variant),) = dispatch._plans.values()
    assert not variant.split_kv
    assert variant.tensor_row_sums == (not with_lse and headdim in fwd_sm90.FP8_TENSOR_ROW_SUMS)
    _check(out, lse, quantized, kw)


@hopper_only
@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("weight", [1.875, 3.5])
@pytest.mark.parametrize("row", range(len(fp8_rows(128, None))))
def test_fp8_running_max_rising_by_a_little_or_more(row, weight, with_lse):
    """Two keys that matter: key A in the last key block (the kernel's first), key B in the first,
    whose score is log2(weight) higher (every other key ~50 log2 units lower), every input exact in
    e4m3, on every row at head dim 128 with per-head descales. Until session 47 the per-head 192-key
    row kept a maximum up to 2^1 stale in calls with the LSE, its P's offset lowered to 7: at weight
    1.875 B's block left it at A's score, and P_B = 2^(offset) * 1.875 had to fit e4m3 (448: 240;
    at offset 8, 480 saturating to 448, O 5% off); at 3.5 the maximum moved. Now every maximum
    moves and O is rescaled; the weights keep every P exact in e4m3, so O is float64's but for bf16
    rounding."""
    g = torch.Generator(device="cuda").manual_seed(row)
    seqlen_q, seqlen_k, headdim, key_a, key_b = 200, 1100, 128, 1050, 5
    q = torch.ones(1, seqlen_q, 2, headdim, device="cuda")
    k = torch.zeros(1, seqlen_k, 2, headdim, device="cuda")
    k[..., 0] = -448.0  # amax 448: the descale is 1, every code exact
    k[:, key_a, :, 0], k[:, key_b, :, 0] = 8.0, 16.0  # scores 8 and 16 times the scale
    v = torch.randn(1, seqlen_k, 2, headdim, device="cuda", generator=g)
    quantized, inputs = _quantized_inputs(*(x.to(torch.bfloat16) for x in (q, k, v)), None)
    kw = dict(causal=False, window=(-1, -1), softmax_scale=math.log(weight) / 8.0)
    problem = _problem(inputs["q"], inputs["k"], kw, torch.bfloat16, with_lse)
    with fp8_row(headdim, row, None):
        out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, (1, 2, seqlen_q) if with_lse else None,
                                              torch.bfloat16)
    ref_out, ref_lse = gpu_attention.attention(*(_dequantize(x8, d) for x8, d in quantized), compute_dtype=torch.float64,
                                               **kw, softcap=0.0)
    err = (out.double() - ref_out).abs().max().item()
    assert err <= 2e-2, f"O off by {err:.3g}"  # (bf16 rounding of |O| <= 4: 8e-3; FMA-pipe exponentials 2.1e-3 relative)
    if with_lse:
        assert (lse.double() - ref_lse).abs().max().item() <= 1e-4


@hopper_only
@pytest.mark.parametrize("headdim,row,with_lse", [(128, row, True) for row in range(len(fp8_rows(128, None)))]
                         + [(256, row, False) for row in range(len(fp8_rows(256, None)))])
def test_fp8_rows_led_by_a_few_large_keys_keep_the_bound(headdim, row, with_lse):
    """The hypothesis test's inputs (every 7th key times 4: a few keys lead each row; every 5th
    value row times 3), 64 query rows and 1100 keys, per-head descales, forty seeds on every row at
    head dim 128 returning the LSE and at 256 without it (FP8_STALE_MAX's row). A stale running
    maximum leaves such a row's largest weight rounded to e4m3 instead of an exact power of two: O
    divided by the unrounded sum carried that (2^1 on 128's per-head 192-key row with the LSE until
    session 47: 1 seed in 40 broke the bound here, H200), O divided by the sums of P as rounded
    does not."""
    kw = dict(causal=False, window=(-1, -1), softmax_scale=None)
    with fp8_row(headdim, row, None):
        for seed in range(40):
            g = torch.Generator(device="cuda").manual_seed(seed)
            q, k, v = (torch.randn(1, s, 2, headdim, device="cuda", generator=g, dtype=torch.bfloat16)
                       for s in (64, 1100, 1100))
            k[:, ::7] *= 4
            v[:, 1::5] *= 3
            quantized, inputs = _quantized_inputs(q, k, v, None, seed=3)
            problem = _problem(inputs["q"], inputs["k"], kw, torch.bfloat16, with_lse)
            out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, (1, 2, 64) if with_lse else None,
                                                  torch.bfloat16)
            _check(out, lse, quantized, kw)


@hopper_only
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("headdim,row,block", EVERY_ROW)
def test_fp8_blocks_and_rows_of_negative_scores(headdim, row, block, with_lse, causal):
    """test_gpu_fwd's blocks and rows of negative scores (the integer row maxima's fallback,
    gpu_attention.signed_scores_inputs) on every FP8 row, with and without the LSE."""
    g = torch.Generator(device="cuda").manual_seed(headdim + row)
    signed = gpu_attention.signed_scores_inputs((1, 200, 2, headdim), (1, 1100, 2, headdim), g)
    quantized, inputs = _quantized_inputs(*(x.to(torch.bfloat16) for x in signed), block)
    kw = dict(causal=causal, window=(-1, -1), softmax_scale=4.0)
    problem = _problem(inputs["q"], inputs["k"], kw, torch.bfloat16, with_lse)
    with fp8_row(headdim, row, block):
        out, lse = gpu_attention.run_poisoned(problem, inputs, (1, 200, 2, headdim), (1, 2, 200) if with_lse else None,
                                              torch.bfloat16)
    _check(out, lse, quantized, kw)


@hopper_only
@pytest.mark.parametrize("with_lse", [True, False])
@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_kv", [
    (1, 1, 20000, 16, 4), (2, 1, 3000, 8, 8), (1, 5, 9000, 4, 2), (3, 1, 700, 32, 8)])
def test_fp8_decode_as_rows_and_split_kv_match_reference(batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim, block,
                                                        with_lse):
    """FP8 decode steps: GQA's query heads as the rows of their kv head (q's descales then one a row)
    and, with few tiles, split-KV (float32 partials in a poisoned workspace, combine_splits); per-head
    and per-128-row descales, with and without the LSE, against the reference, bit for bit again."""
    from cuflash.kernels import forward

    g = torch.Generator(device="cuda").manual_seed(seqlen_k + headdim)
    q = torch.randn(batch, seqlen_q, nheads, headdim, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", generator=g, dtype=torch.bfloat16)
            for _ in range(2))
    q[:, :, ::3] *= 5  # query heads of one kv head with different descales
    k[:, ::7] *= 4
    v[:, 1::5] *= 3
    quantized, inputs = _quantized_inputs(q, k, v, block)
    kw = dict(causal=seqlen_q == 1, window=(-1, -1), softmax_scale=None)
    problem = _problem(inputs["q"], inputs["k"], kw, torch.bfloat16, with_lse)
    planned = forward.query_heads_as_rows(problem) or problem
    assert (planned is problem) == (seqlen_q > 1 or nheads == nheads_kv)
    lse_shape = (batch, nheads, seqlen_q) if with_lse else None
    dispatch.clear_plans()
    out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, lse_shape, torch.bfloat16)
    # (query heads as rows: a split variant, in one part where kv_splits has none)
    assert [(p.seqlen_q, variant.split_kv) for (p, _), (_, variant) in dispatch._plans.items()] == \
        [(planned.seqlen_q, fwd_sm90.split_parts(planned) is not None)]
    _check(out, lse, quantized, kw)
    _assert_same_again(problem, inputs, out, lse)


@hopper_only
@pytest.mark.parametrize("block", [None, 128])
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_kv, window", [
    (1, 4, 20000, 16, 4, (-1, 0)), (2, 5, 3001, 8, 2, (-1, 3)), (1, 64, 9000, 2, 1, (-1, 40)),
    (1, 128, 5000, 1, 1, (8999, 0))])
def test_fp8_masked_split_kv_matches_reference(batch, seqlen_q, seqlen_k, nheads, nheads_kv, window, headdim, block):
    """FP8 speculative steps (a few rows, causal or right-bounded, GQA, a left bound that hides no key)
    run the e4m3 masked split variants: per-head and per-128-row descales against the reference, the
    outputs and the partials' workspace poisoned, bit for bit again."""
    g = torch.Generator(device="cuda").manual_seed(seqlen_k + headdim + seqlen_q)
    q = torch.randn(batch, seqlen_q, nheads, headdim, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", generator=g, dtype=torch.bfloat16)
            for _ in range(2))
    k[:, ::7] *= 4
    v[:, 1::5] *= 3
    quantized, inputs = _quantized_inputs(q, k, v, block)
    kw = dict(causal=window == (-1, 0), window=window, softmax_scale=None)
    problem = _problem(inputs["q"], inputs["k"], kw, torch.bfloat16)
    assert fwd_sm90.kv_splits(problem) > 1
    lse_shape = (batch, nheads, seqlen_q)
    dispatch.clear_plans()
    out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, lse_shape, torch.bfloat16)
    assert [(variant.split_kv, variant.masked) for _, variant in dispatch._plans.values()] == [(True, True)]
    _check(out, lse, quantized, kw)
    _assert_same_again(problem, inputs, out, lse)


def _v_transposed(v8):
    """e4m3 V (batch, seqlen, heads, dim) as the pre-transposed FP8 forward loads it (as uint8 bits):
    (batch, heads, dim, seqlen padded to 16 with zeros), keys within each group of 16 in the order the
    kernel packs P (transpose_v_fp8.cu): position 4c + q holds key 2c + (q & 1) + 8 (q >> 1)."""
    batch, seqlen, heads, dim = v8.shape
    pad = -seqlen % 16
    bits = torch.nn.functional.pad(v8.view(torch.uint8), (0, 0, 0, 0, 0, pad))
    order = torch.tensor([2 * c + (q & 1) + 8 * (q >> 1) for c in range(4) for q in range(4)], device=v8.device)
    groups = bits.view(batch, (seqlen + pad) // 16, 16, heads, dim)[:, :, order]
    return groups.reshape(batch, seqlen + pad, heads, dim).permute(0, 2, 3, 1)


@hopper_only
@settings(max_examples=80, deadline=None)
@given(headdim=st.sampled_from([64, 128, 256, 32, 96, 192]), batch=st.integers(1, 3), seqlen_q=SEQLENS,
       seqlen_k=SEQLENS, nheads_kv=st.integers(1, 2), group=st.sampled_from([1, 2, 4]), kw=features(),
       hadamard=st.booleans(), dtype=st.sampled_from([torch.bfloat16, torch.float16]),
       row=st.one_of(st.none(), st.integers(0, 3)), with_lse=st.booleans(), misaligned=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_fp8_true_quantizes_as_quantize_fp8_and_matches_reference(headdim, batch, seqlen_q, seqlen_k, nheads_kv, group,
                                                                  kw, hadamard, dtype, row, with_lse, misaligned, seed):
    """attention(fp8=True) as one op (fwd_quantized_sm90) on its own row (row None: one of FP8_TILES'
    rows, pre-transposed; from 2048 keys at head dim 128 the 192-key row, the next test's) or any of
    the rows of k's and v's scale block fwd_fp8_sm90 may take: its workspace holds exactly
    quantize_fp8's codes and descales (q per 128 rows, k and v per reference.fp8_key_block rows,
    seed 0), V's as V^T, padding keys zero; its out (and lse) pass _check against them; a second
    run gives the same bits. Rows of v (and q) 2 bytes off a 16-byte boundary take the element
    loads."""
    assume(batch * nheads_kv * group * seqlen_q * seqlen_k <= MAX_SCORES)
    _fp8_true_case(headdim, batch, seqlen_q, seqlen_k, nheads_kv, group, kw, hadamard, dtype, row, with_lse,
                   misaligned, seed)


@hopper_only
@pytest.mark.parametrize("headdim, seqlen_k, causal, with_lse, row", [
    (128, 4096, False, False, None), (128, 4300, True, True, None), (128, 4300, False, True, 0),
    (96, 2100, True, False, None), (128, 2047, False, False, None), (128, 2048, True, False, None),
    (64, 4200, True, False, None)])
def test_fp8_true_from_2048_keys_quantizes_k_and_v_per_192_rows(headdim, seqlen_k, causal, with_lse, row):
    """As test_fp8_true_quantizes_as_quantize_fp8_and_matches_reference, beyond its lengths: from
    reference.FP8_WIDE_KEYS_FROM keys at head dims 65-128, k and v take one scale per 192 rows on the
    192-key row (key tails short of a block; 2047 keys and head dim 64 stay at 128)."""
    kw = dict(causal=causal, window=(-1, -1), softmax_scale=None)
    _fp8_true_case(headdim, 1, 300, seqlen_k, 2, 2, kw, True, torch.bfloat16, row, with_lse, headdim == 96, 11)


def _fp8_true_case(headdim, batch, seqlen_q, seqlen_k, nheads_kv, group, kw, hadamard, dtype, row, with_lse,
                   misaligned, seed):
    """One case of attention(fp8=True) as one op: its workspace against quantize_fp8's codes and
    descales, its out (and lse) against the reference (_check), a second run's bits."""
    nheads = nheads_kv * group
    hadamard = hadamard and headdim in (64, 128, 256)
    g = torch.Generator(device="cuda").manual_seed(seed)
    pad = 1 if misaligned else 0
    q, k, v = (torch.randn(batch, s, h, headdim + pad, device="cuda", generator=g, dtype=dtype)[..., pad:]
               for s, h in ((seqlen_q, nheads), (seqlen_k, nheads_kv), (seqlen_k, nheads_kv)))
    k[:, ::7] *= 4
    v[:, 1::5] *= 3
    problem = _problem(q, k, kw, dtype, with_lse, op="attention_quantized_forward",
                       dtype=str(dtype).removeprefix("torch."), fp8_block=reference.FP8_BLOCK,
                       hadamard_seed=0 if hadamard else None)
    inputs = dict(q=q, k=k, v=v)
    lse_shape = (batch, nheads, seqlen_q) if with_lse else None
    workspace = {}
    key_block = reference.fp8_key_block(headdim, seqlen_k)
    with contextlib.nullcontext() if row is None else fp8_row(headdim, row, key_block):
        out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, lse_shape, dtype, workspace)
        _assert_same_again(problem, inputs, out, lse)
    quantized = (_quantize(q, reference.FP8_BLOCK, hadamard), _quantize(k, key_block, hadamard),
                 _quantize(v, key_block, False))
    for name, (x8, descale) in zip("qk", quantized):
        assert torch.equal(workspace[f"{name}8"].view(torch.uint8), x8.view(torch.uint8)), f"{name}'s codes"
        assert torch.equal(workspace[f"{name}_descale"], descale), f"{name}'s descales"
    assert torch.equal(workspace["v_descale"], quantized[2][1]), "v's descales"
    if "v_transposed" in workspace:
        assert torch.equal(workspace["v_transposed"].view(torch.uint8), _v_transposed(quantized[2][0])), "V^T"
    else:
        assert torch.equal(workspace["v8"].view(torch.uint8), quantized[2][0].view(torch.uint8)), "v's codes"
    _check(out, lse, quantized, kw, key_block)


@hopper_only
@pytest.mark.parametrize("headdim, seqlen_k", [(64, 700), (128, 1000), (128, 3000), (256, 900), (96, 2500)])
def test_fp8_true_quantizers_staged_or_straight_give_the_same_bits(monkeypatch, headdim, seqlen_k):
    """attention(fp8=True) with its quantizers' items staged through shared memory (LOAD_STAGED, on
    Hopper) and with 16-byte loads straight into registers (LOAD_VECTORS, chosen by shrinking the
    shared memory the selection sees, as on GPUs with 100 KiB an SM): the same out and lse, bit for
    bit (at head dim 128 from 2k keys, k and v per 192 rows), over CTAs of several items (items
    split as for a GPU of 4 SMs)."""
    from cuflash import jit
    from cuflash.kernels import quantize_fp8

    g = torch.Generator(device="cuda").manual_seed(headdim + seqlen_k)
    q = torch.randn(2, 300, 4, headdim, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(2, seqlen_k, 2, headdim, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    properties = {**jit.device_properties(0), "multiProcessorCount": 4}
    results = []
    for loads, per_sm in ((quantize_fp8.LOAD_STAGED, properties["sharedMemPerMultiprocessor"]),
                          (quantize_fp8.LOAD_VECTORS, 0)):
        monkeypatch.setattr(jit, "device_properties",
                            lambda index: {**properties, "sharedMemPerMultiprocessor": per_sm})
        dispatch.clear_plans()
        assert quantize_fp8.select_loads(0, True, reference.FP8_BLOCK, 256) == loads
        out, lse = cuflash.attention(q, k, v, fp8=True, hadamard=headdim in (64, 128, 256), causal=True,
                                     return_lse=True)
        results.append((out.clone(), lse.clone()))
    dispatch.clear_plans()
    assert torch.isfinite(results[0][0]).all()
    assert torch.equal(results[0][0], results[1][0]) and torch.equal(results[0][1], results[1][1])


@hopper_only
def test_fp8_true_runs_on_the_gpu_close_to_bf16_attention():
    """attention(..., fp8=True) quantizes and runs the FP8 kernel: out in q's dtype, close to the
    bf16 kernel's (the FP8 error budget), through the public API and its checks."""
    g = torch.Generator(device="cuda").manual_seed(5)
    q, k, v = (torch.randn(2, 700, 4, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    want = cuflash.attention(q, k, v, causal=True)
    for hadamard in (False, True):
        got = cuflash.attention(q, k, v, causal=True, fp8=True, hadamard=hadamard)
        assert got.dtype == torch.bfloat16 and got.shape == q.shape
        rel = ((got.float() - want.float()).norm() / want.float().norm()).item()
        assert rel < 0.05, rel


@hopper_only
def test_fp8_attention_public_api_returns_lse_and_out_dtype():
    g = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(1, 300, 2, 64, device="cuda", generator=g, dtype=torch.float16)
    q8, qd = cuflash.quantize_fp8(q, block=128)
    out, lse = cuflash.attention_fp8(q8, q8, q8, qd, qd, qd, out_dtype=torch.float16, return_lse=True)
    assert out.dtype == torch.float16 and lse.shape == (1, 2, 300)
    _check(out, lse, ((q8, qd),) * 3, dict(causal=False, window=(-1, -1), softmax_scale=None))


@hopper_only
@pytest.mark.parametrize("headdim, seqlen_q", [(128, 300), (256, 600)])  # 256 beyond 512 rows: V^T beforehand
def test_fp8_repeated_calls_read_each_calls_arrays(headdim, seqlen_q):
    """Calls of quantize_fp8, attention_fp8 and attention(fp8=True) after the first with arrays laid
    out alike skip the checks and reuse the prepared launches (dispatch.run_checked): each must
    read its own arrays and descales."""
    g = torch.Generator(device="cuda").manual_seed(headdim)
    kw = dict(causal=True, window=(-1, -1), softmax_scale=None)
    for _ in range(3):
        q = torch.randn(2, seqlen_q, 4, headdim, device="cuda", generator=g, dtype=torch.bfloat16)
        k, v = (torch.randn(2, 650, 2, headdim, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
        quantized = [cuflash.quantize_fp8(x, block=128) for x in (q, k, v)]
        out, lse = cuflash.attention_fp8(*(x8 for x8, _ in quantized), *(d for _, d in quantized), causal=True,
                                         return_lse=True)
        _check(out, lse, quantized, kw)
        # attention(fp8=True), whose k and v take 192-row scales from 2k keys at head dim 128
        key_block = reference.fp8_key_block(headdim, k.shape[1])
        quantized = (_quantize(q, reference.FP8_BLOCK, True), _quantize(k, key_block, True),
                     _quantize(v, key_block, False))
        _check(cuflash.attention(q, k, v, causal=True, fp8=True, hadamard=True), None, quantized, kw, key_block)


@hopper_only
def test_fp8_kernel_launched_during_the_v_transpose_pass_reads_what_the_pass_wrote():
    """At head dim 256 beyond 512 query rows a pass writes V^T (transpose_v_fp8.cu) into a workspace
    and the attention kernel is launched as its programmatic dependent (driver.DependentLaunch): it
    may start while the pass still runs, and its producer waits for the pass to complete before it
    loads V^T. Many keys (a long pass; ragged, and v strided as a packed kv gives it) and a tile per
    CTA (every CTA's first V^T load, of the last key block, at its start), with the workspace
    poisoned before each call: V^T has the pass's bits and each call the first's (which are within
    the reference's bounds), eagerly, replayed from a CUDA graph (the dependency then a programmatic
    edge) and under jax.jit. (With the wait removed, none of 100 such calls on an H200 read the
    poison: the kernel's CTAs start only as the pass's last blocks leave the SMs. This test guards
    the launch path and the pass, not the wait's timing.)"""
    g = torch.Generator(device="cuda").manual_seed(256)
    q = torch.randn(1, 1024, 16, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    kv = torch.randn(1, 16377, 16, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    (q8, qd), (kv8, kvd) = (cuflash.quantize_fp8(x, block=reference.FP8_BLOCK) for x in (q, kv))
    quantized = ((q8, qd), (kv8[:, :, :8], kvd[:, :8]), (kv8[:, :, 8:], kvd[:, 8:]))
    inputs = dict(zip(("q", "q_descale", "k", "k_descale", "v", "v_descale"), (x for pair in quantized for x in pair)))
    kw = dict(causal=False, window=(-1, -1), softmax_scale=None)
    problem = _problem(inputs["q"], inputs["k"], kw, torch.bfloat16, with_lse=False)
    dispatch.clear_plans()
    workspace = {}
    out, _ = gpu_attention.run_poisoned(problem, inputs, q.shape, None, torch.bfloat16, workspace_out=workspace)
    ((_, variant),) = dispatch._plans.values()
    assert variant.v_pretransposed and not variant.split_kv
    assert torch.equal(workspace["v_transposed"].view(torch.uint8), _v_transposed(inputs["v"]))
    _check(out, None, quantized, kw)
    for _ in range(8):
        _assert_same_again(problem, inputs, out, None)
    names = ("q", "k", "v", "q_descale", "k_descale", "v_descale")
    _assert_graph_replays_give(lambda: cuflash.attention_fp8(*(inputs[n] for n in names)), out)
    jax = pytest.importorskip("jax")
    if jax.default_backend() == "gpu":  # XLA's stream, workspace and outputs (XLA's arrays are dense)
        args = [jax.dlpack.from_dlpack(inputs[n].contiguous()) for n in names]
        assert torch.equal(torch.from_dlpack(jax.jit(cuflash.attention_fp8)(*args)), out)


@hopper_only
def test_fp8_true_chain_of_launches_waits_for_every_quantizer():
    """attention(fp8=True) launches the quantizers of q, k and v and the attention kernel as a chain
    of programmatic dependents (quantized_sm90.prepare; grid_dependency.cuh, ChainLink): each starts
    as the CTAs of the one before have all started, and the attention kernel waits before it reads,
    but a wait covers only the kernel one link back, so each link keeps its threads until the one
    before it has completed. Here q's quantizer runs long (32k rows of 16 heads, several waves) and
    k's and v's short (256 keys): were the chain to let a link end first, the attention kernel would
    read q's poisoned workspace. Eagerly (workspace poisoned, the codes against quantize_fp8's, a
    second run's bits), replayed from a CUDA graph (programmatic edges) and under jax.jit."""
    kw = dict(causal=False, window=(-1, -1), softmax_scale=None)
    _fp8_true_case(128, 1, 32768, 256, 2, 8, kw, True, torch.bfloat16, None, False, False, 50)
    g = torch.Generator(device="cuda").manual_seed(51)
    q = torch.randn(1, 32768, 16, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 256, 2, 128, device="cuda", generator=g, dtype=q.dtype) for _ in range(2))
    want = cuflash.attention(q, k, v, fp8=True, hadamard=True)
    _assert_graph_replays_give(lambda: cuflash.attention(q, k, v, fp8=True, hadamard=True), want)
    jax = pytest.importorskip("jax")
    if jax.default_backend() == "gpu":  # XLA's stream and workspace
        got = jax.jit(lambda a, b, c: cuflash.attention(a, b, c, fp8=True, hadamard=True))(
            *(jax.dlpack.from_dlpack(x) for x in (q, k, v)))
        assert torch.equal(torch.from_dlpack(got), want)


@hopper_only
def test_quantize_fp8_per_head_launches_each_wait_for_the_one_before():
    """quantize_fp8 with one scale per head takes three launches (each block's amax, a head's descale
    from them, the codes), the second and third programmatic dependents of the one before; the
    third loads its first item of x before it waits for the descales. With x8, the descales and the
    block-amax workspace poisoned, a long tensor (several waves of CTAs; outliers late in one head,
    so its descale comes from the last blocks) gives the reference's descales and codes, a second
    run the same bits, and so does a CUDA graph's replay."""
    g = torch.Generator(device="cuda").manual_seed(52)
    x = torch.randn(1, 40000, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    x[:, 39000::37, 5] *= 30
    problem = Problem(op="quantize_fp8", framework="torch", device=arrays.Device("cuda", x.device.index or 0),
                      dtype="bfloat16", batch=1, seqlen_q=40000, seqlen_k=40000, nheads=8, nheads_kv=8, headdim=128,
                      fp8_block=None, hadamard_seed=0)
    shapes = dict(x8=(x.shape, "float8_e4m3fn"), descale=((1, 8), "float32"), **kernels.workspace(problem))
    assert "block_amax" in shapes

    def run():
        outputs = {name: gpu_attention._poisoned(shape, dtype) for name, (shape, dtype) in shapes.items()}
        dispatch.execute(problem, dict(x=x), outputs, torch.cuda.current_stream().cuda_stream)
        torch.cuda.synchronize()
        return outputs["x8"].view(torch.uint8), outputs["descale"]

    x8, descale = run()
    want8, want_descale = reference.quantize_fp8(x.cpu().float().numpy(), None, 0)
    np.testing.assert_allclose(descale.cpu().numpy(), want_descale, rtol=2e-6)
    got = x8.cpu().numpy().view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    want = want8.astype(np.float64)
    assert (np.abs(got - want) <= reference.e4m3_spacing(want) + 1e-12).all()
    assert np.mean(got != want) < 1e-3
    again8, again_descale = run()
    assert torch.equal(again8, x8) and torch.equal(again_descale, descale), "moved between identical runs: a race"
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured8, captured_descale = cuflash.quantize_fp8(x, hadamard=True, seed=0)
    for _ in range(2):
        captured8.view(torch.uint8).fill_(0x7F)
        captured_descale.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured8.view(torch.uint8), x8) and torch.equal(captured_descale, descale)


@hopper_only
def test_fp8_attention_under_jax_jit_matches_torch():
    """JAX arrays on the GPU: attention(fp8=True) under jax.jit, where XLA allocates the outputs and
    the V^T workspace (head dim 256 beyond 512 query rows), gives torch's bits; so does
    cuflash.jax.attention(fp8=True)."""
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    import cuflash.jax as cj

    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(1, 700, 4, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 900, 2, 256, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    assert fwd_sm90.fp8_workspace(_problem(q, k, dict(causal=True, window=(-1, -1), softmax_scale=None),
                                           torch.bfloat16)), "this shape should take the pre-transposed row"
    want = cuflash.attention(q, k, v, causal=True, fp8=True, hadamard=True)
    to_jax = lambda t: jax.dlpack.from_dlpack(t)
    for attention in (cuflash.attention, cj.attention):
        got = jax.jit(lambda a, b, c: attention(a, b, c, causal=True, fp8=True, hadamard=True))(
            to_jax(q), to_jax(k), to_jax(v))
        assert torch.equal(torch.from_dlpack(got), want)
    # Scales per head: three launches of the quantizer with a workspace between them, XLA's here.
    x8, descale = jax.jit(lambda a: cuflash.quantize_fp8(a, hadamard=True))(to_jax(q))
    want8, want_descale = cuflash.quantize_fp8(q, hadamard=True)
    assert np.array_equal(np.asarray(x8).view(np.uint8), want8.view(torch.uint8).cpu().numpy())
    assert np.array_equal(np.asarray(descale), want_descale.cpu().numpy())


@hopper_only
def test_fp8_true_with_192_row_scales_under_jax_jit_and_torch_compile():
    """attention(fp8=True) at head dim 128 from 2048 keys (k and v per 192 rows: workspace descales of
    ceil(2100 / 192) blocks, which JAX declares at trace time and XLA allocates) gives the eager torch
    call's bits under jax.jit, through cuflash.jax, and through cuflash.torch under torch.compile."""
    jax = pytest.importorskip("jax")
    import cuflash.torch as ct

    g = torch.Generator(device="cuda").manual_seed(10)
    q = torch.randn(1, 300, 4, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 2100, 2, 128, device="cuda", generator=g, dtype=q.dtype) for _ in range(2))
    assert reference.fp8_key_block(128, 2100) == reference.FP8_WIDE_KEY_BLOCK
    kw = dict(causal=True, fp8=True, hadamard=True, return_lse=True)
    want, want_lse = cuflash.attention(q, k, v, **kw)
    with torch.no_grad():
        got, lse = torch.compile(lambda: ct.attention(q, k, v, **kw), fullgraph=True)()
    assert torch.equal(got, want) and torch.equal(lse, want_lse)
    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    import cuflash.jax as cj

    for attention in (cuflash.attention, cj.attention):
        got, lse = jax.jit(lambda a, b, c: attention(a, b, c, **kw))(*(jax.dlpack.from_dlpack(x) for x in (q, k, v)))
        assert torch.equal(torch.from_dlpack(got), want) and torch.equal(torch.from_dlpack(lse), want_lse)


@hopper_only
def test_fp8_torch_custom_ops_under_compile_match_the_plain_functions():
    """cuflash.torch's FP8 custom ops under torch.compile(fullgraph=True), V^T workspace included
    (head dim 256 beyond 512 query rows), give the plain functions' bits."""
    import cuflash.torch as ct

    g = torch.Generator(device="cuda").manual_seed(9)
    q = torch.randn(1, 700, 4, 256, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(1, 900, 2, 256, device="cuda", generator=g, dtype=q.dtype) for _ in range(2))

    def run(quantize, attention_fp8, attention):
        (q8, qd), (k8, kd), (v8, vd) = (quantize(x, block=b) for x, b in ((q, None), (k, None), (v, 128)))
        return (q8.view(torch.uint8), vd, *attention_fp8(q8, k8, v8, qd, kd, vd, causal=True, return_lse=True),
                *attention(q, k, v, fp8=True, hadamard=True, window=(300, 0), return_lse=True))

    compiled = torch.compile(lambda: run(ct.quantize_fp8, ct.attention_fp8, ct.attention), fullgraph=True)
    with torch.no_grad():
        got = compiled()
    want = run(cuflash.quantize_fp8, cuflash.attention_fp8, cuflash.attention)
    for g_, w in zip(got, want):
        assert g_.dtype == w.dtype and torch.equal(g_, w)


@hopper_only
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_fp8_true_on_cupy_arrays_matches_torch(dtype):
    """CuPy arrays (which cannot hold e4m3): attention(fp8=True) quantizes them into uint8 buffers of
    its own, V^T workspace included (head dim 256 beyond 512 query rows), called inside a
    non-default CuPy stream, and gives torch's bits, twice (the second call through the remembered
    plan). quantize_fp8 and attention_fp8 still refuse CuPy, called with the arguments and layouts
    of fp8=True's own calls (whose remembered plans must not answer for them)."""
    cupy = pytest.importorskip("cupy")
    g = torch.Generator(device="cuda").manual_seed(8)
    q = torch.randn(1, 700, 4, 256, device="cuda", generator=g, dtype=getattr(torch, dtype))
    k, v = (torch.randn(1, 900, 2, 256, device="cuda", generator=g, dtype=q.dtype) for _ in range(2))
    assert fwd_sm90.fp8_workspace(_problem(q, k, dict(causal=True, window=(-1, -1), softmax_scale=None), q.dtype))
    want, want_lse = cuflash.attention(q, k, v, causal=True, fp8=True, hadamard=True, return_lse=True)
    torch.cuda.synchronize()
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        qc, kc, vc = (cupy.from_dlpack(x) for x in (q, k, v))
        for _ in range(2):
            got, lse = cuflash.attention(qc, kc, vc, causal=True, fp8=True, hadamard=True, return_lse=True)
            assert isinstance(got, cupy.ndarray) and got.dtype == qc.dtype and got.shape == qc.shape
            stream.synchronize()
            assert torch.equal(torch.from_dlpack(got), want) and torch.equal(torch.from_dlpack(lse), want_lse)
    with pytest.raises(TypeError, match="x is a CuPy array, and CuPy has no float8_e4m3fn"):
        cuflash.quantize_fp8(qc, block=128, hadamard=True, seed=0)
    bits = [cupy.zeros(x.shape, cupy.uint8) for x in (qc, kc, vc)]
    descales = [cupy.ones((1, x.shape[2], -(-x.shape[1] // 128)), cupy.float32) for x in (qc, kc, vc)]
    with pytest.raises(TypeError, match="q8 must be float8_e4m3fn .*got uint8; CuPy has no e4m3 dtype"):
        cuflash.attention_fp8(*bits, *descales, causal=True, out_dtype=dtype)


@pytest.mark.skipif(_hopper(), reason="the refusal is for GPUs without the FP8 kernel")
def test_fp8_attention_elsewhere_says_which_gpu_it_needs():
    q = torch.randn(1, 8, 2, 64, device="cuda", dtype=torch.bfloat16)
    with pytest.raises(NotImplementedError, match="fwd_quantized_sm90 needs compute capability 9.0"):
        cuflash.attention(q, q, q, fp8=True)
