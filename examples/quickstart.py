"""cuflash quick start: one call, every framework.

NumPy arrays (and CPU torch tensors / JAX CPU arrays) run the NumPy reference; GPU arrays (CuPy,
torch CUDA, JAX on GPU) run cuflash's kernels. Outputs come back in the caller's framework.
Run: python examples/quickstart.py
"""
import numpy as np

import cuflash

rng = np.random.default_rng(0)
batch, seqlen, nheads, nheads_kv, headdim = 2, 256, 8, 2, 64
q = rng.standard_normal((batch, seqlen, nheads, headdim)).astype(np.float16)
k = rng.standard_normal((batch, seqlen, nheads_kv, headdim)).astype(np.float16)  # GQA: 4 query heads per kv head
v = rng.standard_normal((batch, seqlen, nheads_kv, headdim)).astype(np.float16)

out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
print(f"numpy: out {out.shape} {out.dtype}, lse {lse.shape} {lse.dtype}")

try:
    import torch

    out_torch = cuflash.attention(torch.from_numpy(q), torch.from_numpy(k), torch.from_numpy(v), causal=True)
    print(f"torch: {type(out_torch).__name__} {tuple(out_torch.shape)}, max |torch - numpy| = "
          f"{(out_torch.float().numpy() - out.astype(np.float32)).__abs__().max():.1e}")
except ImportError:
    print("torch: not installed")

try:
    import jax

    attend = jax.jit(lambda q, k, v: cuflash.attention(q, k, v, causal=True))
    out_jax = attend(q, k, v)
    print(f"jax.jit: {type(out_jax).__name__} {out_jax.shape}, max |jax - numpy| = "
          f"{np.abs(np.asarray(out_jax, np.float32) - out.astype(np.float32)).max():.1e}")
except ImportError:
    print("jax: not installed")
