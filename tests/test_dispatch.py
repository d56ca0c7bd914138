"""How dispatch remembers a call (no GPU needed): the call signature keeps apart arguments that
compare equal but check differently, and a remembered call skips the checks only for a signature
whose checks passed."""
import pytest

from cuflash import arrays, dispatch


class _GpuArray:
    """Stands in for a GPU array: arrays.signature gives it the signature it carries."""

    def __init__(self, signature):
        self.signature = signature


@pytest.fixture
def gpu_arrays(monkeypatch):
    monkeypatch.setattr(arrays, "signature", lambda x: x.signature if isinstance(x, _GpuArray) else None)
    dispatch.clear_plans()
    yield
    dispatch.clear_plans()


def test_call_signature_keeps_types_and_layouts_apart(gpu_arrays):
    a, b = _GpuArray(("bf16", (2, 8))), _GpuArray(("bf16", (2, 8), "strided"))
    key = dispatch.call_signature("op", dict(q=a), (True, (-1, -1), None))
    assert key == dispatch.call_signature("op", dict(q=_GpuArray(("bf16", (2, 8)))), (True, (-1, -1), None))
    others = [dispatch.call_signature("op", dict(q=b), (True, (-1, -1), None)),  # another layout
              dispatch.call_signature("op", dict(k=a), (True, (-1, -1), None)),  # another argument
              dispatch.call_signature("other", dict(q=a), (True, (-1, -1), None)),  # another op
              dispatch.call_signature("op", dict(q=a), (1, (-1, -1), None)),  # 1 == True, but not a bool
              dispatch.call_signature("op", dict(q=a), (True, (-1.0, -1), None))]  # a float in the window
    assert None not in others and len({key, *others}) == 1 + len(others)
    assert dispatch.call_signature("op", dict(q=a), (True, [-1, -1], None)) is None  # unhashable: checked every time
    assert dispatch.call_signature("op", dict(q=a, k=object()), (True,)) is None  # not a GPU array


def test_run_checked_checks_each_signature_until_its_checks_pass(gpu_arrays, monkeypatch):
    prepared, checks = [], []

    def prepared_run(problem, inputs, outputs):
        prepared.append(problem)
        return lambda inputs: (problem, inputs["q"])

    monkeypatch.setattr(dispatch, "_prepared_run", prepared_run)

    class Problem:  # what a check returns: a GPU problem
        device = arrays.Device("cuda", 0)
        framework = "torch"

    def check(fail=False):
        checks.append(fail)
        if fail:
            raise ValueError("q is wrong")
        return Problem, {}

    q = _GpuArray(("bf16",))
    key = dispatch.call_signature("op", dict(q=q), ())
    for call in range(3):
        assert dispatch.run_checked(key, dict(q=call), check) == (Problem, call)  # this call's arrays
    assert (len(checks), len(prepared)) == (1, 1)
    bad = dispatch.call_signature("op", dict(q=q), ("bad",))
    for _ in range(2):
        with pytest.raises(ValueError, match="q is wrong"):
            dispatch.run_checked(bad, dict(q=q), lambda: check(fail=True))
    assert checks == [False, True, True]  # a failed check is made again: nothing was remembered
    dispatch.clear_plans()
    dispatch.run_checked(key, dict(q=q), check)
    assert (len(checks), len(prepared)) == (4, 2)
