"""Packing sequences of different lengths for `cuflash.attention_varlen`, and unpacking the result.

Instead of padding a batch to its longest sequence, the sequences are laid end to end: q is
(total_tokens, nheads, headdim) and an int32 `cu_seqlens` of length batch + 1 holds the prefix sums
of the lengths (sequence b is rows cu_seqlens[b]:cu_seqlens[b+1]). Attention never crosses from one
sequence into another, so each sequence's slice of the packed output must equal `cuflash.attention`
on that sequence alone (a batch of one) — which is what this example checks, for the output and lse.

It runs on whatever is here: torch CUDA tensors if torch sees a GPU, else CuPy arrays if CuPy does
(both bf16, cuflash's kernels), else NumPy (float16, the NumPy reference).

  python examples/varlen_packing.py                      # picks torch, cupy or numpy
  python examples/varlen_packing.py --framework numpy
"""
from __future__ import annotations

import argparse

import numpy as np

import cuflash


def available_framework() -> str:
    """'torch' (CUDA), 'cupy' or 'numpy': the first that can run here."""
    try:
        import torch

        if torch.cuda.is_available():
            return "torch"
    except ImportError:
        pass
    try:
        import cupy

        if cupy.cuda.runtime.getDeviceCount() > 0:
            return "cupy"
    except Exception:  # no CuPy, no driver or no device
        pass
    return "numpy"


def to_framework(x: np.ndarray, framework: str, dtype: str):
    """A float32 or int32 NumPy array as `framework`'s array (on the GPU for torch and cupy), cast to dtype."""
    if framework == "numpy":
        return x.astype(np.dtype(dtype) if dtype != "bfloat16" else _bfloat16())
    if framework == "cupy":
        import cupy

        return cupy.asarray(x).astype(np.dtype(dtype) if dtype != "bfloat16" else _bfloat16())
    import torch

    return torch.from_numpy(x).to("cuda", getattr(torch, dtype))


def _bfloat16():
    import ml_dtypes

    return ml_dtypes.bfloat16


def _concatenate(arrays: list, framework: str):
    if framework == "torch":
        import torch

        return torch.cat(arrays)
    if framework == "cupy":
        import cupy

        return cupy.concatenate(arrays)
    return np.concatenate(arrays)


def host_values(x) -> np.ndarray:
    """A small array's values on the host (for GPU arrays a copy, which waits for the GPU)."""
    if isinstance(x, np.ndarray):
        return x
    if hasattr(x, "get"):  # cupy
        return x.get()
    return x.cpu().numpy()  # torch


def pack(sequences: list, framework: str):
    """(seqlen_b, heads, headdim) arrays -> the packed (total, heads, headdim) array, int32 cu_seqlens
    (on the arrays' device) and the longest length."""
    lengths = [int(s.shape[0]) for s in sequences]
    cu_seqlens = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32)
    return _concatenate(sequences, framework), to_framework(cu_seqlens, framework, "int32"), max(lengths)


def unpack(packed, cu_seqlens, axis: int = 0) -> list:
    """A packed array back as a list of per-sequence views (no copies) along its token axis: 0 for
    out (total, nheads, headdim), 1 for lse (nheads, total)."""
    bounds = host_values(cu_seqlens).tolist()
    return [packed[(slice(None),) * axis + (slice(start, end),)] for start, end in zip(bounds[:-1], bounds[1:])]


def batch_of_one(x):
    """(seqlen, heads, headdim) -> (1, seqlen, heads, headdim), a view."""
    return x[None]


def max_difference(framework: str | None = None, dtype: str | None = None, *, lengths=(37, 1, 128, 64, 5, 90),
                   nheads: int = 8, nheads_kv: int = 2, headdim: int = 64, causal: bool = True,
                   seed: int = 0) -> dict[str, float]:
    """Packed varlen attention against attention on each sequence alone. Returns {"out": max |varlen -
    per sequence| over every sequence's output, "lse": the same for lse}, in float32.
    framework: 'numpy', 'cupy' or 'torch' (CUDA); None picks the first available.
    dtype: bf16 on the GPU, float16 with NumPy, unless given."""
    framework = framework or available_framework()
    dtype = dtype or ("float16" if framework == "numpy" else "bfloat16")
    rng = np.random.default_rng(seed)

    def make(length, heads):
        return to_framework(rng.standard_normal((length, heads, headdim), np.float32), framework, dtype)

    qs = [make(n, nheads) for n in lengths]  # one (seqlen, heads, headdim) array per sequence
    ks = [make(n, nheads_kv) for n in lengths]
    vs = [make(n, nheads_kv) for n in lengths]

    q, cu_seqlens, max_seqlen = pack(qs, framework)
    k, _, _ = pack(ks, framework)
    v, _, _ = pack(vs, framework)
    out, lse = cuflash.attention_varlen(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=causal,
                                        return_lse=True)  # out (total, nheads, headdim), lse (nheads, total)

    diff = {"out": 0.0, "lse": 0.0}
    for b, (out_b, lse_b) in enumerate(zip(unpack(out, cu_seqlens), unpack(lse, cu_seqlens, axis=1))):
        # the same sequence alone, as a batch of one: out (1, seqlen, nheads, headdim), lse (1, nheads, seqlen)
        alone, lse_alone = cuflash.attention(*(batch_of_one(x[b]) for x in (qs, ks, vs)), causal=causal,
                                             return_lse=True)
        diff["out"] = max(diff["out"], _max_abs_diff(out_b, alone[0]))
        diff["lse"] = max(diff["lse"], _max_abs_diff(lse_b, lse_alone[0]))
    return diff


def _max_abs_diff(a, b) -> float:
    """max |a - b| in float32, for NumPy, CuPy and torch arrays alike."""
    if hasattr(a, "float"):  # torch
        return (a.float() - b.float()).abs().max().item()
    return float(abs(a.astype(np.float32) - b.astype(np.float32)).max())  # NumPy or CuPy


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--framework", choices=("numpy", "cupy", "torch"), default=None,
                        help="default: torch if it sees a GPU, else cupy if it does, else numpy")
    args = parser.parse_args()
    framework = args.framework or available_framework()
    dtype = "float16" if framework == "numpy" else "bfloat16"
    lengths = (37, 1, 128, 64, 5, 90)
    print(f"{framework} {dtype}: {len(lengths)} sequences of lengths {lengths} packed into {sum(lengths)} tokens, "
          f"cu_seqlens = {np.concatenate([[0], np.cumsum(lengths)]).tolist()}, causal GQA 8/2 heads")
    diff = max_difference(framework, dtype, lengths=lengths)
    print(f"  max |varlen slice - attention on the sequence alone|: out {diff['out']:.1e}, lse {diff['lse']:.1e}")


if __name__ == "__main__":
    main()
