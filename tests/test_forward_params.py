"""What the forward launchers put in the kernels' parameter structs (no GPU needed)."""
import math
import random

import numpy as np
import pytest

from cuflash import arrays
from cuflash.kernels import forward
from cuflash.problem import Problem


def _problem(**kw):
    base = dict(op="attention_forward", framework="torch", device=arrays.Device("cuda", 0), dtype="bfloat16",
                batch=2, seqlen_q=100, seqlen_k=300, nheads=4, nheads_kv=2, headdim=64, softmax_scale=0.125)
    return Problem(**{**base, **kw})


def test_window_bounds_past_every_key_become_unbounded():
    big = 2**31 - 1
    assert forward.kernel_window(_problem(window_left=big, window_right=big)) == (-1, -1)
    assert forward.kernel_window(_problem(window_left=300, window_right=100)) == (-1, -1)  # exactly past
    assert forward.kernel_window(_problem(window_left=299, window_right=99)) == (299, 99)  # still a bound
    assert forward.kernel_window(_problem(window_left=5, window_right=0, causal=True)) == (5, 0)


def test_softmax_constants_fold_log2e_and_the_softcap_scale():
    assert forward.softmax_constants(_problem()) == (0.125 / math.log(2), 0.0, 0.0)
    scale_log2, exp2_scale, softcap = forward.softmax_constants(_problem(softcap=30.0))
    assert scale_log2 == 1 / math.log(2) and softcap == 30.0
    # tanh(x) = 1 - 2 / (2^(exp2_scale * s) + 1) with x = s * softmax_scale / softcap
    s = 7.0
    assert math.isclose(softcap * (1 - 2 / (2 ** (exp2_scale * s) + 1)), 30.0 * math.tanh(s * 0.125 / 30.0),
                        rel_tol=1e-12)


def _fast_div(n, mul, shift):
    """fast_div of cuda_src/common/types.cuh, in Python integers."""
    return (n * mul >> 32) >> shift if mul else n


def test_fast_divisor_divides_exactly_over_the_int32_range():
    from cuflash.kernels import fast_divisor
    rng = random.Random(0)
    divisors = [*range(1, 300), 2**16 - 1, 2**16, 2**16 + 1, 641, 6700417, 2**30 + 3, 2**31 - 1]
    divisors += [rng.randrange(2, 2**31) for _ in range(200)]
    for d in divisors:
        mul, shift = fast_divisor(d)
        assert 0 <= mul < 2**32 and 0 <= shift < 32
        near = [k * d + r for k in (0, 1, 2, (2**31 - 1) // d) for r in (-1, 0, 1)]
        for n in [0, 1, 2**31 - 1, *near, *(rng.randrange(2**31) for _ in range(200))]:
            if 0 <= n < 2**31:
                assert _fast_div(n, mul, shift) == n // d, (n, d)
    with pytest.raises(ValueError):
        fast_divisor(0)


def _rows(ptr, batch, seqlen, heads, dim, varlen=False):
    """A contiguous (batch, seqlen, heads, dim) DeviceArray, or (total, heads, dim) for varlen."""
    shape = (batch * seqlen, heads, dim) if varlen else (batch, seqlen, heads, dim)
    return arrays.DeviceArray(ptr, shape, arrays.contiguous_strides(shape))


@pytest.mark.parametrize("fp8, varlen", [(False, False), (False, True), (True, False)])
def test_fwd_sm90_prepared_launch_writes_each_calls_addresses_into_the_struct(fp8, varlen, monkeypatch):
    """fwd_sm90.prepare builds the parameter struct once and each launch writes the addresses in:
    every field as the kernel reads it, the tensor maps of this call's q, k, v at their offsets, and a
    new tile-counter slot per launch (offline: the driver's encoder and the launch are stand-ins)."""
    import numpy as np

    from cuflash import jit, tma
    from cuflash.kernels import fast_divisor, fwd_sm90

    monkeypatch.setattr(tma, "encode_tiled", lambda dtype, ptr, dims, strides, box: repr(
        (dtype, ptr, dims, strides, box)).encode().ljust(tma.MAP_BYTES, b"\0")[:tma.MAP_BYTES])
    monkeypatch.setattr(jit, "device_properties", lambda index: {"multiProcessorCount": 132})
    dtype = "float8_e4m3fn" if fp8 else "bfloat16"
    batch, seqlen_q, seqlen_k, nheads, nheads_kv, headdim = 2, 300, 2100, 6, 2, 128
    problem = _problem(op="attention_fp8_forward" if fp8 else "attention_varlen_forward" if varlen else
                       "attention_forward", dtype=dtype, batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                       nheads=nheads, nheads_kv=nheads_kv, headdim=headdim, causal=True, window_right=0,
                       window_left=50, out_dtype="float16" if fp8 else None,
                       total_q=batch * seqlen_q if varlen else 0, total_k=batch * seqlen_k if varlen else 0)
    variant = fwd_sm90.FwdSm90Variant(dtype, "float16" if fp8 else dtype, headdim, 2, 128, 2, "tile", "overlap",
                                      varlen, False, True, True, False)

    def arrays_at(base):
        inputs = dict(q=_rows(base, batch, seqlen_q, nheads, headdim, varlen),
                      k=_rows(base + 0x10000, batch, seqlen_k, nheads_kv, headdim, varlen),
                      v=_rows(base + 0x20000, batch, seqlen_k, nheads_kv, headdim, varlen))
        if varlen:
            inputs.update(cu_seqlens_q=arrays.DeviceArray(base + 0x30000, (batch + 1,), (1,)),
                          cu_seqlens_k=arrays.DeviceArray(base + 0x30100, (batch + 1,), (1,)))
        if fp8:
            inputs.update({n: arrays.DeviceArray(base + 0x40000 + 0x100 * i, (batch, h, 3), (h * 3, 3, 1))
                           for i, (n, h) in enumerate((("q_descale", nheads), ("k_descale", nheads_kv),
                                                       ("v_descale", nheads_kv)))})
        out = _rows(base + 0x50000, batch, seqlen_q, nheads, headdim, varlen)
        lse_shape = (nheads, batch * seqlen_q) if varlen else (batch, nheads, seqlen_q)
        lse = arrays.DeviceArray(base + 0x60000, lse_shape, arrays.contiguous_strides(lse_shape))
        return inputs, dict(out=out, lse=lse)

    launched = []
    function = lambda grid, block, args, shared_mem, stream: launched.append((grid, block, args, shared_mem, stream))
    inputs, outputs = arrays_at(0)
    launch = fwd_sm90.prepare(variant, function, problem, inputs, outputs)
    bases = (1 << 30, 3 << 30)
    for base in bases:
        launch(*arrays_at(base), "stream")
    blocks_m = math.ceil(seqlen_q / 128)
    slots = []
    for base, (grid, block, (params,), shared_mem, stream) in zip(bases, launched):
        assert (grid, block, shared_mem, stream) == ((min(132, blocks_m * nheads * batch),), (384,),
                                                     variant.dynamic_shared_bytes, "stream")
        p = np.frombuffer(params.tobytes(), fwd_sm90.FWD_SM90_PARAMS)[0]
        inputs, outputs = arrays_at(base)
        for name, rows in (("q", 128), ("k", 128), ("v", 128)):
            heads = nheads if name == "q" else nheads_kv
            assert p[f"{name}_map"].tobytes() == tma.encode_tiled(problem.dtype, inputs[name].ptr,
                                                                  *fwd_sm90.map_layout(problem, inputs[name], heads, rows))
        # the epilogue's TMA stores: dense only (a varlen box would spill into the next sequence)
        out_dtype = "float16" if fp8 else dtype
        assert p["o_map"].tobytes() == (bytes(tma.MAP_BYTES) if varlen else tma.encode_tiled(
            out_dtype, outputs["out"].ptr, *fwd_sm90.map_layout(problem, outputs["out"], nheads, 64, out_dtype)))
        assert (p["out"], p["lse"]) == (base + 0x50000, base + 0x60000)
        assert (p["cu_seqlens_q"], p["cu_seqlens_k"]) == ((base + 0x30000, base + 0x30100) if varlen else (0, 0))
        assert tuple(p["descale"]) == ((base + 0x40000, base + 0x40100, base + 0x40200) if fp8 else (0, 0, 0))
        assert (p["o_stride_b"], p["o_stride_s"], p["o_stride_h"]) == (
            (0, nheads * headdim, headdim) if varlen else (seqlen_q * nheads * headdim, nheads * headdim, headdim))
        assert (p["lse_stride_b"], p["lse_stride_h"]) == ((0, batch * seqlen_q) if varlen else (nheads * seqlen_q, seqlen_q))
        expected_descale = ((nheads * 3, nheads_kv * 3, nheads_kv * 3), (3, 3, 3), (1, 1, 1)) if fp8 else ((0,) * 3,) * 3
        assert (tuple(p["descale_stride_b"]), tuple(p["descale_stride_h"]), tuple(p["descale_stride_block"])) == \
            expected_descale
        assert (p["seqlen_q"], p["seqlen_k"], p["group"], p["headdim"]) == (seqlen_q, seqlen_k, 3, headdim)
        assert (p["window_left"], p["window_right"]) == (50, 0)
        assert (p["scale_log2"], p["softcap_exp2_scale"], p["softcap"]) == pytest.approx(
            forward.softmax_constants(problem), rel=1e-7)
        assert (p["nheads"], p["blocks_m"], p["num_tiles"]) == (nheads, blocks_m, blocks_m * nheads * batch)
        # masked, 2k keys or more: one window of all 12 (batch, head) pairs here (36 tiles, 36 CTAs);
        # varlen: head by head
        window = 1 if varlen else batch * nheads
        assert (p["window_pair0"], p["window_heads"], p["window_tiles"]) == (0, window, window * blocks_m)
        for name, divisor in (("blocks_m", blocks_m), ("nheads", nheads), ("group", 3), ("window_heads", window),
                              ("window_tiles", window * blocks_m)):
            assert (p[f"{name}_mul"], p[f"{name}_shift"]) == fast_divisor(divisor)
        slots.append(int(p["counter_slot"]))
    assert (slots[1] - slots[0]) % fwd_sm90.TILE_COUNTERS == 1


def test_param_struct_writes_each_field_where_the_dtype_puts_it():
    """kernels.ParamStruct: a template with some fields set, then per-call writes of scalars, arrays
    and opaque bytes, read back through the struct's dtype."""
    import numpy as np

    from cuflash.kernels import ParamStruct

    dtype = np.dtype({"names": ["blob", "ptr", "ptrs", "stride", "n", "scale"],
                      "formats": [(np.void, 16), np.uint64, (np.uint64, 3), np.int64, np.int32, np.float32],
                      "itemsize": 80})
    params = ParamStruct(dtype)
    template = params.template(stride=-7, n=5, scale=0.25)
    buf = bytearray(template)
    params.write(buf, "blob", bytes(range(16)))
    params.write(buf, "ptr", 2**64 - 1)
    params.write(buf, "ptrs", 1, 2, 3)
    p = params.argument(buf).view(dtype)[0]
    assert p["blob"].tobytes() == bytes(range(16)) and p["ptr"] == 2**64 - 1 and tuple(p["ptrs"]) == (1, 2, 3)
    assert (p["stride"], p["n"], p["scale"]) == (-7, 5, 0.25)
    assert bytearray(template) != buf and np.frombuffer(template, dtype)[0]["ptr"] == 0  # the template is untouched
    with pytest.raises(AssertionError):
        params.write(buf, "blob", b"short")


@pytest.mark.parametrize("pairs, blocks_m, ctas, seqlen_k, pair0, window", [
    (256, 4, 132, 512, 223, 33),  # head dim 256, causal 512 (FA3 sizing): the last 33 pairs make a wave
    (128, 8, 132, 1024, 111, 17),  # head dim 256, causal 1k
    (20, 4, 132, 512, 0, 20),     # fewer pairs than a wave's worth: all in one window
    (64, 16, 132, 2048, 0, 16),   # head dim 256, causal 2k: windows throughout, 16 divides 64
    (8, 128, 132, 16384, 0, 2),   # head dim 256, causal 16k
    (131, 4, 132, 4096, 0, 1),    # no divisor of 131 from 33 to 66: head by head
    (12, 3, 36, 4096, 0, 12),     # fewer tiles than SMs: one CTA a tile, one window
    (4, 200, 132, 512, 0, 1),     # a head alone has a tile per CTA
])
def test_fwd_sm90_masked_tile_order_windows_heads(pairs, blocks_m, ctas, seqlen_k, pair0, window):
    """fwd_sm90's masked variants draw tiles head by head up to window_pair0 and then in windows of
    (batch, head) pairs, row block major within a window (tile_at in cuda_src/fwd_sm90.cu):
    tile_window puts every pair in a window from TILE_WINDOW_MIN_KEYS keys (the fewest pairs that
    give a window a tile per CTA and divide the pairs) and only the last wave's worth below, and
    the kernel's decode, mirrored here with its fast divisions, maps the tile indices one to one
    onto (pair, row block) in that order."""
    from cuflash.kernels import fast_divisor, fwd_sm90

    assert fwd_sm90.tile_window(pairs, blocks_m, ctas, seqlen_k) == (pair0, window)

    def fast_div(n, divisor):
        mul, shift = fast_divisor(divisor)
        return n if mul == 0 else (n * mul >> 32) >> shift

    decoded = []
    windowed = pair0 * blocks_m
    for index in range(pairs * blocks_m):
        if index >= windowed:
            w = fast_div(index - windowed, window * blocks_m)
            in_window = index - windowed - w * window * blocks_m
            from_last = fast_div(in_window, window)
            decoded.append((pair0 + w * window + in_window - from_last * window, from_last))
        else:
            hb = fast_div(index, blocks_m)
            decoded.append((hb, index - hb * blocks_m))
    expected = [(pair, from_last) for pair in range(pair0) for from_last in range(blocks_m)]
    expected += [(pair0 + w + pair, from_last) for w in range(0, pairs - pair0, window)
                 for from_last in range(blocks_m) for pair in range(window)]
    assert decoded == expected
    assert sorted(decoded) == [(pair, b) for pair in range(pairs) for b in range(blocks_m)]


def test_fwd_sm90_windows_only_the_last_wave_below_the_window_key_count(monkeypatch):
    """Masked problems with fewer than TILE_WINDOW_MIN_KEYS keys draw their tiles head by head but
    for one window of a wave's worth of heads at the end; from there on, every head is in a window."""
    import numpy as np

    from cuflash import jit, tma
    from cuflash.kernels import fwd_sm90

    monkeypatch.setattr(tma, "encode_tiled", lambda *args: bytes(tma.MAP_BYTES))
    monkeypatch.setattr(jit, "device_properties", lambda index: {"multiProcessorCount": 132})
    orders = []
    for seqlen in (fwd_sm90.TILE_WINDOW_MIN_KEYS - 1, fwd_sm90.TILE_WINDOW_MIN_KEYS):
        problem = _problem(op="attention_forward", dtype="bfloat16", batch=4, seqlen_q=seqlen, seqlen_k=seqlen,
                           nheads=8, nheads_kv=8, headdim=128, causal=True, window_right=0)
        variant = fwd_sm90.FwdSm90Variant("bfloat16", "bfloat16", 128, 2, 128, 2, "pingpong", "overlap", False,
                                          False, True, True, False)
        rows = lambda base: _rows(base, 4, seqlen, 8, 128, False)
        inputs = dict(q=rows(0), k=rows(1 << 28), v=rows(2 << 28))
        lse = arrays.DeviceArray(3 << 28, (4, 8, seqlen), arrays.contiguous_strides((4, 8, seqlen)))
        outputs = dict(out=rows(4 << 28), lse=lse)
        launched = []
        launch = fwd_sm90.prepare(variant, lambda *args, **kwargs: launched.append(args), problem, inputs, outputs)
        launch(inputs, outputs, "stream")
        p = np.frombuffer(launched[0][2][0].tobytes(), fwd_sm90.FWD_SM90_PARAMS)[0]
        orders.append((int(p["window_pair0"]), int(p["window_heads"])))
    # 32 pairs of 16 row blocks: 9 pairs make a wave of 132 CTAs; 16 is the least divisor from 9
    assert orders == [(32 - 9, 9), (0, 16)]


def _view(buffer, x):
    """The NumPy view of `buffer` that DeviceArray x (ptr: an element offset) describes."""
    item = buffer.itemsize
    last = x.ptr + sum((n - 1) * s for n, s in zip(x.shape, x.strides))
    assert min(x.strides) >= 0 and last < buffer.size, "the view reaches outside the array"
    return np.lib.stride_tricks.as_strided(buffer[x.ptr:], x.shape, tuple(s * item for s in x.strides))


@pytest.mark.parametrize("causal, window, softcap, seqlen_k", [
    (False, (-1, -1), 0.0, 37), (True, (-1, -1), 0.0, 37), (False, (36, 0), 0.0, 37), (False, (-1, 5), 5.0, 37),
    (True, (-1, -1), 0.0, 0)])
@pytest.mark.parametrize("q_layout", ["contiguous", "heads_first"])
def test_decode_gqa_as_rows_of_kv_heads_is_the_same_attention(causal, window, softcap, seqlen_k, q_layout):
    """query_heads_as_rows' problem on heads_as_rows' views of the same memory gives the call's out
    and lse (the NumPy reference on both): query head kv * group + g is row g of kv head kv."""
    from cuflash import reference

    rng = np.random.default_rng(0)
    batch, nheads, nheads_kv, headdim = 2, 12, 3, 16
    group = nheads // nheads_kv
    window = (window[0], 0) if causal else window
    problem = _problem(batch=batch, seqlen_q=1, seqlen_k=seqlen_k, nheads=nheads, nheads_kv=nheads_kv,
                       headdim=headdim, causal=causal, window_left=window[0], window_right=window[1],
                       softcap=softcap)
    rows = forward.query_heads_as_rows(problem)
    assert (rows.seqlen_q, rows.nheads, rows.nheads_kv) == (group, nheads_kv, nheads_kv)
    assert (rows.causal, rows.window_left, rows.window_right, rows.softcap) == (False, -1, -1, softcap)
    # q with heads outermost (a transposed (batch, nheads, 1, headdim) array), or contiguous
    q_shape = (batch, 1, nheads, headdim)
    q_strides = (headdim, headdim, batch * headdim, 1) if q_layout == "heads_first" else arrays.contiguous_strides(q_shape)
    q_buffer = rng.standard_normal(batch * nheads * headdim)
    k, v = rng.standard_normal((2, batch, seqlen_k, nheads_kv, headdim))
    out_shape, lse_shape = q_shape, (batch, nheads, 1)
    device = dict(q=arrays.DeviceArray(0, q_shape, q_strides),
                  out=arrays.DeviceArray(0, out_shape, arrays.contiguous_strides(out_shape)),
                  lse=arrays.DeviceArray(0, lse_shape, arrays.contiguous_strides(lse_shape)))
    out_buffer, lse_buffer = np.full(batch * nheads * headdim, np.nan), np.full(batch * nheads, np.nan)
    features = dict(softmax_scale=problem.softmax_scale, softcap=softcap)
    want_out, want_lse = reference.forward(_view(q_buffer, device["q"]), k, v, causal=causal, window=window, **features)
    viewed = forward.heads_as_rows(device, group)
    assert viewed["q"].shape == (batch, group, nheads_kv, headdim) and viewed["lse"].shape == (batch, nheads_kv, group)
    got_out, got_lse = reference.forward(_view(q_buffer, viewed["q"]), k, v, causal=rows.causal,
                                         window=(rows.window_left, rows.window_right), **features)
    _view(out_buffer, viewed["out"])[...] = got_out
    _view(lse_buffer, viewed["lse"])[...] = got_lse
    np.testing.assert_allclose(_view(out_buffer, device["out"]), want_out, rtol=1e-12, atol=1e-12)
    np.testing.assert_allclose(_view(lse_buffer, device["lse"]), want_lse, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("change", [dict(seqlen_q=2), dict(nheads=3, nheads_kv=3), dict(window_left=35),
                                    dict(op="attention_varlen_forward"), dict(op="attention_quantized_forward"),
                                    dict(op="attention_backward")])
def test_decode_gqa_as_rows_only_where_every_query_head_sees_every_key(change):
    base = dict(seqlen_q=1, seqlen_k=37, nheads=12, nheads_kv=3)
    assert forward.query_heads_as_rows(_problem(**base)) is not None
    assert forward.query_heads_as_rows(_problem(**{**base, "window_left": 36})) is not None  # sees key 0 still
    assert forward.query_heads_as_rows(_problem(**{**base, **change})) is None


@pytest.mark.parametrize("blocks", [(), (1,)])
def test_decode_gqa_as_rows_reads_q_descales_one_a_row(blocks):
    """FP8 attention's q descales (batch, nheads) or (batch, nheads, 1 block) as the rows of their kv
    head: [b, kv, g] is query head kv * group + g's. Such a problem says so (q_descale_per_row) and
    runs a split variant, in one part if need be, which takes one a row (q_descale_shift 0)."""
    from cuflash.kernels import fwd_sm90

    batch, nheads, group = 3, 12, 4
    descale = np.arange(batch * nheads, dtype=np.float64).reshape(batch, nheads, *blocks)
    device = dict(q_descale=arrays.DeviceArray(0, descale.shape, arrays.contiguous_strides(descale.shape)))
    viewed = forward.heads_as_rows(device, group)["q_descale"]
    np.testing.assert_array_equal(_view(descale.ravel(), viewed), descale.reshape(batch, nheads // group, group))
    fp8 = dict(op="attention_fp8_forward", dtype="float8_e4m3fn", batch=batch, seqlen_q=1, seqlen_k=100, nheads=nheads,
               nheads_kv=nheads // group)
    rows = forward.query_heads_as_rows(_problem(**fp8))
    assert rows.q_descale_per_row and fwd_sm90._q_descale_shift(rows) == 0
    assert fwd_sm90.kv_splits(rows) == 1 and fwd_sm90.split_parts(rows) == 1  # (one key block: no split, but one part)
    assert fwd_sm90.split_workspace(rows)["o_partial"][0] == (batch, 1, group, nheads // group, 64)
    whole = _problem(**{**fp8, "seqlen_q": 200})
    assert fwd_sm90.split_parts(whole) is None and fwd_sm90._q_descale_shift(whole) == 7
    assert not forward.query_heads_as_rows(_problem(seqlen_q=1, nheads=nheads, nheads_kv=3)).q_descale_per_row


def test_every_row_sees_every_key_and_such_few_tiles_split():
    """forward.sees_every_key, the bounds exactly (bottom-right aligned); fwd_sm90.kv_splits splits a
    causal decode step's few tiles (its one row sees every key), a causal step of a few rows (masked
    split variants, 16-bit or e4m3), and not the same keys under a left window that hides some, nor
    masked rows beyond one row block a head."""
    from cuflash.kernels import fwd_sm90

    every = lambda **kw: forward.sees_every_key(_problem(**{**dict(seqlen_q=3, seqlen_k=40), **kw}))
    assert every() and every(window_left=39, window_right=2) and every(window_left=-1, window_right=5)
    assert not every(window_left=38) and not every(window_right=1) and not every(window_right=0)
    assert not every(window_left=37)  # row 0 sees key 0, but row 2 not keys 0 and 1 (their first key is row + 37 - 39)
    assert forward.sees_every_key(_problem(seqlen_q=1, seqlen_k=40, window_right=0, causal=True))
    decode = dict(batch=1, seqlen_q=1, seqlen_k=32768, nheads=32, nheads_kv=32, headdim=128)
    assert fwd_sm90.kv_splits(_problem(**decode, window_right=0, causal=True)) > 1
    assert fwd_sm90.kv_splits(_problem(**decode, window_left=1000)) == 1
    assert fwd_sm90.kv_splits(_problem(**{**decode, "batch": 8, "nheads": 16, "nheads_kv": 16})) == 1  # 128 tiles
    draft = dict(decode, seqlen_q=4, nheads_kv=8)  # a speculative step: 4 new rows, causal
    block_m = fwd_sm90.split_block_m(_problem(**draft, window_right=0, causal=True))
    assert fwd_sm90.kv_splits(_problem(**draft, window_right=0, causal=True)) > 1
    assert fwd_sm90.kv_splits(_problem(**draft, window_right=2)) > 1
    assert fwd_sm90.kv_splits(_problem(**draft, window_left=32767, window_right=0, causal=True)) > 1  # (hides nothing)
    assert fwd_sm90.kv_splits(_problem(**draft, window_left=32766, window_right=0, causal=True)) == 1
    assert fwd_sm90.kv_splits(_problem(**{**draft, "seqlen_q": block_m}, window_right=0, causal=True)) > 1
    assert fwd_sm90.kv_splits(_problem(**{**draft, "seqlen_q": block_m + 1}, window_right=0, causal=True)) == 1
    fp8 = dict(op="attention_fp8_forward", dtype="float8_e4m3fn")
    assert fwd_sm90.kv_splits(_problem(**draft, **fp8)) > 1
    assert fwd_sm90.kv_splits(_problem(**draft, **fp8, window_right=0, causal=True)) > 1
    assert fwd_sm90.kv_splits(_problem(**draft, **fp8, window_left=32766, window_right=0, causal=True)) == 1
    fp8_masked = fwd_sm90._select_split(_problem(**draft, **fp8, out_dtype="bfloat16", window_right=0, causal=True),
                                        128, False)
    assert fp8_masked.split_kv and fp8_masked.masked and fp8_masked in fwd_sm90.fp8_variants_for((9, 0))
    masked = fwd_sm90._select_split(_problem(**draft, window_right=0, causal=True), 128, False)
    assert masked.split_kv and masked.masked and not masked.pass_by
    assert fwd_sm90._select_split(_problem(**{**draft, "headdim": 256}, window_right=0, causal=True), 256, False).pass_by
    unmasked = fwd_sm90._select_split(_problem(**decode, window_right=0, causal=True), 128, False)
    assert unmasked.split_kv and not unmasked.masked and masked in fwd_sm90.variants_for((9, 0))


def test_split_parts_of_few_rows_take_one_consumer():
    """Unmasked split parts of at most 64 query rows (few_rows: a decode step, GQA's query heads as
    rows) run the head dim's one-consumer row, 16-bit and e4m3; more rows, a mask or softcap keep
    two consumers (a second row block of 64 would read the keys again)."""
    from cuflash.kernels import fwd_sm90

    def split(**kw):
        problem = _problem(**{**dict(batch=1, seqlen_q=1, seqlen_k=32768, nheads=32, nheads_kv=8, headdim=128), **kw})
        problem = forward.query_heads_as_rows(problem) or problem
        assert fwd_sm90.kv_splits(problem) > 1
        return fwd_sm90._select_split(problem, problem.headdim, False)

    for headdim in (64, 128, 256):
        variant = split(headdim=headdim)
        assert (variant.consumers, variant.sync) == (1, "free")
        assert (variant.block_n, variant.stages) == fwd_sm90.SPLIT_ONE_CONSUMER_TILES[headdim][1:3]
        assert variant.block_m == fwd_sm90.split_block_m(forward.query_heads_as_rows(_problem(
            batch=1, seqlen_q=1, seqlen_k=32768, nheads=32, nheads_kv=8, headdim=headdim))) == 64
    assert split(seqlen_q=8, nheads_kv=32).consumers == 1  # 8 rows a head, no GQA
    assert split(seqlen_q=65, nheads=8, nheads_kv=8).consumers == 2  # 65 rows: two consumers' worth
    assert split(seqlen_q=4, causal=True, window_right=0).consumers == 2  # a speculative step: masked
    assert split(softcap=5.0).consumers == 2
    fp8 = dict(op="attention_fp8_forward", dtype="float8_e4m3fn", out_dtype="bfloat16")
    assert split(**fp8).consumers == 1 and split(**fp8, headdim=256).consumers == 2
    with pytest.raises(ValueError, match="consumers=1 must be 2 or 3, or 1 for split_kv without ping-pong"):
        fwd_sm90.FwdSm90Variant("bfloat16", "bfloat16", 128, 1, 64, 2, "free", "overlap", False, False, True, False,
                                False)
    compiled = fwd_sm90.variants_for((9, 0))
    assert all(fwd_sm90._split_variant("bfloat16", 128, False, False, few) in compiled for few in (False, True))


def test_split_kv_parts_follow_the_measured_rules():
    """fwd_sm90.kv_splits on the shapes its rules were measured on (benchmarks/NOTES-sm90.md, "Decode
    shapes"): a part keeps at least SPLIT_KV_KEYS_PER_ROW keys a query row of its tile, and the
    parts' waves fill the SMs. Since combine_splits merges in one round trip, a part may be a single
    key block: a decode step of 1k keys splits, and batch 1 with 8k keys takes 16 parts, not 9."""
    from cuflash.kernels import fwd_sm90

    def parts(**kw):
        problem = _problem(**{**dict(batch=1, seqlen_q=1, nheads=8, nheads_kv=8, headdim=128), **kw})
        return fwd_sm90.kv_splits(forward.query_heads_as_rows(problem) or problem)

    assert parts(seqlen_k=1024, nheads=32) == 16  # 8 tiles of 4 rows, 16 key blocks of 64: one a part
    assert parts(seqlen_k=8192, nheads=64) == 16  # (15 parts of 192-key blocks before SPLIT_TILES)
    assert parts(seqlen_k=32768, nheads=32) == 16
    # whole: fewer than 8 keys a query row per part (1k x 1k at 64, 512 x 512 at 256), or 80% of the SMs in tiles
    assert parts(seqlen_q=1024, seqlen_k=1024, headdim=64) == 1
    assert parts(seqlen_q=512, seqlen_k=512, nheads=4, nheads_kv=4, headdim=256) == 1
    assert parts(batch=8, seqlen_k=8192, nheads=16, nheads_kv=16) == 1
