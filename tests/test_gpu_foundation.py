"""GPU tests of the foundation (run on the lent GPU): the bwd_preprocess kernel against the
reference with poisoned outputs, zero-copy views, ordering on the caller's stream, JAX under jit
through buffer_callback, and the honest refusal of ops no kernel serves yet."""
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import api, arrays, dispatch, reference
from cuflash.kernels.bwd_preprocess import HEADDIMS

pytestmark = pytest.mark.gpu

SEQLENS = st.one_of(st.sampled_from([1, 2, 3, 17, 127, 128, 129, 1021, 2048]), st.integers(1, 2048))


def _torch():
    return pytest.importorskip("torch")


def _delta_reference(out, dout):
    """float64 reference of delta from the same 16-bit values the kernel read."""
    torch = _torch()
    as64 = lambda t: t.detach().to("cpu", torch.float64).numpy()
    return reference.backward_preprocess(as64(dout), as64(out))


def _check_delta(delta, out, dout):
    torch = _torch()
    got = delta.detach().to("cpu", torch.float64).numpy()
    ref = _delta_reference(out, dout)
    assert np.isfinite(got).all(), "unwritten (poisoned) or non-finite elements"
    # fp32 accumulation of exact fp16/bf16 products: error ~ headdim * eps32 * sum|terms|
    bound = 1e-6 + 4 * out.shape[-1] * 2.0**-24 * reference.backward_preprocess(
        np.abs(dout.detach().to("cpu", torch.float64).numpy()), np.abs(out.detach().to("cpu", torch.float64).numpy()))
    assert (np.abs(got - ref) <= bound).all(), float(np.abs(got - ref).max())


def _strided(torch, shape, dtype, layout, offset_elems):
    """A (batch, seq, heads, dim) view with non-trivial strides: 'bhsd' is a transposed
    (batch, heads, seq, dim) array; 'padded' slices heads out of a wider array; offset_elems
    shifts the start (an odd offset breaks 16-byte alignment, forcing the scalar variant)."""
    b, s, h, d = shape
    if layout == "contiguous":
        base = torch.randn(b * s * h * d + offset_elems, device="cuda").to(dtype)
        return base[offset_elems:].view(b, s, h, d)
    if layout == "bhsd":
        base = torch.randn(b * h * s * d + offset_elems, device="cuda").to(dtype)
        return base[offset_elems:].view(b, h, s, d).transpose(1, 2)
    base = torch.randn(b, s, h + 3, d + offset_elems, device="cuda").to(dtype)
    return base[:, :, 1:h + 1, offset_elems:]


@settings(max_examples=120)
@given(dtype=st.sampled_from(["float16", "bfloat16"]), headdim=st.sampled_from(HEADDIMS),
       batch=st.integers(1, 4), seqlen=SEQLENS, nheads=st.integers(1, 8),
       layout=st.sampled_from(["contiguous", "bhsd", "padded"]), offset=st.sampled_from([0, 0, 1, 8]))
def test_bwd_preprocess_matches_reference_with_poisoned_output(dtype, headdim, batch, seqlen, nheads, layout, offset):
    torch = _torch()
    tdtype = getattr(torch, dtype)
    out = _strided(torch, (batch, seqlen, nheads, headdim), tdtype, layout, offset)
    dout = _strided(torch, (batch, seqlen, nheads, headdim), tdtype, layout, 0)
    infos = api._describe_all(dict(dout=dout, out=out))
    problem = cuflash.problem.Problem(op="backward_preprocess", framework="torch", device=infos["out"].device,
                                      dtype=dtype, batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, nheads=nheads,
                                      nheads_kv=nheads, headdim=headdim)
    delta = torch.full((batch, nheads, seqlen), float("nan"), device="cuda")
    dispatch.execute(problem, dict(dout=dout, out=out), dict(delta=delta), torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    _check_delta(delta, out, dout)
    # the public path, same inputs: same bits (one kernel, deterministic)
    again = api.backward_preprocess(dout, out)
    torch.cuda.synchronize()
    assert torch.equal(again, delta)


def test_scalar_and_vector_variants_are_both_chosen():
    torch = _torch()
    aligned = torch.randn(2, 64, 4, 128, device="cuda", dtype=torch.float16)
    misaligned = torch.randn(2 * 64 * 4 * 128 + 1, device="cuda", dtype=torch.float16)[1:].view(2, 64, 4, 128)
    for x, vec in ((aligned, 8), (misaligned, 1)):
        infos = api._describe_all(dict(dout=x, out=x))
        problem = cuflash.problem.Problem(op="backward_preprocess", framework="torch", device=infos["out"].device,
                                          dtype="float16", batch=2, seqlen_q=64, seqlen_k=64, nheads=4,
                                          nheads_kv=4, headdim=128)
        _, variant = dispatch.plan(problem, {n: arrays.device_array(x) for n in ("out", "dout")})
        assert variant.vec == vec


def test_zero_copy_views_keep_the_device_pointer():
    torch = _torch()
    cupy = pytest.importorskip("cupy")
    t = torch.randn(3, 40, 6, 64, device="cuda", dtype=torch.bfloat16)[:, 5:, 1:5]  # a strided view
    view = arrays.device_array(t)
    assert view.ptr == t.data_ptr() and view.shape == tuple(t.shape) and view.strides == tuple(t.stride())
    c = cupy.arange(2 * 7 * 3 * 32, dtype=cupy.float16).reshape(2, 7, 3, 32)[:, ::2]
    view = arrays.device_array(c)
    assert view.ptr == c.data.ptr and view.strides == tuple(s // 2 for s in c.strides)
    jax = pytest.importorskip("jax")
    j = jax.device_put(np.ones((2, 5, 3, 64), np.float16), jax.devices("gpu")[0])
    assert arrays.device_array(j).ptr == j.unsafe_buffer_pointer()


def test_torch_cupy_and_jax_results_agree_and_stay_in_their_framework():
    torch = _torch()
    cupy = pytest.importorskip("cupy")
    jax = pytest.importorskip("jax")
    rng = np.random.default_rng(1)
    o = rng.standard_normal((2, 33, 4, 64)).astype(np.float16)
    g = rng.standard_normal((2, 33, 4, 64)).astype(np.float16)
    ref = reference.backward_preprocess(g.astype(np.float64), o.astype(np.float64))
    d_torch = api.backward_preprocess(torch.from_numpy(g).cuda(), torch.from_numpy(o).cuda())
    d_cupy = api.backward_preprocess(cupy.asarray(g), cupy.asarray(o))
    gpu = jax.devices("gpu")[0]
    d_jax = api.backward_preprocess(jax.device_put(g, gpu), jax.device_put(o, gpu))
    assert isinstance(d_torch, torch.Tensor) and d_torch.is_cuda and d_torch.dtype == torch.float32
    assert isinstance(d_cupy, cupy.ndarray) and d_cupy.dtype == np.float32
    assert isinstance(d_jax, jax.Array) and d_jax.dtype == np.float32 and d_jax.devices() == {gpu}
    for got in (d_torch.cpu().numpy(), d_cupy.get(), np.asarray(d_jax)):
        np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-5)


def test_runs_on_the_callers_torch_stream():
    """Inputs are produced on a side stream after a long GPU sleep; if cuflash launched anywhere but
    that stream it would read the stale zeros and the result would be wrong."""
    torch = _torch()
    rng = np.random.default_rng(2)
    o = torch.from_numpy(rng.standard_normal((4, 512, 8, 128)).astype(np.float16)).cuda()
    g = torch.from_numpy(rng.standard_normal((4, 512, 8, 128)).astype(np.float16)).cuda()
    ref = _delta_reference(o, g)
    side = torch.cuda.Stream()
    torch.cuda.synchronize()
    for _ in range(3):
        with torch.cuda.stream(side):
            out = torch.zeros_like(o)
            dout = torch.zeros_like(g)
            torch.cuda._sleep(50_000_000)  # ~25 ms of spinning on `side` before the inputs are written
            out.copy_(o)
            dout.copy_(g)
            delta = api.backward_preprocess(dout, out)
            result = delta * 1.0  # consumed on the same stream
        side.synchronize()
        np.testing.assert_allclose(result.cpu().numpy(), ref, rtol=1e-5, atol=1e-5)


def test_runs_on_the_callers_cupy_stream():
    cupy = pytest.importorskip("cupy")
    rng = np.random.default_rng(3)
    o = rng.standard_normal((2, 300, 4, 96)).astype(np.float16)
    g = rng.standard_normal((2, 300, 4, 96)).astype(np.float16)
    stream = cupy.cuda.Stream(non_blocking=True)
    with stream:
        delta = api.backward_preprocess(cupy.asarray(g), cupy.asarray(o))
        seen = cupy.cuda.get_current_stream().ptr
    assert seen == stream.ptr
    stream.synchronize()
    np.testing.assert_allclose(delta.get(), reference.backward_preprocess(g.astype(np.float64), o.astype(np.float64)),
                               rtol=1e-5, atol=1e-5)


def test_jax_jit_runs_the_kernel_inside_xla():
    jax = pytest.importorskip("jax")
    jnp = jax.numpy
    gpu = jax.devices("gpu")[0]
    rng = np.random.default_rng(4)
    o = rng.standard_normal((3, 100, 2, 256)).astype(np.float16)
    g = rng.standard_normal((3, 100, 2, 256)).astype(np.float16)

    @jax.jit
    def f(dout, out):
        return api.backward_preprocess(dout * 2, out) + 1  # XLA work before and after the kernel

    compiled = f.lower(jax.device_put(g, gpu), jax.device_put(o, gpu)).compile()
    got = compiled(jax.device_put(g, gpu), jax.device_put(o, gpu))
    ref = reference.backward_preprocess(2 * g.astype(np.float64), o.astype(np.float64)) + 1
    np.testing.assert_allclose(np.asarray(got), ref, rtol=1e-5, atol=1e-4)
    assert jnp.asarray(got).dtype == jnp.float32


def test_gpu_attention_refuses_an_unsupported_head_dim_plainly():
    torch = _torch()
    q = torch.randn(1, 16, 2, 12, device="cuda", dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="attention_forward.*head dims that are multiples of 8.*got 12"):
        cuflash.attention(q, q, q)
