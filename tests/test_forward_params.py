"""What the forward launchers put in the kernels' parameter structs (no GPU needed)."""
import math
import random

import pytest

from cuflash import arrays
from cuflash.kernels import forward
from cuflash.problem import Problem


def _problem(**kw):
    base = dict(op="attention_forward", framework="torch", device=arrays.Device("cuda", 0), dtype="bfloat16",
                batch=2, seqlen_q=100, seqlen_k=300, nheads=4, nheads_kv=2, headdim=64, softmax_scale=0.125)
    return Problem(**{**base, **kw})


def test_window_bounds_past_every_key_become_unbounded():
    big = 2**31 - 1
    assert forward.kernel_window(_problem(window_left=big, window_right=big)) == (-1, -1)
    assert forward.kernel_window(_problem(window_left=300, window_right=100)) == (-1, -1)  # exactly past
    assert forward.kernel_window(_problem(window_left=299, window_right=99)) == (299, 99)  # still a bound
    assert forward.kernel_window(_problem(window_left=5, window_right=0, causal=True)) == (5, 0)


def test_softmax_constants_fold_log2e_and_the_softcap_scale():
    assert forward.softmax_constants(_problem()) == (0.125 / math.log(2), 0.0, 0.0)
    scale_log2, exp2_scale, softcap = forward.softmax_constants(_problem(softcap=30.0))
    assert scale_log2 == 1 / math.log(2) and softcap == 30.0
    # tanh(x) = 1 - 2 / (2^(exp2_scale * s) + 1) with x = s * softmax_scale / softcap
    s = 7.0
    assert math.isclose(softcap * (1 - 2 / (2 ** (exp2_scale * s) + 1)), 30.0 * math.tanh(s * 0.125 / 30.0),
                        rel_tol=1e-12)


def _fast_div(n, mul, shift):
    """fast_div of cuda_src/common/types.cuh, in Python integers."""
    return (n * mul >> 32) >> shift if mul else n


def test_fast_divisor_divides_exactly_over_the_int32_range():
    from cuflash.kernels import fast_divisor
    rng = random.Random(0)
    divisors = [*range(1, 300), 2**16 - 1, 2**16, 2**16 + 1, 641, 6700417, 2**30 + 3, 2**31 - 1]
    divisors += [rng.randrange(2, 2**31) for _ in range(200)]
    for d in divisors:
        mul, shift = fast_divisor(d)
        assert 0 <= mul < 2**32 and 0 <= shift < 32
        near = [k * d + r for k in (0, 1, 2, (2**31 - 1) // d) for r in (-1, 0, 1)]
        for n in [0, 1, 2**31 - 1, *near, *(rng.randrange(2**31) for _ in range(200))]:
            if 0 <= n < 2**31:
                assert _fast_div(n, mul, shift) == n // d, (n, d)
    with pytest.raises(ValueError):
        fast_divisor(0)
