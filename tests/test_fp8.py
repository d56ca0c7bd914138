"""FP8 (e4m3) on the reference backend: quantization, the Hadamard transform, attention on quantized
inputs, the convenience path attention(..., fp8=True), argument checks, frameworks, and the
accuracy study of issue 6 (per-tensor vs block scales vs block scales with the transform)."""
import dataclasses
import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import reference

E4M3 = ml_dtypes.float8_e4m3fn
REL = 2.0**-4  # e4m3 keeps 3 mantissa bits: half an ulp is at most 2^-4 of the value (normal range)
ABS = 2.0**-10  # half the smallest subnormal (2^-9), in units of the descale


def _rows(descale, seqlen):
    """A descale (B, H) or (B, H, ceil(S / 128)) as a factor over x (B, S, H, D), expanded here
    independently of the reference: row r takes block r // 128."""
    descale = np.asarray(descale, np.float64)
    if descale.ndim == 2:
        return descale[:, None, :, None]
    assert descale.shape[2] == -(-seqlen // 128)
    return np.swapaxes(np.repeat(descale, 128, axis=2)[:, :, :seqlen], 1, 2)[..., None]


def _normal(rng, shape, outliers=0.0):
    x = rng.standard_normal(shape)
    if outliers:
        x[rng.random(shape) < outliers] *= 10
    return x


def test_hadamard_is_orthogonal_and_cancels_in_qk():
    rng = np.random.default_rng(0)
    for d in (1, 2, 64, 128, 256):
        h = reference.hadamard_matrix(d, seed=3)
        np.testing.assert_allclose(h @ h.T, np.eye(d), atol=1e-12)
        assert set(np.unique(np.abs(h)).round(12)) == {round(1 / math.sqrt(d), 12)}
    q, k = rng.standard_normal((5, 64)), rng.standard_normal((7, 64))
    h = reference.hadamard_matrix(64, seed=9)
    np.testing.assert_allclose((q @ h) @ (k @ h).T, q @ k.T, atol=1e-12)
    assert not np.allclose(reference.hadamard_matrix(64, 1), reference.hadamard_matrix(64, 2))
    with pytest.raises(ValueError, match="power of two"):
        reference.hadamard_matrix(96, 0)


def test_quantize_transforms_with_x_times_the_hadamard_matrix():
    """The direction of the transform (x @ M with M = diag(signs) H / sqrt(d)), which q k^T alone
    cannot tell from M^T: the round trip lands on x @ M."""
    rng = np.random.default_rng(8)
    x = rng.standard_normal((1, 140, 2, 128))
    x8, descale = cuflash.quantize_fp8(x, block=128, hadamard=True, seed=4)
    want = x @ reference.hadamard_matrix(128, 4)
    back = reference.dequantize_fp8(x8, descale)
    assert (np.abs(back - want) <= REL * np.abs(want) + ABS * _rows(descale, 140) + 1e-12).all()
    assert np.abs(back - x @ reference.hadamard_matrix(128, 4).T).max() > 0.5  # M^T is another matrix


def test_quantize_keeps_descales_normal_for_tiny_heads():
    """A head whose amax / 448 is below the smallest normal float32 gets that smallest normal: a GPU
    would flush a smaller descale to zero (and x / 0 to inf). Its codes stay within 448."""
    x = np.random.default_rng(3).standard_normal((1, 40, 2, 64))
    x[0, :, 1] = np.sign(x[0, :, 1]) * (1 + np.abs(x[0, :, 1])) * 2.0**-120  # normal floats, amax / 448 < 2^-126
    x8, descale = cuflash.quantize_fp8(x.astype(np.float32))
    assert descale[0, 1] == np.finfo(np.float32).tiny and descale[0, 0] == np.float32(np.abs(x[0, :, 0]).max() / 448)
    back = reference.dequantize_fp8(x8, descale)
    assert np.isfinite(back).all() and np.abs(x8.astype(np.float64)).max() <= 448
    assert np.allclose(back[0, :, 1], x[0, :, 1], rtol=2.0**-3, atol=0)


def test_quantize_ignores_nans_for_the_scale_and_a_short_sequence_is_one_short_block():
    x = np.random.default_rng(9).standard_normal((1, 8, 1, 64))
    clean8, clean_descale = cuflash.quantize_fp8(x)
    x[0, 3, 0, 5] = np.nan
    x8, descale = cuflash.quantize_fp8(x)
    assert descale == clean_descale and np.isnan(x8.astype(np.float32)).sum() == 1
    same = x8.astype(np.float32) == clean8.astype(np.float32)
    assert same.sum() == x.size - 1
    short8, short_descale = cuflash.quantize_fp8(x, block=128)  # 8 rows: one block, 120 rows short
    assert short_descale.shape == (1, 1, 1) and short_descale[0, 0, 0] == descale[0, 0]
    assert np.array_equal(short8.astype(np.float32), x8.astype(np.float32), equal_nan=True)
    empty8, empty_descale = cuflash.quantize_fp8(x[:, :0], block=128)
    assert empty8.shape == (1, 0, 1, 64) and empty_descale.shape == (1, 1, 0)


@pytest.mark.parametrize("block", [None, 128])
def test_quantize_maps_each_scale_group_to_448_and_round_trips(block):
    """Per head, or per block of 128 rows (300 rows: blocks of 128, 128 and a short 44), one scale
    per block (no repetition per row); an all-zero head or block gets descale 1."""
    rng = np.random.default_rng(1)
    x = _normal(rng, (2, 300, 3, 64), outliers=0.01).astype(np.float32)
    x[1, :, 2] = 0  # an all-zero head
    x[0, 128:256, 1] = 0  # an all-zero block
    x8, descale = cuflash.quantize_fp8(x, block=block)
    assert x8.dtype == E4M3 and x8.shape == x.shape and descale.dtype == np.float32
    assert descale.shape == ((2, 3) if block is None else (2, 3, 3))
    mags = np.abs(x8.astype(np.float64))
    if block is None:
        assert (mags.max(axis=(1, 3))[[0, 0, 0, 1, 1], [0, 1, 2, 0, 1]] == 448).all()
        assert descale[1, 2] == 1 and (x8[1, :, 2].astype(np.float32) == 0).all()
    else:
        for b, h in np.ndindex(2, 3):
            for i, start in enumerate(range(0, 300, 128)):
                rows = slice(start, start + 128)
                amax = np.abs(x[b, rows, h]).max()
                if amax == 0:
                    assert descale[b, h, i] == 1 and (mags[b, rows, h] == 0).all()
                else:
                    assert descale[b, h, i] == np.float32(amax / 448) and mags[b, rows, h].max() == 448
        assert descale[0, 1, 1] == 1 and descale[1, 2].tolist() == [1, 1, 1]
    back = reference.dequantize_fp8(x8, descale)
    assert (np.abs(back - x) <= REL * np.abs(x) + ABS * _rows(descale, 300) + 1e-12).all()


def test_dequantize_expands_each_block_scale_to_its_rows():
    """Row r of a head takes descale[..., r // block], the last block short (300 rows: 128, 128, 44
    or 192, 108); a descale of another length (the per-row layout of old) is refused."""
    x8 = np.ones((1, 300, 2, 8), np.float32).astype(E4M3)
    descale = np.array([[[1.0, 2.0, 4.0], [8.0, 16.0, 32.0]]], np.float32)  # (1, 2, 3)
    back = reference.dequantize_fp8(x8, descale)
    for h in range(2):
        assert (back[0, :128, h] == descale[0, h, 0]).all()
        assert (back[0, 128:256, h] == descale[0, h, 1]).all()
        assert (back[0, 256:, h] == descale[0, h, 2]).all()
    assert np.array_equal(reference.dequantize_fp8(x8[:, :5], descale[:, :, :1]),
                          np.broadcast_to(descale[0, :, 0][None, None, :, None], (1, 5, 2, 8)))
    with pytest.raises(ValueError, match=r"\(B, H, 3\) \(one scale per 128 of 300 rows\)"):
        reference.dequantize_fp8(x8, np.ones((1, 2, 300), np.float32))
    with pytest.raises(ValueError, match="block must be None, 128 or 192"):
        reference.quantize_fp8(np.ones((1, 4, 1, 8)), block=64)
    # Blocks of 192 rows (attention(fp8=True)'s k and v at head dim 128): 300 rows are 192 and 108.
    back = reference.dequantize_fp8(x8, descale[:, :, :2], 192)
    assert (back[0, :192] == descale[0, :, 0, None]).all() and (back[0, 192:] == descale[0, :, 1, None]).all()
    with pytest.raises(ValueError, match=r"\(B, H, 2\) \(one scale per 192 of 300 rows\)"):
        reference.dequantize_fp8(x8, descale, 192)


def test_attention_fp8_is_attention_of_the_dequantized_inputs():
    """With block descales (several blocks, the last short) and per-head ones mixed: exactly the
    attention of x8 * descale expanded to rows here (not through the reference's expansion)."""
    rng = np.random.default_rng(2)
    q, k, v = (_normal(rng, (2, n, h, 64)) for n, h in ((170, 4), (290, 2), (290, 2)))
    q8, qd = cuflash.quantize_fp8(q, block=128, hadamard=True, seed=5)
    k8, kd = cuflash.quantize_fp8(k, hadamard=True, seed=5)
    v8, vd = cuflash.quantize_fp8(v, block=128)
    assert qd.shape == (2, 4, 2) and kd.shape == (2, 2) and vd.shape == (2, 2, 3)
    out, lse = cuflash.attention_fp8(q8, k8, v8, qd, kd, vd, causal=True, out_dtype="float16", return_lse=True)
    explicit = [x8.astype(np.float64) * _rows(d, x8.shape[1]) for x8, d in ((q8, qd), (k8, kd), (v8, vd))]
    want, want_lse = reference.forward(*explicit, causal=True)
    assert out.dtype == np.float16 and lse.dtype == np.float32 and lse.shape == (2, 4, 170)
    assert np.array_equal(out, want.astype(np.float16)) and np.array_equal(lse, want_lse.astype(np.float32))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_fp8_attention_on_random_shapes(data):
    """Finite outputs; exactly the attention of the dequantized inputs; and against the attention of
    the unquantized inputs (standard normal, 0.1% outliers times 10) a relative RMSE of at most 0.15
    (the stated bound: the worst of 150 random draws measured 0.087; a descale or transform applied
    wrongly is off by about 1)."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    batch, group, nheads_kv = data.draw(st.integers(1, 2)), data.draw(st.sampled_from((1, 2, 4))), data.draw(
        st.integers(1, 2))
    seqlen_q, seqlen_k = data.draw(st.integers(1, 300)), data.draw(st.integers(1, 300))
    headdim = data.draw(st.sampled_from((64, 128, 256)))
    block = data.draw(st.sampled_from((None, 128)))
    hadamard = data.draw(st.booleans())
    mask = data.draw(st.sampled_from((dict(), dict(causal=True), dict(window=(20, 5)))))
    out_dtype = data.draw(st.sampled_from(("bfloat16", "float16")))
    q = _normal(rng, (batch, seqlen_q, nheads_kv * group, headdim), outliers=0.001)
    k, v = (_normal(rng, (batch, seqlen_k, nheads_kv, headdim), outliers=0.001) for _ in range(2))
    seed = int(rng.integers(0, 1000))
    q8, qd = cuflash.quantize_fp8(q, block=block, hadamard=hadamard, seed=seed)
    k8, kd = cuflash.quantize_fp8(k, block=block, hadamard=hadamard, seed=seed)
    v8, vd = cuflash.quantize_fp8(v, block=block)
    out, lse = cuflash.attention_fp8(q8, k8, v8, qd, kd, vd, out_dtype=out_dtype, return_lse=True, **mask)
    dequantized, _ = reference.forward(*(reference.dequantize_fp8(x8, d) for x8, d in ((q8, qd), (k8, kd), (v8, vd))),
                                       **mask)
    exact, exact_lse = reference.forward(q, k, v, **mask)
    out = np.asarray(out, np.float64)
    assert np.isfinite(out).all() and np.array_equal(np.isfinite(lse), np.isfinite(exact_lse))
    assert np.array_equal(out, dequantized.astype(ml_dtypes.bfloat16 if out_dtype == "bfloat16" else np.float16))
    assert _rmse(out, exact) <= 0.15 * max(math.sqrt(np.mean(exact**2)), 2.0**-8)
    out_only = cuflash.attention_fp8(q8, k8, v8, qd, kd, vd, out_dtype=out_dtype, **mask)  # (no LSE asked for)
    assert np.array_equal(np.asarray(out_only, np.float64), out)


def _rmse(x, y):
    return float(np.sqrt(np.mean((np.asarray(x, np.float64) - y) ** 2)))


def test_forward_p_codes_is_fast_exps_yardstick():
    """reference.forward_p_codes (fast_exp's P as e4m3 codes of round(8 log2 P), the yardstick of its
    GPU tests and of `python -m cuflash check`): a row of one key gives v itself and rows without
    keys 0; on Gaussian rows its RMS error against float64 is 1.2-2.5x forward_p_e4m3's (each weight
    within 8% of exp's where e4m3's rounding is within 6%; measured 1.68-1.70x), not equal to it."""
    rng = np.random.default_rng(9)
    q, k, v = (rng.standard_normal((2, 300, 2, 64)) for _ in range(3))
    k *= 2
    diagonal = reference.forward_p_codes(q[:, :3], k[:, :2], v[:, :2], window=(0, 0))  # row i sees key i - 1 only
    assert np.array_equal(diagonal[:, 0], np.zeros_like(diagonal[:, 0]))
    assert np.array_equal(diagonal[:, 1:], v[:, :2])
    want = reference.forward(q, k, v)[0]
    rmse = lambda out: np.sqrt(np.mean((out - want) ** 2))  # noqa: E731
    ratio = rmse(reference.forward_p_codes(q, k, v)) / rmse(reference.forward_p_e4m3(q, k, v))
    assert 1.2 <= ratio <= 2.5, ratio


def test_accuracy_study_outliers():
    """Issue 6's study on the reference (inputs standard normal, 0.1% of entries times 10; RMSE of out
    against float64 attention): (a) one scale per tensor, (b) one per 128-row block, (c) (b) with
    the Hadamard transform on q and k. Only the inputs' quantization is simulated here (P is exact):
    on this machine (a) 1.47e-2, (b) 1.27e-2, (c) 8.5e-3, (a)/(c) = 1.7 (benchmarks/NOTES-fp8.md)."""
    rng = np.random.default_rng(0)
    q, k, v = (_normal(rng, (2, 1024, 4, 128), outliers=0.001) for _ in range(3))
    want, _ = reference.forward(q, k, v)

    def per_tensor(x):
        descale = np.full(x.shape[::2], np.abs(x).max() / 448, np.float32)  # (batch, heads), one value
        return (x / descale[:, None, :, None]).astype(E4M3), descale

    a = reference.attention_fp8(*per_tensor(q)[:1], *per_tensor(k)[:1], *per_tensor(v)[:1],
                                per_tensor(q)[1], per_tensor(k)[1], per_tensor(v)[1])[0]
    quant = [cuflash.quantize_fp8(x, block=128) for x in (q, k, v)]
    b = reference.attention_fp8(*(x8 for x8, _ in quant), *(d for _, d in quant))[0]
    quant = [cuflash.quantize_fp8(q, block=128, hadamard=True, seed=1), cuflash.quantize_fp8(k, block=128, hadamard=True,
                                                                                              seed=1),
             cuflash.quantize_fp8(v, block=128)]
    c = reference.attention_fp8(*(x8 for x8, _ in quant), *(d for _, d in quant))[0]
    ra, rb, rc = _rmse(a, want), _rmse(b, want), _rmse(c, want)
    print(f"RMSE (a) per tensor {ra:.2e}, (b) block 128 {rb:.2e}, (c) block 128 + Hadamard {rc:.2e}; (a)/(c) {ra / rc:.2f}")
    assert rc < rb < ra and ra / rc > 1.5
    # As a kernel would also round P: unnormalised (row max 1) to e4m3 before P V, the sum unrounded.
    pa = reference.forward_p_e4m3(*(reference.dequantize_fp8(*per_tensor(x)) for x in (q, k, v)), exp_offset=0)
    pc = reference.forward_p_e4m3(*(reference.dequantize_fp8(x8, d) for x8, d in quant), exp_offset=0)
    print(f"with P in e4m3: (a) {_rmse(pa, want):.2e}, (c) {_rmse(pc, want):.2e}, "
          f"(a)/(c) {_rmse(pa, want) / _rmse(pc, want):.2f}")
    assert _rmse(pa, want) / _rmse(pc, want) > 1.5


@pytest.mark.parametrize("headdim, seqlen_k", [(64, 4100), (128, 200), (128, 4100), (96, 4100), (256, 4100)])
def test_attention_with_fp8_true_quantizes_on_the_fly(headdim, seqlen_k):
    """attention(fp8=True): q quantized per 128 rows, k and v per reference.fp8_key_block rows (192
    at head dims 65-128 from 2048 keys, where 4100 keys make blocks of 192 ending 4031-4099: not
    attention_fp8's of 128 ending 4095-4099), then attention on the dequantized values."""
    rng = np.random.default_rng(4)
    q = _normal(rng, (1, 200, 4, headdim)).astype(ml_dtypes.bfloat16)
    k, v = (_normal(rng, (1, seqlen_k, 2, headdim)).astype(ml_dtypes.bfloat16) for _ in range(2))
    exact = reference.forward(q, k, v, causal=True)[0]
    key_block = reference.fp8_key_block(headdim, seqlen_k)
    assert key_block == (192 if headdim in (96, 128) and seqlen_k >= 2048 else 128)
    for hadamard in (False, True) if headdim != 96 else (False,):
        out, lse = cuflash.attention(q, k, v, causal=True, fp8=True, hadamard=hadamard, return_lse=True)
        seed = 0 if hadamard else None
        dequantized = [reference.dequantize_fp8(*reference.quantize_fp8(x, block, s), block) for x, block, s in
                       ((q, 128, seed), (k, key_block, seed), (v, key_block, None))]
        want, want_lse = reference.forward(*dequantized, causal=True)
        assert out.dtype == ml_dtypes.bfloat16 and np.array_equal(out, want.astype(ml_dtypes.bfloat16))
        assert np.allclose(lse, want_lse, rtol=0, atol=1e-6)
        assert 0 < _rmse(out, exact) < 0.05
        (q8, qd), (k8, kd), (v8, vd) = (cuflash.quantize_fp8(x, block=128, hadamard=h)
                                        for x, h in ((q, hadamard), (k, hadamard), (v, False)))
        per_128 = cuflash.attention_fp8(q8, k8, v8, qd, kd, vd, causal=True, out_dtype="bfloat16")
        assert np.array_equal(out, per_128) == (key_block == 128)


def test_fp8_arguments_are_checked_by_name():
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 8, 2, 64)).astype(np.float16)
    q8, qd = cuflash.quantize_fp8(q)
    with pytest.raises(TypeError, match="k8 must be float8_e4m3fn"):
        cuflash.attention_fp8(q8, q, q8, qd, qd, qd)
    with pytest.raises(ValueError, match=r"k_descale must have shape \(1, 2\) \(one scale per head\) or \(1, 2, 1\) "
                                         r"\(one scale per 128 rows of 8"):
        cuflash.attention_fp8(q8, q8, q8, qd, qd[:, :1], qd)
    with pytest.raises(TypeError, match="v_descale must be float32"):
        cuflash.attention_fp8(q8, q8, q8, qd, qd, qd.astype(np.float64))
    with pytest.raises(TypeError, match="out_dtype must be one of bfloat16, float16"):
        cuflash.attention_fp8(q8, q8, q8, qd, qd, qd, out_dtype=np.float32)
    for block in (0, 64, 256, 1, -128, 2**40):
        with pytest.raises(ValueError, match=r"block must be None \(one scale per head\), 128 or 192 .*attention_fp8 "
                                             r"takes q's per 128, k's and v's per its kv_block\); got " + str(block)):
            cuflash.quantize_fp8(q, block=block)
    for block in (2.0, 128.0, True, "128"):
        with pytest.raises(TypeError, match=r"block must be None \(one scale per head\), 128 or 192"):
            cuflash.quantize_fp8(q, block=block)
    assert cuflash.quantize_fp8(q, block=np.int64(128))[1].shape == (1, 2, 1)
    with pytest.raises(ValueError, match=r"block=192 \(attention_fp8's key block at head dims 65-128\) needs a head "
                                         r"dim there; got head dim 64: use 128"):
        cuflash.quantize_fp8(q, block=192)
    for kv_block in (64, 256, 0):
        with pytest.raises(ValueError, match=r"kv_block must be 128 or 192 \(rows per k and v descale"):
            cuflash.attention_fp8(q8, q8, q8, qd, qd, qd, kv_block=kv_block)
    for kv_block in (True, 192.0, "192", None):
        with pytest.raises(TypeError, match=r"kv_block must be 128 or 192"):
            cuflash.attention_fp8(q8, q8, q8, qd, qd, qd, kv_block=kv_block)
    with pytest.raises(ValueError, match=r"kv_block=192 .* needs a head dim there; got head dim 64"):
        cuflash.attention_fp8(q8, q8, q8, qd, qd, qd, kv_block=192)
    with pytest.raises(ValueError, match="seed must be an int >= 0"):
        cuflash.quantize_fp8(q, hadamard=True, seed=-1)
    with pytest.raises(ValueError, match="power of two"):
        cuflash.quantize_fp8(np.zeros((1, 4, 1, 96), np.float16), hadamard=True)
    with pytest.raises(TypeError, match="x has dtype float8_e4m3fn"):
        cuflash.quantize_fp8(q8)
    with pytest.raises(ValueError, match="needs fp8=True"):
        cuflash.attention(q, q, q, hadamard=True)
    with pytest.raises(ValueError, match=r"^fast_exp=True .* needs fp8=True"):
        cuflash.attention(q, q, q, fast_exp=True)
    for call in (lambda **kw: cuflash.attention_fp8(q8, q8, q8, qd, qd, qd, **kw),
                 lambda **kw: cuflash.attention(q, q, q, fp8=True, **kw)):
        with pytest.raises(ValueError, match=r"^fast_exp=True .* needs return_lse=False"):
            call(fast_exp=True, return_lse=True)
        with pytest.raises(TypeError, match="fast_exp must be a bool"):
            call(fast_exp=1)
    with pytest.raises(ValueError, match="softcap is not supported with fp8=True"):
        cuflash.attention(q, q, q, fp8=True, softcap=5.0)
    with pytest.raises(TypeError, match="fp8=True quantizes float16 or bfloat16"):
        cuflash.attention(*(x.astype(np.float32) for x in (q, q, q)), fp8=True)


def test_attention_fp8_takes_k_and_v_descales_per_192_rows_with_kv_block():
    """kv_block=192 (head dims 65-128): k's and v's block descales are one per 192 rows
    (quantize_fp8(..., block=192)), q's still per 128; per-head ones are as with kv_block=128, and a
    descale of the other block count is refused naming kv_block. Where 128 and 192 give as many
    blocks (200 rows: two either way) only kv_block says which rows a scale covers."""
    rng = np.random.default_rng(12)
    q = rng.standard_normal((1, 300, 4, 96)).astype(np.float16)
    k, v = (rng.standard_normal((1, 200, 2, 96)).astype(np.float16) * s for s in (1.0, 3.0))
    k[:, 150:] *= 8  # the last 50 keys: scaled by block 1 under both, with rows 128-191 too under 128's
    (q8, qd), (k8, kd), (v8, vd) = (cuflash.quantize_fp8(x, block=b) for x, b in ((q, 128), (k, 192), (v, 192)))
    assert kd.shape == vd.shape == (1, 2, 2)
    out, lse = cuflash.attention_fp8(q8, k8, v8, qd, kd, vd, causal=True, kv_block=192, return_lse=True)
    dequantized = [reference.dequantize_fp8(x8, d, b) for x8, d, b in ((q8, qd, 128), (k8, kd, 192), (v8, vd, 192))]
    want, want_lse = reference.forward(*dequantized, causal=True)
    assert np.array_equal(out, want.astype(ml_dtypes.bfloat16)) and np.allclose(lse, want_lse, rtol=0, atol=1e-6)
    misread = cuflash.attention_fp8(q8, k8, v8, qd, kd, vd, causal=True)  # the same descales as per 128 rows
    assert not np.array_equal(misread, out)
    (k8h, kh), (v8h, vh) = cuflash.quantize_fp8(k), cuflash.quantize_fp8(v)  # per head
    mixed = cuflash.attention_fp8(q8, k8h, v8, qd, kh, vd, kv_block=192)  # k per head, v per 192 rows
    want_mixed, _ = reference.forward(dequantized[0], reference.dequantize_fp8(k8h, kh), dequantized[2])
    assert np.array_equal(mixed, want_mixed.astype(ml_dtypes.bfloat16))
    assert np.array_equal(cuflash.attention_fp8(q8, k8h, v8h, qd, kh, vh, kv_block=192),
                          cuflash.attention_fp8(q8, k8h, v8h, qd, kh, vh))
    _, kd128 = cuflash.quantize_fp8(k[:, :130], block=128)  # 2 blocks of 128 of 130 keys; 1 of 192
    with pytest.raises(ValueError, match=r"k_descale must have shape \(1, 2\) \(one scale per head\) or \(1, 2, 1\) "
                                         r"\(one scale per 192 rows of 130 \(kv_block=192\)"):
        cuflash.attention_fp8(q8, k8[:, :130], v8[:, :130], qd, kd128, kd128, kv_block=192)


def test_attention_fp8_refuses_per_row_descales():
    """The per-row layout of old, (batch, heads, seqlen), is refused with the shapes it takes."""
    rng = np.random.default_rng(10)
    q = rng.standard_normal((1, 300, 2, 64)).astype(np.float16)
    q8, qd = cuflash.quantize_fp8(q, block=128)
    k8, kd = q8[:, :130, :1], qd[:, :1, :2]
    per_row = np.ascontiguousarray(np.repeat(qd, 128, axis=2)[:, :, :300])
    with pytest.raises(ValueError, match=r"q_descale must have shape \(1, 2\) \(one scale per head\) or \(1, 2, 3\) "
                                         r"\(one scale per 128 rows of 300, the last block possibly short\); "
                                         r"got \(1, 2, 300\)"):
        cuflash.attention_fp8(q8, k8, k8, per_row, kd, kd)
    with pytest.raises(ValueError, match=r"v_descale must have shape \(1, 1\) .* or \(1, 1, 2\) .*got \(1, 1, 130\)"):
        cuflash.attention_fp8(q8, k8, k8, qd, kd, np.ones((1, 1, 130), np.float32))
    out = cuflash.attention_fp8(q8, k8, k8, qd, kd, kd)  # the block layout, GQA, k and v shorter than q
    assert out.shape == q.shape


def test_attention_fp8_true_checks_everything_before_quantizing(monkeypatch):
    def no_quantizing(*args, **kw):
        raise AssertionError("quantized before the arguments were checked")

    monkeypatch.setattr(cuflash.api, "quantize_fp8", no_quantizing)
    q = np.zeros((1, 8, 3, 64), np.float16)
    with pytest.raises(TypeError, match="k has dtype float32 but q has float16"):
        cuflash.attention(q, q[:, :, :1].astype(np.float32), q[:, :, :1], fp8=True)
    with pytest.raises(ValueError, match=r"nheads of q \(3\) must be a multiple"):
        cuflash.attention(q, q[:, :, :2], q[:, :, :2], fp8=True)
    with pytest.raises(TypeError, match="window must be a pair"):
        cuflash.attention(q, q, q, fp8=True, window=3)
    with pytest.raises(TypeError, match="return_lse must be a bool"):
        cuflash.attention(q, q, q, fp8=True, return_lse=None)
    with pytest.raises(ValueError, match="power of two"):
        cuflash.attention(*(np.zeros((1, 8, 1, 96), np.float16),) * 3, fp8=True, hadamard=True)


def test_fp8_in_torch_and_jax_matches_numpy():
    torch = pytest.importorskip("torch")
    jax = pytest.importorskip("jax")
    rng = np.random.default_rng(6)
    q, k, v = (rng.standard_normal((1, 64, h, 64)).astype(np.float16) for h in (4, 2, 2))
    want = cuflash.attention(q, k, v, fp8=True, hadamard=True, window=(16, 0))
    t8, td = cuflash.quantize_fp8(torch.from_numpy(q), block=128)
    assert t8.dtype == torch.float8_e4m3fn and td.dtype == torch.float32 and tuple(td.shape) == (1, 4, 1)
    out = cuflash.attention(*(torch.from_numpy(x) for x in (q, k, v)), fp8=True, hadamard=True, window=(16, 0))
    assert out.dtype == torch.float16 and np.array_equal(out.numpy(), want)
    f = jax.jit(lambda q, k, v: cuflash.attention(q, k, v, fp8=True, hadamard=True, window=(16, 0)))
    assert np.array_equal(np.asarray(f(q, k, v)), want)
    # jax.vmap over a leading axis folds it into the batch: each slice as if alone
    stacked = [np.stack([x, x[:, ::-1].copy()]) for x in (q, k, v)]
    mapped = np.asarray(jax.jit(jax.vmap(f))(*stacked))
    assert np.array_equal(mapped[0], want)
    assert np.array_equal(mapped[1], cuflash.attention(*(x[1] for x in stacked), fp8=True, hadamard=True,
                                                       window=(16, 0)))


def _gpu_x(torch, shape, dtype, seed, aligned=True):
    """Random x on the GPU; aligned=False: a view whose rows start 2 bytes past a 16-byte boundary
    (the quantizer's element-wise loads instead of its 16-byte ones)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    wide = torch.randn(*shape[:-1], shape[-1] + 8, device="cuda", generator=g, dtype=getattr(torch, dtype))
    x = wide[..., 1:shape[-1] + 1] if not aligned else wide[..., :shape[-1]].contiguous()
    assert (x.data_ptr() % 16 == 0) == aligned
    return x


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("headdim,block,hadamard,seqlen,aligned", [
    (64, None, True, 333, True), (128, 128, True, 333, True), (256, 128, True, 333, True), (96, None, False, 333, True),
    (96, 128, False, 333, True), (128, 128, False, 50, True), (256, 128, False, 256, True),
    (128, 128, True, 333, False), (64, None, False, 333, False), (64, None, True, 40000, True)])
def test_quantize_fp8_on_gpu_matches_the_reference(dtype, headdim, block, hadamard, seqlen, aligned):
    """The GPU quantizer (fp32 arithmetic) against reference.quantize_fp8 (float64): descales within
    float32 rounding, one per head or per 128-row block (333 rows: a short last block; 50: one
    short block; 40000 rows per head at head dim 64: 313 blocks, more than a CTA's 256 threads, whose
    amaxes the second launch reduces), codes equal but for the rare value at a rounding boundary
    (one e4m3 step). Rows 16-byte aligned or not (vector or element loads)."""
    torch = pytest.importorskip("torch")
    x = _gpu_x(torch, (2, seqlen, 3, headdim), dtype, headdim, aligned)
    x[0, ::97, 1, :5] *= 10  # outliers
    x[1, :, 2] = 0  # an all-zero head
    if dtype == "bfloat16" and not hadamard:
        # a head of normal floats whose amax / 448 is not: descale clamped to the smallest normal
        # float (not with the transform, whose sums near zero are subnormal: flushed on the GPU)
        x[0, :, 2] = x[0, :, 2].sign() * (1 + x[0, :, 2].abs()) * 2.0**-120
    x8, descale = cuflash.quantize_fp8(x, block=block, hadamard=hadamard, seed=11)
    assert x8.dtype == torch.float8_e4m3fn and descale.dtype == torch.float32 and x8.is_cuda
    assert tuple(descale.shape) == ((2, 3) if block is None else (2, 3, -(-seqlen // 128)))
    want8, want_descale = reference.quantize_fp8(x.cpu().float().numpy(), block, 11 if hadamard else None)
    np.testing.assert_allclose(descale.cpu().numpy(), want_descale, rtol=2e-6)
    got = x8.cpu().view(torch.uint8).numpy().view(E4M3).astype(np.float64)
    want = want8.astype(np.float64)
    assert (np.abs(got - want) <= reference.e4m3_spacing(want) + 1e-12).all()
    assert np.mean(got != want) < 1e-3, np.mean(got != want)


@pytest.mark.gpu
@pytest.mark.parametrize("headdim,block,hadamard", [(64, None, True), (128, 128, True), (128, 192, True),
                                                    (256, 128, False), (96, 128, False), (128, 192, False)])
def test_quantize_fp8_on_gpu_staged_or_straight_loads_give_the_same_codes(monkeypatch, headdim, block, hadamard):
    """The quantizer with x's chunks staged through shared memory (LOAD_STAGED, where an SM has room)
    and with 16-byte loads straight into registers (LOAD_VECTORS, chosen here by shrinking the shared
    memory the selection sees, as on sm_89): the same codes and descales, bit for bit, over rows that
    end in a short block, with CTAs of several items (items split as for a GPU of 4 SMs)."""
    torch = pytest.importorskip("torch")
    from cuflash import dispatch, jit
    from cuflash.kernels import quantize_fp8 as quantize

    x = _gpu_x(torch, (3, 1000, 4, headdim), "bfloat16", headdim)
    x[1, ::89, 2, :3] *= 30  # outliers
    results, properties = {}, {**jit.device_properties(0), "multiProcessorCount": 4}
    rows, compiled = block or reference.FP8_BLOCK, quantize._compiled_headdim(headdim)
    for loads, per_sm in ((quantize.LOAD_STAGED, properties["sharedMemPerMultiprocessor"]), (quantize.LOAD_VECTORS, 0)):
        monkeypatch.setattr(jit, "device_properties",
                            lambda index: {**properties, "sharedMemPerMultiprocessor": per_sm})
        dispatch.clear_plans()
        assert quantize.select_loads(0, True, rows, compiled) == loads
        assert quantize._items_split(0, 3, 4, 1000, rows, compiled)[0] >= 4
        x8, descale = cuflash.quantize_fp8(x, block=block, hadamard=hadamard, seed=3)
        results[loads] = (x8.view(torch.uint8).clone(), descale.clone())
    dispatch.clear_plans()
    assert torch.equal(results[quantize.LOAD_STAGED][0], results[quantize.LOAD_VECTORS][0])
    assert torch.equal(results[quantize.LOAD_STAGED][1], results[quantize.LOAD_VECTORS][1])
    _, want_descale = reference.quantize_fp8(x.cpu().float().numpy(), block, 3 if hadamard else None)
    np.testing.assert_allclose(results[quantize.LOAD_STAGED][1].cpu().numpy(), want_descale, rtol=2e-6)


@pytest.mark.gpu
@pytest.mark.parametrize("block", [None, 128])
def test_quantize_fp8_on_gpu_keeps_the_references_nans_and_infinities(block):
    """A NaN does not count towards its group's scale and stays NaN; an infinity makes the scale
    infinite, the group's finite values 0 and the infinity NaN (x / descale, as the reference)."""
    torch = pytest.importorskip("torch")
    x = _gpu_x(torch, (1, 300, 2, 64), "bfloat16", 5)
    x[0, 10, 0, 3] = float("nan")
    x[0, 200, 1, 7] = float("inf")
    x8, descale = cuflash.quantize_fp8(x, block=block)
    want8, want_descale = reference.quantize_fp8(x.cpu().float().numpy(), block)
    assert np.array_equal(descale.cpu().numpy(), want_descale)
    assert np.isinf(want_descale).any() and np.isfinite(want_descale).any()
    got = x8.cpu().view(torch.uint8).numpy().view(E4M3).astype(np.float64)
    want = want8.astype(np.float64)
    assert np.array_equal(np.isnan(got), np.isnan(want)) and np.isnan(want).sum() == 2
    ok = ~np.isnan(want)
    assert (np.abs(got[ok] - want[ok]) <= reference.e4m3_spacing(want[ok]) + 1e-12).all()


@pytest.mark.gpu
def test_quantize_fp8_refuses_cupy_arrays_by_name():
    cupy = pytest.importorskip("cupy")
    with pytest.raises(TypeError, match="x is a CuPy array, and CuPy has no float8_e4m3fn"):
        cuflash.quantize_fp8(cupy.zeros((1, 8, 2, 64), cupy.float16))


def test_fwd_fp8_sm90_refuses_more_key_blocks_than_its_transposer_counts():
    """The kernel's transposing warps count a tile's key blocks in 16 bits: select refuses (and
    dispatch then says why) instead of letting the count wrap, which would hang the kernel; a causal
    tile's blocks (two row blocks: no split), or a split-KV part's (few tiles, every row seeing every
    key, or a causal step within one row block)."""

    from cuflash.arrays import Device, DeviceArray
    from cuflash.kernels import fwd_sm90
    from cuflash.problem import Problem

    most = fwd_sm90.FP8_MAX_KEY_BLOCKS * 128
    problem = Problem(op="attention_fp8_forward", framework="torch", device=Device("cuda", 0), dtype="float8_e4m3fn",
                      batch=1, seqlen_q=256, seqlen_k=most + 1, nheads=1, nheads_kv=1, headdim=128,
                      softmax_scale=0.1, out_dtype="bfloat16", causal=True, window_right=0)

    def rows(seqlen):
        return DeviceArray(ptr=1 << 20, shape=(1, seqlen, 1, 128), strides=(seqlen * 128, 128, 128, 1))

    descale = DeviceArray(ptr=1 << 20, shape=(1, 1), strides=(1, 1))
    inputs = dict(q=rows(256), k=rows(most + 1), v=rows(most + 1), q_descale=descale, k_descale=descale,
                  v_descale=descale)
    with pytest.raises(ValueError, match=f"at most {most} keys per sequence here; got seqlen_k {most + 1}"):
        fwd_sm90.select_fp8(problem, inputs)
    accepted = fwd_sm90.select_fp8(dataclasses.replace(problem, seqlen_k=most), dict(inputs, k=rows(most), v=rows(most)))
    assert accepted.family == "fwd_fp8_sm90" and accepted.headdim == 128
    split = dataclasses.replace(problem, causal=False, window_right=-1)
    assert fwd_sm90.select_fp8(split, inputs).split_kv  # parts of fewer blocks
    step = dataclasses.replace(problem, seqlen_q=128)
    masked_split = fwd_sm90.select_fp8(step, dict(inputs, q=rows(128)))
    assert masked_split.split_kv and masked_split.masked
    parts = fwd_sm90.kv_splits(split)
    too_many = parts * most + 1
    with pytest.raises(ValueError, match=f"at most {parts * most} keys per sequence here; got seqlen_k {too_many}"):
        fwd_sm90.select_fp8(dataclasses.replace(split, seqlen_k=too_many), dict(inputs, k=rows(too_many), v=rows(too_many)))


def test_fwd_fp8_sm90_writes_v_transposed_beforehand_where_its_table_says():
    """The FP8 table's pre-transposed rows (head dim 256 beyond 512 query rows or from 256 with no
    more keys, 128 beyond 1024 (masked: beyond 2048), 64 beyond 4096): select takes them, and the
    workspace the caller's framework allocates is declared from the problem alone, keys padded to
    16; elsewhere, and where the V^T kernel's grid cannot hold the batch, no workspace."""

    from cuflash import kernels
    from cuflash.arrays import Device, DeviceArray
    from cuflash.kernels import fwd_sm90
    from cuflash.problem import Problem

    problem = Problem(op="attention_fp8_forward", framework="torch", device=Device("cuda", 0), dtype="float8_e4m3fn",
                      batch=2, seqlen_q=513, seqlen_k=1000, nheads=4, nheads_kv=2, headdim=256, softmax_scale=0.1,
                      out_dtype="bfloat16")

    def inputs(p):
        def rows(seqlen, heads):
            return DeviceArray(ptr=1 << 20, shape=(p.batch, seqlen, heads, p.headdim),
                               strides=(seqlen * heads * p.headdim, heads * p.headdim, p.headdim, 1))
        descale = DeviceArray(ptr=1 << 20, shape=(p.batch, p.nheads), strides=(p.nheads, 1))
        kv = rows(p.seqlen_k, p.nheads_kv)
        return dict(q=rows(p.seqlen_q, p.nheads), k=kv, v=kv, q_descale=descale, k_descale=descale, v_descale=descale)

    assert fwd_sm90.select_fp8(problem, inputs(problem)).v_pretransposed
    assert kernels.workspace(problem) == {"v_transposed": ((2, 2, 256, 1008), "float8_e4m3fn")}
    for other in (dataclasses.replace(problem, seqlen_q=512), dataclasses.replace(problem, headdim=128)):
        assert not fwd_sm90.select_fp8(other, inputs(other)).v_pretransposed
        assert kernels.workspace(other) == {}
    # Head dim 256 from 256 query rows where the keys are no more (FP8_SHORT_KEYS_PRETRANSPOSED).
    for seqlen_q, seqlen_k, pretransposed in ((512, 512, True), (256, 100, True), (255, 255, False), (256, 257, False)):
        short = dataclasses.replace(problem, seqlen_q=seqlen_q, seqlen_k=seqlen_k)
        assert fwd_sm90.select_fp8(short, inputs(short)).v_pretransposed == pretransposed, (seqlen_q, seqlen_k)
        assert bool(kernels.workspace(short)) == pretransposed
    assert all(any(tiles[5] for _, tiles in fwd_sm90.FP8_TILES[hd]) for hd in fwd_sm90.FP8_SHORT_KEYS_PRETRANSPOSED)
    huge = dataclasses.replace(problem, batch=65536)  # more batches than the V^T kernel's grid z holds
    assert not fwd_sm90.select_fp8(huge, inputs(huge)).v_pretransposed and kernels.workspace(huge) == {}
    square_128 = dataclasses.replace(problem, headdim=128, seqlen_q=512, seqlen_k=512)
    assert not fwd_sm90.select_fp8(square_128, inputs(square_128)).v_pretransposed
    long_64 = dataclasses.replace(problem, headdim=64, seqlen_q=4097)  # head dim 64: beyond 4k query rows
    assert fwd_sm90.select_fp8(long_64, inputs(long_64)).v_pretransposed
    assert kernels.workspace(long_64) == {"v_transposed": ((2, 2, 64, 1008), "float8_e4m3fn")}
    assert fwd_sm90.select_fp8(long_64, inputs(long_64)).block_n == 160  # per-head descales: FP8_PER_HEAD_TILES
    assert kernels.workspace(dataclasses.replace(long_64, seqlen_q=4096)) == {}
    long_128 = dataclasses.replace(problem, headdim=128, seqlen_q=2049)  # head dim 128: beyond 2k, masked or not
    assert fwd_sm90.select_fp8(long_128, inputs(long_128)).v_pretransposed
    assert kernels.workspace(long_128) == {"v_transposed": ((2, 2, 128, 1008), "float8_e4m3fn")}
    unmasked_128 = dataclasses.replace(long_128, seqlen_q=1025)  # unmasked beyond 1k
    assert fwd_sm90.select_fp8(unmasked_128, inputs(unmasked_128)).v_pretransposed
    assert kernels.workspace(dataclasses.replace(long_128, seqlen_q=1024)) == {}
    # Masked (FP8_MASKED_IN_KERNEL_ROWS), beyond 2k; a causal row that sees every key is not masked.
    for seqlen_q, window, pretransposed in ((2048, (-1, 0), False), (2049, (-1, 0), True), (2048, (-1, 5000), True),
                                            (2048, (100, -1), False), (2048, (-1, -1), True)):
        masked = dataclasses.replace(long_128, seqlen_q=seqlen_q, seqlen_k=seqlen_q, window_left=window[0],
                                     window_right=window[1])
        assert fwd_sm90.select_fp8(masked, inputs(masked)).v_pretransposed == pretransposed, (seqlen_q, window)
        assert bool(kernels.workspace(masked)) == pretransposed
    # There, per-head k and v descales take 192-key blocks (FP8_PER_HEAD_TILES); per-128-row ones 128.
    assert fwd_sm90.select_fp8(long_128, inputs(long_128)).block_n == 192
    per_block = DeviceArray(ptr=1 << 20, shape=(2, 2, 8), strides=(16, 8, 1))
    for name in ("k_descale", "v_descale"):
        assert fwd_sm90.select_fp8(long_128, {**inputs(long_128), name: per_block}).block_n == 128
    # Calls without the LSE sum P's rows on the tensor cores at head dims 64 and 128
    # (FP8_TENSOR_ROW_SUMS): at 64 on its 128-key row (the 160-key one would spill), at 128 on its
    # 192-key one; no call without it needs an lse (the kernel writes none where its address is null).
    for long, block_n in ((long_64, 128), (long_128, 192)):
        assert not fwd_sm90.select_fp8(long, inputs(long)).tensor_row_sums
        no_lse = dataclasses.replace(long, with_lse=False)
        chosen = fwd_sm90.select_fp8(no_lse, inputs(no_lse))
        assert chosen.tensor_row_sums and chosen.block_n == block_n and "lse" not in kernels.workspace(no_lse)
        assert chosen.dynamic_shared_bytes > dataclasses.replace(chosen, tensor_row_sums=False).dynamic_shared_bytes
    assert not fwd_sm90.tensor_row_sums_fit(64, fwd_sm90.FP8_PER_HEAD_TILES[64])
    # At 256 the sums take a wgmma of their own, on the pre-transposed row (its consumers run free),
    # not on the ping-pong one (up to 512 query rows), with 1 KiB of ones for all stages.
    no_lse = dataclasses.replace(problem, with_lse=False)
    chosen = fwd_sm90.select_fp8(no_lse, inputs(no_lse))
    assert chosen.tensor_row_sums and "lse" not in kernels.workspace(no_lse)
    bare = dataclasses.replace(chosen, tensor_row_sums=False, stale_max=0)
    assert chosen.dynamic_shared_bytes == bare.dynamic_shared_bytes + 1024
    short_no_lse = dataclasses.replace(no_lse, seqlen_q=512)
    assert not fwd_sm90.select_fp8(short_no_lse, inputs(short_no_lse)).tensor_row_sums
    with pytest.raises(ValueError, match="tensor_row_sums is for e4m3 at head dims"):
        fwd_sm90.FwdSm90Variant("bfloat16", "bfloat16", 128, 2, 128, 2, "pingpong", "overlap", False, False, True,
                                False, False, tensor_row_sums=True).check()
    # Calls without the LSE take some exponentials on the FMA pipe on FP8_EXP_ON_FMA's rows (head dim
    # 128's rows, 64's row-sums row), unmasked and masked as it says; calls with it some pairs of them
    # (exp_fma_pairs) on FP8_LSE_EXP_PAIRS' rows; other rows and 16-bit variants none.
    def on_fma(p, inputs_changed=None, **changes):
        p = dataclasses.replace(p, **changes)
        variant = fwd_sm90.select_fp8(p, {**inputs(p), **(inputs_changed or {})})
        return variant.exp_on_fma, variant.exp_fma_pairs

    for long, tiles in ((long_128, fwd_sm90.FP8_PER_HEAD_TILES[128]), (long_64, fwd_sm90.FP8_TILES[64][1][1])):
        every = fwd_sm90.FP8_EXP_ON_FMA[(long.headdim, tiles)]
        assert (on_fma(long, with_lse=False), on_fma(long, with_lse=False, window_right=0)) == (
            (every[0], False), (every[1], False))
        # with the LSE: the per-head rows, with FP8_LSE_EXP_PAIRS' pairs or none
        lse_pairs = fwd_sm90.FP8_LSE_EXP_PAIRS.get((long.headdim, fwd_sm90.FP8_PER_HEAD_TILES[long.headdim]), (0, 0))
        assert (on_fma(long), on_fma(long, window_right=0)) == tuple((every, every > 0) for every in lse_pairs)
    for table in (fwd_sm90.FP8_EXP_ON_FMA, fwd_sm90.FP8_LSE_EXP_PAIRS):
        assert all(max(every) > 0 for every in table.values())  # (an entry of zeros says nothing)
    blocks = dict(k_descale=per_block, v_descale=per_block)  # the 128-key rows beyond 2k (4k at 64) rows
    narrow = fwd_sm90.FP8_EXP_ON_FMA[(128, fwd_sm90.FP8_TILES[128][1][1])][0]
    assert on_fma(long_128, blocks, with_lse=False) == (narrow, False) and narrow > 0
    for long in (long_128, long_64):
        pairs = fwd_sm90.FP8_LSE_EXP_PAIRS[(long.headdim, fwd_sm90.FP8_TILES[long.headdim][1][1])]
        assert (on_fma(long, blocks), on_fma(long, blocks, window_right=0)) == (
            (pairs[0], pairs[0] > 0), (pairs[1], pairs[1] > 0)) and pairs[0] > 0
    assert on_fma(problem, with_lse=False) == (0, False) == on_fma(problem)  # head dim 256
    # A stale running maximum (FP8_STALE_MAX) only where O is divided by the sums of P as rounded
    # (on the tensor cores: calls without the LSE) and k and v descales are per head: head dim 256's
    # pre-transposed row; not with the LSE, per-128-row descales, ping-pong, or at 128 and 64.
    def stale(p, inputs_changed=None, **changes):
        p = dataclasses.replace(p, **changes)
        return fwd_sm90.select_fp8(p, {**inputs(p), **(inputs_changed or {})}).stale_max

    at_256 = fwd_sm90.FP8_STALE_MAX[(256, fwd_sm90.FP8_TILES[256][1][1])]
    assert stale(problem, with_lse=False) == stale(problem, with_lse=False, window_right=0) == at_256 > 0
    assert stale(problem) == stale(problem, blocks, with_lse=False) == stale(problem, with_lse=False, seqlen_q=512) == 0
    assert stale(long_128) == stale(long_128, with_lse=False) == stale(long_64, with_lse=False) == 0
    with pytest.raises(ValueError, match="stale_max=3 is for e4m3 .* with P's sums on the tensor cores"):
        dataclasses.replace(fwd_sm90.select_fp8(problem, inputs(problem)), stale_max=3).check()
    with pytest.raises(ValueError, match="exp_fma_pairs says how exp_on_fma's exponentials are taken"):
        dataclasses.replace(fwd_sm90.select_fp8(problem, inputs(problem)), exp_fma_pairs=True).check()
    # fast_exp: P's codes from the scores wherever P is summed on the tensor cores (calls without the
    # LSE), in place of any exponential, stale maximum kept; not where the sums are fp32.
    for p, changed in ((problem, None), (long_128, None), (long_64, None), (long_128, blocks)):
        exact = fwd_sm90.select_fp8(dataclasses.replace(p, with_lse=False), {**inputs(p), **(changed or {})})
        fast = fwd_sm90.select_fp8(dataclasses.replace(p, with_lse=False, fast_exp=True), {**inputs(p), **(changed or {})})
        assert exact.tensor_row_sums and fast == dataclasses.replace(exact, exp_codes=True, exp_on_fma=0)
    assert not fwd_sm90.select_fp8(dataclasses.replace(short_no_lse, fast_exp=True), inputs(short_no_lse)).exp_codes
    with pytest.raises(ValueError, match="exp_codes .* needs tensor_row_sums"):
        dataclasses.replace(fwd_sm90.select_fp8(problem, inputs(problem)), exp_codes=True).check()
    with pytest.raises(ValueError, match="exp_on_fma=4: every how many-th exponential .* e4m3 only"):
        fwd_sm90.FwdSm90Variant("bfloat16", "bfloat16", 128, 2, 128, 2, "pingpong", "overlap", False, False, True,
                                False, False, exp_on_fma=4).check()
    saved, fwd_sm90.fp8_tiles_override = fwd_sm90.fp8_tiles_override, {128: (2, 192, 2, "tile", "overlap", True)}
    try:
        with pytest.raises(ValueError, match="blocks of 192 keys need k_descale and v_descale per head"):
            fwd_sm90.select_fp8(long_128, {**inputs(long_128), "k_descale": per_block})
    finally:
        fwd_sm90.fp8_tiles_override = saved
    assert kernels.workspace(dataclasses.replace(problem, headdim=300)) == {}  # refused by select, no workspace
    assert kernels.workspace(dataclasses.replace(problem, device=Device("cpu"))) == {}  # the reference needs none


HOPPER_SHARED_MEMORY = {"sharedMemPerBlockOptin": 232448, "sharedMemPerMultiprocessor": 233472}  # an H100's


def test_quantize_fp8_launches_one_or_two_passes_heads_next_to_each_other(monkeypatch):
    """The GPU quantizer's plumbing, offline: 16-byte loads only for 16-byte aligned rows, through
    shared memory where the CTAs an SM holds have room for their staged items (all on sm_90, only
    192-row blocks on sm_89), with that shared memory asked for at every launch; scales per
    128-row block in one launch, per head in three (block amaxes to a workspace, a CTA per head
    reducing them to its descale, the convert), runs of consecutive (block, head) items a CTA on
    grid x (ITEMS_PER_CTA, or the items spread over one wave where a CTA has its SM to itself or that
    leaves fewer on the busiest SM), batch on grid y; on sm_90 the second and third launches per
    head as programmatic dependents of the one before (as the first too with dependent=True, a link
    of attention(fp8=True)'s chain), on sm_89 ordinary ones; grids that do not fit are refused by
    name."""
    from cuflash import driver, jit, kernels
    from cuflash.arrays import Device, DeviceArray
    from cuflash.kernels import quantize_fp8 as quantize
    from cuflash.problem import Problem

    problem = Problem(op="quantize_fp8", framework="torch", device=Device("cuda", 0), dtype="bfloat16", batch=2,
                      seqlen_q=300, seqlen_k=300, nheads=3, nheads_kv=3, headdim=128, hadamard_seed=5)
    properties = {"multiProcessorCount": 132, "major": 9, "minor": 0, **HOPPER_SHARED_MEMORY}
    monkeypatch.setattr(jit, "device_properties", lambda index: properties)

    def rows(p, ptr=1 << 20, pad=0):
        width = p.headdim + pad
        return DeviceArray(ptr=ptr, shape=(p.batch, p.seqlen_q, p.nheads, p.headdim),
                           strides=(p.seqlen_q * p.nheads * width, p.nheads * width, width, 1))

    assert quantize.select(problem, {"x": rows(problem)}).loads == quantize.LOAD_STAGED
    assert quantize.select(problem, {"x": rows(problem, ptr=(1 << 20) + 2)}).loads == quantize.LOAD_ELEMENTS
    assert quantize.select(problem, {"x": rows(problem, pad=4)}).loads == quantize.LOAD_ELEMENTS  # 132-element rows
    per_block = dataclasses.replace(problem, fp8_block=128)
    assert kernels.workspace(per_block) == {}
    assert kernels.workspace(problem) == {"block_amax": ((2, 3, 3), "float32")}

    launches, dependent, shared = [], [], []
    def function(grid, block, args, shared_mem, stream):
        launches.append((grid, block, np.frombuffer(args[0].tobytes(), quantize.QUANTIZE_FP8_PARAMS)[0]))
        dependent.append(False)
        shared.append(shared_mem)

    class DependentLaunch:  # driver.DependentLaunch's: the same record
        def __init__(self, kernel, grid, block, shared_mem):
            assert kernel is function
            self.grid, self.block, self.shared_mem = grid, block, shared_mem

        def __call__(self, params, stream):
            function(self.grid, self.block, (np.frombuffer(params, np.uint8),), self.shared_mem, stream)
            dependent[-1] = True

    monkeypatch.setattr(driver, "DependentLaunch", DependentLaunch)
    variant = quantize.select(problem, {"x": rows(problem)})
    arrays = {"x": rows(problem), "x8": rows(problem, ptr=2 << 20), "descale": DeviceArray(3 << 20, (2, 3), (3, 1)),
              "block_amax": DeviceArray(4 << 20, (2, 3, 3), (9, 3, 1))}
    items = (9, 2)  # 3 blocks of 3 heads, batch 2: 18 items for 264 CTAs (two of 512 threads an SM), one each
    for p, passes, chained in ((per_block, [(quantize.BLOCK_SCALES, items)], False),
                               (problem, [(quantize.HEAD_AMAX, items), (quantize.HEAD_SCALE, (3, 2)),
                                          (quantize.HEAD_CONVERT, items)], False),
                               (per_block, [(quantize.BLOCK_SCALES, items)], True)):
        launches.clear()
        dependent.clear()
        shared.clear()
        quantize.prepare(variant, function, p, arrays, arrays, dependent=chained)(arrays, arrays, None)
        assert [(int(params["pass"]), grid) for grid, _, params in launches] == passes
        assert dependent == [chained] + [True] * (len(passes) - 1)
        assert all(block == (quantize.threads(128, 128),) == (512,) for _, block, _ in launches)
        assert shared == [0 if kind == quantize.HEAD_SCALE else 2 * 128 * 128 * 2 for kind, _ in passes]
        assert variant.dynamic_shared_bytes == 2 * 128 * 128 * 2
        assert all(params["block_amax"] == (0 if p.fp8_block else 4 << 20) and params["descale"] == 3 << 20
                   and params["x"] == 1 << 20 and params["x8"] == 2 << 20 and params["items_per_cta"] == 1
                   for _, _, params in launches)
    # Ada: no griddepcontrol in the kernels, no dependent launch; 100 KiB of shared memory an SM, where
    # two 512-thread CTAs' staged items (64 KiB each) do not fit: loads straight into registers
    properties.update(major=8, minor=9, sharedMemPerBlockOptin=101376, sharedMemPerMultiprocessor=102400)
    launches.clear()
    dependent.clear()
    shared.clear()
    ada = quantize.select(problem, {"x": rows(problem)})
    assert ada.loads == quantize.LOAD_VECTORS and ada.dynamic_shared_bytes == 0
    quantize.prepare(ada, function, problem, arrays, arrays)(arrays, arrays, None)
    assert dependent == [False] * 3 and shared == [0] * 3
    wide_ada = quantize.select(dataclasses.replace(problem, fp8_block=192), {"x": rows(problem)})
    assert wide_ada.loads == quantize.LOAD_STAGED and wide_ada.dynamic_shared_bytes == 2 * 192 * 128 * 2  # one CTA
    properties.update(major=9, minor=0, **HOPPER_SHARED_MEMORY)
    # attention(fp8=True)'s k and v at head dim 128: blocks of 192 rows (2 of 300), 768 threads a CTA
    wide = dataclasses.replace(problem, fp8_block=192)
    wide_variant = quantize.select(wide, {"x": rows(wide)})
    assert wide_variant.block_rows == 192 and wide_variant in quantize.VARIANTS
    launches.clear()
    dependent.clear()
    quantize.prepare(wide_variant, function, wide, arrays, arrays)(arrays, arrays, None)
    assert [(int(params["pass"]), grid, block) for grid, block, params in launches] == [
        (quantize.BLOCK_SCALES, (6, 2), (768,))] and dependent == [False]
    # A 16k x 2048 tensor: 128 blocks of 16 heads, 4 a CTA in two whole waves of 264 CTAs (two an SM);
    # 86 blocks of 192 rows would take 2.6 waves of 132 (one an SM): 11 a CTA, one wave of 126.
    assert quantize._items_split(0, 1, 16, 16384, 128, 128) == (4, (512, 1))
    assert quantize._items_split(0, 1, 16, 16384, 192, 128) == (11, (126, 1))
    assert quantize._items_split(0, 4, 16, 4096, 192, 128) == (11, (32, 4))  # 22 blocks a batch entry
    assert quantize._items_split(0, 1, 32, 16384, 128, 64) == (4, (1024, 1))  # 256 threads: four CTAs an SM
    assert quantize._items_split(0, 1, 8, 16384, 128, 256) == (8, (128, 1))  # 1024 threads: one wave of 128
    with pytest.raises(ValueError, match=r"blocks of 192 rows at head dim 64 are not among the compiled"):
        quantize.select(dataclasses.replace(wide, headdim=64), {"x": rows(dataclasses.replace(wide, headdim=64))})
    with pytest.raises(ValueError, match=r"quantize_fp8 launches a row of CTAs .*batch 65536 must be at most 65535"):
        quantize.prepare(variant, function, dataclasses.replace(problem, batch=65536), arrays, arrays)
    with pytest.raises(ValueError, match=r"nheads x ceil\(seqlen / 128\) \(65536 x 32768\) at most 2147483647"):
        quantize.prepare(variant, function, dataclasses.replace(problem, nheads=2**16, seqlen_q=2**22), arrays, arrays)


def test_fwd_fp8_sm90_takes_the_192_key_row_for_k_and_v_descales_per_192_rows(monkeypatch):
    """attention_fp8(..., kv_block=192) (Problem.fp8_block FP8_WIDE_KEY_BLOCK): the 192-key row of
    FP8_PER_HEAD_TILES, V^T beforehand, whatever the query rows (the in-kernel rows take 128-key
    blocks), its variant among those compiled, its workspace declared from the problem; a decode
    step with GQA keeps its query heads as heads and does not split (the split variants take
    128-key blocks); a forced row of 128 keys refuses it by name."""
    from cuflash import jit, kernels, reference as ref
    from cuflash.arrays import Device, DeviceArray
    from cuflash.kernels import fwd_sm90, query_heads_as_rows
    from cuflash.problem import Problem

    monkeypatch.setattr(jit, "device_properties", lambda index: {"multiProcessorCount": 132})
    problem = Problem(op="attention_fp8_forward", framework="torch", device=Device("cuda", 0), dtype="float8_e4m3fn",
                      batch=2, seqlen_q=300, seqlen_k=1000, nheads=4, nheads_kv=2, headdim=128, softmax_scale=0.1,
                      out_dtype="bfloat16", fp8_block=ref.FP8_WIDE_KEY_BLOCK)

    def inputs(p, kv_blocks=6):
        def rows(seqlen, heads):
            return DeviceArray(ptr=1 << 20, shape=(p.batch, seqlen, heads, p.headdim),
                               strides=(seqlen * heads * p.headdim, heads * p.headdim, p.headdim, 1))
        q_descale = DeviceArray(ptr=1 << 20, shape=(p.batch, p.nheads), strides=(p.nheads, 1))
        kv_descale = DeviceArray(ptr=1 << 20, shape=(p.batch, p.nheads_kv, kv_blocks), strides=(2 * kv_blocks,
                                                                                                  kv_blocks, 1))
        kv = rows(p.seqlen_k, p.nheads_kv)
        return dict(q=rows(p.seqlen_q, p.nheads), k=kv, v=kv, q_descale=q_descale, k_descale=kv_descale,
                    v_descale=kv_descale)

    compiled = set(fwd_sm90.fp8_variants_for((9, 0)))
    for with_lse in (True, False):
        for causal in (False, True):
            p = dataclasses.replace(problem, with_lse=with_lse, causal=causal, window_right=0 if causal else -1)
            chosen = fwd_sm90.select_fp8(p, inputs(p))
            assert (chosen.block_n, chosen.v_pretransposed, chosen.split_kv) == (192, True, False)
            assert chosen in compiled and chosen.stale_max == 0  # (a stale maximum: per-head descales only)
            assert kernels.workspace(p) == {"v_transposed": ((2, 2, 128, 1008), "float8_e4m3fn")}
    decode = dataclasses.replace(problem, seqlen_q=1, seqlen_k=32768, batch=1)
    assert query_heads_as_rows(decode) is None and fwd_sm90.split_parts(decode) is None
    assert not fwd_sm90.select_fp8(decode, inputs(decode, 171)).split_kv
    assert query_heads_as_rows(dataclasses.replace(decode, fp8_block=None)) is not None  # as it was
    monkeypatch.setattr(fwd_sm90, "fp8_tiles_override", {128: (2, 128, 2, "free", "overlap", True)})
    with pytest.raises(ValueError, match=r"blocks of 128 keys need k_descale and v_descale per head .* or per 128 "
                                         r"rows; got descales per 192 rows"):
        fwd_sm90.select_fp8(problem, inputs(problem))


def test_fp8_launches_after_other_kernels_as_their_programmatic_dependents(monkeypatch):
    """attention(fp8=True) on Hopper (fwd_quantized_sm90): q's quantizer an ordinary launch (all
    before it in the stream complete when it starts), then k's, v's (into V^T) and the attention
    kernel each the programmatic dependent of the launch before, the attention kernel told to wait
    for its inputs at its start (wait_for_inputs). attention_fp8 after its V^T pass: the pass an
    ordinary launch, the kernel its dependent, waiting only before V^T (wait_for_inputs 0)."""
    from cuflash import driver, jit, kernels, tma
    from cuflash.arrays import Device, DeviceArray, contiguous_strides
    from cuflash.kernels import fwd_sm90, quantized_sm90
    from cuflash.problem import Problem

    monkeypatch.setattr(tma, "encode_tiled", lambda *args: bytes(tma.MAP_BYTES))
    monkeypatch.setattr(jit, "device_properties",
                        lambda index: {"multiProcessorCount": 132, "major": 9, "minor": 0, **HOPPER_SHARED_MEMORY})
    launched = []

    class Function:  # a loaded kernel: records its ordinary launches
        def __init__(self, name):
            self.name = name

        def __call__(self, grid, block, args, **kwargs):
            launched.append((self.name, False, args[0].tobytes()))

    class DependentLaunch:
        def __init__(self, function, grid, block, shared_mem):
            self.name = function.name

        def __call__(self, params, stream):
            launched.append((self.name, True, bytes(params)))

    monkeypatch.setattr(jit, "get_function", lambda variant, index: Function(type(variant).__name__))
    monkeypatch.setattr(driver, "DependentLaunch", DependentLaunch)

    def arrays(shapes):
        return {name: DeviceArray((i + 1) << 28, shape, contiguous_strides(shape)) for i, (name, shape) in
                enumerate(shapes.items())}

    def wait_for_inputs(params):
        return int(np.frombuffer(params, fwd_sm90.FWD_SM90_PARAMS)[0]["wait_for_inputs"])

    problem = Problem(op="attention_quantized_forward", framework="torch", device=Device("cuda", 0),
                      dtype="bfloat16", batch=2, seqlen_q=300, seqlen_k=4100, nheads=4, nheads_kv=2, headdim=128,
                      softmax_scale=0.1, out_dtype="bfloat16", with_lse=False, fp8_block=128, hadamard_seed=0)
    inputs = arrays(dict(q=(2, 300, 4, 128), k=(2, 4100, 2, 128), v=(2, 4100, 2, 128)))
    outputs = arrays({"out": (2, 300, 4, 128), **{n: shape for n, (shape, _) in kernels.workspace(problem).items()}})
    variant = quantized_sm90.select(problem, inputs)
    quantized_sm90.prepare(variant, Function("attention"), problem, inputs, outputs)(inputs, outputs, "stream")
    assert [(name, dependent) for name, dependent, _ in launched] == [
        ("QuantizeFp8Variant", False), ("QuantizeFp8Variant", True), ("QuantizeFp8TransposedVariant", True),
        ("attention", True)]
    assert wait_for_inputs(launched[-1][2]) == 1
    launched.clear()
    fp8 = Problem(op="attention_fp8_forward", framework="torch", device=Device("cuda", 0), dtype="float8_e4m3fn",
                  batch=2, seqlen_q=600, seqlen_k=1000, nheads=4, nheads_kv=2, headdim=256, softmax_scale=0.1,
                  out_dtype="bfloat16", with_lse=False)
    descales = dict(q_descale=(2, 4), k_descale=(2, 2), v_descale=(2, 2))
    inputs = arrays(dict(q=(2, 600, 4, 256), k=(2, 1000, 2, 256), v=(2, 1000, 2, 256), **descales))
    outputs = arrays({"out": (2, 600, 4, 256), **{n: shape for n, (shape, _) in kernels.workspace(fp8).items()}})
    variant = fwd_sm90.select_fp8(fp8, inputs)
    assert variant.v_pretransposed
    fwd_sm90.prepare(variant, Function("attention"), fp8, inputs, outputs)(inputs, outputs, "stream")
    assert [(name, dependent) for name, dependent, _ in launched] == [("TransposeVFp8Variant", False),
                                                                       ("attention", True)]
    assert wait_for_inputs(launched[-1][2]) == 0


def test_fwd_quantized_sm90_selects_pre_transposed_rows_and_declares_its_workspace(monkeypatch):
    """attention(fp8=True)'s op on Hopper (fwd_quantized_sm90): the FP8 forward's own row for the
    problem, pre-transposed (V^T comes from the quantizer), with the tensor-core row sums at head dim
    64 without the LSE; at head dim 128 from 2048 keys the 192-key row, k and v quantized per 192
    rows; its workspace (e4m3 q, k, V^T and the descales) from the problem alone; empty sequences,
    head dims that are not multiples of 16 and forced rows of another key block refused."""
    from cuflash import jit, kernels
    from cuflash.arrays import Device, DeviceArray
    from cuflash.kernels import fwd_sm90, quantized_sm90
    from cuflash.problem import Problem

    monkeypatch.setattr(jit, "device_properties", lambda index: HOPPER_SHARED_MEMORY)  # (the quantizers' loads)

    problem = Problem(op="attention_quantized_forward", framework="torch", device=Device("cuda", 0),
                      dtype="bfloat16", batch=2, seqlen_q=300, seqlen_k=1000, nheads=4, nheads_kv=2, headdim=256,
                      softmax_scale=0.1, out_dtype="bfloat16", fp8_block=128, hadamard_seed=0)

    def inputs(p):
        def rows(seqlen, heads):
            return DeviceArray(ptr=1 << 20, shape=(p.batch, seqlen, heads, p.headdim),
                               strides=(seqlen * heads * p.headdim, heads * p.headdim, p.headdim, 1))
        return dict(q=rows(p.seqlen_q, p.nheads), k=rows(p.seqlen_k, p.nheads_kv), v=rows(p.seqlen_k, p.nheads_kv))

    fp8 = quantized_sm90._fp8_problem(problem)
    variant = quantized_sm90.select(problem, inputs(problem))
    assert variant.v_pretransposed and (variant.consumers, variant.block_n, variant.stages, variant.sync) == \
        fwd_sm90.fp8_tiles(fp8)[:4] and not fwd_sm90.fp8_tiles(fp8)[5]  # the short row, flipped
    assert variant in quantized_sm90.variants_for((9, 0)) and variant.out_dtype == "bfloat16"
    assert kernels.workspace(problem) == {
        "q8": ((2, 300, 4, 256), "float8_e4m3fn"), "k8": ((2, 1000, 2, 256), "float8_e4m3fn"),
        "q_descale": ((2, 4, 3), "float32"), "k_descale": ((2, 2, 8), "float32"), "v_descale": ((2, 2, 8), "float32"),
        "v_transposed": ((2, 2, 256, 1008), "float8_e4m3fn")}
    no_lse_64 = dataclasses.replace(problem, headdim=64, with_lse=False)
    assert quantized_sm90.select(no_lse_64, inputs(no_lse_64)).tensor_row_sums
    long_64 = dataclasses.replace(no_lse_64, seqlen_q=5000)  # its pre-transposed row: FP8_EXP_ON_FMA's
    assert quantized_sm90.select(long_64, inputs(long_64)).exp_on_fma == fwd_sm90.FP8_EXP_ON_FMA[
        (64, fwd_sm90.FP8_TILES[64][1][1])][0]
    flipped_64 = fwd_sm90.pretransposed(fwd_sm90.FP8_TILES[64][0][1])  # the in-kernel row, flipped
    assert quantized_sm90.select(no_lse_64, inputs(no_lse_64)).exp_on_fma == fwd_sm90.FP8_EXP_ON_FMA[(64, flipped_64)][0]
    # Head dim 128 (and 72-112, compiled as 128): below 2048 keys the 128-key row, pre-transposed;
    # from there k and v per 192 rows and the 192-key row.
    short_128 = dataclasses.replace(problem, headdim=128, seqlen_q=5000)
    variant = quantized_sm90.select(short_128, inputs(short_128))
    assert variant.block_n == 128 and variant.v_pretransposed and kernels.workspace(short_128)["k_descale"] == \
        ((2, 2, 8), "float32")
    for headdim, seqlen_q in ((128, 300), (128, 5000), (96, 300)):
        wide = dataclasses.replace(problem, headdim=headdim, seqlen_q=seqlen_q, seqlen_k=4100, with_lse=False,
                                   hadamard_seed=0 if headdim == 128 else None)
        variant = quantized_sm90.select(wide, inputs(wide))
        assert (variant.consumers, variant.block_n, variant.stages, variant.sync, variant.v_pretransposed) == \
            fwd_sm90.FP8_PER_HEAD_TILES[128][:4] + (True,) and variant.tensor_row_sums
        assert variant.exp_on_fma == fwd_sm90.FP8_EXP_ON_FMA[(128, fwd_sm90.FP8_PER_HEAD_TILES[128])][0]
        assert variant in fwd_sm90.fp8_variants_for((9, 0)) and not variant.exp_codes
        fast = quantized_sm90.select(dataclasses.replace(wide, fast_exp=True), inputs(wide))  # P's codes, no exp
        assert fast == dataclasses.replace(variant, exp_codes=True, exp_on_fma=0)
        assert fast in fwd_sm90.fp8_variants_for((9, 0))
        assert {name: kernels.workspace(wide)[name] for name in ("q_descale", "k_descale", "v_descale")} == {
            "q_descale": ((2, 4, -(-seqlen_q // 128)), "float32"), "k_descale": ((2, 2, 22), "float32"),
            "v_descale": ((2, 2, 22), "float32")}  # 4100 keys: 21 blocks of 192 and one of 68
    for bad, match in ((dataclasses.replace(problem, seqlen_k=0), "cannot describe an empty"),
                       (dataclasses.replace(problem, headdim=40, hadamard_seed=None), "multiples of 16")):
        with pytest.raises(ValueError, match=match):
            quantized_sm90.select(bad, inputs(bad))
    saved = fwd_sm90.fp8_tiles_override
    try:
        fwd_sm90.fp8_tiles_override = {256: fwd_sm90.FP8_PER_HEAD_TILES[128]}
        with pytest.raises(ValueError, match="per 128 rows at head dim 256: a forced row of 192 keys"):
            quantized_sm90.select(problem, inputs(problem))
        wide = dataclasses.replace(problem, headdim=128, seqlen_k=2048)
        fwd_sm90.fp8_tiles_override = {128: fwd_sm90.FP8_TILES[128][1][1]}
        with pytest.raises(ValueError, match="per 192 rows at head dim 128: a forced row of 128 keys"):
            quantized_sm90.select(wide, inputs(wide))
        fwd_sm90.fp8_tiles_override = {256: fwd_sm90.FP8_TILES[256][0][1]}  # in the kernel: v8 in the workspace
        assert not quantized_sm90.select(problem, inputs(problem)).v_pretransposed
        assert kernels.workspace(problem)["v8"] == ((2, 1000, 2, 256), "float8_e4m3fn")
    finally:
        fwd_sm90.fp8_tiles_override = saved
