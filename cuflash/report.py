"""Benchmark reports: the harness's JSON (cuflash.bench) as markdown tables and PNG charts.

  python -m cuflash.report DIR     # DIR/fwd_*.json, DIR/bwd_*.json -> DIR/fwd.md, DIR/fwd_<dtype>.png, ...
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

# cuflash-sm80: the fallback kernel forced (backend="sm80"), timed beside the default on Hopper.
# cuflash-deterministic: the backward with deterministic=True, timed beside the default.
# cuflash-fp8(-block): attention_fp8 on inputs quantized beforehand (per head; per 128-row block).
# cuflash-fp8-lse: cuflash-fp8 returning the LSE too (its kernel: fp32 row sums, no FMA-pipe exponentials).
# cuflash-fp8-fastexp: cuflash-fp8 with fast_exp=True (P's e4m3 codes straight from the scores).
# cuflash-fp8-e2e: attention(fp8=True, hadamard=True), quantizing q, k and v each call.
# jax-cudnn-fp8: cuDNN's FP8 forward (through JAX, in its process; cuflash.bench._jax_cudnn_fp8).
PEERS = ("cuflash-sm80", "cuflash-deterministic", "torch-flash", "torch-cudnn", "jax-cudnn", "cuflash-fp8",
         "cuflash-fp8-block", "cuflash-fp8-lse", "cuflash-fp8-fastexp", "cuflash-fp8-e2e", "jax-cudnn-fp8")
# One colour per implementation in every chart (matplotlib's default cycle, then tab20's light blue;
# an implementation keeps its colour when a column is added).
COLORS = {"cuflash": "#1f77b4", "cuflash-sm80": "#ff7f0e", "cuflash-deterministic": "#8c564b",
          "torch-flash": "#2ca02c", "torch-cudnn": "#d62728", "jax-cudnn": "#9467bd", "cuflash-fp8": "#e377c2",
          "cuflash-fp8-block": "#7f7f7f", "cuflash-fp8-e2e": "#bcbd22", "jax-cudnn-fp8": "#17becf",
          "cuflash-fp8-lse": "#aec7e8", "cuflash-fp8-fastexp": "#ffbb78"}
LABELS = {"cuflash": "cuflash", "cuflash-sm80": "cuflash, portable kernel (sm80)",
          "cuflash-deterministic": "cuflash, deterministic=True", "torch-flash": "PyTorch SDPA, FlashAttention-2",
          "torch-cudnn": "PyTorch SDPA, cuDNN", "jax-cudnn": "JAX, cuDNN",
          "cuflash-fp8": "cuflash FP8 (e4m3), per-head scales",
          "cuflash-fp8-block": "cuflash FP8 (e4m3), per-128-row scales",
          "cuflash-fp8-lse": "cuflash FP8 (e4m3), per-head scales, returning the LSE",
          "cuflash-fp8-fastexp": "cuflash FP8 (e4m3), per-head scales, fast_exp=True",
          "cuflash-fp8-e2e": "cuflash FP8 end to end (fp8=True, hadamard=True: quantizing each call)",
          "jax-cudnn-fp8": "JAX, cuDNN FP8 (e4m3), per-tensor scales"}
PASSES = {"fwd": "Forward", "bwd": "Backward (2.5x the forward's FLOPs)", "decode": "Decode steps"}
# A row whose repetitions spread this much (p10 to p90, over the median) of some implementation was
# not measured at a steady state: seen in the shortest causal rows, where the host's calls of the
# interleaved implementations fall behind the GPU and some or all of them read 1.5-2x slow (normal
# in the next run). Marked in the table, like a throttled row, rather than used.
UNSTEADY_SPREAD = 0.15


def _cells(rows: list[dict]) -> dict:
    cells = defaultdict(dict)
    for r in rows:
        cells[(r["dtype"], r["headdim"], r["causal"], r["seqlen"])][r["impl"]] = r
    return cells


def _clock_range(rows: list[dict]) -> str:
    clocks = sorted({r["sm_clock_mhz"] for r in rows if r.get("sm_clock_mhz")})
    return f"SM clock {clocks[0]}-{clocks[-1]} MHz over the rows" if clocks else "SM clock not recorded"


def _versions(results: list[dict]) -> dict:
    """Every package version the runs recorded (the JAX process knows no torch, and the torch one
    no cuDNN of JAX's: merged)."""
    merged = {}
    for res in results:
        merged.update(res["meta"]["versions"])
    return merged


def _jax_timing(rows: list[dict]) -> str:
    """How the JAX process timed its rows: programs of jax_calls calls each (cuflash.bench._jax_repeated),
    or, in runs before that field, calls dispatched one by one."""
    calls = {r.get("jax_calls") for r in rows if r["impl"].startswith("jax-")}
    return f"programs of {calls.pop()} calls" if len(calls) == 1 and None not in calls else "calls back to back"


def _graph_timing(results: list[dict]) -> str:
    """How the torch process timed its rows, where it replayed CUDA graphs (bench.time_graphs); read
    from every document's meta, since the JAX process's (which never does) sorts first."""
    calls = sorted({res["meta"]["graph_calls"] for res in results if res["meta"].get("graph_calls")})
    if not calls:
        return ""
    jax = any(r["impl"].startswith("jax-") for res in results for r in res["rows"])
    whose = "of the torch process's " if jax else ""
    return f", each {whose}a CUDA graph replay of {' or '.join(map(str, calls))} calls"


def render(results: list[dict], title: str = "Forward") -> str:
    """A markdown table: TFLOP/s of every implementation, cuflash's ratios to FA2 and cuDNN, the FP8
    kernel's (per-head scales) to cuflash's 16-bit one and to cuDNN's FP8 forward, the clock."""
    rows = [r for res in results for r in res["rows"]]
    meta = results[0]["meta"]
    cells = _cells(rows)
    gpu = rows[0]["gpu"] if rows else "?"
    peers = [p for p in PEERS if any(p in c for c in cells.values())]
    fp8 = "cuflash-fp8" in peers  # then also the FP8 kernel's speed-up over the 16-bit one
    fp8_cudnn = fp8 and "jax-cudnn-fp8" in peers  # and its ratio to cuDNN's FP8 forward
    fast = "cuflash-fp8-fastexp" in peers  # and fast_exp's over the 16-bit kernel
    out = [f"{title} TFLOPs on {gpu}, {meta['date']} (FA3 sizing: batch*seqlen = {meta['tokens']}, "
           f"nheads*headdim = {meta['hidden']}; median of {meta['reps']} interleaved repetitions"
           + _graph_timing(results)
           + (f"; {', '.join(p for p in peers if p.startswith('jax-'))} timed in JAX's process, {_jax_timing(rows)}"
              if any(p.startswith("jax-") for p in peers) else "") + "; "
           f"{_clock_range(rows)})."
           + (" fp8 / cuDNN fp8 divides times from the two processes (CUDA events in torch's, the wall clock of"
              " JAX's programs) of kernels that write bf16 (cuflash) and e4m3 (cuDNN)." if fp8_cudnn else ""),
           "Versions: " + ", ".join(f"{k} {v}" for k, v in _versions(results).items()) + ".", "",
           "| dtype | hdim | causal | seqlen | cuflash | " + " | ".join(peers) + " | cuflash / FA2 | cuflash / cuDNN |"
           + (" fp8 / cuflash |" if fp8 else "") + (" fp8 fast_exp / cuflash |" if fast else "")
           + (" fp8 / cuDNN fp8 |" if fp8_cudnn else "") + " clock MHz |",
           "|---|---|---|---|---|" + "---|" * len(peers) + "---|---|" + ("---|" if fp8 else "") + ("---|" if fast else "")
           + ("---|" if fp8_cudnn else "") + "---|"]
    for key in sorted(cells):
        c = cells[key]
        if "cuflash" not in c:
            continue
        tf = lambda name: f"{c[name]['tflops']:.0f}" if name in c else "-"
        ratio = lambda name: f"{c['cuflash']['tflops'] / c[name]['tflops']:.2f}" if name in c else "-"
        flag = " (throttled)" if any(r.get("throttled") for r in c.values()) else ""
        spread = max((r.get("spread_p10_p90") or 0.0) for r in c.values())
        if spread > UNSTEADY_SPREAD:
            flag += f" (unsteady: p10-p90 {spread:.2f} of a median)"
        over = lambda top, name: (f"{c[top]['tflops'] / c[name]['tflops']:.2f}" if top in c and name in c else "-")
        out.append(f"| {key[0]} | {key[1]} | {int(key[2])} | {key[3]} | {tf('cuflash')} | "
                   + " | ".join(tf(p) for p in peers)
                   + f" | {ratio('torch-flash')} | {ratio('torch-cudnn')} |"
                   + (f" {over('cuflash-fp8', 'cuflash')} |" if fp8 else "")
                   + (f" {over('cuflash-fp8-fastexp', 'cuflash')} |" if fast else "")
                   + (f" {over('cuflash-fp8', 'jax-cudnn-fp8')} |" if fp8_cudnn else "")
                   + f" {c['cuflash']['sm_clock_mhz'] or '?'}{flag} |")
    return "\n".join(out) + "\n"


def render_decode(results: list[dict], title: str = "Decode steps") -> str:
    """A markdown table of decode rows (cuflash.bench.DECODE_SHAPES, SPECULATIVE_SHAPES): microseconds
    of every implementation, the bandwidth cuflash reads K and V at, its speed over FA2's and cuDNN's (their
    time over its), the FP8 kernel's over cuflash's 16-bit one, the clock."""
    rows = [r for res in results for r in res["rows"]]
    meta = results[0]["meta"]
    cells = defaultdict(dict)
    for r in rows:
        cells[(r["dtype"], r["headdim"], bool(r["causal"]), r["batch"], r["seqlen_q"], r["seqlen"], r["nheads"],
               r["nheads_kv"])][r["impl"]] = r
    peers = [p for p in PEERS if any(p in c for c in cells.values())]
    fp8 = "cuflash-fp8" in peers
    out = [f"{title} on {rows[0]['gpu'] if rows else '?'}, {meta['date']}: microseconds a call, median of "
           f"{meta['reps']} interleaved repetitions"
           + _graph_timing(results)
           + f"; {_clock_range(rows)}. Copies: the sets of inputs a row's calls cycle through, so that each reads K "
           "and V from memory rather than from the L2 the previous call filled (cuflash.bench.input_copies; 1: the "
           "same inputs every call). Causal rows (speculative decoding's steps) align the mask bottom-right, the "
           "peers through torch's causal_lower_right (cuDNN's backend as a dense mask made each call). TB/s: K "
           "and V's bytes (16-bit) over cuflash's time; speed-ups are times over cuflash's.", "Versions: " + ", ".join(f"{k} {v}" for k, v in _versions(results).items()) + ".", "",
           "| dtype | hdim | causal | batch | q rows | keys | heads (q/kv) | copies | cuflash | " + " | ".join(peers)
           + " | cuflash TB/s | vs FA2 | vs cuDNN |" + (" fp8 / cuflash |" if fp8 else "") + " clock MHz |",
           "|---|---|---|---|---|---|---|---|---|" + "---|" * len(peers) + "---|---|---|" + ("---|" if fp8 else "") + "---|"]
    for key in sorted(cells):
        c = cells[key]
        if "cuflash" not in c:
            continue
        dtype, headdim, causal, batch, seqlen_q, seqlen_k, nheads, nheads_kv = key
        us = lambda name: f"{1e3 * c[name]['ms']:.1f}" if name in c else "-"
        over = lambda name, base="cuflash": f"{c[name]['ms'] / c[base]['ms']:.2f}" if name in c and base in c else "-"
        flag = " (throttled)" if any(r.get("throttled") for r in c.values()) else ""
        tbs = 2 * batch * seqlen_k * nheads_kv * headdim * 2 / (c["cuflash"]["ms"] * 1e9)
        out.append(f"| {dtype} | {headdim} | {int(causal)} | {batch} | {seqlen_q} | {seqlen_k} | {nheads}/{nheads_kv} | "
                   + f"{c['cuflash'].get('input_copies', 1)} | {us('cuflash')} | "
                   + " | ".join(us(p) for p in peers) + f" | {tbs:.2f} | {over('torch-flash')} | {over('torch-cudnn')} |"
                   + (f" {over('cuflash', 'cuflash-fp8')} |" if fp8 else "")
                   + f" {c['cuflash']['sm_clock_mhz'] or '?'}{flag} |")
    return "\n".join(out) + "\n"


def chart(results: list[dict], path: Path, title: str = "Forward", dtype: str = "bfloat16") -> Path:
    """A PNG: TFLOP/s against seqlen, one panel per (head dim, causal), one line per implementation.
    Needs matplotlib (ImportError otherwise)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for res in results for r in res["rows"] if r["dtype"] == dtype]
    if not rows:
        raise ValueError(f"no {dtype} rows to chart")
    headdims = sorted({r["headdim"] for r in rows})
    causals = sorted({bool(r["causal"]) for r in rows})
    impls = [i for i in ("cuflash",) + PEERS if any(r["impl"] == i for r in rows)]
    top = 1.08 * max(r["tflops"] for r in rows)
    fig, axes = plt.subplots(len(causals), len(headdims), figsize=(4.2 * len(headdims), 3.4 * len(causals)),
                             squeeze=False, sharey=True)
    for i, causal in enumerate(causals):
        for j, headdim in enumerate(headdims):
            ax = axes[i][j]
            for impl in impls:
                pts = sorted((r["seqlen"], r["tflops"]) for r in rows
                             if r["impl"] == impl and r["headdim"] == headdim and bool(r["causal"]) == causal)
                if pts:
                    ax.plot(*zip(*pts), marker="o", linewidth=2.4 if impl == "cuflash" else 1.4, label=LABELS[impl],
                            color=COLORS[impl], zorder=3 if impl == "cuflash" else 2)
            ax.set_xscale("log", base=2)
            seqlens = sorted({r["seqlen"] for r in rows})
            ax.set_xticks(seqlens, [f"{s // 1024}k" if s >= 1024 else str(s) for s in seqlens])
            ax.minorticks_off()
            ax.set_title(f"head dim {headdim}, {'causal' if causal else 'non-causal'}", fontsize=10)
            ax.set_xlabel("sequence length (tokens)")
            if j == 0:
                ax.set_ylabel("TFLOP/s")
            ax.set_ylim(0, top)
            ax.grid(True, alpha=0.3)
    legend = {}  # every implementation drawn in some panel, in drawing order
    for ax in axes.flat:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    handles, labels = list(legend.values()), list(legend)
    fig.legend(handles, labels, loc="lower center", ncol=min(len(labels), 3), frameon=False)
    meta = results[0]["meta"]
    fig.suptitle(f"{title}, {dtype}, {rows[0]['gpu']}, {meta['date']} ({_clock_range(rows)}; "
                 f"batch*seqlen = {meta['tokens']}, nheads*headdim = {meta['hidden']})", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 0.95))
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def charts_available() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def outputs(directory: Path) -> list[Path]:
    """The benchmark JSON and the reports of them already in `directory`."""
    return [p for prefix in PASSES for pattern in (f"{prefix}_*.json", f"{prefix}.md", f"{prefix}_*.png")
            for p in sorted(directory.glob(pattern))]


def write(directory: Path, charts: bool = True) -> list[Path]:
    """fwd.md / bwd.md / decode.md from DIR's JSON, and a PNG per pass (but decode) and dtype when
    matplotlib is installed; the paths written."""
    written = []
    for prefix, title in PASSES.items():
        results = [json.loads(p.read_text()) for p in sorted(directory.glob(f"{prefix}_*.json"))]
        if not results:
            continue
        md = directory / f"{prefix}.md"
        md.write_text((render_decode if prefix == "decode" else render)(results, title))
        written.append(md)
        if not charts or prefix == "decode":  # (decode rows: a table)
            continue
        for dtype in sorted({r["dtype"] for res in results for r in res["rows"]}):
            written.append(chart(results, directory / f"{prefix}_{dtype}.png", title.split(" (")[0], dtype))
    return written


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    charts = charts_available()
    if not charts:
        print("matplotlib is not installed: markdown only (pip install matplotlib for the charts)", file=sys.stderr)
    written = write(Path(argv[0]), charts)
    if not written:
        print(f"no fwd_*.json, bwd_*.json or decode_*.json in {argv[0]}: nothing to report", file=sys.stderr)
        return 2
    for path in written:
        print(path.read_text() if path.suffix == ".md" else f"chart: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
