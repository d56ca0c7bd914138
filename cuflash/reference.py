"""NumPy reference backend: the executable specification of attention.

This module is the correctness reference of cuflash, not a fast path.  Every
other backend (the CUDA kernels, the JIT-compiled variants) is tested against
it, so it is written to be obviously right: float64 arithmetic by default,
plain vectorised NumPy, and one function per concept.

Semantics
---------
Shapes follow FlashAttention: ``q`` is ``(batch, seqlen_q, nheads, headdim)``,
``k`` and ``v`` are ``(batch, seqlen_k, nheads_kv, headdim)`` with ``nheads``
divisible by ``nheads_kv``; query head ``h`` reads key/value head
``h // (nheads // nheads_kv)`` (GQA, MQA when ``nheads_kv == 1``).

For one batch entry and one head, with ``scale = softmax_scale`` (default
``1 / sqrt(headdim)``)::

    s[i, j] = scale * (q[i] . k[j])
    s[i, j] = softcap * tanh(s[i, j] / softcap)         # only if softcap > 0
    s[i, j] = -inf  unless  key j is visible to query i
    lse[i]  = log(sum_j exp(s[i, j]))                   # natural log
    P[i, j] = exp(s[i, j] - lse[i])
    out[i]  = sum_j P[i, j] v[j]

Visibility is aligned to the bottom-right corner of the score matrix: with
``(left, right) = window_bounds(causal, window)`` and
``offset = seqlen_k - seqlen_q``, query ``i`` sees key ``j`` iff
``i + offset - left <= j <= i + offset + right`` (a bound of -1 means that side
is unbounded; ``causal`` means ``right = 0``).  A query row that sees no key
has ``out = 0`` and ``lse = -inf``, never NaN; it also gets a zero gradient.

All inputs (float16, bfloat16 from ml_dtypes, float32, float64) are converted
to ``compute_dtype`` (float64 unless asked otherwise, float32 on request) and
results are returned in ``compute_dtype``; casting back is the caller's job.
Shapes are assumed to have been validated by the API layer.

Measured speed
--------------
Measured on the project's development machine: a 2-core Intel Xeon VM
(24 GiB), NumPy 2.4 with its bundled OpenBLAS, median of 5 calls, batch 1,
seqlen_q = seqlen_k = 1024, 8 heads, headdim 64, no mask:

===============  =========  =========
call             float64    float32
===============  =========  =========
forward          ~0.08 s    ~0.04 s
forward_tiled    ~0.12 s    ~0.07 s
backward         ~0.19 s    ~0.10 s
===============  =========  =========

That is roughly 27 and 50 GFLOP/s for ``forward`` (counting
4 * B * H * Sq * Sk * D flops).  ``forward`` materialises the whole
``(batch, nheads, seqlen_q, seqlen_k)`` score tensor (64 MiB in float64 at
this size), so its memory grows quadratically with the sequence length and a
good part of its time is spent touching fresh memory; causal masking does not
make it faster.  ``forward_tiled`` keeps only one block of scores at a time
and skips masked key blocks, at the cost of a Python loop over blocks.
"""

from __future__ import annotations

import math

import numpy as np

__all__ = [
    "window_bounds",
    "visible_mask",
    "probabilities",
    "forward",
    "forward_tiled",
    "backward_preprocess",
    "backward",
    "varlen_forward",
    "varlen_backward",
    "e4m3_spacing",
    "FP8_BLOCK",
    "FP8_WIDE_KEY_BLOCK",
    "FP8_WIDE_KEYS_FROM",
    "fp8_key_block",
    "fp8_blocks",
    "quantized_inputs",
    "hadamard_signs",
    "hadamard_matrix",
    "quantize_fp8",
    "dequantize_fp8",
    "attention_fp8",
    "attention_quantized",
]


# ---------------------------------------------------------------------------
# Masks
# ---------------------------------------------------------------------------


def window_bounds(causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    """Fold ``causal`` into a sliding window and return ``(left, right)``.

    -1 on a side means unbounded on that side.  ``causal=True`` means
    ``right = 0`` (``left`` is kept from ``window``); a causal call whose window
    asks for ``right > 0`` is a contradiction and raises ``ValueError``.
    Window bounds below -1 raise ``ValueError`` as well.
    """
    left, right = (int(w) for w in window)
    if left < -1 or right < -1:
        raise ValueError(f"window bounds must be >= -1 (-1 = unbounded), got window={tuple(window)}")
    if causal:
        if right not in (-1, 0):
            raise ValueError(
                f"causal=True implies window right bound 0, but window={tuple(window)} "
                "asks for right > 0; pass causal=False with that window instead"
            )
        right = 0
    return left, right


def _block_mask(r0: int, r1: int, c0: int, c1: int, seqlen_q: int, seqlen_k: int,
                left: int, right: int) -> np.ndarray:
    """Visibility of keys ``c0:c1`` to queries ``r0:r1`` (bool, (r1-r0, c1-c0))."""
    i = np.arange(r0, r1)[:, None]
    j = np.arange(c0, c1)[None, :]
    diag = i + (seqlen_k - seqlen_q)  # key aligned with query i (bottom-right)
    mask = np.ones((r1 - r0, c1 - c0), dtype=bool)
    if left >= 0:
        mask &= j >= diag - left
    if right >= 0:
        mask &= j <= diag + right
    return mask


def visible_mask(seqlen_q: int, seqlen_k: int, *, causal=False, window=(-1, -1)) -> np.ndarray:
    """Boolean ``(seqlen_q, seqlen_k)`` matrix: True where query i sees key j."""
    left, right = window_bounds(causal, window)
    return _block_mask(0, seqlen_q, 0, seqlen_k, seqlen_q, seqlen_k, left, right)


# ---------------------------------------------------------------------------
# Shared helpers
# ---------------------------------------------------------------------------


def _cast(x, dtype) -> np.ndarray:
    return np.asarray(x).astype(dtype, copy=False)


def _scale(softmax_scale, headdim: int, dtype) -> np.generic:
    scale = 1.0 / math.sqrt(headdim) if softmax_scale is None else float(softmax_scale)
    return dtype.type(scale)


def _group_heads(x: np.ndarray, nheads_kv: int) -> np.ndarray:
    """(B, S, H, X) -> (B, Hkv, G*S, X) for query-side tensors (q, dout).

    Query head ``h = hkv * G + g`` lands at row ``g * S + s`` of group ``hkv``,
    so one matmul per kv head serves all ``G`` query heads that share it and
    K/V are never repeated.
    """
    b, s, h, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, nheads_kv, (h // nheads_kv) * s, d)


def _ungroup_heads(y: np.ndarray, nheads: int) -> np.ndarray:
    """(B, Hkv, G*S, X) -> (B, H, S, X)."""
    b, hkv, gs, x = y.shape
    return y.reshape(b, nheads, gs // (nheads // hkv), x)


def _kv_heads(x: np.ndarray) -> np.ndarray:
    """(B, S, Hkv, D) -> (B, Hkv, S, D)."""
    return x.transpose(0, 2, 1, 3)


def _scores(q, k, scale, softcap):
    """Scaled (and soft-capped) scores, unmasked, shape (B, H, Sq, Sk).

    Returns ``(s, t)`` where ``t = tanh(scale * qk / softcap)`` when softcap is
    on (needed by the backward pass) and ``None`` otherwise.  Operations are
    done in place on the fresh matmul result to limit large temporaries.
    """
    nheads, nheads_kv = q.shape[2], k.shape[2]
    qk = _ungroup_heads(_group_heads(q, nheads_kv) @ _kv_heads(k).swapaxes(-1, -2), nheads)
    if softcap > 0:
        cap = q.dtype.type(softcap)
        t = np.tanh(np.multiply(qk, scale / cap, out=qk), out=qk)
        return cap * t, t
    return np.multiply(qk, scale, out=qk), None


def _apply_probs(p, v, nheads):
    """out[b, i, h] = sum_j p[b, h, i, j] v[b, j, h // G]; returns (B, Sq, H, Dv)."""
    b, h, sq, sk = p.shape
    nheads_kv = v.shape[2]
    o = p.reshape(b, nheads_kv, (h // nheads_kv) * sq, sk) @ _kv_heads(v)
    return np.ascontiguousarray(_ungroup_heads(o, nheads).transpose(0, 2, 1, 3))


def _masked_softmax(s):
    """Row softmax of masked scores s (-inf = invisible) with a safe max.

    Returns ``(P, lse)``; rows without a finite score give P = 0, lse = -inf.
    ``s`` is overwritten (P reuses its memory).
    """
    m = np.max(s, axis=-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, 0).astype(s.dtype)  # -inf rows: exp(-inf - 0) = 0
    p = np.exp(np.subtract(s, m_safe, out=s), out=s)
    total = p.sum(axis=-1, keepdims=True)
    seen = total > 0
    p /= np.where(seen, total, 1)
    lse = np.where(seen, m_safe + np.log(np.where(seen, total, 1)), -np.inf)
    return p, lse[..., 0].astype(s.dtype)


# ---------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------


def _prepare(q, k, v, softmax_scale, compute_dtype):
    dt = np.dtype(compute_dtype)
    q, k, v = _cast(q, dt), _cast(k, dt), _cast(v, dt)
    return q, k, v, _scale(softmax_scale, q.shape[-1], dt), dt


def _masked_scores(q, k, scale, causal, window, softcap):
    s, t = _scores(q, k, scale, softcap)
    mask = visible_mask(q.shape[1], k.shape[1], causal=causal, window=window)
    np.copyto(s, -np.inf, where=~mask)  # s is a fresh array: mask in place
    return s, t, mask


def probabilities(q, k, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
                  compute_dtype=np.float64) -> np.ndarray:
    """Attention probabilities P, shape (B, H, Sq, Sk).

    Each row sums to 1, or is all zeros for a query that sees no key.
    """
    dt = np.dtype(compute_dtype)
    q, k = _cast(q, dt), _cast(k, dt)
    scale = _scale(softmax_scale, q.shape[-1], dt)
    s, _, _ = _masked_scores(q, k, scale, causal, window, softcap)
    return _masked_softmax(s)[0]


def forward(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), softcap=0.0,
            compute_dtype=np.float64):
    """Naive attention: materialise all scores, softmax, multiply by V.

    Returns ``(out, lse)`` with out (B, Sq, H, Dv) and lse (B, H, Sq), in
    ``compute_dtype``.
    """
    q, k, v, scale, dt = _prepare(q, k, v, softmax_scale, compute_dtype)
    s, _, _ = _masked_scores(q, k, scale, causal, window, softcap)
    p, lse = _masked_softmax(s)
    return _apply_probs(p, v, q.shape[2]), lse


def _key_range(r0, r1, seqlen_q, seqlen_k, left, right):
    """Keys ``[lo, hi)`` that any query in ``r0:r1`` may see (empty if lo >= hi).

    The visible keys of row i are [i + offset - left, i + offset + right]; for
    consecutive rows these intervals overlap, so their union is one interval.
    """
    offset = seqlen_k - seqlen_q
    lo = 0 if left < 0 else max(0, r0 + offset - left)
    hi = seqlen_k if right < 0 else min(seqlen_k, (r1 - 1) + offset + right + 1)
    return lo, hi


def forward_tiled(q, k, v, *, block_m=64, block_n=64, causal=False, softmax_scale=None,
                  window=(-1, -1), softcap=0.0, compute_dtype=np.float64):
    """Blocked forward pass with online softmax: the algorithm of the kernels.

    For each block of ``block_m`` queries, visit the key blocks of ``block_n``
    keys that the block can see, keeping per row:

    * ``m``: the running maximum of the scores seen so far (log2 domain),
    * ``l``: the running sum of ``exp2(score - m)``,
    * ``acc``: the running, *unnormalised* sum of ``exp2(score - m) * v``.

    Scores are kept in the log2 domain: ``scale * log2(e)`` is folded into one
    multiplier so each probability is a single ``exp2`` (with softcap, the
    score is ``softcap * log2(e) * tanh(qk * scale / softcap)``).  When a new
    block raises the row maximum from ``m`` to ``m_new``, everything
    accumulated so far was computed relative to the old maximum, so ``l`` and
    ``acc`` are rescaled by ``alpha = exp2(m - m_new)`` before the block's
    terms are added; this keeps every exponent <= 0 (no overflow) without
    knowing the final maximum in advance.  Division by ``l`` happens once, at
    the end.  ``lse = (m + log2(l)) / log2(e)`` converts back to natural log.

    A row that has seen no visible key yet has ``m = -inf``; subtracting it
    would give ``-inf - (-inf) = NaN``.  The *safe max* substitutes 0 for a
    ``-inf`` maximum, so ``exp2(-inf - 0) = 0`` and the row keeps ``l = 0``;
    rows that end with ``l = 0`` get ``out = 0`` and ``lse = -inf``.

    Key blocks that the window/causal bounds make entirely invisible to the
    query block are never visited (the key range is computed from the bounds,
    as a kernel computes ``n_block_min``/``n_block_max``).  Inside visited
    blocks the element mask is applied to every block here for clarity; a
    kernel only needs it on blocks that straddle a mask boundary.
    """
    q, k, v, scale, dt = _prepare(q, k, v, softmax_scale, compute_dtype)
    left, right = window_bounds(causal, window)
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_kv, dv = k.shape[1], k.shape[2], v.shape[-1]
    group = nheads // nheads_kv
    log2e = dt.type(math.log2(math.e))
    neg_inf = dt.type(-np.inf)
    if softcap > 0:
        pre, post = scale / dt.type(softcap), dt.type(softcap) * log2e
    else:
        mult = scale * log2e

    # (B, Hkv, G, Sq, D): query heads grouped under the kv head they read.
    qg = q.transpose(0, 2, 1, 3).reshape(batch, nheads_kv, group, seqlen_q, q.shape[-1])
    kh = _kv_heads(k)[:, :, None]  # (B, Hkv, 1, Sk, D), broadcast over the group
    vh = _kv_heads(v)[:, :, None]
    out = np.zeros((batch, nheads_kv, group, seqlen_q, dv), dtype=dt)
    lse = np.full((batch, nheads_kv, group, seqlen_q), neg_inf, dtype=dt)

    for r0 in range(0, seqlen_q, block_m):
        r1 = min(r0 + block_m, seqlen_q)
        qb = qg[:, :, :, r0:r1]
        m = np.full(qb.shape[:-1], neg_inf, dtype=dt)
        l = np.zeros(qb.shape[:-1], dtype=dt)
        acc = np.zeros(qb.shape[:-1] + (dv,), dtype=dt)
        lo, hi = _key_range(r0, r1, seqlen_q, seqlen_k, left, right)
        for c0 in range((lo // block_n) * block_n, hi, block_n):
            c1 = min(c0 + block_n, seqlen_k)
            qk = qb @ kh[:, :, :, c0:c1].swapaxes(-1, -2)  # (B, Hkv, G, bm, bn)
            s = post * np.tanh(qk * pre) if softcap > 0 else qk * mult
            s = np.where(_block_mask(r0, r1, c0, c1, seqlen_q, seqlen_k, left, right), s, neg_inf)
            m_new = np.maximum(m, s.max(axis=-1))
            m_safe = np.where(m_new == neg_inf, dt.type(0), m_new)
            alpha = np.exp2(m - m_safe)  # rescales the old terms; 0 while m = -inf
            p = np.exp2(s - m_safe[..., None])
            l = alpha * l + p.sum(axis=-1)
            acc = alpha[..., None] * acc + p @ vh[:, :, :, c0:c1]
            m = m_new
        seen = l > 0
        l_safe = np.where(seen, l, dt.type(1))
        out[:, :, :, r0:r1] = acc / l_safe[..., None]
        lse[:, :, :, r0:r1] = np.where(seen, (m + np.log2(l_safe)) / log2e, neg_inf)

    out = out.reshape(batch, nheads, seqlen_q, dv).transpose(0, 2, 1, 3)
    return np.ascontiguousarray(out), lse.reshape(batch, nheads, seqlen_q)


# ---------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------


def backward_preprocess(dout, out, compute_dtype=np.float64) -> np.ndarray:
    """D = rowsum(dout * out) over headdim, heads moved before the sequence.

    (B, Sq, H, D) inputs give (B, H, Sq); varlen (T, H, D) inputs give (H, T).
    Since rows of P sum to one, D[i] = sum_j P[i, j] dP[i, j], the term the
    softmax backward subtracts.
    """
    dt = np.dtype(compute_dtype)
    d = (_cast(dout, dt) * _cast(out, dt)).sum(axis=-1)
    return np.ascontiguousarray(np.swapaxes(d, -1, -2))


def backward(dout, q, k, v, out, lse, *, causal=False, softmax_scale=None, window=(-1, -1),
             softcap=0.0, compute_dtype=np.float64):
    """Gradients ``(dq, dk, dv)`` of attention, recomputing P from q, k and lse.

    ``dq`` has the shape of q; ``dk``/``dv`` have the shape of k/v and are
    summed over the query heads that share each kv head.  Rows with
    ``lse = -inf`` contribute nothing.
    """
    q, k, v, scale, dt = _prepare(q, k, v, softmax_scale, compute_dtype)
    dout, lse = _cast(dout, dt), _cast(lse, dt)
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv

    s, t, mask = _masked_scores(q, k, scale, causal, window, softcap)
    live = np.isfinite(lse)[..., None] & mask  # (B, H, Sq, Sk)
    lse_safe = np.where(np.isfinite(lse), lse, dt.type(0))[..., None]
    p = np.exp(np.where(live, s - lse_safe, dt.type(-np.inf)))

    d = backward_preprocess(dout, out, dt)  # (B, H, Sq)
    dout_g = _group_heads(dout, nheads_kv)  # (B, Hkv, G*Sq, Dv)
    dp = _ungroup_heads(dout_g @ _kv_heads(v).swapaxes(-1, -2), nheads)  # dout . V^T
    ds = p * (dp - d[..., None])  # gradient w.r.t. the (capped) scores
    if t is not None:
        ds = ds * (1 - t * t)  # d/dx of c*tanh(x/c) = 1 - tanh^2(x/c)

    ds_g = ds.reshape(batch, nheads_kv, group * seqlen_q, seqlen_k)
    p_g = p.reshape(batch, nheads_kv, group * seqlen_q, seqlen_k)
    dq = _ungroup_heads(scale * (ds_g @ _kv_heads(k)), nheads).transpose(0, 2, 1, 3)
    # Contracting over the G*Sq axis sums the group's query heads into each kv head.
    dk = (scale * (ds_g.swapaxes(-1, -2) @ _group_heads(q, nheads_kv))).transpose(0, 2, 1, 3)
    dv = (p_g.swapaxes(-1, -2) @ dout_g).transpose(0, 2, 1, 3)
    return tuple(np.ascontiguousarray(x) for x in (dq, dk, dv))


def _query_range(c0, c1, seqlen_q, seqlen_k, left, right):
    """Queries ``[lo, hi)`` that may see any key in ``c0:c1`` (empty if lo >= hi): the mirror of
    ``_key_range``; query i sees key j iff ``j - off - right <= i <= j - off + left``."""
    off = seqlen_k - seqlen_q
    lo = max(0, c0 - off - right) if right >= 0 else 0
    hi = min(seqlen_q, c1 - 1 - off + left + 1) if left >= 0 else seqlen_q
    return lo, hi


def backward_tiled(dout, q, k, v, out, lse, *, block_m=64, block_n=64, causal=False, softmax_scale=None,
                   window=(-1, -1), softcap=0.0, compute_dtype=np.float64):
    """Blocked backward pass: the algorithm of the backward kernels (FlashAttention-2's).

    ``D = rowsum(dout * out)`` first (``backward_preprocess``). Then for each kv head and each block
    of ``block_n`` keys, with ``dK`` and ``dV`` for the block accumulated in place (the kernels keep
    them in registers), visit every query head of the kv head's group and every block of
    ``block_m`` queries that can see the key block (the query range follows from the mask bounds, as
    the key range does in the forward), and per (query block, key block):

    * recompute ``P = exp(score - lse)`` from q, k and the saved lse (0 where masked, and for rows
      with ``lse = -inf``): the score matrix is never stored;
    * ``dV += Pᵀ dO``;  ``dP = dO Vᵀ``;  ``dS = P ∘ (dP - D)``, times ``1 - tanh²`` with softcap;
    * ``dK += scale · dSᵀ Q`` and ``dQ[block] += scale · dS K`` — the one accumulation that crosses
      key blocks (atomics in float32, or a separate pass, in a kernel).

    Summing over the group's query heads inside the loop is what makes dK/dV per kv head without
    expanding K and V.
    """
    q, k, v, scale, dt = _prepare(q, k, v, softmax_scale, compute_dtype)
    dout, lse = _cast(dout, dt), _cast(lse, dt)
    left, right = window_bounds(causal, window)
    batch, seqlen_q, nheads, _ = q.shape
    seqlen_k, nheads_kv = k.shape[1], k.shape[2]
    group = nheads // nheads_kv
    d = backward_preprocess(dout, out, dt)  # (B, H, Sq)
    live = np.isfinite(lse)
    lse_safe = np.where(live, lse, dt.type(0))
    qh, doh = q.transpose(0, 2, 1, 3), dout.transpose(0, 2, 1, 3)  # (B, H, Sq, D)
    kh, vh = _kv_heads(k), _kv_heads(v)  # (B, Hkv, Sk, D)
    dq = np.zeros_like(qh)
    dk, dv = np.zeros_like(kh), np.zeros_like(vh)

    for c0 in range(0, seqlen_k, block_n):
        c1 = min(c0 + block_n, seqlen_k)
        lo, hi = _query_range(c0, c1, seqlen_q, seqlen_k, left, right)
        for hkv in range(nheads_kv):
            kb, vb = kh[:, hkv, c0:c1], vh[:, hkv, c0:c1]  # (B, bn, D)
            for h in range(hkv * group, (hkv + 1) * group):
                for r0 in range((lo // block_m) * block_m, hi, block_m):
                    r1 = min(r0 + block_m, seqlen_q)
                    qb, dob = qh[:, h, r0:r1], doh[:, h, r0:r1]  # (B, bm, D)
                    x = qb @ kb.swapaxes(-1, -2) * scale  # (B, bm, bn)
                    t = np.tanh(x / softcap) if softcap > 0 else None
                    score = softcap * t if softcap > 0 else x
                    visible = _block_mask(r0, r1, c0, c1, seqlen_q, seqlen_k, left, right) & live[:, h, r0:r1, None]
                    p = np.where(visible, np.exp(np.where(visible, score - lse_safe[:, h, r0:r1, None], 0)), 0)
                    dv[:, hkv, c0:c1] += p.swapaxes(-1, -2) @ dob
                    ds = p * (dob @ vb.swapaxes(-1, -2) - d[:, h, r0:r1, None])
                    if t is not None:
                        ds = ds * (1 - t * t)
                    dk[:, hkv, c0:c1] += scale * (ds.swapaxes(-1, -2) @ qb)
                    dq[:, h, r0:r1] += scale * (ds @ kb)
    return tuple(np.ascontiguousarray(x.transpose(0, 2, 1, 3)) for x in (dq, dk, dv))


# ---------------------------------------------------------------------------
# Variable-length (packed) sequences
# ---------------------------------------------------------------------------


def check_cu_seqlens(name: str, cu_seqlens, total: int, max_name: str, max_seqlen: int) -> None:
    """ValueError unless cu_seqlens (the values) are prefix sums of sequence lengths that start at 0,
    never decrease, end at the packed length `total` and are each at most `max_seqlen`. The varlen
    calls check host arrays here and GPU arrays with cuda_src/check_cu_seqlens.cu, which repeats
    these rules and messages."""
    values = np.asarray(cu_seqlens, dtype=np.int64)
    if values[0] != 0:
        raise ValueError(f"{name} must start at 0; got {values[0]}")
    lengths = np.diff(values)
    if (lengths < 0).any():
        i = int(np.argmax(lengths < 0))
        raise ValueError(f"{name} must be non-decreasing; {name}[{i + 1}] = {values[i + 1]} < "
                         f"{name}[{i}] = {values[i]}")
    if values[-1] != total:
        raise ValueError(f"{name}[-1] = {values[-1]} must equal the packed length {total}")
    if lengths.size and lengths.max() > max_seqlen:
        raise ValueError(f"{max_name} = {max_seqlen} is smaller than the longest sequence in {name} "
                         f"({lengths.max()})")


def _sequences(cu_seqlens_q, cu_seqlens_k):
    cq = np.asarray(cu_seqlens_q).astype(np.int64)
    ck = np.asarray(cu_seqlens_k).astype(np.int64)
    for b in range(len(cq) - 1):
        yield slice(int(cq[b]), int(cq[b + 1])), slice(int(ck[b]), int(ck[b + 1]))


def varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, softmax_scale=None,
                   window=(-1, -1), softcap=0.0, compute_dtype=np.float64):
    """Packed forward: q (Tq, H, D), k/v (Tk, Hkv, D); returns out (Tq, H, Dv), lse (H, Tq).

    Sequence b is rows ``cu[b]:cu[b+1]``; masks align bottom-right per
    sequence.  Query rows outside every sequence keep out = 0, lse = -inf.
    """
    dt = np.dtype(compute_dtype)
    q, k, v = _cast(q, dt), _cast(k, dt), _cast(v, dt)
    out = np.zeros(q.shape[:-1] + (v.shape[-1],), dtype=dt)
    lse = np.full((q.shape[1], q.shape[0]), -np.inf, dtype=dt)
    kw = dict(causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
              compute_dtype=dt)
    for sq, sk in _sequences(cu_seqlens_q, cu_seqlens_k):
        o, l = forward(q[None, sq], k[None, sk], v[None, sk], **kw)
        out[sq], lse[:, sq] = o[0], l[0]
    return out, lse


def varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, causal=False,
                    softmax_scale=None, window=(-1, -1), softcap=0.0, compute_dtype=np.float64):
    """Packed backward; lse is (H, Tq).  Returns dq (Tq, H, D), dk, dv (Tk, Hkv, D)."""
    dt = np.dtype(compute_dtype)
    dout, q, k, v, out, lse = (_cast(x, dt) for x in (dout, q, k, v, out, lse))
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    kw = dict(causal=causal, softmax_scale=softmax_scale, window=window, softcap=softcap,
              compute_dtype=dt)
    for sq, sk in _sequences(cu_seqlens_q, cu_seqlens_k):
        g = backward(dout[None, sq], q[None, sq], k[None, sk], v[None, sk], out[None, sq],
                     lse[None, :, sq], **kw)
        dq[sq], dk[sk], dv[sk] = g[0][0], g[1][0], g[2][0]
    return dq, dk, dv


# ---------------------------------------------------------------------------
# FP8 (e4m3): quantization, incoherent processing, attention on quantized inputs
# ---------------------------------------------------------------------------
#
# x8 = round_e4m3(x / descale) with descale = amax / 448 taken per (batch, head)
# or per block of FP8_BLOCK rows of each (batch, head); x ~ x8 * descale. Before
# quantizing q and k, `hadamard` multiplies their head dim by the orthogonal
# matrix hadamard_matrix(headdim, seed): with the same seed for both, q k^T is
# unchanged (H H^T = I) while outlier coordinates are spread over all of them
# ("incoherent processing"). v is never transformed (it would change out).
# attention_fp8 is attention on the dequantized inputs, computed in float64:
# quantization is the only difference from `forward`.

E4M3_MAX = 448.0
FP8_BLOCK = 128  # rows per block scale: q's always, and k's and v's unless FP8_WIDE_KEY_BLOCK (the GPU
# FP8 attention kernel applies the K and V descales once per block of keys)
# k's and v's block at head dims 65-128 (FP8_WIDE_HEADDIMS), the GPU kernel's key block there (192
# keys; 128-row scales would straddle its blocks, so they run 128-key blocks): attention_fp8's
# kv_block=192, and attention(q, k, v, fp8=True)'s from FP8_WIDE_KEYS_FROM keys. End to end on an
# H200 (session 45, benchmarks/NOTES-fp8.md) against 128-row scales on 128-key blocks: 1.035x at 2k
# keys, 1.056x at 4k, 1.13x at 16k (causal 1.01x, 1.02x, 1.09x), but 0.94x at 1k, where the
# quantizers' larger blocks cost more than the wider blocks save.
FP8_WIDE_KEY_BLOCK = 192
FP8_WIDE_HEADDIMS = range(65, 129)
FP8_WIDE_KEYS_FROM = 2048


def fp8_key_block(headdim: int, seqlen_k: int) -> int:
    """Rows per scale of k and v in attention(q, k, v, fp8=True) (attention_quantized): FP8_WIDE_KEY_BLOCK
    at head dims 65 to 128 with at least FP8_WIDE_KEYS_FROM keys, else FP8_BLOCK (q always FP8_BLOCK)."""
    return FP8_WIDE_KEY_BLOCK if headdim in FP8_WIDE_HEADDIMS and seqlen_k >= FP8_WIDE_KEYS_FROM else FP8_BLOCK


def _e4m3():
    import ml_dtypes

    return ml_dtypes.float8_e4m3fn


def e4m3_spacing(x) -> np.ndarray:
    """The distance between neighbouring e4m3 values around |x|: 2^(e - 3) for |x| in [2^e, 2^(e+1)),
    2^-9 below the normal range (e >= -6)."""
    return np.exp2(np.maximum(np.floor(np.log2(np.maximum(np.abs(x), 2.0**-6))), -6) - 3)


def hadamard_signs(headdim: int, seed: int) -> np.ndarray:
    """The transform's signs: headdim values +-1 drawn from numpy.random.default_rng(seed)."""
    return np.random.default_rng(seed).integers(0, 2, headdim) * 2.0 - 1.0


def hadamard_matrix(headdim: int, seed: int) -> np.ndarray:
    """(headdim, headdim) float64 orthogonal matrix diag(signs) H / sqrt(headdim): H the Sylvester
    Hadamard matrix (headdim a power of two), signs hadamard_signs(headdim, seed)."""
    if headdim < 1 or headdim & (headdim - 1):
        raise ValueError(f"the Hadamard transform needs a head dim that is a power of two; got {headdim}")
    h = np.ones((1, 1))
    while h.shape[0] < headdim:
        h = np.block([[h, h], [h, -h]])
    return hadamard_signs(headdim, seed)[:, None] * h / math.sqrt(headdim)


def fp8_blocks(seqlen: int, block: int = FP8_BLOCK) -> int:
    """How many block scales a head of `seqlen` rows has: ceil(seqlen / block) (the last block may
    be short)."""
    return -(-seqlen // block)


def _row_descale(descale, seqlen: int, block: int) -> np.ndarray:
    """A descale of shape (B, H) (one per head) or (B, H, fp8_blocks(S, block)) (one per `block`
    rows: row r takes block r // block) as a factor broadcasting over (B, S, H, D)."""
    d = np.asarray(descale, np.float64)
    if d.ndim == 2:
        return d[:, None, :, None]
    if d.ndim != 3 or d.shape[2] != fp8_blocks(seqlen, block):
        raise ValueError(f"a descale has shape (B, H) or (B, H, {fp8_blocks(seqlen, block)}) (one scale per {block} "
                         f"of {seqlen} rows); got {d.shape}")
    rows = np.repeat(d, block, axis=2)[:, :, :seqlen]  # (B, H, S)
    return np.swapaxes(rows, 1, 2)[..., None]


def quantize_fp8(x, block: int | None = None, hadamard_seed: int | None = None):
    """x (B, S, H, D) -> (x8 float8_e4m3fn (B, S, H, D), descale float32): descale (B, H) with one
    scale per head (block None), or (B, H, ceil(S / block)) with one scale per block of `block`
    rows (FP8_BLOCK, or FP8_WIDE_KEY_BLOCK: attention_fp8's k and v with kv_block=192,
    attention_quantized's at some head dims; the last block may be short). An all-zero head
    or block gets descale 1; the others amax / 448, but at least the smallest normal float32
    (2^-126: a GPU flushes smaller ones to zero)."""
    if block not in (None, FP8_BLOCK, FP8_WIDE_KEY_BLOCK):
        raise ValueError(f"block must be None, {FP8_BLOCK} or {FP8_WIDE_KEY_BLOCK}; got {block!r}")
    x = _cast(x, np.float64)
    if hadamard_seed is not None:
        x = x @ hadamard_matrix(x.shape[-1], hadamard_seed)
    b, s, h, d = x.shape
    # NaNs do not count towards amax (a NaN stays NaN in x8); a group of NaNs only gets descale 1.
    if block is None:
        amax = np.fmax.reduce(np.abs(x), axis=(1, 3), initial=0.0)  # (B, H)
    else:
        blocks = fp8_blocks(s, block)
        padded = np.zeros((b, blocks * block, h, d))  # zero rows leave amax as it is
        padded[:, :s] = x
        amax = np.fmax.reduce(np.abs(padded.reshape(b, blocks, block, h, d)), axis=(2, 4), initial=0.0)
        amax = np.swapaxes(amax, 1, 2)  # (B, H, blocks)
    descale = np.where(amax > 0, np.maximum(amax / E4M3_MAX, np.finfo(np.float32).tiny), 1.0).astype(np.float32)
    # e4m3fn has no inf: never overflow (a per-head descale takes no block)
    scaled = np.clip(x / _row_descale(descale, s, block or FP8_BLOCK), -E4M3_MAX, E4M3_MAX)
    return scaled.astype(_e4m3()), descale


def dequantize_fp8(x8, descale, block: int = FP8_BLOCK) -> np.ndarray:
    """x8 * descale in float64: descale (B, H), or (B, H, ceil(S / block)) expanded to rows (row r
    takes block r // block), as quantize_fp8 returns it."""
    x8 = np.asarray(x8)
    return x8.astype(np.float64) * _row_descale(descale, x8.shape[1], block)


def forward_p_e4m3(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1), exp_offset: int = 8):
    """Attention as an FP8 kernel computes it from exact inputs, the yardstick of FP8 error bounds:
    P = exp(s - rowmax) * 2^exp_offset rounded to e4m3 before P V, the row sum unrounded (FP8 kernels
    keep P <= 2^8 in e4m3, FlashAttention-3's offset; 0 puts the row maximum at 1). Rows that see no
    key give 0. Returns out (B, Sq, H, Dv) in float64."""
    p = probabilities(q, k, causal=causal, softmax_scale=softmax_scale, window=window)  # rows summing to 1
    top = p.max(axis=-1, keepdims=True, initial=0.0)  # exp(0) / rowsum, or 0 for a row without keys
    unit = np.where(top > 0, top, 1) / 2.0**exp_offset
    p8 = (p / unit).astype(_e4m3()).astype(np.float64) * unit
    return _apply_probs(p8, _cast(v, np.float64), p.shape[1])


def forward_p_codes(q, k, v, *, causal=False, softmax_scale=None, window=(-1, -1)):
    """forward_p_e4m3 as the FP8 kernel computes it with fast_exp (api.attention_fp8), the yardstick of
    its error bound: P as the e4m3 codes of round(8 log2 P) (their mantissas linear within each
    binade), the row's largest at 2^8 with its log2 rounded up to an eighth, codes below 0 clamped to
    0; out divided by the sum of the codes' values. Rows that see no key give 0. Returns out
    (B, Sq, H, Dv) in float64."""
    q, k, v, scale, _ = _prepare(q, k, v, softmax_scale, np.float64)
    z = _masked_scores(q, k, scale, causal, window, 0.0)[0] * math.log2(math.e)  # (-inf where masked)
    top = np.ceil(8 * z.max(axis=-1, keepdims=True, initial=-np.inf)) / 8
    with np.errstate(invalid="ignore"):  # (-inf - -inf in rows without keys: NaN, code 0)
        code = np.nan_to_num(np.rint(8 * (z - top)) + 120, nan=0.0, neginf=0.0)
    p = np.arange(127, dtype=np.uint8).view(_e4m3()).astype(np.float64)[np.clip(code, 0, 126).astype(np.int64)]
    total = p.sum(axis=-1, keepdims=True)
    return _apply_probs(np.divide(p, total, out=np.zeros_like(p), where=total > 0), v, p.shape[1])


def attention_fp8(q8, k8, v8, q_descale, k_descale, v_descale, *, causal=False, softmax_scale=None,
                  window=(-1, -1), kv_block: int = FP8_BLOCK):
    """`forward` on the dequantized inputs, in float64: (out, lse). Block descales: q's per FP8_BLOCK
    rows, k's and v's per kv_block rows (FP8_BLOCK or FP8_WIDE_KEY_BLOCK)."""
    return forward(dequantize_fp8(q8, q_descale), dequantize_fp8(k8, k_descale, kv_block),
                   dequantize_fp8(v8, v_descale, kv_block), causal=causal, softmax_scale=softmax_scale, window=window)


def quantized_inputs(q, k, v, hadamard_seed: int | None = None) -> list[np.ndarray]:
    """q, k and v as attention(q, k, v, fp8=True) quantizes them, dequantized (float64): q with one
    scale per FP8_BLOCK rows, k and v per fp8_key_block(headdim, seqlen_k) rows, q and k after the
    Hadamard transform of `hadamard_seed` (None for none: it cancels in q k^T)."""
    key_block = fp8_key_block(np.shape(q)[-1], np.shape(k)[1])
    return [dequantize_fp8(*quantize_fp8(x, block, seed), block) for x, block, seed in
            ((q, FP8_BLOCK, hadamard_seed), (k, key_block, hadamard_seed), (v, key_block, None))]


def attention_quantized(q, k, v, hadamard_seed: int | None = None, *, causal=False, softmax_scale=None,
                        window=(-1, -1)):
    """attention(q, k, v, fp8=True): attention on quantized_inputs, as `attention_fp8`: (out, lse) in
    float64."""
    return forward(*quantized_inputs(q, k, v, hadamard_seed), causal=causal, softmax_scale=softmax_scale,
                   window=window)
