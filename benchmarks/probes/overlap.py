"""Overlap probe: does one warpgroup's e4m3 wgmma overlap another warpgroup's softmax work on an SM?

Runs overlap.cu (one CTA of two warpgroups per SM, every SM) with each role alone and beside a
GEMM role, and prints the cycles each warpgroup's loop took: alone, together, and the slowdown.
Where two roles overlap perfectly, each keeps its time alone; where they share a resource, one or
both slow. Findings and numbers: benchmarks/NOTES-fp8.md (session 29).

  python benchmarks/probes/overlap.py [--iters-gemm 2000] [--iters-other 1000]
"""
import argparse
from pathlib import Path

ROLES = ("idle", "gemm_ss", "gemm_rs", "softmax", "mufu", "ffma", "fmnmx", "fadd")  # overlap.cu's Role
KERNEL = "overlap_probe"
SOURCE = Path(__file__).with_suffix(".cu")
SHARED_BYTES = (64 + 192 + 2 * 128) * 128 + 1024  # overlap.cu's kSharedBytes


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters-gemm", type=int, default=2000, help="GEMM roles' iterations")
    parser.add_argument("--iters-other", type=int, default=1000, help="the other roles' iterations")
    args = parser.parse_args(argv)

    import cupy
    import numpy as np

    from cuflash import jit
    device = cupy.cuda.Device()
    arch = jit.arch_for(jit.device_compute_capability(device.id))
    if arch != "sm_90a":
        raise SystemExit(f"the probe issues wgmma: it needs a Hopper GPU (sm_90a), not {arch}")
    # cuflash's compile options: overlap.cu includes cuda_src/common/
    kernel = cupy.RawModule(code=SOURCE.read_text(), options=jit.compile_options(arch)).get_function(KERNEL)
    kernel.max_dynamic_shared_size_bytes = SHARED_BYTES
    sms = device.attributes["MultiProcessorCount"]
    sink = cupy.zeros(256, cupy.float32)
    cycles = cupy.zeros(2 * sms, cupy.int64)

    def cycles_of(role0: str, role1: str) -> tuple[float, float]:
        """Median over the SMs of each warpgroup's loop cycles (second of two launches)."""
        for _ in range(2):
            kernel((sms,), (256,), (np.int32(ROLES.index(role0)), np.int32(ROLES.index(role1)),
                                    np.int32(args.iters_gemm), np.int32(args.iters_other), sink, cycles),
                   shared_mem=SHARED_BYTES)
        per_sm = cycles.get().reshape(sms, 2)
        return float(np.median(per_sm[:, 0])), float(np.median(per_sm[:, 1]))

    alone = {role: cycles_of(role, "idle")[0] for role in ROLES[1:]}
    print(f"{device.id}: {cupy.cuda.runtime.getDeviceProperties(device.id)['name'].decode()}, {sms} SMs; "
          f"iterations: GEMM {args.iters_gemm}, others {args.iters_other}")
    print("kcycles a warpgroup's loop took: alone (each role on warpgroup 0, warpgroup 1 idle), together "
          "(warpgroup 0 / 1), slowdown")
    for gemm in ("gemm_ss", "gemm_rs"):
        for other in ROLES[1:]:
            together = cycles_of(gemm, other)
            print(f"{gemm:8s} + {other:8s}  alone {alone[gemm] / 1e3:8.1f} / {alone[other] / 1e3:8.1f}"
                  f"  together {together[0] / 1e3:8.1f} / {together[1] / 1e3:8.1f}"
                  f"  x{together[0] / alone[gemm]:.2f} / x{together[1] / alone[other]:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
