"""benchmarks/probes/: the overlap probe compiles here (NVRTC from pip) as its premise needs, and on a
Hopper GPU it measures what it says (two GEMM warpgroups share the SM's tensor cores)."""
import importlib.util
import re
from pathlib import Path

import pytest

PROBES = Path(__file__).resolve().parent.parent / "benchmarks" / "probes"


def _overlap():
    spec = importlib.util.spec_from_file_location("overlap_probe", PROBES / "overlap.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_overlap_probe_compiles_to_one_cta_an_sm_without_spills():
    from cuflash import jit, toolchain
    overlap = _overlap()
    program = toolchain.compile_cubin(overlap.SOURCE.read_text(), name=overlap.SOURCE.name,
                                      options=(*jit.compile_options("sm_90a"), "-Xptxas=-v"), name_expressions=[])
    report = toolchain.parse_ptxas_report(program.log)[overlap.KERNEL]
    assert report.spill_stores == 0 and report.spill_loads == 0 and report.stack_frame == 0
    # The probe's premise: one CTA (two warpgroups) an SM, so the roles meet on every SM. Its 256
    # threads at more than 128 registers each leave no room for a second CTA.
    assert report.registers > 128
    assert "(C75" not in program.log, program.log  # no wgmma serialised: the GEMM roles run as written
    ops = toolchain.sass_opcode_histogram(program.cubin)[overlap.KERNEL]
    assert ops.get("QGMMA", 0) > 0 and ops.get("MUFU", 0) >= 2 * 96 and ops.get("FMNMX", 0) >= 96, ops


def test_overlap_probe_host_names_the_roles_and_shared_memory_of_its_kernel():
    overlap = _overlap()
    source = overlap.SOURCE.read_text()
    roles = re.search(r"enum Role : int \{([^}]*)\}", source).group(1)
    assert [name.strip()[1:].lower() for name in roles.split(",")] == [r.replace("_", "") for r in overlap.ROLES]
    shared = re.search(r"constexpr unsigned kSharedBytes = ([\d ()+*]+);", source).group(1)
    assert eval(shared) == overlap.SHARED_BYTES  # (digits, spaces, + * and parentheses only)


@pytest.mark.gpu
def test_overlap_probe_sees_two_gemm_warpgroups_share_the_tensor_cores(capsys):
    import cupy

    from cuflash import jit
    if jit.arch_for(jit.device_compute_capability(cupy.cuda.Device().id)) != "sm_90a":
        pytest.skip("the probe issues wgmma: Hopper only")
    assert _overlap().main(["--iters-gemm", "300", "--iters-other", "150"]) == 0
    rows = re.findall(r"^(gemm_\w+)\s+\+\s+(\w+)\s.* x([\d.]+) / x([\d.]+)$", capsys.readouterr().out, re.M)
    assert len(rows) == 14, rows
    slowdown = {(a, b): (float(x), float(y)) for a, b, x, y in rows}
    # One warpgroup's GEMM loop (a wait each iteration) keeps the tensor cores busy most of the
    # time: beside another GEMM warpgroup each takes well over its time alone (H100: x1.71).
    assert min(slowdown[("gemm_ss", "gemm_ss")]) > 1.4
    assert all(min(pair) > 0.9 for pair in slowdown.values())  # nothing gets faster for company
