"""python -m cuflash without a GPU: info says so plainly, build refuses in one line, kernels works."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import _cuda_available

ROOT = Path(__file__).resolve().parent.parent
no_gpu = pytest.mark.skipif(_cuda_available(), reason="checks the behaviour on a machine without a GPU")


def cuflash(*args):
    return subprocess.run([sys.executable, "-m", "cuflash", *args], cwd=ROOT, capture_output=True, text=True)


@no_gpu
def test_info_says_plainly_there_is_no_gpu():
    result = cuflash("info")
    assert result.returncode == 0, result.stderr
    assert "GPU: none." in result.stdout and "compute capability 8.0 or newer" in result.stdout
    assert "bwd_preprocess" in result.stdout and "no GPU here" in result.stdout


@no_gpu
def test_build_exits_nonzero_with_one_line():
    result = cuflash("build")
    assert result.returncode == 1
    assert len(result.stderr.strip().splitlines()) == 1 and "no" in result.stderr.lower()


def test_kernels_json_for_one_family():
    result = cuflash("kernels", "--arch", "sm_80", "--family", "bwd_preprocess", "--json")
    assert result.returncode == 0, result.stderr
    rows = json.loads(result.stdout)
    assert len(rows) == 32 and all(r["arch"] == "sm_80" and r["spill_store_bytes"] == 0 for r in rows)


def test_kernels_refuses_a_malformed_arch():
    result = cuflash("kernels", "--arch", "hopper")
    assert result.returncode == 2 and "sm_80" in result.stderr
