"""bwd_sm80 on the GPU: gradients against the float32 reference from the same fp16/bf16 inputs, by
FlashAttention's criterion (each of dq, dk, dv: max abs error at most 2x that of a plain
low-precision implementation, plus 1e-4); NaN never passes; outputs poisoned before the call."""
import math

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

import cuflash
from cuflash import arrays, dispatch, reference
from cuflash.problem import Problem

pytestmark = pytest.mark.gpu
gpu_attention = pytest.importorskip("gpu_attention_reference")


def _grads(q, k, v, dout, compute_dtype, kw):
    leaves = [x.detach().to(compute_dtype).requires_grad_() for x in (q, k, v)]
    out, _ = gpu_attention.attention(*leaves, compute_dtype=compute_dtype, **kw)
    out.backward(dout.to(out.dtype))
    return [x.grad.float() for x in leaves]


@settings(max_examples=120)
@given(dtype=st.sampled_from([torch.float16, torch.bfloat16]), headdim=st.sampled_from([32, 64]),
       batch=st.integers(1, 3), seqlen_q=st.sampled_from([1, 7, 64, 65, 127, 200, 333]),
       seqlen_k=st.sampled_from([1, 9, 64, 100, 129, 256, 401]), nheads_kv=st.integers(1, 2),
       group=st.sampled_from([1, 2, 4]), causal=st.booleans(), left=st.sampled_from([-1, 0, 17, 100]),
       softcap=st.sampled_from([0.0, 0.0, 5.0]), seed=st.integers(0, 2**31 - 1))
def test_backward_matches_reference(dtype, headdim, batch, seqlen_q, seqlen_k, nheads_kv, group, causal, left,
                                    softcap, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    nheads = nheads_kv * group
    q = torch.randn(batch, seqlen_q, nheads, headdim, device="cuda", generator=g).to(dtype)
    k = torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", generator=g).to(dtype)
    v = torch.randn(batch, seqlen_k, nheads_kv, headdim, device="cuda", generator=g).to(dtype)
    dout = torch.randn(batch, seqlen_q, nheads, headdim, device="cuda", generator=g).to(dtype)
    kw = dict(causal=causal, window=(left, -1), softcap=softcap, softmax_scale=None)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    left_b, right_b = reference.window_bounds(causal, (left, -1))
    problem = Problem(op="attention_backward", framework="torch", device=arrays.Device("cuda", 0),
                      dtype=str(dtype).removeprefix("torch."), batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k,
                      nheads=nheads, nheads_kv=nheads_kv, headdim=headdim, causal=causal, window_left=left_b,
                      window_right=right_b, softmax_scale=1 / math.sqrt(headdim), softcap=softcap)
    grads = {n: torch.full(x.shape, float("nan"), device="cuda", dtype=dtype) for n, x in (("dq", q), ("dk", k), ("dv", v))}
    dispatch.execute(problem, dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse), grads,
                     torch.cuda.current_stream().cuda_stream)
    torch.cuda.synchronize()
    ref = _grads(q, k, v, dout, torch.float32, kw)
    low = _grads(q, k, v, dout, dtype, kw)
    for name, got, want, plain in zip(("dq", "dk", "dv"), grads.values(), ref, low):
        assert not torch.isnan(got).any(), f"NaN (or an unwritten, poisoned element) in {name}"
        err = (got.float() - want).abs().max().item()
        plain_err = (plain - want).abs().max().item()
        assert err <= 2 * plain_err + 1e-4, f"{name}: max error {err:.3g} vs plain {dtype} {plain_err:.3g}"


def test_torch_autograd_runs_the_backward_kernel():
    import cuflash.torch as ct

    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 300, 4, 64, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    ct.attention(q, k, v, causal=True).float().square().sum().backward()
    want = _grads(q, k, v, 2 * ct.attention(q, k, v, causal=True).detach().float(), torch.float32,
                  dict(causal=True, window=(-1, -1), softcap=0.0, softmax_scale=None))
    for got, w in zip((q.grad, k.grad, v.grad), want):
        assert (got.float() - w).abs().max().item() < 0.05 * w.abs().max().item() + 1e-3
