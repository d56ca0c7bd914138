"""Train a tiny transformer with cuflash attention in JAX, or with `jax.nn.dot_product_attention`,
and compare: the JAX twin of examples/train_torch.py (same task, same model shape), written with
plain jax.numpy and a hand-rolled AdamW so that it needs nothing beyond JAX. The training step is
one `jax.jit` of `jax.value_and_grad`: cuflash's forward and backward kernels run inside XLA's
program (on a GPU) through `cuflash.jax.attention`.

  python examples/train_jax.py --steps 300
  JAX_PLATFORMS=cpu python examples/train_jax.py --attention cuflash --steps 3   # the reference, slow
"""
from __future__ import annotations

import argparse
import math

import jax
import jax.numpy as jnp
import numpy as np

import cuflash.jax as cj


def init_params(key, vocab: int, seqlen: int, dim: int, layers: int, nheads: int, nheads_kv: int) -> dict:
    headdim = dim // nheads
    keys = iter(jax.random.split(key, 4 + 4 * layers))

    def dense(fan_in, fan_out):  # the spread of torch.nn.Linear's default initialisation
        return jax.random.normal(next(keys), (fan_in, fan_out), jnp.float32) / math.sqrt(3 * fan_in)

    blocks = [dict(norm1=jnp.ones(dim), norm2=jnp.ones(dim),
                   qkv=dense(dim, (nheads + 2 * nheads_kv) * headdim), proj=dense(dim, dim),
                   up=dense(dim, 4 * dim), down=dense(4 * dim, dim)) for _ in range(layers)]
    return dict(embed=jax.random.normal(next(keys), (vocab, dim)) * 0.02,
                pos=jax.random.normal(next(keys), (seqlen, dim)) * 0.02,
                blocks=blocks, norm=jnp.ones(dim), head=dense(dim, vocab))


def layer_norm(x, scale):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * scale


def attention(block, x, nheads: int, nheads_kv: int, impl: str):
    batch, seqlen, dim = x.shape
    headdim = dim // nheads
    qkv = (x @ block["qkv"]).astype(jnp.bfloat16)
    q, k, v = jnp.split(qkv, [nheads * headdim, (nheads + nheads_kv) * headdim], axis=-1)
    q = q.reshape(batch, seqlen, nheads, headdim)
    k, v = (t.reshape(batch, seqlen, nheads_kv, headdim) for t in (k, v))
    if impl == "cuflash":
        out = cj.attention(q, k, v, causal=True)
    else:
        out = jax.nn.dot_product_attention(q, k, v, is_causal=True)
    return out.reshape(batch, seqlen, dim).astype(jnp.float32) @ block["proj"]


def forward(params, tokens, nheads: int, nheads_kv: int, impl: str):
    x = params["embed"][tokens] + params["pos"][:tokens.shape[1]]
    for block in params["blocks"]:
        x = x + attention(block, layer_norm(x, block["norm1"]), nheads, nheads_kv, impl)
        x = x + jax.nn.gelu(layer_norm(x, block["norm2"]) @ block["up"]) @ block["down"]
    return layer_norm(x, params["norm"]) @ params["head"]


def train(impl: str, steps: int, *, seed: int = 0, batch: int = 16, seqlen: int = 256, period: int = 16,
          vocab: int = 16, dim: int = 256, layers: int = 2, nheads: int = 4, nheads_kv: int = 2, lr: float = 1e-3,
          log_every: int = 0) -> list[float]:
    """The loss of every step; the same weights and batches for either attention."""
    params = init_params(jax.random.PRNGKey(seed), vocab, seqlen, dim, layers, nheads, nheads_kv)
    moments = (jax.tree.map(jnp.zeros_like, params), jax.tree.map(jnp.zeros_like, params))
    rng = np.random.default_rng(seed)

    def loss_fn(params, tokens):
        logits = forward(params, tokens[:, :-1], nheads, nheads_kv, impl)
        logp = jax.nn.log_softmax(logits)
        return -jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1).mean()

    @jax.jit
    def step(params, moments, tokens, t):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        b1, b2, eps, decay = 0.9, 0.999, 1e-8, 0.01  # torch.optim.AdamW's defaults
        m1 = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g, moments[0], grads)
        m2 = jax.tree.map(lambda m, g: b2 * m + (1 - b2) * g * g, moments[1], grads)
        params = jax.tree.map(lambda p, a, b: p * (1 - lr * decay) - lr * (a / (1 - b1 ** t)) /
                              (jnp.sqrt(b / (1 - b2 ** t)) + eps), params, m1, m2)
        return params, (m1, m2), loss

    losses = []
    for t in range(1, steps + 1):
        block = rng.integers(vocab, size=(batch, period))
        tokens = jnp.asarray(np.tile(block, (1, seqlen // period)), jnp.int32)
        params, moments, loss = step(params, moments, tokens, t)
        losses.append(float(loss))
        if log_every and ((t - 1) % log_every == 0 or t == steps):
            print(f"{impl:8s} step {t - 1:4d}  loss {losses[-1]:.4f}", flush=True)
    return losses


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--attention", choices=("cuflash", "jax", "both"), default="both")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    impls = ("cuflash", "jax") if args.attention == "both" else (args.attention,)
    for impl in impls:
        losses = train(impl, args.steps, log_every=max(1, args.steps // 10))
        tail = losses[-min(50, len(losses)):]
        print(f"{impl}: loss {losses[0]:.3f} -> {sum(tail) / len(tail):.3f} (mean of the last {len(tail)} steps)")


if __name__ == "__main__":
    main()
