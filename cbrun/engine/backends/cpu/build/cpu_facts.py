"""What the running CPU is: its feature flags and model name, read in one place.

The flags key the kernel build (build/kernel_build.py: -march=native bakes them into
the library) and show in `cbrun info` and the bench report beside the model name.
"""

from __future__ import annotations

import platform


def cpu_flags() -> str:
    """The CPU's feature flags, sorted (Linux /proc/cpuinfo; elsewhere the machine and processor names).

    -march=native bakes these into the library: a build for AVX-512 loaded on
    an AVX2-only CPU dies of SIGILL with no message, so they key the cache.
    """
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith(("flags", "Features")):
                    return " ".join(sorted(line.split(":", 1)[1].split()))
    except OSError:
        pass
    return f"{platform.machine()} {platform.processor()}"


def cpu_model() -> str:
    """The CPU's model name (Linux /proc/cpuinfo; elsewhere the processor name, empty when the platform has none).

    Beside `cpu_flags` so that `cbrun info` and the bench report read the CPU in one place.
    """
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()
