"""Issue 6's accuracy study, run on cuflash's kernels: RMSE of attention's output against float64
attention of the unquantized inputs, for inputs drawn from a standard normal with 0.1% of entries
multiplied by 10 (FlashAttention-3's outlier test), quantized three ways:

  (a) one scale per tensor (every head's descale the tensor's amax / 448),
  (b) one scale per 128-row block of each head (`quantize_fp8(x, block=128)`),
  (c) (b) with the random-sign Hadamard transform on q and k (`hadamard=True`, one seed for both),

beside cuflash's bf16 attention of the same inputs, and on a GPU (c) again with fast_exp=True (P's
e4m3 codes straight from the scores; (a) / (c) is taken without it). Every path starts from the
bf16 inputs (what `attention(..., fp8=True)` takes); outputs are bf16. On a GPU this is the FP8
kernel as it runs
(P rounded to e4m3 in registers included); without one, torch CPU tensors take the reference
backend's simulation (P exact), as tests/test_fp8.py's study does.

--parts splits (a) and (c) by where the rounding is: float64 attention of the bf16 inputs with
only q and k rounded as (a) or (c) round them ("q, k only"), or only v as (c) rounds it ("v only";
(a)'s one scale for v gives within a few % of it: e4m3 rounds to 2^-4 relative at any scale); the
parts add about in quadrature to the whole.

    python benchmarks/fp8_accuracy.py [--headdims 64,128,256] [--seqlens 1024,4096] [--device cuda|cpu] [--parts]
"""
from __future__ import annotations

import argparse
import sys

import ml_dtypes
import numpy as np
import torch

import cuflash
from cuflash import reference

BATCH, HEADS, OUTLIERS = 2, 4, 0.001


def inputs(rng, shape):
    """Standard normal, a fraction OUTLIERS of the entries times 10 (float64)."""
    x = rng.standard_normal(shape)
    x[rng.random(shape) < OUTLIERS] *= 10
    return x


def exact_attention(q, k, v):
    """Float64 attention, (batch, seqlen, heads, headdim), one head at a time (bounded memory)."""
    out = torch.empty_like(q)
    for h in range(q.shape[2]):
        scores = torch.einsum("bqd,bkd->bqk", q[:, :, h], k[:, :, h]) / q.shape[-1] ** 0.5
        out[:, :, h] = torch.softmax(scores, dim=-1) @ v[:, :, h]
    return out


def per_tensor(x):
    """(a): x8 and (batch, heads) descales all equal to the tensor's amax / 448."""
    descale = (x.float().abs().max() / 448).expand(x.shape[0], x.shape[2]).contiguous()
    return (x.float() / descale[:, None, :, None]).to(torch.float8_e4m3fn), descale


def dequantized(x8, descale):
    """x8 times its descales (per head, or per 128-row block of each head), float64, on x8's
    device: reference.dequantize_fp8 on torch tensors."""
    codes = x8.cpu().view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn)
    return torch.from_numpy(reference.dequantize_fp8(codes, descale.cpu().numpy())).to(x8.device)


def study(headdim: int, seqlen: int, device: str, seed: int = 0, parts: bool = False) -> dict[str, float]:
    rng = np.random.default_rng([seed, headdim, seqlen])
    exact = [torch.tensor(inputs(rng, (BATCH, seqlen, HEADS, headdim)), device=device) for _ in range(3)]
    want = exact_attention(*exact)
    q, k, v = (x.to(torch.bfloat16) for x in exact)

    def rmse(out):
        return float(torch.sqrt(torch.mean((out.double() - want) ** 2)))

    quantized = {
        "(a) per tensor": [per_tensor(x) for x in (q, k, v)],
        "(b) per 128 rows": [cuflash.quantize_fp8(x, block=128) for x in (q, k, v)],
        "(c) per 128 rows + Hadamard": [cuflash.quantize_fp8(q, block=128, hadamard=True, seed=seed),
                                        cuflash.quantize_fp8(k, block=128, hadamard=True, seed=seed),
                                        cuflash.quantize_fp8(v, block=128)],
    }
    errors = {"bf16": rmse(cuflash.attention(q, k, v))}
    for name, ((q8, qd), (k8, kd), (v8, vd)) in quantized.items():
        errors[name] = rmse(cuflash.attention_fp8(q8, k8, v8, qd, kd, vd, out_dtype="bfloat16"))
    if device == "cuda":  # (the reference computes P exactly, fast_exp or not)
        (q8, qd), (k8, kd), (v8, vd) = quantized["(c) per 128 rows + Hadamard"]
        errors["(c) fast_exp"] = rmse(cuflash.attention_fp8(q8, k8, v8, qd, kd, vd, out_dtype="bfloat16", fast_exp=True))
    if parts:  # (c)'s q and k are in the transform's basis, where their scores are q k^T's
        for label, name in (("(a)", "(a) per tensor"), ("(c)", "(c) per 128 rows + Hadamard")):
            (q8, qd), (k8, kd), _ = quantized[name]
            errors[f"{label} q, k only"] = rmse(exact_attention(dequantized(q8, qd), dequantized(k8, kd), v.double()))
        v8, vd = quantized["(c) per 128 rows + Hadamard"][2]
        errors["v only"] = rmse(exact_attention(q.double(), k.double(), dequantized(v8, vd)))
    return errors


def table(rows: list[tuple[int, int, dict[str, float]]], where: str) -> str:
    names = list(rows[0][2])
    lines = [f"RMSE against float64 attention ({where}; batch {BATCH}, {HEADS} heads, inputs N(0, 1) with "
             f"{OUTLIERS:.1%} of entries x 10, bf16 in and out)", "",
             "| head dim | seqlen | " + " | ".join(names) + " | (a) / (c) |",
             "|---" * (len(names) + 3) + "|"]
    for headdim, seqlen, errors in rows:
        ratio = errors["(a) per tensor"] / errors["(c) per 128 rows + Hadamard"]
        lines.append(f"| {headdim} | {seqlen} | " + " | ".join(f"{errors[n]:.2e}" for n in names) + f" | {ratio:.2f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--headdims", default="64,128,256")
    parser.add_argument("--seqlens", default="1024,4096")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=("cuda", "cpu"))
    parser.add_argument("--out", help="also write the table to this markdown file")
    parser.add_argument("--parts", action="store_true", help="also the errors of rounding q and k only, or v only")
    args = parser.parse_args(argv)
    rows = [(h, s, study(h, s, args.device, parts=args.parts)) for h in map(int, args.headdims.split(","))
            for s in map(int, args.seqlens.split(","))]
    where = (f"{torch.cuda.get_device_name()}, cuflash's kernels" if args.device == "cuda"
             else "CPU, the reference backend's FP8 simulation (P exact)")
    text = table(rows, where)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
