"""CPU-only tests of cuflash.toolchain: they really compile with NVRTC (pip wheel),
read ptxas' -v report and disassemble with nvdisasm (pip wheel).  No GPU, no
CUDA driver.  Nothing is skipped: the tools come with the ``test`` extra."""

from __future__ import annotations

import collections
import concurrent.futures
import os
import sys
import time

import pytest

try:
    from cuflash import toolchain as tc
except ImportError:  # running from a checkout without installing the package
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from cuflash import toolchain as tc

ARCHS = ("sm_80", "sm_90a")


def _opts(arch: str, *extra: str) -> list[str]:
    return [f"-arch={arch}", "-Xptxas=-v", "-std=c++17",
            *(f"-I{d}" for d in tc.cuda_include_dirs()), *extra]


SCALE_SRC = r"""
#include <cuda_fp16.h>
#include <cuda_bf16.h>

template <typename T, int N>
__global__ void scale(T* __restrict__ out, const T* __restrict__ in, float s, int n) {
    const int base = (blockIdx.x * blockDim.x + threadIdx.x) * N;
#pragma unroll
    for (int k = 0; k < N; ++k) {
        const int i = base + k;
        if (i < n) out[i] = static_cast<T>(static_cast<float>(in[i]) * s);
    }
}
"""
SCALE_EXPRS = ("scale<__half, 4>", "scale<__nv_bfloat16, 2>")


# --------------------------------------------------------------------------- tools


def test_tools_are_found():
    lib = tc.nvrtc_library()
    assert os.path.exists(lib)
    major, minor = tc.nvrtc_version()
    assert major >= 12 and minor >= 0
    dirs = tc.cuda_include_dirs()
    assert dirs, "pip nvidia-cuda-runtime-cu12 headers should be found"
    for d in dirs:
        assert os.path.isfile(os.path.join(d, "cuda_fp16.h"))
    assert any(os.path.isfile(os.path.join(d, "cuda_bf16.h")) for d in dirs)
    nvd = tc.nvdisasm_path()
    assert os.path.isfile(nvd) and os.access(nvd, os.X_OK)


def test_toolchain_error_is_runtime_error():
    assert issubclass(tc.ToolchainError, RuntimeError)


# ------------------------------------------------------------------ template kernel


@pytest.mark.parametrize("arch", ARCHS)
def test_compile_template_instantiations(arch):
    t0 = time.perf_counter()
    prog = tc.compile_cubin(SCALE_SRC, name="scale.cu", options=_opts(arch),
                            name_expressions=SCALE_EXPRS)
    elapsed = time.perf_counter() - t0
    assert elapsed < 60
    assert isinstance(prog, tc.CompiledProgram)
    assert prog.cubin[:4] == b"\x7fELF"

    # lowered names map back to the name expressions
    assert set(prog.lowered_names) == set(SCALE_EXPRS)
    half_name = prog.lowered_names["scale<__half, 4>"]
    bf16_name = prog.lowered_names["scale<__nv_bfloat16, 2>"]
    assert half_name.startswith("_Z5scaleI6__halfLi4E")
    assert bf16_name.startswith("_Z5scaleI13__nv_bfloat16Li2E")

    # ptxas' -v report is in the log and parses for both entry functions
    assert "ptxas" in prog.log and f"for '{arch}'" in prog.log
    report = tc.parse_ptxas_report(prog.log)
    assert set(report) == {half_name, bf16_name}
    for res in report.values():
        assert isinstance(res, tc.FunctionResources)
        assert res.registers > 0
        assert res.spill_stores == 0 and res.spill_loads == 0
        assert res.stack_frame == 0
        assert res.shared_static == 0

    # SASS of both functions
    hist = tc.sass_opcode_histogram(prog.cubin)
    assert set(hist) == {half_name, bf16_name}
    for counts in hist.values():
        assert isinstance(counts, collections.Counter)
        assert counts["EXIT"] >= 1
        assert counts["LDG"] >= 1 and counts["STG"] >= 1
        assert counts["LDL"] == 0 and counts["STL"] == 0
        # mnemonics carry neither predicates nor modifiers
        assert all("." not in op and "@" not in op for op in counts)


def test_headers_mapping_and_shared_memory():
    headers = {"cuflash_test_tile.h": "#pragma once\nconstexpr int kTile = 256;\n"}
    src = r"""
#include "cuflash_test_tile.h"
__global__ void reverse_tile(float* out) {
    __shared__ float buf[kTile];
    buf[threadIdx.x] = out[threadIdx.x];
    __syncthreads();
    out[threadIdx.x] = buf[kTile - 1 - threadIdx.x];
}
"""
    prog = tc.compile_cubin(src, name="tile.cu", options=_opts("sm_80"),
                            name_expressions=("reverse_tile",), headers=headers)
    fn = prog.lowered_names["reverse_tile"]
    res = tc.parse_ptxas_report(prog.log)[fn]
    assert res.shared_static == 256 * 4
    assert res.barriers == 1
    assert res.constant.get(0, 0) > 0  # sm_80 reports "N bytes cmem[0]"
    hist = tc.sass_opcode_histogram(prog.cubin)[fn]
    assert hist["STS"] >= 1 and hist["LDS"] >= 1 and hist["BAR"] >= 1


# ------------------------------------------------------------- Hopper: wgmma/HGMMA

WGMMA_SRC = r"""
// NVRTC has no C++ standard library headers: no <cstdint>, so plain types.
extern "C" __global__ void __launch_bounds__(128)
wgmma_m64n8k16(float* out, unsigned long long desc_a, unsigned long long desc_b) {
    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
    asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %6, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 "
        "{%0, %1, %2, %3}, %4, %5, p, 1, 1, 0, 0;\n"
        "}\n"
        : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
        : "l"(desc_a), "l"(desc_b), "r"(1));
    asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
    asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory");
    float* o = out + 4 * threadIdx.x;
    o[0] = d0; o[1] = d1; o[2] = d2; o[3] = d3;
}
"""


def test_hopper_wgmma_shows_hgmma():
    prog = tc.compile_cubin(WGMMA_SRC, name="wgmma.cu", options=_opts("sm_90a"))
    report = tc.parse_ptxas_report(prog.log)
    assert "wgmma_m64n8k16" in report
    assert report["wgmma_m64n8k16"].registers > 0
    hist = tc.sass_opcode_histogram(prog.cubin)
    assert hist["wgmma_m64n8k16"]["HGMMA"] >= 1
    assert hist["wgmma_m64n8k16"]["EXIT"] >= 1


# --------------------------------------------------------------- spills / local mem

LOCAL_ARRAY_SRC = r"""
extern "C" __global__ void local_array(float* out, const int* idx) {
    float a[256];
    for (int i = 0; i < 256; ++i) a[i] = out[i] * i;
    out[threadIdx.x] = a[idx[threadIdx.x]];   // dynamic index: lives in local memory
}
"""

PRESSURE_SRC = r"""
extern "C" __global__ void pressure(float* out, const float* in) {
    float v[32];
#pragma unroll
    for (int i = 0; i < 32; ++i) v[i] = in[threadIdx.x + i * 128];
    float s = 0.f;
#pragma unroll
    for (int j = 1; j < 8; ++j)
#pragma unroll
        for (int i = 0; i < 32; ++i) s += v[i] * v[(i + j) & 31];
    out[threadIdx.x] = s;
}
"""


@pytest.mark.parametrize("arch", ARCHS)
def test_local_array_detected(arch):
    prog = tc.compile_cubin(LOCAL_ARRAY_SRC, name="local.cu", options=_opts(arch))
    res = tc.parse_ptxas_report(prog.log)["local_array"]
    assert res.stack_frame >= 256 * 4
    hist = tc.sass_opcode_histogram(prog.cubin)["local_array"]
    assert hist["LDL"] + hist["STL"] > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_register_spills_detected(arch):
    prog = tc.compile_cubin(PRESSURE_SRC, name="pressure.cu",
                            options=_opts(arch, "-maxrregcount=24"))
    res = tc.parse_ptxas_report(prog.log)["pressure"]
    assert res.registers <= 24
    assert res.spill_stores > 0 and res.spill_loads > 0
    assert res.stack_frame > 0
    hist = tc.sass_opcode_histogram(prog.cubin)["pressure"]
    assert hist["STL"] > 0 and hist["LDL"] > 0


# ------------------------------------------------------------------------- errors


def test_compile_error_carries_log():
    src = "__global__ void broken(float* p) { p[0] = undeclared_identifier_xyz; }\n"
    with pytest.raises(tc.ToolchainError) as ei:
        tc.compile_cubin(src, name="broken.cu", options=_opts("sm_80"))
    msg = str(ei.value)
    assert "undeclared_identifier_xyz" in msg
    assert "broken.cu" in msg
    assert "undeclared_identifier_xyz" in ei.value.log


def test_virtual_arch_gives_no_cubin_error():
    with pytest.raises(tc.ToolchainError, match="real architecture"):
        tc.compile_cubin("__global__ void k() {}", name="k.cu",
                         options=["-arch=compute_80"])


def test_bad_name_expression_fails():
    with pytest.raises(tc.ToolchainError):
        tc.compile_cubin(SCALE_SRC, name="scale.cu", options=_opts("sm_80"),
                         name_expressions=("scale<no_such_type, 4>",))


def test_nvdisasm_error_is_toolchain_error():
    with pytest.raises(tc.ToolchainError, match="nvdisasm"):
        tc.sass_opcode_histogram(b"this is not an ELF file")


# ------------------------------------------------------------------------ threads


def test_parallel_compiles():
    jobs = [(arch, n) for arch in ARCHS for n in (1, 2, 4, 8)]

    def one(job):
        arch, n = job
        expr = f"scale<float, {n}>"
        prog = tc.compile_cubin(SCALE_SRC, name=f"scale_{n}.cu", options=_opts(arch),
                                name_expressions=(expr,))
        fn = prog.lowered_names[expr]
        return job, fn, tc.parse_ptxas_report(prog.log)[fn], f"for '{arch}'" in prog.log

    with concurrent.futures.ThreadPoolExecutor(max_workers=4) as ex:
        results = list(ex.map(one, jobs))
    for (arch, n), fn, res, right_arch in results:
        assert fn.startswith(f"_Z5scaleIfLi{n}E")
        assert res.registers > 0 and res.spill_stores == 0
        assert right_arch


# ------------------------------------------------------------------ pure parsers

PTXAS_LOG = """\
ptxas info    : Overriding maximum register limit 256 for '_Z3fooPf' with  168 of maxrregcount option
ptxas warning : Local memory used for function '_Z3fooPf', size of stack frame: 16 bytes
ptxas warning : Registers are spilled to local memory in function '_Z3fooPf', 8 bytes spill stores, 12 bytes spill loads
ptxas info    : 0 bytes gmem
ptxas info    : Compiling entry function '_Z3fooPf' for 'sm_90a'
ptxas info    : Function properties for _Z3fooPf
ptxas         .     16 bytes stack frame, 8 bytes spill stores, 12 bytes spill loads
ptxas info    : Used 168 registers, used 1 barriers, 16 bytes cumulative stack size, 49152 bytes smem
ptxas info    : Compile time = 3.1 ms
ptxas info    : Compiling entry function 'bar' for 'sm_80'
ptxas info    : Function properties for bar
ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
ptxas info    : Used 10 registers, 376 bytes cmem[0], 8 bytes cmem[2]
ptxas info    : Function properties for _Z6helperf
ptxas         .     32 bytes stack frame, 4 bytes spill stores, 4 bytes spill loads
"""


def test_parse_ptxas_report_formats():
    rep = tc.parse_ptxas_report(PTXAS_LOG)
    assert set(rep) == {"_Z3fooPf", "bar"}  # device function _Z6helperf left out
    foo = rep["_Z3fooPf"]
    assert (foo.registers, foo.stack_frame, foo.spill_stores, foo.spill_loads) == (168, 16, 8, 12)
    assert foo.shared_static == 49152 and foo.constant == {} and foo.barriers == 1
    bar = rep["bar"]
    assert bar.registers == 10 and bar.constant == {0: 376, 2: 8}
    assert bar.shared_static == 0 and bar.spill_stores == 0
    assert tc.parse_ptxas_report("") == {}


SASS_TEXT = """\
\t.headerflags\t@"EF_CUDA_SM90 EF_CUDA_VIRTUAL_SM(EF_CUDA_SM90)"
//--------------------- .text._Z3fooPf --------------------------
\t.section\t.text._Z3fooPf,"ax",@progbits
\t.align\t128
.text._Z3fooPf:
        .global         _Z3fooPf
_Z3fooPf:
        /*0000*/                   LDC R1, c[0x0][0x28] ;
        /*0010*/                   HMMA.16816.F32 R4, R8, R12, R4 ;
        /*0020*/              @!P0 HMMA.16816.F32.BF16 R4, R8, R12, R4 ;
        /*0030*/               @P1 LDSM.16.M88.4 R8, [R2] ;
        /*0040*/              @!PT LDS.U.128 R8, [R2] ;
        /*0050*/              @UP0 BRA `(.L_x_1) ;
.L_x_1:
        /*0060*/                   EXIT ;
        /*0070*/                   BRA `(.L_x_2);
        /*0080*/                   NOP;
//--------------------- .nv.constant0._Z3fooPf --------------------------
\t.section\t.nv.constant0._Z3fooPf,"a",@progbits
        /*0000*/ \t.byte\t0x00, 0x00
//--------------------- .text.bar --------------------------
\t.section\t.text.bar,"ax",@progbits
        /*0000*/                   HGMMA.64x8x16.F32 gdesc[UR4], RZ, !UPT ;
        /*0010*/                   EXIT ;
"""


def test_parse_sass_opcodes():
    hist = tc.parse_sass_opcodes(SASS_TEXT)
    assert set(hist) == {"_Z3fooPf", "bar"}
    assert hist["_Z3fooPf"] == collections.Counter(
        {"LDC": 1, "HMMA": 2, "LDSM": 1, "LDS": 1, "BRA": 2, "EXIT": 1, "NOP": 1})
    assert hist["bar"] == collections.Counter({"HGMMA": 1, "EXIT": 1})


def test_parse_gmma_span_opcodes():
    text = SASS_TEXT + """//--------------------- .text.loop --------------------------
\t.section\t.text.loop,"ax",@progbits
        /*0000*/                   R2UR UR4, R2 ;
        /*0010*/                   HGMMA.64x64x16.F32 R24, gdesc[UR4], RZ, !UPT ;
        /*0020*/                   R2UR UR6, R3 ;
        /*0030*/              @!P0 QGMMA.64x64x32.F32.E4M3.E4M3 R24, gdesc[UR4], R24 ;
        /*0040*/                   R2UR UR8, R4 ;
        /*0050*/                   EXIT ;
"""
    spans = tc.parse_gmma_span_opcodes(text)
    assert set(spans) == {"bar", "loop"}  # _Z3fooPf has no wgmma
    assert spans["bar"] == collections.Counter({"HGMMA": 1})
    assert spans["loop"] == collections.Counter({"HGMMA": 1, "R2UR": 1, "QGMMA": 1})


# ------------------------------------------------------ Ampere: mma/ldmatrix/cp.async

AMPERE_SRC = r"""
extern "C" __global__ void __launch_bounds__(32)
mma_m16n8k16(float* out, const unsigned* gin) {
    __shared__ __align__(128) unsigned smem[256];
    unsigned saddr = static_cast<unsigned>(__cvta_generic_to_shared(smem + 4 * threadIdx.x));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n"
                 :: "r"(saddr), "l"(gin + 4 * threadIdx.x) : "memory");
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncwarp();
    unsigned a0, a1, a2, a3, b0, b1;
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(a0), "=r"(a1), "=r"(a2), "=r"(a3) : "r"(saddr));
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
                 : "=r"(b0), "=r"(b1) : "r"(saddr));
    float d0 = 0.f, d1 = 0.f, d2 = 0.f, d3 = 0.f;
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                 "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
                 : "+f"(d0), "+f"(d1), "+f"(d2), "+f"(d3)
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
    float* o = out + 4 * threadIdx.x;
    o[0] = d0; o[1] = d1; o[2] = d2; o[3] = d3;
}
"""


@pytest.mark.parametrize("arch", ARCHS)
def test_ampere_tensor_core_path_shows_hmma_ldsm_ldgsts(arch):
    prog = tc.compile_cubin(AMPERE_SRC, name="mma.cu", options=_opts(arch))
    hist = tc.sass_opcode_histogram(prog.cubin)["mma_m16n8k16"]
    assert hist["HMMA"] >= 1
    assert hist["LDSM"] >= 2
    assert hist["LDGSTS"] >= 1
    assert hist["LDL"] == 0 and hist["STL"] == 0
