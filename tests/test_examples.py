"""The examples run (on the CPU reference here; on the GPU they take the kernels)."""
import math
import runpy
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_quickstart_runs_and_frameworks_agree(capsys):
    runpy.run_path(str(EXAMPLES / "quickstart.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "numpy: out (2, 256, 8, 64) float16" in printed
    for line in printed.splitlines():
        if "max |" in line:
            assert float(line.rsplit("=", 1)[1]) == 0.0, line  # same reference, same bits


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
