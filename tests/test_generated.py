"""Generated sources are up to date with their generators."""
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_wgmma_header_matches_its_generator():
    result = subprocess.run([sys.executable, str(ROOT / "tools" / "gen_wgmma.py"), "--check"], capture_output=True,
                            text=True)
    assert result.returncode == 0, result.stderr
