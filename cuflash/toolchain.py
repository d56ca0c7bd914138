"""Offline CUDA toolchain: compile cuflash kernels and read what the compiler did,
on a machine with no GPU and no CUDA driver.

Why this exists
---------------
cuflash's kernels are C++ templates in ``cuda_src/`` that are compiled at run
time by NVRTC (through ``cupy.RawModule``) on a GPU machine.  Whether a kernel
variant is any good depends on things the compiler decides: how many registers
it uses, whether it spills, how much static shared memory it takes, and which
instructions it ends up with (``HMMA``/``HGMMA`` tensor-core ops, ``LDSM``,
``LDGSTS``, or ``LDL``/``STL`` local-memory traffic).  This module lets anyone
see those facts on a CPU-only machine:

* :func:`compile_cubin` drives ``libnvrtc`` directly through :mod:`ctypes`
  (no cupy, no driver) and asks for a CUBIN for a *real* architecture
  (``-arch=sm_80``, ``-arch=sm_90a`` ...), so ptxas runs inside NVRTC.
* :func:`parse_ptxas_report` reads ptxas' own ``-v`` report from the NVRTC log
  (pass ``-Xptxas=-v``).  Nothing is estimated: the numbers are the compiler's.
* :func:`sass_opcode_histogram` runs ``nvdisasm`` on the CUBIN and counts the
  SASS opcodes of every kernel; :func:`parse_gmma_span_opcodes` counts those
  from a kernel's first wgmma to its last (its main loops, on Hopper).

Where the tools come from (all pip wheels, installed by ``pip install "cuflash[test]"``)
-----------------------------------------------------------------------------------
* ``libnvrtc.so.12`` (+ ``libnvrtc-builtins``): ``nvidia-cuda-nvrtc-cu12``,
  at ``site-packages/nvidia/cuda_nvrtc/lib``; the CUDA 13 layout
  ``site-packages/nvidia/cu13/lib/libnvrtc.so.13`` is used too if present.
* ``cuda_fp16.h`` / ``cuda_bf16.h`` and friends: ``nvidia-cuda-runtime-cu12``,
  at ``site-packages/nvidia/cuda_runtime/include`` (or ``nvidia/cu13/include``).
* ``nvdisasm``: ``nvidia-cuda-nvdisasm``, at ``site-packages/nvidia/cu13/bin``
  (or ``nvidia/cuda_nvdisasm/bin``).

A local CUDA toolkit (``CUDA_PATH`` / ``CUDA_HOME``) or the system library
path / ``PATH`` are used as fall-backs.

This module never imports cupy and never touches a GPU or the CUDA driver.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import dataclasses
import glob
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
from typing import Mapping, Sequence

__all__ = [
    "ToolchainError",
    "nvrtc_library",
    "nvrtc_version",
    "cuda_include_dirs",
    "nvdisasm_path",
    "CompiledProgram",
    "compile_cubin",
    "FunctionResources",
    "parse_ptxas_report",
    "disassemble",
    "parse_sass_sections",
    "parse_sass_opcodes",
    "parse_gmma_span_opcodes",
    "sass_opcode_histogram",
]

_INSTALL_HINT = 'pip install "cuflash[test]"'


class ToolchainError(RuntimeError):
    """A tool is missing, or NVRTC/nvdisasm failed.

    For a missing tool the message names the pip package that provides it; for
    a failed compile it carries NVRTC's whole log (also in :attr:`log`).
    """

    def __init__(self, message: str, log: str = ""):
        super().__init__(message)
        self.log = log


# --------------------------------------------------------------------------
# Locating the tools
# --------------------------------------------------------------------------


def _nvidia_dirs() -> list[str]:
    """The ``site-packages/nvidia`` directories (a namespace package) of pip wheels."""
    try:
        spec = importlib.util.find_spec("nvidia")
    except (ImportError, ValueError):
        spec = None
    dirs: list[str] = []
    if spec is not None and spec.submodule_search_locations:
        dirs.extend(str(p) for p in spec.submodule_search_locations)
    # Also look at sys.path directly, in case "nvidia" is shadowed by something.
    for entry in sys.path:
        cand = os.path.join(entry or os.getcwd(), "nvidia")
        if os.path.isdir(cand) and cand not in dirs:
            dirs.append(cand)
    return dirs


def _toolkit_roots() -> list[str]:
    roots = []
    for var in ("CUDA_PATH", "CUDA_HOME"):
        val = os.environ.get(var)
        if val and os.path.isdir(val) and val not in roots:
            roots.append(val)
    return roots


_IS_WINDOWS = sys.platform.startswith("win")


def _nvrtc_candidates() -> list[str]:
    cands: list[str] = []
    for nv in _nvidia_dirs():
        if _IS_WINDOWS:
            for sub in ("cuda_nvrtc/bin", "cu13/bin"):
                cands.extend(sorted(glob.glob(os.path.join(nv, sub, "nvrtc64_*.dll"))))
        else:
            cands.append(os.path.join(nv, "cuda_nvrtc", "lib", "libnvrtc.so.12"))
            cands.append(os.path.join(nv, "cu13", "lib", "libnvrtc.so.13"))
    for root in _toolkit_roots():
        if _IS_WINDOWS:
            cands.extend(sorted(glob.glob(os.path.join(root, "bin", "nvrtc64_*.dll"))))
        else:
            for lib in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib")):
                d = os.path.join(root, lib)
                cands.append(os.path.join(d, "libnvrtc.so"))
                cands.extend(sorted(glob.glob(os.path.join(d, "libnvrtc.so.*[0-9]")), reverse=True))
    return cands


def nvrtc_library() -> str:
    """Path (or loader name) of the libnvrtc to load.

    Order: pip wheels (``nvidia/cuda_nvrtc/lib/libnvrtc.so.12``, then the CUDA 13
    layout ``nvidia/cu13/lib/libnvrtc.so.13``), then ``$CUDA_PATH``/``$CUDA_HOME``
    ``lib64``, then :func:`ctypes.util.find_library`.
    """
    for cand in _nvrtc_candidates():
        if os.path.isfile(cand):
            return cand
    found = ctypes.util.find_library("nvrtc")
    if found:
        return found
    raise ToolchainError(
        "libnvrtc (the CUDA runtime compiler) was not found in the pip wheels, "
        "$CUDA_PATH/$CUDA_HOME or the system library path. Install it with "
        f"`{_INSTALL_HINT}` (which installs nvidia-cuda-nvrtc-cu12, "
        "nvidia-cuda-runtime-cu12 and nvidia-cuda-nvdisasm), or "
        "`pip install nvidia-cuda-nvrtc-cu12`."
    )


def cuda_include_dirs() -> list[str]:
    """Directories holding ``cuda_fp16.h`` / ``cuda_bf16.h``; possibly empty.

    pip ``nvidia/cuda_runtime/include`` (and ``nvidia/cu13/include`` if present),
    then ``$CUDA_PATH/include`` / ``$CUDA_HOME/include``.  When the libnvrtc in
    use is the CUDA 13 one, the CUDA 13 headers are put first so headers and
    compiler match.
    """
    cu12: list[str] = []
    cu13: list[str] = []
    for nv in _nvidia_dirs():
        cu12.append(os.path.join(nv, "cuda_runtime", "include"))
        cu13.append(os.path.join(nv, "cu13", "include"))
    toolkit = [os.path.join(r, "include") for r in _toolkit_roots()]

    prefer13 = False
    try:
        lib = nvrtc_library()
        prefer13 = os.path.basename(lib).startswith("libnvrtc.so.13") or (
            os.sep + "cu13" + os.sep in lib
        )
    except ToolchainError:
        pass
    ordered = (cu13 + cu12 if prefer13 else cu12 + cu13) + toolkit

    out: list[str] = []
    for d in ordered:
        if d not in out and os.path.isfile(os.path.join(d, "cuda_fp16.h")):
            out.append(d)
    return out


def nvdisasm_path() -> str:
    """Path of ``nvdisasm``: pip ``nvidia/cu13/bin`` or ``nvidia/cuda_nvdisasm/bin``,
    then ``PATH``, then ``$CUDA_PATH/bin`` / ``$CUDA_HOME/bin``."""
    exe = "nvdisasm.exe" if _IS_WINDOWS else "nvdisasm"
    cands = []
    for nv in _nvidia_dirs():
        cands.append(os.path.join(nv, "cu13", "bin", exe))
        cands.append(os.path.join(nv, "cuda_nvdisasm", "bin", exe))
    for cand in cands:
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    found = shutil.which("nvdisasm")
    if found:
        return found
    for root in _toolkit_roots():
        cand = os.path.join(root, "bin", exe)
        if os.path.isfile(cand) and os.access(cand, os.X_OK):
            return cand
    raise ToolchainError(
        "nvdisasm (the CUDA SASS disassembler) was not found in the pip wheels, "
        "on PATH or in $CUDA_PATH/$CUDA_HOME/bin. Install it with "
        f"`{_INSTALL_HINT}` (which installs nvidia-cuda-nvdisasm), or "
        "`pip install nvidia-cuda-nvdisasm`."
    )


# --------------------------------------------------------------------------
# ctypes binding to libnvrtc
# --------------------------------------------------------------------------

_lib_lock = threading.Lock()
_lib: ctypes.CDLL | None = None

_c_prog = ctypes.c_void_p  # nvrtcProgram is an opaque pointer
_c_str_array = ctypes.POINTER(ctypes.c_char_p)


def _load_nvrtc() -> ctypes.CDLL:
    global _lib
    if _lib is not None:
        return _lib
    with _lib_lock:
        if _lib is not None:
            return _lib
        path = nvrtc_library()
        mode = getattr(os, "RTLD_GLOBAL", 0) | getattr(os, "RTLD_NOW", 0)
        try:
            lib = ctypes.CDLL(path, mode=mode)
        except OSError as exc:
            # libnvrtc finds its builtins library through RUNPATH=$ORIGIN; if a
            # build lacks it, preload the builtins sitting next to it and retry.
            lib = None
            d = os.path.dirname(path)
            for b in sorted(glob.glob(os.path.join(d, "libnvrtc-builtins.so*"))):
                if ".alt." in b:
                    continue
                try:
                    ctypes.CDLL(b, mode=mode)
                except OSError:
                    continue
                try:
                    lib = ctypes.CDLL(path, mode=mode)
                    break
                except OSError:
                    pass
            if lib is None:
                raise ToolchainError(
                    f"could not load libnvrtc from {path!r}: {exc}. "
                    f"Reinstall it with `{_INSTALL_HINT}` "
                    "(nvidia-cuda-nvrtc-cu12)."
                ) from exc

        i = ctypes.c_int
        sz = ctypes.POINTER(ctypes.c_size_t)
        pp = ctypes.POINTER(_c_prog)
        sigs = {
            "nvrtcVersion": (i, [ctypes.POINTER(i), ctypes.POINTER(i)]),
            "nvrtcGetErrorString": (ctypes.c_char_p, [i]),
            "nvrtcCreateProgram": (
                i,
                [pp, ctypes.c_char_p, ctypes.c_char_p, i, _c_str_array, _c_str_array],
            ),
            "nvrtcDestroyProgram": (i, [pp]),
            "nvrtcAddNameExpression": (i, [_c_prog, ctypes.c_char_p]),
            "nvrtcCompileProgram": (i, [_c_prog, i, _c_str_array]),
            "nvrtcGetProgramLogSize": (i, [_c_prog, sz]),
            "nvrtcGetProgramLog": (i, [_c_prog, ctypes.c_char_p]),
            "nvrtcGetCUBINSize": (i, [_c_prog, sz]),
            "nvrtcGetCUBIN": (i, [_c_prog, ctypes.c_char_p]),
            "nvrtcGetLoweredName": (
                i,
                [_c_prog, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)],
            ),
        }
        for fname, (restype, argtypes) in sigs.items():
            try:
                fn = getattr(lib, fname)
            except AttributeError as exc:
                raise ToolchainError(
                    f"{path!r} has no symbol {fname}; it is too old to produce "
                    f"CUBINs. Install a current one with `{_INSTALL_HINT}` "
                    "(nvidia-cuda-nvrtc-cu12)."
                ) from exc
            fn.restype = restype
            fn.argtypes = argtypes
        _lib = lib
        return lib


def _error_string(lib: ctypes.CDLL, code: int) -> str:
    try:
        s = lib.nvrtcGetErrorString(code)
        return s.decode("utf-8", "replace") if s else f"NVRTC error {code}"
    except Exception:  # pragma: no cover - defensive
        return f"NVRTC error {code}"


def _check(lib: ctypes.CDLL, code: int, what: str, log: str = "") -> None:
    if code != 0:
        msg = f"{what} failed: {_error_string(lib, code)} ({code})"
        if log:
            msg += "\n" + log
        raise ToolchainError(msg, log)


def nvrtc_version() -> tuple[int, int]:
    """(major, minor) of the loaded libnvrtc, e.g. ``(12, 9)``."""
    lib = _load_nvrtc()
    major, minor = ctypes.c_int(), ctypes.c_int()
    _check(lib, lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor)), "nvrtcVersion")
    return (major.value, minor.value)


def _str_array(items: Sequence[bytes]):
    arr = (ctypes.c_char_p * max(len(items), 1))(*items)
    return ctypes.cast(arr, _c_str_array), arr


@dataclasses.dataclass(frozen=True)
class CompiledProgram:
    cubin: bytes
    #: NVRTC's log; holds ptxas' -v report when -Xptxas=-v is passed.
    log: str
    #: name expression -> mangled (lowered) name
    lowered_names: dict[str, str]


def _program_log(lib: ctypes.CDLL, prog) -> str:
    size = ctypes.c_size_t()
    if lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size)) != 0 or size.value <= 1:
        return ""
    buf = ctypes.create_string_buffer(size.value)
    if lib.nvrtcGetProgramLog(prog, buf) != 0:
        return ""
    return buf.value.decode("utf-8", "replace")


_ARCH_RE = re.compile(r"(?:-arch|--gpu-architecture)[= ]\s*(\S+)")


def compile_cubin(
    source: str,
    *,
    name: str,
    options: Sequence[str],
    name_expressions: Sequence[str] = (),
    headers: Mapping[str, str] | None = None,
) -> CompiledProgram:
    """Compile ``source`` with NVRTC to a CUBIN.

    ``options`` must name a real architecture (``-arch=sm_80``, ``-arch=sm_90a``),
    so that NVRTC runs ptxas and yields a CUBIN; add ``-Xptxas=-v`` to get ptxas'
    resource report in :attr:`CompiledProgram.log`.  ``name_expressions`` (e.g.
    ``"scale<__half, 4>"``) instantiate templates and are mapped to their
    mangled names.  ``headers`` maps include names to their source text.

    Raises :class:`ToolchainError` carrying the whole NVRTC log on failure.
    Each call uses its own program, so calls may run in parallel threads
    (ctypes releases the GIL during the NVRTC calls).
    """
    lib = _load_nvrtc()
    headers = dict(headers or {})
    h_src = [v.encode("utf-8") for v in headers.values()]
    h_names = [k.encode("utf-8") for k in headers.keys()]
    h_src_p, _keep1 = _str_array(h_src)
    h_names_p, _keep2 = _str_array(h_names)
    opts = [str(o).encode("utf-8") for o in options]
    opts_p, _keep3 = _str_array(opts)

    prog = _c_prog()
    _check(
        lib,
        lib.nvrtcCreateProgram(
            ctypes.byref(prog),
            source.encode("utf-8"),
            name.encode("utf-8"),
            len(headers),
            h_src_p if headers else None,
            h_names_p if headers else None,
        ),
        "nvrtcCreateProgram",
    )
    try:
        for expr in name_expressions:
            _check(
                lib,
                lib.nvrtcAddNameExpression(prog, expr.encode("utf-8")),
                f"nvrtcAddNameExpression({expr!r})",
            )
        rc = lib.nvrtcCompileProgram(prog, len(opts), opts_p)
        log = _program_log(lib, prog)
        if rc != 0:
            raise ToolchainError(
                f"NVRTC failed to compile {name!r} ({_error_string(lib, rc)}) "
                f"with options {list(options)}:\n{log}",
                log,
            )

        lowered: dict[str, str] = {}
        for expr in name_expressions:
            out = ctypes.c_char_p()
            _check(
                lib,
                lib.nvrtcGetLoweredName(prog, expr.encode("utf-8"), ctypes.byref(out)),
                f"nvrtcGetLoweredName({expr!r})",
                log,
            )
            # The string belongs to the program: copy it before destroying.
            lowered[expr] = (out.value or b"").decode("utf-8")

        size = ctypes.c_size_t()
        _check(lib, lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "nvrtcGetCUBINSize", log)
        if size.value == 0:
            archs = _ARCH_RE.findall(" ".join(str(o) for o in options))
            raise ToolchainError(
                "NVRTC produced no CUBIN: the options must name a real architecture "
                f"such as -arch=sm_80 or -arch=sm_90a (got arch {archs or 'none'}).",
                log,
            )
        buf = ctypes.create_string_buffer(size.value)
        _check(lib, lib.nvrtcGetCUBIN(prog, buf), "nvrtcGetCUBIN", log)
        return CompiledProgram(cubin=buf.raw, log=log, lowered_names=lowered)
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


# --------------------------------------------------------------------------
# ptxas -v report
# --------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class FunctionResources:
    registers: int
    stack_frame: int  # bytes
    spill_stores: int  # bytes
    spill_loads: int  # bytes
    shared_static: int  # bytes ("smem" in ptxas' report)
    constant: dict  # bank -> bytes, from "cmem[N]" entries (may be empty)
    barriers: int = 0  # named barriers ("used N barriers"), when reported


_COMPILING_RE = re.compile(r"Compiling\s+(entry\s+)?function\s+'([^']+)'")
_PROPS_RE = re.compile(r"Function properties for\s+'?([^'\s]+)'?")
_STACK_RE = re.compile(r"(\d+)\s+bytes\s+stack\s+frame", re.I)
_SPST_RE = re.compile(r"(\d+)\s+bytes\s+spill\s+stores", re.I)
_SPLD_RE = re.compile(r"(\d+)\s+bytes\s+spill\s+loads", re.I)
_QUOTED_FN_RE = re.compile(r"function\s+'([^']+)'")
_USED_RE = re.compile(r"\bUsed\s+(\d+)\s+registers?(.*)$", re.I)
_BARRIERS_RE = re.compile(r"used\s+(\d+)\s+barriers?", re.I)
_SMEM_RE = re.compile(r"(\d+)\s+bytes\s+smem", re.I)
_CMEM_RE = re.compile(r"(\d+)\s+bytes\s+cmem\s*\[\s*(\d+)\s*\]", re.I)


def parse_ptxas_report(log: str) -> dict[str, FunctionResources]:
    """Parse ptxas' ``-v`` report (as found in NVRTC's log) per entry function.

    The report looks like::

        ptxas info    : Compiling entry function '_Z5scaleIfLi2EEvPT_PKS0_fi' for 'sm_80'
        ptxas info    : Function properties for _Z5scaleIfLi2EEvPT_PKS0_fi
        ptxas         .     0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads
        ptxas info    : Used 10 registers, used 0 barriers, 376 bytes cmem[0]

    "smem"/"cmem"/"barriers" items appear only when relevant or for some
    architectures.  "Function properties" blocks of non-entry (device)
    functions are read but only entry functions are returned, keyed by
    mangled name.
    """
    entries: list[str] = []
    props: dict[str, dict] = {}  # name -> stack/spills
    used: dict[str, dict] = {}  # entry name -> registers/smem/cmem/barriers
    compiling: str | None = None  # function ptxas is compiling ("Used" refers to it)
    props_of: str | None = None  # function the next "stack frame" line refers to

    for raw in log.splitlines():
        line = raw.strip()
        if not line:
            continue
        m = _COMPILING_RE.search(line)
        if m:
            compiling = m.group(2)
            if m.group(1) and compiling not in entries:
                entries.append(compiling)
            continue
        m = _PROPS_RE.search(line)
        if m:
            props_of = m.group(1)
            continue
        if "stack frame" in line or "spill" in line:
            # "ptxas . N bytes stack frame, ..." after "Function properties for X",
            # or a warning naming its function (--warn-on-spills):
            # "Registers are spilled to local memory in function 'X', N bytes spill stores, ..."
            mq = _QUOTED_FN_RE.search(line)
            target = mq.group(1) if mq else (props_of or compiling)
            if target is None:
                continue
            rec = props.setdefault(target, {})
            for key, rx in (("stack_frame", _STACK_RE), ("spill_stores", _SPST_RE),
                            ("spill_loads", _SPLD_RE)):
                mm = rx.search(line)
                if mm:
                    rec[key] = int(mm.group(1))
            continue
        m = _USED_RE.search(line)
        if m and compiling is not None:
            rest = m.group(2)
            rec = {"registers": int(m.group(1))}
            mm = _BARRIERS_RE.search(rest)
            if mm:
                rec["barriers"] = int(mm.group(1))
            mm = _SMEM_RE.search(rest)
            if mm:
                rec["shared_static"] = int(mm.group(1))
            rec["constant"] = {int(b): int(n) for n, b in _CMEM_RE.findall(rest)}
            used[compiling] = rec
            continue

    result: dict[str, FunctionResources] = {}
    for fn in entries:
        u = used.get(fn, {})
        p = props.get(fn, {})
        result[fn] = FunctionResources(
            registers=u.get("registers", 0),
            stack_frame=p.get("stack_frame", 0),
            spill_stores=p.get("spill_stores", 0),
            spill_loads=p.get("spill_loads", 0),
            shared_static=u.get("shared_static", 0),
            constant=dict(u.get("constant", {})),
            barriers=u.get("barriers", 0),
        )
    return result


# --------------------------------------------------------------------------
# SASS via nvdisasm
# --------------------------------------------------------------------------


def disassemble(cubin: bytes, extra_args: Sequence[str] = ()) -> str:
    """Run ``nvdisasm -c`` (code sections only) on ``cubin`` and return its text."""
    exe = nvdisasm_path()
    fd, path = tempfile.mkstemp(suffix=".cubin", prefix="cuflash_")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(cubin)
        proc = subprocess.run(
            [exe, "-c", *extra_args, path],
            capture_output=True,
            text=True,
            errors="replace",
        )
        if proc.returncode != 0 and "-ndf" not in extra_args:
            # Dataflow analysis "may occasionally fail" (nvdisasm --help); it
            # only adds branch labels, so retry without it.
            proc = subprocess.run(
                [exe, "-c", "-ndf", *extra_args, path],
                capture_output=True,
                text=True,
                errors="replace",
            )
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass
    if proc.returncode != 0:
        raise ToolchainError(
            f"nvdisasm ({exe}) failed with exit code {proc.returncode}:\n"
            f"{proc.stderr.strip()}",
            proc.stderr,
        )
    return proc.stdout


_SECTION_RE = re.compile(r"^\s*\.section\s+([^\s,]+)")
_INSTR_RE = re.compile(r"^\s*/\*[0-9a-fA-F]+\*/\s*([^;]*);")
_PRED_RE = re.compile(r"^@!?U?P[A-Z0-9]+\s*")
_MNEMONIC_RE = re.compile(r"^[A-Z][A-Z0-9_]*$")


def parse_sass_opcodes(text: str) -> dict[str, collections.Counter]:
    """Count opcode mnemonics per ``.text.<function>`` section of nvdisasm output.

    Instruction lines look like ``/*0040*/  @!P0 HMMA.16816.F32 R4, R8, R12, R4 ;``;
    the predicate and the modifiers are dropped (``HMMA``).  Device functions
    that ptxas placed in a kernel's section (not inlined, but called) count
    towards that kernel, as do the trailing ``BRA``-to-self and ``NOP`` padding.
    """
    return {name: collections.Counter(body) for name, body in parse_sass_sections(text).items()}


def sass_opcode_histogram(cubin: bytes) -> dict[str, collections.Counter]:
    """Per function (mangled name) -> Counter of SASS opcode mnemonics
    (``HMMA``, ``HGMMA``, ``LDSM``, ``LDGSTS``, ``LDL``, ``STL``, ``EXIT`` ...)."""
    return parse_sass_opcodes(disassemble(cubin))


def parse_gmma_span_opcodes(text: str) -> dict[str, collections.Counter]:
    """Per ``.text.<function>`` section of nvdisasm output, the opcode mnemonics from its first
    wgmma instruction (``HGMMA``, ``QGMMA``, ...) to its last: the main loops of a Hopper kernel,
    where, for example, each ``R2UR`` is a value moved into a uniform register before use.
    Functions without wgmma are left out."""
    spans: dict[str, collections.Counter] = {}
    for name, body in parse_sass_sections(text).items():
        gmma = [i for i, mnemonic in enumerate(body) if mnemonic.endswith("GMMA")]
        if gmma:
            spans[name] = collections.Counter(body[gmma[0]:gmma[-1] + 1])
    return spans


def parse_sass_sections(text: str) -> dict[str, list[str]]:
    """Per ``.text.<function>`` section of nvdisasm output, its opcode mnemonics in order."""
    sections: dict[str, list[str]] = {}
    current: list[str] | None = None
    for line in text.splitlines():
        m = _SECTION_RE.match(line)
        if m:
            sec = m.group(1)
            current = sections.setdefault(sec[len(".text."):], []) if sec.startswith(".text.") else None
            continue
        if current is None:
            continue
        m = _INSTR_RE.match(line)
        if not m:
            continue
        body = _PRED_RE.sub("", m.group(1).strip().lstrip("{").strip())
        if not body:
            continue
        mnemonic = body.split(None, 1)[0].split(".", 1)[0]
        if _MNEMONIC_RE.match(mnemonic):
            current.append(mnemonic)
    return sections
