"""The compiled CPU kernels' build: the compiler, its flags, and one library per build key in the user cache.

The kernels are plain C with OpenMP and vector extensions (csrc/), built with
the local C compiler (-march=native) in a few seconds and loaded through
ctypes (kernels/loader.py). The library's name includes a digest of the
sources and headers, the flags, the compiler's version and the CPU's feature
flags (build/cpu_facts.py), so a library built on another CPU (a shared home
directory) is never loaded where it could stop the process on an illegal
instruction. Builds are atomic: concurrent builders never see half a file.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cbrun.engine.backends.cpu.build.cpu_facts import cpu_flags
from cbrun.user_cache import cache_dir

log = logging.getLogger("cbrun.engine")

_SOURCES = Path(__file__).parents[1] / "csrc"  # *.c built into one library, with their shared header
# CBRUN_KERNEL_MARCH builds for another target than this CPU (e.g. x86-64-v3: AVX2 only), for a cluster's
# lowest common ISA or to check that an AVX2 build gives the same bits here
_MARCH = os.environ.get("CBRUN_KERNEL_MARCH") or "native"
_FLAGS = ["-O3", f"-march={_MARCH}", "-ffp-contract=fast", "-fopenmp", "-shared", "-fPIC"]
# GCC's tuning for some CPUs (Zen: avoid-fma-max-bits) keeps reduction chains as a multiply and an add instead
# of a fused multiply-add, so a kernel's sums would round differently on an AMD and an Intel machine (measured:
# the fp32 attention differed between -march=znver3 and -march=sapphirerapids builds). Form FMAs everywhere.
_GCC_FLAGS = ["--param=avoid-fma-max-bits=0"]
# Reported, not fatal, at a user's build; tests/cpu_kernels/test_linear_methods.py builds every source with -Werror.
_WARNINGS = ["-Wall", "-Wextra", "-Wno-psabi"]


def cache_root() -> Path:
    """Where the libraries and the self-check results live (the user cache's kernels/)."""
    return cache_dir() / "kernels"


def sources() -> list[Path]:
    """The C sources built into the one library."""
    return sorted(_SOURCES.glob("*.c"))


def compiler() -> str:
    """The C compiler: $CC, else cc or gcc on PATH (raises without one)."""
    found = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if found is None:
        raise RuntimeError("no C compiler (cc/gcc) on PATH")
    return found


def _flags(compiler: str) -> list[str]:
    """The build's flags for this compiler. GCC gets its FMA-forming parameter; clang contracts only within a
    statement (-ffp-contract=on), since its "fast" fuses across statements and would change rotary's and the
    softmax's roundings (GCC's "fast" fuses within expressions, which is what the kernels are written for)."""
    if _is_gcc(compiler):
        return [*_FLAGS, *_GCC_FLAGS]
    return [flag if flag != "-ffp-contract=fast" else "-ffp-contract=on" for flag in _FLAGS]


@functools.cache
def _is_gcc(compiler: str) -> bool:
    """GCC (not clang, which also defines __GNUC__): its --version names the Free Software Foundation."""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return "Free Software Foundation" in out and "clang" not in out.lower()


def _compiler_version(compiler: str) -> str:
    """The compiler's own description of itself (`cc --version`'s first line)."""
    try:
        out = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return out.splitlines()[0] if out else "unknown"


def _digest(compiler: str, extra_flags: tuple[str, ...] = ()) -> str:
    """Names the build: every source and header, the flags, the compiler, the CPU and the platform."""
    content = hashlib.sha256()
    for path in sorted([*sources(), *_SOURCES.glob("*.h")]):
        content.update(path.name.encode() + path.read_bytes())
    content.update(" ".join(_flags(compiler)).encode() + sys.platform.encode())
    content.update(_compiler_version(compiler).encode() + cpu_flags().encode())
    if extra_flags:  # none: the default build's name, as before
        content.update(b"\0extra\0" + "\0".join(extra_flags).encode())
    return content.hexdigest()[:16]


def _compile(compiler: str, sources: list[Path], target: Path, extra_flags: tuple[str, ...] = ()) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        built = Path(scratch) / target.name
        result = subprocess.run(
            [compiler, *_flags(compiler), *_WARNINGS, *extra_flags, *map(str, sources), "-o", str(built), "-lm"],
            check=True,
            capture_output=True,
            text=True,
        )
        if result.stderr.strip():  # a compiler we have not seen warns: say so (tests build with -Werror)
            log.warning("the CPU kernels built with warnings:\n%s", result.stderr.strip()[-4000:])
        os.replace(built, target)  # atomic: concurrent builders never see half a file


def library(defines: tuple[str, ...] = ()) -> Path:
    """The library built with extra `-D` definitions (none: the default build), built first if this build key
    has none in the cache yet. Raises where it cannot be built (no compiler, a failed build)."""
    cc = compiler()
    flags = tuple(f"-D{define}" for define in defines)
    target = cache_root() / f"cbrun_cpu-{_digest(cc, flags)}.so"
    if not target.exists():
        _compile(cc, sources(), target, flags)
    return target
