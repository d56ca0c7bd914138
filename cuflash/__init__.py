"""cuflash: FlashAttention kernels for NVIDIA GPUs, compiled at run time with NVRTC and callable
on CuPy arrays, PyTorch tensors and JAX arrays (NumPy and other CPU arrays run the NumPy reference).

Importing cuflash touches no GPU and imports no framework.
"""
from .api import (attention, attention_backward, attention_fp8, attention_varlen, attention_varlen_backward,
                  quantize_fp8)

__version__ = "0.1.0"
__all__ = ["attention", "attention_varlen", "attention_backward", "attention_varlen_backward", "attention_fp8",
           "quantize_fp8"]
