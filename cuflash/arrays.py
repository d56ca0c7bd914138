"""Framework detection, zero-copy views and streams.

cuflash takes NumPy, CuPy, PyTorch and JAX arrays. Everything framework-specific lives here:
what an array is (`describe`), a zero-copy NumPy view of a host array (`host_view`), a GPU array
as a kernel sees it (`device_array`: address, shape, strides), allocating an output in the
caller's framework (`empty`), and the caller's current stream (`current_stream`).

No framework is imported here at module import: a framework is only looked at when the caller
passes one of its arrays (it is then already in `sys.modules`).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

import numpy as np

FRAMEWORKS = ("numpy", "cupy", "torch", "jax")

# Hints for the fix when the last dimension is not contiguous; shown in the error message.
_CONTIGUOUS_FIX = {
    "numpy": "numpy.ascontiguousarray(x)",
    "cupy": "cupy.ascontiguousarray(x)",
    "torch": "x.contiguous()",
    "jax": "jax arrays are always contiguous",
}


@dataclass(frozen=True)
class Device:
    """Where an array lives: ("cpu", 0) or ("cuda", ordinal). JAX tracers have no concrete
    device at trace time; they are described by `jax.default_device`'s when one is set, else by
    the platform of JAX's default backend (_jax_trace_device)."""

    kind: str
    index: int = 0

    @property
    def is_cuda(self) -> bool:
        return self.kind == "cuda"

    def __str__(self) -> str:
        return "cpu" if self.kind == "cpu" else f"cuda:{self.index}"


@dataclass(frozen=True)
class ArrayInfo:
    """What the argument checks need to know of one array, independent of its framework."""

    name: str
    framework: str
    device: Device
    dtype: str  # canonical name: float16, bfloat16, float32, float64, int32, ...
    shape: tuple[int, ...]
    strides: tuple[int, ...]  # in elements
    traced: bool = False  # a JAX tracer: shapes are known, values are not

    @property
    def contiguous_fix(self) -> str:
        return _CONTIGUOUS_FIX[self.framework]


def _module(name: str):
    return sys.modules.get(name)


_FRAMEWORK_OF_TYPE: dict[type, str | None] = {}


def framework_of(x: Any) -> str | None:
    """The framework an array belongs to, or None for anything that is not a supported array."""
    kind = type(x)
    if kind not in _FRAMEWORK_OF_TYPE:  # isinstance checks once per type: this runs on every call
        _FRAMEWORK_OF_TYPE[kind] = _framework_of_type(x)
    return _FRAMEWORK_OF_TYPE[kind]


def _framework_of_type(x: Any) -> str | None:
    if isinstance(x, np.ndarray):
        return "numpy"
    cupy = _module("cupy")
    if cupy is not None and isinstance(x, cupy.ndarray):
        return "cupy"
    torch = _module("torch")
    if torch is not None and isinstance(x, torch.Tensor):
        return "torch"
    jax = _module("jax")
    if jax is not None and isinstance(x, jax.Array):
        return "jax"
    return None


def _dtype_name(framework: str, dtype: Any) -> str:
    if framework == "torch":
        return str(dtype).removeprefix("torch.")
    return np.dtype(dtype).name


def contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major strides in elements, as every framework's `empty` lays an array out."""
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


def _element_strides(name: str, byte_strides: tuple[int, ...], itemsize: int) -> tuple[int, ...]:
    if any(s % itemsize for s in byte_strides):
        raise ValueError(f"{name} has byte strides {tuple(byte_strides)} that are not multiples of its item size "
                         f"({itemsize}); pass a plain contiguous array (e.g. numpy.ascontiguousarray(x))")
    return tuple(s // itemsize for s in byte_strides)


def describe(name: str, x: Any) -> ArrayInfo:
    """Describe argument `name`; TypeError (naming it) if it is not an array cuflash takes."""
    framework = framework_of(x)
    if framework is None:
        raise TypeError(
            f"{name} must be a NumPy, CuPy, PyTorch or JAX array; got {type(x).__module__}.{type(x).__qualname__}"
        )
    shape = tuple(int(n) for n in x.shape)
    if framework == "numpy":
        if isinstance(x, np.ma.MaskedArray):
            raise TypeError(f"{name} is a masked array; cuflash would ignore its mask. Pass a plain array "
                            "and express masking with causal/window")
        return ArrayInfo(name, framework, Device("cpu"), _dtype_name(framework, x.dtype), shape,
                         _element_strides(name, x.strides, x.dtype.itemsize))
    if framework == "cupy":
        return ArrayInfo(name, framework, Device("cuda", int(x.device.id)), _dtype_name(framework, x.dtype), shape,
                         _element_strides(name, x.strides, x.dtype.itemsize))
    if framework == "torch":
        if x.layout != _module("torch").strided:
            raise TypeError(f"{name} is a torch tensor with layout {x.layout}; cuflash takes dense (strided) "
                            "tensors: convert with x.to_dense()")
        dev = x.device
        if dev.type not in ("cpu", "cuda"):
            raise ValueError(f"{name} is on torch device {dev}; cuflash runs on 'cpu' (reference) or 'cuda'")
        device = Device("cuda", dev.index if dev.index is not None else 0) if dev.type == "cuda" else Device("cpu")
        return ArrayInfo(name, framework, device, _dtype_name(framework, x.dtype), shape, tuple(x.stride()))
    # JAX: arrays are dense and row-major; a tracer has no device, so take the default one.
    jax = _module("jax")
    traced = isinstance(x, jax.core.Tracer)
    if traced:
        device = _jax_trace_device(jax)
    else:
        devices = x.devices()
        if len(devices) != 1:
            raise ValueError(f"{name} is sharded over {len(devices)} devices; pass a single-device array")
        (d,) = devices
        device = Device("cuda", d.id) if d.platform in ("gpu", "cuda") else Device("cpu")
    return ArrayInfo(name, framework, device, _dtype_name(framework, x.dtype), shape,
                     contiguous_strides(shape), traced=traced)


def _jax_trace_device(jax) -> Device:
    """Where JAX will run a traced computation of uncommitted arrays: the device `jax.default_device`
    set (a Device or a platform name), else the default backend's first. (Inputs committed to
    another device move it; the callback then sees where its buffers are: cuflash/jax.py.)"""
    default = jax.config.jax_default_device
    if default is None:
        platform, index = jax.default_backend(), 0
    elif isinstance(default, str):
        platform, index = default, 0
    else:
        platform, index = default.platform, default.id
    return Device("cuda", index) if platform in ("gpu", "cuda") else Device("cpu")


def signature(x: Any) -> tuple | None:
    """What `describe` and the kernel families look at in a GPU array (type, dtype, device, shape,
    strides, address mod 16), as a hashable key, for CuPy arrays and plain torch CUDA tensors; None
    for anything else. Equal signatures mean the same checks pass and the same kernel serves the
    call, which lets `dispatch` skip both on a repeated call. Never raises."""
    kind = type(x)
    torch = _module("torch")
    if torch is not None and kind is torch.Tensor:  # not subclasses (fake tensors have no address)
        if x.layout is not torch.strided or not x.is_cuda:
            return None
        return kind, x.dtype, x.device, x.shape, x.stride(), x.data_ptr() % 16
    cupy = _module("cupy")
    if cupy is not None and kind is cupy.ndarray:
        return kind, x.dtype, x.device.id, x.shape, x.strides, x.data.ptr % 16
    return None


# NumPy knows these through ml_dtypes only (not by name).
_ML_DTYPES = ("bfloat16", "float8_e4m3fn")


def numpy_dtype(name: str) -> np.dtype:
    """The NumPy dtype of a canonical dtype name (bfloat16 and float8_e4m3fn from ml_dtypes)."""
    if name in _ML_DTYPES:
        import ml_dtypes

        return np.dtype(getattr(ml_dtypes, name))
    return np.dtype(name)


def host_view(x: Any) -> np.ndarray:
    """Zero-copy NumPy view of a host array (NumPy, torch CPU tensor, JAX CPU array or JAX CPU
    callback buffer). Writes through the view land in `x`."""
    framework = framework_of(x)
    if framework == "numpy":
        return x
    if framework == "torch":
        torch = _module("torch")
        t = x.detach()
        name = str(t.dtype).removeprefix("torch.")
        if name in _ML_DTYPES:  # NumPy has no such dtype: reinterpret the bits as ml_dtypes' type
            return t.view(torch.uint8 if t.element_size() == 1 else torch.int16).numpy().view(numpy_dtype(name))
        return t.numpy()
    # JAX arrays and jax.experimental.buffer_callback.Buffer objects implement __array__ on CPU.
    return np.asarray(x)


_TORCH_DTYPES = ("float16", "bfloat16", "float32", "float64", "int32", "float8_e4m3fn")


@lru_cache(maxsize=None)
def _torch_dtype_and_device(dtype: str, device: Device) -> tuple:
    # Made once: torch parses a device string on every call, which costs more than the allocation.
    torch = _module("torch")
    assert dtype in _TORCH_DTYPES, dtype
    return getattr(torch, dtype), torch.device(device.kind, device.index) if device.is_cuda else torch.device("cpu")


# CuPy has no e4m3 dtype ("Unsupported dtype float8_e4m3fn", CuPy 14.2): cuflash's own e4m3 buffers
# for CuPy callers (attention(..., fp8=True)'s quantized copies, the V^T workspace) hold the bits in
# arrays of this dtype. They never reach the caller: quantize_fp8 and attention_fp8 refuse CuPy.
CUPY_E4M3_BITS = "uint8"


def empty(framework: str, device: Device, shape: tuple[int, ...], dtype: str) -> Any:
    """Allocate an uninitialised array through the caller's framework's own allocator (CuPy: e4m3 as
    CUPY_E4M3_BITS)."""
    if framework == "numpy":
        return np.empty(shape, numpy_dtype(dtype))
    if framework == "torch":
        torch_dtype, torch_device = _torch_dtype_and_device(dtype, device)
        return _module("torch").empty(shape, dtype=torch_dtype, device=torch_device)
    if framework == "cupy":
        cupy = _module("cupy")
        with cupy.cuda.Device(device.index):
            return cupy.empty(shape, CUPY_E4M3_BITS if dtype == "float8_e4m3fn" else numpy_dtype(dtype))
    raise AssertionError(f"outputs of {framework} arrays are allocated by the framework itself")


class _StreamHandle:
    """A raw CUDA stream handle, spoken in the CUDA stream protocol that CuPy takes."""

    def __init__(self, ptr: int):
        self.ptr = ptr

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.ptr)


@lru_cache(maxsize=64)
def cupy_stream(ptr: int, device_index: int):
    """A CuPy stream object for a raw handle (torch's, XLA's or CuPy's own) on GPU `device_index`,
    for launching on it. Cached per (handle, device): it only wraps the handle, and making one costs
    more than the launch; the device is part of the key because the same handle (0, the legacy
    default stream) names a different stream on each GPU."""
    cupy = _module("cupy")
    with cupy.cuda.Device(device_index):
        return cupy.cuda.Stream.from_external(_StreamHandle(ptr))


def current_stream(framework: str, device: Device) -> int:
    """The handle of the caller's current CUDA stream for `device` (torch's or CuPy's)."""
    if framework == "torch":
        torch = _module("torch")
        # The handle without a torch.cuda.Stream object around it (a few microseconds a call); the
        # function torch's own compiled code calls, with the public spelling where it is missing.
        raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
        return int(raw(device.index)) if raw else int(torch.cuda.current_stream(device.index).cuda_stream)
    if framework == "cupy":
        cupy = _module("cupy")
        with cupy.cuda.Device(device.index):
            return int(cupy.cuda.get_current_stream().ptr)
    raise AssertionError(f"{framework} work gets its stream from its own runtime")


class DeviceArray(NamedTuple):
    """A GPU array as a kernel sees it: address, shape and strides in elements. (A named tuple: made
    for every array of every call, and a frozen dataclass costs several times more to make.)"""

    ptr: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]


def device_array(x: Any) -> DeviceArray:
    """Zero-copy description of a CuPy array, torch CUDA tensor, JAX GPU array or JAX GPU
    callback buffer (the last two through the CUDA array interface)."""
    framework = framework_of(x)
    if framework == "torch":
        return DeviceArray(x.data_ptr(), tuple(x.shape), x.stride())
    if framework == "cupy":
        return DeviceArray(x.data.ptr, x.shape, tuple(s // x.itemsize for s in x.strides))
    cai = x.__cuda_array_interface__
    shape = tuple(int(n) for n in cai["shape"])
    itemsize = int(cai["typestr"][2:]) if cai["typestr"][1] in "fiuV" else 1
    strides = (tuple(int(s) // itemsize for s in cai["strides"]) if cai.get("strides")
               else contiguous_strides(shape))
    return DeviceArray(int(cai["data"][0]), shape, strides)
