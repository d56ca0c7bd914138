"""Turn the benchmark JSON (bench_fwd.py) into markdown tables of TFLOPs and ratios.

  python benchmarks/report.py DIR        # reads DIR/fwd_*.json and DIR/bwd_*.json, writes DIR/fwd.md
                                         # and DIR/bwd.md and prints them
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

# cuflash-sm80: the fallback kernel forced (backend="sm80"), timed beside the default on Hopper.
# cuflash-deterministic: the backward with deterministic=True, timed beside the default.
PEERS = ("cuflash-sm80", "cuflash-deterministic", "torch-flash", "torch-cudnn", "jax-cudnn")
PASSES = {"fwd": "Forward", "bwd": "Backward (2.5x the forward's FLOPs)"}


def render(results: list[dict], title: str = "Forward") -> str:
    rows = [r for res in results for r in res["rows"]]
    meta = results[0]["meta"]
    cells = defaultdict(dict)
    for r in rows:
        cells[(r["dtype"], r["headdim"], r["causal"], r["seqlen"])][r["impl"]] = r
    gpu = rows[0]["gpu"] if rows else "?"
    clocks = sorted({r["sm_clock_mhz"] for r in rows})
    peers = [p for p in PEERS if any(p in c for c in cells.values())]
    out = [f"{title} TFLOPs on {gpu}, {meta['date']} (FA3 sizing: batch*seqlen = {meta['tokens']}, "
           f"nheads*headdim = {meta['hidden']}; median of {meta['reps']} interleaved repetitions; "
           f"SM clock {clocks[0]}-{clocks[-1]} MHz over the rows).",
           "Versions: " + ", ".join(f"{k} {v}" for k, v in meta["versions"].items()) + ".", "",
           "| dtype | hdim | causal | seqlen | cuflash | " + " | ".join(peers) + " | cuflash / FA2 | cuflash / cuDNN | clock MHz |",
           "|---|---|---|---|---|" + "---|" * len(peers) + "---|---|---|"]
    for key in sorted(cells):
        c = cells[key]
        if "cuflash" not in c:
            continue
        tf = lambda name: f"{c[name]['tflops']:.0f}" if name in c else "-"
        ratio = lambda name: f"{c['cuflash']['tflops'] / c[name]['tflops']:.2f}" if name in c else "-"
        flag = " (throttled)" if any(r.get("throttled") for r in c.values()) else ""
        out.append(f"| {key[0]} | {key[1]} | {int(key[2])} | {key[3]} | {tf('cuflash')} | "
                   + " | ".join(tf(p) for p in peers)
                   + f" | {ratio('torch-flash')} | {ratio('torch-cudnn')} | {c['cuflash']['sm_clock_mhz']}{flag} |")
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    directory = Path((argv or sys.argv[1:])[0])
    for prefix, title in PASSES.items():
        results = [json.loads(p.read_text()) for p in sorted(directory.glob(f"{prefix}_*.json"))]
        if results:
            text = render(results, title)
            (directory / f"{prefix}.md").write_text(text)
            print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
