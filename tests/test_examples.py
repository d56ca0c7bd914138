"""The examples run (on the CPU reference here; on the GPU they take the kernels)."""
import runpy
from pathlib import Path

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"


def test_quickstart_runs_and_frameworks_agree(capsys):
    runpy.run_path(str(EXAMPLES / "quickstart.py"), run_name="__main__")
    printed = capsys.readouterr().out
    assert "numpy: out (2, 256, 8, 64) float16" in printed
    for line in printed.splitlines():
        if "max |" in line:
            assert float(line.rsplit("=", 1)[1]) == 0.0, line  # same reference, same bits
