"""Differentiable attention for PyTorch.

`cuflash.torch.attention` and `cuflash.torch.attention_varlen` are `torch.library` custom ops with
autograd and fake (shape-only) implementations, so they work under autograd and `torch.compile`
without graph breaks. Each op calls the framework-agnostic function of `cuflash.api`: CUDA tensors
run cuflash's kernels on torch's current stream with outputs allocated by torch; CPU tensors run the
NumPy reference (which is how CI checks the gradients). The forward saves q, k, v, out and lse for
the backward, never the score matrix. lse, when returned, is not differentiable (like
FlashAttention's): gradients flow through out only.
"""
from __future__ import annotations

import torch

from . import api

# Features travel through the ops as plain scalars (the custom-op schema has no tuples or None):
# api._feature_scalars checks them once. The forward ops take `deterministic` too, unused there,
# so that their autograd rule can hand it to the backward op.


@torch.library.custom_op("cuflash::attention_fwd", mutates_args=())
def _attention_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, softmax_scale: float,
                   window_left: int, window_right: int, softcap: float,
                   deterministic: bool) -> tuple[torch.Tensor, torch.Tensor]:
    features = (causal, softmax_scale, window_left, window_right, softcap)
    return api.attention(q, k, v, return_lse=True, **api._feature_keywords(features))


@_attention_fwd.register_fake
def _(q, k, v, causal, softmax_scale, window_left, window_right, softcap, deterministic):
    batch, seqlen_q, nheads, _ = q.shape
    return q.new_empty(q.shape), q.new_empty((batch, nheads, seqlen_q), dtype=torch.float32)


@torch.library.custom_op("cuflash::attention_bwd", mutates_args=())
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


def _grad_dense(ctx, dout, _dlse):
    q, k, v, out, lse = ctx.saved_tensors
    # autograd may hand over a strided gradient; the kernels read rows with unit stride
    dq, dk, dv = _attention_bwd(dout.contiguous(), q, k, v, out, lse, *ctx.features)
    return (dq, dk, dv) + (None,) * len(ctx.features)


_attention_fwd.register_autograd(_grad_dense, setup_context=_save_dense)


@torch.library.custom_op("cuflash::attention_varlen_fwd", mutates_args=())
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


@torch.library.custom_op("cuflash::attention_varlen_bwd", mutates_args=())
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


def _grad_varlen(ctx, dout, _dlse):
    q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k = ctx.saved_tensors
    dq, dk, dv = _attention_varlen_bwd(dout.contiguous(), q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *ctx.scalars)
    return (dq, dk, dv, None, None) + (None,) * len(ctx.scalars)


_attention_varlen_fwd.register_autograd(_grad_varlen, setup_context=_save_varlen)


def _features(q, causal, softmax_scale, window, softcap) -> tuple:
    if not isinstance(q, torch.Tensor):
        raise TypeError(f"q must be a torch.Tensor for cuflash.torch; got {type(q).__module__}.{type(q).__qualname__} "
                        "(cuflash.attention takes any framework's arrays)")
    return api._feature_scalars(q.shape[-1], causal, softmax_scale, window, softcap)


def attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, return_lse=False,
              deterministic=False):
    """`cuflash.attention` for torch tensors, differentiable in q, k and v (see its docstring for the
    semantics). Returns out, or (out, lse) with return_lse=True; lse is not differentiable.
    deterministic=True makes the backward bit-identical from run to run (`attention_backward`)."""
    return_lse = api._check_flag("return_lse", return_lse)
    deterministic = api._check_flag("deterministic", deterministic)
    out, lse = _attention_fwd(q, k, v, *_features(q, causal, softmax_scale, window, softcap), deterministic)
    return (out, lse) if return_lse else out


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window=(-1, -1), softcap=0.0, return_lse=False, deterministic=False):
    """`cuflash.attention_varlen` for torch tensors, differentiable in q, k and v. max_seqlen_q and
    max_seqlen_k must be Python ints (the op's schema; under torch.compile they are constants).
    deterministic: as for `attention`."""
    return_lse = api._check_flag("return_lse", return_lse)
    deterministic = api._check_flag("deterministic", deterministic)
    api._check_static_max_seqlens(max_seqlen_q, max_seqlen_k)
    out, lse = _attention_varlen_fwd(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     *_features(q, causal, softmax_scale, window, softcap), deterministic)
    return (out, lse) if return_lse else out


__all__ = ["attention", "attention_varlen"]
