"""What the forward launchers put in the kernels' parameter structs (no GPU needed)."""
import math

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
