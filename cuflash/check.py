"""Check every kernel family this GPU runs against the NumPy reference, on fresh random configurations.

The first half of `python -m cuflash`'s main job (the test suite is the thorough version: hypothesis
over the whole contract, poisoned outputs, sanitizers). Each case draws shapes and features, runs
one family forced through `backend=` on CuPy arrays, and compares with the float64 reference on the
same fp16/bf16 inputs:
- forward out: FlashAttention's criterion, max abs error at most 2x that of a plain low-precision
  attention plus 1e-5; the plain attention here keeps the scores in float32 (softmax in float32, P
  rounded to the input dtype, PV accumulated in float32, the result rounded), which makes the bound
  tighter than FlashAttention's test, whose scores are rounded too. lse within 1e-3, relative.
- gradients: max abs error at most 3 units of the dtype's epsilon times the largest reference value
  plus 1e-4 (bwd_sm80's errors measured about 0.5 eps times that value on H100; a wrong mask, block
  or sum is off by about the largest value itself); the backward preprocess (float32
  sums): 1e-5 relative.
- FP8 attention (quantize_fp8 per head or per block of 128 rows (of 192 for k and v at head dims
  65-128: attention_fp8's kv_block), then attention_fp8; through torch, as
  CuPy has no e4m3 dtype) against the reference on the dequantized inputs: max abs error at most 2x
  that of a plain FP8 attention (P = exp(s - rowmax) * 2^8 rounded to e4m3 before P V, as any e4m3
  P V must) plus 1e-4; lse within 1e-3 plus 2^-11 of the row's largest scaled |q||k| dot product
  (Hopper adds e4m3 products with fewer mantissa bits than fp32). attention(fp8=True) (its own op,
  quantizing inside) the same, against the reference on the inputs as quantize_fp8 quantizes them
  (its codes and descales, which the op's own quantization reproduces bit for bit). Half of either
  with fast_exp=True (no LSE): the plain attention's P then as the same codes (reference.forward_p_codes).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from . import api, kernels, reference
from .arrays import numpy_dtype

HEADDIMS = tuple(range(8, 257, 8))
_E4M3_OPS = ("attention_fp8_forward", "attention_quantized_forward", "quantize_fp8")  # checked through torch


@dataclass
class Case:
    family: str
    op: str
    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int
    features: dict = field(default_factory=dict)
    deterministic: bool = False
    varlen: tuple[int, ...] = ()  # sequence lengths (queries and keys alike) of a packed case

    def describe(self) -> str:
        dt = {"float16": "fp16", "bfloat16": "bf16"}[self.dtype] + (" -> e4m3" if self.op in _E4M3_OPS else "")
        shape = (f"seqlens {list(self.varlen)}" if self.varlen else
                 f"b={self.batch} sq={self.seqlen_q} sk={self.seqlen_k}")
        feats = " ".join([f"{k}={v}" for k, v in self.features.items()] + ["deterministic"] * self.deterministic)
        return f"{self.family:<14} {self.op:<26} {dt} {shape} h={self.nheads}/{self.nheads_kv} d={self.headdim} {feats}"


@dataclass
class Outcome:
    case: Case
    ok: bool
    detail: str


def draw_cases(rng: np.random.Generator, compute_capability, per_op: int = 3) -> list[Case]:
    """`per_op` cases for every op of every family that runs on this compute capability (packed
    sequences for the varlen ops), one more with deterministic=True for each backward op of a family
    that offers it, and one for backward_preprocess. Head dims stay within the family's max_headdim."""
    cases = []
    for family in kernels.FAMILIES.values():
        if not family.runs_on(compute_capability):
            continue
        for op in family.ops:
            backward = op.endswith("_backward") and family.deterministic
            count = 1 if op == "backward_preprocess" else per_op + backward
            for i in range(count):
                cases.append(_draw(rng, family, op, varlen="varlen" in op, deterministic=backward and i == per_op))
    return cases


def _draw(rng, family, op: str, varlen: bool, deterministic: bool) -> Case:
    # FP8 attention: dtype is that of the inputs before quantization (and of out).
    fp8 = op in ("attention_fp8_forward", "attention_quantized_forward")
    dtype = str(rng.choice(sorted(api.FP8_OUT_DTYPES if fp8 else family.dtypes)))
    # Half the draws take a head dim the family compiles (the common case), half any multiple of 8
    # (of 16 for e4m3: 16-byte rows).
    served = lambda hs: tuple(h for h in hs if h <= family.max_headdim)
    headdim = int(rng.choice(served((64, 128)) if rng.random() < 0.5 else served(HEADDIMS[1::2] if fp8 else HEADDIMS)))
    nheads_kv = int(rng.integers(1, 3))
    nheads = nheads_kv * int(rng.choice((1, 2, 4)))
    features = {}
    if op == "quantize_fp8":  # per head or per block of rows, and the transform (a power-of-two head dim)
        features["block"] = _draw_fp8_block(rng, headdim)
        features["hadamard"] = headdim in (64, 128, 256) and bool(rng.integers(2))
    elif op != "backward_preprocess":
        if rng.random() < 0.5:
            features["causal"] = True
        elif rng.random() < 0.3:
            features["window"] = (int(rng.integers(0, 200)), int(rng.integers(0, 200)))
        if op == "attention_fp8_forward":
            features["block"] = _draw_fp8_block(rng, headdim)
        elif fp8:
            features["hadamard"] = headdim in (64, 128, 256) and bool(rng.integers(2))
        elif rng.random() < 0.25:
            features["softcap"] = float(rng.choice((5.0, 30.0)))
        if fp8:
            features["fast_exp"] = bool(rng.integers(2))
    if varlen:
        lengths = tuple(int(n) for n in rng.integers(1, 400, size=int(rng.integers(2, 5))))
        return Case(family.name, op, dtype, len(lengths), max(lengths), max(lengths), nheads, nheads_kv, headdim,
                    features, deterministic, lengths)
    seqlen_q = int(rng.integers(1, 700))
    seqlen_k = seqlen_q if op in ("backward_preprocess", "quantize_fp8") else int(rng.integers(1, 700))
    return Case(family.name, op, dtype, int(rng.integers(1, 3)), seqlen_q, seqlen_k, nheads, nheads_kv, headdim,
                features, deterministic)


def _draw_fp8_block(rng, headdim: int) -> int | None:
    """quantize_fp8's block: None (per head), FP8_BLOCK rows, or at head dims 65-128
    FP8_WIDE_KEY_BLOCK rows (attention_fp8's k and v with kv_block=192)."""
    blocks = (None, reference.FP8_BLOCK) + ((reference.FP8_WIDE_KEY_BLOCK,) if headdim in reference.FP8_WIDE_HEADDIMS
                                            else ())
    return blocks[int(rng.integers(len(blocks)))]


def _round(x: np.ndarray, dtype: str) -> np.ndarray:
    return x.astype(numpy_dtype(dtype))


def _plain_forward(q, k, v, dtype: str, features: dict) -> np.ndarray:
    """Attention as a plain low-precision implementation computes it (the criterion's yardstick)."""
    p = reference.probabilities(q, k, compute_dtype=np.float32, **features)  # (B, H, Sq, Sk)
    p = _round(p, dtype).astype(np.float32)
    vv = np.repeat(v.astype(np.float32), q.shape[2] // k.shape[2], axis=2)
    return _round(np.einsum("bhqk,bkhd->bqhd", p, vv), dtype).astype(np.float64)


def _max_err(got, want, relative: bool = False) -> float:
    """Max abs error (relative to max(1, |want|) if `relative`); inf where the non-finite entries
    differ (a NaN, or a missing -inf lse)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    finite = np.isfinite(want)
    if not np.array_equal(np.isfinite(got), finite) or not np.array_equal(got[~finite], want[~finite]):
        return float("inf")
    err = np.abs(got[finite] - want[finite])
    if relative:
        err /= np.maximum(1.0, np.abs(want[finite]))
    return float(err.max(initial=0.0))


def _gradient_bound(want, dtype: str) -> float:
    import ml_dtypes

    eps = float(ml_dtypes.finfo(numpy_dtype(dtype)).eps)
    return 3 * eps * float(np.abs(want).max(initial=0.0)) + 1e-4


def run_case(case: Case, rng: np.random.Generator, on_gpu: bool = True) -> Outcome:
    """Run one case on CuPy arrays with the case's family forced (on_gpu=False: on NumPy arrays,
    through the reference itself; that is how the CPU tests check this checker)."""
    if on_gpu:
        import cupy as cp

        put, get, backend = cp.asarray, cp.asnumpy, kernels.FAMILIES[case.family].backend
    else:
        put, get, backend = (lambda x: x), np.asarray, None
    host = lambda *shape: _round(rng.standard_normal(shape, dtype=np.float32), case.dtype)
    f64 = lambda x: np.asarray(x, np.float64)
    if case.op == "backward_preprocess":
        dout, out = host(case.batch, case.seqlen_q, case.nheads, case.headdim), host(case.batch, case.seqlen_q,
                                                                                   case.nheads, case.headdim)
        got = get(api.backward_preprocess(put(dout), put(out)))
        want = reference.backward_preprocess(f64(dout), f64(out))
        # float32 sums of the same products: only the summation order differs.
        err, bound = _max_err(got, want), 1e-5 * float(np.abs(want).max(initial=0.0)) + 1e-5
        return Outcome(case, err <= bound, f"delta err {err:.1e} <= {bound:.1e}")
    if case.op == "quantize_fp8":
        return _run_quantize(case, host, on_gpu)
    if case.op in ("attention_fp8_forward", "attention_quantized_forward"):
        return _run_attention_fp8(case, host, on_gpu, backend)
    if case.varlen:
        total = sum(case.varlen)
        q, k, v = (host(total, h, case.headdim) for h in (case.nheads, case.nheads_kv, case.nheads_kv))
        cu = np.concatenate([[0], np.cumsum(case.varlen)]).astype(np.int32)
        packed = (put(cu), put(cu), max(case.varlen), max(case.varlen))
        ref = lambda fn, *xs: fn(*xs, cu, cu, **case.features)
        forward, backward = reference.varlen_forward, reference.varlen_backward
        call_forward = lambda *xs, **kw: api.attention_varlen(*xs, *packed, **kw)
        call_backward = lambda *xs, **kw: api.attention_varlen_backward(*xs, *packed, **kw)
    else:
        shapes = ((case.batch, case.seqlen_q, case.nheads), (case.batch, case.seqlen_k, case.nheads_kv))
        q, k, v = host(*shapes[0], case.headdim), host(*shapes[1], case.headdim), host(*shapes[1], case.headdim)
        ref = lambda fn, *xs: fn(*xs, **case.features)
        forward, backward = reference.forward, reference.backward
        call_forward, call_backward = api.attention, api.attention_backward
    dev = lambda *xs: [put(x) for x in xs]
    want_out, want_lse = ref(forward, f64(q), f64(k), f64(v))
    if case.op.endswith("_forward"):
        out, lse = call_forward(*dev(q, k, v), return_lse=True, backend=backend, **case.features)
        out, lse = get(out), get(lse)
        if case.varlen:
            plain_err = max(_max_err(_plain_forward(q[None, s], k[None, s], v[None, s], case.dtype, case.features),
                                     want_out[None, s]) for s in _slices(case.varlen))
        else:
            plain_err = _max_err(_plain_forward(q, k, v, case.dtype, case.features), want_out)
        err, bound = _max_err(out, want_out), 2 * plain_err + 1e-5
        lse_err = _max_err(lse, want_lse, relative=True)
        return Outcome(case, err <= bound and lse_err <= 1e-3,
                       f"out err {err:.1e} <= {bound:.1e}, lse rel err {lse_err:.1e} <= 1e-3")
    # Backward: the reference's out and lse (rounded as a forward would return them) are the inputs.
    dout = host(*q.shape)
    out = _round(want_out, case.dtype)
    lse = want_lse.astype(np.float32)
    grads = call_backward(*dev(dout, q, k, v, out, lse), backend=backend, deterministic=case.deterministic,
                          **case.features)
    wants = ref(backward, f64(dout), f64(q), f64(k), f64(v), f64(out), f64(lse))
    parts, ok = [], True
    for name, got, want in zip(("dq", "dk", "dv"), grads, wants):
        err, bound = _max_err(get(got), want), _gradient_bound(want, case.dtype)
        ok &= err <= bound
        parts.append(f"{name} err {err:.1e} <= {bound:.1e}")
    return Outcome(case, ok, ", ".join(parts))


def runnable(case: Case) -> str | None:
    """Why this machine cannot run `case`, or None: quantize_fp8's e4m3 outputs need torch or JAX
    arrays (CuPy has no e4m3 dtype), and the check uses torch."""
    if case.op in _E4M3_OPS:
        try:
            import torch
        except ImportError:
            return f"{case.op} is checked through torch (CuPy has no e4m3 dtype), which is not installed"
        if not torch.cuda.is_available():
            return f"{case.op} is checked through torch (CuPy has no e4m3 dtype), which sees no GPU here"
    return None


def _torch_io(case: Case, on_gpu: bool):
    """(put, get) between NumPy and the arrays an e4m3 case runs on: torch on the GPU."""
    from .arrays import host_view

    if not on_gpu:
        return (lambda a: a), np.asarray
    import torch

    return (lambda a: torch.from_numpy(a.astype(np.float32)).to("cuda", getattr(torch, case.dtype)),
            lambda t: host_view(t.cpu()))


def _run_attention_fp8(case: Case, host, on_gpu: bool, backend) -> Outcome:
    """attention_fp8 on quantize_fp8's outputs (k and v per head or per block of 128 or 192 rows: its
    kv_block), or attention(fp8=True) (attention_quantized_forward)
    against the reference's quantization of its inputs (q per 128 rows, k and v per
    reference.fp8_key_block rows, seed 0 for the transform; the GPU's Hadamard sums in float32 may
    put a rare code one step from the reference's, far within the bound)."""
    put, get = _torch_io(case, on_gpu)
    shapes = ((case.batch, case.seqlen_q, case.nheads), (case.batch, case.seqlen_k, case.nheads_kv))
    q, k, v = host(*shapes[0], case.headdim), host(*shapes[1], case.headdim), host(*shapes[1], case.headdim)
    features = {n: x for n, x in case.features.items() if n not in ("block", "hadamard", "fast_exp")}
    fast_exp = case.features["fast_exp"]  # (then without the LSE)
    if case.op == "attention_quantized_forward":
        hadamard = case.features["hadamard"]
        out, lse = _with_lse(api.attention(put(q), put(k), put(v), fp8=True, hadamard=hadamard, fast_exp=fast_exp,
                                           return_lse=not fast_exp, backend=backend, **features), fast_exp)
        q, k, v = reference.quantized_inputs(q, k, v, api._FP8_SEED if hadamard else None)
    else:
        block = case.features["block"]  # k's and v's (q's per 128 rows where they are per 192: kv_block)
        wide = block == reference.FP8_WIDE_KEY_BLOCK
        blocks = (reference.FP8_BLOCK if wide else block, block, block)
        quantized = [api.quantize_fp8(put(x), block=b) for x, b in zip((q, k, v), blocks)]
        out, lse = _with_lse(api.attention_fp8(*(x8 for x8, _ in quantized), *(d for _, d in quantized),
                                               out_dtype=case.dtype, return_lse=not fast_exp, fast_exp=fast_exp,
                                               kv_block=block if wide else reference.FP8_BLOCK, backend=backend,
                                               **features), fast_exp)
        q, k, v = (reference.dequantize_fp8(get(x8), get(d), b or reference.FP8_BLOCK)
                   for (x8, d), b in zip(quantized, blocks))
    want_out, want_lse = reference.forward(q, k, v, **features)
    plain = _round((reference.forward_p_codes if fast_exp else reference.forward_p_e4m3)(q, k, v, **features),
                   case.dtype)
    err, bound = _max_err(get(out), want_out), 2 * _max_err(plain, want_out) + 1e-4
    if lse is None:
        return Outcome(case, err <= bound, f"out err {err:.1e} <= {bound:.1e} (fast_exp: P's codes in the plain FP8 "
                       "attention too)")
    scale = features.get("softmax_scale") or 1 / np.sqrt(case.headdim)
    dots = np.einsum("bqhd,bkhd->bhqk", np.abs(q), np.repeat(np.abs(k), case.nheads // case.nheads_kv, axis=2))
    lse_bound = 1e-3 + 2.0**-11 * scale * dots.max(axis=-1, initial=0.0)
    lse_err = _max_err(get(lse), want_lse)  # inf where the rows without keys differ
    live = np.isfinite(want_lse)
    lse_ok = np.isfinite(lse_err) and bool((np.abs(get(lse)[live] - want_lse[live]) <= lse_bound[live]).all())
    return Outcome(case, err <= bound and lse_ok, f"out err {err:.1e} <= {bound:.1e}, lse err {lse_err:.1e} "
                   f"(within 1e-3 + 2^-11 scale max|q||k|: {lse_ok})")


def _with_lse(result, fast_exp: bool) -> tuple:
    """(out, lse) of an FP8 call: with fast_exp it returns out only (no LSE: lse None)."""
    return (result, None) if fast_exp else result


def _run_quantize(case: Case, host, on_gpu: bool) -> Outcome:
    """quantize_fp8 in fp32 on the GPU (torch tensors) against the float64 reference: descales
    within float32 rounding (2e-6 relative), codes equal but where a value sits at a rounding
    boundary (one step, at most 0.1% of them)."""
    x = host(case.batch, case.seqlen_q, case.nheads, case.headdim)
    block, hadamard = case.features["block"], case.features["hadamard"]
    put, get = _torch_io(case, on_gpu)
    x8, descale = api.quantize_fp8(put(x), block=block, hadamard=hadamard, seed=7)
    want8, want_descale = reference.quantize_fp8(x, block, 7 if hadamard else None)
    got, want = get(x8).astype(np.float64), want8.astype(np.float64)
    descale_err = float(np.abs(get(descale) / want_descale - 1).max(initial=0.0))
    steps = np.abs(got - want) / reference.e4m3_spacing(want)  # e4m3 steps apart
    off = int((steps > 0).sum())
    ok = descale_err <= 2e-6 and steps.max(initial=0.0) <= 1 + 1e-9 and off <= max(1, got.size // 1000)
    return Outcome(case, ok, f"descale rel err {descale_err:.1e} <= 2e-6, {off} of {got.size} codes one step off")


def _slices(lengths):
    start = 0
    for n in lengths:
        yield slice(start, start + n)
        start += n
