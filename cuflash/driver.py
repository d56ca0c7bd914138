"""The CUDA driver API (libcuda) through ctypes, for what CuPy does not expose: tensor maps
(tma.py) and launches with a programmatic dependency on the kernel before them in the stream."""
from __future__ import annotations

import ctypes
from functools import lru_cache


@lru_cache(maxsize=None)
def libcuda() -> ctypes.CDLL:
    try:
        return ctypes.CDLL("libcuda.so.1")
    except OSError as e:  # no driver: no kernel is selected without a GPU, so this is a bug
        raise RuntimeError(f"cuflash needs the CUDA driver (libcuda.so.1) on a GPU: {e}") from e


# CUlaunchAttributeID: the kernel may start once every CTA of the kernel before it in the stream has
# run griddepcontrol.launch_dependents (or exited); its griddepcontrol.wait then waits for that
# kernel to complete and for its memory operations to be visible (CUDA driver API, cuLaunchKernelEx;
# PTX ISA, griddepcontrol).
LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION = 6


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: the id padded to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("id_pad", ctypes.c_int), ("value", ctypes.c_int),
                ("value_rest", ctypes.c_char * 60)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("shared_mem_bytes", ctypes.c_uint),
                ("stream", ctypes.c_void_p), ("attrs", ctypes.POINTER(_LaunchAttribute)),
                ("num_attrs", ctypes.c_uint)]


assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
assert ctypes.sizeof(_LaunchConfig) == 56 and _LaunchConfig.stream.offset == 32


@lru_cache(maxsize=None)
def _launch_kernel_ex():
    fn = libcuda().cuLaunchKernelEx
    fn.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


class DependentLaunch:
    """Launches of `function` (a CuPy RawKernel, loaded; its one argument a parameter struct passed
    by value) with `grid`, `block` and `shared_mem` bytes of dynamic shared memory, each as a
    programmatic dependent of the kernel before it in the stream: it may start before that kernel
    ends, and must run griddepcontrol.wait before it reads anything that kernel writes. Everything
    before that kernel has completed when it starts. In a CUDA graph being captured the dependency
    becomes a programmatic edge. The ctypes objects a launch does not change are made once here:
    per call they cost more than the launch itself."""

    def __init__(self, function, grid: tuple[int, ...], block: tuple[int, ...], shared_mem: int):
        self._function = function.kernel.ptr
        self._grid = (ctypes.c_uint * 3)(*grid, *(1,) * (3 - len(grid)))
        self._block = (ctypes.c_uint * 3)(*block, *(1,) * (3 - len(block)))
        self._shared_mem = shared_mem
        self._attribute = _LaunchAttribute(id=LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION, value=1)
        self._description = f"grid {grid}, block {block}, {shared_mem} bytes of shared memory"

    def __call__(self, params: bytearray, stream) -> None:
        """Launch on `stream` (a CuPy stream) with the parameter struct `params` (copied at the call)."""
        config = _LaunchConfig(self._grid, self._block, self._shared_mem, stream.ptr, ctypes.pointer(self._attribute),
                               1)
        pointers = (ctypes.c_void_p * 1)(ctypes.addressof((ctypes.c_char * len(params)).from_buffer(params)))
        status = _launch_kernel_ex()(ctypes.byref(config), self._function, pointers, None)
        if status != 0:
            raise RuntimeError(f"cuLaunchKernelEx failed with CUresult {status} ({self._description})")
