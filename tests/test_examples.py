"""The examples run (on the CPU reference here; on the GPU they take the kernels)."""
import math
import runpy
from pathlib import Path

import pytest

from conftest import _cuda_available

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_quickstart_runs_and_frameworks_agree(capsys):
    runpy.run_path(str(EXAMPLES / "quickstart.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "numpy: out (2, 256, 8, 64) float16" in printed
    for line in printed.splitlines():
        if "max |" in line:
            # Same reference, same bits; except jax.jit on a GPU backend, which puts the NumPy inputs on
            # the GPU and runs the kernel: float16, |out| < 8, so one ulp is 2^-8 (measured 9.8e-4, H200).
            bound = 2.0**-8 if line.startswith("jax.jit") and _jax_backend() != "cpu" else 0.0
            assert float(line.rsplit("=", 1)[1]) <= bound, line


def _jax_backend() -> str:
    import jax

    return jax.default_backend()


def _example(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _same_training(cuflash_losses, framework_losses, floor):
    """The two runs see the same weights and batches; their losses may differ only by the attention's
    rounding: equal at the start, within noise along the way, and both reach the task's floor."""
    assert all(math.isfinite(x) for x in cuflash_losses + framework_losses)
    assert abs(cuflash_losses[0] - framework_losses[0]) < 1e-2
    mean_gap = sum(abs(a - b) for a, b in zip(cuflash_losses, framework_losses)) / len(cuflash_losses)
    assert mean_gap < 0.05, mean_gap
    tail = lambda xs: sum(xs[-50:]) / len(xs[-50:])
    assert tail(cuflash_losses) < floor + 0.15 and tail(framework_losses) < floor + 0.15
    assert abs(tail(cuflash_losses) - tail(framework_losses)) < 0.02


def test_torch_training_example_steps_on_cpu():
    """A few steps on the CPU reference (CI): cuflash's loss equals torch's own attention's."""
    pytest.importorskip("torch")
    train_torch = _example("train_torch")
    small = dict(device="cpu", steps=3, seqlen=64, dim=64, layers=1)
    ours, theirs = train_torch.train("cuflash", **small), train_torch.train("torch", **small)
    for a, b in zip(ours, theirs):
        assert math.isfinite(a) and abs(a - b) < 1e-2


def test_jax_training_example_steps_on_cpu():
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "cpu":
        pytest.skip("the GPU run is test_training_examples_match_the_frameworks_attention")
    train_jax = _example("train_jax")
    small = dict(steps=2, seqlen=64, dim=64, layers=1)
    for a, b in zip(train_jax.train("cuflash", **small), train_jax.train("jax", **small)):
        assert math.isfinite(a) and abs(a - b) < 1e-2


@pytest.mark.gpu
def test_training_examples_match_the_frameworks_attention():
    """300 steps of each example on the GPU, cuflash's kernels against the framework's attention."""
    train_torch, train_jax = _example("train_torch"), _example("train_jax")
    floor = train_torch.loss_floor(16, 256, 16)
    torch_runs = [train_torch.train(impl, 300) for impl in ("cuflash", "torch")]
    print("torch example, every 25th step (cuflash, torch):",
          [(round(a, 3), round(b, 3)) for a, b in list(zip(*torch_runs))[::25]])
    _same_training(*torch_runs, floor)
    jax_runs = [train_jax.train(impl, 300) for impl in ("cuflash", "jax")]
    print("jax example, every 25th step (cuflash, jax):",
          [(round(a, 3), round(b, 3)) for a, b in list(zip(*jax_runs))[::25]])
    _same_training(*jax_runs, floor)


# ----------------------------------------------------------------------------- the four short examples
# (quickstart_cupy, torch_module, jax_grad, varlen_packing). Their comparison functions return, per
# array, (max |ours - theirs|, max |theirs|); the bounds below are relative to the second.

FP32_EPS = 2.0**-23
BF16_EPS = 2.0**-7   # spacing of bfloat16 numbers in [1, 2): 8 significant bits
FP16_EPS = 2.0**-10  # float16: 11 significant bits


def _within(result: dict, bound: float):
    """Every (diff, scale) of `result` has diff <= bound * scale; the scales are not degenerate."""
    for name, (diff, scale) in result.items():
        assert scale > 0 and math.isfinite(diff), (name, diff, scale)
        assert diff <= bound * scale, f"{name}: max diff {diff:.3g} > {bound:.3g} * max |reference| {scale:.3g}"


def _run_script(name: str, *args: str):
    import os
    import subprocess
    import sys

    path = [str(EXAMPLES.parent), os.environ.get("PYTHONPATH")]  # cuflash from this checkout
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in path if p))
    return subprocess.run([sys.executable, str(EXAMPLES / f"{name}.py"), *args], capture_output=True, text=True,
                          env=env, timeout=600)


@pytest.mark.skipif(_cuda_available(), reason="checks the behaviour on a machine without a GPU")
def test_quickstart_cupy_without_a_gpu_says_so_in_one_line():
    result = _run_script("quickstart_cupy")
    assert result.returncode == 0 and result.stderr == "", result.stderr
    (line,) = result.stdout.splitlines()
    assert line.startswith("quickstart_cupy needs an NVIDIA GPU: "), line


@pytest.mark.parametrize("window", [(-1, -1), (32, 0)])
def test_torch_module_matches_sdpa_on_cpu(window):
    """CuflashSelfAttention on CPU (cuflash's float64 reference, rounded to float32) against the same
    weights through torch's float32 SDPA: output, input gradient and both weight gradients. Measured
    (seeds 0-3): at most 4.2 float32 eps times the largest entry; bound 16 eps. A wrong mask, head
    mapping or gradient would be off by ~1e-1 relative."""
    pytest.importorskip("torch")
    result = _example("torch_module").compare("cpu", window=window)
    assert set(result) == {"out", "grad_x", "grad_qkv.weight", "grad_out.weight"}
    _within(result, 16 * FP32_EPS)


def test_jax_grad_matches_jax_attention_on_cpu():
    """jit(value_and_grad) through cuflash.jax.attention (the float64 reference, rounded to float32)
    against jax.nn.dot_product_attention in float32, plain and vmapped over a stack of 3. Measured
    (seeds 0-3): at most 9.6 float32 eps times the largest entry (XLA's float32 softmax and its
    autodiff); bound 32 eps."""
    jax = pytest.importorskip("jax")
    if jax.default_backend() != "cpu":
        pytest.skip("the GPU run is test_jax_grad_example_on_gpu")
    result = _example("jax_grad").differences()
    assert set(result) == {"loss", "dq", "dk", "dv", "vmap loss", "vmap dq", "vmap dk", "vmap dv"}
    _within(result, 32 * FP32_EPS)


def test_varlen_packing_on_numpy():
    """Each packed sequence's output and lse equal attention on it alone. Both are the same float64
    reference rounded to float16 (out) and float32 (lse): measured exactly 0. The bounds allow one
    float16 ulp at |out| < 8 (|out| <= max |v|, about 4.5 here) and a float32 rounding of lse; a
    token seen across sequences would change out by ~1e-1."""
    varlen = _example("varlen_packing")
    diff = varlen.max_difference("numpy")
    assert diff["out"] <= 2.0**-8 and diff["lse"] <= 1e-5, diff


def test_varlen_pack_unpack_round_trip():
    import numpy as np

    varlen = _example("varlen_packing")
    seqs = [np.full((n, 2, 8), n, np.float16) for n in (3, 1, 5)]
    packed, cu_seqlens, max_seqlen = varlen.pack(seqs, "numpy")
    assert packed.shape == (9, 2, 8) and max_seqlen == 5
    assert cu_seqlens.dtype == np.int32 and cu_seqlens.tolist() == [0, 3, 4, 9]
    parts = varlen.unpack(packed, cu_seqlens)
    assert [p.shape[0] for p in parts] == [3, 1, 5] and all((p == s).all() for p, s in zip(parts, seqs))
    lse_parts = varlen.unpack(np.arange(18).reshape(2, 9), cu_seqlens, axis=1)
    assert [p.tolist() for p in lse_parts][2] == [[4, 5, 6, 7, 8], [13, 14, 15, 16, 17]]


# GPU runs of the same four examples, in bf16 (and fp16 for quickstart_cupy). Bounds are relative to
# the largest reference entry, in units of the type's eps (the spacing of numbers in [1, 2)):
#  - a kernel against the float64 reference: the kernel rounds its output to the type (half an ulp,
#    <= eps/2 of the largest entry) and rounds P to it before P @ V and the backward's products
#    (about eps/2 more); bound 2 eps.
#  - cuflash against the framework's own bf16 attention: both sides make those errors; bound 3 eps.
# Measured on an H200 (seeds 0-3), relative to the largest entry, in eps: quickstart_cupy out <= 0.62,
# dq/dk/dv <= 0.93 (bf16 and fp16 alike), lse <= 1.8 float32 eps; torch_module <= 0.90; jax_grad <=
# 0.98; torch.compile against eager 0; varlen_packing 0 (and one bf16 ulp, 3.9e-3, when the batch of
# one was a stride-0 view that sent the dense call to fwd_sm80, before fwd_sm90 accepted such views).


def _report(title: str, result: dict):
    print(title, {name: f"{diff / scale:.2e}" for name, (diff, scale) in result.items()})  # pytest -s shows it


@pytest.mark.gpu
def test_quickstart_cupy_on_gpu():
    """cuflash's kernels on CuPy arrays against the float64 reference on their NumPy copies, and the
    script itself prints its comparison."""
    quickstart = _example("quickstart_cupy")
    assert quickstart.no_gpu_reason() is None
    for dtype, eps in (("bfloat16", BF16_EPS), ("float16", FP16_EPS)):
        result = quickstart.compare(dtype)
        _report(f"quickstart_cupy {dtype}", result)
        _within({n: result[n] for n in ("out", "dq", "dk", "dv")}, 2 * eps)
        _within({"lse": result["lse"]}, 16 * FP32_EPS)  # float32 both sides, scores from the same inputs
    result = _run_script("quickstart_cupy")
    assert result.returncode == 0 and result.stdout.count("max |gpu - reference|") == 5, result.stdout + result.stderr


@pytest.mark.gpu
@pytest.mark.parametrize("window", [(-1, -1), (32, 0)])
def test_torch_module_on_gpu(window):
    """bf16 CuflashSelfAttention against bf16 SdpaSelfAttention with the same weights: output, input
    gradient and weight gradients."""
    result = _example("torch_module").compare("cuda", window=window)
    _report(f"torch_module cuda window={window}", result)
    _within(result, 3 * BF16_EPS)


@pytest.mark.gpu
def test_torch_module_compiles_on_gpu():
    """torch.compile(fullgraph=True) of the module (no graph break at cuflash's op) against eager: the
    same attention kernels, the projections perhaps computed otherwise; bound 2 eps."""
    result = _example("torch_module").compiled_difference()
    _report("torch_module compiled vs eager", result)
    _within(result, 2 * BF16_EPS)


@pytest.mark.gpu
def test_jax_grad_example_on_gpu():
    """jit(value_and_grad), plain and vmapped, through cuflash against jax.nn.dot_product_attention (XLA), bf16."""
    jax = pytest.importorskip("jax")
    if jax.default_backend() == "cpu":
        pytest.skip("this JAX has no GPU backend")
    result = _example("jax_grad").differences()
    _report("jax_grad bf16", result)
    _within(result, 3 * BF16_EPS)


@pytest.mark.gpu
@pytest.mark.parametrize("framework", ["torch", "cupy"])
def test_varlen_packing_on_gpu(framework):
    """Packed varlen against each sequence alone, both on the kernels. The same kernel family gives the
    same bits; the bound allows one bf16 ulp at |out| < 8 (|out| <= max |v|) for a call that a GPU
    serves with another family, and float32 rounding of lse."""
    if framework == "torch":
        pytest.importorskip("torch")
    diff = _example("varlen_packing").max_difference(framework)
    print(f"varlen_packing {framework} bf16", diff)
    assert diff["out"] <= 2.0**-5 and diff["lse"] <= 1e-5, diff


def test_fp8_inference_on_numpy():
    """The reference simulates e4m3 exactly: both ways in land within FP8's error of the bf16 result
    (relative RMS 4.6e-2 measured at these sizes: 3 mantissa bits, 0.1% outliers times 10), and a
    wrong descale or transform would be off by order 1."""
    result = _example("fp8_inference").run("numpy", seqlen=192, nheads=4, nheads_kv=2)
    assert 0 < result["on_the_fly"] < 0.08 and 0 < result["cached"] < 0.08, result


@pytest.mark.gpu
def test_fp8_inference_on_gpu():
    """On Hopper the FP8 kernel serves both ways in; its error adds P rounded to e4m3 to the inputs'
    quantization (same bound as on the reference); elsewhere attention(fp8=True) is refused."""
    pytest.importorskip("torch")
    example = _example("fp8_inference")
    if example.available_framework() != "torch":
        pytest.skip("no FP8 attention kernel for this GPU (compute capability 9.0 only)")
    result = example.run("torch")
    print("fp8_inference", result)
    assert 0 < result["on_the_fly"] < 0.08 and 0 < result["cached"] < 0.08, result
    assert result["ms_fp8"] > 0 and result["ms_bf16"] > 0
