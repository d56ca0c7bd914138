"""JAX arrays: every cuflash call on JAX arrays, eager or under `jax.jit`, runs inside XLA's
program through `jax.experimental.buffer_callback`. XLA allocates the outputs; the callback gets
the input and output buffers (NumPy-viewable on CPU, CUDA-array-interface on GPU) and XLA's
stream, and hands them to `dispatch.execute` — the same path CuPy and torch arrays take. So work
is ordered after its producers on XLA's own stream, with no copy and no host synchronisation.

`cuflash.jax.attention` and `attention_varlen` are the differentiable entry points: a
`jax.custom_vjp` whose forward saves q, k, v, out and lse (never the score matrix) and whose
backward is `attention_backward`, both through the same callback. `attention(..., fp8=True)` is
forward only: its custom_vjp's backward refuses by name. Under `jax.vmap` the dense ops
fold the mapped axes into the batch (the callback sees them as leading dimensions; XLA's buffers
are row-major, so the fold is a view); varlen ops run once per mapped element.
"""
from __future__ import annotations

import dataclasses
import math
from functools import lru_cache, partial

import jax
import numpy as np

from . import api, dispatch, reference
from .arrays import Device, numpy_dtype
from .problem import Problem

# Ops whose arrays all lead with the batch dimension: vmapped axes fold into it.
_BATCH_LEADING_OPS = frozenset({"attention_forward", "attention_backward", "backward_preprocess",
                                "attention_fp8_forward", "attention_quantized_forward", "quantize_fp8"})
_BASE_RANK = 4  # of q (and dout, the first input of the backward ops): (batch, seqlen, heads, dim)


def _jax_dtype(name: str):
    return numpy_dtype(name)


# XLA's callback buffers offer the CUDA array interface for integer and 16-to-64-bit float types,
# not for float8: e4m3 arrays cross the callback as their bytes (uint8, a bitcast that costs
# nothing) and the host path views them as e4m3 again.
_AS_BYTES = frozenset({"float8_e4m3fn"})
_BYTES = "uint8"


def _bitcast(x, dtype: str):
    return jax.lax.bitcast_convert_type(x, _jax_dtype(dtype))


def _buffer_device(buffer) -> Device:
    """Where a callback buffer lives: XLA chose it at compile time, which a tracer did not know."""
    try:
        ptr = buffer.__cuda_array_interface__["data"][0]
    except jax.errors.JaxRuntimeError:  # a host buffer: "only supported on CUDA and ROCm"
        return Device("cpu")
    import cupy

    return Device("cuda", int(cupy.cuda.runtime.pointerGetAttributes(ptr).device))


class _CudaView:
    """A contiguous device buffer seen with another shape (the CUDA array interface, folded)."""

    def __init__(self, cai: dict, shape: tuple[int, ...]):
        self.__cuda_array_interface__ = dict(cai, shape=shape, strides=None)


def _fold(buffer, lead: int, device: Device):
    """`buffer` with its `lead` vmapped leading dimensions folded into the batch dimension after them."""
    if lead == 0:
        return buffer
    shape = tuple(buffer.shape)
    folded = (math.prod(shape[:lead + 1]),) + shape[lead + 1:]
    if not device.is_cuda:
        return np.asarray(buffer).reshape(folded)  # a view: XLA's buffers are dense and row-major
    cai = buffer.__cuda_array_interface__
    assert cai.get("strides") is None, "XLA buffers are dense and row-major"
    return _CudaView(cai, folded)


@lru_cache(maxsize=256)
def _callable(problem: Problem, inputs: tuple[tuple[str, str], ...], outputs: tuple[tuple[str, tuple, str], ...]):
    """One buffer_callback per distinct call signature, so eager calls reuse XLA's compilation.
    `inputs` are (name, dtype); dtypes in _AS_BYTES arrive, and are returned, as uint8."""
    from jax.experimental.buffer_callback import buffer_callback

    result_types = tuple(jax.ShapeDtypeStruct(shape, _jax_dtype(_BYTES if dtype in _AS_BYTES else dtype))
                         for _, shape, dtype in outputs)
    foldable = problem.op in _BATCH_LEADING_OPS

    def callback(ctx, outs, *ins):
        device = _buffer_device(outs[0])
        lead = len(ins[0].shape) - _BASE_RANK if foldable else 0  # axes added by jax.vmap

        def arrays(buffers, dtypes):
            views = {}
            for (name, dtype), x in zip(dtypes, buffers):
                x = _fold(x, lead, device)
                if dtype in _AS_BYTES and not device.is_cuda:  # the reference takes e4m3 arrays
                    x = np.asarray(x).view(numpy_dtype(dtype))
                views[name] = x
            return views

        # vmapped axes fold into a batch-leading op's batch; a varlen op's leading dimension is its
        # packed rows, not its batch (that is cu_seqlens' length less one)
        batch = math.prod(ins[0].shape[:lead + 1]) if foldable else problem.batch
        p = dataclasses.replace(problem, device=device, batch=batch)
        views = arrays(ins, inputs)
        if p.varlen and not device.is_cuda:  # a jax.jit program's values, unknown to api's checks (GPU: the kernel's)
            for side, total, max_seqlen in (("q", p.total_q, p.seqlen_q), ("k", p.total_k, p.seqlen_k)):
                name = f"cu_seqlens_{side}"
                reference.check_cu_seqlens(name, np.asarray(views[name]), total, f"max_seqlen_{side}", max_seqlen)
        dispatch.execute(p, views, arrays(outs, [(name, dtype) for name, _, dtype in outputs]),
                         int(ctx.stream) if device.is_cuda else None)

    # broadcast_all: under vmap every input gets the mapped axes (unmapped ones broadcast by XLA).
    return buffer_callback(callback, result_types, vmap_method="broadcast_all" if foldable else "sequential")


def call(problem: Problem, inputs: dict, outputs: dict[str, tuple]) -> tuple:
    """Run `problem` on JAX arrays or tracers; returns JAX arrays, in the order of `outputs`."""
    spec = tuple((name, tuple(shape), dtype) for name, (shape, dtype) in outputs.items())
    dtypes = {name: str(x.dtype) for name, x in inputs.items()}
    results = _callable(problem, tuple(dtypes.items()), spec)(
        *(_bitcast(x, _BYTES) if dtypes[name] in _AS_BYTES else x for name, x in inputs.items()))
    return tuple(_bitcast(r, dtype) if dtype in _AS_BYTES else r for r, (_, _, dtype) in zip(results, spec))


# ----------------------------------------------------------------------------- differentiable


@partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def _attention(q, k, v, features, deterministic):
    return api.attention(q, k, v, return_lse=True, **api._feature_keywords(features))


def _attention_fwd(q, k, v, features, deterministic):
    out, lse = _attention(q, k, v, features, deterministic)
    return (out, lse), (q, k, v, out, lse)


def _attention_bwd(features, deterministic, residuals, cotangents):
    dout, _ = cotangents  # lse is returned without a gradient (stop_gradient in `attention`)
    # JAX may hand over the cotangent as a NumPy array (outside jit); api wants one framework
    return api.attention_backward(jax.numpy.asarray(dout), *residuals, **api._feature_keywords(features),
                                  deterministic=deterministic)


_attention.defvjp(_attention_fwd, _attention_bwd)


@partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _attention_quantized(q, k, v, features, hadamard, fast_exp, return_lse):
    """out, or (out, lse): without the LSE the FP8 kernel may sum P's rows on the tensor cores."""
    return api.attention(q, k, v, return_lse=return_lse, fp8=True, hadamard=hadamard, fast_exp=fast_exp,
                         **api._feature_keywords(features))


def _attention_quantized_fwd(q, k, v, features, hadamard, fast_exp, return_lse):
    return _attention_quantized(q, k, v, features, hadamard, fast_exp, return_lse), None


def _attention_quantized_bwd(features, hadamard, fast_exp, return_lse, residuals, cotangents):
    raise ValueError("attention(..., fp8=True) is forward only (no gradient through e4m3 quantization): "
                     "differentiate the 16-bit attention, or wrap the FP8 call in jax.lax.stop_gradient")


_attention_quantized.defvjp(_attention_quantized_fwd, _attention_quantized_bwd)


def attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, return_lse=False,
              deterministic=False, fp8=False, hadamard=False, fast_exp=False):
    """`cuflash.attention` for JAX arrays, differentiable in q, k and v (jax.grad, jax.jit, jax.vmap;
    see `cuflash.attention` for the semantics). Returns out, or (out, lse) with return_lse=True;
    lse carries no gradient. Like any jax.numpy function it takes NumPy arrays too (as JAX arrays).
    deterministic=True makes the gradient bit-identical from run to run (`attention_backward`).
    fp8=True (and hadamard, fast_exp) as in `cuflash.attention`: forward only, jax.grad through it
    refuses."""
    return_lse = api._check_flag("return_lse", return_lse)
    deterministic = api._check_flag("deterministic", deterministic)
    fp8, hadamard, fast_exp = api._fp8_flags(fp8, hadamard, fast_exp, return_lse, deterministic)
    q, k, v = (jax.numpy.asarray(x) for x in (q, k, v))
    features = api._feature_scalars(q.shape[-1], causal, softmax_scale, window, softcap)
    if fp8 and not return_lse:
        return _attention_quantized(q, k, v, features, hadamard, fast_exp, False)
    out, lse = (_attention_quantized(q, k, v, features, hadamard, fast_exp, True) if fp8
                else _attention(q, k, v, features, deterministic))
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out


@partial(jax.custom_vjp, nondiff_argnums=(5, 6, 7, 8))
def _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, features, deterministic):
    return api.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_lse=True,
                                **api._feature_keywords(features))


def _attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, features, deterministic):
    out, lse = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, features,
                                 deterministic)
    return (out, lse), (q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)


def _attention_varlen_bwd(max_seqlen_q, max_seqlen_k, features, deterministic, residuals, cotangents):
    dout, _ = cotangents
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = residuals
    dq, dk, dv = api.attention_varlen_backward(jax.numpy.asarray(dout), q, k, v, out, lse, cu_seqlens_q,
                                               cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                               **api._feature_keywords(features), deterministic=deterministic)
    no_tangent = lambda x: np.zeros(x.shape, dtype=jax.dtypes.float0)  # integer inputs have none
    return dq, dk, dv, no_tangent(cu_seqlens_q), no_tangent(cu_seqlens_k)


_attention_varlen.defvjp(_attention_varlen_fwd, _attention_varlen_bwd)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window=(-1, -1), softcap=0.0, return_lse=False, deterministic=False):
    """`cuflash.attention_varlen` for JAX arrays, differentiable in q, k and v. max_seqlen_q and
    max_seqlen_k must be Python ints (static under jax.jit). deterministic: as for `attention`."""
    return_lse = api._check_flag("return_lse", return_lse)
    deterministic = api._check_flag("deterministic", deterministic)
    api._check_static_max_seqlens(max_seqlen_q, max_seqlen_k)
    q, k, v, cu_seqlens_q, cu_seqlens_k = (jax.numpy.asarray(x) for x in (q, k, v, cu_seqlens_q, cu_seqlens_k))
    out, lse = _attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                 api._feature_scalars(q.shape[-1], causal, softmax_scale, window, softcap),
                                 deterministic)
    return (out, jax.lax.stop_gradient(lse)) if return_lse else out
