"""Gradients through cuflash in JAX: `jax.jit` of `jax.value_and_grad`, and `jax.vmap` over it.

A small loss over causal, grouped-query attention (8 query heads, 2 key/value heads) is
differentiated in q, k and v twice: once through `cuflash.jax.attention` (a `jax.custom_vjp` whose
forward and backward are cuflash's, inside XLA's program) and once through JAX's own
`jax.nn.dot_product_attention`. Both take (batch, seqlen, heads, headdim), so the two losses differ
in the attention call alone; their values and gradients must agree up to rounding. Then the same
gradient is vmapped over a leading axis (a stack of independent problems).

On a GPU the inputs are bf16 and cuflash runs its kernels; on the CPU they are float32 and cuflash
runs the NumPy reference.

  python examples/jax_grad.py
  JAX_PLATFORMS=cpu python examples/jax_grad.py
"""
from __future__ import annotations

from functools import partial

import jax
import jax.numpy as jnp

import cuflash.jax as cj


def cuflash_attention(q, k, v):
    return cj.attention(q, k, v, causal=True)


def jax_attention(q, k, v):
    return jax.nn.dot_product_attention(q, k, v, is_causal=True)  # GQA when k has fewer heads than q


def loss(attend, q, k, v, target):
    """Mean squared distance of the attention's output from a target, in float32."""
    out = attend(q, k, v).astype(jnp.float32)
    return jnp.mean(jnp.square(out - target))


def value_and_grad(attend):
    """loss and its gradients in (q, k, v), jit-compiled."""
    return jax.jit(jax.value_and_grad(partial(loss, attend), argnums=(0, 1, 2)))


def vmapped_value_and_grad(attend):
    """The same over a leading axis of q, k and v (one target shared by every problem)."""
    return jax.jit(jax.vmap(jax.value_and_grad(partial(loss, attend), argnums=(0, 1, 2)), in_axes=(0, 0, 0, None)))


def _max_diff(a, b) -> tuple[float, float]:
    """(max |a - b|, max |b|), in float32."""
    a, b = jnp.asarray(a, jnp.float32), jnp.asarray(b, jnp.float32)
    return float(jnp.max(jnp.abs(a - b))), float(jnp.max(jnp.abs(b)))


def differences(dtype=None, *, batch: int = 2, seqlen: int = 128, nheads: int = 8, nheads_kv: int = 2,
                headdim: int = 64, stack: int = 3, seed: int = 0) -> dict[str, tuple[float, float]]:
    """cuflash against jax.nn.dot_product_attention, same inputs. Returns {name: (max |cuflash - jax|,
    max |jax|)} for the loss and dq, dk, dv, plain and vmapped over a leading axis of `stack`.
    dtype: bf16 on a GPU backend, float32 on the CPU, unless given."""
    dtype = dtype or (jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    keys = jax.random.split(jax.random.PRNGKey(seed), 4)
    q = jax.random.normal(keys[0], (stack, batch, seqlen, nheads, headdim), dtype)
    k = jax.random.normal(keys[1], (stack, batch, seqlen, nheads_kv, headdim), dtype)
    v = jax.random.normal(keys[2], (stack, batch, seqlen, nheads_kv, headdim), dtype)
    target = jax.random.normal(keys[3], (batch, seqlen, nheads, headdim), jnp.float32)

    result = {}
    ours, theirs = value_and_grad(cuflash_attention), value_and_grad(jax_attention)
    (loss_a, grads_a), (loss_b, grads_b) = ours(q[0], k[0], v[0], target), theirs(q[0], k[0], v[0], target)
    result["loss"] = _max_diff(loss_a, loss_b)
    result.update({f"d{n}": _max_diff(a, b) for n, a, b in zip("qkv", grads_a, grads_b)})

    ours, theirs = vmapped_value_and_grad(cuflash_attention), vmapped_value_and_grad(jax_attention)
    (loss_a, grads_a), (loss_b, grads_b) = ours(q, k, v, target), theirs(q, k, v, target)
    result["vmap loss"] = _max_diff(loss_a, loss_b)
    result.update({f"vmap d{n}": _max_diff(a, b) for n, a, b in zip("qkv", grads_a, grads_b)})
    return result


def main() -> None:
    dtype = "float32" if jax.default_backend() == "cpu" else "bfloat16"
    print(f"jax {jax.__version__} on {jax.default_backend()}, {dtype}: jit(value_and_grad) of a loss over causal "
          "GQA attention (8/2 heads), cuflash.jax.attention vs jax.nn.dot_product_attention")
    for name, (diff, scale) in differences().items():
        print(f"  {name:10s} max |cuflash - jax| = {diff:.1e}   (max |jax| = {scale:.2e})")


if __name__ == "__main__":
    main()
