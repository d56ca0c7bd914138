"""CUDA tensor maps (TMA descriptors), encoded on the host by the driver's cuTensorMapEncodeTiled
through ctypes on libcuda (driver.py), for the sm_90a kernels. Facts: shared/notes/hopper.md section 5."""
from __future__ import annotations

import ctypes
import threading
from functools import lru_cache

import numpy as np

from . import driver

# CUtensorMapDataType
DATA_TYPES = {"float16": 6, "bfloat16": 9, "float8_e4m3fn": 0, "float32": 7}  # e4m3 as UINT8: TMA only moves bytes
SWIZZLE_NONE, SWIZZLE_128B = 0, 3
L2_PROMOTION_256B = 3
MAP_BYTES = 128
MAX_STRIDE_BYTES = 1 << 40  # globalStrides[i] < 2^40
STRIDE_ALIGN_BYTES = 16


def strides_encodable(strides_bytes) -> bool:
    """TMA takes positive strides (bytes) that are multiples of 16 and below 2^40."""
    return all(0 < s < MAX_STRIDE_BYTES and s % STRIDE_ALIGN_BYTES == 0 for s in strides_bytes)


@lru_cache(maxsize=None)
def _encode_tiled():
    fn = driver.libcuda().cuTensorMapEncodeTiled
    fn.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint64),
                   ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


# The driver writes the map into 64-byte-aligned memory: one scratch buffer, aligned by offset.
_scratch = np.zeros(MAP_BYTES + 64, np.uint8)
_scratch_offset = -_scratch.ctypes.data % 64
_scratch_lock = threading.Lock()


@lru_cache(maxsize=1024)
def encode_tiled(dtype: str, ptr: int, dims: tuple[int, ...], strides_bytes: tuple[int, ...],
                 box: tuple[int, ...], swizzle: int = SWIZZLE_128B) -> bytes:
    """A tiled tensor map over `dims` (innermost first, elements) with strides (bytes, one per outer
    dim) and box `box`, 128-byte swizzled (or SWIZZLE_NONE); out-of-bounds elements load as zeros.

    Cached on every input: a map holds nothing but these, so the same address and layout (CuPy's
    pool hands addresses out again) reuse the same 128 bytes."""
    rank = len(dims)
    assert len(strides_bytes) == rank - 1 and len(box) == rank
    u64, u32 = ctypes.c_uint64, ctypes.c_uint32
    fn = _encode_tiled()
    with _scratch_lock:
        status = fn(_scratch.ctypes.data + _scratch_offset, DATA_TYPES[dtype], rank, ptr, (u64 * rank)(*dims),
                    (u64 * (rank - 1))(*strides_bytes), (u32 * rank)(*box), (u32 * rank)(*([1] * rank)), 0,
                    swizzle, L2_PROMOTION_256B, 0)
        encoded = _scratch[_scratch_offset:_scratch_offset + MAP_BYTES].tobytes()
    if status != 0:
        raise RuntimeError(f"cuTensorMapEncodeTiled failed with CUresult {status} for dims {dims}, strides "
                           f"{strides_bytes} bytes, box {box} at address {ptr:#x}")
    return encoded
