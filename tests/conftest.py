"""Test configuration: hypothesis profiles, the `gpu` marker, and JAX's CPU device for CPU tests.

Profiles (choose with --hypothesis-profile=NAME; `ci` is the default):
  ci       300 examples per property, derandomized: the same examples every run (CI).
  dev      50 examples, for quick local iterations.
  explore  1000 random examples, to look for new failures.
  gpu      derandomized profile for the GPU suites (examples set per test).
"""
import os

import pytest
from hypothesis import HealthCheck, settings

_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
               print_blob=True)
settings.register_profile("ci", max_examples=300, derandomize=True, **_common)
settings.register_profile("dev", max_examples=50, derandomize=True, **_common)
settings.register_profile("explore", max_examples=1000, derandomize=False, **_common)
settings.register_profile("gpu", max_examples=200, derandomize=True, **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))


def _cuda_available() -> bool:
    try:
        import cupy

        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver, no device: all mean "no GPU here"
        return False


def pytest_collection_modifyitems(config, items):
    if _cuda_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA driver and device); runs on the lent GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def jax_on_its_cpu_in_cpu_tests(request):
    """Tests not marked gpu hold JAX arrays to the NumPy reference (float64 among them): they run on
    JAX's CPU device also where JAX has a GPU (the lent machine's), whose kernels take 16-bit inputs
    only. GPU tests choose their devices themselves. (JAX is imported here, not left to the test: a
    test that imports it itself, first in a run, would otherwise get XLA's GPU.)"""
    if request.node.get_closest_marker("gpu"):
        yield
        return
    try:
        import jax
    except ImportError:
        yield
        return
    with jax.default_device(jax.devices("cpu")[0]):
        yield


@pytest.fixture
def fresh_plans():
    """For tests that change a family's tile table: dispatch forgets its remembered kernel choices,
    prepared launches and calls before the test and after it."""
    from cuflash import dispatch

    dispatch.clear_plans()
    yield
    dispatch.clear_plans()
