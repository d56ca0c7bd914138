"""JAX arrays: every cuflash call on JAX arrays, eager or under `jax.jit`, runs inside XLA's
program through `jax.experimental.buffer_callback`. XLA allocates the outputs; the callback gets
the input and output buffers (NumPy-viewable on CPU, CUDA-array-interface on GPU) and XLA's
stream, and hands them to `dispatch.execute` — the same path CuPy and torch arrays take. So work
is ordered after its producers on XLA's own stream, with no copy and no host synchronisation.

(The differentiable `cuflash.jax.attention` with `jax.custom_vjp` builds on this.)
"""
from __future__ import annotations

import dataclasses
from functools import lru_cache

import jax
import numpy as np

from . import dispatch
from .arrays import Device
from .problem import Problem


def _jax_dtype(name: str):
    if name == "bfloat16":
        import ml_dtypes

        return ml_dtypes.bfloat16
    return np.dtype(name)


def _buffer_device(buffer) -> Device:
    """Where a callback buffer lives: XLA chose it at compile time, which a tracer did not know."""
    try:
        ptr = buffer.__cuda_array_interface__["data"][0]
    except jax.errors.JaxRuntimeError:  # a host buffer: "only supported on CUDA and ROCm"
        return Device("cpu")
    import cupy

    return Device("cuda", int(cupy.cuda.runtime.pointerGetAttributes(ptr).device))


@lru_cache(maxsize=256)
def _callable(problem: Problem, input_names: tuple[str, ...], outputs: tuple[tuple[str, tuple, str], ...]):
    """One buffer_callback per distinct call signature, so eager calls reuse XLA's compilation."""
    from jax.experimental.buffer_callback import buffer_callback

    output_names = tuple(name for name, _, _ in outputs)
    result_types = tuple(jax.ShapeDtypeStruct(shape, _jax_dtype(dtype)) for _, shape, dtype in outputs)

    def callback(ctx, outs, *ins):
        p = dataclasses.replace(problem, device=_buffer_device(outs[0]))
        dispatch.execute(p, dict(zip(input_names, ins)), dict(zip(output_names, outs)),
                         int(ctx.stream) if p.device.is_cuda else None)

    return buffer_callback(callback, result_types)


def call(problem: Problem, inputs: dict, outputs: dict[str, tuple]) -> tuple:
    """Run `problem` on JAX arrays or tracers; returns JAX arrays, in the order of `outputs`."""
    spec = tuple((name, tuple(shape), dtype) for name, (shape, dtype) in outputs.items())
    return tuple(_callable(problem, tuple(inputs), spec)(*inputs.values()))
