"""The differentiable entry points, cuflash.torch and cuflash.jax, on CPU: their gradients go
through the NumPy reference's backward, checked against finite differences in float64; they trace
under torch.compile (no graph break) and jax.jit, and jax.vmap folds mapped axes into the batch."""
import numpy as np
import pytest

from cuflash import reference

# deterministic only reaches the backward op (the reference is deterministic anyway): it must pass
# through the custom ops' schemas and autograd rules
FEATURES = [dict(), dict(causal=True, deterministic=True), dict(window=(3, 1), softcap=2.0),
            dict(causal=True, window=(2, -1), softmax_scale=0.4)]


def _rand(rng, *shape):
    return rng.standard_normal(shape)


# ----------------------------------------------------------------------------- torch

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("kw", FEATURES)
def test_torch_gradcheck_dense(kw):
    import cuflash.torch as ct

    rng = np.random.default_rng(1)
    q, k, v = (torch.tensor(_rand(rng, *s), requires_grad=True) for s in ((2, 5, 4, 8), (2, 7, 2, 8), (2, 7, 2, 8)))
    assert torch.autograd.gradcheck(lambda q, k, v: ct.attention(q, k, v, **kw), (q, k, v))


def test_torch_gradcheck_varlen():
    import cuflash.torch as ct

    rng = np.random.default_rng(2)
    cu_q, cu_k = torch.tensor([0, 3, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 6, 9], dtype=torch.int32)
    q, k, v = (torch.tensor(_rand(rng, *s), requires_grad=True) for s in ((8, 4, 8), (9, 2, 8), (9, 2, 8)))
    assert torch.autograd.gradcheck(
        lambda q, k, v: ct.attention_varlen(q, k, v, cu_q, cu_k, 5, 4, causal=True, deterministic=True), (q, k, v))


def test_torch_compile_has_no_graph_break_and_lse_is_not_differentiable():
    import cuflash.torch as ct

    rng = np.random.default_rng(3)
    q, k, v = (torch.tensor(_rand(rng, 2, 6, 2, 8), requires_grad=True) for _ in range(3))

    def loss(q, k, v):
        out, lse = ct.attention(q, k, v, causal=True, return_lse=True)
        return out.square().sum(), lse

    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)  # fullgraph: a break raises
    value, lse = compiled(q, k, v)
    assert not lse.requires_grad
    value.backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    loss(q, k, v)[0].backward()
    for got, want in zip(grads, (x.grad for x in (q, k, v))):
        torch.testing.assert_close(got, want)
    # symbolic shapes and floats (dynamic=True): the scalar checks trace there too
    dynamic = torch.compile(loss, backend="aot_eager", fullgraph=True, dynamic=True)
    torch.testing.assert_close(dynamic(q, k, v)[0], value)


def test_torch_eager_calls_run_the_plain_functions_and_tracers_see_the_ops():
    """Eager calls skip torch.library's custom-op layers (their host time: cuflash/torch.py): with
    autograd recording, the graph's node is the eager autograd.Function; make_fx, fake tensors and
    torch.compile see the custom ops, with the same gradient rule (varlen here; dense above)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    import cuflash.torch as ct

    rng = np.random.default_rng(4)
    cu_q, cu_k = torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32)
    q, k, v = (torch.tensor(_rand(rng, *s), requires_grad=True) for s in ((8, 4, 8), (9, 2, 8), (9, 2, 8)))

    def loss(q, k, v):
        return ct.attention_varlen(q, k, v, cu_q, cu_k, 5, 5, causal=True).square().sum()

    assert type(ct.attention(q[None], k[None], v[None]).grad_fn).__name__ == "_DenseAttentionBackward"
    assert type(loss(q, k, v).grad_fn.next_functions[0][0].next_functions[0][0]).__name__ == "_VarlenAttentionBackward"
    graph = make_fx(lambda q, k, v: ct.attention(q, k, v, causal=True))(q[None].detach(), k[None].detach(),
                                                                         v[None].detach())
    assert "cuflash.attention_fwd" in str(graph.graph)
    mode = FakeTensorMode()
    fake = [mode.from_tensor(x) for x in (q.detach(), k.detach(), v.detach(), cu_q, cu_k)]
    with mode:
        out = ct.attention_varlen(*fake, 5, 5)
    assert out.shape == q.shape
    compiled = torch.compile(loss, backend="aot_eager", fullgraph=True)
    compiled(q, k, v).backward()
    grads = [x.grad.clone() for x in (q, k, v)]
    for x in (q, k, v):
        x.grad = None
    loss(q, k, v).backward()
    for got, want in zip(grads, (x.grad for x in (q, k, v))):
        torch.testing.assert_close(got, want)


def test_torch_entry_points_refuse_bad_arguments_by_name():
    import cuflash.torch as ct

    x = torch.zeros(1, 2, 1, 8)
    with pytest.raises(TypeError, match="^q must be a torch.Tensor"):
        ct.attention(np.zeros((1, 2, 1, 8)), x, x)
    with pytest.raises(TypeError, match="^window must be a pair of ints"):
        ct.attention(x, x, x, window=3)
    cu = torch.tensor([0, 2], dtype=torch.int32)
    with pytest.raises(TypeError, match="^max_seqlen_q must be an int"):
        ct.attention_varlen(x[0], x[0], x[0], cu, cu, 2.0, 2)


def test_torch_fp8_ops_trace_under_compile_and_match_the_plain_functions():
    """cuflash.torch's FP8 entry points are custom ops: torch.compile(fullgraph=True) traces them,
    and their results are the framework-agnostic functions' (the reference's e4m3 simulation here)."""
    import cuflash
    import cuflash.torch as ct

    rng = np.random.default_rng(4)
    q = torch.tensor(_rand(rng, 2, 130, 4, 64), dtype=torch.bfloat16)
    k, v = (torch.tensor(_rand(rng, 2, 150, 2, 64), dtype=torch.bfloat16) for _ in range(2))
    wide = torch.tensor(_rand(rng, 1, 200, 2, 128), dtype=torch.bfloat16)  # k and v per 192 rows at head dim 128

    def run(quantize, attention_fp8, attention):
        (q8, qd), (k8, kd), (v8, vd) = (quantize(x, block=b, hadamard=h, seed=3) for x, b, h in
                                        ((q, 128, True), (k, 128, True), (v, None, False)))
        out, lse = attention_fp8(q8, k8, v8, qd, kd, vd, causal=True, window=(40, -1), out_dtype=torch.float16,
                                 return_lse=True)
        (w8, wd), (w8k, wdk) = quantize(wide, block=128), quantize(wide, block=192)
        out_wide = attention_fp8(w8, w8k, w8k, wd, wdk, wdk, kv_block=192)
        return (q8, qd, vd, out, lse, wdk, out_wide), attention(q, k, v, fp8=True, hadamard=True, window=(7, 3),
                                                                return_lse=True)

    want = run(cuflash.quantize_fp8, cuflash.attention_fp8, cuflash.attention)
    for dynamic in (False, True):  # dynamic: symbolic shapes (the head dim is read as a plain int)
        compiled = torch.compile(lambda: run(ct.quantize_fp8, ct.attention_fp8, ct.attention), backend="aot_eager",
                                 fullgraph=True, dynamic=dynamic)  # fullgraph: a break raises
        got = compiled()
        assert got[0][0].dtype == torch.float8_e4m3fn and got[0][1].shape == (2, 4, 2) and got[0][2].shape == (2, 2)
        assert got[0][3].dtype == torch.float16 and got[0][5].shape == (1, 2, 2) and got[0][6].shape == wide.shape
        assert got[1][0].dtype == torch.bfloat16 and got[1][1].shape == (2, 4, 130)
        for g, w in zip((*got[0], *got[1]), (*want[0], *want[1])):
            assert g.dtype == w.dtype and torch.equal(g.view(torch.uint8) if g.dtype == torch.float8_e4m3fn else g,
                                                      w.view(torch.uint8) if w.dtype == torch.float8_e4m3fn else w)


def test_torch_fp8_ops_fake_implementations_agree_with_the_real_ones():
    """torch.library.opcheck: each FP8 op's fake (what torch.compile traces with) gives the real op's
    shapes, dtypes and strides. (Its schema test runs ops on CPU float8 tensors, which torch cannot
    multiply: left out for attention_fp8_fwd.)"""
    import cuflash.torch as ct

    rng = np.random.default_rng(8)
    q = torch.tensor(_rand(rng, 1, 130, 4, 64), dtype=torch.bfloat16)
    k = torch.tensor(_rand(rng, 1, 70, 2, 64), dtype=torch.bfloat16)
    ops = torch.ops.cuflash
    for block, hadamard in ((None, False), (128, True)):
        torch.library.opcheck(ops.quantize_fp8.default, (q, block, hadamard, 3))
    wide = torch.tensor(_rand(rng, 1, 200, 2, 128), dtype=torch.bfloat16)
    torch.library.opcheck(ops.quantize_fp8.default, (wide, 192, True, 3))  # (1, 2, 2) descales
    (q8, qd), (k8, kd) = ct.quantize_fp8(q, block=128), ct.quantize_fp8(k)
    (w8, wd), (w8k, wdk) = ct.quantize_fp8(wide, block=128), ct.quantize_fp8(wide, block=192)
    for return_lse in (True, False):  # without it, an empty lse
        fast_exp = not return_lse  # (fast_exp needs return_lse=False)
        for args in ((q8, k8, k8, qd, kd, kd, True, 0.125, -1, -1, torch.float16, return_lse, 128, fast_exp),
                     (w8, w8k, w8k, wd, wdk, wdk, False, 0.125, -1, -1, torch.bfloat16, return_lse, 192, False)):
            torch.library.opcheck(ops.attention_fp8_fwd.default, args, test_utils=(
                "test_faketensor", "test_aot_dispatch_dynamic", "test_autograd_registration"))
        torch.library.opcheck(ops.attention_quantized_fwd.default,
                              (q, k, k, True, 0.125, 5, -1, 0.0, True, fast_exp, return_lse))


def test_torch_fp8_entry_points_are_forward_only_and_refuse_bad_arguments_by_name():
    import cuflash.torch as ct

    q = torch.zeros(1, 4, 2, 64, dtype=torch.bfloat16, requires_grad=True)
    with pytest.raises(ValueError, match=r"^attention\(\.\.\., fp8=True\) is forward only"):
        ct.attention(q, q, q, fp8=True)
    with pytest.raises(ValueError, match="^quantize_fp8 is forward only"):
        ct.quantize_fp8(q)
    with torch.no_grad():
        assert ct.attention(q, q, q, fp8=True).shape == q.shape  # no grad mode: allowed
        with pytest.raises(ValueError, match="^deterministic=True is about the backward"):
            ct.attention(q, q, q, fp8=True, deterministic=True)
        with pytest.raises(ValueError, match="^hadamard=True .* needs fp8=True"):
            ct.attention(q, q, q, hadamard=True)
        with pytest.raises(ValueError, match="^fast_exp=True .* needs return_lse=False"):
            ct.attention(q, q, q, fp8=True, fast_exp=True, return_lse=True)
        with pytest.raises(ValueError, match="^block must be None"):
            ct.quantize_fp8(q, block=64)
        with pytest.raises(TypeError, match="^block must be None"):  # not cast to 1 by the op's schema
            ct.quantize_fp8(q, block=True)
        with pytest.raises(TypeError, match="^seed must be an int >= 0"):
            ct.quantize_fp8(q, seed=True)
        with pytest.raises(ValueError, match="^seed must be below 2\\*\\*63"):
            ct.quantize_fp8(q, seed=2**70)
        with pytest.raises(TypeError, match="^x must be a torch.Tensor"):
            ct.quantize_fp8(np.zeros((1, 4, 2, 64)))
        q8, qd = ct.quantize_fp8(q)
        with pytest.raises(TypeError, match="^out_dtype must be one of"):
            ct.attention_fp8(q8, q8, q8, qd, qd, qd, out_dtype=torch.float32)
        with pytest.raises(ValueError, match="^kv_block must be 128 or 192"):
            ct.attention_fp8(q8, q8, q8, qd, qd, qd, kv_block=64)
        with pytest.raises(TypeError, match="^kv_block must be 128 or 192"):  # not cast to 1 by the op's schema
            ct.attention_fp8(q8, q8, q8, qd, qd, qd, kv_block=True)
        with pytest.raises(TypeError, match="^q8 must be float8_e4m3fn"):
            ct.attention_fp8(q.detach(), q8, q8, qd, qd, qd)
        with pytest.raises(TypeError, match="^q8 must be a torch.Tensor"):
            ct.attention_fp8(np.zeros((1, 4, 2, 64)), q8, q8, qd, qd, qd)
    with pytest.raises(ValueError, match="^attention_fp8 is forward only"):  # a descale autograd would follow
        ct.attention_fp8(q8, q8, q8, qd, qd, qd.clone().requires_grad_())


# ----------------------------------------------------------------------------- jax

jax = pytest.importorskip("jax")


@pytest.fixture
def x64():
    jax.config.update("jax_enable_x64", True)
    yield
    jax.config.update("jax_enable_x64", False)


@pytest.mark.parametrize("kw", FEATURES)
def test_jax_check_grads_dense(kw, x64):
    from jax.test_util import check_grads

    import cuflash.jax as cj

    rng = np.random.default_rng(4)
    args = tuple(jax.numpy.asarray(_rand(rng, *s)) for s in ((2, 5, 4, 8), (2, 7, 2, 8), (2, 7, 2, 8)))
    check_grads(lambda q, k, v: cj.attention(q, k, v, **kw), args, order=1, modes=["rev"])


def test_jax_check_grads_varlen_and_jit(x64):
    from jax.test_util import check_grads

    import cuflash.jax as cj

    rng = np.random.default_rng(5)
    cu_q, cu_k = np.array([0, 3, 3, 8], np.int32), np.array([0, 4, 6, 9], np.int32)
    args = tuple(jax.numpy.asarray(_rand(rng, *s)) for s in ((8, 4, 8), (9, 2, 8), (9, 2, 8)))
    f = lambda q, k, v: cj.attention_varlen(q, k, v, cu_q, cu_k, 5, 4, causal=True, deterministic=True)
    check_grads(f, args, order=1, modes=["rev"])
    eager = jax.grad(lambda q: f(q, *args[1:]).sum())(args[0])
    jitted = jax.jit(jax.grad(lambda q: f(q, *args[1:]).sum()))(args[0])
    np.testing.assert_allclose(np.asarray(jitted), np.asarray(eager), rtol=1e-12, atol=1e-12)


def test_jax_vmap_folds_into_the_batch(x64):
    import cuflash.jax as cj

    rng = np.random.default_rng(6)
    qs = jax.numpy.asarray(_rand(rng, 3, 2, 5, 4, 8))  # mapped over the first axis; k, v shared
    k, v = (jax.numpy.asarray(_rand(rng, 2, 7, 2, 8)) for _ in range(2))
    out = jax.vmap(lambda q: cj.attention(q, k, v, causal=True))(qs)
    want = np.stack([reference.forward(np.asarray(q), np.asarray(k), np.asarray(v), causal=True)[0] for q in qs])
    np.testing.assert_allclose(np.asarray(out), want, rtol=1e-12, atol=1e-12)
    grad = lambda q: jax.grad(lambda q: cj.attention(q, k, v).sum())(q)
    np.testing.assert_allclose(np.asarray(jax.jit(jax.vmap(grad))(qs)), np.stack([np.asarray(grad(q)) for q in qs]),
                               rtol=1e-12, atol=1e-12)
    # nested vmap (two mapped axes) and a mapped varlen call (run once per element)
    nested = jax.vmap(jax.vmap(lambda q: cj.attention(q, k, v)))(qs.reshape(3, 1, 2, 5, 4, 8))
    np.testing.assert_allclose(np.asarray(nested).reshape(out.shape),
                               np.stack([reference.forward(np.asarray(q), np.asarray(k), np.asarray(v))[0] for q in qs]),
                               rtol=1e-12, atol=1e-12)
    cu = np.array([0, 3, 7], np.int32)
    qv = jax.numpy.asarray(_rand(rng, 2, 7, 4, 8))
    kv = jax.numpy.asarray(_rand(rng, 7, 2, 8))
    got = jax.vmap(lambda q: cj.attention_varlen(q, kv, kv, cu, cu, 4, 4))(qv)
    want = np.stack([reference.varlen_forward(np.asarray(q), np.asarray(kv), np.asarray(kv), cu, cu)[0] for q in qv])
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-12, atol=1e-12)


def test_jax_fp8_true_is_the_plain_functions_forward_and_refuses_grad():
    """cuflash.jax.attention(fp8=True): cuflash.attention(fp8=True)'s results (eager and under
    jax.jit), and jax.grad through it refuses by name rather than differentiating the quantizer."""
    import cuflash
    import cuflash.jax as cj

    rng = np.random.default_rng(7)
    q, k, v = (jax.numpy.asarray(_rand(rng, 1, 40, 2, 64), dtype=jax.numpy.bfloat16) for _ in range(3))
    kw = dict(causal=True, fp8=True, hadamard=True, return_lse=True)
    want = cuflash.attention(q, k, v, **kw)
    for got in (cj.attention(q, k, v, **kw), jax.jit(lambda q, k, v: cj.attention(q, k, v, **kw))(q, k, v)):
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and np.array_equal(np.asarray(g), np.asarray(w))
    with pytest.raises(ValueError, match=r"^attention\(\.\.\., fp8=True\) is forward only"):
        jax.grad(lambda q: cj.attention(q, k, v, fp8=True).astype(jax.numpy.float32).sum())(q)
    with pytest.raises(ValueError, match="^deterministic=True is about the backward"):
        cj.attention(q, k, v, fp8=True, deterministic=True)
    with pytest.raises(ValueError, match="^hadamard=True .* needs fp8=True"):
        cj.attention(q, k, v, hadamard=True)
    with pytest.raises(ValueError, match="^fast_exp=True .* needs fp8=True"):
        cj.attention(q, k, v, fast_exp=True)
