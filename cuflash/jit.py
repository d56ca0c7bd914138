"""From a kernel variant to a loaded function: sources, compile options, caches.

Convention: every family is one C++ `__global__` template in `cuda_src/`; a variant is an
instantiation named through NVRTC name expressions (`cuflash::bwd_preprocess<cuflash::half_t, 128, ...>`).
The program compiled for it is just `#include "<family source>"`, so one spelling of the kernel
serves every variant, on a GPU (cupy.RawModule) and offline (NVRTC through ctypes, for the
resource and SASS report of `python -m cuflash kernels`). The options are the same on both paths.

Caches: loaded functions per (variant, arch, device) in this process; CuPy's disk cache across
processes. CuPy's disk-cache key hashes the source string and the options but not the headers an
`#include` pulls in, so the options carry a hash of every file in cuda_src/: editing a header
can never serve a stale binary.
"""
from __future__ import annotations

import hashlib
import threading
from functools import lru_cache
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


@lru_cache(maxsize=None)
def source_dir() -> Path:
    """cuda_src/: inside the installed package (cuflash/cuda_src), or at the top of a checkout."""
    for candidate in (_PACKAGE_DIR / "cuda_src", _PACKAGE_DIR.parent / "cuda_src"):
        if (candidate / "common").is_dir():
            return candidate
    raise FileNotFoundError(f"cuflash's CUDA sources (cuda_src/) are missing: looked in {_PACKAGE_DIR / 'cuda_src'} "
                            f"and {_PACKAGE_DIR.parent / 'cuda_src'}; reinstall cuflash")


@lru_cache(maxsize=None)
def source_hash() -> str:
    """sha256 over the relative path and contents of every .cu/.cuh file in cuda_src/."""
    h = hashlib.sha256()
    root = source_dir()
    for path in sorted(p for p in root.rglob("*") if p.suffix in (".cu", ".cuh")):
        h.update(str(path.relative_to(root)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def arch_for(compute_capability: tuple[int, int]) -> str:
    """The arch a GPU's kernels are compiled for: sm_90a on Hopper (wgmma, setmaxnreg are only
    legal there), the plain sm_XY elsewhere."""
    major, minor = compute_capability
    return "sm_90a" if (major, minor) == (9, 0) else f"sm_{major}{minor}"


def compute_capability_of(arch: str) -> tuple[int, int]:
    """'sm_90a' -> (9, 0), 'sm_86' -> (8, 6), 'sm_100a' -> (10, 0)."""
    digits = arch.removeprefix("sm_").rstrip("af")
    if not arch.startswith("sm_") or not digits.isdigit() or len(digits) < 2:
        raise ValueError(f"arch must look like sm_80, sm_86, sm_89 or sm_90a; got {arch!r}")
    return int(digits[:-1]), int(digits[-1])


def program_source(variant) -> str:
    return f'#include "{variant.source}"\n'


def compile_options(arch: str) -> tuple[str, ...]:
    # -ftz=true: CuPy adds it to every RawModule; named here so the offline compile matches.
    return ("-std=c++17", f"-arch={arch}", "-ftz=true", f"-I{source_dir()}",
            f"-DCUFLASH_SOURCE_HASH=0x{source_hash()[:16]}")


# ----------------------------------------------------------------------------- on a GPU (CuPy)

@lru_cache(maxsize=None)
def device_properties(device_index: int) -> dict:
    """CUDA's device properties of GPU `device_index` (queried once per process)."""
    import cupy

    return cupy.cuda.runtime.getDeviceProperties(device_index)


def device_compute_capability(device_index: int) -> tuple[int, int]:
    props = device_properties(device_index)
    return int(props["major"]), int(props["minor"])


class CompileError(RuntimeError):
    """NVRTC rejected a variant: the message names it and carries the whole log, which is also
    written to a file (its path in the message) for a bug report."""

    def __init__(self, variant, arch: str, log: str):
        import tempfile

        path = Path(tempfile.gettempdir()) / f"cuflash-compile-{hashlib.sha1(variant.uri.encode()).hexdigest()[:12]}.log"
        path.write_text(f"{variant.uri}\narch {arch}\noptions {' '.join(compile_options(arch))}\n\n{log}\n")
        self.log_path = path
        super().__init__(f"cuflash could not compile {variant.uri} for {arch} (log: {path}; reproduce offline with "
                         f"`python -m cuflash kernels --arch {arch} --family {variant.family}`):\n{log}")


_functions: dict[tuple, object] = {}
_lock = threading.Lock()


def get_function(variant, device_index: int):
    """The loaded kernel for `variant` on GPU `device_index`, compiled on first use."""
    function = _functions.get((variant, device_index))  # the hot path: one dict lookup
    if function is not None:
        return function
    import cupy

    with _lock, cupy.cuda.Device(device_index):
        function = _functions.get((variant, device_index))
        if function is None:
            arch = arch_for(device_compute_capability(device_index))
            try:
                module = cupy.RawModule(code=program_source(variant), options=compile_options(arch),
                                        name_expressions=[variant.name_expression])
                function = module.get_function(variant.name_expression)
                function.compile()  # compile and load now, not at the first launch
            except cupy.cuda.compiler.CompileException as e:
                raise CompileError(variant, arch, e.get_message()) from None
            # Without opting in, a launch may ask for 48 KiB less the kernel's static shared memory
            if variant.dynamic_shared_bytes:
                function.max_dynamic_shared_size_bytes = variant.dynamic_shared_bytes
            _functions[(variant, device_index)] = function
        return function


# ----------------------------------------------------------------------------- offline (no GPU)


def offline_report(arch: str, variants, jobs: int = 2) -> list[dict]:
    """Compile each variant for `arch` with NVRTC (no GPU needed) and read back ptxas' own -v
    report and the SASS opcode histogram (nvdisasm). One dict per variant."""
    from concurrent.futures import ThreadPoolExecutor

    from . import toolchain

    options = (*compile_options(arch), "-Xptxas=-v")

    def one(variant) -> dict:
        program = toolchain.compile_cubin(program_source(variant), name=f"{variant.family}_instance.cu", options=options,
                                          name_expressions=[variant.name_expression])
        mangled = program.lowered_names[variant.name_expression]
        resources = toolchain.parse_ptxas_report(program.log)[mangled]
        sass = toolchain.disassemble(program.cubin)
        opcodes = toolchain.parse_sass_opcodes(sass)[mangled]
        gmma_span = toolchain.parse_gmma_span_opcodes(sass).get(mangled, {})
        return dict(
            uri=variant.uri,
            family=variant.family,
            arch=arch,
            name_expression=variant.name_expression,
            registers=resources.registers,
            spill_store_bytes=resources.spill_stores,
            spill_load_bytes=resources.spill_loads,
            stack_frame_bytes=resources.stack_frame,
            static_shared_bytes=resources.shared_static,
            dynamic_shared_bytes=variant.dynamic_shared_bytes,
            local_memory_instructions=opcodes.get("LDL", 0) + opcodes.get("STL", 0),
            # ptxas' numbered notes, e.g. C7515 "wgmma.mma_async instructions are serialized"
            ptxas_notes=sorted({line.split(")", 1)[0].split("(")[-1] for line in program.log.splitlines()
                                if "(C7" in line}),
            sass_opcodes=dict(sorted(opcodes.items(), key=lambda kv: (-kv[1], kv[0]))),
            # from the first wgmma to the last (Hopper kernels' main loops): R2UR there is a value
            # ptxas did not keep uniform, moved to a uniform register before a wgmma or mbarrier op
            r2ur_between_gmmas=gmma_span.get("R2UR", 0),
        )

    with ThreadPoolExecutor(max_workers=jobs) as pool:
        return list(pool.map(one, variants))
