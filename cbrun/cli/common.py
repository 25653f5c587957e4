"""What the commands share: the usage-error type, model and engine options, model loading.

`generate` and `bench` declare their model and engine options with the
aliases below (`page_size: PageSizeOption = None`, ...), turn them into an
EngineConfig with `build_engine_config` and load the model with `load_model`,
so both commands spell, document and check them the same way.
"""

from __future__ import annotations

import logging
import os
from enum import Enum
from typing import Annotated, Optional

import typer

EXIT_OK, EXIT_ROWS_FAILED, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


class CliError(Exception):
    """A problem the user can fix: printed as one line, never a traceback."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code


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


class Scheduler(str, Enum):
    fifo = "fifo"
    prefill_first = "prefill-first"


MODEL_PANEL, ENGINE_PANEL = "Model", "Engine"
DEFAULT_MODEL = "smollm2-135m"

ModelOption = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="HF model dir, hub id (downloaded unless cached or HF_HUB_OFFLINE=1), .gguf file or alias.",
        rich_help_panel=MODEL_PANEL,
    ),
]
RevisionOption = Annotated[
    Optional[str],
    typer.Option(help="Branch, tag or commit of a hub --model.", show_default=False, rich_help_panel=MODEL_PANEL),
]
DtypeOption = Annotated[
    Dtype,
    typer.Option(
        help="Weights and compute dtype (auto: bf16 on CPUs with bf16 dot products, AVX512-BF16 or AMX, whose "
        "kernel passes its self-check; else fp32; bf16 or fp16 on GPU). `cbrun info` shows the choice.",
        rich_help_panel=MODEL_PANEL,
    ),
]
DeviceOption = Annotated[Device, typer.Option(help="Where to run.", rich_help_panel=MODEL_PANEL)]
PageSizeOption = Annotated[
    Optional[int], typer.Option(help="KV-cache page size in tokens.", rich_help_panel=ENGINE_PANEL)
]
NumBlocksOption = Annotated[
    Optional[int], typer.Option(help="KV-cache pages (default: sized from free memory).", rich_help_panel=ENGINE_PANEL)
]
MaxBatchTokensOption = Annotated[
    Optional[int], typer.Option(help="Query tokens per forward pass.", rich_help_panel=ENGINE_PANEL)
]
MaxRequestsPerBatchOption = Annotated[
    Optional[int], typer.Option(help="Sequences per forward pass.", rich_help_panel=ENGINE_PANEL)
]
SchedulerOption = Annotated[
    Optional[Scheduler], typer.Option(help="Step ordering (default fifo).", rich_help_panel=ENGINE_PANEL)
]
SafetyMarginOption = Annotated[
    Optional[float],
    typer.Option(help="Free-cache fraction below which no new prefill starts.", rich_help_panel=ENGINE_PANEL),
]
NoPrefixCacheOption = Annotated[
    bool, typer.Option("--no-prefix-cache", help="Disable prefix caching.", rich_help_panel=ENGINE_PANEL)
]
CpuOffloadOption = Annotated[
    Optional[float],
    typer.Option(help="CPU swap pool (GiB) for preempted requests; 0 recomputes them.", rich_help_panel=ENGINE_PANEL),
]
MaxMemoryPercentOption = Annotated[
    Optional[float],
    typer.Option(help="Share of free memory for the KV cache (0.5 or 50).", rich_help_panel=ENGINE_PANEL),
]
KernelsOption = Annotated[
    Optional[Kernels],
    typer.Option(
        help="CPU linear kernels: portable (default; the same bits on every CPU) or fastest (may take a method "
        "whose bits are this CPU's own, e.g. oneDNN on fixed blocks, when a trial shows it faster; still "
        "batch-invariant).",
        show_default=False,
        rich_help_panel=ENGINE_PANEL,
    ),
]


def build_engine_config(
    *,
    page_size: int | None = None,
    num_blocks: int | None = None,
    max_batch_tokens: int | None = None,
    max_requests_per_batch: int | None = None,
    scheduler: str | None = None,
    safety_margin: float | None = None,
    no_prefix_cache: bool = False,
    cpu_offload_gb: float | None = None,
    max_memory_percent: float | None = None,
    kernels: str | None = None,
):
    """EngineConfig from command-line values; None keeps EngineConfig's default.

    max_memory_percent accepts a fraction (0.5) or a percentage (50).
    Raises CliError naming the bad value.
    """
    from cbrun.engine import ConfigError, EngineConfig

    if max_memory_percent is not None and max_memory_percent > 1:
        max_memory_percent /= 100.0
    given = {
        "page_size": page_size,
        "num_blocks": num_blocks,
        "max_batch_tokens": max_batch_tokens,
        "max_requests_per_batch": max_requests_per_batch,
        "scheduler": scheduler.value if isinstance(scheduler, Enum) else scheduler,
        "safety_margin": safety_margin,
        "allow_block_sharing": False if no_prefix_cache else None,
        "cpu_offload_space": cpu_offload_gb,
        "max_memory_percent": max_memory_percent,
        "kernels": kernels.value if isinstance(kernels, Enum) else kernels,
    }
    try:
        return EngineConfig(**{name: value for name, value in given.items() if value is not None})
    except ConfigError as exc:
        raise CliError(f"invalid engine option: {exc}") from None


def load_model(spec: str, dtype: Dtype | str, device: Device | str, revision: str | None = None):
    """`cbrun.models.load_model`, with every failure turned into a one-line CliError."""
    from cbrun.models import ModelLoadError, load_model as load

    try:
        return load(
            spec, dtype=getattr(dtype, "value", dtype), device=getattr(device, "value", device), revision=revision
        )
    except ModelLoadError as exc:
        raise CliError(str(exc)) from None
    except (OSError, ValueError, RuntimeError, ImportError) as exc:
        raise CliError(f"cannot load model {spec!r}: {first_line(exc)}") from None


def first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def quiet_libraries(quiet: bool) -> None:
    """Library warnings would drown our output; with --quiet, no progress bars or logs either."""
    try:
        import transformers

        transformers.logging.set_verbosity_error()
        if quiet:
            transformers.logging.disable_progress_bar()
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    if quiet:
        logging.getLogger().setLevel(logging.ERROR)
        os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
        os.environ["HF_HUB_DISABLE_PROGRESS_BARS"] = "1"
        from huggingface_hub.utils import disable_progress_bars

        disable_progress_bars()  # the variable above is read only when huggingface_hub is first imported


def check_input_output(opts) -> None:
    """The INPUT / --dataset / OUTPUT / --window checks generate and score share (on their options object).

    With --dataset the one positional argument is OUTPUT, so it moves over.
    """
    if opts.dataset is not None and opts.output is None:
        opts.input, opts.output = None, opts.input
    elif opts.dataset is not None and opts.input is not None:
        raise CliError("give either INPUT or --dataset, not both")
    if opts.output is None:
        raise CliError("missing OUTPUT (a .jsonl or .parquet path, or - for stdout)")
    if opts.window < 1:
        raise CliError(f"--window must be at least 1, got {opts.window}")
