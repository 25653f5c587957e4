"""The fixed choices of command-line options, as the enums typer shows and checks.

A leaf module: it imports nothing of cbrun, so the option bundles
(options.py, generate_options.py) and the helpers that read their values
(common.py) can all import it without importing each other.
"""

from __future__ import annotations

from enum import Enum


class Dtype(str, Enum):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class Kernels(str, Enum):
    portable = "portable"
    fastest = "fastest"


class Quantization(str, Enum):
    int8 = "int8"


class Scheduler(str, Enum):
    fifo = "fifo"
    prefill_first = "prefill-first"


class FormatName(str, Enum):
    """`cbrun generate --format`: which output format the rows are written in."""

    auto = "auto"
    cbrun = "cbrun"
    openai = "openai"
