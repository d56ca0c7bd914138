"""Turn the benchmark JSON (bench_fwd.py) into markdown tables and PNG charts (cuflash.report).

  python benchmarks/report.py DIR        # reads DIR/fwd_*.json and DIR/bwd_*.json, writes DIR/fwd.md,
                                         # DIR/bwd.md and DIR/{fwd,bwd}_<dtype>.png, prints the tables
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing
from cuflash.report import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
