"""The argument contract of the public API (cuflash.api), on CPU arrays only.

Bad input must be refused with a ValueError or TypeError that names the argument, says what was
given and what is expected, before any kernel runs (here: before `dispatch.run`, which the
refusal tests replace by a function that fails loudly). Valid but unusual input (strided views,
GQA, seqlen_q != seqlen_k, seqlen 1, half precision, torch and JAX arrays, zero-length varlen
sequences) must be accepted and give the reference result, in the caller's framework and dtype.

Sections:
  1. a table of bad calls (NumPy, torch CPU, JAX CPU), for the dense and varlen forward and both
     backwards (and `api.backward_preprocess`);
  2. valid unusual inputs, checked against a naive attention written here, torch autograd, the
     NumPy reference and the NumPy call on the same data;
  3. no argument check depends on the values of the arrays (NaN data, JAX tracers).
"""
from __future__ import annotations

import dataclasses
import math
import re
import os
import sys
from typing import Any

import ml_dtypes
import numpy as np
import pytest

try:
    import cuflash
except ImportError:  # running from a checkout without installing the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import cuflash

import jax
import jax.numpy as jnp
import torch

from cuflash import api, arrays, dispatch, reference

BF16 = np.dtype(ml_dtypes.bfloat16)

# Default problem of the refusal table: dense (B, S, H, D) and varlen (T, H, D).
B, SQ, SK, H, HKV, D = 2, 5, 7, 4, 2, 8
CU_Q, CU_K = (0, 2, 5), (0, 3, 7)  # sequence lengths q: 2, 3; k: 3, 4
TQ, TK, MAXQ, MAXK = 5, 7, 3, 4

# Each op: the function and its positional argument names.
OPS = {
    "fwd": (cuflash.attention, ("q", "k", "v")),
    "bwd": (cuflash.attention_backward, ("dout", "q", "k", "v", "out", "lse")),
    "vfwd": (cuflash.attention_varlen,
             ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")),
    "vbwd": (cuflash.attention_varlen_backward,
             ("dout", "q", "k", "v", "out", "lse", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")),
    "pre": (api.backward_preprocess, ("dout", "out")),
}
DENSE, VARLEN = ("fwd", "bwd"), ("vfwd", "vbwd")
QKV_OPS = DENSE + VARLEN
FORWARDS, BACKWARDS = ("fwd", "vfwd"), ("bwd", "vbwd")


# ----------------------------------------------------------------------------- framework helpers


def rnd(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def to_torch(x):
    if not isinstance(x, np.ndarray):
        return x
    if x.size == 0:  # torch's own strides, not NumPy's all-zero strides of an empty array
        return torch.empty(x.shape, dtype=TORCH_DTYPES[x.dtype.name])
    if x.dtype == BF16:
        return torch.from_numpy(np.ascontiguousarray(x).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(np.ascontiguousarray(x))


def to_jax(x):
    return jnp.asarray(x) if isinstance(x, np.ndarray) else x


def to_numpy(x):
    """Host NumPy copy of a NumPy / torch / JAX array (bfloat16 as ml_dtypes')."""
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.dtype == torch.bfloat16:
            return x.view(torch.int16).numpy().view(BF16).copy()
        return x.numpy().copy()
    return np.array(x)


CONVERT = {"numpy": lambda x: x, "torch": to_torch, "jax": to_jax}

TORCH_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32,
                "float64": torch.float64, "int32": torch.int32, "int64": torch.int64,
                "complex64": torch.complex64, "bool": torch.bool, "uint8": torch.uint8}


def astype(x, name: str):
    if isinstance(x, torch.Tensor):
        return x.to(TORCH_DTYPES[name])
    if isinstance(x, np.ndarray):
        return x.astype(BF16 if name == "bfloat16" else name)
    return x.astype(jnp.bfloat16 if name == "bfloat16" else name)


def widen(x):
    """The same values with stride 2 on the last dimension."""
    if isinstance(x, torch.Tensor):
        return torch.repeat_interleave(x, 2, dim=-1)[..., ::2]
    return np.repeat(x, 2, axis=-1)[..., ::2]


def base_args(op: str) -> dict[str, Any]:
    """A valid call of `op` (float32 NumPy; lse values are irrelevant to the checks)."""
    rng = np.random.default_rng(0)
    if op in VARLEN:
        return dict(q=rnd(rng, (TQ, H, D)), k=rnd(rng, (TK, HKV, D)), v=rnd(rng, (TK, HKV, D)),
                    dout=rnd(rng, (TQ, H, D)), out=rnd(rng, (TQ, H, D)), lse=np.zeros((H, TQ), np.float32),
                    cu_seqlens_q=np.array(CU_Q, np.int32), cu_seqlens_k=np.array(CU_K, np.int32),
                    max_seqlen_q=MAXQ, max_seqlen_k=MAXK)
    return dict(q=rnd(rng, (B, SQ, H, D)), k=rnd(rng, (B, SK, HKV, D)), v=rnd(rng, (B, SK, HKV, D)),
                dout=rnd(rng, (B, SQ, H, D)), out=rnd(rng, (B, SQ, H, D)), lse=np.zeros((B, H, SQ), np.float32))


# ----------------------------------------------------------------------------- 1. refusal table


@dataclasses.dataclass(frozen=True)
class Bad:
    op: str
    fw: str
    changes: tuple  # (name, value or function of the argument dict)
    kwargs: tuple
    exc: type
    match: str

    def build(self):
        fn, names = OPS[self.op]
        a = {n: CONVERT[self.fw](x) for n, x in base_args(self.op).items()}
        for name, change in self.changes:
            a[name] = change(a) if callable(change) else change
        return fn, [a[n] for n in names], dict(self.kwargs)


BAD: list = []


def bad(ops, label, exc, match, fw="numpy", kw=None, **changes):
    for op in (ops,) if isinstance(ops, str) else ops:
        case = Bad(op, fw, tuple(changes.items()), tuple((kw or {}).items()), exc, match)
        BAD.append(pytest.param(case, id=f"{op}-{fw}-{label}"))


def _all(names, fn):
    """Changes applying fn to each named argument."""
    return {n: (lambda a, n=n: fn(a[n])) for n in names}


def _rank_cases():
    for ops, rank in ((DENSE, 4), (VARLEN, 3)):
        bad(ops, "q-rank-plus-1", ValueError, rf"^q must have {rank} dimensions.*got shape", q=lambda a: a["q"][None])
        bad(ops, "k-rank-minus-1", ValueError, rf"^k must have {rank} dimensions", k=lambda a: a["k"][0])
        bad(ops, "v-rank-plus-1", ValueError, rf"^v must have {rank} dimensions", v=lambda a: a["v"][..., None])
        bad(ops, "q-0d", ValueError, rf"^q must have {rank} dimensions", q=np.zeros((), np.float32))
    bad(DENSE, "k-batch", ValueError, r"^k has batch 1 but q has batch 2.*must match", k=lambda a: a["k"][:1])
    bad(DENSE, "v-batch", ValueError, r"^v must have shape \(2, 7, 2, 8\) \(the shape of k\); got \(1,",
        v=lambda a: a["v"][:1])
    bad(QKV_OPS, "k-headdim", ValueError, r"^k has headdim 4 but q has headdim 8.*must match", k=lambda a: a["k"][..., :4])
    bad(QKV_OPS, "v-headdim", ValueError, r"^v must have shape .*shape of k", v=lambda a: a["v"][..., :4])
    bad(DENSE, "v-seqlen", ValueError, r"^v must have shape .*shape of k", v=lambda a: a["v"][:, :-1])
    bad(VARLEN, "v-tokens", ValueError, r"^v must have shape .*shape of k", v=lambda a: a["v"][:-1])
    bad(QKV_OPS, "v-nheads", ValueError, r"^v must have shape .*shape of k", v=lambda a: a["v"][..., :1, :])
    bad(QKV_OPS, "nheads-not-divisible", ValueError, r"nheads of q \(3\) must be a multiple of nheads of k and v \(2\)",
        q=lambda a: a["q"][..., :3, :], dout=lambda a: a["dout"][..., :3, :], out=lambda a: a["out"][..., :3, :])
    bad(QKV_OPS, "nheads-kv-0", ValueError, r"nheads of q \(4\) must be a multiple of nheads of k and v \(0\)",
        **_all("kv", lambda x: x[..., :0, :]))
    bad(QKV_OPS, "headdim-0", ValueError, r"^q must have headdim >= 1",
        **_all(("q", "k", "v", "dout", "out"), lambda x: x[..., :0]))


def _dtype_cases():
    for dt in ("int32", "int64", "uint8", "complex64", "bool"):
        bad(QKV_OPS, f"qkv-{dt}", TypeError, rf"^q has dtype {dt}, which cuflash does not support.*expected one of.*float32",
            **_all("qkv", lambda x, dt=dt: astype(x, dt)))
    bad(QKV_OPS, "qkv-object", TypeError, r"^q has dtype object.*expected one of",
        **_all("qkv", lambda x: x.astype(object)))
    bad(QKV_OPS, "k-float64", TypeError, r"^k has dtype float64 but q has float32.*share one dtype",
        k=lambda a: a["k"].astype(np.float64))
    bad(QKV_OPS, "v-float16", TypeError, r"^v has dtype float16 but q has float32.*share one dtype",
        v=lambda a: a["v"].astype(np.float16))
    bad(QKV_OPS, "v-bfloat16", TypeError, r"^v has dtype bfloat16 but q has float32", v=lambda a: a["v"].astype(BF16))
    for fw in ("torch", "jax"):
        bad(QKV_OPS, "qkv-int32", TypeError, r"^q has dtype int32.*expected one of", fw=fw,
            **_all("qkv", lambda x: astype(x, "int32")))
        bad(QKV_OPS, "k-float16", TypeError, r"^k has dtype float16 but q has float32", fw=fw,
            k=lambda a: astype(a["k"], "float16"))
    bad(QKV_OPS, "qkv-complex64", TypeError, r"^q has dtype complex64.*expected one of", fw="torch",
        **_all("qkv", lambda x: astype(x, "complex64")))


def _not_an_array_cases():
    bad(QKV_OPS, "q-list", TypeError, r"^q must be a NumPy, CuPy, PyTorch or JAX array; got builtins\.list",
        q=lambda a: a["q"].tolist())
    bad(QKV_OPS, "k-None", TypeError, r"^k must be a NumPy.*array; got builtins\.NoneType", k=None)
    bad(QKV_OPS, "v-numpy-scalar", TypeError, r"^v must be a NumPy.*array; got numpy\.float32", v=np.float32(1))
    bad(BACKWARDS, "dout-list", TypeError, r"^dout must be a NumPy.*array; got builtins\.list",
        dout=lambda a: a["dout"].tolist())
    bad(BACKWARDS, "out-tuple", TypeError, r"^out must be a NumPy.*array; got builtins\.tuple",
        out=lambda a: tuple(a["out"].tolist()))
    bad(BACKWARDS, "lse-float", TypeError, r"^lse must be a NumPy.*array; got builtins\.float", lse=0.0)
    bad(VARLEN, "cu_seqlens_q-list", TypeError, r"^cu_seqlens_q must be a NumPy.*array; got builtins\.list",
        cu_seqlens_q=list(CU_Q))
    bad(VARLEN, "cu_seqlens_k-tuple", TypeError, r"^cu_seqlens_k must be a NumPy.*array; got builtins\.tuple",
        cu_seqlens_k=CU_K)


def _framework_device_cases():
    bad(QKV_OPS, "k-torch", TypeError, r"^k is a torch array but (q|dout) is a numpy array; pass arrays of one framework",
        k=lambda a: to_torch(a["k"]))
    bad(QKV_OPS, "v-jax", TypeError, r"^v is a jax array but (q|dout) is a numpy array", v=lambda a: to_jax(a["v"]))
    bad(QKV_OPS, "k-numpy", TypeError, r"^k is a numpy array but (q|dout) is a torch array", fw="torch",
        k=lambda a: a["k"].numpy())
    bad(QKV_OPS, "k-numpy", TypeError, r"^k is a numpy array but (q|dout) is a jax array", fw="jax",
        k=lambda a: np.asarray(a["k"]))
    bad(BACKWARDS, "lse-torch", TypeError, r"^lse is a torch array but dout is a numpy array",
        lse=lambda a: to_torch(a["lse"]))
    bad(BACKWARDS, "dout-numpy", TypeError, r"^q is a torch array but dout is a numpy array", fw="torch",
        dout=lambda a: a["dout"].numpy())
    bad(VARLEN, "cu_seqlens_q-torch", TypeError, r"^cu_seqlens_q is a torch array but (q|dout) is a numpy array",
        cu_seqlens_q=lambda a: to_torch(a["cu_seqlens_q"]))
    bad(VARLEN, "cu_seqlens_k-numpy", TypeError, r"^cu_seqlens_k is a numpy array but (q|dout) is a jax array", fw="jax",
        cu_seqlens_k=np.array(CU_K, np.int32))
    bad("pre", "out-torch", TypeError, r"^out is a torch array but dout is a numpy array", out=lambda a: to_torch(a["out"]))
    # torch devices other than cpu/cuda: all on 'meta', or one of them.
    meta = lambda x: torch.empty(x.shape, dtype=x.dtype, device="meta")  # noqa: E731
    bad(QKV_OPS, "q-meta", ValueError, r"^q is on torch device meta; cuflash runs on 'cpu'", fw="torch",
        q=lambda a: meta(a["q"]))
    bad(QKV_OPS, "k-meta", ValueError, r"^k is on torch device meta", fw="torch", k=lambda a: meta(a["k"]))
    bad(BACKWARDS, "lse-meta", ValueError, r"^lse is on torch device meta", fw="torch", lse=lambda a: meta(a["lse"]))


def _stride_cases():
    names = {"fwd": "qkv", "vfwd": "qkv", "bwd": ("dout", "q", "k", "v", "out"), "vbwd": ("dout", "q", "k", "v", "out"),
             "pre": ("dout", "out")}
    for op, ns in names.items():
        for n in ns:
            bad(op, f"{n}-stride-2", ValueError,
                rf"^{n} must have unit stride on its last dimension; got strides \(.*, 2\).*numpy\.ascontiguousarray\(x\)",
                **{n: lambda a, n=n: widen(a[n])})
            bad(op, f"{n}-stride-2", ValueError, rf"^{n} must have unit stride on its last.*x\.contiguous\(\)",
                fw="torch", **{n: lambda a, n=n: widen(a[n])})
    bad(QKV_OPS, "q-reversed", ValueError, r"^q must have unit stride.*-1\).*ascontiguousarray",
        q=lambda a: a["q"][..., ::-1])
    bad(QKV_OPS, "v-broadcast", ValueError, r"^v must have unit stride.*0\).*ascontiguousarray",
        v=lambda a: np.broadcast_to(a["v"][..., :1], a["v"].shape))
    bad(QKV_OPS, "k-transposed-last", ValueError, r"^k must have unit stride.*contiguous\(\)", fw="torch",
        k=lambda a: a["k"].transpose(-1, -2).contiguous().transpose(-1, -2))


def _feature_cases():
    cases = [
        ("window-left-minus-2", ValueError, r"^window values must be in \[-1, .*got \(-2, 0\)", dict(window=(-2, 0))),
        ("window-right-minus-5", ValueError, r"^window values must be in \[-1, .*got \(3, -5\)", dict(window=(3, -5))),
        ("window-triple", TypeError, r"^window must be a pair of ints.*got \(1, 2, 3\)", dict(window=(1, 2, 3))),
        ("window-single", TypeError, r"^window must be a pair of ints", dict(window=(4,))),
        ("window-int", TypeError, r"^window must be a pair of ints.*got 4", dict(window=4)),
        ("window-None", TypeError, r"^window must be a pair of ints.*got None", dict(window=None)),
        ("window-float", TypeError, r"^window must be a pair of ints.*got \(1\.0, 2\)", dict(window=(1.0, 2))),
        ("window-bool", TypeError, r"^window must be a pair of ints", dict(window=(True, 0))),
        ("window-str", TypeError, r"^window must be a pair of ints", dict(window="ab")),
        ("window-ndarray", TypeError, r"^window must be a pair of ints", dict(window=np.array([2, 0]))),
        ("causal-window-right-1", ValueError, r"causal=True.*window.*right", dict(causal=True, window=(-1, 1))),
        ("causal-window-right-4", ValueError, r"causal=True.*window", dict(causal=True, window=(2, 4))),
        ("causal-int", TypeError, r"^causal must be a bool; got 1", dict(causal=1)),
        ("causal-str", TypeError, r"^causal must be a bool", dict(causal="yes")),
        ("softcap-negative", ValueError, r"^softcap must be a finite float >= 0.*got -1\.0", dict(softcap=-1.0)),
        ("softcap-negative-int", ValueError, r"^softcap must be a finite float >= 0", dict(softcap=-3)),
        ("softcap-nan", ValueError, r"^softcap must be a finite float.*got nan", dict(softcap=float("nan"))),
        ("softcap-inf", ValueError, r"^softcap must be a finite float.*got inf", dict(softcap=math.inf)),
        ("softcap-np-nan", ValueError, r"^softcap must be a finite", dict(softcap=np.float32("nan"))),
        ("softcap-str", TypeError, r"^softcap must be a finite float >= 0.*; got '1'", dict(softcap="1")),
        ("softcap-None", TypeError, r"^softcap must be a finite float >= 0.*; got None", dict(softcap=None)),
        ("softcap-bool", TypeError, r"^softcap must be a finite float >= 0.*; got True", dict(softcap=True)),
        ("softmax_scale-nan", ValueError, r"^softmax_scale must be a finite float.*; got nan", dict(softmax_scale=math.nan)),
        ("softmax_scale-inf", ValueError, r"^softmax_scale must be a finite float.*; got inf", dict(softmax_scale=math.inf)),
        ("softmax_scale-minus-inf", ValueError, r"^softmax_scale must be a finite float.*", dict(softmax_scale=-math.inf)),
        ("softmax_scale-np-inf", ValueError, r"^softmax_scale must be a finite float.*", dict(softmax_scale=np.float64("inf"))),
        ("softmax_scale-str", TypeError, r"^softmax_scale must be a finite float > 0, or None.*got '0\.5'", dict(softmax_scale="0.5")),
        ("softmax_scale-list", TypeError, r"^softmax_scale must be a finite float > 0, or None", dict(softmax_scale=[0.5])),
        ("softmax_scale-complex", TypeError, r"^softmax_scale must be a finite float > 0, or None", dict(softmax_scale=1j)),
        ("softmax_scale-bool", TypeError, r"^softmax_scale must be a finite float > 0, or None", dict(softmax_scale=True)),
        ("softmax_scale-tensor", TypeError, r"^softmax_scale must be a finite float > 0, or None", dict(softmax_scale=torch.tensor(0.5))),
        # Python ints too large for a float: still bad input, to be refused naming the argument.
        ("softcap-huge-int", ValueError, r"^softcap must be a finite", dict(softcap=10 ** 400)),
        ("softmax_scale-zero", ValueError, r"^softmax_scale must be a finite float > 0.*got 0", dict(softmax_scale=0.0)),
        ("softmax_scale-negative", ValueError, r"^softmax_scale must be a finite float > 0.*got -0\.5", dict(softmax_scale=-0.5)),
        ("softmax_scale-huge-int", ValueError, r"^softmax_scale must be a finite float.*", dict(softmax_scale=10 ** 400)),
    ]
    for label, exc, match, kw in cases:
        bad(QKV_OPS, label, exc, match, kw=kw)
    for label, value in (("1", 1), ("None", None), ("str", "True"), ("array", np.array(True))):
        bad(FORWARDS, f"return_lse-{label}", TypeError, r"^return_lse must be a bool; got", kw=dict(return_lse=value))
    for label, value in (("1", 1), ("None", None), ("str", "True"), ("array", np.array(True))):
        bad(BACKWARDS, f"deterministic-{label}", TypeError, r"^deterministic must be a bool; got",
            kw=dict(deterministic=value))
    for label, value in (("unknown", "sm70"), ("family-name", "fwd_sm90"), ("int", 90), ("upper", "SM90")):
        bad(FORWARDS, f"backend-{label}", ValueError, r"^backend must be None \(cuflash chooses\) or one of \['sm80', 'sm90'\]",
            kw=dict(backend=value))
        bad(BACKWARDS, f"backend-{label}", ValueError, r"^backend must be None \(cuflash chooses\) or one of \['sm80', 'sm90'\]",
            kw=dict(backend=value))
    # On CPU arrays a kernel backend cannot run: nothing is copied to a GPU behind the caller's back.
    bad(FORWARDS, "backend-on-cpu", ValueError, r"^backend='sm90' names a GPU kernel family, but the arrays are on cpu",
        kw=dict(backend="sm90"))
    bad(BACKWARDS, "backend-on-cpu", ValueError, r"^backend='sm80' names a GPU kernel family, but the arrays are on cpu",
        kw=dict(backend="sm80"))


def _backward_cases():
    bad(BACKWARDS, "dout-shape", ValueError, r"^dout must have shape .* \(the shape of q\); got",
        dout=lambda a: a["dout"][..., :3, :])
    bad(BACKWARDS, "out-shape", ValueError, r"^out must have shape .* \(the shape of q\); got", out=lambda a: a["out"][:-1])
    bad(BACKWARDS, "dout-rank", ValueError, r"^dout must have shape", dout=lambda a: a["dout"][None])
    bad(BACKWARDS, "dout-float64", TypeError, r"^dout has dtype float64 but q has float32.*share one dtype",
        dout=lambda a: a["dout"].astype(np.float64))
    bad(BACKWARDS, "out-float16", TypeError, r"^out has dtype float16 but q has float32", out=lambda a: a["out"].astype(np.float16))
    bad(BACKWARDS, "out-bfloat16", TypeError, r"^out has dtype bfloat16 but q has float32", fw="torch",
        out=lambda a: astype(a["out"], "bfloat16"))
    for dt in ("float64", "float16", "int32"):
        bad(BACKWARDS, f"lse-{dt}", TypeError, rf"^lse must be float32 .*got {dt}", lse=lambda a, dt=dt: a["lse"].astype(dt))
    bad(BACKWARDS, "lse-bfloat16", TypeError, r"^lse must be float32 .*got bfloat16", fw="torch",
        lse=lambda a: astype(a["lse"], "bfloat16"))
    # lse of half-precision q/k/v is still float32; lse in q's dtype is refused.
    bad(BACKWARDS, "lse-like-q", TypeError, r"^lse must be float32 .*got float16",
        **_all(("dout", "q", "k", "v", "out", "lse"), lambda x: x.astype(np.float16)))
    bad("bwd", "lse-transposed", ValueError, r"^lse must have shape \(2, 4, 5\) \(as the forward returns it\); got \(2, 5, 4\)",
        lse=lambda a: np.ascontiguousarray(a["lse"].transpose(0, 2, 1)))
    bad("bwd", "lse-no-batch", ValueError, r"^lse must have shape \(2, 4, 5\)", lse=lambda a: a["lse"][0])
    bad("vbwd", "lse-transposed", ValueError, r"^lse must have shape \(4, 5\) \(as the forward returns it\); got \(5, 4\)",
        lse=lambda a: np.ascontiguousarray(a["lse"].T))
    bad("vbwd", "lse-dense-layout", ValueError, r"^lse must have shape \(4, 5\)", lse=lambda a: a["lse"][None])
    bad(BACKWARDS, "lse-shape", ValueError, r"^lse must have shape", fw="torch", lse=lambda a: a["lse"][..., :-1])
    # Like every other array a kernel reads, lse needs unit stride on its last dimension.
    bad(BACKWARDS, "lse-stride-2", ValueError, r"^lse must have unit stride.*ascontiguousarray", lse=lambda a: widen(a["lse"]))
    bad(BACKWARDS, "lse-stride-2", ValueError, r"^lse must have unit stride.*contiguous\(\)", fw="torch",
        lse=lambda a: widen(a["lse"]))
    # backward_preprocess
    bad("pre", "dout-rank", ValueError, r"^dout must have 4 dimensions", dout=lambda a: a["dout"][0])
    bad("pre", "out-rank", ValueError, r"^out must have 4 dimensions", out=lambda a: a["out"][None])
    bad("pre", "dout-shape", ValueError, r"^dout must have shape .*\(the shape of out\)", dout=lambda a: a["dout"][:, :-1])
    bad("pre", "dout-float64", TypeError, r"^dout has dtype float64 but out has float32", dout=lambda a: a["dout"].astype(np.float64))
    bad("pre", "int32", TypeError, r"^out has dtype int32.*expected one of", **_all(("dout", "out"), lambda x: x.astype(np.int32)))
    bad("pre", "dout-list", TypeError, r"^dout must be a NumPy", dout=lambda a: a["dout"].tolist())


def _varlen_cases():
    i32 = lambda *v: np.array(v, np.int32)  # noqa: E731
    for side, other_cu, total, maxlen in (("q", CU_Q, TQ, MAXQ), ("k", CU_K, TK, MAXK)):
        cu, mx = f"cu_seqlens_{side}", f"max_seqlen_{side}"
        bad(VARLEN, f"{cu}-int64", TypeError, rf"^{cu} must be int32 .*got dtype int64", **{cu: np.array(other_cu, np.int64)})
        bad(VARLEN, f"{cu}-uint32", TypeError, rf"^{cu} must be int32 .*got dtype uint32", **{cu: np.array(other_cu, np.uint32)})
        bad(VARLEN, f"{cu}-float32", TypeError, rf"^{cu} must be int32", **{cu: np.array(other_cu, np.float32)})
        bad(VARLEN, f"{cu}-2d", ValueError, rf"^{cu} must be 1-D of length batch \+ 1.*got shape \(1, 3\)",
            **{cu: np.array([other_cu], np.int32)})
        bad(VARLEN, f"{cu}-0d", ValueError, rf"^{cu} must be 1-D", **{cu: np.array(0, np.int32)})
        bad(VARLEN, f"{cu}-length-1", ValueError, rf"^{cu} must be 1-D of length batch \+ 1 >= 2", **{cu: i32(0)})
        bad(VARLEN, f"{cu}-start-1", ValueError, rf"^{cu} must start at 0; got 1", **{cu: i32(1, 2, total)})
        bad(VARLEN, f"{cu}-start-negative", ValueError, rf"^{cu} must start at 0; got -1", **{cu: i32(-1, 2, total)})
        bad(VARLEN, f"{cu}-decreasing", ValueError, rf"^{cu} must be non-decreasing; {cu}\[2\] = 1 < {cu}\[1\] = 4",
            **{cu: i32(0, 4, 1, total)})
        bad(VARLEN, f"{cu}-last-short", ValueError, rf"^{cu}\[-1\] = {total - 1} must equal the packed length {total}",
            **{cu: i32(0, 2, total - 1), mx: 9})
        bad(VARLEN, f"{cu}-last-long", ValueError, rf"^{cu}\[-1\] = {total + 1} must equal the packed length {total}",
            **{cu: i32(0, 2, total + 1), mx: 9})
        bad(VARLEN, f"{mx}-too-small", ValueError,
            rf"^{mx} = {maxlen - 1} is smaller than the longest sequence in {cu} \({maxlen}\)", **{mx: maxlen - 1})
        bad(VARLEN, f"{mx}-zero", ValueError, rf"^{mx} = 0 is smaller than the longest sequence", **{mx: 0})
        bad(VARLEN, f"{mx}-float", TypeError, rf"^{mx} must be a non-negative int; got 3\.0", **{mx: 3.0})
        bad(VARLEN, f"{mx}-None", TypeError, rf"^{mx} must be a non-negative int; got None", **{mx: None})
        bad(VARLEN, f"{mx}-bool", TypeError, rf"^{mx} must be a non-negative int", **{mx: True})
        bad(VARLEN, f"{mx}-negative", (TypeError, ValueError), rf"^{mx} must be in \[0, ", **{mx: -1})
        bad(VARLEN, f"{cu}-stride-2", ValueError, rf"^{cu} must have unit stride.*ascontiguousarray",
            **{cu: lambda a, cu=cu: np.repeat(a[cu], 2)[::2]})
        # torch and JAX (eager: values are checked)
        bad(VARLEN, f"{cu}-int64", TypeError, rf"^{cu} must be int32 .*got dtype int64", fw="torch",
            **{cu: lambda a, cu=cu: a[cu].long()})
        bad(VARLEN, f"{cu}-decreasing", ValueError, rf"^{cu} must be non-decreasing", fw="torch",
            **{cu: torch.tensor([0, total, 2, total], dtype=torch.int32)})
        bad(VARLEN, f"{cu}-float32", TypeError, rf"^{cu} must be int32 .*got dtype float32", fw="jax",
            **{cu: lambda a, cu=cu: a[cu].astype(jnp.float32)})
        bad(VARLEN, f"{cu}-start-1", ValueError, rf"^{cu} must start at 0; got 1", fw="jax",
            **{cu: lambda a, total=total: jnp.array([1, 2, total], jnp.int32)})  # made in the test: on its (CPU) device
        bad(VARLEN, f"{cu}-last", ValueError, rf"^{cu}\[-1\] = 1 must equal the packed length {total}", fw="jax",
            **{cu: lambda a: jnp.array([0, 1, 1], jnp.int32)})
        bad(VARLEN, f"{mx}-too-small", ValueError, rf"^{mx} = 1 is smaller than the longest sequence in {cu}", fw="jax", **{mx: 1})
    bad(VARLEN, "cu_seqlens-different-lengths", ValueError,
        r"^cu_seqlens_k describes 2 sequences but cu_seqlens_q describes 1; they must have the same length",
        cu_seqlens_q=i32(0, 5), max_seqlen_q=5)
    bad(VARLEN, "cu_seqlens-different-lengths-2", ValueError, r"^cu_seqlens_k describes 3 sequences but cu_seqlens_q describes 2",
        cu_seqlens_k=i32(0, 3, 5, 7))


def _exotic_cases():
    # A float32 field of a structured array: the last-dim stride is 6 bytes, 1.5 elements, not unit.
    def field(x):
        s = np.zeros(x.shape, dtype=[("a", "<f4"), ("b", "<f2")])
        s["a"] = x
        return s["a"]
    bad(("fwd", "vfwd"), "q-struct-field-stride", ValueError, r"^q has byte strides .* not multiples of its item size", q=lambda a: field(a["q"]))


_rank_cases()
_dtype_cases()
_not_an_array_cases()
_framework_device_cases()
_stride_cases()
_feature_cases()
_backward_cases()
_varlen_cases()
_exotic_cases()


@pytest.fixture
def no_kernel(monkeypatch):
    """Fail loudly if a call gets past the argument checks."""
    def refuse(problem, inputs, outputs):
        raise AssertionError(f"the argument checks let {problem.op} through to dispatch.run: {problem}")

    monkeypatch.setattr(dispatch, "run", refuse)


@pytest.mark.parametrize("case", BAD)
def test_bad_call_is_refused(case, no_kernel):
    fn, args, kwargs = case.build()
    with pytest.raises(case.exc, match=case.match):
        fn(*args, **kwargs)


MIXED_DEVICES = [("fwd", "k"), ("fwd", "v"), ("bwd", "q"), ("bwd", "lse"), ("vfwd", "k"), ("vfwd", "cu_seqlens_k"),
                 ("vbwd", "out"), ("vbwd", "cu_seqlens_q"), ("pre", "out")]


@pytest.mark.parametrize("op,other", MIXED_DEVICES)
def test_mixed_devices_are_refused(op, other, no_kernel, monkeypatch):
    """An array on another device than the first one is refused, naming it (devices faked: no GPU here)."""
    fn, names = OPS[op]
    describe = arrays.describe

    def fake(n, x):
        info = describe(n, x)
        return dataclasses.replace(info, device=arrays.Device("cuda", 0)) if n == other else info

    monkeypatch.setattr(arrays, "describe", fake)
    a = base_args(op)
    with pytest.raises(ValueError, match=rf"^{other} is on cuda:0 but {names[0]} is on cpu; pass arrays on one device"):
        fn(*(a[n] for n in names))


# ----------------------------------------------------------------------------- naive references


def visible(sq, sk, causal=False, window=(-1, -1)):
    left, right = window
    if causal:
        right = 0
    i = np.arange(sq)[:, None] + (sk - sq)
    j = np.arange(sk)[None, :]
    mask = np.ones((sq, sk), bool)
    if left >= 0:
        mask &= j >= i - left
    if right >= 0:
        mask &= j <= i + right
    return mask


def naive_attention(q, k, v, causal=False, window=(-1, -1), softmax_scale=None, softcap=0.0):
    """Row by row, float64: (out (B, Sq, H, D), lse (B, H, Sq))."""
    q, k, v = (np.asarray(x).astype(np.float64) for x in (q, k, v))
    b, sq, h, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = h // hkv
    scale = 1 / math.sqrt(d) if softmax_scale is None else softmax_scale
    vis = visible(sq, sk, causal, window)
    out, lse = np.zeros((b, sq, h, d)), np.full((b, h, sq), -np.inf)
    for bi in range(b):
        for hi in range(h):
            s = scale * q[bi, :, hi] @ k[bi, :, hi // g].T
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            for r in range(sq):
                if vis[r].any():
                    row = s[r, vis[r]]
                    m = row.max()
                    p = np.exp(row - m)
                    out[bi, r, hi] = p @ v[bi, vis[r], hi // g] / p.sum()
                    lse[bi, hi, r] = m + np.log(p.sum())
    return out, lse


def autograd_grads(dout, q, k, v, causal=False, window=(-1, -1), softmax_scale=None, softcap=0.0):
    """(dq, dk, dv) of the naive attention by torch autograd in float64."""
    t = [torch.tensor(np.asarray(x).astype(np.float64), requires_grad=True) for x in (q, k, v)]
    tq, tk, tv = t
    g = tq.shape[2] // tk.shape[2]
    kk, vv = tk.repeat_interleave(g, dim=2), tv.repeat_interleave(g, dim=2)
    scale = 1 / math.sqrt(tq.shape[-1]) if softmax_scale is None else softmax_scale
    s = torch.einsum("bihd,bjhd->bhij", tq, kk) * scale
    if softcap > 0:
        s = softcap * torch.tanh(s / softcap)
    vis = torch.tensor(visible(tq.shape[1], tk.shape[1], causal, window))
    p = torch.softmax(torch.where(vis, s, torch.tensor(-1e30, dtype=s.dtype)), dim=-1) * vis.any(-1, keepdim=True)
    o = torch.einsum("bhij,bjhd->bihd", p, vv)
    o.backward(torch.tensor(np.asarray(dout).astype(np.float64)))
    return tuple(x.grad.numpy() for x in t)


def close(actual, expected, tol=2e-5):
    np.testing.assert_allclose(np.asarray(actual).astype(np.float64), np.asarray(expected).astype(np.float64),
                               rtol=tol, atol=tol)


def problem(rng, b=B, sq=SQ, sk=SK, h=H, hkv=HKV, d=D, dtype=np.float32):
    q, k, v = rnd(rng, (b, sq, h, d), dtype), rnd(rng, (b, sk, hkv, d), dtype), rnd(rng, (b, sk, hkv, d), dtype)
    return q, k, v, rnd(rng, (b, sq, h, d), dtype)


# ----------------------------------------------------------------------------- 2. valid unusual inputs


def _np_views(x, layout):
    """A non-contiguous view with the values of x (unit stride on the last dim)."""
    if layout == "heads-slice":
        return np.repeat(x, 2, axis=-2)[..., ::2, :]
    if layout == "seq-slice":  # varlen: every other token of a bigger array
        if x.ndim == 3:
            return np.repeat(x, 2, axis=0)[::2]
        pad = np.zeros_like(x[:, :1])
        return np.concatenate([pad, x, pad, pad], axis=1)[:, 1:-2]
    if layout == "heads-major":  # (B, H, S, D) or (H, T, D) memory, transposed back
        axes = (0, 2, 1, 3) if x.ndim == 4 else (1, 0, 2)
        return np.ascontiguousarray(x.transpose(axes)).transpose(axes)
    if layout == "batch-step":
        return np.repeat(x, 3, axis=0)[::3]
    raise AssertionError(layout)


def _torch_views(x, layout):
    if layout == "heads-slice":
        return torch.repeat_interleave(x, 2, dim=-2)[..., ::2, :]
    if layout == "seq-slice":
        dim = 0 if x.ndim == 3 else 1
        return torch.cat([x.narrow(dim, 0, 1), x, x.narrow(dim, 0, 2)], dim=dim).narrow(dim, 1, x.shape[dim])
    if layout == "heads-major":
        return x.transpose(-3, -2).contiguous().transpose(-3, -2)
    if layout == "batch-step":
        return torch.repeat_interleave(x, 3, dim=0)[::3]
    raise AssertionError(layout)


LAYOUTS = ["heads-slice", "seq-slice", "heads-major", "batch-step"]


def _check_view(view, x, framework):
    contiguous = view.is_contiguous() if framework == "torch" else view.flags.c_contiguous
    assert not contiguous
    strides = view.stride() if framework == "torch" else tuple(s // view.itemsize for s in view.strides)
    assert strides[-1] == 1
    np.testing.assert_array_equal(to_numpy(view), to_numpy(x))


@pytest.mark.parametrize("framework", ["numpy", "torch"])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_strided_dense(layout, framework):
    rng = np.random.default_rng(1)
    q, k, v, dout = problem(rng)
    kw = dict(causal=True, window=(3, -1))
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **kw)
    delta = api.backward_preprocess(dout, out)
    ref_out, ref_lse = naive_attention(q, k, v, **kw)
    close(out, ref_out)
    close(lse, ref_lse)

    conv, view = (to_torch, _torch_views) if framework == "torch" else ((lambda x: x), _np_views)
    plain = dict(q=q, k=k, v=v, dout=dout, out=out)
    views = {n: view(conv(x), layout) for n, x in plain.items()}
    for n, x in views.items():
        _check_view(x, plain[n], framework)
    before = {n: to_numpy(x) for n, x in views.items()}
    s_out, s_lse = cuflash.attention(views["q"], views["k"], views["v"], return_lse=True, **kw)
    close(s_out, out, 1e-6)
    close(s_lse, lse, 1e-6)
    s_grads = cuflash.attention_backward(views["dout"], views["q"], views["k"], views["v"], views["out"],
                                         conv(lse), **kw)
    for g, e in zip(s_grads, grads):
        close(g, e, 1e-6)
    close(api.backward_preprocess(views["dout"], views["out"]), delta, 1e-6)
    for n, x in views.items():  # inputs are read, never written
        np.testing.assert_array_equal(to_numpy(x), before[n])


@pytest.mark.parametrize("layout", ["heads-slice", "seq-slice", "heads-major"])
def test_strided_varlen(layout):
    rng = np.random.default_rng(2)
    q, k, v, dout = rnd(rng, (TQ, H, D)), rnd(rng, (TK, HKV, D)), rnd(rng, (TK, HKV, D)), rnd(rng, (TQ, H, D))
    cu_q, cu_k = np.array(CU_Q, np.int32), np.array(CU_K, np.int32)
    out, lse = cuflash.attention_varlen(q, k, v, cu_q, cu_k, MAXQ, MAXK, causal=True, return_lse=True)
    grads = cuflash.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, MAXQ, MAXK, causal=True)
    views = [_np_views(x, layout) for x in (q, k, v, dout, out)]
    for view, x in zip(views, (q, k, v, dout, out)):
        _check_view(view, x, "numpy")
    vq, vk, vv, vdout, vout = views
    s_out, s_lse = cuflash.attention_varlen(vq, vk, vv, cu_q, cu_k, MAXQ, MAXK, causal=True, return_lse=True)
    close(s_out, out, 1e-6)
    close(s_lse, lse, 1e-6)
    s_grads = cuflash.attention_varlen_backward(vdout, vq, vk, vv, vout, lse, cu_q, cu_k, MAXQ, MAXK, causal=True)
    for g, e in zip(s_grads, grads):
        close(g, e, 1e-6)


@pytest.mark.parametrize("group", [1, 2, 4, 8])
def test_gqa(group):
    rng = np.random.default_rng(group)
    hkv = 2
    q, k, v, dout = problem(rng, b=1, sq=4, sk=6, h=hkv * group, hkv=hkv)
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    assert out.shape == q.shape and lse.shape == (1, hkv * group, 4)
    # Query head h reads kv head h // group: the same as MHA with each kv head repeated group times.
    k_rep, v_rep = np.repeat(k, group, axis=2), np.repeat(v, group, axis=2)
    mha_out, mha_lse = cuflash.attention(q, k_rep, v_rep, return_lse=True)
    close(out, mha_out, 1e-6)
    close(lse, mha_lse, 1e-6)
    close(out, naive_attention(q, k, v)[0])
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    mdq, mdk, mdv = cuflash.attention_backward(dout, q, k_rep, v_rep, mha_out, mha_lse)
    close(dq, mdq, 1e-5)
    close(dk, mdk.reshape(1, 6, hkv, group, D).sum(3), 1e-5)  # summed over the group's query heads
    close(dv, mdv.reshape(1, 6, hkv, group, D).sum(3), 1e-5)
    for g, e in zip((dq, dk, dv), autograd_grads(dout, q, k, v)):
        close(g, e, 1e-4)
    # varlen with the same ratio, against per-sequence dense calls
    cu = np.array([0, 1, 4], np.int32)
    cuk = np.array([0, 2, 6], np.int32)
    vout = cuflash.attention_varlen(q[0], k[0], v[0], cu, cuk, 3, 4, causal=True)
    for s in range(2):
        sq, sk = slice(cu[s], cu[s + 1]), slice(cuk[s], cuk[s + 1])
        dense = cuflash.attention(q[:, sq], k[:, sk], v[:, sk], causal=True)
        close(vout[sq], dense[0], 1e-6)


MASKS = {"none": {}, "causal": dict(causal=True), "window-2-1": dict(window=(2, 1)),
         "causal-window-1": dict(causal=True, window=(1, 0)), "softcap": dict(softcap=2.0, softmax_scale=0.7)}


@pytest.mark.parametrize("mask", MASKS)
@pytest.mark.parametrize("sq,sk", [(1, 1), (1, 6), (6, 1), (3, 8), (8, 3)])
def test_seqlens(sq, sk, mask):
    kw = MASKS[mask]
    rng = np.random.default_rng(sq * 10 + sk)
    q, k, v, dout = problem(rng, b=2, sq=sq, sk=sk, h=4, hkv=2, d=8)
    out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
    assert out.shape == (2, sq, 4, 8) and lse.shape == (2, 4, sq) and lse.dtype == np.float32
    ref_out, ref_lse = naive_attention(q, k, v, **kw)
    close(out, ref_out)
    close(lse, ref_lse)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, **kw)
    for g, e, x in zip(grads, autograd_grads(dout, q, k, v, **kw), (q, k, v)):
        assert g.shape == x.shape and g.dtype == np.float32
        close(g, e, 1e-4)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_numpy(dtype):
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    tol = 4e-2 if dtype == "bfloat16" else 5e-3
    rng = np.random.default_rng(3)
    q, k, v, dout = problem(rng, dtype=dt)
    out, lse = cuflash.attention(q, k, v, return_lse=True, causal=True)
    assert out.dtype == dt and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == (B, H, SQ)
    ref_out, ref_lse = naive_attention(q, k, v, causal=True)
    close(out, ref_out, tol)
    close(lse, ref_lse, 1e-5)  # computed from the same half inputs, stored in float32
    grads = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)
    for g, x in zip(grads, (q, k, v)):
        assert g.dtype == dt and g.shape == x.shape
    for g, e in zip(grads, reference.backward(dout, q, k, v, out, lse, causal=True)):
        close(g, e, tol)
    delta = api.backward_preprocess(dout, out)
    assert delta.dtype == np.float32 and delta.shape == (B, H, SQ)

    vq, vk, vv, vdout = q[0], k[0], v[0], dout[0]
    cu_q, cu_k = np.array(CU_Q, np.int32), np.array(CU_K, np.int32)
    vout, vlse = cuflash.attention_varlen(vq, vk, vv, cu_q, cu_k, MAXQ, MAXK, return_lse=True)
    assert vout.dtype == dt and vout.shape == (TQ, H, D)
    assert vlse.dtype == np.float32 and vlse.shape == (H, TQ)
    vgrads = cuflash.attention_varlen_backward(vdout, vq, vk, vv, vout, vlse, cu_q, cu_k, MAXQ, MAXK)
    for g, x in zip(vgrads, (vq, vk, vv)):
        assert g.dtype == dt and g.shape == x.shape


@pytest.mark.parametrize("op", BACKWARDS)
def test_deterministic_flag_is_accepted(op):
    """On the reference every backward is deterministic: the flag changes nothing there."""
    fn, names = OPS[op]
    a = base_args(op)
    args = [a[n] for n in names]
    plain = fn(*args)
    for flag in (True, np.bool_(True), False):
        for got, want in zip(fn(*args, deterministic=flag), plain):
            np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("op", FORWARDS)
def test_return_lse(op):
    fn, names = OPS[op]
    a = base_args(op)
    args = [a[n] for n in names]
    plain = fn(*args)
    assert isinstance(plain, np.ndarray)
    for flag in (False, np.bool_(False)):
        np.testing.assert_array_equal(fn(*args, return_lse=flag), plain)
    for flag in (True, np.bool_(True)):
        result = fn(*args, return_lse=flag)
        assert isinstance(result, tuple) and len(result) == 2
        np.testing.assert_array_equal(result[0], plain)
        assert result[1].dtype == np.float32
        assert result[1].shape == ((B, H, SQ) if op == "fwd" else (H, TQ))


@pytest.mark.parametrize("left", [0, 1, 3, 100])
def test_window_equivalences(left):
    rng = np.random.default_rng(4)
    q, k, v, dout = problem(rng, sq=6, sk=9)

    def run(**kw):
        out, lse = cuflash.attention(q, k, v, return_lse=True, **kw)
        return out, lse, cuflash.attention_backward(dout, q, k, v, out, lse, **kw)

    def same(x, y):
        for a, b in zip(x[:2] + tuple(x[2]), y[:2] + tuple(y[2])):
            np.testing.assert_array_equal(a, b)

    default = run()
    same(run(window=(-1, -1)), default)
    same(run(window=[-1, -1]), default)
    same(run(causal=False, window=(np.int64(-1), np.int32(-1))), default)
    same(run(causal=True), run(window=(-1, 0)))
    same(run(causal=True), run(causal=np.bool_(True), window=(-1, -1)))
    banded = run(causal=True, window=(left, 0))
    same(run(causal=True, window=(left, -1)), banded)
    same(run(causal=False, window=(left, 0)), banded)
    close(banded[0], naive_attention(q, k, v, window=(left, 0))[0])
    # varlen: the same equivalences per sequence
    cu_q, cu_k = np.array([0, 2, 6], np.int32), np.array([0, 5, 9], np.int32)
    vc = cuflash.attention_varlen(q[0], k[0], v[0], cu_q, cu_k, 4, 5, causal=True, window=(left, 0))
    np.testing.assert_array_equal(cuflash.attention_varlen(q[0], k[0], v[0], cu_q, cu_k, 4, 5, causal=True,
                                                           window=(left, -1)), vc)
    np.testing.assert_array_equal(cuflash.attention_varlen(q[0], k[0], v[0], cu_q, cu_k, 4, 5, window=(left, 0)), vc)
    np.testing.assert_array_equal(cuflash.attention_varlen(q[0], k[0], v[0], cu_q, cu_k, 4, 5, window=(-1, -1)),
                                  cuflash.attention_varlen(q[0], k[0], v[0], cu_q, cu_k, 4, 5))


def _all_ops(dt):
    """One valid NumPy call of every op: (function, array arguments, keywords)."""
    rng = np.random.default_rng(5)
    q, k, v, dout = problem(rng, dtype=dt)
    out, lse = cuflash.attention(q, k, v, return_lse=True, causal=True)
    cu_q, cu_k = np.array(CU_Q, np.int32), np.array(CU_K, np.int32)
    vout, vlse = cuflash.attention_varlen(q[0], k[0], v[0], cu_q, cu_k, MAXQ, MAXK, return_lse=True, softcap=1.5)
    calls = {
        "fwd": (cuflash.attention, (q, k, v), dict(causal=True, return_lse=True)),
        "bwd": (cuflash.attention_backward, (dout, q, k, v, out, lse), dict(causal=True)),
        "vfwd": (cuflash.attention_varlen, (q[0], k[0], v[0], cu_q, cu_k), dict(softcap=1.5, return_lse=True)),
        "vbwd": (cuflash.attention_varlen_backward, (dout[0], q[0], k[0], v[0], vout, vlse, cu_q, cu_k),
                 dict(softcap=1.5)),
        "pre": (api.backward_preprocess, (dout, out), {}),
    }
    return calls


def _varlen_extra(op):
    return (MAXQ, MAXK) if op in VARLEN else ()


def _expected(fn, args, op, kw):
    result = fn(*args, *_varlen_extra(op), **kw)
    return result if isinstance(result, tuple) else (result,)


@pytest.mark.parametrize("requires_grad", [False, True])
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "float64"])
def test_torch_cpu(dtype, requires_grad):
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    for op, (fn, args, kw) in _all_ops(dt).items():
        expected = _expected(fn, args, op, kw)
        targs = [to_torch(x) for x in args]
        if requires_grad:
            targs = [x.requires_grad_() if x.is_floating_point() else x for x in targs]
        result = fn(*targs, *_varlen_extra(op), **kw)
        result = result if isinstance(result, tuple) else (result,)
        assert len(result) == len(expected)
        for r, e in zip(result, expected):
            assert isinstance(r, torch.Tensor) and r.device.type == "cpu", op
            assert r.dtype == TORCH_DTYPES[e.dtype.name], (op, r.dtype, e.dtype)
            assert tuple(r.shape) == e.shape
            np.testing.assert_array_equal(to_numpy(r), e)
        for x, a in zip(targs, args):  # inputs untouched
            np.testing.assert_array_equal(to_numpy(x), a)


@pytest.mark.parametrize("jit", [False, True], ids=["eager", "jit"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_jax_cpu(dtype, jit):
    dt = BF16 if dtype == "bfloat16" else np.dtype(dtype)
    for op, (fn, args, kw) in _all_ops(dt).items():
        expected = _expected(fn, args, op, kw)
        extra = _varlen_extra(op)
        call = lambda *xs, fn=fn, extra=extra, kw=kw: fn(*xs, *extra, **kw)  # noqa: E731
        if jit:
            call = jax.jit(call)
        result = call(*(to_jax(x) for x in args))
        result = result if isinstance(result, tuple) else (result,)
        assert len(result) == len(expected)
        for r, e in zip(result, expected):
            assert isinstance(r, jax.Array) and not isinstance(r, jax.core.Tracer), op
            assert np.dtype(r.dtype) == e.dtype and r.shape == e.shape, (op, r.dtype, e.dtype)
            np.testing.assert_array_equal(np.asarray(r), e)


def test_jax_tracers_take_the_default_device_jax_will_run_them_on(monkeypatch):
    """A tracer has no device: it is described by jax.default_device's when one is set (on a GPU
    machine a computation of CPU arrays under jax.default_device(cpu) runs on the CPU), else by the
    default backend's. Simulated GPU backend: this machine's JAX has only its CPU."""
    from cuflash import arrays

    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    seen = []
    probe = lambda x: seen.append(arrays.describe("q", x).device) or x  # noqa: E731
    with jax.default_device(None):  # none set (conftest sets JAX's CPU for CPU tests)
        jax.jit(probe)(jax.numpy.zeros(2))
    with jax.default_device(jax.devices("cpu")[0]):
        jax.jit(probe)(jax.numpy.ones(3))
    with jax.default_device("cpu"):  # a platform name
        jax.jit(probe)(jax.numpy.ones(4))
    assert [str(d) for d in seen] == ["cuda:0", "cpu", "cpu"]


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax"])
def test_varlen_zero_length_sequences(framework):
    conv = CONVERT[framework]
    rng = np.random.default_rng(6)
    # q lengths 0, 3, 0, 2; k lengths 2, 0, 4, 1.
    cu_q, cu_k = np.array([0, 0, 3, 3, 5], np.int32), np.array([0, 2, 2, 6, 7], np.int32)
    q, k, v = rnd(rng, (5, H, D)), rnd(rng, (7, HKV, D)), rnd(rng, (7, HKV, D))
    dout = rnd(rng, (5, H, D))
    args = [conv(x) for x in (q, k, v, cu_q, cu_k)]
    out, lse = cuflash.attention_varlen(*args, 3, 4, return_lse=True)
    out, lse = to_numpy(out), to_numpy(lse)
    assert out.shape == (5, H, D) and lse.shape == (H, 5) and lse.dtype == np.float32
    np.testing.assert_array_equal(out[0:3], 0)  # sequence 1 has no keys: out 0, lse -inf
    assert np.all(lse[:, 0:3] == -np.inf)
    ref_out, ref_lse = naive_attention(q[None, 3:5], k[None, 6:7], v[None, 6:7])
    close(out[3:5], ref_out[0])
    close(lse[:, 3:5], ref_lse[0])
    dq, dk, dv = (to_numpy(g) for g in cuflash.attention_varlen_backward(
        conv(dout), *args[:3], conv(out), conv(lse), *args[3:], 3, 4))
    np.testing.assert_array_equal(dq[0:3], 0)
    np.testing.assert_array_equal(dk[0:6], 0)  # keys of sequences without queries, or unseen
    np.testing.assert_array_equal(dv[0:6], 0)
    for g, e in zip((dq[3:5], dk[6:7], dv[6:7]), autograd_grads(dout[None, 3:5], q[None, 3:5], k[None, 6:7], v[None, 6:7])):
        close(g, e[0], 1e-4)


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax"])
def test_varlen_all_sequences_empty(framework):
    conv = CONVERT[framework]
    q, k = conv(np.zeros((0, H, D), np.float32)), conv(np.zeros((0, HKV, D), np.float32))
    cu = conv(np.zeros(3, np.int32))
    out, lse = cuflash.attention_varlen(q, k, k, cu, cu, 0, 0, return_lse=True)
    assert tuple(out.shape) == (0, H, D) and tuple(lse.shape) == (H, 0)
    grads = cuflash.attention_varlen_backward(q, q, k, k, out, lse, cu, cu, 0, 0)
    assert [tuple(g.shape) for g in grads] == [(0, H, D), (0, HKV, D), (0, HKV, D)]


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax"])
@pytest.mark.parametrize("empty", ["batch", "seqlen_q", "seqlen_k"])
def test_empty_dimensions(empty, framework):
    """Zero-size batch or sequence dims are valid; a query that sees no key gets out 0, lse -inf.
    (NumPy reports all-zero strides for arrays with a zero-size dimension.)"""
    conv = CONVERT[framework]
    b, sq, sk = (0 if empty == "batch" else B), (0 if empty == "seqlen_q" else SQ), (0 if empty == "seqlen_k" else SK)
    rng = np.random.default_rng(7)
    q, k, v, dout = (conv(x) for x in problem(rng, b=b, sq=sq, sk=sk))
    out, lse = cuflash.attention(q, k, v, return_lse=True)
    assert tuple(out.shape) == (b, sq, H, D) and tuple(lse.shape) == (b, H, sq)
    np.testing.assert_array_equal(to_numpy(out), 0)
    assert np.all(to_numpy(lse) == -np.inf)
    grads = cuflash.attention_backward(dout, q, k, v, out, lse)
    assert [tuple(g.shape) for g in grads] == [tuple(x.shape) for x in (q, k, v)]
    for g in grads:
        np.testing.assert_array_equal(to_numpy(g), 0)
    assert tuple(api.backward_preprocess(dout, out).shape) == (b, H, sq)


@pytest.mark.parametrize("framework", ["numpy", "torch"])
def test_kv_broadcast_over_batch(framework):
    """k and v shared by the batch through a zero batch stride (a read-only view) are read as they are."""
    rng = np.random.default_rng(8)
    q, k, v, dout = problem(rng)
    k1, v1 = k[:1], v[:1]
    if framework == "numpy":
        kb, vb = np.broadcast_to(k1, k.shape), np.broadcast_to(v1, v.shape)
        assert kb.strides[0] == 0 and not kb.flags.writeable
        qq = q
    else:
        kb, vb = to_torch(k1).expand(*k.shape), to_torch(v1).expand(*v.shape)
        assert kb.stride()[0] == 0
        qq = to_torch(q)
    expected = cuflash.attention(q, np.ascontiguousarray(np.broadcast_to(k1, k.shape)),
                                 np.ascontiguousarray(np.broadcast_to(v1, v.shape)), causal=True)
    close(to_numpy(cuflash.attention(qq, kb, vb, causal=True)), expected, 1e-6)


@pytest.mark.parametrize("window", [(2 ** 40, 2 ** 40), (2 ** 70, 2 ** 70), (2 ** 70, 0)])
def test_huge_window_is_unbounded_or_refused(window):
    """A window wider than any sequence means unbounded; a value too large to use must be refused
    naming window, not crash with an OverflowError."""
    rng = np.random.default_rng(9)
    q, k, v, _ = problem(rng)
    unbounded = (-1 if window[0] > 0 else window[0], -1 if window[1] > 0 else window[1])
    try:
        out = cuflash.attention(q, k, v, window=window)
    except (ValueError, TypeError) as e:
        assert "window" in str(e)
        return
    np.testing.assert_array_equal(out, cuflash.attention(q, k, v, window=unbounded))


def test_varlen_max_seqlen_may_exceed_longest():
    a = base_args("vfwd")
    args = [a[n] for n in OPS["vfwd"][1][:5]]
    exact = cuflash.attention_varlen(*args, MAXQ, MAXK)
    np.testing.assert_array_equal(cuflash.attention_varlen(*args, np.int64(100), np.int32(200)), exact)


# ----------------------------------------------------------------------------- 3. values never matter


def _fill_nan(x):
    if isinstance(x, np.ndarray) and x.dtype.kind in "fc" and x.flags.writeable:
        x[...] = np.nan
    elif isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == "cpu" and x.layout == torch.strided:
        x.detach().fill_(math.nan)


def _outcome(fn, args, kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - the outcome is compared, whatever it is
        return type(e), str(e)
    return None


@pytest.mark.parametrize("case", [c for c in BAD if c.values[0].fw != "jax"])
def test_refusal_does_not_depend_on_values(case, no_kernel):
    """Every bad call of the table fails the same way when q, k, v, dout, out and lse are all NaN."""
    fn, args, kwargs = case.build()
    plain = _outcome(fn, args, kwargs)
    fn, args, kwargs = case.build()
    for x in args:
        _fill_nan(x)
    assert _outcome(fn, args, kwargs) == plain


_READS_VALUES = ("start", "last", "too-small", "decreasing")  # cases whose cu_seqlens values are bad
JIT_BAD = [p for p in BAD if p.values[0].fw == "jax" and not any(s in p.id for s in _READS_VALUES)]


@pytest.mark.parametrize("case", JIT_BAD)
def test_refusal_is_the_same_under_jit(case, no_kernel):
    """Tracers carry no values: every check that does not read cu_seqlens fails the same under jax.jit."""
    fn, args, kwargs = case.build()
    eager = _outcome(fn, args, kwargs)
    assert eager is not None and eager[0] is case.exc
    is_array = [isinstance(x, jax.Array) for x in args]
    traced_args = [x for x, t in zip(args, is_array) if t]

    def traced(*xs):
        it = iter(xs)
        return fn(*(next(it) if t else x for x, t in zip(args, is_array)), **kwargs)

    assert _outcome(jax.jit(traced), traced_args, {}) == eager


JIT_BAD_VALUES = [p for p in BAD if p.values[0].fw == "jax" and any(s in p.id for s in _READS_VALUES)]


@pytest.mark.parametrize("case", JIT_BAD_VALUES)
def test_cu_seqlens_values_are_checked_where_a_jit_program_runs(case):
    """Under jax.jit cu_seqlens' values are unknown to the argument checks; a CPU program's callback
    (cuflash/jax.py) checks them before it reads them and the program fails with its message
    (a GPU program's: kernels/check_cu_seqlens.py)."""
    fn, args, kwargs = case.build()
    is_array = [isinstance(x, jax.Array) for x in args]

    def traced(*xs):
        it = iter(xs)
        return fn(*(next(it) if t else x for x, t in zip(args, is_array)), **kwargs)

    with pytest.raises(Exception) as raised:  # JAX's runtime error, carrying the callback's ValueError
        jax.block_until_ready(jax.jit(traced)(*(x for x, t in zip(args, is_array) if t)))
    message = str(raised.value)
    assert "ValueError: " in message and re.search(case.match.removeprefix("^"), message), message


@pytest.mark.parametrize("values, max_seqlen", [([3, 5, 9], 9), ([0, 5, 2, 9], 9), ([0, 5, 8], 9), ([0, 5, 9], 4)],
                         ids=["start", "decreasing", "last", "too-small"])
def test_gpu_cu_seqlens_check_prints_the_host_checks_messages(values, max_seqlen):
    """cuda_src/check_cu_seqlens.cu repeats reference.check_cu_seqlens' rules in its words: each host
    message, its names as %s and its numbers as %d, is one of the kernel's printf formats."""
    from cuflash import jit

    source = (jit.source_dir() / "check_cu_seqlens.cu").read_text()
    formats = set(re.findall(r'printf\("(.*?)\\n"', source))
    with pytest.raises(ValueError) as raised:
        reference.check_cu_seqlens("cu_seqlens_k", np.array(values, np.int32), 9, "max_seqlen_k", max_seqlen)
    literals = {"start at 0": "<zero>", "[-1]": "<last>"}  # numbers of the words themselves
    message = str(raised.value)
    for literal, placeholder in literals.items():
        message = message.replace(literal, placeholder)
    message = re.sub(r"-?\d+", "%d", message.replace("max_seqlen_k", "%s").replace("cu_seqlens_k", "%s"))
    for literal, placeholder in literals.items():
        message = message.replace(placeholder, literal)
    assert "cuflash.%s: " + message in formats, (message, formats)


@pytest.mark.parametrize("framework", ["numpy", "torch", "jax-jit"])
def test_nan_data_is_not_an_argument_error(framework):
    """NaN (and inf) data runs: it is not the argument checks' business."""
    conv = to_jax if framework == "jax-jit" else CONVERT[framework]
    for op, (fn, args, kw) in _all_ops(np.dtype(np.float32)).items():
        data = []
        for x in args:
            x = np.array(x)
            if x.dtype.kind == "f":
                x[...] = np.nan
                x.flat[0] = np.inf
            data.append(conv(x))
        extra = _varlen_extra(op)
        call = lambda *xs, fn=fn, extra=extra, kw=kw: fn(*xs, *extra, **kw)  # noqa: E731
        if framework == "jax-jit":
            call = jax.jit(call)
        with np.errstate(all="ignore"):
            result = call(*data)
        result = result if isinstance(result, tuple) else (result,)
        assert [tuple(r.shape) for r in result] == [tuple(e.shape) for e in _expected(fn, args, op, kw)], op
