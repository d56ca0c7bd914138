"""python -m cuflash: the main job (check every kernel family this GPU runs against the reference,
then benchmark cuflash against the peers it finds); info | kernels | build."""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from importlib import metadata


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def _gpus() -> tuple[list[dict], str | None]:
    """The visible GPUs, or ([], reason) when there are none."""
    try:
        import cupy
    except ImportError:
        return [], 'CuPy is not installed (pip install "cuflash[cuda12]")'
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # no driver, one too old for CuPy's CUDA, or no device
        driver = cupy.cuda.runtime.driverGetVersion()  # 0: no driver at all
        if driver == 0:
            return [], "no NVIDIA driver is installed (or no GPU is present)"
        runtime = cupy.cuda.runtime.runtimeGetVersion()
        return [], (f"no NVIDIA GPU is usable here: the driver supports CUDA {driver // 1000}.{driver % 1000 // 10}, "
                    f"CuPy was built for CUDA {runtime // 1000}.{runtime % 1000 // 10} ({type(e).__name__}: {e})")
    if count == 0:
        return [], "no NVIDIA GPU is visible"
    from . import jit

    gpus = []
    for i in range(count):
        props = jit.device_properties(i)
        gpus.append(dict(index=i, name=props["name"].decode(), compute_capability=(props["major"], props["minor"]),
                         multiprocessors=props["multiProcessorCount"], memory_gib=props["totalGlobalMem"] / 2**30))
    return gpus, None


def cmd_info(args) -> int:
    from . import __version__, jit, kernels

    print(f"cuflash {__version__}  (sources {jit.source_dir()}, hash {jit.source_hash()[:16]})")
    print(f"python {platform.python_version()}, numpy {_version('numpy')}")
    frameworks = {name: _version(dist) for name, dist in
                  (("cupy", "cupy-cuda12x"), ("cupy", "cupy-cuda13x"), ("torch", "torch"), ("jax", "jax"))
                  if _version(dist)}
    print("frameworks: " + (", ".join(f"{k} {v}" for k, v in frameworks.items()) or "none besides numpy"))
    gpus, reason = _gpus()
    if gpus:
        import cupy

        print(f"CUDA driver {cupy.cuda.runtime.driverGetVersion()}, CuPy's NVRTC {cupy.cuda.nvrtc.getVersion()}")
        for g in gpus:
            cc = g["compute_capability"]
            print(f"GPU {g['index']}: {g['name']}, compute capability {cc[0]}.{cc[1]} (compiles for "
                  f"{jit.arch_for(cc)}), {g['multiprocessors']} SMs, {g['memory_gib']:.0f} GiB")
    else:
        print(f"GPU: none. {reason}. cuflash's kernels need an NVIDIA GPU of compute capability 8.0 or newer; "
              "NumPy and other CPU arrays run on the NumPy reference.")
    try:
        from . import toolchain

        print(f"offline compiler: NVRTC {'.'.join(map(str, toolchain.nvrtc_version()))} ({toolchain.nvrtc_library()})")
    except Exception as e:
        print(f"offline compiler: unavailable ({e})")
    print("kernel families (in order of preference; backend= forces one; a family that declines a call "
          "says why in the 'cuflash' logger at DEBUG level):")
    cc_here = gpus[0]["compute_capability"] if gpus else None
    for family in kernels.FAMILIES.values():
        if cc_here is None:
            here = "no GPU here"
        else:
            here = "runs here" if family.runs_on(cc_here) else "not on this GPU"
        print(f"  {family.name:<18} backend={family.backend!r:<7} {', '.join(family.ops):<50} "
              f"{family.requirement}: {here}")
        print(f"  {'':<18} {family.description}")
    return 0


def cmd_kernels(args) -> int:
    from . import jit, kernels

    try:
        cc = jit.compute_capability_of(args.arch)
    except ValueError as e:
        print(f"cuflash kernels: {e}", file=sys.stderr)
        return 2
    variants = kernels.variants_for(cc, args.family)
    start = time.perf_counter()
    report = jit.offline_report(args.arch, variants, jobs=args.jobs)
    elapsed = time.perf_counter() - start
    if args.json:
        json.dump(report, sys.stdout, indent=1)
        print()
        return 0
    print(f"{len(report)} variants for {args.arch}, compiled offline in {elapsed:.1f} s")
    print(f"{'variant':<58} {'regs':>4} {'spill':>5} {'stack':>5} {'smem':>6} {'LDL/STL':>7}  top SASS opcodes")
    for r in report:
        top = ", ".join(f"{k} {v}" for k, v in list(r["sass_opcodes"].items())[:5])
        spills = r["spill_store_bytes"] + r["spill_load_bytes"]
        smem = r["static_shared_bytes"] + r["dynamic_shared_bytes"]
        print(f"{r['uri']:<58} {r['registers']:>4} {spills:>5} {r['stack_frame_bytes']:>5} {smem:>6} "
              f"{r['local_memory_instructions']:>7}  {top}")
    return 0


def _load_times(variants, device_index: int) -> list[float]:
    from . import jit

    times = []
    for variant in variants:
        t0 = time.perf_counter()
        jit.get_function(variant, device_index)
        times.append(time.perf_counter() - t0)
    return times


def cmd_build(args) -> int:
    gpus, reason = _gpus()
    if not gpus:
        print(f"cuflash build: {reason}; nothing to build without a GPU", file=sys.stderr)
        return 1
    import subprocess

    from . import jit, kernels

    device = gpus[args.device]
    cc = device["compute_capability"]
    variants = kernels.variants_for(cc, args.family)
    if args.load_only:  # the child process below: everything comes from CuPy's disk cache
        print(json.dumps(_load_times(variants, device["index"])))
        return 0
    print(f"building {len(variants)} variants for {device['name']} ({jit.arch_for(cc)})")
    first = []
    for i, variant in enumerate(variants, 1):
        first.extend(_load_times([variant], device["index"]))
        print(f"\r[{i}/{len(variants)}] {variant.uri:<60} {first[-1]:6.2f} s", end="", flush=True)
    print()
    print(f"first load (compiles unless CuPy's disk cache has it): total {sum(first):.2f} s, "
          f"slowest {max(first):.2f} s")
    # A warm load is what the next process pays: measure it in one.
    families = [a for name in (args.family or []) for a in ("--family", name)]
    child = subprocess.run([sys.executable, "-m", "cuflash", "build", "--load-only", "--device", str(args.device),
                            *families], capture_output=True, text=True)
    if child.returncode != 0:
        print(f"warm load check failed:\n{child.stderr}", file=sys.stderr)
        return 1
    warm = json.loads(child.stdout.strip().splitlines()[-1])
    print(f"warm load in a new process (CuPy's disk cache): total {sum(warm):.3f} s, "
          f"mean {1e3 * sum(warm) / len(warm):.1f} ms per variant")
    return 0


def _show_reference() -> None:
    """What the NumPy reference computes on a small problem: the CPU half of the main job."""
    import numpy as np

    import cuflash

    rng = np.random.default_rng(0)
    q = rng.standard_normal((1, 6, 4, 64)).astype(np.float16)
    k, v = (rng.standard_normal((1, 6, 2, 64)).astype(np.float16) for _ in range(2))
    out, lse = cuflash.attention(q, k, v, causal=True, return_lse=True)
    print("The NumPy reference on a small problem: q (1, 6, 4, 64), k and v (1, 6, 2, 64) float16 (GQA, 2 query "
          "heads per kv head), causal:")
    show = lambda x: np.array2string(np.asarray(x, np.float32), precision=4, floatmode="fixed")
    print(f"  out {out.shape} {out.dtype}; out[0, :, 0, 0] = {show(out[0, :, 0, 0])}")
    print(f"  lse {lse.shape} {lse.dtype}; lse[0, 0] = {show(lse[0, 0])}")
    print("  row 0 sees only key 0, so out[0, 0, 0] equals v[0, 0, 0]: "
          f"{out[0, 0, 0, 0]} == {v[0, 0, 0, 0]} ({bool(out[0, 0, 0, 0] == v[0, 0, 0, 0])})")


def cmd_run(args) -> int:
    """The main job."""
    from pathlib import Path

    gpus, reason = _gpus()
    if not gpus:
        _show_reference()
        print(f"\nNo GPU: {reason}. cuflash's kernels need an NVIDIA GPU of compute capability 8.0 or newer "
              "(A100, A10, L4, RTX 30xx/40xx, H100, H200); there `python -m cuflash` checks them against this "
              "reference and benchmarks them against PyTorch's and JAX's attention.")
        return 0
    import numpy as np

    from . import bench, check, jit, report

    device = gpus[0]
    cc = device["compute_capability"]
    print(f"GPU 0: {device['name']}, compute capability {cc[0]}.{cc[1]} (kernels compiled for {jit.arch_for(cc)})")
    if cc < (8, 0):
        _show_reference()
        print("cuflash's kernels need compute capability 8.0 or newer; this GPU runs none of them.")
        return 1
    seed = args.seed if args.seed is not None else int(np.random.SeedSequence().entropy % 2**31)
    again = f"python -m cuflash --no-bench --checks {args.checks} --seed {seed}"
    rng = np.random.default_rng(seed)
    cases = []
    for case in check.draw_cases(rng, cc, args.checks):
        why_not = check.runnable(case)
        if why_not:
            print(f"  not checked here: {case.describe()}: {why_not}")
        else:
            cases.append(case)
    print(f"1. Checking {len(cases)} random configurations against the NumPy reference (`{again}` repeats "
          "them). Each kernel variant compiles on first use and is cached.")
    failures = []
    for case in bench.progress(cases, "checking"):
        try:
            outcome = check.run_case(case, rng)
        except Exception as e:  # a compile error or a refused call is a failed check, reported in full
            outcome = check.Outcome(case, False, f"{type(e).__name__}: {e}")
        bench.say(f"  {'ok  ' if outcome.ok else 'FAIL'} {case.describe()}: {outcome.detail}")
        if not outcome.ok:
            failures.append(outcome)
    if failures:
        print(f"{len(failures)} of {len(cases)} checks FAILED (above); not benchmarking wrong kernels. "
              f"Please report it with this output; `{again}` repeats the draws.")
        return 1
    print(f"All {len(cases)} checks passed.")
    if args.no_bench:
        return 0
    seqlens = bench.SEQLENS if args.full else bench.QUICK_SEQLENS
    grid = bench.configs(("bfloat16",), bench.HEADDIMS, (False, True), seqlens)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in report.outputs(out_dir):  # an earlier run's results would be merged into this report
        stale.unlink()
    xp = bench.array_backend()
    peers = "torch SDPA (FlashAttention-2 and cuDNN backends)" if xp.name == "torch" else \
        "no PyTorch with CUDA here, so cuflash alone on CuPy arrays"
    print(f"2. Benchmarking, bf16, FlashAttention-3 sizing (batch*seqlen = {bench.TOKENS}, nheads*headdim = "
          f"{bench.HIDDEN}), {len(grid)} configurations, forward then backward; peers: {peers}.")
    command = "python -m cuflash " + " ".join(args.argv)
    fwd = bench.run(grid, reps=args.reps, warmup=3, xp=xp)
    bench.save(out_dir / f"fwd_{xp.name}.json", fwd, reps=args.reps, command=command)
    jax_rows, why_not = bench.run_jax_process(grid, args.reps)
    if jax_rows:
        bench.save(out_dir / "fwd_jax.json", jax_rows, reps=args.reps, command=command)
    else:
        print(f"  JAX's cuDNN attention not measured: {why_not}")
    bwd = bench.run(grid, backward=True, reps=args.reps, warmup=3, xp=xp)
    bench.save(out_dir / f"bwd_{xp.name}.json", bwd, reps=args.reps, command=command)
    charts = report.charts_available()
    written = report.write(out_dir, charts)
    for path in written:
        if path.suffix == ".md":
            print("\n" + path.read_text())
    print("Written: " + ", ".join(str(p) for p in written)
          + ("" if charts else " (no charts: pip install matplotlib)"))
    return 0


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(prog="python -m cuflash", description=__doc__,
                                     epilog="Without a command: the main job (`run`); `python -m cuflash run -h` lists "
                                            "its options, which may follow `python -m cuflash` directly.")
    sub = parser.add_subparsers(dest="command")
    r = sub.add_parser("run", help="the main job, what `python -m cuflash` alone does: check every kernel family "
                                   "this GPU runs against the reference, then benchmark against the peers")
    r.add_argument("--out", default="cuflash-report", help="where the JSON, tables and charts go, replacing an earlier "
                                                          "run's (default ./cuflash-report)")
    r.add_argument("--checks", type=int, default=3, help="random configurations per kernel family and op (default 3)")
    r.add_argument("--seed", type=int, default=None, help="repeat the checks of an earlier run")
    r.add_argument("--no-bench", action="store_true", help="check only")
    r.add_argument("--full", action="store_true", help="the full FlashAttention-3 grid (seqlens 512-16k) instead "
                                                       "of the quick set (1k, 4k, 16k)")
    r.add_argument("--reps", type=int, default=20, help="timed repetitions per implementation (default 20)")
    sub.add_parser("info", help="GPU, versions, frameworks, kernel families and whether they run here")
    k = sub.add_parser("kernels", help="compile every registered variant offline (no GPU needed) and report "
                                       "registers, spills, shared memory and SASS opcodes")
    k.add_argument("--arch", default="sm_90a", help="sm_80, sm_86, sm_89, sm_90a, ... (default sm_90a)")
    k.add_argument("--family", action="append", help="only this family (repeatable)")
    k.add_argument("--json", action="store_true", help="print the full report as JSON")
    k.add_argument("--jobs", type=int, default=2, help="parallel compiles (default 2)")
    b = sub.add_parser("build", help="precompile every variant for this GPU into CuPy's disk cache")
    b.add_argument("--device", type=int, default=0)
    b.add_argument("--family", action="append", help="only this family (repeatable)")
    b.add_argument("--load-only", action="store_true", help=argparse.SUPPRESS)
    if not argv or argv[0].startswith("-") and argv[0] not in ("-h", "--help"):
        argv = ["run", *argv]  # no command: the main job
    args = parser.parse_args(argv)
    args.argv = argv[1:]
    return {"run": cmd_run, "info": cmd_info, "kernels": cmd_kernels, "build": cmd_build}[args.command](args)


if __name__ == "__main__":
    sys.exit(main())
