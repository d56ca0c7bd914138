"""The registry of kernel families.

A family is one `__global__` template in `cuda_src/` plus the Python that knows it: its variant
record (every compile-time choice, validated, yielding its URI and C++ name expression), the
variants it offers, the archs it runs on, which Problems it accepts and how it launches.
Adding a family is one module here and one line in `FAMILIES`; tests, `python -m cuflash kernels`
and `build` enumerate this registry, so a new variant is covered the day it is added.
"""
from __future__ import annotations

import dataclasses
import struct
from dataclasses import dataclass
from typing import Any, Callable, ClassVar

import numpy as np

from .forward import query_heads_as_rows

# C++ spelling of each element type, as cuda_src/common/types.cuh defines it.
CXX_TYPES = {"float16": "cuflash::half_t", "bfloat16": "cuflash::bfloat16_t"}
SHORT_DTYPE = {"float16": "fp16", "bfloat16": "bf16", "float8_e4m3fn": "e4m3"}


@dataclass(frozen=True)
class Variant:
    """One instantiation of a family's kernel template. Subclasses add their fields (in template
    argument order where they are template arguments) and implement `template_args` and `check`."""

    family: ClassVar[str]
    source: ClassVar[str]  # file in cuda_src/
    template: ClassVar[str]  # qualified C++ name of the __global__ template

    def __post_init__(self):
        self.check()

    def check(self) -> None:
        """Raise ValueError for an illegal combination (the kernel static_asserts the same)."""

    def template_args(self) -> tuple[str, ...]:
        raise NotImplementedError

    @property
    def dynamic_shared_bytes(self) -> int:
        """Dynamic shared memory the launch asks for (jit.get_function raises the function's limit to it)."""
        return 0

    @property
    def name_expression(self) -> str:
        return f"{self.template}<{', '.join(self.template_args())}>"

    @property
    def uri(self) -> str:
        """A readable, unique name: family and every field, e.g. bwd_preprocess/dtype=bf16/headdim=128/..."""
        parts = [self.family]
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            parts.append(f"{f.name}={SHORT_DTYPE.get(value, value)}")
        return "/".join(parts)


class ParamStruct:
    """A kernel's by-value parameter struct: `dtype` reproduces the C++ struct field for field. A
    prepared launch (Family.prepare) fills what does not depend on the arrays' addresses once
    (`template`) and per call writes the addresses into a copy of those bytes (`write`); the kernel
    gets the bytes as one argument (`argument`: CuPy would inspect a structured dtype field by
    field on every launch)."""

    _PACKING = {("u", 8): "Q", ("i", 8): "q", ("u", 4): "I", ("i", 4): "i", ("f", 4): "f"}

    def __init__(self, dtype: np.dtype):
        self.dtype = dtype
        self._void = np.dtype((np.void, dtype.itemsize))
        self._fields = {}
        for name, (field, offset, *_) in dtype.fields.items():
            if field.base.kind == "V":  # opaque bytes (a tensor map): written as they are
                self._fields[name] = (offset, field.itemsize)
            else:
                count = field.shape[0] if field.shape else 1
                self._fields[name] = (offset, struct.Struct(
                    "<" + self._PACKING[field.base.kind, field.base.itemsize] * count))

    def template(self, **fields) -> bytes:
        """The struct's bytes with `fields` set and every other field zero."""
        params = np.zeros((), self.dtype)
        for name, value in fields.items():
            params[name] = value
        return params.tobytes()

    def write(self, params: bytearray, name: str, *values) -> None:
        """Field `name` of `params` (a copy of a template) set to `values` (its elements, or one
        bytes object for an opaque field)."""
        offset, packing = self._fields[name]
        if isinstance(packing, int):
            (data,) = values
            assert len(data) == packing, (name, len(data))
            params[offset:offset + packing] = data
        else:
            packing.pack_into(params, offset, *values)

    def write_addresses(self, params: bytearray, arrays: dict, names) -> None:
        """Each of `names` set to the address of arrays[name] (a DeviceArray)."""
        for name in names:
            self.write(params, name, arrays[name].ptr)

    def argument(self, params: bytearray) -> np.ndarray:
        """`params` as the kernel argument CuPy passes by value."""
        return np.frombuffer(params, self._void)


def launch_nothing(inputs, outputs, stream) -> None:
    """The prepared launch (Family.prepare) of an empty problem: no block to run, nothing to write."""


ROW_ALIGN_BYTES = 16  # one cp.async chunk or vector load


def rows_aligned(array, itemsize: int) -> bool:
    """Every row of `array` (a DeviceArray; all dimensions but the last) starts on a 16-byte
    boundary: what 16-byte vector loads and cp.async need."""
    return array.ptr % ROW_ALIGN_BYTES == 0 and all((s * itemsize) % ROW_ALIGN_BYTES == 0 for s in array.strides[:-1])


def require_rows_aligned(family: str, inputs, names, itemsize: int) -> None:
    """ValueError naming the first of `names` whose rows are not 16-byte aligned (rows_aligned)."""
    for name in names:
        array = inputs[name]
        if not rows_aligned(array, itemsize):
            raise ValueError(f"{family} loads 16-byte chunks: {name} must start on a 16-byte boundary and have "
                             f"strides that are multiples of {ROW_ALIGN_BYTES // itemsize} elements (got strides "
                             f"{array.strides}); pass a contiguous copy")


def compiled_headdim(headdim: int, compiled: tuple[int, ...]) -> int:
    """The smallest of a family's compiled head dims (ascending) that holds `headdim`: a call's head
    dim runs on it, its extra columns zero-filled on load and never stored."""
    return next(h for h in compiled if h >= headdim)


def cxx_bool(flag: bool) -> str:
    """A template argument's spelling of a bool."""
    return "true" if flag else "false"


def fast_divisor(d: int) -> tuple[int, int]:
    """(mul, shift) for the kernels' fast_div (cuda_src/common/types.cuh): n // d for 0 <= n < 2**31
    as umulhi(n, mul) >> shift, mul = ceil(2**p / d), p = 31 + ceil(log2(d)); (0, 0) for d = 1."""
    if not 1 <= d < 2**31:
        raise ValueError(f"fast_divisor: {d} is not a divisor in [1, 2**31)")
    if d == 1:
        return 0, 0
    p = 31 + (d - 1).bit_length()
    return -(-(1 << p) // d), p - 32


MAX_GRID_YZ = 65535  # CUDA's limit on gridDim.y and gridDim.z


def check_grid_yz(family: str, nheads: int, batch: int, hint: str = "") -> None:
    """Families that launch one block row per (head, batch) on grid y and z (hint: the way out, if any)."""
    if nheads > MAX_GRID_YZ or batch > MAX_GRID_YZ:
        raise ValueError(f"{family} launches one block row per (head, batch): nheads {nheads} and batch {batch} "
                         f"must each be at most {MAX_GRID_YZ}{hint}")


@dataclass(frozen=True)
class Family:
    name: str
    backend: str  # what `backend=` names to force this family, e.g. "sm80"
    ops: tuple[str, ...]  # the Problem.ops it serves
    description: str
    min_compute_capability: tuple[int, int]
    # (compute capability) -> the variants this family would use on that arch; `build` and the
    # offline report compile exactly these
    variants_for: Callable[[tuple[int, int]], tuple]
    # (problem, device inputs) -> variant; ValueError if it can't serve it. It may look at the inputs'
    # alignment and strides but not at their contents: dispatch remembers the choice on that basis.
    select: Callable[[Any, Any], Variant]
    # (variant, function, problem, inputs, outputs) -> launch(inputs, outputs, stream): the launch
    # with what does not depend on the arrays' addresses worked out once, for arrays laid out as
    # these (shapes, strides, addresses mod 16; their addresses are not used). dispatch remembers it
    # per layout, so a repeated call only writes addresses and launches (ParamStruct).
    prepare: Callable[..., Callable[..., None]]
    dtypes: frozenset = frozenset(CXX_TYPES)
    # Arch-specific code (sm_90a) runs on one compute capability only.
    max_compute_capability: tuple[int, int] | None = None
    # (problem) -> {name: (shape, dtype)}: scratch buffers the launcher needs beside the outputs,
    # allocated like them by the caller's framework (so CUDA graphs capture them, JAX's XLA owns
    # them); contents undefined on entry. From the problem alone: JAX declares them at trace time.
    workspace: Callable[[Any], dict] | None = None
    # The largest head dim `select` accepts, and whether it serves deterministic=True (backward; its
    # `select` refuses the rest, and dispatch moves on): what `python -m cuflash`'s check draws for
    # this family stays within them.
    max_headdim: int = 256
    deterministic: bool = True

    def runs_on(self, compute_capability: tuple[int, int]) -> bool:
        cc = tuple(compute_capability)
        return cc >= self.min_compute_capability and (self.max_compute_capability is None
                                                      or cc <= self.max_compute_capability)

    @property
    def requirement(self) -> str:
        """The compute capabilities it runs on, in words."""
        low = "{}.{}".format(*self.min_compute_capability)
        if self.max_compute_capability is None:
            return f"compute capability >= {low}"
        high = "{}.{}".format(*self.max_compute_capability)
        return f"compute capability {low}" if high == low else f"compute capability {low} to {high}"


def _families() -> tuple[Family, ...]:
    from . import (bwd_preprocess, bwd_sm80, bwd_sm90, check_cu_seqlens, fwd_sm80, fwd_sm90, quantize_fp8,
                   quantized_sm90)

    # In order of preference: dispatch takes the first family that runs on the GPU and accepts the problem.
    # (check_cu_seqlens serves no op: dispatch runs it ahead of every varlen kernel.)
    return (fwd_sm90.FAMILY, fwd_sm80.FAMILY, fwd_sm90.FP8_FAMILY, quantized_sm90.FAMILY, bwd_sm90.FAMILY,
            bwd_sm80.FAMILY, bwd_preprocess.FAMILY, quantize_fp8.FAMILY, check_cu_seqlens.FAMILY)


FAMILIES: dict[str, Family] = {f.name: f for f in _families()}


def families_for(op: str, backend: str | None = None) -> list[Family]:
    """The families serving `op`, in order of preference; only those of `backend` when given."""
    return [f for f in FAMILIES.values() if op in f.ops and backend in (None, f.backend)]


def workspace(problem) -> dict[str, tuple[tuple[int, ...], str]]:
    """The scratch buffers any family that may serve `problem` needs (Family.workspace), of the
    problem its kernels run (a decode step with GQA: kernels.forward.query_heads_as_rows); none for
    a problem on the CPU, which the reference serves (JAX would otherwise allocate them there)."""
    if not problem.device.is_cuda:
        return {}
    problem = query_heads_as_rows(problem) or problem  # as dispatch's launcher plans it
    buffers: dict[str, tuple] = {}
    for family in families_for(problem.op, problem.backend):
        for name, spec in (family.workspace(problem) if family.workspace else {}).items():
            assert buffers.setdefault(name, spec) == spec, f"families disagree on workspace {name}"
    return buffers


def backends_for(op: str) -> list[str]:
    """The names `backend=` accepts for `op`."""
    return sorted({f.backend for f in families_for(op)})


def variants_for(compute_capability: tuple[int, int], family_names=None) -> list[Variant]:
    """Every variant the registered families would use on a GPU of this compute capability."""
    return [v for f in FAMILIES.values() if (not family_names or f.name in family_names) and f.runs_on(compute_capability)
            for v in f.variants_for(compute_capability)]
