"""Problem -> backend. CPU arrays run the NumPy reference; GPU arrays run the kernel family that
serves the Problem's op on this GPU. JAX arrays go through `cuflash.jax`, which calls back into
`execute` from inside XLA's program (jax.experimental.buffer_callback), on XLA's stream."""
from __future__ import annotations

import logging
from typing import Any

from . import arrays, kernels, reference
from .problem import Problem

# Why a family declined a call (and which one ran) goes to DEBUG: the fallback from fwd_sm90 to
# fwd_sm80 is silent otherwise. Logged once per remembered plan, not per call.
log = logging.getLogger("cuflash")

# The NumPy reference computes in float64 and takes these input dtypes (FP8 attention: e4m3 only).
REFERENCE_DTYPES = frozenset({"float16", "bfloat16", "float32", "float64"})
FP8_DTYPES = frozenset({"float8_e4m3fn"})


def supported_dtypes(op: str, device: arrays.Device) -> frozenset:
    """Input dtypes `op` accepts on `device`; empty when no GPU kernel serves `op` yet (then `run`
    says so)."""
    if not device.is_cuda:
        return FP8_DTYPES if op == "attention_fp8_forward" else REFERENCE_DTYPES
    return frozenset().union(*(f.dtypes for f in kernels.families_for(op)))


def unavailable(op: str, device: arrays.Device, backend: str | None = None) -> str | None:
    """Why no kernel family can run `op` on this GPU at all (its compute capability), or None: for
    checks before work whose result only such a kernel could take (attention(..., fp8=True))."""
    from . import jit

    cc = jit.device_compute_capability(device.index)
    families = kernels.families_for(op, backend)
    if any(f.runs_on(cc) for f in families):
        return None
    why = "; ".join(f"{f.name} needs {f.requirement}" for f in families) or "no GPU kernel family implements it"
    return f"compute capability {cc[0]}.{cc[1]}: {why}"


def run(problem: Problem, inputs: dict[str, Any], outputs: dict[str, tuple]) -> tuple:
    """Allocate the outputs (name -> (shape, dtype)), and the kernels' workspace on a GPU, in the
    caller's framework; run; return the outputs."""
    if problem.framework == "jax":  # the device is XLA's choice, known only inside the callback
        from . import jax as cuflash_jax

        return cuflash_jax.call(problem, inputs, {**outputs, **kernels.workspace(problem)})[:len(outputs)]
    buffers = {**outputs, **(kernels.workspace(problem) if problem.device.is_cuda else {})}
    allocated = {name: arrays.empty(problem.framework, problem.device, shape, dtype)
                 for name, (shape, dtype) in buffers.items()}
    stream = arrays.current_stream(problem.framework, problem.device) if problem.device.is_cuda else None
    execute(problem, inputs, allocated, stream)
    return tuple(allocated[name] for name in outputs)


def execute(problem: Problem, inputs: dict[str, Any], outputs: dict[str, Any], stream: int | None) -> None:
    """Fill `outputs` in place: host arrays on the reference, device arrays with a kernel launched
    on `stream` (a CUDA stream handle). On a GPU `outputs` also holds the workspace
    (kernels.workspace)."""
    if not problem.device.is_cuda:
        _run_reference(problem, {n: arrays.host_view(x) for n, x in inputs.items()},
                       {n: arrays.host_view(x) for n, x in outputs.items()})
        return
    import cupy

    from . import jit

    device_inputs = {n: arrays.device_array(x) for n, x in inputs.items()}
    device_outputs = {n: arrays.device_array(x) for n, x in outputs.items()}
    family, variant = plan(problem, device_inputs)
    with cupy.cuda.Device(problem.device.index):
        function = jit.get_function(variant, problem.device.index)
        family.launch(variant, function, problem, device_inputs, device_outputs,
                      arrays.cupy_stream(stream, problem.device.index))


_plans: dict[tuple, tuple] = {}
_MAX_PLANS = 4096


def plan(problem: Problem, device_inputs: dict[str, arrays.DeviceArray]):
    """The (family, variant) that runs `problem` on its GPU; NotImplementedError saying why not.

    Remembered per (problem, each input's address mod 16 and strides): families choose from the
    problem and the inputs' alignment and strides only, and choosing again on every call costs
    more than a launch."""
    key = (problem, tuple((a.ptr % 16, a.strides) for a in device_inputs.values()))
    chosen = _plans.get(key)
    if chosen is None:
        chosen = _choose(problem, device_inputs)
        if len(_plans) >= _MAX_PLANS:
            _plans.clear()
        _plans[key] = chosen
    return chosen


def _choose(problem: Problem, device_inputs: dict[str, arrays.DeviceArray]):
    from . import jit

    cc = jit.device_compute_capability(problem.device.index)
    reasons = []
    for family in kernels.families_for(problem.op, problem.backend):
        if not family.runs_on(cc):
            reasons.append(f"{family.name} needs {family.requirement}")
            continue
        if problem.dtype not in family.dtypes:
            reasons.append(f"{family.name} takes {sorted(family.dtypes)}")
            continue
        try:
            variant = family.select(problem, device_inputs)
        except ValueError as e:
            reasons.append(str(e))
            continue
        if reasons:
            log.debug("%s runs %s on %s; declined: %s", family.name, problem.op, problem.device, "; ".join(reasons))
        return family, variant
    why = "; ".join(reasons) if reasons else "no GPU kernel family implements this operation yet"
    if problem.backend:
        why = f"backend={problem.backend!r}: {why}"
    raise NotImplementedError(f"cuflash cannot run {problem.op} on GPU {problem.device} "
                              f"(compute capability {cc[0]}.{cc[1]}, dtype {problem.dtype}, "
                              f"headdim {problem.headdim}): {why}")


def _run_reference(problem: Problem, ins: dict, outs: dict) -> None:
    """The NumPy reference (float64) for every op; results are cast into the outputs' dtypes."""
    f = problem.features
    op = problem.op
    if op == "attention_forward":
        outs["out"][...], outs["lse"][...] = reference.forward(ins["q"], ins["k"], ins["v"], **f)
    elif op == "attention_varlen_forward":
        outs["out"][...], outs["lse"][...] = reference.varlen_forward(
            ins["q"], ins["k"], ins["v"], ins["cu_seqlens_q"], ins["cu_seqlens_k"], **f)
    elif op == "attention_backward":
        outs["dq"][...], outs["dk"][...], outs["dv"][...] = reference.backward(
            ins["dout"], ins["q"], ins["k"], ins["v"], ins["out"], ins["lse"], **f)
    elif op == "attention_varlen_backward":
        outs["dq"][...], outs["dk"][...], outs["dv"][...] = reference.varlen_backward(
            ins["dout"], ins["q"], ins["k"], ins["v"], ins["out"], ins["lse"],
            ins["cu_seqlens_q"], ins["cu_seqlens_k"], **f)
    elif op == "backward_preprocess":
        outs["delta"][...] = reference.backward_preprocess(ins["dout"], ins["out"])
    elif op == "attention_fp8_forward":
        outs["out"][...], outs["lse"][...] = reference.attention_fp8(
            ins["q"], ins["k"], ins["v"], ins["q_descale"], ins["k_descale"], ins["v_descale"],
            causal=f["causal"], window=f["window"], softmax_scale=f["softmax_scale"])
    elif op == "quantize_fp8":
        outs["x8"][...], outs["descale"][...] = reference.quantize_fp8(ins["x"], problem.fp8_block,
                                                                     problem.hadamard_seed)
    else:
        raise AssertionError(op)
