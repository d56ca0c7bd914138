"""Differentiable attention for PyTorch.

`cuflash.torch.attention` and `cuflash.torch.attention_varlen` are `torch.library` custom ops with
autograd and fake (shape-only) implementations, so they work under autograd and `torch.compile`
without graph breaks; eager calls run the ops' functions and gradient rule without the custom-op
layers, whose host time is more than cuflash's own (below). The FP8 path (`quantize_fp8`,
`attention_fp8` and `attention(..., fp8=True)`) is custom ops too, forward only: it traces under
`torch.compile`, and refuses inputs that require grad (e4m3 quantization has no gradient here).
Each op calls the framework-agnostic function of `cuflash.api`: CUDA tensors run cuflash's kernels
on torch's current stream with outputs allocated by torch; CPU tensors run the NumPy reference
(which is how CI checks the gradients). The forward saves q, k, v, out and lse for the backward,
never the score matrix. lse, when returned, is not differentiable (like FlashAttention's):
gradients flow through out only.
"""
from __future__ import annotations

from typing import Optional

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode

from . import api, reference

# Features travel through the ops as plain scalars (no tuples or None in their schemas, by choice):
# api._feature_scalars checks them once. The forward ops take `deterministic` too, unused there,
# so that their autograd rule can hand it to the backward op.


# Each op's implementation is a plain function that calls cuflash.api, registered as a custom op
# (with a fake) by `_op`, which keeps the plain function: tracers (torch.compile, torch.export, fake
# tensors, make_fx) see the op, and eager calls run the plain function (`_call`, `_differentiable`).
# torch.library's custom-op layers (dispatch, schema defaults, aliasing checks, their autograd
# wrapper) cost about 60 us of host time a call and 400 us a training step's forward and backward on
# an H200's host, more than cuflash's own calls (benchmarks/NOTES-sm90.md, session 55). The dense and
# varlen gradient rules are written once (_grad_dense, _grad_varlen) for two carriers: the ops'
# autograd (register_autograd), which tracers see, and an autograd.Function for eager calls.

_PLAIN: dict = {}  # custom op -> the function it runs


def _op(name: str):
    """Register the decorated function as custom op cuflash::name; `_PLAIN` keeps the function."""
    def register(fn):
        op = torch.library.custom_op(f"cuflash::{name}", fn, mutates_args=())
        _PLAIN[op] = fn
        return op
    return register


def _tracing() -> bool:
    return torch.compiler.is_compiling() or _get_current_dispatch_mode() is not None


def _call(op, *args):
    """op(*args) for a tracer; its plain function for an eager call (a forward-only op)."""
    return op(*args) if _tracing() else _PLAIN[op](*args)


@_op("attention_fwd")
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                   window_left: int, window_right: int, softcap: float,
                   deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    features = (causal, softmax_scale, window_left, window_right, softcap)
    return api.attention(q, k, v, return_lse=True, **api._feature_keywords(features))


@_attention_fwd.register_fake
def _(q, k, v, causal, softmax_scale, window_left, window_right, softcap, deterministic):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


@_op("attention_bwd")
def _attention_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                   lse: torch.Tensor, causal: bool, softmax_scale: float, window_left: int, window_right: int,
                   softcap: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    features = (causal, softmax_scale, window_left, window_right, softcap)
    return api.attention_backward(dout, q, k, v, out, lse, **api._feature_keywords(features),
                                  deterministic=deterministic)


@_attention_bwd.register_fake
def _(dout, q, k, v, out, lse, causal, softmax_scale, window_left, window_right, softcap, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_dense(ctx, inputs, output):
    q, k, v, *features = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.features = features  # and deterministic, last
    ctx.mark_non_differentiable(lse)


def _grad_dense(backward):
    """The dense forward's gradient rule, running `backward` (the op, or its plain function)."""
    def grad(ctx, dout, _dlse):
        q, k, v, out, lse = ctx.saved_tensors
        # autograd may hand over a strided gradient; the kernels read rows with unit stride
        dq, dk, dv = backward(dout.contiguous(), q, k, v, out, lse, *ctx.features)
        return (dq, dk, dv) + (None,) * len(ctx.features)
    return grad


_attention_fwd.register_autograd(_grad_dense(_attention_bwd), setup_context=_save_dense)


@_op("attention_varlen_fwd")
def _attention_varlen_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens_q: torch.Tensor,
                          cu_seqlens_k: torch.Tensor, max_seqlen_q: int, max_seqlen_k: int, causal: bool,
                          softmax_scale: float, window_left: int, window_right: int,
                          softcap: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    features = (causal, softmax_scale, window_left, window_right, softcap)
    return api.attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, return_lse=True,
                                **api._feature_keywords(features))


@_attention_varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, window_left,
      window_right, softcap, deterministic):
    total_q, nheads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((nheads, total_q), dtype=torch.float32)


@_op("attention_varlen_bwd")
def _attention_varlen_bwd(dout: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, out: torch.Tensor,
                          lse: torch.Tensor, cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor, max_seqlen_q: int,
                          max_seqlen_k: int, causal: bool, softmax_scale: float, window_left: int, window_right: int,
                          softcap: float, deterministic: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    features = (causal, softmax_scale, window_left, window_right, softcap)
    return api.attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                         max_seqlen_k, **api._feature_keywords(features), deterministic=deterministic)


@_attention_varlen_bwd.register_fake
def _(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale,
      window_left, window_right, softcap, deterministic):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _save_varlen(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *scalars = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k)
    ctx.scalars = scalars  # max_seqlen_q, max_seqlen_k, the features and deterministic
    ctx.mark_non_differentiable(lse)


def _grad_varlen(backward):
    """The varlen forward's gradient rule, running `backward` (the op, or its plain function)."""
    def grad(ctx, dout, _dlse):
        q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
        dq, dk, dv = backward(dout.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.scalars)
        return (dq, dk, dv, None, None) + (None,) * len(ctx.scalars)
    return grad


_attention_varlen_fwd.register_autograd(_grad_varlen(_attention_varlen_bwd), setup_context=_save_varlen)


def _eager_function(name: str, forward, setup_context, grad):
    """An autograd.Function of a plain forward function and a gradient rule. Its forward takes ctx (the
    old style): a Function with a separate setup_context binds every call's arguments to the forward's
    signature (inspect), about 60 us of host time a call."""
    def forward_with_context(ctx, *inputs):
        output = forward(*inputs)
        setup_context(ctx, inputs, output)
        return output

    return type(name, (torch.autograd.Function,), dict(forward=staticmethod(forward_with_context),
                                                       backward=staticmethod(grad)))


_EAGER_AUTOGRAD = {  # forward op -> its autograd.Function of plain functions
    _attention_fwd: _eager_function("_DenseAttention", _PLAIN[_attention_fwd], _save_dense,
                                    _grad_dense(_PLAIN[_attention_bwd])),
    _attention_varlen_fwd: _eager_function("_VarlenAttention", _PLAIN[_attention_varlen_fwd], _save_varlen,
                                           _grad_varlen(_PLAIN[_attention_varlen_bwd]))}


def _differentiable(op, *args):
    """A dense or varlen forward op (q, k and v first): `_call`, through its autograd.Function where
    autograd records the call."""
    if _tracing():
        return op(*args)
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in args[:3]):
        return _EAGER_AUTOGRAD[op].apply(*args)
    return _PLAIN[op](*args)


@_op("quantize_fp8")
def _quantize_fp8(x: torch.Tensor, block: Optional[int], hadamard: bool,
                  seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    return api.quantize_fp8(x, block=block, hadamard=hadamard, seed=seed)


@_quantize_fp8.register_fake
def _(x, block, hadamard, seed):
    batch, seqlen, nheads, _ = x.shape
    descale = (batch, nheads) if block is None else (batch, nheads, reference.fp8_blocks(seqlen, block))
    return x.new_empty(x.shape, dtype=torch.float8_e4m3fn), x.new_empty(descale, dtype=torch.float32)


# The FP8 ops return (out, lse), lse empty (0 elements) without return_lse: the kernel may then sum
# P's rows on the tensor cores and write no LSE (cuflash.kernels.fwd_sm90, FP8_TENSOR_ROW_SUMS).
def _lse_or_empty(result, return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return result if return_lse else (result, result.new_empty(0, dtype=torch.float32))


def _fake_lse(x: torch.Tensor, return_lse: bool) -> torch.Tensor:
    batch, seqlen_q, nheads, _ = x.shape
    return x.new_empty((batch, nheads, seqlen_q) if return_lse else 0, dtype=torch.float32)


@_op("attention_fp8_fwd")
def _attention_fp8_fwd(q8: torch.Tensor, k8: torch.Tensor, v8: torch.Tensor, q_descale: torch.Tensor,
                       k_descale: torch.Tensor, v_descale: torch.Tensor, causal: bool, softmax_scale: float,
                       window_left: int, window_right: int, out_dtype: torch.dtype, return_lse: bool,
                       kv_block: int, fast_exp: bool) -> tuple[torch.Tensor, torch.Tensor]:
    return _lse_or_empty(api.attention_fp8(q8, k8, v8, q_descale, k_descale, v_descale, causal=causal,
                                           softmax_scale=softmax_scale, window=(window_left, window_right),
                                           out_dtype=out_dtype, return_lse=return_lse, kv_block=kv_block,
                                           fast_exp=fast_exp), return_lse)


@_attention_fp8_fwd.register_fake
def _(q8, k8, v8, q_descale, k_descale, v_descale, causal, softmax_scale, window_left, window_right, out_dtype,
      return_lse, kv_block, fast_exp):
    return q8.new_empty(q8.shape, dtype=out_dtype), _fake_lse(q8, return_lse)


@_op("attention_quantized_fwd")
def _attention_quantized_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                             window_left: int, window_right: int, softcap: float, hadamard: bool, fast_exp: bool,
                             return_lse: bool) -> tuple[torch.Tensor, torch.Tensor]:
    features = (causal, softmax_scale, window_left, window_right, softcap)
    return _lse_or_empty(api.attention(q, k, v, return_lse=return_lse, fp8=True, hadamard=hadamard, fast_exp=fast_exp,
                                       **api._feature_keywords(features)), return_lse)


@_attention_quantized_fwd.register_fake
def _(q, k, v, causal, softmax_scale, window_left, window_right, softcap, hadamard, fast_exp, return_lse):
    return q.new_empty(q.shape), _fake_lse(q, return_lse)


def _forward_only(what: str, *tensors) -> None:
    """The FP8 ops have no backward: refuse inputs autograd would follow, rather than fail in it."""
    if torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in tensors):
        raise ValueError(f"{what} is forward only (no gradient through e4m3 quantization): call it under "
                         "torch.no_grad() or torch.inference_mode(), or on tensors that do not require grad")


def _check_tensor(name: str, x, plain: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor for cuflash.torch; got {type(x).__module__}."
                        f"{type(x).__qualname__} (cuflash.{plain} takes any framework's arrays)")


def _features(q, causal, softmax_scale, window, softcap) -> tuple:
    _check_tensor("q", q, "attention")
    return api._feature_scalars(q.shape[-1], causal, softmax_scale, window, softcap)


def attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, return_lse=False,
              deterministic=False, fp8=False, hadamard=False, fast_exp=False):
    """`cuflash.attention` for torch tensors, differentiable in q, k and v (see its docstring for the
    semantics). Returns out, or (out, lse) with return_lse=True; lse is not differentiable.
    deterministic=True makes the backward bit-identical from run to run (`attention_backward`).
    fp8=True (and hadamard, fast_exp) as in `cuflash.attention`: forward only, so q, k and v must not
    require grad (or grad mode must be off); deterministic does not apply there."""
    return_lse = api._check_flag("return_lse", return_lse)
    deterministic = api._check_flag("deterministic", deterministic)
    features = _features(q, causal, softmax_scale, window, softcap)
    fp8, hadamard, fast_exp = api._fp8_flags(fp8, hadamard, fast_exp, return_lse, deterministic)
    if fp8:
        _forward_only("attention(..., fp8=True)", q, k, v)
        out, lse = _call(_attention_quantized_fwd, q, k, v, *features, hadamard, fast_exp, return_lse)
    else:
        out, lse = _differentiable(_attention_fwd, q, k, v, *features, deterministic)
    return (out, lse) if return_lse else out


def quantize_fp8(x, *, block=None, hadamard=False, seed=0):
    """`cuflash.quantize_fp8` as a custom op (traces under torch.compile); forward only. seed must
    fit the op schema's int64."""
    _check_tensor("x", x, "quantize_fp8")
    _forward_only("quantize_fp8", x)
    block, hadamard, seed = api._quantize_options(block, hadamard, seed)  # checked here, before the schema casts
    if seed >= 2**63:
        raise ValueError(f"seed must be below 2**63 for cuflash.torch.quantize_fp8 (an int64 in its op); got {seed}")
    return _call(_quantize_fp8, x, block, hadamard, seed)


def attention_fp8(q8, k8, v8, q_descale, k_descale, v_descale, *, causal=False, window=(-1, -1), softmax_scale=None,
                  out_dtype=torch.bfloat16, return_lse=False, kv_block=api.FP8_BLOCK, fast_exp=False):
    """`cuflash.attention_fp8` as a custom op (traces under torch.compile); forward only."""
    return_lse = api._check_flag("return_lse", return_lse)
    fast_exp = api._check_fast_exp(fast_exp, return_lse)
    _check_tensor("q8", q8, "attention_fp8")
    _forward_only("attention_fp8", q8, k8, v8, q_descale, k_descale, v_descale)
    causal, softmax_scale, window_left, window_right, _ = _features(q8, causal, softmax_scale, window, 0.0)
    # a torch.dtype by its name: no NumPy dtype lookup for torch.compile to trace
    name = str(out_dtype).removeprefix("torch.") if isinstance(out_dtype, torch.dtype) else out_dtype
    out_dtype = getattr(torch, api._dtype_arg("out_dtype", name, api.FP8_OUT_DTYPES))
    kv_block = api.kv_block_rows(kv_block)  # (an int, for the op's schema)
    out, lse = _call(_attention_fp8_fwd, q8, k8, v8, q_descale, k_descale, v_descale, causal, softmax_scale,
                     window_left, window_right, out_dtype, return_lse, kv_block, fast_exp)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window=(-1, -1), softcap=0.0, return_lse=False, deterministic=False):
    """`cuflash.attention_varlen` for torch tensors, differentiable in q, k and v. max_seqlen_q and
    max_seqlen_k must be Python ints (the op's schema; under torch.compile they are constants).
    deterministic: as for `attention`."""
    return_lse = api._check_flag("return_lse", return_lse)
    deterministic = api._check_flag("deterministic", deterministic)
    api._check_static_max_seqlens(max_seqlen_q, max_seqlen_k)
    out, lse = _differentiable(_attention_varlen_fwd, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                               max_seqlen_k, *_features(q, causal, softmax_scale, window, softcap), deterministic)
    return (out, lse) if return_lse else out


__all__ = ["attention", "attention_varlen", "attention_fp8", "quantize_fp8"]
