"""Problem -> backend. CPU arrays run the NumPy reference; GPU arrays run the kernel family that
serves the Problem's op on this GPU. JAX arrays go through `cuflash.jax`, which calls back into
`execute` from inside XLA's program (jax.experimental.buffer_callback), on XLA's stream."""
from __future__ import annotations

import logging
from typing import Any

from . import arrays, kernels, reference
from .kernels import check_cu_seqlens
from .kernels.forward import heads_as_rows, query_heads_as_rows
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


def run(problem: Problem, inputs: dict[str, Any], outputs: dict[str, tuple]) -> tuple:
    """Allocate the outputs (name -> (shape, dtype)), and the kernels' workspace on a GPU, in the
    caller's framework; run; return the outputs."""
    if problem.framework == "jax":  # the device is XLA's choice, known only inside the callback
        from . import jax as cuflash_jax

        return cuflash_jax.call(problem, inputs, {**outputs, **kernels.workspace(problem)})[:len(outputs)]
    if problem.device.is_cuda:
        return _prepared_run(problem, inputs, outputs)(inputs)
    allocated = {name: arrays.empty(problem.framework, problem.device, shape, dtype)
                 for name, (shape, dtype) in outputs.items()}
    execute(problem, inputs, allocated, None)
    return tuple(allocated[name] for name in outputs)


# ----------------------------------------------------------------------------- repeated calls
#
# A training step or a decode loop calls with arrays of the same layouts again and again, and the
# argument checks, the choice of kernel and the launch's parameters cost several times what torch
# takes for a whole call (benchmarks/NOTES-sm90.md, "Host time"). So the public functions hand
# `run_checked` a call signature: the signatures of their GPU arrays (arrays.signature: everything
# the checks and the families' `select` look at) and their other arguments with their types. The
# first call with a signature runs the checks; a later one runs what they concluded: the outputs to
# allocate and a prepared launch (Family.prepare), with only the arrays' addresses new.

_calls: dict[tuple, Any] = {}  # call signature -> what `remembered` made for it


def _types(values: tuple) -> tuple:
    """The type of each value, and of each item of a tuple: causal=1 must not find the entry that
    causal=True made (1 == True, and both hash alike), nor window=(-1.0, -1) the entry of (-1, -1)."""
    return tuple((tuple, *map(type, v)) if type(v) is tuple else type(v) for v in values)


def call_signature(op: str, arrays_: dict[str, Any], scalars: tuple) -> tuple | None:
    """The key under which `run_checked` remembers a call of `op` on the named arrays and the other
    arguments `scalars`: None (not remembered) unless every array has a signature (GPU torch or
    CuPy arrays) and every scalar is hashable (a window given as a list is not)."""
    signatures = tuple(arrays.signature(x) for x in arrays_.values())
    if None in signatures:
        return None
    key = (op, tuple(arrays_), signatures, scalars, _types(scalars))
    try:
        hash(key)
    except TypeError:  # an unhashable argument: the checks will say what is wrong with it, every time
        return None
    return key


def remembered(signature: tuple | None, make):
    """make(), which runs a call's argument checks and returns what they concluded, or, for a call
    signature (call_signature) seen before, what it returned then, without checking again. A
    check that raises leaves nothing behind: the next call checks again."""
    return make() if signature is None else _remember(_calls, signature, make)


def run_checked(signature: tuple | None, inputs: dict[str, Any], check) -> tuple:
    """`run` the Problem and outputs that `check()` returns after every argument check; remembered
    per call signature (`remembered`) as a prepared run (`_prepared_run`)."""
    def prepare():
        problem, outputs = check()
        if problem.device.is_cuda and problem.framework != "jax":  # (every call with a signature)
            return _prepared_run(problem, inputs, outputs)
        return lambda inputs: run(problem, inputs, outputs)

    return remembered(signature, prepare)(inputs)


def _prepared_run(problem: Problem, inputs: dict[str, Any], outputs: dict[str, tuple]):
    """A function of inputs laid out as `inputs` are (shapes, strides, addresses mod 16) that
    allocates the outputs and the workspace, launches `problem`'s kernel on the caller's current
    stream and returns the outputs. It holds no reference to `inputs`."""
    buffers = {**outputs, **kernels.workspace(problem)}
    framework, device, index = problem.framework, problem.device, problem.device.index
    layouts = {name: arrays.DeviceArray(0, shape, arrays.contiguous_strides(shape))  # as arrays.empty makes them
               for name, (shape, _) in buffers.items()}
    launch = launcher(problem, {n: arrays.device_array(x) for n, x in inputs.items()}, layouts)
    names = tuple(outputs)

    def prepared(inputs: dict[str, Any]) -> tuple:
        allocated = {name: arrays.empty(framework, device, shape, dtype) for name, (shape, dtype) in buffers.items()}
        launch({n: arrays.device_array(x) for n, x in inputs.items()},
               {n: arrays.device_array(x) for n, x in allocated.items()},
               arrays.cupy_stream(arrays.current_stream(framework, device), index))
        return tuple(allocated[name] for name in names)

    return prepared


def execute(problem: Problem, inputs: dict[str, Any], outputs: dict[str, Any], stream: int | None) -> None:
    """Fill `outputs` in place: host arrays on the reference, device arrays with a kernel launched
    on `stream` (a CUDA stream handle). On a GPU `outputs` also holds the workspace
    (kernels.workspace)."""
    if not problem.device.is_cuda:
        _run_reference(problem, {n: arrays.host_view(x) for n, x in inputs.items()},
                       {n: arrays.host_view(x) for n, x in outputs.items()})
        return
    device_inputs = {n: arrays.device_array(x) for n, x in inputs.items()}
    device_outputs = {n: arrays.device_array(x) for n, x in outputs.items()}
    launcher(problem, device_inputs, device_outputs)(device_inputs, device_outputs,
                                                     arrays.cupy_stream(stream, problem.device.index))


_plans: dict[tuple, tuple] = {}
_launchers: dict[tuple, Any] = {}
_MAX_ENTRIES = 4096  # per cache


def clear_plans() -> None:
    """Forget every choice of kernel and every prepared launch and call: after changing a family's
    tile table (benchmarks and tests that force table rows)."""
    for cache in (_plans, _launchers, _calls):
        cache.clear()


def _remember(cache: dict, key: tuple, make):
    """cache[key], made by make() if missing; a cache that reaches _MAX_ENTRIES starts over."""
    value = cache.get(key)
    if value is None:
        value = make()
        if len(cache) >= _MAX_ENTRIES:
            cache.clear()
        cache[key] = value
    return value


def _layout_key(device_arrays: dict[str, arrays.DeviceArray]) -> tuple:
    return tuple((a.ptr % 16, a.strides) for a in device_arrays.values())


def plan(problem: Problem, device_inputs: dict[str, arrays.DeviceArray]):
    """The (family, variant) that runs `problem` on its GPU; NotImplementedError saying why not.

    Remembered per (problem, each input's address mod 16 and strides): families choose from the
    problem and the inputs' alignment and strides only, and choosing again on every call costs
    more than a launch."""
    return _remember(_plans, (problem, _layout_key(device_inputs)), lambda: _choose(problem, device_inputs))


def launcher(problem: Problem, device_inputs: dict[str, arrays.DeviceArray],
             device_outputs: dict[str, arrays.DeviceArray]):
    """`plan`'s kernel, loaded (compiled on first use), as a function (inputs, outputs, stream) of
    arrays laid out as these (Family.prepare): remembered per plan and outputs' strides. A decode
    step with GQA runs as its kv heads' query heads in rows (kernels.forward.query_heads_as_rows); a
    varlen call's kernel runs behind check_cu_seqlens (kernels/check_cu_seqlens.py)."""
    def make():
        import cupy

        from . import jit

        as_rows = query_heads_as_rows(problem)
        kernel_problem = as_rows or problem
        if as_rows:  # the kernels read q, out, lse (and q's descales) through views
            group = problem.nheads // problem.nheads_kv
            view = lambda arrays: heads_as_rows(arrays, group)  # noqa: E731
        else:
            view = lambda arrays: arrays  # noqa: E731
        family, variant = plan(kernel_problem, view(device_inputs))
        index = problem.device.index
        launch = family.prepare(variant, jit.get_function(variant, index), kernel_problem, view(device_inputs),
                                view(device_outputs))
        if problem.varlen:  # their cu_seqlens checked on the GPU first, on the same stream
            checker = check_cu_seqlens.VARIANT
            check = check_cu_seqlens.prepare(checker, jit.get_function(checker, index), problem, device_inputs,
                                             device_outputs)
        else:
            check = kernels.launch_nothing

        def on_device(inputs, outputs, stream) -> None:
            with cupy.cuda.Device(index):
                check(inputs, outputs, stream)
                launch(view(inputs), view(outputs), stream)
        return on_device

    key = (problem, _layout_key(device_inputs), tuple(a.strides for a in device_outputs.values()))
    return _remember(_launchers, key, make)


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
    elif op in ("attention_fp8_forward", "attention_quantized_forward"):
        kw = dict(causal=f["causal"], window=f["window"], softmax_scale=f["softmax_scale"])
        if op == "attention_fp8_forward":
            out, lse = reference.attention_fp8(ins["q"], ins["k"], ins["v"], ins["q_descale"], ins["k_descale"],
                                               ins["v_descale"], **kw,
                                               kv_block=problem.fp8_block or reference.FP8_BLOCK)
        else:
            out, lse = reference.attention_quantized(ins["q"], ins["k"], ins["v"], problem.hadamard_seed, **kw)
        outs["out"][...] = out
        if problem.with_lse:
            outs["lse"][...] = lse
    elif op == "quantize_fp8":
        outs["x8"][...], outs["descale"][...] = reference.quantize_fp8(ins["x"], problem.fp8_block,
                                                                     problem.hadamard_seed)
    else:
        raise AssertionError(op)
