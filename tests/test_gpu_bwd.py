"""bwd_sm80 and bwd_sm90 (Hopper) on the GPU: gradients against the float32 reference from the same fp16/bf16 inputs, by
FlashAttention's criterion (each of dq, dk, dv: max abs error at most 2x that of a plain
low-precision implementation, plus 1e-4); NaN never passes; outputs poisoned before the call.
Dense and varlen, every compiled head dim and padded ones between, deterministic mode bit-identical."""
import dataclasses
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import arrays, dispatch, reference
from cuflash import kernels
from cuflash.kernels import bwd_sm80
from cuflash.problem import Problem

pytestmark = pytest.mark.gpu
gpu_attention = pytest.importorskip("gpu_attention_reference")

# compiled head dims, and multiples of 8 between them that run padded
HEADDIMS = [32, 64, 96, 128, 160, 192, 224, 256, 40, 80, 136, 200]
SM90_HEADDIMS = [64, 128, 256, 8, 32, 40, 96, 120, 136, 192, 200]  # bwd_sm90 compiles 64, 128 and 256


def _grads(q, k, v, dout, compute_dtype, kw):
    leaves = [x.detach().to(compute_dtype).requires_grad_() for x in (q, k, v)]
    out, _ = gpu_attention.attention(*leaves, compute_dtype=compute_dtype, **kw)
    out.backward(dout.to(out.dtype))
    return [x.grad.float() for x in leaves]


def _check(got: dict, ref, low, dtype):
    for name, g, want, plain in zip(("dq", "dk", "dv"), (got[n] for n in ("dq", "dk", "dv")), ref, low):
        assert not torch.isnan(g).any(), f"NaN (or an unwritten, poisoned element) in {name}"
        if not g.numel():
            continue
        err = (g.float() - want).abs().max().item()
        plain_err = (plain - want).abs().max().item()
        assert err <= 2 * plain_err + 1e-4, f"{name}: max error {err:.3g} vs plain {dtype} {plain_err:.3g}"


def _poisoned(problem, dtype, **shapes):
    """The gradients and the kernels' workspace, every element garbage (NaN, or a bad semaphore
    count): what the launcher must zero or write, it must."""
    buffers = {n: torch.full(s, float("nan"), device="cuda", dtype=dtype) for n, s in shapes.items()}
    for name, (shape, dt) in kernels.workspace(problem).items():
        dt = getattr(torch, dt)
        buffers[name] = torch.full(shape, 12345 if dt == torch.int32 else float("nan"), device="cuda", dtype=dt)
    return buffers


def _randn(g, dtype, *shape):
    return torch.randn(*shape, device="cuda", generator=g).to(dtype)


def _requires_hopper():
    if torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("bwd_sm90 needs compute capability 9.0")


_DENSE = dict(dtype=st.sampled_from([torch.float16, torch.bfloat16]), batch=st.integers(1, 3),
              seqlen_q=st.sampled_from([1, 7, 64, 65, 127, 200, 333]),
              seqlen_k=st.sampled_from([1, 9, 64, 100, 129, 256, 401]), nheads_kv=st.integers(1, 2),
              group=st.sampled_from([1, 2, 4]), causal=st.booleans(), left=st.sampled_from([-1, 0, 17, 100]),
              right=st.sampled_from([-1, -1, 0, 9]), softcap=st.sampled_from([0.0, 0.0, 5.0]),
              seed=st.integers(0, 2**31 - 1))


@settings(max_examples=160)
@given(headdim=st.sampled_from(HEADDIMS), deterministic=st.booleans(), **_DENSE)
def test_backward_matches_reference(dtype, headdim, batch, seqlen_q, seqlen_k, nheads_kv, group, causal, left,
                                    right, softcap, deterministic, seed):
    _dense_backward("sm80", dtype, headdim, batch, seqlen_q, seqlen_k, nheads_kv, group, causal, left, right,
                    softcap, deterministic, seed)


@settings(max_examples=200)
@given(headdim=st.sampled_from(SM90_HEADDIMS), **_DENSE)
def test_sm90_backward_matches_reference(dtype, headdim, batch, seqlen_q, seqlen_k, nheads_kv, group, causal, left,
                                         right, softcap, seed):
    _requires_hopper()
    _dense_backward("sm90", dtype, headdim, batch, seqlen_q, seqlen_k, nheads_kv, group, causal, left, right,
                    softcap, False, seed)


def _dense_backward(backend, dtype, headdim, batch, seqlen_q, seqlen_k, nheads_kv, group, causal, left, right,
                    softcap, deterministic, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nheads = nheads_kv * group
    q = _randn(g, dtype, batch, seqlen_q, nheads, headdim)
    k, v = (_randn(g, dtype, batch, seqlen_k, nheads_kv, headdim) for _ in range(2))
    dout = _randn(g, dtype, batch, seqlen_q, nheads, headdim)
    window = (left, -1 if causal else right)  # a right bound beyond 0 contradicts causal
    kw = dict(causal=causal, window=window, softcap=softcap, softmax_scale=None)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    left_b, right_b = reference.window_bounds(causal, window)
    problem = Problem(op="attention_backward", framework="torch", device=arrays.Device("cuda", 0),
                      dtype=str(dtype).removeprefix("torch."), batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                      nheads=nheads, nheads_kv=nheads_kv, headdim=headdim, causal=causal, window_left=left_b,
                      window_right=right_b, softmax_scale=1 / math.sqrt(headdim), softcap=softcap,
                      deterministic=deterministic, backend=backend)
    grads = _poisoned(problem, dtype, dq=q.shape, dk=k.shape, dv=v.shape)
    dispatch.execute(problem, dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse), grads,
                     torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    _check(grads, _grads(q, k, v, dout, torch.float32, kw), _grads(q, k, v, dout, dtype, kw), dtype)


_VARLEN = dict(dtype=st.sampled_from([torch.float16, torch.bfloat16]),
               lens=st.lists(st.tuples(st.integers(0, 300), st.integers(0, 300)), min_size=1, max_size=4),
               nheads_kv=st.integers(1, 2), group=st.sampled_from([1, 2]), causal=st.booleans(),
               left=st.sampled_from([-1, 5, 60]), right=st.sampled_from([-1, -1, 0, 9]), softcap=st.sampled_from([0.0, 3.0]),
               seed=st.integers(0, 2**31 - 1))


@settings(max_examples=60)
@given(headdim=st.sampled_from([64, 128, 256, 80]), deterministic=st.booleans(), **_VARLEN)
def test_varlen_backward_matches_per_sequence_reference(dtype, headdim, lens, nheads_kv, group, causal, left,
                                                        right, softcap, deterministic, seed):
    _varlen_backward("sm80", dtype, headdim, lens, nheads_kv, group, causal, left, right, softcap, deterministic, seed)


@settings(max_examples=80)
@given(headdim=st.sampled_from([64, 128, 256, 80, 32, 192]), **_VARLEN)
def test_sm90_varlen_backward_matches_per_sequence_reference(dtype, headdim, lens, nheads_kv, group, causal, left,
                                                             right, softcap, seed):
    _requires_hopper()
    # TMA cannot describe an empty q or k: bwd_sm90 refuses those (bwd_sm80 serves them, tested above)
    assume(sum(a for a, _ in lens) and sum(b for _, b in lens))
    _varlen_backward("sm90", dtype, headdim, lens, nheads_kv, group, causal, left, right, softcap, False, seed)


def _varlen_backward(backend, dtype, headdim, lens, nheads_kv, group, causal, left, right, softcap, deterministic,
                     seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nheads = nheads_kv * group
    total_q, total_k = sum(a for a, _ in lens), sum(b for _, b in lens)
    q, dout = (_randn(g, dtype, total_q, nheads, headdim) for _ in range(2))
    k, v = (_randn(g, dtype, total_k, nheads_kv, headdim) for _ in range(2))
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(x).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
                  for x in zip(*lens))
    max_q, max_k = max(a for a, _ in lens), max(b for _, b in lens)
    window = (left, -1 if causal else right)  # a right bound beyond 0 contradicts causal
    kw = dict(causal=causal, window=window, softcap=softcap, softmax_scale=None)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, return_lse=True, **kw)
    dense = Problem(op="attention_varlen_backward", framework="torch", device=arrays.Device("cuda", 0),
                    dtype=str(dtype).removeprefix("torch."), batch=len(lens), seqlen_q=max_q, seqlen_k=max_k,
                    nheads=nheads, nheads_kv=nheads_kv, headdim=headdim, total_q=total_q, total_k=total_k)
    left_b, right_b = reference.window_bounds(causal, window)
    problem = dataclasses.replace(dense, causal=causal, window_left=left_b, window_right=right_b,
                                  softmax_scale=1 / math.sqrt(headdim), softcap=softcap, deterministic=deterministic,
                                  backend=backend)
    grads = _poisoned(problem, dtype, dq=q.shape, dk=k.shape, dv=v.shape)
    dispatch.execute(problem, dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k),
                     grads, torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    ref, low = [[], [], []], [[], [], []]
    for b, (sq, sk) in enumerate(lens):
        rows_q, rows_k = slice(cu_q[b].item(), cu_q[b + 1].item()), slice(cu_k[b].item(), cu_k[b + 1].item())
        xs = [x[None, r] for x, r in ((q, rows_q), (k, rows_k), (v, rows_k), (dout, rows_q))]
        for acc, compute in ((ref, torch.float32), (low, dtype)):
            if sq and sk:
                for a, grad in zip(acc, _grads(*xs, compute, kw)):
                    a.append(grad[0])
            else:  # an empty sequence has zero gradients (torch's softmax of nothing is NaN)
                for a, x in zip(acc, xs):
                    a.append(torch.zeros(x.shape[1:], device="cuda"))
    _check(grads, *([torch.cat(parts) for parts in acc] for acc in (ref, low)), dtype)


@pytest.mark.parametrize("headdim, causal, group", [(64, False, 1), (128, True, 2), (256, False, 4), (96, True, 1)])
def test_deterministic_gradients_are_bit_identical(headdim, causal, group):
    """Many key blocks add to each query block's dq: with deterministic=True their order is fixed, so
    three runs agree bit for bit (and each is correct)."""
    g = torch.Generator(device="cuda").manual_seed(headdim)
    q, dout = (_randn(g, torch.bfloat16, 2, 1000, 2 * group, headdim) for _ in range(2))
    k, v = (_randn(g, torch.bfloat16, 2, 1100, 2, headdim) for _ in range(2))
    out, lse = cuflash.attention(q, k, v, causal=causal, return_lse=True)
    runs = [cuflash.attention_backward(dout, q, k, v, out, lse, causal=causal, deterministic=True) for _ in range(3)]
    for run in runs[1:]:
        for a, b in zip(runs[0], run):
            assert torch.equal(a, b)
    kw = dict(causal=causal, window=(-1, -1), softcap=0.0, softmax_scale=None)
    _check(dict(zip(("dq", "dk", "dv"), runs[0])), _grads(q, k, v, dout, torch.float32, kw),
           _grads(q, k, v, dout, torch.bfloat16, kw), torch.bfloat16)


@pytest.mark.parametrize("headdim, tiles", [(hd, t) for hd, rows in bwd_sm80.TILES.items() for t in rows])
def test_every_tile_row(headdim, tiles, monkeypatch, fresh_plans):
    """Each row of the tile table, the fallbacks for GPUs with less shared memory included (forced
    here): GQA, a window, ragged tails, deterministic and not."""
    monkeypatch.setattr(bwd_sm80, "tiles_override", {headdim: tiles})
    g = torch.Generator(device="cuda").manual_seed(headdim)
    q, dout = (_randn(g, torch.float16, 2, 150, 4, headdim) for _ in range(2))
    k, v = (_randn(g, torch.float16, 2, 170, 2, headdim) for _ in range(2))
    kw = dict(causal=True, window=(90, -1), softcap=0.0, softmax_scale=None)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    ref, low = _grads(q, k, v, dout, torch.float32, kw), _grads(q, k, v, dout, torch.float16, kw)
    for deterministic in (False, True):
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, **kw, deterministic=deterministic, backend="sm80")
        _check(dict(zip(("dq", "dk", "dv"), grads)), ref, low, torch.float16)


@pytest.mark.parametrize("headdim, dq_buffers", [(64, 0), (64, 1), (64, 2), (128, 0), (128, 1), (256, 0), (256, 1)])
def test_sm90_every_dq_path(headdim, dq_buffers, monkeypatch, fresh_plans):
    """bwd_sm90's ways of adding dQ (DQ_BUFFERS: the consumers' own reductions, or staged for bulk
    reductions in one or two buffers), each forced: GQA, a window, ragged tails, more query tiles
    than Q/dO slots and dQ buffers."""
    _requires_hopper()
    from cuflash.kernels import bwd_sm90

    monkeypatch.setitem(bwd_sm90.DQ_BUFFERS, headdim, dq_buffers)
    g = torch.Generator(device="cuda").manual_seed(headdim + dq_buffers)
    q, dout = (_randn(g, torch.bfloat16, 2, 450, 4, headdim) for _ in range(2))
    k, v = (_randn(g, torch.bfloat16, 2, 270, 2, headdim) for _ in range(2))
    kw = dict(causal=True, window=(200, -1), softcap=0.0, softmax_scale=None)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **kw, backend="sm90")
    _check(dict(zip(("dq", "dk", "dv"), grads)), _grads(q, k, v, dout, torch.float32, kw),
           _grads(q, k, v, dout, torch.bfloat16, kw), torch.bfloat16)


def test_sm90_strided_inputs_and_lse_layouts():
    """bwd_sm90 with q and dout as strided views (different strides) and lse padded per row; an lse
    with a negative stride, which its TMA map cannot index, is refused by name when bwd_sm90 is forced
    and served by bwd_sm80 otherwise."""
    _requires_hopper()
    import cupy

    g = torch.Generator(device="cuda").manual_seed(7)
    q = _randn(g, torch.bfloat16, 2, 300, 6, 128)[:, :, 1:5]
    dout = _randn(g, torch.bfloat16, 2, 300, 8, 128)[:, :, ::2]
    k, v = (_randn(g, torch.bfloat16, 2, 260, 2, 128) for _ in range(2))
    kw = dict(causal=True, window=(-1, -1), softcap=0.0, softmax_scale=None)
    out, lse = cuflash.attention(q, k, v, return_lse=True, causal=True)
    ref, low = _grads(q, k, v, dout, torch.float32, kw), _grads(q, k, v, dout, torch.bfloat16, kw)
    padded = torch.full((2, 4, 320), float("nan"), device="cuda")
    padded[..., :300] = lse
    grads = cuflash.attention_backward(dout, q, k, v, out, padded[..., :300], causal=True, backend="sm90")
    _check(dict(zip(("dq", "dk", "dv"), grads)), ref, low, torch.bfloat16)
    cq, ck, cv, cdout, cout = (cupy.from_dlpack(x) for x in (q, k, v, dout, out))
    reversed_heads = cupy.ascontiguousarray(cupy.from_dlpack(lse)[:, ::-1])[:, ::-1]  # lse's values, head stride < 0
    with pytest.raises(NotImplementedError, match="lse"):
        cuflash.attention_backward(cdout, cq, ck, cv, cout, reversed_heads, causal=True, backend="sm90")
    grads = cuflash.attention_backward(cdout, cq, ck, cv, cout, reversed_heads, causal=True)
    _check(dict(zip(("dq", "dk", "dv"), (torch.from_dlpack(x) for x in grads))), ref, low, torch.bfloat16)


@pytest.mark.parametrize("deterministic", [True, False])
def test_torch_autograd_runs_the_backward_kernel(deterministic):
    """Through autograd: bwd_sm80 (deterministic), and on Hopper bwd_sm90 (the default)."""
    import cuflash.torch as ct

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 300, 4, 128, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    ct.attention(q, k, v, causal=True, deterministic=deterministic).float().square().sum().backward()
    want = _grads(q, k, v, 2 * ct.attention(q, k, v, causal=True).detach().float(), torch.float32,
                  dict(causal=True, window=(-1, -1), softcap=0.0, softmax_scale=None))
    for got, w in zip((q.grad, k.grad, v.grad), want):
        assert (got.float() - w).abs().max().item() < 0.05 * w.abs().max().item() + 1e-3


def _captured(step):
    """A CUDA graph of step() and the output its capture returned (contents written by replays):
    warmed up on a side stream first, so that kernels are compiled and loaded before the capture."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = step()
    return graph, out


@pytest.mark.parametrize("deterministic", [True, False])
def test_torch_cuda_graph_captures_forward_and_backward(deterministic):
    """A training step's attention, forward and backward, captured in a CUDA graph: every buffer
    (outputs and workspace) comes from torch's allocator, every launch goes to the capturing
    stream. A replay on new inputs equals an eager step: bit for bit with the deterministic backward
    (bwd_sm80), within a rounding of the order dq's parts are added in otherwise (bwd_sm90 on
    Hopper, whose TMA descriptors the graph holds by value)."""
    import cuflash.torch as ct

    g = torch.Generator(device="cuda").manual_seed(2)
    q, k, v = (torch.randn(2, 333, 4, 128, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn(q.shape, device="cuda", generator=g, dtype=torch.bfloat16)

    def step():
        for x in (q, k, v):
            x.grad = None
        out = ct.attention(q, k, v, causal=True, deterministic=deterministic)
        out.backward(dout)
        return out

    graph, out = _captured(step)
    with torch.no_grad():
        for x in (q, k, v):
            x.copy_(torch.randn(x.shape, device="cuda", generator=g, dtype=x.dtype))
    graph.replay()
    torch.cuda.synchronize()
    captured = [out.detach().clone()] + [x.grad.clone() for x in (q, k, v)]
    eager = step()
    for got, want in zip(captured, [eager] + [x.grad for x in (q, k, v)]):
        if deterministic or got is captured[0]:  # the forward is deterministic either way
            assert torch.equal(got, want)
        else:
            assert (got.float() - want.float()).abs().max().item() <= 1e-2 * want.float().abs().max().item()


def test_torch_cuda_graph_captures_a_varlen_training_step():
    """attention_varlen's cu_seqlens are checked on the GPU (kernels/check_cu_seqlens.py), never copied
    to the host: a CUDA graph captures a packed step, forward and backward, and a replay with other
    lengths written into the same cu_seqlens buffers computes those lengths, as an eager step does."""
    import cuflash.torch as ct

    g = torch.Generator(device="cuda").manual_seed(3)
    total, nheads, headdim = 700, 4, 128
    q, k, v = (torch.randn(total, nheads, headdim, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    dout = torch.randn(q.shape, device="cuda", generator=g, dtype=torch.bfloat16)
    cu_seqlens = torch.tensor([0, 100, 350, 700], device="cuda", dtype=torch.int32)
    max_seqlen = 400  # bounds every packing below

    def step():
        for x in (q, k, v):
            x.grad = None
        out = ct.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)
        out.backward(dout)
        return out

    graph, out = _captured(step)
    graph.replay()  # (the capture ran nothing)
    captured_before = out.detach().clone()
    cu_seqlens.copy_(torch.tensor([0, 300, 310, 700], dtype=torch.int32))
    graph.replay()
    torch.cuda.synchronize()
    captured = [out.detach().clone()] + [x.grad.clone() for x in (q, k, v)]
    eager = step()
    for got, want in zip(captured, [eager] + [x.grad for x in (q, k, v)]):
        assert not torch.isnan(got).any()
        assert (got.float() - want.float()).abs().max().item() <= 1e-2 * want.float().abs().max().item()
    assert (captured[0].float() - captured_before.float()).abs().max().item() > 0.1  # the lengths did matter


# Bad cu_seqlens on the GPU stop the program (a device-side assertion ahead of the attention kernel),
# so each case runs in a process of its own: (framework, call, (argument: value), the message printed).
_VALID = dict(cu_seqlens_q=[0, 4, 9], cu_seqlens_k=[0, 5, 11], max_seqlen_q=5, max_seqlen_k=6)
_BAD_CU_SEQLENS = [
    ("torch", "forward", dict(cu_seqlens_q=[0, 10, 9]), "cuflash.attention_varlen: cu_seqlens_q must be "
     "non-decreasing; cu_seqlens_q[2] = 9 < cu_seqlens_q[1] = 10"),
    ("torch", "backward", dict(cu_seqlens_k=[0, 5, 12]), "cuflash.attention_varlen_backward: cu_seqlens_k[-1] = 12 "
     "must equal the packed length 11"),
    ("cupy", "forward", dict(cu_seqlens_k=[1, 5, 11]), "cuflash.attention_varlen: cu_seqlens_k must start at 0; got 1"),
    ("torch", "forward", dict(max_seqlen_q=4), "cuflash.attention_varlen: max_seqlen_q = 4 is smaller than the "
     "longest sequence in cu_seqlens_q (5)"),
    ("jax-jit", "forward", dict(cu_seqlens_q=[0, 4, 8]), "cuflash.attention_varlen: cu_seqlens_q[-1] = 8 must equal "
     "the packed length 9"),
    ("torch", "autograd", dict(cu_seqlens_q=[0, 4, 9, 3, 9], cu_seqlens_k=[0, 5, 11, 11, 11]),
     "cuflash.attention_varlen: cu_seqlens_q must be non-decreasing; cu_seqlens_q[3] = 3 < cu_seqlens_q[2] = 9"),
    # 600 sequences, most of them empty: the first of two decreasing steps, past the kernel's 256 threads
    ("torch", "many", dict(cu_seqlens_q=[0] * 450 + [4, 3] + [9] * 48 + [2] + [9] * 100,
                           cu_seqlens_k=[0] + [5] * 599 + [11]),
     "cuflash.attention_varlen: cu_seqlens_q must be non-decreasing; cu_seqlens_q[451] = 3 < cu_seqlens_q[450] = 4"),
]
_BAD_CU_SEQLENS_SCRIPT = """
import ctypes, json, sys
import torch, cuflash, cuflash.torch
framework, call, changes = json.loads(sys.argv[1])
a = dict(json.loads(sys.argv[2]), **changes)
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(n, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16) for n in (9, 11, 11))
cu = {n: torch.tensor(a[n], device="cuda", dtype=torch.int32) for n in ("cu_seqlens_q", "cu_seqlens_k")}
good = (torch.tensor(c, device="cuda", dtype=torch.int32) for c in ([0, 4, 9], [0, 5, 11]))
out, lse = cuflash.attention_varlen(q, k, v, *good, 5, 6, return_lse=True)  # a good call first, in this process
torch.cuda.synchronize()
args = (cu["cu_seqlens_q"], cu["cu_seqlens_k"], a["max_seqlen_q"], a["max_seqlen_k"])
try:
    if framework == "cupy":
        import cupy
        cuflash.attention_varlen(*(cupy.from_dlpack(x) for x in (q, k, v, *args[:2])), *args[2:])
        cupy.cuda.get_current_stream().synchronize()
    elif framework == "jax-jit":
        import jax
        xs = [jax.dlpack.from_dlpack(x) for x in (q, k, v, *args[:2])]
        jax.block_until_ready(jax.jit(lambda *xs: cuflash.attention_varlen(*xs, *args[2:]))(*xs))
    elif call in ("forward", "many"):
        cuflash.attention_varlen(q, k, v, *args)
    elif call == "backward":
        cuflash.attention_varlen_backward(torch.ones_like(out), q, k, v, out, lse, *args)
    else:
        q.requires_grad_()
        cuflash.torch.attention_varlen(q, k, v, *args).float().sum().backward()
    torch.cuda.synchronize()
    print("RETURNED")
finally:
    ctypes.CDLL(None).fflush(None)  # the device's printf went to C's stdout buffer
"""


@pytest.mark.parametrize("framework, call, changes, message", _BAD_CU_SEQLENS,
                         ids=[f"{c[0]}-{c[1]}-{next(iter(c[2]))}" for c in _BAD_CU_SEQLENS])
def test_bad_gpu_cu_seqlens_stop_the_program_with_their_message(framework, call, changes, message):
    """GPU cu_seqlens are checked by a kernel queued ahead of the attention kernel (no host copy, no
    synchronisation): a broken rule is printed, with reference.check_cu_seqlens' words, and a
    device-side assertion stops the program before the attention kernel reads them."""
    import json
    import subprocess
    import sys

    if framework == "jax-jit":
        jax = pytest.importorskip("jax")
        if jax.default_backend() != "gpu":
            pytest.skip("JAX has no GPU backend here")
    if framework == "cupy":
        pytest.importorskip("cupy")
    result = subprocess.run([sys.executable, "-c", _BAD_CU_SEQLENS_SCRIPT, json.dumps([framework, call, changes]),
                             json.dumps(_VALID)], capture_output=True, text=True, timeout=300)
    assert "RETURNED" not in result.stdout and result.returncode != 0, (result.stdout, result.stderr[-2000:])
    assert message in result.stdout, (result.stdout, result.stderr[-2000:])
    assert "assert" in (result.stdout + result.stderr).lower(), result.stderr[-2000:]


def test_jax_grad_runs_the_backward_kernel():
    jax = pytest.importorskip("jax")
    import cuflash.jax as cj

    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    g = torch.Generator(device="cuda").manual_seed(1)
    tq, tk, tv = (torch.randn(2, 200, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    q, k, v = (jax.dlpack.from_dlpack(x) for x in (tq, tk, tv))
    loss = lambda q, k, v: jax.numpy.square(cj.attention(q, k, v, causal=True).astype(jax.numpy.float32)).sum()
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    leaves = [x.detach().float().requires_grad_() for x in (tq, tk, tv)]
    out, _ = gpu_attention.attention(*leaves, compute_dtype=torch.float32, causal=True)
    out.square().sum().backward()
    for got, w in zip(grads, leaves):
        got = torch.from_dlpack(got).float()
        assert (got - w.grad).abs().max().item() < 0.05 * w.grad.abs().max().item() + 1e-3


def test_jax_varlen_runs_the_gpu_kernels():
    """cuflash.jax.attention_varlen under jax.jit and jax.grad on GPU arrays: the kernels torch's call
    runs, with the sequences cu_seqlens give (the callback once took q's packed rows for the batch,
    and the kernels read cu_seqlens past their end)."""
    jax = pytest.importorskip("jax")
    import cuflash.jax as cj
    import cuflash.torch as ct

    if jax.default_backend() != "gpu":
        pytest.skip("JAX has no GPU backend here")
    g = torch.Generator(device="cuda").manual_seed(4)
    cu_q = torch.tensor([0, 100, 100, 333], device="cuda", dtype=torch.int32)
    cu_k = torch.tensor([0, 50, 290, 400], device="cuda", dtype=torch.int32)
    tq = torch.randn(333, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16)
    tk, tv = (torch.randn(400, 2, 64, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    q, k, v, cq, ck = (jax.dlpack.from_dlpack(x) for x in (tq, tk, tv, cu_q, cu_k))
    attend = lambda q, k, v: cj.attention_varlen(q, k, v, cq, ck, 233, 240, causal=True)  # noqa: E731
    out = jax.jit(attend)(q, k, v)
    want = cuflash.attention_varlen(tq, tk, tv, cu_q, cu_k, 233, 240, causal=True)
    assert torch.equal(torch.from_dlpack(out), want)
    loss = lambda q, k, v: jax.numpy.square(attend(q, k, v).astype(jax.numpy.float32)).sum()  # noqa: E731
    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    leaves = [x.detach().clone().requires_grad_() for x in (tq, tk, tv)]
    ct_out = ct.attention_varlen(*leaves, cu_q, cu_k, 233, 240, causal=True)
    ct_out.float().square().sum().backward()
    for got, leaf in zip(grads, leaves):
        got, w = torch.from_dlpack(got).float(), leaf.grad.float()
        assert not torch.isnan(got).any() and (got - w).abs().max().item() <= 1e-2 * w.abs().max().item()


@pytest.mark.parametrize("backend", ["sm80", "sm90"])
def test_repeated_calls_read_each_calls_arrays(backend):
    """The backward's calls after the first with arrays laid out alike skip the checks and reuse
    the prepared launch (dispatch.run_checked): each must read its own arrays."""
    if backend == "sm90":
        _requires_hopper()
    g = torch.Generator(device="cuda").manual_seed(5)
    kw = dict(causal=True, window=(-1, -1), softcap=0.0, softmax_scale=None)
    for _ in range(3):
        q, dout = (_randn(g, torch.bfloat16, 2, 200, 4, 64) for _ in range(2))
        k, v = (_randn(g, torch.bfloat16, 2, 260, 2, 64) for _ in range(2))
        out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
        grads = cuflash.attention_backward(dout, q, k, v, out, lse, **kw, backend=backend)
        _check(dict(zip(("dq", "dk", "dv"), grads)), _grads(q, k, v, dout, torch.float32, kw),
               _grads(q, k, v, dout, torch.bfloat16, kw), torch.bfloat16)
