"""cuflash quick start with CuPy: attention and its backward on the GPU, checked against the reference.

CuPy arrays in fp16 or bf16, shaped (batch, seqlen, heads, headdim), with grouped-query attention
(8 query heads reading 2 key/value heads). `cuflash.attention` runs cuflash's kernels on them and
gives back CuPy arrays; the same call on their NumPy copies runs the NumPy reference (float64
inside), the executable specification the kernels are tested against. The example prints the
largest difference of the output, lse, and the gradients of `cuflash.attention_backward`.

Needs an NVIDIA GPU (compute capability 8.0 or newer) and CuPy; without them it says so in one
line and exits (examples/quickstart.py runs anywhere).

  python examples/quickstart_cupy.py
  python examples/quickstart_cupy.py --dtype float16
"""
from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

import cuflash

DTYPES = {"bfloat16": ml_dtypes.bfloat16, "float16": np.float16}


def no_gpu_reason() -> str | None:
    """Why cuflash's kernels can't run here, or None if they can."""
    try:
        import cupy
    except ImportError:
        return "CuPy is not installed (pip install 'cuflash[cuda12]', or cuflash[cuda13])"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as error:  # no driver, or one too old for this CuPy
        return f"CuPy is installed but finds no usable GPU ({str(error).strip()})"
    if count == 0:
        return "CuPy is installed but finds no GPU"
    cc = int(cupy.cuda.Device(0).compute_capability)
    if cc < 80:
        return f"GPU 0 has compute capability {cc // 10}.{cc % 10}; cuflash's kernels need 8.0 or newer"
    return None


def max_diff(gpu, reference) -> tuple[float, float]:
    """(max |gpu - reference|, max |reference|) in float32; gpu is a CuPy array, reference NumPy."""
    # (every row sees at least its own key here, so no lse is -inf)
    a, b = gpu.get().astype(np.float32), np.asarray(reference, np.float32)
    return float(np.abs(a - b).max()), float(np.abs(b).max())


def compare(dtype: str = "bfloat16", *, batch: int = 2, seqlen: int = 256, nheads: int = 8, nheads_kv: int = 2,
            headdim: int = 64, seed: int = 0) -> dict[str, tuple[float, float]]:
    """Forward (out, lse) and backward (dq, dk, dv) on the GPU against the reference on the NumPy
    copies of the same inputs. Returns {name: (max |gpu - reference|, max |reference|)}."""
    import cupy

    rng = cupy.random.default_rng(seed)
    make = lambda heads: rng.standard_normal((batch, seqlen, heads, headdim), dtype=cupy.float32).astype(DTYPES[dtype])
    q, k, v = make(nheads), make(nheads_kv), make(nheads_kv)  # GQA: query head h reads kv head h // 4
    dout = make(nheads)

    # GPU: CuPy in, CuPy out; lse is float32 (batch, nheads, seqlen)
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    dq, dk, dv = cuflash.attention_backward(dout, q, k, v, out, lse, causal=True)

    # The reference: the same call on the NumPy copies (q.get() is a NumPy array of the same dtype)
    q_np, k_np, v_np, dout_np = (x.get() for x in (q, k, v, dout))
    out_ref, lse_ref = cuflash.attention(q_np, k_np, v_np, causal=True, return_lse=True)
    dq_ref, dk_ref, dv_ref = cuflash.attention_backward(dout_np, q_np, k_np, v_np, out_ref, lse_ref, causal=True)

    gpu = dict(out=out, lse=lse, dq=dq, dk=dk, dv=dv)
    reference = dict(out=out_ref, lse=lse_ref, dq=dq_ref, dk=dk_ref, dv=dv_ref)
    return {name: max_diff(gpu[name], reference[name]) for name in gpu}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    args = parser.parse_args()
    reason = no_gpu_reason()
    if reason:
        print(f"quickstart_cupy needs an NVIDIA GPU: {reason}. Nothing to run; "
              "examples/quickstart.py shows the CPU reference.")
        return
    import cupy

    name = cupy.cuda.runtime.getDeviceProperties(0)["name"].decode()
    print(f"{name}, {args.dtype}, causal GQA (8 query heads, 2 kv heads): GPU kernels vs the NumPy reference")
    for what, (diff, scale) in compare(args.dtype).items():
        print(f"  {what:4s} max |gpu - reference| = {diff:.1e}   (max |reference| = {scale:.2f})")


if __name__ == "__main__":
    main()
