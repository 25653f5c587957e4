"""This process's memory, in the words a run summary and `cbrun info` use: weights held and peak RSS.

Peak RSS is the kernel's high-water mark of the resident set (file pages of a
memory-mapped checkpoint included), what `/usr/bin/time -v` reports; it is
the figure that says whether a model fits a machine.
"""

from __future__ import annotations

import resource
import sys


def peak_rss_bytes() -> int:
    """The process's peak resident set so far (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


def format_bytes(count: float) -> str:
    """1234567890 -> '1.23 GB' (decimal units, as model sizes are quoted)."""
    for unit in ("B", "KB", "MB", "GB"):
        if abs(count) < 1000 or unit == "GB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.2f} {unit}"
        count /= 1000
    return f"{count:.2f} GB"
