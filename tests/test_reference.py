"""Property tests of the NumPy reference backend (cuflash.reference).

The reference is the executable specification that every other backend is
checked against, so these tests check it against the mathematics of attention
rather than against another implementation: invariances (key permutation,
per-row score shifts), decompositions (merging partial results by LSE,
varlen = one call per sequence), the blocked online-softmax algorithm against
the naive one, and the backward pass against finite differences.

The number of examples comes from the hypothesis profile registered in
tests/conftest.py (``ci``, ``dev``, ``explore``); nothing here sets it.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from cuflash import reference as ref

# Any floating-point warning (invalid value, division by zero, overflow) from
# the reference is a bug: it is how a NaN or inf would first show up.
pytestmark = pytest.mark.filterwarnings("error::RuntimeWarning")

# Sizes that make tiling edges interesting: 1, primes, and just past powers of 2.
SEQLENS = [1, 2, 3, 7, 13, 31, 61, 97, 127, 251, 257, 293]
HEADDIMS = [1, 3, 8, 16, 32, 64, 80, 96, 128, 160, 192, 256]
BLOCKS = [16, 32, 64, 128, 17, 48, 5]


# ---------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------


def sizes(choices, upper, lower=1):
    picked = [c for c in choices if lower <= c <= upper] or [upper]
    return st.one_of(st.sampled_from(picked), st.integers(lower, upper))


def window_side(max_w):
    return st.one_of(st.just(-1), st.just(0), st.integers(1, 8), st.integers(0, max_w))


@st.composite
def features(draw, masks=True, softcap=True, max_window=300, max_scale=2.0):
    """Keyword arguments shared by all reference functions."""
    causal = draw(st.booleans()) if masks else False
    window = (draw(window_side(max_window)), draw(window_side(max_window))) if masks else (-1, -1)
    if causal and window[1] > 0:
        window = (window[0], draw(st.sampled_from([-1, 0])))
    cap = draw(st.one_of(st.just(0.0), st.floats(0.5, 50.0))) if softcap else 0.0
    scale = draw(st.one_of(st.none(), st.floats(0.01, max_scale)))
    return dict(causal=causal, window=window, softcap=cap, softmax_scale=scale)


class Problem:
    """One random attention problem: shapes, features and float64 data."""

    def __init__(self, batch, seqlen_q, seqlen_k, nheads_kv, group, headdim, kw, seed):
        self.batch, self.seqlen_q, self.seqlen_k = batch, seqlen_q, seqlen_k
        self.nheads_kv, self.group, self.nheads, self.headdim = nheads_kv, group, nheads_kv * group, headdim
        self.kw = kw
        self.rng = np.random.default_rng(seed)
        r = self.rng
        self.q = r.standard_normal((batch, seqlen_q, self.nheads, headdim))
        self.k = r.standard_normal((batch, seqlen_k, nheads_kv, headdim))
        self.v = r.standard_normal((batch, seqlen_k, nheads_kv, headdim))
        self.dout = r.standard_normal((batch, seqlen_q, self.nheads, headdim))

    @property
    def scale(self):
        s = self.kw["softmax_scale"]
        return 1.0 / math.sqrt(self.headdim) if s is None else s

    @property
    def mask(self):
        return ref.visible_mask(self.seqlen_q, self.seqlen_k, causal=self.kw["causal"],
                                window=self.kw["window"])

    def __repr__(self):
        return (f"Problem(batch={self.batch}, seqlen_q={self.seqlen_q}, seqlen_k={self.seqlen_k}, "
                f"nheads={self.nheads}, nheads_kv={self.nheads_kv}, headdim={self.headdim}, {self.kw})")


@st.composite
def problems(draw, max_seqlen=300, max_headdim=256, min_seqlen=1, feats=None,
             score_budget=300_000, flop_budget=20_000_000):
    """Draw a problem whose batch*heads is scaled down so the score tensor
    (batch*heads*seqlen_q*seqlen_k) and the matmuls stay within budget."""
    seqlen_q = draw(sizes(SEQLENS, max_seqlen, min_seqlen))
    seqlen_k = draw(sizes(SEQLENS, max_seqlen, min_seqlen))
    headdim = draw(sizes(HEADDIMS, max_headdim))
    area = max(seqlen_q * seqlen_k, 1)
    cap = max(1, min(score_budget // area, flop_budget // (area * headdim)))
    nheads_kv = draw(st.integers(1, max(1, min(3, cap))))
    group = draw(st.sampled_from([g for g in (1, 2, 4) if nheads_kv * g <= cap] or [1]))
    batch = draw(st.integers(1, max(1, min(3, cap // (nheads_kv * group)))))
    kw = draw(feats if feats is not None else features())
    seed = draw(st.integers(0, 2**32 - 1))
    return Problem(batch, seqlen_q, seqlen_k, nheads_kv, group, headdim, kw, seed)


# ---------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------


def no_nan(*arrays):
    for a in arrays:
        assert not np.isnan(np.asarray(a, dtype=np.float64)).any(), "NaN in result"


def repeat_kv(x, group):
    """Materialise GQA explicitly (test-side only): (B, S, Hkv, D) -> (B, S, H, D)."""
    return np.repeat(x, group, axis=2)


def assert_lse_close(actual, expected, rtol=1e-10, atol=1e-10):
    """Same -inf pattern, finite entries close."""
    no_nan(actual, expected)
    np.testing.assert_array_equal(np.isneginf(actual), np.isneginf(expected))
    assert np.isfinite(actual[~np.isneginf(actual)]).all()
    fin = np.isfinite(expected)
    np.testing.assert_allclose(actual[fin], expected[fin], rtol=rtol, atol=atol)


def independent_forward(p: Problem):
    """Straightforward attention written independently of the reference:
    explicit repeated K/V, explicit Python mask, scipy-style logsumexp."""
    k, v = repeat_kv(p.k, p.group), repeat_kv(p.v, p.group)
    s = np.einsum("bihd,bjhd->bhij", p.q, k) * p.scale
    if p.kw["softcap"] > 0:
        s = p.kw["softcap"] * np.tanh(s / p.kw["softcap"])
    left, right = p.kw["window"]
    if p.kw["causal"]:
        right = 0
    vis = np.zeros((p.seqlen_q, p.seqlen_k), dtype=bool)
    for i in range(p.seqlen_q):
        for j in range(p.seqlen_k):
            d = j - (i + p.seqlen_k - p.seqlen_q)
            vis[i, j] = (left == -1 or d >= -left) and (right == -1 or d <= right)
    s = np.where(vis, s, -np.inf)
    lse = np.full(s.shape[:-1], -np.inf)
    probs = np.zeros_like(s)
    rows = vis.any(-1)
    if rows.any():
        sr = s[:, :, rows]
        m = sr.max(-1, keepdims=True)
        lse[:, :, rows] = (m + np.log(np.exp(sr - m).sum(-1, keepdims=True)))[..., 0]
        probs[:, :, rows] = np.exp(sr - lse[:, :, rows][..., None])
    return np.einsum("bhij,bjhd->bihd", probs, v), lse, probs, vis


# ---------------------------------------------------------------------------
# 1. forward_tiled == forward
# ---------------------------------------------------------------------------


@given(p=problems(), block_m=st.sampled_from(BLOCKS), block_n=st.sampled_from(BLOCKS))
def test_tiled_matches_naive(p, block_m, block_n):
    out, lse = ref.forward(p.q, p.k, p.v, **p.kw)
    out_t, lse_t = ref.forward_tiled(p.q, p.k, p.v, block_m=block_m, block_n=block_n, **p.kw)
    no_nan(out, lse, out_t, lse_t)
    assert out_t.shape == out.shape and lse_t.shape == lse.shape
    assert out_t.dtype == lse_t.dtype == np.float64
    assert_lse_close(lse_t, lse, rtol=1e-12, atol=1e-11)
    np.testing.assert_allclose(out_t, out, rtol=1e-10, atol=1e-12 * np.abs(p.v).max())
    dead = np.isneginf(lse).transpose(0, 2, 1)  # (B, Sq, H)
    assert (out_t[dead] == 0).all() and (out[dead] == 0).all()


@given(p=problems(max_seqlen=160, score_budget=60_000), block_m=st.sampled_from(BLOCKS),
       block_n=st.sampled_from(BLOCKS))
def test_tiled_backward_matches_naive(p, block_m, block_n):
    out, lse = ref.forward(p.q, p.k, p.v, **p.kw)
    grads = ref.backward(p.dout, p.q, p.k, p.v, out, lse, **p.kw)
    tiled = ref.backward_tiled(p.dout, p.q, p.k, p.v, out, lse, block_m=block_m, block_n=block_n, **p.kw)
    for name, want, got in zip(("dq", "dk", "dv"), grads, tiled):
        no_nan(got)
        assert got.shape == want.shape, name
        np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-10 * max(1.0, np.abs(want).max()), err_msg=name)


@given(seqlen_q=st.integers(1, 90), seqlen_k=st.integers(1, 90), causal=st.booleans(),
       left=st.integers(-1, 40), right=st.integers(-1, 40), block_n=st.sampled_from([1, 3, 16, 64]))
def test_query_range_is_exactly_the_rows_that_see_a_key_block(seqlen_q, seqlen_k, causal, left, right, block_n):
    """The backward visits, per key block, exactly the query rows that see one of its keys."""
    window = (left, -1 if causal else right)
    vis = ref.visible_mask(seqlen_q, seqlen_k, causal=causal, window=window)
    lo_bound, hi_bound = ref.window_bounds(causal, window)
    for c0 in range(0, seqlen_k, block_n):
        c1 = min(c0 + block_n, seqlen_k)
        lo, hi = ref._query_range(c0, c1, seqlen_q, seqlen_k, lo_bound, hi_bound)
        rows = np.flatnonzero(vis[:, c0:c1].any(axis=1))
        if rows.size:
            assert (lo, hi) == (rows[0], rows[-1] + 1)
            assert vis[rows[0]:rows[-1] + 1, c0:c1].any(axis=1).all()  # contiguous
        else:
            assert lo >= hi


# ---------------------------------------------------------------------------
# 2. probabilities are a row-stochastic matrix, and out = P V
# ---------------------------------------------------------------------------


@given(p=problems(score_budget=100_000))
def test_probabilities_rows_and_out_equals_pv(p):
    probs = ref.probabilities(p.q, p.k, **p.kw)
    out, lse = ref.forward(p.q, p.k, p.v, **p.kw)
    no_nan(probs, out, lse)
    mask = p.mask
    assert probs.shape == (p.batch, p.nheads, p.seqlen_q, p.seqlen_k)
    assert (probs >= 0).all()
    assert (probs[..., ~mask] == 0).all()
    sees = mask.any(-1)
    sums = probs.sum(-1)
    np.testing.assert_allclose(sums[..., sees], 1.0, rtol=0, atol=1e-12)
    assert (sums[..., ~sees] == 0).all()
    np.testing.assert_array_equal(np.isneginf(lse), np.broadcast_to(~sees, lse.shape))

    pv = np.einsum("bhij,bjhd->bihd", probs, repeat_kv(p.v, p.group))
    np.testing.assert_allclose(out, pv, rtol=1e-10, atol=1e-12 * np.abs(p.v).max())

    # ... and all of it agrees with an independent straightforward implementation.
    out_i, lse_i, probs_i, vis_i = independent_forward(p)
    np.testing.assert_array_equal(mask, vis_i)
    np.testing.assert_allclose(probs, probs_i, rtol=1e-9, atol=1e-13)
    assert_lse_close(lse, lse_i, rtol=1e-12, atol=1e-11)
    np.testing.assert_allclose(out, out_i, rtol=1e-9, atol=1e-12 * np.abs(p.v).max())


# ---------------------------------------------------------------------------
# 3. permuting keys together with values changes nothing (no mask)
# ---------------------------------------------------------------------------


@given(p=problems(feats=features(masks=False)))
def test_key_permutation_invariance(p):
    perm = p.rng.permutation(p.seqlen_k)
    out, lse = ref.forward(p.q, p.k, p.v, **p.kw)
    out_p, lse_p = ref.forward(p.q, p.k[:, perm], p.v[:, perm], **p.kw)
    no_nan(out, lse, out_p, lse_p)
    assert_lse_close(lse_p, lse, rtol=1e-12, atol=1e-11)
    np.testing.assert_allclose(out_p, out, rtol=1e-10, atol=1e-12 * np.abs(p.v).max())


# ---------------------------------------------------------------------------
# 4. adding a constant to a row's scores changes out, and shifts lse exactly
# ---------------------------------------------------------------------------


@given(p=problems(feats=features(softcap=False)))
def test_row_shift_invariance(p):
    # k' = k + w adds scale * (q_i . w) to every score of row i (per head).
    w = p.rng.standard_normal((p.batch, 1, p.nheads_kv, p.headdim))
    out, lse = ref.forward(p.q, p.k, p.v, **p.kw)
    out_s, lse_s = ref.forward(p.q, p.k + w, p.v, **p.kw)
    no_nan(out, lse, out_s, lse_s)
    shift = p.scale * np.einsum("bihd,bhd->bhi", p.q, repeat_kv(w, p.group)[:, 0])
    np.testing.assert_array_equal(np.isneginf(lse_s), np.isneginf(lse))
    fin = np.isfinite(lse)
    np.testing.assert_allclose(lse_s[fin], (lse + shift)[fin], rtol=1e-11,
                               atol=1e-11 * (1 + np.abs(shift).max(initial=0)))
    # The scores of a row keep their differences, so P and out are unchanged;
    # rounding grows with the size of the scores.
    tol = 1e-12 * (1 + p.scale * np.abs(p.q).max() * np.abs(p.k + w).max() * p.headdim)
    np.testing.assert_allclose(out_s, out, rtol=0, atol=tol * np.abs(p.v).max())


# ---------------------------------------------------------------------------
# 5. rows that see no key: out 0, lse -inf, never NaN
# ---------------------------------------------------------------------------


def _check_dead_rows(q, k, v, **kw):
    sq, sk = q.shape[1], k.shape[1]
    mask = ref.visible_mask(sq, sk, causal=kw.get("causal", False), window=kw.get("window", (-1, -1)))
    dead = ~mask.any(-1)
    results = [ref.forward(q, k, v, **kw), ref.forward_tiled(q, k, v, block_m=16, block_n=16, **kw)]
    for out, lse in results:
        no_nan(out, lse)
        assert out.shape == q.shape and lse.shape == (q.shape[0], q.shape[2], sq)
        np.testing.assert_array_equal(np.isneginf(lse), np.broadcast_to(dead, lse.shape))
        assert np.isfinite(lse[..., ~dead]).all()
        assert (out[:, dead] == 0).all()
    out, lse = results[0]
    probs = ref.probabilities(q, k, **kw)
    no_nan(probs)
    assert (probs[:, :, dead] == 0).all()
    dout = np.ones_like(out)
    dq, dk, dv = ref.backward(dout, q, k, v, out, lse, **kw)
    no_nan(dq, dk, dv)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert (dq[:, dead] == 0).all()
    unseen = ~mask.any(0)  # keys no query sees get no gradient
    assert (dk[:, unseen] == 0).all() and (dv[:, unseen] == 0).all()
    return dead


@given(p=problems(feats=features(softcap=True)), causal=st.booleans(),
       left=window_side(40), right=window_side(40))
def test_rows_without_keys(p, causal, left, right):
    window = (left, -1 if causal and right > 0 else right)
    kw = dict(p.kw, causal=causal, window=window)
    _check_dead_rows(p.q, p.k, p.v, **kw)


@pytest.mark.parametrize(
    "seqlen_q, seqlen_k, kw, n_dead",
    [
        (10, 4, dict(causal=True), 6),  # causal, more queries than keys
        (7, 1, dict(causal=True), 6),
        (8, 5, dict(window=(0, 0)), 3),  # each row sees exactly key i - 3
        (5, 8, dict(window=(0, 0)), 0),
        (6, 6, dict(window=(0, 0)), 0),
        (9, 3, dict(window=(1, 0)), 6),  # row i sees keys i-7..i-6: rows 0..5 see none
        (4, 9, dict(causal=True, window=(0, -1)), 0),
        (12, 2, dict(causal=True, window=(2, 0)), 10),
        (5, 0, {}, 5),  # no keys at all
        (5, 0, dict(causal=True), 5),
        (0, 5, {}, 0),  # no queries at all
        (0, 0, dict(causal=True), 0),
    ],
)
def test_rows_without_keys_examples(seqlen_q, seqlen_k, kw, n_dead):
    rng = np.random.default_rng(seqlen_q * 100 + seqlen_k)
    q = rng.standard_normal((2, seqlen_q, 4, 8))
    k = rng.standard_normal((2, seqlen_k, 2, 8))
    v = rng.standard_normal((2, seqlen_k, 2, 8))
    dead = _check_dead_rows(q, k, v, **kw)
    assert dead.sum() == n_dead


# ---------------------------------------------------------------------------
# 6. backward == central finite differences
# ---------------------------------------------------------------------------


@given(p=problems(max_seqlen=40, max_headdim=32, score_budget=8_000))
def test_backward_matches_finite_differences(p):
    kw = p.kw
    out, lse = ref.forward(p.q, p.k, p.v, **kw)
    grads = ref.backward(p.dout, p.q, p.k, p.v, out, lse, **kw)
    no_nan(*grads)
    base = {"q": p.q, "k": p.k, "v": p.v}
    loss_scale = np.abs(p.dout * out).sum() + 1.0
    eps = 1e-6
    for (name, x), g in zip(base.items(), grads):
        assert g.shape == x.shape and g.dtype == np.float64
        u = p.rng.standard_normal(x.shape)

        def loss(sign):
            args = dict(base, **{name: x + sign * eps * u})
            return np.sum(p.dout * ref.forward(args["q"], args["k"], args["v"], **kw)[0])

        fd = (loss(+1) - loss(-1)) / (2 * eps)
        an = np.sum(g * u)
        # Relative 1e-6 on the directional derivative, plus the rounding
        # noise of the difference quotient (~1e-16 * |L| / eps).
        tol = 1e-6 * abs(an) + 1e-9 * (np.abs(g * u).sum() + loss_scale)
        assert abs(fd - an) <= tol, (name, fd, an, tol)


@given(p=problems(max_seqlen=64, max_headdim=64))
def test_backward_preprocess(p):
    out, _ = ref.forward(p.q, p.k, p.v, **p.kw)
    d = ref.backward_preprocess(p.dout, out)
    assert d.shape == (p.batch, p.nheads, p.seqlen_q) and d.dtype == np.float64
    np.testing.assert_allclose(d, np.sum(p.dout * out, -1).transpose(0, 2, 1), rtol=1e-13, atol=1e-13)
    # The varlen layout (T, H, D) gives (H, T).
    flat = ref.backward_preprocess(p.dout[0], out[0])
    np.testing.assert_allclose(flat, d[0], rtol=1e-13, atol=1e-13)


# ---------------------------------------------------------------------------
# 7. varlen == one call per sequence
# ---------------------------------------------------------------------------


def varlen_lengths(max_len):
    return st.one_of(st.just(0), sizes(SEQLENS, max_len))


@given(
    lens=st.lists(st.tuples(varlen_lengths(70), varlen_lengths(70)), min_size=1, max_size=4),
    nheads_kv=st.integers(1, 2),
    group=st.sampled_from([1, 2, 4]),
    headdim=sizes(HEADDIMS, 64),
    kw=features(max_window=80),
    seed=st.integers(0, 2**32 - 1),
)
def test_varlen_matches_per_sequence(lens, nheads_kv, group, headdim, kw, seed):
    rng = np.random.default_rng(seed)
    nheads = nheads_kv * group
    cu_q = np.concatenate([[0], np.cumsum([a for a, _ in lens])]).astype(np.int32)
    cu_k = np.concatenate([[0], np.cumsum([b for _, b in lens])]).astype(np.int32)
    q = rng.standard_normal((cu_q[-1], nheads, headdim))
    k = rng.standard_normal((cu_k[-1], nheads_kv, headdim))
    v = rng.standard_normal((cu_k[-1], nheads_kv, headdim))
    dout = rng.standard_normal(q.shape)

    out, lse = ref.varlen_forward(q, k, v, cu_q, cu_k, **kw)
    assert out.shape == q.shape and lse.shape == (nheads, q.shape[0])
    dq, dk, dv = ref.varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, **kw)
    no_nan(out, lse, dq, dk, dv)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for b in range(len(lens)):
        sq, sk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        o_b, l_b = ref.forward(q[None, sq], k[None, sk], v[None, sk], **kw)
        np.testing.assert_allclose(out[sq], o_b[0], rtol=1e-13, atol=1e-14)
        assert_lse_close(lse[:, sq], l_b[0], rtol=1e-13, atol=1e-13)
        g_b = ref.backward(dout[None, sq], q[None, sq], k[None, sk], v[None, sk], o_b, l_b, **kw)
        np.testing.assert_allclose(dq[sq], g_b[0][0], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(dk[sk], g_b[1][0], rtol=1e-12, atol=1e-13)
        np.testing.assert_allclose(dv[sk], g_b[2][0], rtol=1e-12, atol=1e-13)
    # Independently of the per-sequence loop: one attention over all packed tokens, where query i
    # sees key j only inside its own sequence, aligned bottom-right to that sequence.
    packed_out, packed_lse = _packed_attention(q, k, v, cu_q, cu_k, **kw)
    np.testing.assert_allclose(out, packed_out, rtol=1e-12, atol=1e-13)
    assert_lse_close(lse, packed_lse, rtol=1e-12, atol=1e-12)


def _packed_attention(q, k, v, cu_q, cu_k, *, causal, window, softcap, softmax_scale):
    seg_q = np.searchsorted(cu_q, np.arange(q.shape[0]), side="right") - 1
    seg_k = np.searchsorted(cu_k, np.arange(k.shape[0]), side="right") - 1
    pos_q = np.arange(q.shape[0]) - cu_q[seg_q]
    pos_k = np.arange(k.shape[0]) - cu_k[seg_k]
    len_q, len_k = np.diff(cu_q)[seg_q], np.diff(cu_k)[seg_k]
    left, right = (window[0], 0 if causal else window[1])
    diag = pos_q[:, None] + (len_k[None, :] - len_q[:, None])  # the key a query's diagonal meets
    visible = seg_q[:, None] == seg_k[None, :]
    if left >= 0:
        visible &= pos_k[None, :] >= diag - left
    if right >= 0:
        visible &= pos_k[None, :] <= diag + right
    group = q.shape[1] // k.shape[1]
    kx, vx = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
    scale = 1 / np.sqrt(q.shape[-1]) if softmax_scale is None else softmax_scale
    s = np.einsum("ihd,jhd->hij", q, kx) * scale
    if softcap:
        s = softcap * np.tanh(s / softcap)
    s = np.where(visible[None], s, -np.inf)
    m = s.max(-1, keepdims=True, initial=-np.inf)
    m_safe = np.where(np.isfinite(m), m, 0.0)
    e = np.exp(s - m_safe)
    total = e.sum(-1, keepdims=True)
    with np.errstate(divide="ignore"):
        lse = (np.log(total) + m_safe)[..., 0]
    p = np.divide(e, total, out=np.zeros_like(e), where=total > 0)
    return np.einsum("hij,jhd->ihd", p, vx), lse


# ---------------------------------------------------------------------------
# 8. merging partial results by LSE == attention over all keys
# ---------------------------------------------------------------------------


@given(p=problems(feats=features(masks=False)), data=st.data())
def test_merge_by_lse(p, data):
    split = data.draw(st.integers(0, p.seqlen_k), label="split")
    kw = p.kw
    out, lse = ref.forward(p.q, p.k, p.v, **kw)
    o1, l1 = ref.forward(p.q, p.k[:, :split], p.v[:, :split], **kw)
    o2, l2 = ref.forward(p.q, p.k[:, split:], p.v[:, split:], **kw)
    no_nan(o1, l1, o2, l2)
    merged_lse = np.logaddexp(l1, l2)
    w1 = np.exp(l1 - merged_lse).transpose(0, 2, 1)[..., None]  # (B, Sq, H, 1)
    w2 = np.exp(l2 - merged_lse).transpose(0, 2, 1)[..., None]
    merged = w1 * o1 + w2 * o2
    assert_lse_close(merged_lse, lse, rtol=1e-12, atol=1e-11)
    np.testing.assert_allclose(merged, out, rtol=1e-10, atol=1e-12 * np.abs(p.v).max())


# ---------------------------------------------------------------------------
# 9. dtypes: float32 compute agrees with float64; low-precision inputs accepted
# ---------------------------------------------------------------------------


@given(p=problems(feats=features(max_scale=0.5)))
def test_float32_compute_agrees(p):
    o64, l64 = ref.forward(p.q, p.k, p.v, **p.kw)
    for fn in (ref.forward, ref.forward_tiled):
        o32, l32 = fn(p.q, p.k, p.v, compute_dtype=np.float32, **p.kw)
        assert o32.dtype == np.float32 and l32.dtype == np.float32
        no_nan(o32, l32)
        np.testing.assert_array_equal(np.isneginf(l32), np.isneginf(l64))
        fin = np.isfinite(l64)
        np.testing.assert_allclose(l32[fin], l64[fin], rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(o32, o64, rtol=1e-5, atol=1e-5 * np.abs(p.v).max())
    g64 = ref.backward(p.dout, p.q, p.k, p.v, o64, l64, **p.kw)
    g32 = ref.backward(p.dout, p.q, p.k, p.v, o64, l64, compute_dtype=np.float32, **p.kw)
    # A gradient can vanish (dq and dk are 0 with a single key), so the
    # absolute tolerance is relative to the largest of the three gradients.
    gmax = max(np.abs(b).max(initial=0) for b in g64)
    for a, b in zip(g32, g64):
        assert a.dtype == np.float32
        no_nan(a)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * gmax)


@pytest.mark.parametrize("in_dtype", [np.float16, ml_dtypes.bfloat16, np.float32])
@given(p=problems(max_seqlen=100, max_headdim=64))
def test_low_precision_inputs(in_dtype, p):
    """Low-precision inputs are converted exactly to compute_dtype."""
    q, k, v, dout = (x.astype(in_dtype) for x in (p.q, p.k, p.v, p.dout))
    q64, k64, v64, dout64 = (x.astype(np.float64) for x in (q, k, v, dout))
    for compute_dtype in (np.float64, np.float32):
        out, lse = ref.forward(q, k, v, compute_dtype=compute_dtype, **p.kw)
        out_e, lse_e = ref.forward(q64, k64, v64, compute_dtype=compute_dtype, **p.kw)
        assert out.dtype == lse.dtype == compute_dtype
        no_nan(out, lse)
        np.testing.assert_array_equal(out, out_e)
        np.testing.assert_array_equal(lse, lse_e)
        out_t, lse_t = ref.forward_tiled(q, k, v, compute_dtype=compute_dtype, **p.kw)
        assert out_t.dtype == compute_dtype
        no_nan(out_t, lse_t)
        grads = ref.backward(dout, q, k, v, out.astype(in_dtype), lse, compute_dtype=compute_dtype, **p.kw)
        grads_e = ref.backward(dout64, q64, k64, v64, out.astype(in_dtype).astype(np.float64), lse,
                               compute_dtype=compute_dtype, **p.kw)
        for a, b in zip(grads, grads_e):
            assert a.dtype == compute_dtype
            no_nan(a)
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------------------
# 10. window_bounds and visible_mask
# ---------------------------------------------------------------------------


@given(left=st.integers(-1, 300), right=st.integers(-1, 300))
def test_window_bounds(left, right):
    assert ref.window_bounds(False, (left, right)) == (left, right)
    if right in (-1, 0):
        assert ref.window_bounds(True, (left, right)) == (left, 0)
    else:
        with pytest.raises(ValueError, match="window"):
            ref.window_bounds(True, (left, right))


@pytest.mark.parametrize("window", [(-2, 0), (0, -2), (-5, -5)])
def test_window_bounds_rejects_below_minus_one(window):
    with pytest.raises(ValueError, match="window"):
        ref.window_bounds(False, window)


def test_causal_contradiction_raises_everywhere():
    q = np.zeros((1, 3, 1, 4))
    with pytest.raises(ValueError, match="window"):
        ref.window_bounds(True, (3, 5))
    with pytest.raises(ValueError, match="window"):
        ref.visible_mask(3, 3, causal=True, window=(-1, 1))
    for fn in (ref.forward, ref.forward_tiled):
        with pytest.raises(ValueError, match="window"):
            fn(q, q, q, causal=True, window=(2, 5))


@given(seqlen_q=sizes(SEQLENS, 70, 0), seqlen_k=sizes(SEQLENS, 70, 0), causal=st.booleans(),
       left=window_side(80), right=window_side(80))
def test_visible_mask_definition(seqlen_q, seqlen_k, causal, left, right):
    if causal and right > 0:
        right = 0
    mask = ref.visible_mask(seqlen_q, seqlen_k, causal=causal, window=(left, right))
    assert mask.shape == (seqlen_q, seqlen_k) and mask.dtype == bool
    r = 0 if causal else right
    for i in range(seqlen_q):
        lo = i + seqlen_k - seqlen_q - left
        hi = i + seqlen_k - seqlen_q + r
        expected = [(left == -1 or j >= lo) and (r == -1 or j <= hi) for j in range(seqlen_k)]
        assert mask[i].tolist() == expected
    # causal is the same as the window with right bound 0
    if causal:
        np.testing.assert_array_equal(
            mask, ref.visible_mask(seqlen_q, seqlen_k, causal=False, window=(left, 0)))
