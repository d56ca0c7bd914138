"""The forward kernel families (fwd_sm80 everywhere, fwd_sm90 on Hopper), each forced through
`backend=`, on the GPU against the reference, FlashAttention's criterion: cuflash's max abs error
against a float32 reference from the same fp16/bf16 inputs is at most 2x that of a plain
low-precision implementation, plus 1e-5; the LSE within 1e-3 relative; NaN never passes; outputs
are poisoned before every call, and a second identical call must give the same bits (a moving
error is a race)."""
import dataclasses
import math

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import arrays, dispatch, reference
from cuflash.problem import Problem

pytestmark = pytest.mark.gpu
torch = pytest.importorskip("torch")
gpu_attention = pytest.importorskip("gpu_attention_reference")

SEQLENS = st.one_of(st.sampled_from([1, 2, 7, 31, 64, 127, 128, 129, 257, 1021, 1024, 2048]), st.integers(1, 2048))
HEADDIMS = st.sampled_from([32, 64, 96, 128, 160, 192, 224, 256, 40, 72, 80, 200, 8])
MAX_SCORES = 2**26  # batch * nheads * seqlen_q * seqlen_k per example, to bound the reference's memory


def _backends():
    if not torch.cuda.is_available():
        return ["sm80", "sm90"]  # collected, then skipped by the gpu marker
    sm90 = torch.cuda.get_device_capability() == (9, 0)
    return ["sm80", pytest.param("sm90", marks=pytest.mark.skipif(not sm90, reason="fwd_sm90 needs compute capability 9.0"))]


BACKENDS = pytest.mark.parametrize("backend", _backends())


@st.composite
def features(draw):
    causal = draw(st.booleans())
    side = st.one_of(st.just(-1), st.integers(0, 64), st.integers(0, 2048))
    window = (draw(side), draw(st.sampled_from([-1, 0]) if causal else side))
    softcap = draw(st.one_of(st.just(0.0), st.just(0.0), st.floats(1.0, 50.0)))
    scale = draw(st.one_of(st.none(), st.floats(0.02, 1.0)))
    return dict(causal=causal, window=window, softcap=softcap, softmax_scale=scale)


def _strided(shape, dtype, layout, generator):
    """A (batch, seq, heads, dim) tensor: contiguous, a transposed (batch, heads, seq, dim) array, or
    heads sliced out of a wider array (all with 16-byte aligned rows)."""
    b, s, h, d = shape
    if layout == "bhsd":
        return torch.randn(b, h, s, d, device="cuda", generator=generator).to(dtype).transpose(1, 2)
    if layout == "padded":
        return torch.randn(b, s, h + 2, d + 8, device="cuda", generator=generator).to(dtype)[:, :, 1:h + 1, :d]
    return torch.randn(b, s, h, d, device="cuda", generator=generator).to(dtype)


def _problem(op, q, k, backend, **kw):
    """The Problem api.py would build (keywords already normalised), forced onto `backend`."""
    left, right = reference.window_bounds(kw["causal"], kw["window"])
    scale = kw["softmax_scale"] if kw["softmax_scale"] is not None else 1 / math.sqrt(q.shape[-1])
    return Problem(op=op, framework="torch", device=arrays.Device("cuda", q.device.index or 0),
                   dtype=str(q.dtype).removeprefix("torch."), batch=q.shape[0], seqlen_q=q.shape[1],
                   seqlen_k=k.shape[1], nheads=q.shape[2], nheads_kv=k.shape[2], headdim=q.shape[-1],
                   causal=kw["causal"], window_left=left, window_right=right, softmax_scale=scale,
                   softcap=float(kw["softcap"]), backend=backend)


def _check(out, lse, q, k, v, kw):
    ref_out, ref_lse = gpu_attention.attention(q, k, v, compute_dtype=torch.float32, **kw)
    low_out, _ = gpu_attention.attention(q, k, v, compute_dtype=q.dtype, **kw)
    assert not torch.isnan(out).any(), "NaN (or an unwritten, poisoned element) in out"
    assert not torch.isnan(lse).any(), "NaN (or an unwritten, poisoned element) in lse"
    err = (out.float() - ref_out).abs().max().item() if out.numel() else 0.0
    low_err = (low_out.float() - ref_out).abs().max().item() if out.numel() else 0.0
    assert err <= 2 * low_err + 1e-5, f"max error {err:.3g} vs plain {q.dtype} implementation {low_err:.3g}"
    dead = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), dead), "rows without keys must have lse -inf, and only those"
    torch.testing.assert_close(lse[~dead], ref_lse[~dead], rtol=1e-3, atol=1e-3)
    return err, low_err


@BACKENDS
@settings(max_examples=200)
@given(dtype=st.sampled_from([torch.float16, torch.bfloat16]), headdim=HEADDIMS, batch=st.integers(1, 4),
       seqlen_q=SEQLENS, seqlen_k=SEQLENS, nheads_kv=st.integers(1, 2), group=st.sampled_from([1, 2, 4, 8]),
       kw=features(), layout=st.sampled_from(["contiguous", "bhsd", "padded"]), seed=st.integers(0, 2**31 - 1))
def test_forward_matches_reference(backend, dtype, headdim, batch, seqlen_q, seqlen_k, nheads_kv, group, kw, layout, seed):
    nheads = nheads_kv * group
    assume(batch * nheads * seqlen_q * seqlen_k <= MAX_SCORES)
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = _strided((batch, seqlen_q, nheads, headdim), dtype, layout, g)
    k = _strided((batch, seqlen_k, nheads_kv, headdim), dtype, layout, g)
    v = _strided((batch, seqlen_k, nheads_kv, headdim), dtype, layout, g)
    problem = _problem("attention_forward", q, k, backend, **kw)
    inputs = dict(q=q, k=k, v=v)
    out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, (batch, nheads, seqlen_q), dtype)
    _check(out, lse, q, k, v, kw)
    again, lse_again = gpu_attention.run_poisoned(problem, inputs, q.shape, (batch, nheads, seqlen_q), dtype)
    assert torch.equal(again, out) and torch.equal(lse_again, lse), "results moved between identical runs: a race"


@BACKENDS
@settings(max_examples=60)
@given(dtype=st.sampled_from([torch.float16, torch.bfloat16]), headdim=st.sampled_from([64, 128, 96, 256]),
       lens=st.lists(st.tuples(st.integers(0, 700), st.integers(0, 700)), min_size=1, max_size=5),
       nheads_kv=st.integers(1, 2), group=st.sampled_from([1, 4]), kw=features(), seed=st.integers(0, 2**31 - 1))
def test_varlen_matches_per_sequence_reference(backend, dtype, headdim, lens, nheads_kv, group, kw, seed):
    nheads = nheads_kv * group
    g = torch.Generator(device="cuda").manual_seed(seed)
    cu_q = torch.tensor(np.concatenate([[0], np.cumsum([a for a, _ in lens])]), dtype=torch.int32, device="cuda")
    cu_k = torch.tensor(np.concatenate([[0], np.cumsum([b for _, b in lens])]), dtype=torch.int32, device="cuda")
    total_q, total_k = int(cu_q[-1]), int(cu_k[-1])
    assume(backend != "sm90" or (total_q and total_k))  # TMA cannot describe an empty tensor (sm80 serves it)
    q = torch.randn(total_q, nheads, headdim, device="cuda", generator=g).to(dtype)
    k = torch.randn(total_k, nheads_kv, headdim, device="cuda", generator=g).to(dtype)
    v = torch.randn(total_k, nheads_kv, headdim, device="cuda", generator=g).to(dtype)
    max_q, max_k = max(a for a, _ in lens), max(b for _, b in lens)
    problem = _problem("attention_forward", q[None], k[None], backend, **kw)
    problem = dataclasses.replace(problem, op="attention_varlen_forward", batch=len(lens), seqlen_q=max_q,
                                  seqlen_k=max_k, total_q=total_q, total_k=total_k)
    inputs = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, (nheads, total_q), dtype)
    for b, (lq, lk) in enumerate(lens):
        sq = slice(int(cu_q[b]), int(cu_q[b + 1]))
        sk = slice(int(cu_k[b]), int(cu_k[b + 1]))
        _check(out[sq][None], lse[:, sq][None], q[sq][None], k[sk][None], v[sk][None], kw)


@BACKENDS
def test_repeated_varlen_calls_read_each_calls_cu_seqlens(backend):
    """Varlen calls are remembered per call signature as `attention`'s are (dispatch.run_checked; their
    GPU cu_seqlens' values are checked by check_cu_seqlens' kernel, not on the host): each later call
    with arrays laid out alike must read its own cu_seqlens, new buffers or new values in the old."""
    g = torch.Generator(device="cuda").manual_seed(12)
    kw = dict(causal=True, window=(-1, -1), softcap=0.0, softmax_scale=None)
    q, k, v = (torch.randn(300, 4, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    reused = torch.zeros(4, device="cuda", dtype=torch.int32)
    for lens in ((100, 200, 0), (250, 0, 50), (0, 300, 0), (1, 1, 298)):
        cu = torch.tensor(np.concatenate([[0], np.cumsum(lens)]), device="cuda", dtype=torch.int32)
        for cu_seqlens in (cu, reused.copy_(cu)):
            out, lse = cuflash.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, 300, 300, return_lse=True,
                                                backend=backend, **kw)
            for start, end in zip(cu[:-1].tolist(), cu[1:].tolist()):
                if start == end:
                    continue
                rows = slice(start, end)
                _check(out[rows][None], lse[:, rows][None], q[rows][None], k[rows][None], v[rows][None], kw)


# Rows the tile table does not hold, which benchmarks/bench_fwd.py --sm90-tiles can time: the serial
# schedule with ping-pong, free and starting tiles together, with one K/V stage and with two, at two
# and three consumers; free consumers with the P V overlap and with two consumers.
OTHER_TILE_ROWS = ((64, (3, 128, 2, "pingpong", "serial")), (128, (2, 128, 2, "tile", "serial")),
                   (256, (2, 128, 1, "free", "serial")), (256, (2, 80, 2, "pingpong", "serial")),
                   (128, (2, 192, 2, "free", "overlap_pv")), (256, (2, 80, 2, "free", "overlap")))


def _tile_row_cases():
    """(headdim, seqlen_k, the row's tiles, whether they override the table) on both sides of every
    bound of fwd_sm90's tile table (the hypothesis draws above stop at 2048 keys, where the first bound
    is), and OTHER_TILE_ROWS."""
    from cuflash.kernels import fwd_sm90

    cases = []
    for headdim, rows in fwd_sm90.TILES.items():
        for (bound, tiles), (_, after) in zip(rows, rows[1:]):
            cases += [(headdim, bound, tiles, False), (headdim, bound + 1, after, False),
                      (headdim, 2 * bound + 77, after, False)]
    return cases + [(headdim, 1000, tiles, True) for headdim, tiles in OTHER_TILE_ROWS]


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="fwd_sm90 needs compute capability 9.0")
@pytest.mark.parametrize("headdim, seqlen_k, tiles, override", _tile_row_cases())
@pytest.mark.parametrize("causal, varlen", [(False, False), (True, False), (True, True)])
def test_sm90_every_tile_row_matches_reference(headdim, seqlen_k, tiles, override, causal, varlen, monkeypatch,
                                               request):
    from cuflash.kernels import fwd_sm90

    # The rows themselves: these few tiles would otherwise run split-KV (test_sm90_split_kv_matches_reference).
    monkeypatch.setattr(fwd_sm90, "kv_splits", lambda problem: 1)
    dispatch.clear_plans()  # and no plan made with the table (or, afterwards, with the override) is reused
    request.addfinalizer(dispatch.clear_plans)
    if override:
        monkeypatch.setattr(fwd_sm90, "tiles_override", {headdim: tiles})
    g = torch.Generator(device="cuda").manual_seed(seqlen_k + headdim)
    seqlen_q = 300 if causal else 200  # causal: bottom-right aligned, the rows see the last keys
    q = torch.randn(1, seqlen_q, 4, headdim, device="cuda", generator=g).to(torch.bfloat16)
    k = torch.randn(1, seqlen_k, 2, headdim, device="cuda", generator=g).to(torch.bfloat16)
    v = torch.randn(1, seqlen_k, 2, headdim, device="cuda", generator=g).to(torch.bfloat16)
    kw = dict(causal=causal, window=(-1, -1), softcap=0.0, softmax_scale=None)
    problem = _problem("attention_forward", q, k, "sm90", **kw)
    inputs = dict(q=q, k=k, v=v)
    if varlen:  # one long sequence after a short one
        cu_q = torch.tensor([0, 37, 37 + seqlen_q], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 51, 51 + seqlen_k], dtype=torch.int32, device="cuda")
        q, k, v = (torch.cat([x[0, :n], x[0]]) for x, n in ((q, 37), (k, 51), (v, 51)))
        problem = dataclasses.replace(problem, op="attention_varlen_forward", batch=2, total_q=q.shape[0],
                                      total_k=k.shape[0])
        inputs = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    family, variant = dispatch.plan(problem, {n: arrays.device_array(x) for n, x in inputs.items()})
    assert family.name == "fwd_sm90"
    assert (variant.consumers, variant.block_n, variant.stages, variant.sync, variant.schedule) == tiles
    if varlen:
        out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, (4, q.shape[0]), torch.bfloat16)
        out, lse, q, k, v = out[37:][None], lse[:, 37:][None], q[37:][None], k[51:][None], v[51:][None]
    else:
        out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, (1, 4, seqlen_q), torch.bfloat16)
        again, _ = gpu_attention.run_poisoned(problem, inputs, q.shape, (1, 4, seqlen_q), torch.bfloat16)
        assert torch.equal(again, out), "results moved between identical runs: a race"
    _check(out, lse, q, k, v, kw)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="fwd_sm90 needs compute capability 9.0")
@pytest.mark.parametrize("headdim, batch, nheads, seqlen", [(64, 8, 16, 512), (256, 16, 8, 1000), (128, 2, 16, 2048)])
def test_sm90_masked_tile_orders_cover_every_tile(headdim, batch, nheads, seqlen):
    """Causal problems with more (batch, head) pairs than a wave of tiles: below 2k keys the pairs go
    head by head and the last wave's worth in one window (window_pair0 > 0), from 2k all in windows
    (fwd_sm90.tile_window): every tile is drawn once (outputs poisoned) and lands on its own rows."""
    from cuflash.kernels import fwd_sm90

    g = torch.Generator(device="cuda").manual_seed(seqlen + headdim)
    q, k, v = (torch.randn(batch, seqlen, nheads, headdim, device="cuda", generator=g).to(torch.bfloat16)
               for _ in range(3))
    kw = dict(causal=True, window=(-1, -1), softcap=0.0, softmax_scale=None)
    problem = _problem("attention_forward", q, k, "sm90", **kw)
    family, variant = dispatch.plan(problem, {n: arrays.device_array(x) for n, x in dict(q=q, k=k, v=v).items()})
    blocks_m = -(-seqlen // variant.block_m)
    ctas = torch.cuda.get_device_properties(0).multi_processor_count
    pair0, heads = fwd_sm90.tile_window(batch * nheads, blocks_m, ctas, seqlen)
    assert (pair0 > 0) == (seqlen < fwd_sm90.TILE_WINDOW_MIN_KEYS) and heads > 1
    out, lse = gpu_attention.run_poisoned(problem, dict(q=q, k=k, v=v), q.shape, (batch, nheads, seqlen), torch.bfloat16)
    _check(out, lse, q, k, v, kw)


@BACKENDS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("rise", [3.0, 24.0])
def test_running_max_rising_block_by_block(backend, dtype, headdim, rise):
    """Scores that rise towards the first keys (the kernels walk key blocks from the last) by `rise`
    log2 units per 128 keys: below fwd_sm90's stale-maximum threshold of 8 (P grows past 1 for a
    few blocks while O is not rescaled, then the maximum moves) and above it (rescaled every block).
    A skipped rescale that was needed would be off by a factor of 2^8 or more."""
    g = torch.Generator(device="cuda").manual_seed(int(rise) * 1000 + headdim)
    seqlen_q, seqlen_k = 200, 1100
    score = torch.arange(seqlen_k, 0, -1, device="cuda", dtype=torch.float32) * (rise / 128 * math.log(2))
    q = 1 + 0.1 * torch.randn(1, seqlen_q, 2, headdim, device="cuda", generator=g)
    k = (score / math.sqrt(headdim))[None, :, None, None] + 0.1 * torch.randn(1, seqlen_k, 2, headdim, device="cuda",
                                                                              generator=g)
    v = torch.randn(1, seqlen_k, 2, headdim, device="cuda", generator=g)
    q, k, v = (x.to(dtype) for x in (q, k, v))
    kw = dict(causal=False, window=(-1, -1), softcap=0.0, softmax_scale=None)
    problem = _problem("attention_forward", q, k, backend, **kw)
    out, lse = gpu_attention.run_poisoned(problem, dict(q=q, k=k, v=v), q.shape, (1, 2, seqlen_q), dtype)
    _check(out, lse, q, k, v, kw)


@BACKENDS
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("headdim", [64, 128, 192, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_blocks_and_rows_of_negative_scores(backend, dtype, headdim, causal):
    """fwd_sm90 takes a block's row maxima as integer maxima of the scores' bits, exact only where a
    row's maximum is >= 0; a warp holding a row whose block scores are all negative (or -0) takes the
    float maxima instead (masking.cuh, quad_row_max_bits). Both, and warps mixing them, against the
    reference (gpu_attention.signed_scores_inputs; softmax scale 4: scores up to +-2.5 x 4)."""
    g = torch.Generator(device="cuda").manual_seed(headdim + 7 * causal)
    q, k, v = (x.to(dtype) for x in gpu_attention.signed_scores_inputs((1, 200, 2, headdim), (1, 1100, 2, headdim), g))
    kw = dict(causal=causal, window=(-1, -1), softcap=0.0, softmax_scale=4.0)
    problem = _problem("attention_forward", q, k, backend, **kw)
    out, lse = gpu_attention.run_poisoned(problem, dict(q=q, k=k, v=v), q.shape, (1, 2, 200), dtype)
    _check(out, lse, q, k, v, kw)


@BACKENDS
def test_windows_reaching_past_every_key_are_unbounded(backend):
    """Window bounds up to int32's maximum are accepted; the kernels must not overflow on them."""
    g = torch.Generator(device="cuda").manual_seed(7)
    q = torch.randn(2, 200, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(2, 333, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    big = 2**31 - 1
    for window in ((big, big), (-1, big), (big, -1), (big, 0)):
        out, lse = cuflash.attention(q, k, k, window=window, return_lse=True, backend=backend)
        _check(out, lse, q, k, k, dict(causal=False, window=window, softcap=0.0, softmax_scale=None))


def test_hopper_runs_fwd_sm90_by_default_and_falls_back_with_a_reason(caplog):
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Hopper only")
    caplog.set_level("DEBUG", logger="cuflash")
    q = torch.randn(1, 64, 2, 128, device="cuda", dtype=torch.bfloat16)
    problem = _problem("attention_forward", q, q, None, causal=False, window=(-1, -1), softcap=0.0, softmax_scale=None)
    inputs = {n: arrays.device_array(q) for n in "qkv"}
    assert dispatch.plan(problem, inputs)[0].name == "fwd_sm90"
    broadcast = torch.randn(1, 64, 1, 128, device="cuda", dtype=torch.bfloat16).expand(1, 64, 2, 128)  # head stride 0
    problem_bc = dataclasses.replace(problem, nheads_kv=2)
    family, _ = dispatch.plan(problem_bc, dict(inputs, k=arrays.device_array(broadcast)))
    assert family.name == "fwd_sm80"
    assert "fwd_sm80 runs attention_forward" in caplog.text and "fwd_sm90 loads k with TMA" in caplog.text
    with pytest.raises(NotImplementedError, match="backend='sm90'.*TMA"):
        cuflash.attention(q, broadcast, broadcast, backend="sm90")
    out = cuflash.attention(q, broadcast, broadcast)  # the fallback serves it
    _check(out, cuflash.attention(q, broadcast, broadcast, return_lse=True)[1], q, broadcast, broadcast,
           dict(causal=False, window=(-1, -1), softcap=0.0, softmax_scale=None))


def test_hopper_keeps_fwd_sm90_for_zero_strides_of_size_one_axes():
    """An axis of extent 1 may have stride 0 (CuPy's x[None], say), which TMA would refuse; TMA never
    steps along it, so fwd_sm90 still serves the call, with the packed copy's result bit for bit."""
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("Hopper only")
    g = torch.Generator(device="cuda").manual_seed(1)
    q, k, v = (torch.randn(n, h, 64, device="cuda", generator=g, dtype=torch.bfloat16)
               for n, h in ((200, 2), (300, 1), (300, 1)))
    zero = lambda x: x.as_strided((1,) + x.shape, (0,) + tuple(s if n > 1 else 0 for n, s in zip(x.shape, x.stride())))
    q, k, v = zero(q), zero(k), zero(v)  # batch stride 0; k and v: head stride 0 too
    assert q.stride(0) == 0 and k.stride()[::2] == (0, 0)
    problem = _problem("attention_forward", q, k, None, causal=True, window=(-1, -1), softcap=0.0, softmax_scale=None)
    assert dispatch.plan(problem, {n: arrays.device_array(x) for n, x in zip("qkv", (q, k, v))})[0].name == "fwd_sm90"
    packed = [torch.empty(x.shape, device="cuda", dtype=x.dtype).copy_(x) for x in (q, k, v)]
    assert torch.equal(cuflash.attention(q, k, v, causal=True, backend="sm90"),
                       cuflash.attention(*packed, causal=True, backend="sm90"))


def test_public_entry_points_run_the_kernel():
    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(2, 333, 8, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k = torch.randn(2, 517, 2, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    out, lse = cuflash.attention(q, k, k, causal=True, return_lse=True)
    assert out.dtype == torch.bfloat16 and lse.shape == (2, 8, 333) and lse.dtype == torch.float32
    _check(out, lse, q, k, k, dict(causal=True, window=(-1, -1), softcap=0.0, softmax_scale=None))
    cupy = pytest.importorskip("cupy")
    out_cp = cuflash.attention(cupy.from_dlpack(q), cupy.from_dlpack(k), cupy.from_dlpack(k), causal=True)
    assert isinstance(out_cp, cupy.ndarray) and torch.equal(torch.from_dlpack(out_cp), out)
    jax = pytest.importorskip("jax")
    to_jax = lambda t: jax.dlpack.from_dlpack(t)
    out_jax = jax.jit(lambda a, b: cuflash.attention(a, b, b, causal=True))(to_jax(q), to_jax(k))
    assert torch.equal(torch.from_dlpack(out_jax), out)


def test_the_torch_reference_is_the_contract():
    """gpu_attention_reference (float64) agrees with cuflash.reference on a mix of features."""
    rng = np.random.default_rng(0)
    for kw in (dict(causal=True, window=(5, -1), softcap=0.0, softmax_scale=None),
               dict(causal=False, window=(3, 7), softcap=4.0, softmax_scale=0.3)):
        q, k, v = (rng.standard_normal(s) for s in ((2, 19, 4, 16), (2, 11, 2, 16), (2, 11, 2, 16)))
        ref_out, ref_lse = reference.forward(q, k, v, **kw)
        out, lse = gpu_attention.attention(*(torch.from_numpy(x).cuda() for x in (q, k, v)),
                                           compute_dtype=torch.float64, **kw)
        np.testing.assert_allclose(out.cpu().numpy(), ref_out, rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(lse.cpu().numpy(), ref_lse, rtol=1e-6, atol=1e-6)


def test_unaligned_strides_are_refused_by_name():
    q = torch.randn(1, 64, 2, 72, device="cuda", dtype=torch.float16)[..., :64]  # head stride 144 bytes: aligned
    cuflash.attention(q, q, q)
    odd = torch.randn(1, 64, 2, 65, device="cuda", dtype=torch.float16)[..., :64]
    with pytest.raises(NotImplementedError, match="16-byte"):
        cuflash.attention(odd, odd, odd)


@BACKENDS
@pytest.mark.parametrize("headdim", [64, 128, 256])
@pytest.mark.parametrize("batch, group, seqlen_k, layout", [(1, 4, 4100, "contiguous"), (3, 8, 333, "bhsd"),
                                                            (2, 2, 1, "padded"), (2, 16, 2049, "contiguous")])
@pytest.mark.parametrize("kw", [dict(causal=False, window=(-1, -1), softcap=0.0, softmax_scale=None),
                                dict(causal=True, window=(-1, -1), softcap=0.0, softmax_scale=None),
                                dict(causal=False, window=(-1, 3), softcap=20.0, softmax_scale=0.3)])
def test_decode_gqa_runs_query_heads_as_rows_and_matches_reference(backend, headdim, batch, group, seqlen_k, layout,
                                                                  kw):
    """A decode step with GQA (one query row) runs with each kv head's query heads as the rows of
    one head (kernels.forward.query_heads_as_rows: dispatch plans that problem) on views of q, out
    and lse, and gives the reference's results, poisoned outputs, bit for bit again."""
    nheads_kv = 2
    g = torch.Generator(device="cuda").manual_seed(batch * group + seqlen_k)
    q = _strided((batch, 1, nheads_kv * group, headdim), torch.bfloat16, layout, g)
    k, v = (_strided((batch, seqlen_k, nheads_kv, headdim), torch.bfloat16, layout, g) for _ in range(2))
    problem = _problem("attention_forward", q, k, backend, **kw)
    dispatch.clear_plans()
    inputs = dict(q=q, k=k, v=v)
    lse_shape = (batch, nheads_kv * group, 1)
    out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, lse_shape, torch.bfloat16)
    planned = [p for p, _ in dispatch._plans]
    assert [(p.seqlen_q, p.nheads, p.causal) for p in planned] == [(group, nheads_kv, False)], planned
    _check(out, lse, q, k, v, kw)
    again, lse_again = gpu_attention.run_poisoned(problem, inputs, q.shape, lse_shape, torch.bfloat16)
    assert torch.equal(again, out) and torch.equal(lse_again, lse), "results moved between identical runs: a race"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="fwd_sm90 needs compute capability 9.0")
@pytest.mark.parametrize("headdim", [64, 96, 128, 192, 256])
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_kv, softcap", [
    (1, 1, 40000, 8, 8, 0.0), (1, 300, 5000, 2, 1, 0.0), (2, 7, 1777, 4, 2, 30.0), (3, 1, 2000, 8, 2, 0.0),
    (1, 1, 40000, 1, 1, 0.0)])  # (one tile: more parts than combine_splits merges at once)
def test_sm90_split_kv_matches_reference(headdim, batch, seqlen_q, seqlen_k, nheads, nheads_kv, softcap):
    """Problems with fewer tiles than SMs run split-KV (fwd_sm90.kv_splits parts, float32 partials in a
    poisoned workspace, combine_splits), and give the reference's results, bit for bit again; the same
    problem under a causal mask runs split too (masked split variants) where its rows are one row block
    a head, and unsplit beyond."""
    from cuflash.kernels import fwd_sm90, forward

    g = torch.Generator(device="cuda").manual_seed(seqlen_k + headdim)
    q = torch.randn(batch, seqlen_q, nheads, headdim, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", generator=g, dtype=torch.bfloat16)
            for _ in range(2))
    kw = dict(causal=False, window=(-1, -1), softcap=softcap, softmax_scale=None)
    problem = _problem("attention_forward", q, k, "sm90", **kw)
    planned = forward.query_heads_as_rows(problem) or problem
    assert fwd_sm90.kv_splits(planned) > 1
    dispatch.clear_plans()
    inputs = dict(q=q, k=k, v=v)
    lse_shape = (batch, nheads, seqlen_q)
    out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, lse_shape, torch.bfloat16)
    assert [variant.split_kv for _, variant in dispatch._plans.values()] == [True]
    _check(out, lse, q, k, v, kw)
    again, lse_again = gpu_attention.run_poisoned(problem, inputs, q.shape, lse_shape, torch.bfloat16)
    assert torch.equal(again, out) and torch.equal(lse_again, lse), "results moved between identical runs: a race"
    if seqlen_q > 1:  # (one query row sees every key under a causal mask: split unmasked, above)
        causal = dict(kw, causal=True)
        masked = _problem("attention_forward", q, k, "sm90", **causal)
        block_m = fwd_sm90.split_block_m(masked)
        assert (fwd_sm90.kv_splits(masked) > 1) == (seqlen_q <= block_m)
        dispatch.clear_plans()
        out, lse = gpu_attention.run_poisoned(masked, inputs, q.shape, lse_shape, torch.bfloat16)
        assert [(variant.split_kv, variant.masked) for _, variant in dispatch._plans.values()] == [(seqlen_q <= block_m, True)]
        _check(out, lse, q, k, v, causal)
        again, lse_again = gpu_attention.run_poisoned(masked, inputs, q.shape, lse_shape, torch.bfloat16)
        assert torch.equal(again, out) and torch.equal(lse_again, lse), "results moved between identical runs: a race"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="fwd_sm90 needs compute capability 9.0")
@pytest.mark.parametrize("headdim", [64, 128, 192, 256])
@pytest.mark.parametrize("batch, seqlen_q, seqlen_k, nheads, nheads_kv, window, softcap", [
    (1, 4, 32768, 32, 8, (-1, 0), 0.0), (2, 5, 3001, 8, 2, (-1, 3), 0.0), (1, 128, 40000, 1, 1, (-1, 0), 0.0),
    (3, 2, 2049, 4, 4, (2048, 0), 30.0), (1, 64, 9000, 2, 1, (-1, 40), 0.0)])
def test_sm90_masked_split_kv_matches_reference(headdim, batch, seqlen_q, seqlen_k, nheads, nheads_kv, window,
                                                softcap):
    """Speculative decoding's steps (a few new rows, causal or right-bounded, GQA, softcap, a left bound
    that hides no key) run the masked split variants, and give the reference's results with the
    outputs and the partials' workspace poisoned, bit for bit again."""
    from cuflash.kernels import fwd_sm90

    g = torch.Generator(device="cuda").manual_seed(seqlen_k + headdim + seqlen_q)
    q = torch.randn(batch, seqlen_q, nheads, headdim, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", generator=g, dtype=torch.bfloat16)
            for _ in range(2))
    kw = dict(causal=window == (-1, 0), window=window, softcap=softcap, softmax_scale=None)
    problem = _problem("attention_forward", q, k, "sm90", **kw)
    assert fwd_sm90.kv_splits(problem) > 1
    dispatch.clear_plans()
    inputs = dict(q=q, k=k, v=v)
    lse_shape = (batch, nheads, seqlen_q)
    out, lse = gpu_attention.run_poisoned(problem, inputs, q.shape, lse_shape, torch.bfloat16)
    assert [(variant.split_kv, variant.masked) for _, variant in dispatch._plans.values()] == [(True, True)]
    _check(out, lse, q, k, v, kw)
    again, lse_again = gpu_attention.run_poisoned(problem, inputs, q.shape, lse_shape, torch.bfloat16)
    assert torch.equal(again, out) and torch.equal(lse_again, lse), "results moved between identical runs: a race"


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="fwd_sm90 needs compute capability 9.0")
@pytest.mark.parametrize("seqlen_q, seqlen_k, window", [(300, 4096, (3796, -1)), (5000, 4096, (0, -1)),
                                                        (128, 4096, (3968, -1)), (300, 4096, (4095, -1))])
def test_sm90_few_tiles_under_a_window_split_only_where_every_row_sees_every_key(seqlen_q, seqlen_k, window):
    """A left window that hides key 0 from the last rows only (row 0 still sees it) keeps its mask:
    those few tiles run whole and masked, and only a window that hides no key splits (a first
    forward.sees_every_key tested row 0 alone, and split these unmasked: max error 0.04-2.4)."""
    from cuflash.kernels import forward

    g = torch.Generator(device="cuda").manual_seed(seqlen_q + window[0])
    q = torch.randn(1, seqlen_q, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(1, seqlen_k, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    kw = dict(causal=False, window=window, softcap=0.0, softmax_scale=None)
    problem = _problem("attention_forward", q, k, "sm90", **kw)
    dispatch.clear_plans()
    out, lse = gpu_attention.run_poisoned(problem, dict(q=q, k=k, v=v), q.shape, (1, 2, seqlen_q), torch.bfloat16)
    assert [variant.split_kv for _, variant in dispatch._plans.values()] == [forward.sees_every_key(problem)]
    assert forward.sees_every_key(problem) == (window[0] == seqlen_k - 1)
    _check(out, lse, q, k, v, kw)


@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0),
                    reason="fwd_sm90 needs compute capability 9.0")
def test_split_kv_decode_under_jax_vmap_jit_and_torch_graphs():
    """Split-KV's workspace is declared before JAX's vmap folds the mapped axis into the batch (the
    launch then takes as many parts as the workspace holds), and is allocated by CUDA graph capture
    under torch: both give the reference's results."""
    jax = pytest.importorskip("jax")
    g = torch.Generator(device="cuda").manual_seed(5)
    kw = dict(causal=True, window=(-1, -1), softcap=0.0, softmax_scale=None)
    q = torch.randn(3, 1, 1, 16, 128, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(3, 1, 8192, 4, 128, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    to_jax = jax.dlpack.from_dlpack
    out = jax.jit(jax.vmap(lambda a, b, c: cuflash.attention(a, b, c, causal=True)))(to_jax(q), to_jax(k), to_jax(v))
    out = torch.from_dlpack(out)
    for i in range(3):
        want, lse = cuflash.attention(q[i], k[i], v[i], causal=True, return_lse=True)
        _check(want, lse, q[i], k[i], v[i], kw)
        _check(out[i], lse, q[i], k[i], v[i], kw)
    static = [x[0].clone() for x in (q, k, v)]
    graph = torch.cuda.CUDAGraph()
    cuflash.attention(*static, causal=True)  # (compiled and planned before capture)
    with torch.cuda.graph(graph):
        captured = cuflash.attention(*static, causal=True, return_lse=True)
    for i in range(3):
        for x, src in zip(static, (q, k, v)):
            x.copy_(src[i])
        graph.replay()
        torch.cuda.synchronize()
        _check(*captured, q[i], k[i], v[i], kw)


@BACKENDS
def test_repeated_calls_read_each_calls_arrays(backend):
    """Calls after the first with arrays laid out alike skip the argument checks and reuse the prepared
    launch (dispatch.run_checked). Each must read its own arrays and write its own outputs (torch's
    allocator is handed a NaN-filled block to give back), a changed layout must be a new call, the
    launch must go to the caller's current stream, and a bad argument must still be refused."""
    g = torch.Generator(device="cuda").manual_seed(11)
    kw = dict(causal=True, window=(-1, -1), softcap=0.0, softmax_scale=None)
    shape_q, shape_kv = (2, 300, 4, 128), (2, 333, 2, 128)
    for layout in ("contiguous", "contiguous", "bhsd", "contiguous", "padded"):
        q = _strided(shape_q, torch.bfloat16, layout, g)
        k, v = (_strided(shape_kv, torch.bfloat16, layout, g) for _ in range(2))
        for shape, dtype in ((shape_q, torch.bfloat16), ((2, 4, 300), torch.float32)):  # out's and lse's
            torch.full(shape, float("nan"), device="cuda", dtype=dtype)  # freed at once, handed out next
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, backend=backend)
        _check(out, lse, q, k, v, kw)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    with torch.cuda.stream(side):
        q, k, v = (torch.zeros(s, device="cuda", dtype=torch.bfloat16) for s in (shape_q, shape_kv, shape_kv))
        torch.cuda._sleep(50_000_000)  # ~25 ms on `side` before the inputs are written
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, device="cuda", generator=g))
        out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True, backend=backend)
    side.synchronize()
    _check(out, lse, q, k, v, kw)
    with pytest.raises(TypeError, match="causal must be a bool"):
        cuflash.attention(q, k, v, causal=1, backend=backend)
