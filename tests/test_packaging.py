"""A non-editable install ships the CUDA sources inside the package and finds them at run time."""
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from cuflash import jit

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out),
                    str(ROOT)], check=True)
    (path,) = out.glob("cuflash-*.whl")
    return path


def test_wheel_contains_every_cuda_source(wheel):
    names = set(zipfile.ZipFile(wheel).namelist())
    sources = sorted(p.relative_to(ROOT / "cuda_src").as_posix() for p in (ROOT / "cuda_src").rglob("*")
                     if p.suffix in (".cu", ".cuh"))
    assert sources, "no CUDA sources in the checkout?"
    missing = [s for s in sources if f"cuflash/cuda_src/{s}" not in names]
    assert not missing, f"wheel lacks {missing}"


def test_installed_package_finds_its_sources_and_compiles(wheel, tmp_path):
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                   check=True)
    probe = (
        "import cuflash, cuflash.jit as j, cuflash.kernels as k\n"
        "print(j.source_dir()); print(j.source_hash())\n"
        "v = k.variants_for((8, 0))[-1]\n"
        "r = j.offline_report('sm_80', [v])[0]\n"
        "print(r['registers'] > 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True,
                            env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"}, check=True)
    source_dir, source_hash, compiled = result.stdout.split()
    assert Path(source_dir) == target / "cuflash" / "cuda_src"
    assert source_hash == jit.source_hash()  # the same files as the checkout
    assert compiled == "True"


def test_import_touches_no_framework_and_no_gpu():
    probe = ("import sys, cuflash\n"
             "print(sorted(m for m in ('cupy', 'torch', 'jax', 'cuflash.toolchain') if m in sys.modules))\n")
    result = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"
