"""What the commands share: the usage-error type, choice enums, engine options -> EngineConfig."""

from __future__ import annotations

from enum import Enum

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


class Scheduler(str, Enum):
    fifo = "fifo"
    prefill_first = "prefill-first"


def build_engine_config(*, page_size: int | None = None, num_blocks: int | None = None,
                        max_batch_tokens: int | None = None, max_requests_per_batch: int | None = None,
                        scheduler: str | None = None, safety_margin: float | None = None,
                        no_prefix_cache: bool = False, cpu_offload_gb: float | None = None,
                        max_memory_percent: float | None = None):
    """EngineConfig from command-line values; None keeps EngineConfig's default.

    max_memory_percent accepts a fraction (0.5) or a percentage (50).
    Raises CliError naming the bad value.
    """
    from cbrun.engine import ConfigError, EngineConfig

    if max_memory_percent is not None and max_memory_percent > 1:
        max_memory_percent /= 100.0
    given = {
        "page_size": page_size, "num_blocks": num_blocks, "max_batch_tokens": max_batch_tokens,
        "max_requests_per_batch": max_requests_per_batch,
        "scheduler": scheduler.value if isinstance(scheduler, Enum) else scheduler,
        "safety_margin": safety_margin, "allow_block_sharing": False if no_prefix_cache else None,
        "cpu_offload_space": cpu_offload_gb, "max_memory_percent": max_memory_percent,
    }
    try:
        return EngineConfig(**{name: value for name, value in given.items() if value is not None})
    except ConfigError as exc:
        raise CliError(f"invalid engine option: {exc}") from None
