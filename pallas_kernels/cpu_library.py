"""jaxspec's CPU kernels as one library: the row matmul (cpu_rows.cc, `row_matmul.py`) and the row attention
(cpu_attention.cc, `row_attention.py`), sharing cpu_common.h (vectors, threads): XLA FFI custom calls (`jax.ffi`)
that give each row the same bits at any row count, by construction, where XLA:CPU's own dots and reductions do not.

How they are built. Compiled together on first use with the machine's C++ compiler (`$CXX`, else c++/g++/clang++)
against `jax.ffi.include_dir()`, for this machine's processor (-march=native) and without FMA contraction, into
$XDG_CACHE_HOME/jaxspec/kernels/ keyed by the sources, compiler, flags, jaxlib version and processor. Where no
compiler works, `available()` is False (`unavailable_reason()` says why) and the target keeps XLA's one-row tiles
and its jax.numpy attention. JAXSPEC_CPU_ROW_KERNEL=off turns both off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import sys
from pathlib import Path

import jax

ENV_VAR = "JAXSPEC_CPU_ROW_KERNEL"
SOURCES = (Path(__file__).with_name("cpu_rows.cc"), Path(__file__).with_name("cpu_attention.cc"))
HEADERS = (Path(__file__).with_name("cpu_common.h"),)  # what the sources include: part of the build's key
FLAGS = ("-O3", "-std=c++17", "-shared", "-fPIC", "-ffp-contract=off", "-fno-fast-math")
TARGETS = {  # XLA FFI target name -> the library's handler symbol
    "jaxspec_row_matmul": "JaxspecRowMatmul",  # float32 panels
    "jaxspec_row_matmul_bf16": "JaxspecRowMatmulBF16",  # bfloat16 panels
    "jaxspec_row_matmul_s8": "JaxspecRowMatmulS8",  # int8 panels
    "jaxspec_row_attention": "JaxspecRowAttention",  # float32 caches
    "jaxspec_row_attention_bf16": "JaxspecRowAttentionBF16",  # bfloat16 caches
}


def enabled() -> bool:
    """Whether the user left the kernels on (JAXSPEC_CPU_ROW_KERNEL is not 'off' / '0')."""
    return os.environ.get(ENV_VAR, "").strip().lower() not in ("off", "0", "false", "no")


def available() -> bool:
    """Whether the kernels are built and registered with XLA in this process (building them on first call); False
    when turned off or when they cannot be built here (`unavailable_reason`)."""
    return enabled() and _load()[0]


def unavailable_reason() -> str | None:
    """Why `available()` is False, in one line; None when it is True."""
    if not enabled():
        return f"{ENV_VAR}=off"
    ok, reason = _load()
    return None if ok else reason


@functools.cache
def _load() -> tuple[bool, str]:
    try:
        library = build()
    except BuildError as e:
        return False, str(e)
    lib = ctypes.cdll.LoadLibrary(str(library))
    for target, symbol in TARGETS.items():
        jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(lib, symbol)), platform="cpu")
    return True, ""


class BuildError(RuntimeError):
    """The kernels' sources could not be compiled here (no compiler, or the compiler refused them)."""


def sources_digest() -> str:
    """A digest of the kernels' sources: what a timing of them depends on beyond the machine and the software
    versions (automatic speculation's stored step costs, `step_cost_store.cost_key`, are timed again when it moves)."""
    return hashlib.sha256("\n".join(source.read_text() for source in SOURCES + HEADERS).encode()).hexdigest()[:16]


def build(cache_dir: Path | None = None, extra_flags: tuple[str, ...] = ()) -> Path:
    """The compiled kernel library for this machine, compiled first if the cache does not hold it yet. One
    process compiles at a time (a file lock); the library is written to a temporary name and renamed, so a reader
    never sees half of it. `extra_flags` (e.g. -mno-avx512f) build it for a narrower instruction set: the tests
    check every register tiling this machine can run."""
    from filelock import FileLock  # jaxspec's dependency; imported here so that the module imports without it

    compiler = _compiler()
    if compiler is None:
        raise BuildError("no C++ compiler found ($CXX, c++, g++ or clang++)")
    version = _run([compiler, "--version"]).splitlines()[0] if _run([compiler, "--version"]) else compiler
    flags = FLAGS + _arch_flags(compiler) + tuple(extra_flags)
    key = hashlib.sha256("\n".join([
        *(source.read_text() for source in SOURCES + HEADERS), compiler, version, " ".join(flags), jax.__version__,
        _jaxlib_version(), _processor(),
    ]).encode()).hexdigest()[:16]
    cache_dir = cache_dir or _cache_dir()
    out = cache_dir / f"cpu_kernels-{key}.so"
    if out.exists():
        return out
    cache_dir.mkdir(parents=True, exist_ok=True)
    with FileLock(str(out) + ".lock"):
        if out.exists():
            return out
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        cmd = [compiler, *flags, "-I", jax.ffi.include_dir(), *map(str, SOURCES), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            tmp.unlink(missing_ok=True)
            first = next((line for line in proc.stderr.splitlines() if "error" in line), proc.stderr.strip()[:200])
            names = " and ".join(source.name for source in SOURCES)
            raise BuildError(f"{Path(compiler).name} could not compile {names}: {first}")
        os.replace(tmp, out)
    return out


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return shutil.which(name)
    return None


@functools.cache
def _arch_flags(compiler: str) -> tuple[str, ...]:
    """-march=native where the compiler takes it (GCC and Clang on x86 and Arm Linux), else nothing."""
    probe = subprocess.run([compiler, "-march=native", "-x", "c++", "-fsyntax-only", "-"], input="", text=True,
                           capture_output=True)
    return ("-march=native",) if probe.returncode == 0 else ()


def _run(cmd: list[str]) -> str:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return ""


def _jaxlib_version() -> str:
    import jaxlib

    return jaxlib.__version__


def _processor() -> str:
    """What -march=native compiles for: the CPU's model and feature flags (Linux), else what platform says."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return f"{platform.machine()} {platform.processor()}"
    lines = [line for line in info.splitlines() if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return f"{platform.machine()} " + " ".join(sorted(set(lines)))


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxspec" / "kernels"


if __name__ == "__main__":  # python -m pallas_kernels.cpu_library: build it and say where, or why not
    print(build() if available() else f"unavailable: {unavailable_reason()}", file=sys.stderr)
