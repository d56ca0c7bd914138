"""The public functions: argument checks, then one Problem handed to `dispatch`.

Every check happens here, before any kernel runs, and each error names the argument, what was
given and what is expected. Nothing below this module re-validates user input, with one exception:
the values of cu_seqlens that are not on the host (on a GPU, or a jax.jit tracer's) are checked
where the call runs, ahead of its kernel (kernels/check_cu_seqlens.py; cuflash/jax.py's callback). A
GPU call whose arrays and other arguments match an earlier call's (dispatch.call_signature: types,
dtypes, shapes, strides, devices, addresses mod 16) runs what that call's checks concluded without
checking again: the checks look at nothing else.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Any

import numpy as np

from . import arrays, dispatch, reference
from .arrays import ArrayInfo
from .problem import Problem

_ATTENTION_LAYOUT = "(batch, seqlen, nheads, headdim)"
_INT32_MAX = 2**31 - 1  # kernels take window bounds and lengths as int32
_VARLEN_LAYOUT = "(total_tokens, nheads, headdim)"


# ----------------------------------------------------------------------------- generic checks


def _describe_all(named: dict[str, Any]) -> dict[str, ArrayInfo]:
    """Describe every array; all must come from one framework and sit on one device."""
    infos = {name: arrays.describe(name, x) for name, x in named.items()}
    first = next(iter(infos.values()))
    for info in infos.values():
        if info.framework != first.framework:
            raise TypeError(
                f"{info.name} is a {info.framework} array but {first.name} is a {first.framework} array; "
                "pass arrays of one framework"
            )
        if info.device != first.device:
            raise ValueError(f"{info.name} is on {info.device} but {first.name} is on {first.device}; "
                             "pass arrays on one device")
    return infos


def _check_rank(info: ArrayInfo, rank: int, layout: str) -> None:
    if len(info.shape) != rank:
        raise ValueError(f"{info.name} must have {rank} dimensions {layout}; got shape {info.shape}")


def _check_unit_last_stride(info: ArrayInfo) -> None:
    # An empty array has no element to reach, and NumPy reports zero strides for it.
    if math.prod(info.shape) and info.shape[-1] > 1 and info.strides[-1] != 1:
        raise ValueError(
            f"{info.name} must have unit stride on its last dimension; got strides {info.strides} "
            f"(in elements). Make it contiguous first: {info.contiguous_fix}"
        )


def _check_same_dtype(infos: list[ArrayInfo]) -> str:
    first = infos[0]
    for info in infos[1:]:
        if info.dtype != first.dtype:
            raise TypeError(f"{info.name} has dtype {info.dtype} but {first.name} has {first.dtype}; "
                            f"{', '.join(i.name for i in infos)} must share one dtype (nothing is cast for you)")
    return first.dtype


def _check_dtype_supported(op: str, info: ArrayInfo) -> None:
    supported = dispatch.supported_dtypes(op, info.device)
    if supported and info.dtype not in supported:
        where = "on the GPU" if info.device.is_cuda else "on the CPU reference backend"
        raise TypeError(f"{info.name} has dtype {info.dtype}, which cuflash does not support {where}; "
                        f"expected one of {', '.join(sorted(supported))}")


def _check_shape(info: ArrayInfo, expected: tuple[int, ...], what: str) -> None:
    if info.shape != expected:
        raise ValueError(f"{info.name} must have shape {expected} {what}; got {info.shape}")


def _features(headdim: int, causal: Any, softmax_scale: Any, window: Any, softcap: Any) -> dict:
    """Check the keyword features; return the Problem fields they set."""
    if not isinstance(causal, (bool, np.bool_)):
        raise TypeError(f"causal must be a bool; got {causal!r}")
    if (not isinstance(window, (tuple, list)) or len(window) != 2
            or not all(isinstance(w, (int, np.integer)) and not isinstance(w, bool) for w in window)):
        raise TypeError(f"window must be a pair of ints (left, right), -1 meaning unbounded; got {window!r}")
    if min(window) < -1 or max(window) > _INT32_MAX:
        raise ValueError(f"window values must be in [-1, {_INT32_MAX}] (-1 means unbounded); got {tuple(window)}")
    left, right = reference.window_bounds(bool(causal), (int(window[0]), int(window[1])))
    softcap = _finite_float("softcap", softcap, "a finite float >= 0 (0 turns it off)")
    if softcap < 0:
        raise ValueError(f"softcap must be a finite float >= 0 (0 turns it off); got {softcap}")
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(headdim)
    else:
        expected = "a finite float > 0, or None for 1/sqrt(headdim)"
        softmax_scale = _finite_float("softmax_scale", softmax_scale, expected)
        if softmax_scale <= 0:  # the kernels take each row's max on unscaled scores
            raise ValueError(f"softmax_scale must be {expected}; got {softmax_scale}")
    return dict(causal=bool(causal), window_left=left, window_right=right,
                softmax_scale=softmax_scale, softcap=softcap)


def _finite_float(name: str, value: Any, expected: str) -> float:
    if not isinstance(value, (int, float, np.floating, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be {expected}; got {value!r}")
    try:
        result = float(value)
    except OverflowError:
        result = math.inf
    # a comparison, not math.isfinite: under torch.compile(dynamic=True) a Python float argument is
    # symbolic, and dynamo can guard on a comparison but not trace isfinite (NaN compares False)
    if not abs(result) < math.inf:
        raise ValueError(f"{name} must be {expected}; got {value!r}")
    return result


def _check_backend(backend: Any, op: str, device) -> str | None:
    if backend is None:
        return None
    from . import kernels

    names = kernels.backends_for(op)
    if not isinstance(backend, str) or backend not in names:
        raise ValueError(f"backend must be None (cuflash chooses) or one of {names}; got {backend!r}")
    if not device.is_cuda:
        raise ValueError(f"backend={backend!r} names a GPU kernel family, but the arrays are on {device}; "
                         "pass GPU arrays or leave backend=None for the NumPy reference")
    return backend


# The differentiable wrappers (cuflash.torch, cuflash.jax) carry the features through their ops as
# plain scalars: (causal, softmax_scale, window_left, window_right, softcap), checked here once.
def _feature_scalars(headdim: int, causal: Any, softmax_scale: Any, window: Any, softcap: Any) -> tuple:
    f = _features(headdim, causal, softmax_scale, window, softcap)
    return f["causal"], f["softmax_scale"], f["window_left"], f["window_right"], f["softcap"]


def _feature_keywords(scalars: tuple) -> dict:
    """`_feature_scalars` back as the keywords of `attention` and its relatives."""
    causal, softmax_scale, window_left, window_right, softcap = scalars
    return dict(causal=causal, softmax_scale=softmax_scale, window=(window_left, window_right), softcap=softcap)


def _fp8_flags(fp8: Any, hadamard: Any, fast_exp: Any, return_lse: bool,
               deterministic: bool = False) -> tuple[bool, bool, bool]:
    """attention's fp8, hadamard and fast_exp flags, checked (hadamard and fast_exp only with fp8,
    fast_exp only without the LSE: _check_fast_exp; the differentiable entry points' deterministic,
    already a checked flag, only without fp8)."""
    fp8, hadamard, fast_exp = _check_flag("fp8", fp8), _check_flag("hadamard", hadamard), _check_flag("fast_exp", fast_exp)
    if hadamard and not fp8:
        raise ValueError("hadamard=True transforms q and k before FP8 quantization: it needs fp8=True")
    if fast_exp and not fp8:
        raise ValueError("fast_exp=True is about the FP8 kernel's e4m3 P: it needs fp8=True")
    _check_fast_exp(fast_exp, return_lse)
    if fp8 and deterministic:
        raise ValueError("deterministic=True is about the backward, and fp8=True has none")
    return fp8, hadamard, fast_exp


def _check_fast_exp(fast_exp: Any, return_lse: bool) -> bool:
    """attention_fp8's (and fp8=True's) fast_exp, checked: only without the LSE, whose row sums are
    of exponentials."""
    fast_exp = _check_flag("fast_exp", fast_exp)
    if fast_exp and return_lse:
        raise ValueError("fast_exp=True takes P's e4m3 codes without exponentials, whose sums the LSE cannot "
                         "come from: it needs return_lse=False")
    return fast_exp


def _check_static_max_seqlens(max_seqlen_q: Any, max_seqlen_k: Any) -> None:
    """The wrappers take the varlen maxima as Python ints (an op schema's int; static under jax.jit)."""
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if not isinstance(value, int) or isinstance(value, bool):
            raise TypeError(f"{name} must be an int; got {value!r}")


def _check_flag(name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be a bool; got {value!r}")
    return bool(value)


# ----------------------------------------------------------------------------- dense attention


def _attention_problem(op: str, infos: dict[str, ArrayInfo], features: tuple, backend: Any = None,
                       deterministic: bool = False) -> Problem:
    """Checks shared by the dense forward and backward: q, k, v layout, GQA, dtype, strides."""
    q, k, v = infos["q"], infos["k"], infos["v"]
    for info in (q, k, v):
        _check_rank(info, 4, _ATTENTION_LAYOUT)
    batch, seqlen_q, nheads, headdim = q.shape
    _, seqlen_k, nheads_kv, _ = k.shape
    if k.shape[0] != batch:
        raise ValueError(f"{k.name} has batch {k.shape[0]} but {q.name} has batch {batch}; they must match")
    if k.shape[3] != headdim:
        raise ValueError(f"{k.name} has headdim {k.shape[3]} but {q.name} has headdim {headdim}; they must match")
    _check_shape(v, k.shape, f"(the shape of {k.name})")
    if headdim < 1:
        raise ValueError(f"{q.name} must have headdim >= 1; got shape {q.shape}")
    if nheads_kv < 1 or nheads % nheads_kv:
        raise ValueError(f"nheads of {q.name} ({nheads}) must be a multiple of nheads of {k.name} and {v.name} "
                         f"({nheads_kv}) (MQA/GQA: query head h reads kv head h // (nheads // nheads_kv))")
    dtype = _check_same_dtype([q, k, v])
    for info in (q, k, v):
        _check_unit_last_stride(info)
    _check_dtype_supported(op, q)
    return Problem(op=op, framework=q.framework, device=q.device, dtype=dtype, batch=batch,
                   seqlen_q=seqlen_q, seqlen_k=seqlen_k, nheads=nheads, nheads_kv=nheads_kv,
                   headdim=headdim, **_features(headdim, *features), backend=_check_backend(backend, op, q.device),
                   deterministic=deterministic)


def attention(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, return_lse=False,
              backend=None, fp8=False, hadamard=False, fast_exp=False):
    """Scaled dot-product attention, FlashAttention semantics.

    q: (batch, seqlen_q, nheads, headdim); k, v: (batch, seqlen_k, nheads_kv, headdim), with nheads a
    multiple of nheads_kv (query head h reads kv head h // (nheads // nheads_kv)).
    softmax_scale defaults to 1/sqrt(headdim). softcap > 0 replaces each scaled score s by
    softcap * tanh(s / softcap), before masking. causal and window=(left, right) align to the
    bottom-right corner: query i sees key j iff
    i + seqlen_k - seqlen_q - left <= j <= i + seqlen_k - seqlen_q + right (causal: right = 0;
    -1: unbounded). A query row that sees no key gives output 0 and lse -inf.

    Returns out (the caller's framework, q's dtype, shape of q) and, with return_lse=True,
    (out, lse) where lse is float32 (batch, nheads, seqlen_q), the natural log of each row's sum of
    exp(scores). NumPy and other CPU arrays run on the NumPy reference; GPU arrays on cuflash's kernels.
    backend=None picks the fastest kernel family that serves the call; "sm90" or "sm80" forces one
    (NotImplementedError saying why, if it can't).

    fp8=True quantizes float16/bfloat16 q, k and v to e4m3 on the fly (as `quantize_fp8` with one
    scale per FP8_BLOCK = 128 rows of each head; k and v per 192 rows at head dims 65-128 from 2048
    keys, the FP8 kernel's key block there: reference.fp8_key_block) and runs FP8 attention (as
    `attention_fp8`), out in q's dtype (reference.attention_quantized); hadamard=True also applies
    the random Hadamard transform to q and k first (incoherent processing: it cancels in q k^T and
    spreads outliers). No softcap with fp8. On Hopper it is one call of the fwd_quantized_sm90
    family, whose e4m3 copies are a workspace of its own (V's straight in the transposed layout the
    FP8 kernel loads), so CuPy arrays work here too (CuPy has no e4m3 dtype: quantize_fp8 and
    attention_fp8 refuse them). fast_exp=True as in `attention_fp8` (fp8=True, without return_lse).
    """
    return_lse = _check_flag("return_lse", return_lse)
    fp8, hadamard, fast_exp = _fp8_flags(fp8, hadamard, fast_exp, return_lse)
    if fp8:
        return _attention_quantized(q, k, v, causal, softmax_scale, window, softcap, return_lse, backend, hadamard,
                                    fast_exp)
    named = dict(q=q, k=k, v=v)
    features = (causal, softmax_scale, window, softcap)

    def check():
        infos = _describe_all(named)
        problem = _attention_problem("attention_forward", infos, features, backend)
        lse_shape = (problem.batch, problem.nheads, problem.seqlen_q)
        return problem, dict(out=(infos["q"].shape, problem.dtype), lse=(lse_shape, "float32"))

    out, lse = dispatch.run_checked(dispatch.call_signature("attention_forward", named, (*features, backend)),
                                    named, check)
    return (out, lse) if return_lse else out


def attention_backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
                       deterministic=False, backend=None):
    """Gradients (dq, dk, dv) of `attention` for the upstream gradient `dout`.

    out and lse are what the forward returned (lse float32 (batch, nheads, seqlen_q)); the keywords
    must be the forward's. dk and dv are summed over the query heads that share a kv head.
    deterministic=True gives bit-identical gradients from run to run: the GPU kernel adds the key
    blocks' parts of dq in a fixed order instead of as they finish, which costs some speed
    (benchmarks/NOTES-bwd_sm80.md). backend: as for `attention`.
    """
    deterministic = _check_flag("deterministic", deterministic)
    named = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)
    features = (causal, softmax_scale, window, softcap)

    def check():
        infos = _describe_all(named)
        problem = _attention_problem("attention_backward", {n: infos[n] for n in ("q", "k", "v")}, features, backend,
                                     deterministic)
        for name in ("dout", "out"):
            _check_shape(infos[name], infos["q"].shape, "(the shape of q)")
            _check_unit_last_stride(infos[name])
        _check_same_dtype([infos["q"], infos["dout"], infos["out"]])
        _check_lse(infos["lse"], (problem.batch, problem.nheads, problem.seqlen_q))
        return problem, dict(dq=(infos["q"].shape, problem.dtype), dk=(infos["k"].shape, problem.dtype),
                             dv=(infos["v"].shape, problem.dtype))

    signature = dispatch.call_signature("attention_backward", named, (*features, deterministic, backend))
    return dispatch.run_checked(signature, named, check)


def _check_lse(info: ArrayInfo, shape: tuple[int, ...]) -> None:
    if info.dtype != "float32":
        raise TypeError(f"lse must be float32 (as the forward returns it); got {info.dtype}")
    _check_shape(info, shape, "(as the forward returns it)")
    _check_unit_last_stride(info)


def backward_preprocess(dout, out):
    """delta = rowsum(dout * out) in float32, shape (batch, nheads, seqlen): the per-row term of the
    softmax gradient that the FlashAttention backward computes first (dS = P * (dP - delta))."""
    infos = _describe_all(dict(dout=dout, out=out))
    for info in infos.values():
        _check_rank(info, 4, _ATTENTION_LAYOUT)
        _check_unit_last_stride(info)
    _check_shape(infos["dout"], infos["out"].shape, "(the shape of out)")
    dtype = _check_same_dtype([infos["out"], infos["dout"]])
    _check_dtype_supported("backward_preprocess", infos["out"])
    batch, seqlen, nheads, headdim = infos["out"].shape
    problem = Problem(op="backward_preprocess", framework=infos["out"].framework, device=infos["out"].device,
                      dtype=dtype, batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, nheads=nheads,
                      nheads_kv=nheads, headdim=headdim)
    (delta,) = dispatch.run(problem, dict(dout=dout, out=out), dict(delta=((batch, nheads, seqlen), "float32")))
    return delta


# ----------------------------------------------------------------------------- varlen attention


def _check_cu_seqlens(name: str, info: ArrayInfo, x: Any, total: int, max_name: str, max_seqlen: Any) -> int:
    """Check one cu_seqlens array against the packed length; return the number of sequences. Its
    values are checked where they are, never copied: a host array's here (reference.check_cu_seqlens),
    a GPU array's by a kernel queued ahead of the attention kernel (kernels/check_cu_seqlens.py), a
    JAX tracer's where the program runs (that kernel, or cuflash/jax.py's callback on a CPU)."""
    if info.dtype != "int32":
        raise TypeError(f"{name} must be int32 prefix sums of the sequence lengths; got dtype {info.dtype}")
    if len(info.shape) != 1 or info.shape[0] < 2:
        raise ValueError(f"{name} must be 1-D of length batch + 1 >= 2; got shape {info.shape}")
    _check_unit_last_stride(info)
    if not isinstance(max_seqlen, (int, np.integer)) or isinstance(max_seqlen, bool):
        raise TypeError(f"{max_name} must be a non-negative int; got {max_seqlen!r}")
    if not 0 <= max_seqlen <= _INT32_MAX:
        raise ValueError(f"{max_name} must be in [0, {_INT32_MAX}]; got {max_seqlen}")
    if not info.device.is_cuda and not info.traced:
        reference.check_cu_seqlens(name, arrays.host_view(x), total, max_name, max_seqlen)
    return info.shape[0] - 1


def _varlen_problem(op: str, infos: dict[str, ArrayInfo], named: dict[str, Any], max_seqlen_q, max_seqlen_k,
                    features: tuple, backend: Any = None, deterministic: bool = False) -> Problem:
    q, k, v = infos["q"], infos["k"], infos["v"]
    for info in (q, k, v):
        _check_rank(info, 3, _VARLEN_LAYOUT)
    total_q, nheads, headdim = q.shape
    total_k, nheads_kv, _ = k.shape
    if k.shape[2] != headdim:
        raise ValueError(f"k has headdim {k.shape[2]} but q has headdim {headdim}; they must match")
    _check_shape(v, k.shape, "(the shape of k)")
    if headdim < 1:
        raise ValueError(f"q must have headdim >= 1; got shape {q.shape}")
    if nheads_kv < 1 or nheads % nheads_kv:
        raise ValueError(f"nheads of q ({nheads}) must be a multiple of nheads of k and v ({nheads_kv})")
    dtype = _check_same_dtype([q, k, v])
    for info in (q, k, v):
        _check_unit_last_stride(info)
    _check_dtype_supported(op, q)
    batch = _check_cu_seqlens("cu_seqlens_q", infos["cu_seqlens_q"], named["cu_seqlens_q"], total_q,
                              "max_seqlen_q", max_seqlen_q)
    batch_k = _check_cu_seqlens("cu_seqlens_k", infos["cu_seqlens_k"], named["cu_seqlens_k"], total_k,
                                "max_seqlen_k", max_seqlen_k)
    if batch_k != batch:
        raise ValueError(f"cu_seqlens_k describes {batch_k} sequences but cu_seqlens_q describes {batch}; "
                         "they must have the same length")
    return Problem(op=op, framework=q.framework, device=q.device, dtype=dtype, batch=batch,
                   seqlen_q=int(max_seqlen_q), seqlen_k=int(max_seqlen_k), nheads=nheads, nheads_kv=nheads_kv,
                   headdim=headdim, total_q=total_q, total_k=total_k, **_features(headdim, *features),
                   backend=_check_backend(backend, op, q.device), deterministic=deterministic)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *, causal=False,
                     softmax_scale=None, window=(-1, -1), softcap=0.0, return_lse=False, backend=None):
    """`attention` over packed sequences of different lengths.

    q: (total_q, nheads, headdim), k, v: (total_k, nheads_kv, headdim); sequence b is rows
    cu_seqlens[b]:cu_seqlens[b+1] (int32 prefix sums of length batch + 1, starting at 0);
    max_seqlen_q/max_seqlen_k bound the sequence lengths. Masks align bottom-right per sequence.
    lse: float32 (nheads, total_q). cu_seqlens values are checked where they are, with no copy and no
    synchronisation (so a CUDA graph may capture the call, and jax.jit checks them too): host arrays'
    with a ValueError; on a GPU by a kernel queued ahead of the attention kernel, which stops the
    program with a device-side assertion after printing the rule they break (the CUDA context is
    then lost, as after PyTorch's own device-side assertions). backend: as for `attention`.
    """
    return_lse = _check_flag("return_lse", return_lse)
    named = dict(q=q, k=k, v=v, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    features = (causal, softmax_scale, window, softcap)

    def check():
        infos = _describe_all(named)
        problem = _varlen_problem("attention_varlen_forward", infos, named, max_seqlen_q, max_seqlen_k, features,
                                  backend)
        return problem, dict(out=(infos["q"].shape, problem.dtype), lse=((problem.nheads, problem.total_q), "float32"))

    # remembered like `attention`'s calls: GPU cu_seqlens' values are not the host's to check
    signature = dispatch.call_signature("attention_varlen_forward", named,
                                        (max_seqlen_q, max_seqlen_k, *features, backend))
    out, lse = dispatch.run_checked(signature, named, check)
    return (out, lse) if return_lse else out


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *,
                              causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0, deterministic=False,
                              backend=None):
    """Gradients (dq, dk, dv) of `attention_varlen`; lse is float32 (nheads, total_q).
    deterministic and backend: as for `attention_backward`."""
    deterministic = _check_flag("deterministic", deterministic)
    named = dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse, cu_seqlens_q=cu_seqlens_q, cu_seqlens_k=cu_seqlens_k)
    features = (causal, softmax_scale, window, softcap)

    def check():
        infos = _describe_all(named)
        problem = _varlen_problem("attention_varlen_backward", infos, named, max_seqlen_q, max_seqlen_k, features,
                                  backend, deterministic)
        for name in ("dout", "out"):
            _check_shape(infos[name], infos["q"].shape, "(the shape of q)")
            _check_unit_last_stride(infos[name])
        _check_same_dtype([infos["q"], infos["dout"], infos["out"]])
        _check_lse(infos["lse"], (problem.nheads, problem.total_q))
        return problem, dict(dq=(infos["q"].shape, problem.dtype), dk=(infos["k"].shape, problem.dtype),
                             dv=(infos["v"].shape, problem.dtype))

    signature = dispatch.call_signature("attention_varlen_backward", named,
                                        (max_seqlen_q, max_seqlen_k, *features, deterministic, backend))
    return dispatch.run_checked(signature, named, check)


# ----------------------------------------------------------------------------- FP8 (e4m3)

FP8_DTYPE = "float8_e4m3fn"
FP8_OUT_DTYPES = ("bfloat16", "float16")
FP8_BLOCK = reference.FP8_BLOCK  # rows per block scale: q's; k's and v's unless FP8_WIDE_KEY_BLOCK
FP8_WIDE_KEY_BLOCK = reference.FP8_WIDE_KEY_BLOCK  # k's and v's at head dims 65-128 (kv_block; fp8=True: fp8_key_block)
_FP8_SEED = 0  # attention(..., fp8=True, hadamard=True): the transform's seed (any works: it cancels)


def _dtype_arg(name: str, value: Any, allowed: tuple[str, ...]) -> str:
    """A dtype given as a name or as a NumPy, ml_dtypes, torch or JAX dtype, by its canonical name."""
    if isinstance(value, str):
        canonical = value
    else:
        try:
            canonical = np.dtype(value).name
        except TypeError:  # torch.dtype
            canonical = str(value).removeprefix("torch.")
    if canonical not in allowed:
        raise TypeError(f"{name} must be one of {', '.join(allowed)}; got {value!r}")
    return canonical


def _check_descale(info: ArrayInfo, batch: int, nheads: int, seqlen: int, block: int = FP8_BLOCK,
                   block_arg: str = "") -> None:
    """A descale of (batch, nheads) or one per `block` rows (block_arg: the argument that says so)."""
    if info.dtype != "float32":
        raise TypeError(f"{info.name} must be float32 (as quantize_fp8 returns it); got {info.dtype}")
    per_head, per_block = (batch, nheads), (batch, nheads, reference.fp8_blocks(seqlen, block))
    if info.shape not in (per_head, per_block):
        raise ValueError(f"{info.name} must have shape {per_head} (one scale per head) or {per_block} (one scale "
                         f"per {block} rows of {seqlen}{block_arg}, the last block possibly short); got {info.shape}")
    _check_unit_last_stride(info)


def _check_wide_block(name: str, block: int, headdim: int) -> None:
    """Blocks of FP8_WIDE_KEY_BLOCK rows only at the head dims where the FP8 kernel's key block is that."""
    if block == FP8_WIDE_KEY_BLOCK and headdim not in reference.FP8_WIDE_HEADDIMS:
        wide = reference.FP8_WIDE_HEADDIMS
        raise ValueError(f"{name}={FP8_WIDE_KEY_BLOCK} (attention_fp8's key block at head dims {wide.start}-"
                         f"{wide.stop - 1}) needs a head dim there; got head dim {headdim}: use {FP8_BLOCK}")


def _check_hadamard_headdim(name: str, headdim: int) -> None:
    if headdim < 1 or headdim & (headdim - 1):
        raise ValueError(f"hadamard=True needs a head dim that is a power of two; {name} has {headdim}")


def quantize_fp8(x, *, block=None, hadamard=False, seed=0):
    """x (batch, seqlen, nheads, headdim), float16/bfloat16/float32 -> (x8, descale).

    x: float16 or bfloat16 (float32 too on the CPU reference); torch or JAX arrays on GPU (CuPy has
    no e4m3 dtype for x8; attention(..., fp8=True) quantizes CuPy arrays into buffers of its own).
    x8: float8_e4m3fn, x's shape; descale: float32 with x ~ x8 * descale, the largest magnitude
    (NaNs ignored) of each scale's rows mapped to e4m3's 448 (an all-zero group gets 1).
    block=None: one scale per (batch, head), descale (batch, nheads); block=128 (FP8_BLOCK): one
    scale per 128 rows of each head, descale (batch, nheads, ceil(seqlen / 128)), row r's scale at
    [..., r // 128] (the last block may be short), as attention_fp8 takes q's, and k's and v's by
    default; block=192 (FP8_WIDE_KEY_BLOCK, head dims 65-128 only): one per 192 rows, for k and v
    of attention_fp8(..., kv_block=192), the GPU kernel's key block at those head dims (it then
    runs as fast as with scales per head; with 128-row k and v scales it takes 128-key blocks:
    kv_block=192 measured 1.07x at 2k keys, 1.09x at 4k and 1.17x at 16k at head dim 128, causal
    1.06-1.11x, but 0.96x at 1k; H200, session 50).
    hadamard=True first multiplies the head dim by a Hadamard matrix with random
    signs drawn from `seed` (headdim a power of two): give q and k the same seed, and never
    transform v (reference.hadamard_matrix).
    """
    named = dict(x=x)

    def check():
        info = _describe_all(named)["x"]
        if info.framework == "cupy":
            raise TypeError("x is a CuPy array, and CuPy has no float8_e4m3fn dtype for x8: pass a torch tensor or a "
                            "JAX array (zero-copy from CuPy: torch.from_dlpack(x)), or let attention(q, k, v, "
                            "fp8=True) quantize CuPy arrays into buffers of its own")
        _check_rank(info, 4, _ATTENTION_LAYOUT)
        _check_unit_last_stride(info)
        _check_dtype_supported("quantize_fp8", info)
        rows, transform, _ = _quantize_options(block, hadamard, seed)
        batch, seqlen, nheads, headdim = info.shape
        if transform:
            _check_hadamard_headdim("x", headdim)
        if rows is not None:
            _check_wide_block("block", rows, headdim)
        problem = Problem(op="quantize_fp8", framework=info.framework, device=info.device, dtype=info.dtype,
                          batch=batch, seqlen_q=seqlen, seqlen_k=seqlen, nheads=nheads, nheads_kv=nheads,
                          headdim=headdim, fp8_block=rows, hadamard_seed=int(seed) if transform else None)
        descale_shape = (batch, nheads) if rows is None else (batch, nheads, reference.fp8_blocks(seqlen, rows))
        return problem, dict(x8=(info.shape, FP8_DTYPE), descale=(descale_shape, "float32"))

    return dispatch.run_checked(dispatch.call_signature("quantize_fp8", named, (block, hadamard, seed)), named, check)


def _block_rows(name: str, block: Any, expected: str) -> int:
    """A block size argument (`name`), FP8_BLOCK or FP8_WIDE_KEY_BLOCK, as a plain int."""
    if not isinstance(block, (int, np.integer)) or isinstance(block, bool):
        raise TypeError(f"{name} must be {expected}; got {block!r}")
    if block not in (FP8_BLOCK, FP8_WIDE_KEY_BLOCK):
        raise ValueError(f"{name} must be {expected}; got {block!r}")
    return int(block)


def kv_block_rows(kv_block: Any) -> int:
    """attention_fp8's kv_block, checked: a plain int."""
    return _block_rows("kv_block", kv_block, f"{FP8_BLOCK} or {FP8_WIDE_KEY_BLOCK} (rows per k and v descale where "
                                             f"those are per block)")


def _quantize_options(block: Any, hadamard: Any, seed: Any) -> tuple[int | None, bool, int]:
    """quantize_fp8's block, hadamard and seed, checked: (block, hadamard, seed) as plain Python values."""
    if block is not None:
        block = _block_rows("block", block, f"None (one scale per head), {FP8_BLOCK} or {FP8_WIDE_KEY_BLOCK} (one "
                            f"scale per that many rows: attention_fp8 takes q's per {FP8_BLOCK}, k's and v's per "
                            f"its kv_block)")
    transform = _check_flag("hadamard", hadamard)
    if not isinstance(seed, (int, np.integer)) or isinstance(seed, bool):
        raise TypeError(f"seed must be an int >= 0; got {seed!r}")
    if seed < 0:
        raise ValueError(f"seed must be an int >= 0; got {seed!r}")
    return block, bool(transform), int(seed)


def attention_fp8(q8, k8, v8, q_descale, k_descale, v_descale, *, causal=False, window=(-1, -1), softmax_scale=None,
                  out_dtype="bfloat16", return_lse=False, kv_block=FP8_BLOCK, fast_exp=False, backend=None):
    """`attention` on e4m3 inputs: q8 (batch, seqlen_q, nheads, headdim), k8 and v8 (batch, seqlen_k,
    nheads_kv, headdim), float8_e4m3fn, with float32 descale factors (quantize_fp8's): each of shape
    (batch, heads) (one scale per head) or one scale per block of rows of its own tensor: q's
    (batch, nheads, ceil(seqlen_q / 128)) (FP8_BLOCK; row r takes [..., r // 128], the last block may
    be short), k's and v's (batch, nheads_kv, ceil(seqlen_k / kv_block)), kv_block 128 or, at head
    dims 65-128, 192 (quantize_fp8(..., block=192)): the Hopper kernel's key block there, which
    from 2k keys runs 7-17% faster than 128-row k and v scales (quantize_fp8's block; with
    per-head ones it takes that block too), V always transposed beforehand into a scratch buffer
    (below). Decode steps (one query row) do not split their keys over CTAs with 192-row k and v
    scales: keep 128 there. A descale does not say its block size: at 193 to 256 rows (two blocks
    either way) one quantized per 192 rows passed as per 128 (q's always; k's and v's with
    kv_block=128), or the other way round, is read with the wrong rows per scale, silently.
    Computes attention of q8 * q_descale, k8 * k_descale and v8 * v_descale, each descale expanded
    to its rows (masks, GQA and the scale as in `attention`); out in out_dtype
    (bfloat16 or float16), lse float32 (batch, nheads, seqlen_q) with return_lse=True. Descales
    must be positive and finite, as quantize_fp8 makes them: the GPU kernel folds q's and k's into
    the softmax scale (which must stay positive) and divides by v's; their values are not read on
    the host to check. On Hopper at head dim 256 with more than 512 query rows, or from 256 with no
    more keys than query rows (at 128, more than 1024, or 2048 under a causal mask or window; at
    64, more than 4096) the call also allocates, through the caller's framework, a scratch buffer
    the size of v8 for V transposed.
    Without return_lse, the Hopper kernel at head dims 64 and 128 (and 256 beyond 512 query rows,
    or from 256 with no more keys) divides out by the row sums of P as rounded to e4m3 (the weights
    P V multiplies, summed on the tensor cores a key block at a time, then in fp32; out's error is
    that of the fp32 sums). There at 256 with per-head descales it keeps a running maximum up to
    2^3 stale, skipping O's rescale while no row's maximum rose more (P's e4m3 range 3 binades
    narrower: 4-6% faster). At 64 and 128 it takes some of P's exponentials from a quadratic on the
    FMA pipe (relative error up to 2.1e-3, below P's rounding to e4m3) instead of the
    special-function unit (at 64 up to 4096 query rows, unmasked only): such calls run 2-12%
    faster. With return_lse, where V is transposed beforehand at 128 (with per-head descales or
    kv_block=192, unmasked only) and at 64 (per-128-row descales, unmasked only), some pairs of P's exponentials
    come from a cubic in f16x2 arithmetic on the FMA pipe (relative error up to 5.5e-4 near each row's
    maximum, within the LSE's bound): 1.5-4.5% faster.
    fast_exp=True (only without return_lse) lets the Hopper kernel take P's e4m3 codes straight from
    the scores where it sums P's rows on the tensor cores (the rows above; not the split-KV decode
    steps, nor head dim 256 up to 512 query rows): one FFMA and a clamp a score, no exponential. A
    code is 8 (e + 7) + m for 2^e (1 + m / 8); rounding 8 log2(P) to an integer gives 2^y with its
    mantissa linear within each binade: each weight within 8% of exp's where e4m3's rounding alone
    is within 6% (RMS 3.1% against 2.65%). On an H200 such calls ran 3-15% faster (head dim 128
    +10-12% from 4k keys, 64 +9-15%, 256 +3-7.5%), with out's RMS error against float64 3-11% higher
    (FP8's outlier study; benchmarks/results/h200-fwd-fp8-session53.md and
    h200-fp8-accuracy-session53.md). The reference backend computes P exactly either way.
    """
    return_lse = _check_flag("return_lse", return_lse)
    fast_exp = _check_fast_exp(fast_exp, return_lse)
    named = dict(q8=q8, k8=k8, v8=v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    features = (causal, softmax_scale, window, 0.0)

    def check():
        dtype = _dtype_arg("out_dtype", out_dtype, FP8_OUT_DTYPES)
        infos = _describe_all(named)
        for name in ("q8", "k8", "v8"):
            if infos[name].dtype != FP8_DTYPE:
                hint = ("; CuPy has no e4m3 dtype: attention(q, k, v, fp8=True) quantizes CuPy arrays into buffers "
                        "of its own" if infos[name].framework == "cupy" else "")
                raise TypeError(f"{name} must be {FP8_DTYPE} (cuflash.quantize_fp8 makes it); got {infos[name].dtype}"
                                + hint)
        problem = _attention_problem("attention_fp8_forward", dict(q=infos["q8"], k=infos["k8"], v=infos["v8"]),
                                     features, backend)
        # Without the LSE the kernel may normalise by the sums of P as rounded to e4m3 (fwd_sm90,
        # FP8_TENSOR_ROW_SUMS), which O's error does not feel but the LSE would.
        rows = kv_block_rows(kv_block)
        _check_wide_block("kv_block", rows, problem.headdim)
        _check_descale(infos["q_descale"], problem.batch, problem.nheads, problem.seqlen_q)
        for name in ("k_descale", "v_descale"):
            _check_descale(infos[name], problem.batch, problem.nheads_kv, problem.seqlen_k, rows,
                           f" (kv_block={rows})")
        # fp8_block: FP8_WIDE_KEY_BLOCK where k's or v's descales are per 192 rows (else None)
        wide = rows == FP8_WIDE_KEY_BLOCK and any(len(infos[name].shape) == 3 for name in ("k_descale", "v_descale"))
        problem = dataclasses.replace(problem, out_dtype=dtype, with_lse=return_lse,
                                      fp8_block=FP8_WIDE_KEY_BLOCK if wide else None, fast_exp=fast_exp)
        return problem, _fp8_outputs(problem)

    inputs = dict(q=q8, k=k8, v=v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)
    signature = dispatch.call_signature("attention_fp8_forward", named,
                                        (*features, out_dtype, backend, return_lse, kv_block, fast_exp))
    results = dispatch.run_checked(signature, inputs, check)
    return tuple(results) if return_lse else results[0]


def _fp8_outputs(problem: Problem) -> dict:
    """The outputs of an FP8 attention problem: out (q's shape, out_dtype), and lse where with_lse."""
    outputs = dict(out=((problem.batch, problem.seqlen_q, problem.nheads, problem.headdim), problem.out_dtype))
    if problem.with_lse:
        outputs["lse"] = ((problem.batch, problem.nheads, problem.seqlen_q), "float32")
    return outputs


def _attention_quantized(q, k, v, causal, softmax_scale, window, softcap, return_lse, backend, hadamard, fast_exp):
    """attention(..., fp8=True): one op (attention_quantized_forward: q, k and v quantized per
    FP8_BLOCK rows, q and k after the transform where asked, then FP8 attention; the e4m3 copies are
    the launch's own workspace), out in q's dtype. Flags checked (attention, _fp8_flags)."""
    named = dict(q=q, k=k, v=v)

    def check():
        infos = _describe_all(named)
        dtype = infos["q"].dtype
        if dtype not in FP8_OUT_DTYPES:
            raise TypeError(f"fp8=True quantizes float16 or bfloat16 q, k and v; q has dtype {dtype}")
        if _finite_float("softcap", softcap, "0 with fp8=True") != 0:
            raise ValueError(f"softcap is not supported with fp8=True; got softcap={softcap}")
        problem = _attention_problem("attention_quantized_forward", infos, (causal, softmax_scale, window, softcap),
                                     backend)
        if hadamard:
            _check_hadamard_headdim("q", problem.headdim)
        # Without the LSE the kernel may normalise by the sums of P as rounded to e4m3 (as attention_fp8).
        problem = dataclasses.replace(problem, out_dtype=dtype, with_lse=return_lse, fp8_block=FP8_BLOCK,
                                      hadamard_seed=_FP8_SEED if hadamard else None, fast_exp=fast_exp)
        return problem, _fp8_outputs(problem)

    signature = dispatch.call_signature("attention_quantized_forward", named,
                                        (causal, softmax_scale, window, softcap, backend, hadamard, return_lse,
                                         fast_exp))
    results = dispatch.run_checked(signature, named, check)
    return tuple(results) if return_lse else results[0]
