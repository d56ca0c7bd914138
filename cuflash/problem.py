"""The validated description of one call: what `api` builds and everything below it consumes."""
from __future__ import annotations

from dataclasses import dataclass

from . import reference
from .arrays import Device

# The operations cuflash runs. Each backend (the NumPy reference, or a kernel family) names the
# ones it implements; `dispatch` routes a Problem by its op.
OPS = (
    "attention_forward",
    "attention_varlen_forward",
    "attention_backward",
    "attention_varlen_backward",
    "backward_preprocess",
    "attention_fp8_forward",
    "attention_quantized_forward",
    "quantize_fp8",
)


@dataclass(frozen=True)
class Problem:
    """Shapes, dtype, device and features of one call, after every argument check.

    For varlen ops `batch` is the number of sequences and `seqlen_q`/`seqlen_k` are the callers'
    max_seqlen_q/max_seqlen_k; `total_q`/`total_k` are the packed lengths (0 for dense ops).
    `window_left`/`window_right` already include `causal` (causal means right = 0); -1 is unbounded.
    `backend` None lets dispatch choose the kernel family.
    """

    op: str
    framework: str
    device: Device
    dtype: str
    batch: int
    seqlen_q: int
    seqlen_k: int
    nheads: int
    nheads_kv: int
    headdim: int
    causal: bool = False
    window_left: int = -1
    window_right: int = -1
    softmax_scale: float = 1.0
    softcap: float = 0.0
    total_q: int = 0
    total_k: int = 0
    backend: str | None = None  # a kernel family's backend name ("sm80", "sm90") the caller forced
    deterministic: bool = False  # backward ops: bit-identical gradients from run to run
    out_dtype: str | None = None  # attention_fp8/quantized_forward: out's dtype (fp8: the inputs are float8_e4m3fn)
    # quantize_fp8: rows per scale (reference.FP8_BLOCK or FP8_WIDE_KEY_BLOCK; None: one scale per head);
    # attention_fp8_forward: reference.FP8_WIDE_KEY_BLOCK where k's or v's descales are per 192 rows
    # (None: per reference.FP8_BLOCK rows, or per head);
    # attention_quantized_forward: q's, reference.FP8_BLOCK (k's and v's: reference.fp8_key_block)
    fp8_block: int | None = None
    hadamard_seed: int | None = None  # quantize_fp8, attention_quantized_forward (q and k): the transform's seed
    with_lse: bool = True  # attention_fp8/quantized_forward: lse is an output (without it, P's row sums may be P's as
    # rounded, and some exponentials a quadratic's: fwd_sm90.fp8_variant)
    q_descale_per_row: bool = False  # attention_fp8_forward with query heads as rows (kernels.forward): q_descale one a row
    # attention_fp8/quantized_forward without the LSE: P's e4m3 codes may come straight from the scores
    # (fwd_sm90.fp8_variant: no exponential, each weight within 8% of exp's where e4m3 rounds to 6%)
    fast_exp: bool = False

    def __post_init__(self):
        assert self.op in OPS, self.op

    @property
    def varlen(self) -> bool:
        return self.op.startswith("attention_varlen")

    @property
    def wide_key_blocks(self) -> bool:
        """attention_fp8_forward: k's and v's descales are per reference.FP8_WIDE_KEY_BLOCK keys, which
        only the FP8 kernel's rows of that key block take (not its split variants, nor query heads
        as rows)."""
        return self.op == "attention_fp8_forward" and self.fp8_block == reference.FP8_WIDE_KEY_BLOCK

    @property
    def features(self) -> dict:
        """The keyword semantics the reference and the kernels share."""
        return dict(
            causal=self.causal,
            window=(self.window_left, self.window_right),
            softmax_scale=self.softmax_scale,
            softcap=self.softcap,
        )
